"""Fill-in-the-middle samples for ``--fim-data``: Megatron-LM's ``GPTFIMDataset``
(megatron/training/datasets/fim_dataset.py; not in megatron-core 0.16.1) over the GPT
samples this package builds.

[Note: FIM permutation] A GPT sample (``seq_length + 1`` tokens, the same as without FIM)
is cut at every ``--fim-eod-token``; each piece between two of them is permuted on its
own and the end-of-document tokens stay where they were. Megatron-LM's details, kept:

* a piece is only permuted when non-empty, and an empty one (two end-of-document tokens
  in a row, or one at position 0) is dropped together with its end-of-document token;
  the piece after the last end-of-document token is always permuted, empty or not (an
  empty one chosen for FIM becomes the three sentinels alone);
* with ``--fim-split-sample TOKEN`` a piece holding TOKEN is first chosen for FIM with
  probability ``--fim-rate``, then each fragment between TOKENs is permuted with
  probability ``--fim-fragment-rate`` (the same empty-fragment rule, TOKEN in place of
  end-of-document); a piece without TOKEN is permuted as below with ``--fim-rate``;
* permuting: with probability ``rate`` the tokens are decoded to text without special
  tokens; text starting with ``--fim-no-prefix`` stays as it was; otherwise two cut
  points are drawn among the ``len(text) + 1`` character positions (sorted), the three
  parts are encoded again, and with probability ``--fim-spm-rate`` the order is SPM
  ``<pre> <suf> suffix <mid> prefix middle``, else PSM ``<pre> prefix <suf> suffix <mid>
  middle``; an unpermuted piece keeps its original tokens;
* the result is cut back to the sample's length, or filled up with ``--fim-pad-token``.

Every choice is one draw of a ``numpy.random.RandomState(--seed)`` in this order:
``binomial(1, rate)``, then (if chosen and not skipped by the prefix rule) ``randint(0,
len + 1, size=2)`` and ``binomial(1, spm_rate)``; fragments add their ``binomial(1,
fim_rate)`` first.

[Note: FIM random streams] Megatron-LM's FIM dataset keeps that generator on the dataset
object, so a sample depends on every sample drawn before it from the same copy. Each
data-parallel rank builds its own datasets (train and validation apart, each member of a
blend apart, all seeded with ``--seed``), and with ``--num-workers W > 0`` each of the W
loader workers of a rank holds its own copy, reading the rank's micro batches in turn
(micro batch k of the run goes to worker k mod W; with 0 workers the rank's process
reads them all). A run that restarts (a resume) builds fresh copies. ``FimSampleSource``
keeps one generator per (blend member, worker) of its rank and serves samples in the
order the rank reads them, which is the order the training loop asks for them; it refuses
a sample asked for out of that order rather than give a different one.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from megatron_fsdp.training.data.tokenizers import END_OF_TEXT, GPT2BPETokenizer, TokenizerType, bytes_to_unicode


class FimTokenError(ValueError):
    """A FIM token the tokenizer's vocabulary lacks, or a tokenizer FIM cannot run with."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FimTokens:
    """The sentinel tokens (strings of the tokenizer's vocabulary), Megatron-LM's defaults."""

    prefix: str = "<fim_prefix>"
    """Starts every permuted piece."""
    middle: str = "<fim_middle>"
    """Precedes the middle part."""
    suffix: str = "<fim_suffix>"
    """Precedes the suffix part."""
    pad: str = "<fim_pad>"
    """Fills a sample that the permutation made shorter."""
    eod: str = END_OF_TEXT
    """Where a sample is cut into documents permuted one by one."""

    def named(self) -> dict[str, str]:
        return {f"--fim-{name}-token": value for name, value in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FimConfig:
    """``--fim-*``: how samples are permuted (see [Note: FIM permutation])."""

    rate: float
    """Probability that a piece (or a sample with split tokens) is permuted (``--fim-rate``)."""
    spm_rate: float
    """Probability of the SPM order over PSM (``--fim-spm-rate``)."""
    tokens: FimTokens = FimTokens()
    split_sample: Optional[str] = None
    """A token of the vocabulary: pieces holding it are permuted fragment by fragment (``--fim-split-sample``)."""
    fragment_rate: Optional[float] = None
    """Probability that each such fragment is permuted (``--fim-fragment-rate``)."""
    no_prefix: Optional[str] = None
    """Decoded text starting with this is never permuted (``--fim-no-prefix``)."""

    def __post_init__(self) -> None:
        # Megatron-LM asserts that both rates are set (truthy): 0 is refused there too.
        for flag, value in (("--fim-rate", self.rate), ("--fim-spm-rate", self.spm_rate)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{flag}={value} must be in (0, 1]: a probability, and Megatron-LM refuses 0 "
                                 "(it asserts the rate is set)")
        if self.fragment_rate is not None and not 0.0 <= self.fragment_rate <= 1.0:
            raise ValueError(f"--fim-fragment-rate={self.fragment_rate} must be a probability in [0, 1]")
        if self.split_sample is not None and self.fragment_rate is None:
            raise ValueError(f"--fim-split-sample {self.split_sample!r} needs --fim-fragment-rate (the probability "
                             "of permuting each fragment); Megatron-LM fails on the first sample holding the token "
                             "without it")

    @classmethod
    def from_args(cls, args) -> "FimConfig":
        tokens = FimTokens(prefix=args.fim_prefix_token, middle=args.fim_middle_token, suffix=args.fim_suffix_token,
                           pad=args.fim_pad_token, eod=args.fim_eod_token)
        return cls(rate=args.fim_rate, spm_rate=args.fim_spm_rate, tokens=tokens,
                   split_sample=args.fim_split_sample or None, fragment_rate=args.fim_fragment_rate,
                   no_prefix=args.fim_no_prefix)


# -- text <-> ids, as Megatron-LM's tokenizer library does it --------------------------------
class TextCodec(Protocol):
    """What the permutation needs from a tokenizer (Megatron-LM's ``tokenizer._tokenizer``)."""

    def token_id(self, token: str) -> int:
        """The id of a vocabulary entry; FimTokenError when there is none."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with the special tokens left out."""

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special tokens written in it become their ids."""


class Gpt2TextCodec:
    """GPT2BPETokenizer as Megatron-LM's HuggingFace GPT-2 tokenizer decodes and encodes for
    FIM: its one special token is ``<|endoftext|>``, dropped when decoding and matched
    verbatim in text when encoding (the rest of the text is byte-level BPE); a vocabulary
    entry made of characters outside GPT-2's byte table decodes to its own UTF-8 bytes, and
    invalid UTF-8 becomes U+FFFD (the ``tokenizers`` ByteLevel decoder's rules)."""

    def __init__(self, tokenizer: GPT2BPETokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self._special = {i for s, i in tokenizer.vocab.items() if s == END_OF_TEXT}

    def token_id(self, token: str) -> int:
        token_id = self.tokenizer.vocab.get(token)
        if token_id is None:
            raise FimTokenError(f"the FIM token {token!r} is not in the GPT-2 vocabulary ({len(self.tokenizer.vocab)} "
                                "entries)")
        return token_id

    def decode(self, ids: Sequence[int]) -> str:
        raw = bytearray()
        for i in ids:
            token = self.tokenizer.inv_vocab.get(int(i))
            if token is None or int(i) in self._special:
                continue
            if all(c in self._byte_of for c in token):
                raw.extend(self._byte_of[c] for c in token)
            else:
                raw.extend(token.encode("utf-8"))
        return raw.decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for k, piece in enumerate(text.split(END_OF_TEXT)):
            if k:
                ids.append(self.tokenizer.eod)
            if piece:
                ids.extend(self.tokenizer.tokenize(piece))
        return ids


def codec_for(tokenizer) -> TextCodec:
    if isinstance(tokenizer, GPT2BPETokenizer):
        return Gpt2TextCodec(tokenizer)
    raise FimTokenError(f"--fim-data is implemented here for GPT2BPETokenizer only, not {type(tokenizer).__name__}: "
                        "Megatron-LM's FIM decodes samples to text and encodes the parts again with its tokenizer "
                        "library, whose exact rules this package reproduces for GPT-2 BPE")


# -- the permutation ------------------------------------------------------------------------
class FimOrder(enum.Enum):
    """Where the middle goes (the FIM paper's two variants)."""

    PSM = "psm"
    """<pre> prefix <suf> suffix <mid> middle."""
    SPM = "spm"
    """<pre> <suf> suffix <mid> prefix middle."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FimTokenIds:
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split_sample: Optional[int]


class FimTransform:
    """One sample's permutation (see [Note: FIM permutation]); ``rng`` is the caller's stream."""

    def __init__(self, config: FimConfig, codec: TextCodec) -> None:
        self.config, self.codec = config, codec
        t = config.tokens
        split = codec.token_id(config.split_sample) if config.split_sample is not None else None
        self.ids = FimTokenIds(prefix=codec.token_id(t.prefix), middle=codec.token_id(t.middle),
                               suffix=codec.token_id(t.suffix), pad=codec.token_id(t.pad), eod=codec.token_id(t.eod),
                               split_sample=split)

    def __call__(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """``sample``: 1-D token ids; returns int64 ids of the same length."""
        sample = np.asarray(sample, dtype=np.int64)
        out = self._per_piece(sample, self.ids.eod, lambda piece: self._fragments(piece, rng))
        if len(out) > len(sample):
            return out[:len(sample)]
        return np.concatenate([out, np.full(len(sample) - len(out), self.ids.pad, dtype=np.int64)])

    @staticmethod
    def _per_piece(tokens: np.ndarray, separator: int, permute) -> np.ndarray:
        """``permute`` each non-empty piece between separators (keeping them) and the piece
        after the last one (even empty); empty pieces vanish with their separator."""
        breaks = np.flatnonzero(tokens == separator)
        if breaks.size == 0:
            return permute(tokens)
        parts, start = [], 0
        for stop in breaks:
            if stop > start:
                parts += [permute(tokens[start:stop]), np.array([separator], dtype=np.int64)]
            start = stop + 1
        parts.append(permute(tokens[start:]))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def _fragments(self, piece: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        split = self.ids.split_sample
        if split is None or not np.any(piece == split):
            return self._permute(piece, self.config.rate, rng)
        if not rng.binomial(1, self.config.rate):
            return piece
        return self._per_piece(piece, split, lambda part: self._permute(part, self.config.fragment_rate, rng))

    def _permute(self, tokens: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        if not rng.binomial(1, rate):
            return tokens
        text = self.codec.decode(tokens)
        if self.config.no_prefix is not None and text.startswith(self.config.no_prefix):
            return tokens
        lo, hi = sorted(int(b) for b in rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (np.asarray(self.codec.encode(part), dtype=np.int64)
                                  for part in (text[:lo], text[lo:hi], text[hi:]))
        order = FimOrder.SPM if rng.binomial(1, self.config.spm_rate) else FimOrder.PSM
        i = self.ids
        if order is FimOrder.SPM:
            parts = [[i.prefix, i.suffix], suffix, [i.middle], prefix, middle]
        else:
            parts = [[i.prefix], prefix, [i.suffix], suffix, [i.middle], middle]
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


# -- samples in Megatron-LM's reading order --------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderLayout:
    """How one data-parallel rank's Megatron-LM data loader reads a split (its sampler hands
    the rank ``micro_batch_size`` samples out of every ``micro_batch_size x dp_size``)."""

    dp_rank: int
    dp_size: int
    micro_batch_size: int
    """--micro-batch-size for training, --eval-micro-batch-size for validation."""
    num_workers: int
    """--num-workers: loader processes, each with its own copy of the dataset."""

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size or self.micro_batch_size < 1 or self.num_workers < 0:
            raise ValueError(f"invalid loader layout {self}")


class FimSampleSource:
    """A SampleSource of FIM samples over a ``MegatronSampleSource`` (see [Note: FIM random
    streams]): ``sample(i)`` for the indices this rank reads, in reading order."""

    def __init__(self, base, transform: FimTransform, layout: LoaderLayout, seed: int) -> None:
        self.base, self.transform, self.layout, self.seed = base, transform, layout, seed
        self.name = getattr(base, "name", "data")
        self._anchor: Optional[int] = None  # the first sample of the run's first chunk
        self._cursors = [0] * max(layout.num_workers, 1)  # per worker: the next ordinal not drawn yet
        self._rngs: dict[tuple[int, int], np.random.RandomState] = {}
        self._last: Optional[tuple[int, torch.Tensor]] = None

    def __len__(self) -> int:
        return len(self.base)

    def sample(self, index: int) -> torch.Tensor:
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        ordinal, worker = self._locate(index)
        if ordinal < self._cursors[worker]:
            raise RuntimeError(f"FIM {self.name} sample {index} asked for after later ones: Megatron-LM's FIM samples "
                               "depend on the order they are drawn in, so they are served once, in reading order")
        for earlier in range(self._cursors[worker], ordinal):  # this worker's samples skipped by the caller
            if self._worker_of(earlier) == worker:
                self._draw(self._index_of(earlier), worker)
        tokens = self._draw(index, worker)
        self._cursors[worker] = ordinal + 1
        self._last = (index, tokens)
        return tokens

    def _locate(self, index: int) -> tuple[int, int]:
        """(ordinal of ``index`` among this rank's samples of the run, its worker)."""
        mbs, rank = self.layout.micro_batch_size, self.layout.dp_rank
        if self._anchor is None:
            self._anchor = index - rank * mbs
        chunk, offset = divmod(index - self._anchor, mbs * self.layout.dp_size)
        local = offset - rank * mbs
        if chunk < 0 or not 0 <= local < mbs:
            raise RuntimeError(f"FIM {self.name} sample {index} is not one that data-parallel rank {rank} reads "
                               f"(micro batch {mbs} x {self.layout.dp_size} ranks from sample {self._anchor})")
        ordinal = chunk * mbs + local
        return ordinal, self._worker_of(ordinal)

    def _worker_of(self, ordinal: int) -> int:
        workers = self.layout.num_workers
        return (ordinal // self.layout.micro_batch_size) % workers if workers else 0

    def _index_of(self, ordinal: int) -> int:
        chunk, local = divmod(ordinal, self.layout.micro_batch_size)
        mbs = self.layout.micro_batch_size
        return self._anchor + chunk * mbs * self.layout.dp_size + self.layout.dp_rank * mbs + local

    def _draw(self, index: int, worker: int) -> torch.Tensor:
        if not 0 <= index < len(self.base):
            return self.base.sample(index)  # raises the base source's IndexError
        item = self.base.dataset[index]
        member = int(item.get("dataset_id", 0))  # blends: each member dataset has its own generator
        text = torch.cat([item["tokens"], item["labels"][-1:]]).numpy()
        rng = self._rngs.get((member, worker))
        if rng is None:
            rng = self._rngs[(member, worker)] = np.random.RandomState(seed=self.seed)
        return torch.from_numpy(self.transform(text, rng))


# -- the launcher's side ----------------------------------------------------------------------
def fim_problems(args) -> list[str]:
    """What is wrong with --fim-data and its flags (empty if nothing or no --fim-data): for
    validation, before any process group."""
    if not getattr(args, "fim_data", False):
        return []
    problems = []
    if args.mock_data:
        problems.append("--fim-data with --mock-data: Megatron-LM refuses the pair (mock documents are not text); "
                        "train FIM on --data-path")
    elif not args.data_path:
        problems.append("--fim-data needs --data-path (indexed datasets made with the tokenizer's ids)")
    try:
        config = FimConfig.from_args(args)
    except ValueError as exc:
        return problems + [str(exc)]
    if args.tokenizer_type != TokenizerType.GPT2_BPE.value:
        kind = args.tokenizer_type or "unset (the byte tokenizer)"
        return problems + [f"--fim-data with --tokenizer-type {kind}: implemented for "
                           "GPT2BPETokenizer only (Megatron-LM's FIM decodes each sample to text and encodes its "
                           "parts again; this package reproduces that for GPT-2 BPE); use GPT2BPETokenizer"]
    if args.vocab_file and os.path.isfile(args.vocab_file):  # a missing file is the tokenizer rules' report
        with open(args.vocab_file, encoding="utf-8") as f:
            problems += fim_token_problems(config, set(json.load(f)), args.vocab_file)
    return problems


def fim_token_problems(config: FimConfig, vocabulary: set, where: str) -> list[str]:
    named = dict(config.tokens.named())
    if config.split_sample is not None:
        named["--fim-split-sample"] = config.split_sample
    missing = [f"{flag} {token!r}" for flag, token in named.items() if token not in vocabulary]
    if not missing:
        return []
    return [f"--fim-data: {', '.join(missing)} not in the vocabulary {where}. Megatron-LM's GPT-2 tokenizer would "
            "turn a missing token into its unknown token, <|endoftext|>, the end-of-document id, so its sentinels "
            "could not be told apart from document ends; add the tokens to the vocabulary file or name tokens it "
            "has with the --fim-*-token flags"]


def wrap_fim_sources(args, tokenizer, train, valid, dp_rank: int):
    """(train, valid) FIM sources over the built GPT sources (valid may be None)."""
    transform = FimTransform(FimConfig.from_args(args), codec_for(tokenizer))
    dp_size = args.data_parallel_size

    def wrap(source, micro_batch_size):
        layout = LoaderLayout(dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=micro_batch_size,
                              num_workers=args.num_workers)
        return FimSampleSource(source, transform, layout, args.seed)

    return wrap(train, args.micro_batch_size), (wrap(valid, args.eval_micro_batch_size) if valid else None)
