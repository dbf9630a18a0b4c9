"""``--fim-data`` (megatron_fsdp/training/data/fim.py) against Megatron-LM's GPTFIMDataset
(megatron/training/datasets/fim_dataset.py at the pinned commit; megatron-core 0.16.1 does
not ship it, so its rules are written out here):

* the permutation, hand-checked on character tokens with a scripted generator: PSM/SPM
  layouts, the pieces between end-of-document tokens (empty ones dropped with their
  token, the last one always permuted), split-sample fragments, --fim-no-prefix, cutting
  and padding back to the sample length, and the exact sequence of numpy draws;
* the GPT-2 text codec: special tokens dropped on decode, matched verbatim on encode (the
  ``tokenizers`` library's rules when it is installed);
* the reading order: samples equal those of a Megatron-LM-like dataset (one RandomState
  on the dataset object) read through a real torch DataLoader with workers, per
  data-parallel rank, with a blend and a resumed start;
* the launcher: validation refusals, and build_datasets wrapping the GPT samples.

(Checked once, outside the suite: 2,848 samples of the shipped corpus, and DataLoader
reads with 0-3 workers, 1-3 ranks and a blend, equal Megatron-LM's own GPTFIMDataset
class run on megatron-core 0.16.1 with a HuggingFace-rules GPT-2 tokenizer, bit for bit.)
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_fsdp.training.args.arguments import ArgumentError, parse_args
from megatron_fsdp.training.data import build_datasets
from megatron_fsdp.training.data.fim import (
    FimConfig,
    FimSampleSource,
    FimTokenError,
    FimTokens,
    FimTransform,
    Gpt2TextCodec,
    LoaderLayout,
)
from megatron_fsdp.training.data.tokenizers import END_OF_TEXT, GPT2BPETokenizer

REPO = Path(__file__).resolve().parents[1]
FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]


# -- the permutation, by hand -------------------------------------------------------------------
class CharCodec:
    """One id per character (its code point); '#' is a special token that decoding drops."""

    def token_id(self, token: str) -> int:
        if len(token) != 1:
            raise FimTokenError(token)
        return ord(token)

    def decode(self, ids) -> str:
        return "".join(chr(int(i)) for i in ids if chr(int(i)) != "#")

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class ScriptedRng:
    """Returns planned draws and records each call (name and arguments)."""

    def __init__(self, *draws) -> None:
        self.draws, self.calls = list(draws), []

    def binomial(self, n, p):
        self.calls.append(("binomial", n, p))
        return self.draws.pop(0)

    def randint(self, low, high, size):
        self.calls.append(("randint", low, high, size))
        return np.array(self.draws.pop(0))


CHAR_TOKENS = FimTokens(prefix="P", middle="M", suffix="S", pad="_", eod="|")


def _fim(text: str, *draws, **config) -> tuple[str, list]:
    settings = dict(rate=0.5, spm_rate=0.25, tokens=CHAR_TOKENS)
    settings.update(config)
    transform = FimTransform(FimConfig(**settings), CharCodec())
    rng = ScriptedRng(*draws)
    out = transform(np.array([ord(c) for c in text]), rng)
    assert out.dtype == np.int64 and len(out) == len(text) and not rng.draws
    return "".join(chr(i) for i in out), rng.calls


B, B_SPM = ("binomial", 1, 0.5), ("binomial", 1, 0.25)


def test_psm_and_spm_layouts():
    # cut points 4 and 1, sorted: prefix 'a', middle 'bcd', suffix 'ef'; PSM; 9 tokens cut back to 6
    assert _fim("abcdef", 1, [4, 1], 0) == ("PaSefM", [B, ("randint", 0, 7, 2), B_SPM])
    # pieces between end-of-document tokens are permuted one by one: 'ab' as SPM (prefix 'a', suffix 'b'),
    # the rest not chosen
    assert _fim("ab|cdefgh", 1, [1, 1], 1, 0) == ("PSbMa|cde", [B, ("randint", 0, 3, 2), B_SPM, B])


def test_empty_pieces_vanish_and_short_samples_are_padded():
    # breaks at 0, 3, 4: the leading and the doubled '|' are dropped with their empty pieces;
    # '#' is a special token, so nothing shrinks until the permutation, here none: 5 tokens + 2 pads
    assert _fim("|ab||c#", 0, 0) == ("ab|c#__", [B, B])
    # the same, the last piece chosen: decoded 'c' (the '#' dropped), cut at 0 and 1, PSM
    assert _fim("|ab||c#", 0, 1, [1, 0], 0) == ("ab|PSMc", [B, B, ("randint", 0, 2, 2), B_SPM])


def test_the_piece_after_the_last_end_of_document_is_permuted_even_empty():
    # 'a####' decodes to 'a' -> PSaM (suffix 'a'); the empty last piece still draws and becomes P S M
    out, calls = _fim("a####|", 1, [0, 0], 0, 1, [0, 0], 1)
    assert out == "PSaM|P"  # 'PSaM|PSM' cut back to 6
    assert calls == [B, ("randint", 0, 2, 2), B_SPM, B, ("randint", 0, 1, 2), B_SPM]


def test_no_prefix_keeps_the_piece_without_drawing_cut_points():
    assert _fim("abcd", 1, no_prefix="ab") == ("abcd", [B])
    out, calls = _fim("xbcdef", 1, [0, 6], 0, no_prefix="ab")  # other text is permuted as usual
    assert out == "PSMxbc" and calls == [B, ("randint", 0, 7, 2), B_SPM]


def test_split_sample_fragments():
    frag = ("binomial", 1, 0.75)
    # the piece holds '/': one draw at --fim-rate, then each fragment at --fim-fragment-rate
    out, calls = _fim("ab/cdef", 1, 0, 1, [2, 2], 0, split_sample="/", fragment_rate=0.75)
    assert out == "ab/PcdS" and calls == [B, frag, frag, ("randint", 0, 5, 2), B_SPM]
    assert _fim("ab/cdef", 0, split_sample="/", fragment_rate=0.75) == ("ab/cdef", [B])  # not chosen: as it was
    # a piece without the split token is permuted as usual, at --fim-rate
    assert _fim("abcdef", 0, split_sample="/", fragment_rate=0.75) == ("abcdef", [B])


@pytest.mark.parametrize("config, message", [
    (dict(rate=0.0, spm_rate=0.5), r"--fim-rate=0.0 must be in \(0, 1\]"),
    (dict(rate=0.5, spm_rate=0.0), r"--fim-spm-rate=0.0 must be in \(0, 1\]"),
    (dict(rate=1.5, spm_rate=0.5), r"--fim-rate=1.5"),
    (dict(rate=0.5, spm_rate=0.5, split_sample="x"), "--fim-split-sample 'x' needs --fim-fragment-rate"),
    (dict(rate=0.5, spm_rate=0.5, fragment_rate=2.0), r"--fim-fragment-rate=2.0 must be a probability"),
])
def test_config_refusals(config, message):
    with pytest.raises(ValueError, match=message):
        FimConfig(**config)


# -- the GPT-2 codec --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fim_vocab(tmp_path_factory) -> Path:
    """data/bpe's vocabulary plus the four FIM tokens and an entry outside GPT-2's byte table."""
    vocab = json.loads((REPO / "data/bpe/vocab.json").read_text(encoding="utf-8"))
    for token in FIM_TOKENS + ["Ω€"]:
        vocab[token] = len(vocab)
    path = tmp_path_factory.mktemp("fim") / "vocab.json"
    path.write_text(json.dumps(vocab), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def gpt2(fim_vocab) -> GPT2BPETokenizer:
    return GPT2BPETokenizer(str(fim_vocab), str(REPO / "data/bpe/merges.txt"))


def test_gpt2_codec(gpt2):
    codec = Gpt2TextCodec(gpt2)
    eod, odd = gpt2.eod, gpt2.vocab["Ω€"]
    with pytest.raises(FimTokenError, match="'<fim_nope>' is not in the GPT-2 vocabulary"):
        codec.token_id("<fim_nope>")
    hello = gpt2.tokenize("Hello world, café")
    assert codec.decode([eod] + hello + [eod]) == "Hello world, café"  # the special token is left out
    assert codec.decode([odd, gpt2.vocab["<fim_prefix>"]]) == "Ω€<fim_prefix>"  # raw UTF-8 / plain entries
    assert codec.decode(gpt2.tokenize("é")[:1]) == "\ufffd"  # half a character: U+FFFD
    assert codec.encode(f"Hello{END_OF_TEXT}{END_OF_TEXT} world") == \
        gpt2.tokenize("Hello") + [eod, eod] + gpt2.tokenize(" world")
    tokenizers = pytest.importorskip("tokenizers")  # the library transformers' GPT-2 tokenizer runs on
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=dict(gpt2.vocab), merges=list(gpt2.merges)))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.add_special_tokens([tokenizers.AddedToken(END_OF_TEXT, special=True)])
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = [int(i) for i in rng.integers(0, len(gpt2.vocab), size=12)]
        tokens = [hf.id_to_token(i) for i in ids if hf.id_to_token(i) != END_OF_TEXT]
        assert codec.decode(ids) == hf.decoder.decode(tokens)
    for text in ("a<|endoftext|>b", "<|endoftext|> x <|endoftext|>", "no special here <|endo"):
        assert codec.encode(text) == hf.encode(text).ids


# -- Megatron-LM's reading order ----------------------------------------------------------------
class _Raw:
    """Base source: sample i is a deterministic token row with a few end-of-document tokens."""

    name = "train"

    def __init__(self, n: int, members: int = 1) -> None:
        rng = np.random.default_rng(3)
        self.rows = [np.where(rng.random(17) < 0.15, ord("|"), rng.integers(97, 123, size=17)) for _ in range(n)]
        self.members = members
        self.dataset = self

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        text = torch.from_numpy(self.rows[i].astype(np.int64))
        return {"dataset_id": self.member(i), "tokens": text[:-1], "labels": text[1:]}

    def member(self, i: int) -> int:
        return (i // 2) % self.members


class _MegatronLikeFim(torch.utils.data.Dataset):
    """What Megatron-LM's GPTFIMDataset does with randomness: one RandomState(seed) per dataset
    object (per blend member), advanced by every sample that copy draws."""

    def __init__(self, raw: _Raw, transform: FimTransform, seed: int) -> None:
        self.raw, self.transform = raw, transform
        self.rngs = [np.random.RandomState(seed) for _ in range(raw.members)]

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.transform(self.raw.rows[i], self.rngs[self.raw.member(i)]))


def _megatron_batches(start: int, rank: int, dp: int, mbs: int, count: int) -> list[list[int]]:
    """Megatron-LM's pretraining sampler: this rank's micro batches from ``start`` on."""
    return [[start + k * mbs * dp + rank * mbs + j for j in range(mbs)] for k in range(count)]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("rank, dp, mbs, workers, start, members", [
    (1, 2, 2, 2, 4, 1),  # two workers take turns; a resumed start
    (0, 2, 1, 3, 0, 2),  # three workers and a blend of two members
])
def test_reading_order_equals_a_dataloader_with_workers(rank, dp, mbs, workers, start, members):
    transform = FimTransform(FimConfig(rate=0.6, spm_rate=0.5, tokens=CHAR_TOKENS), CharCodec())
    raw = _Raw(64, members)
    batches = _megatron_batches(start, rank, dp, mbs, count=9)
    loader = torch.utils.data.DataLoader(_MegatronLikeFim(raw, transform, seed=5), batch_sampler=batches,
                                         num_workers=workers, collate_fn=lambda rows: rows)
    want = [row for rows in loader for row in rows]
    layout = LoaderLayout(dp_rank=rank, dp_size=dp, micro_batch_size=mbs, num_workers=workers)
    source = FimSampleSource(raw, transform, layout, seed=5)
    got = [source.sample(i) for rows in batches for i in rows]
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and len(got) == len(want) == 9 * mbs
    assert sum(not torch.equal(a, torch.from_numpy(raw.rows[i])) for a, i in zip(got, sum(batches, []))) > 3
    # A caller that skips samples gets the same later ones (the skipped ones are drawn for it).
    skipping = FimSampleSource(raw, transform, layout, seed=5)
    assert torch.equal(skipping.sample(batches[0][0]), got[0])
    assert torch.equal(skipping.sample(batches[-1][-1]), got[-1])


def test_out_of_order_samples_are_refused():
    transform = FimTransform(FimConfig(rate=0.6, spm_rate=0.5, tokens=CHAR_TOKENS), CharCodec())
    source = FimSampleSource(_Raw(32), transform, LoaderLayout(dp_rank=1, dp_size=2, micro_batch_size=2,
                                                                 num_workers=0), seed=5)
    first = source.sample(2)  # rank 1 reads 2, 3, 6, 7, ...
    assert torch.equal(source.sample(2), first)  # asking again for the last one is fine
    source.sample(6)
    with pytest.raises(RuntimeError, match="FIM train sample 3 asked for after later ones"):
        source.sample(3)
    with pytest.raises(RuntimeError, match="sample 8 is not one that data-parallel rank 1 reads"):
        source.sample(8)


# -- the launcher ------------------------------------------------------------------------------------
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--lr 1e-3 --micro-batch-size 1 --train-iters 4 --data-path data/corpus_text_document "
        "--merge-file data/bpe/merges.txt --split 90,10,0 --fim-data")


@pytest.mark.parametrize("extra, message", [
    ("--vocab-file data/bpe/vocab.json", "--fim-prefix-token '<fim_prefix>', --fim-middle-token '<fim_middle>', "
                                         "--fim-suffix-token '<fim_suffix>', --fim-pad-token '<fim_pad>' not in the "
                                         "vocabulary data/bpe/vocab.json. Megatron-LM's GPT-2 tokenizer would turn"),
    ("VOCAB --fim-split-sample '<nope>' --fim-fragment-rate 0.5", "--fim-split-sample '<nope>' not in the vocabulary"),
    ("VOCAB --fim-rate 0", "--fim-rate=0.0 must be in (0, 1]"),
    ("VOCAB --mock-data", "--fim-data with --mock-data: Megatron-LM refuses the pair"),
    ("VOCAB --tokenizer-type NullTokenizer --vocab-size 100", "--fim-data with --tokenizer-type NullTokenizer: "
                                                               "implemented for GPT2BPETokenizer only"),
])
def test_launcher_refusals(extra, message, fim_vocab):
    with pytest.raises(ArgumentError) as info:
        parse_args(shlex.split(f"{BASE} {extra}".replace("VOCAB", f"--vocab-file {fim_vocab}")), world_size=2)
    assert message in str(info.value)


def test_build_datasets_wraps_the_gpt_samples(fim_vocab, tmp_path, monkeypatch):
    from megatron_fsdp.training.data import builder

    # The native builder (the same samples as megatron-core's, tests/test_data_gpt.py) spares the import.
    monkeypatch.setattr(builder, "megatron_core_unavailable_reason", lambda: "native for this test")
    args = parse_args(shlex.split(f"{BASE} --vocab-file {fim_vocab} --fim-rate 1 --fim-spm-rate 1 --seed 9 "
                                  "--eval-micro-batch-size 2 --eval-global-batch-size 4 --num-workers 3 "
                                  f"--data-cache-path {tmp_path}"),
                      world_size=1)
    train, valid = build_datasets(args)
    assert isinstance(train, FimSampleSource) and isinstance(valid, FimSampleSource)
    assert (train.layout.micro_batch_size, valid.layout.micro_batch_size, train.layout.num_workers, train.seed) == \
        (1, 2, 3, 9)
    args.fim_data = False
    plain, _ = build_datasets(args)
    tokenizer = GPT2BPETokenizer(str(fim_vocab), str(REPO / "data/bpe/merges.txt"))
    prefix, suffix = tokenizer.vocab["<fim_prefix>"], tokenizer.vocab["<fim_suffix>"]
    for i in range(4):  # --fim-rate 1, --fim-spm-rate 1: every piece starts <fim_prefix> <fim_suffix>
        fim, raw = train.sample(i), plain.sample(i)
        assert fim.shape == raw.shape == (33,) and fim.dtype == torch.int64
        assert fim[:2].tolist() == [prefix, suffix] or int(raw[0]) == tokenizer.eod
