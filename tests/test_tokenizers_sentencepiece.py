"""SentencePiece tokenizers (megatron_fsdp/training/data/sentencepiece_tokenizers.py).

A tiny SentencePiece model is trained here from lines of data/corpus.txt, then:

* GPTSentencePieceTokenizer and Llama2Tokenizer give sentencepiece's own ids (Llama2 with the
  bos id first), eod = the model's eos, vocab = the model's pieces, and decode back to the text;
* SentencePieceTokenizer adds Megatron-LM's specials after the pieces and cuts their text out
  of the input, with the ids and the detokenized text that Megatron-LM's legacy
  ``_SentencePieceTokenizer`` gives (values worked out from its source);
* without the `sentencepiece` package the launcher refuses these types at validation;
* scripts/preprocess_data.py and a short 2-rank CPU launcher run train with it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_inprocess import launch_task

spm = pytest.importorskip("sentencepiece")

from megatron_fsdp.training.data import tokenizers as tk  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LINES = [line for line in (REPO / "data" / "corpus.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
TEXT = "There is a river below the old mill, and the clock keeps time."
PIECES = 200  # the trained model's vocabulary


def _train(out: Path, name: str, **options) -> str:
    corpus = out / f"{name}.txt"
    corpus.write_text("\n".join(LINES[:60]) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(out / name), vocab_size=PIECES,
                                   model_type="bpe", minloglevel=2, **options)
    return str(out / f"{name}.model")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """Sentencepiece's defaults: unk 0, bos <s> 1, eos </s> 2, no pad piece."""
    return _train(tmp_path_factory.mktemp("spm"), "tiny")


@pytest.fixture(scope="module")
def sp(model):
    return spm.SentencePieceProcessor(model_file=model)


def test_the_trained_model_has_sentencepiece_defaults(sp):
    assert sp.get_piece_size() == PIECES
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    assert sp.id_to_piece(1) == "<s>" and sp.id_to_piece(2) == "</s>"


def test_gpt_sentencepiece_is_the_model_as_it_is(model, sp):
    tok = tk.build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert type(tok).__name__ == "GPTSentencePieceTokenizer"
    assert tok.vocab_size == PIECES and tk.vocab_size_with_padding(tok.vocab_size, 128) == 256
    assert tk.vocab_size_with_padding(tok.vocab_size, 128, tensor_model_parallel_size=2) == 256
    assert (tok.eod, tok.eos, tok.bos, tok.pad) == (2, 2, 1, -1)
    ids = tok.tokenize(TEXT)
    assert ids == sp.encode(TEXT) and 1 not in ids and 2 not in ids  # no bos/eos added
    assert tok.detokenize(ids) == sp.decode(ids) == TEXT
    assert tok.detokenize([int(i) for i in ids] + [2]) == TEXT  # eos decodes to nothing
    assert tok.vocab["</s>"] == 2 and tok.inv_vocab[1] == "<s>" and len(tok.vocab) == PIECES
    assert tok.unique_identifiers["tokenizer_model"] == os.path.abspath(model)


def test_llama2_starts_every_text_with_bos(model, sp):
    tok = tk.build_tokenizer("Llama2Tokenizer", tokenizer_model=model)
    assert tok.vocab_size == PIECES and (tok.eod, tok.bos, tok.pad) == (2, 1, -1)
    ids = tok.tokenize(TEXT)
    assert ids == [1] + sp.encode(TEXT)
    assert tok.tokenize(TEXT, bos=False, eos=True) == sp.encode(TEXT) + [2]
    assert tok.tokenize("") == [1]
    assert tok.detokenize(ids) == TEXT


def test_sentencepiece_tokenizer_adds_megatron_specials(model, sp):
    tok = tk.build_tokenizer("SentencePieceTokenizer", tokenizer_model=model, vocab_extra_ids=2)
    # Megatron-LM's order: <CLS> <SEP> <EOD> <MASK>, then the pad piece (<PAD>: the model has none),
    # bos <s> and eos </s> (the model's own ids), then <extra_id_0>, <extra_id_1>.
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == (200, 201, 202, 203, 204)
    assert (tok.bos, tok.eos) == (1, 2)
    assert tok.additional_special_tokens_ids == [205, 206] and tok.vocab_size == 207
    assert tk.vocab_size_with_padding(tok.vocab_size, 128) == 256
    assert tok.tokenize(TEXT) == sp.encode(TEXT)  # text without specials: the model's ids
    # Each special's text becomes its id, the earliest first; the rest is encoded piece by piece.
    text = "the mill<EOD>river</s> time<SEP><extra_id_1>"
    assert tok.tokenize(text) == (sp.encode("the mill") + [202] + sp.encode("river") + [2]
                                  + sp.encode(" time") + [201, 206])
    # detokenize writes each special between single spaces (the trailing one stays).
    assert tok.detokenize(tok.tokenize(text)) == "the mill <EOD> river </s> time <SEP>  <extra_id_1> "
    assert tok.detokenize(sp.encode(TEXT)) == TEXT
    plain = tk.build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert plain.vocab_size == 205 and plain.additional_special_tokens_ids == []


