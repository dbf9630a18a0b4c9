"""Tokenizers (megatron_fsdp/training/data/tokenizers.py) and the shipped BPE vocabulary.

* The shipped data/bpe/ files are what scripts/build_bpe_vocab.py makes from data/corpus.txt.
* Our GPT-2 byte-level BPE round-trips any text, applies merges by rank, and gives the same
  ids as the `tokenizers` package (its ByteLevel BPE, when installed) and as a local
  HuggingFace tokenizer directory; its `re` fallback splits words like `regex` does.
* Null / byte tokenizers, padding, and clear errors for missing files or unsupported types.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fsdp.training.data import tokenizers as tk

REPO = Path(__file__).resolve().parents[1]
VOCAB = REPO / "data" / "bpe" / "vocab.json"
MERGES = REPO / "data" / "bpe" / "merges.txt"
CORPUS = (REPO / "data" / "corpus.txt").read_text(encoding="utf-8")
# Contractions, digits, superscripts, CJK, combining marks, tabs, runs of spaces, newlines.
TRICKY = ("Hello wörld, it's 123 ²³ ½ 日本語 e\u0301 ok?!  tabs\t\tand   spaces\n\n  \n"
          "<|endoftext|> don't WE'LL x\u00a0y 🙂 Ⅻ ٣")
HAS_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None


@pytest.fixture(scope="module")
def bpe() -> tk.GPT2BPETokenizer:
    return tk.build_tokenizer("GPT2BPETokenizer", vocab_file=str(VOCAB), merge_file=str(MERGES))


def test_shipped_vocabulary_is_what_the_script_builds(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "build_bpe_vocab.py"), "--input",
                          str(REPO / "data" / "corpus.txt"), "--output-dir", str(tmp_path), "--num-merges", "2000"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "vocab.json").read_bytes() == VOCAB.read_bytes()
    assert (tmp_path / "merges.txt").read_bytes() == MERGES.read_bytes()


def test_shipped_vocabulary_shape(bpe):
    vocab = json.loads(VOCAB.read_text(encoding="utf-8"))
    merges = MERGES.read_text(encoding="utf-8").splitlines()
    assert merges[0].startswith("#version")
    assert len(merges) - 1 == 1803 and bpe.vocab_size == len(vocab) == 2060
    assert sorted(vocab.values()) == list(range(len(vocab)))  # dense ids
    assert bpe.eod == vocab["<|endoftext|>"] == len(vocab) - 1  # last, as in GPT-2
    assert list(vocab)[:256] == tk.byte_alphabet() and list(vocab)[:3] == ["!", '"', "#"]
    assert tk.vocab_size_with_padding(bpe.vocab_size, 128) == 2176


def test_bpe_round_trips_and_compresses(bpe):
    ids = bpe.tokenize_python(CORPUS)
    assert bpe.detokenize(ids) == CORPUS
    assert len(ids) < len(CORPUS.encode()) / 3.5  # a real BPE: ~4 bytes per token on its own corpus
    tricky = bpe.tokenize_python(TRICKY)
    assert bpe.detokenize(tricky) == TRICKY
    assert bpe.eod not in tricky  # the literal text "<|endoftext|>" is not the special token
    assert all(0 <= i < bpe.vocab_size for i in ids + tricky)


def test_merges_apply_by_rank(tmp_path):
    # Hand-made files: "l l" ranks before "h e", and "he ll" before "hell o".
    alphabet = tk.byte_alphabet()
    merges = [("l", "l"), ("h", "e"), ("he", "ll"), ("hell", "o"), ("Ġ", "w")]
    vocab = {t: i for i, t in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    tok = tk.GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), use_fast=False)
    inv = {i: t for t, i in vocab.items()}
    assert [inv[i] for i in tok.tokenize("hello world")] == ["hello", "Ġw", "o", "r", "l", "d"]
    assert [inv[i] for i in tok.tokenize("é")] == ["Ã", "©"]  # two UTF-8 bytes, no merge
    assert [inv[i] for i in tok.tokenize("hel")] == ["he", "l"]


@pytest.mark.skipif(not HAS_TOKENIZERS, reason="the tokenizers package is not installed")
def test_our_bpe_equals_the_tokenizers_package(bpe):
    assert bpe.backend == "tokenizers"
    for text in (CORPUS, TRICKY, " leading space", "trailing space ", "\n\n\n", ""):
        assert bpe.tokenize_python(text) == bpe.tokenize(text), text[:40]
        assert bpe.detokenize(bpe.tokenize(text)) == text


@pytest.mark.skipif(importlib.util.find_spec("regex") is None, reason="the regex package is not installed")
def test_re_fallback_splits_words_like_regex(monkeypatch):
    import re

    import regex

    expected = regex.compile(tk._GPT2_PATTERN).findall(TRICKY + CORPUS[:2000])
    tk.gpt2_pretokenizer.cache_clear()
    monkeypatch.setitem(sys.modules, "regex", None)  # `import regex` now raises ImportError
    try:
        fallback = tk.gpt2_pretokenizer()
        assert isinstance(fallback, re.Pattern)
        assert fallback.findall(TRICKY + CORPUS[:2000]) == expected
    finally:
        tk.gpt2_pretokenizer.cache_clear()


@pytest.mark.skipif(not HAS_TOKENIZERS, reason="the tokenizers package is not installed")
@pytest.mark.parametrize("reader", ["transformers", "tokenizers"])
def test_huggingface_tokenizer_from_a_local_directory(tmp_path, bpe, reader, monkeypatch):
    if reader == "transformers":
        pytest.importorskip("transformers")
    else:  # as on a machine without transformers: tokenizer.json read by the tokenizers package
        monkeypatch.setattr(tk, "_load_transformers", lambda path: None)
    fast = tk._fast_bpe(bpe.encoder, bpe.merges)
    fast.add_special_tokens(["<|endoftext|>"])
    fast.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}), encoding="utf-8")
    hf = tk.build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (hf._hf is not None) == (reader == "transformers")
    assert hf.vocab_size == bpe.vocab_size and hf.eod == bpe.eod
    assert hf.tokenize(CORPUS[:3000]) == bpe.tokenize_python(CORPUS[:3000])
    assert hf.detokenize(hf.tokenize(CORPUS[:500])) == CORPUS[:500]
    assert hf.unique_identifiers["tokenizer_model"] == str(tmp_path)


def test_null_and_byte_tokenizers():
    null = tk.build_tokenizer("NullTokenizer", vocab_size=1000)
    assert null.vocab_size == 1000 and null.eod == 999
    assert null.tokenize("5 7 11") == [5, 7, 11] and null.detokenize([5, 7]) == "5 7"
    byte = tk.build_tokenizer(tk.TokenizerType.BYTE)
    assert byte.vocab_size == 256 and byte.eod == 0
    assert byte.tokenize("hé") == [104, 195, 169] and byte.detokenize(byte.tokenize(TRICKY)) == TRICKY
    assert null.unique_identifiers["vocab_size"] == 1000


@pytest.mark.parametrize("kind, kwargs, message", [
    ("GPT2BPETokenizer", {}, "needs --vocab-file"),
    ("GPT2BPETokenizer", {"vocab_file": "nope.json", "merge_file": str(MERGES)}, "'nope.json': no such file"),
    ("HuggingFaceTokenizer", {"tokenizer_model": "meta-llama/Llama-3-8B"}, "not downloaded here"),
    ("HuggingFaceTokenizer", {}, "needs --tokenizer-model"),
    ("NullTokenizer", {}, "needs --vocab-size"),
    ("TikTokenizer", {}, "needs --tokenizer-model VOCAB.json"),
    ("MultimodalTokenizer", {}, "not supported here; use GPT2BPETokenizer"),
    ("Word2Vec", {}, "is not one of"),
])
def test_bad_tokenizer_flags_are_clear_errors(kind, kwargs, message):
    assert any(message in p for p in tk.tokenizer_problems(kind, **kwargs))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        tk.build_tokenizer(kind, **kwargs)


def test_mismatched_vocab_and_merges_are_a_clear_error(tmp_path):
    vocab = {t: i for i, t in enumerate(tk.byte_alphabet())}
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\n", encoding="utf-8")
    tok = tk.GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), use_fast=False)
    with pytest.raises(ValueError, match="do not belong together"):
        tok.tokenize("he")