def test_a_model_with_a_pad_piece_keeps_its_ids(tmp_path):
    model = _train(tmp_path, "padded", pad_id=3, user_defined_symbols=["<EOD>"])
    tok = tk.build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    sp = spm.SentencePieceProcessor(model_file=model)
    assert sp.piece_to_id("<EOD>") == 4 and sp.id_to_piece(3) == "<pad>"
    # <EOD> and <pad> are the model's pieces; only <CLS>, <SEP>, <MASK> are new.
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == (200, 201, 4, 202, 3) and tok.vocab_size == 203
    gpt = tk.build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert gpt.pad == 3 and gpt.eod == 2 and gpt.vocab_size == PIECES


def test_a_model_without_eos_is_a_clear_error(tmp_path):
    model = _train(tmp_path, "noeos", eos_id=-1)
    with pytest.raises(ValueError, match="eos_id=-1"):
        tk.build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer"])
def test_flag_problems(kind, tmp_path):
    assert any("needs --tokenizer-model FILE" in p for p in tk.tokenizer_problems(kind))
    missing = str(tmp_path / "nope.model")
    assert any("no such file" in p for p in tk.tokenizer_problems(kind, tokenizer_model=missing))
    with pytest.raises(ValueError, match="no such file"):
        tk.build_tokenizer(kind, tokenizer_model=missing)


def test_without_sentencepiece_the_launcher_refuses(model, monkeypatch):
    from megatron_fsdp.training.args import arguments
    from megatron_fsdp.training.args.arg_types import ArgumentError

    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as if not installed
    problems = tk.tokenizer_problems("Llama2Tokenizer", tokenizer_model=model)
    assert len(problems) == 1 and "`sentencepiece` package, which is not installed" in problems[0]
    with pytest.raises(ArgumentError, match="pip install sentencepiece"):
        arguments.parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                              "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                              "--train-iters", "2", "--lr", "1e-3", "--tokenizer-type", "GPTSentencePieceTokenizer",
                              "--tokenizer-model", model])
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        tk.sentencepiece_tokenizers.GPTSentencePieceTokenizer(model)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    return env


@pytest.mark.parametrize("kind", [
    pytest.param("GPTSentencePieceTokenizer", marks=pytest.mark.skipif(
        not os.environ.get("MFSDP_LAUNCHER_LONG"), reason="Llama2Tokenizer runs the same path; MFSDP_LAUNCHER_LONG=1")),
    "Llama2Tokenizer"])
def test_preprocess_and_train_with_sentencepiece(kind, model, sp, tmp_path, pool2):
    docs = [" ".join(LINES[i:i + 4]) for i in range(0, 120, 4)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "preprocess_data.py"), "--input",
                           str(tmp_path / "docs.jsonl"), "--output-prefix", str(tmp_path / "sp"),
                           "--tokenizer-type", kind, "--tokenizer-model", model, "--append-eod", "--workers", "1"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    prefix = str(tmp_path / "sp_text_document")
    from megatron_fsdp.training.data.indexed import IndexedDataset

    data = IndexedDataset(prefix)
    first = [int(i) for i in data[0]]
    bos = [1] if kind == "Llama2Tokenizer" else []
    assert first == bos + sp.encode(docs[0]) + [2]  # Megatron-LM's preprocess: ids, then eod (= eos)
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--train-iters", "12", "--lr", "3e-3", "--seed", "1234", "--log-interval", "4",
             "--eval-interval", "6", "--eval-iters", "1", "--split", "949,50,1", "--plot-path", "none",
             "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"), "--tokenizer-type", kind,
             "--tokenizer-model", model, "--log-json", str(tmp_path / "m.json")]
    lines = pool2.run(launch_task, flags=shlex.join(flags))[0]  # the launcher in the shared gloo pool
    assert any(f"({kind})" in line for line in lines)
    loss = json.loads((tmp_path / "m.json").read_text())["lm_loss"]
    # Untrained, the loss is ln(vocab): ln 256 = 5.55 for the 200 pieces padded to 128's multiple.
    assert abs(loss[0] - math.log(256)) < 0.1, loss[0]
    assert len(loss) == 12 and sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.3, loss
