"""``--tokenizer-type TikTokenizer``: a tiktoken JSON vocabulary after Megatron-LM's special ids,
equal to megatron-core's own TikTokenTokenizer on the same file and flags (both split
patterns, special tokens written in the text, unicode), and the launcher's validation."""

from __future__ import annotations

import base64
import json
import warnings
from argparse import Namespace

import pytest

pytest.importorskip("tiktoken")

from megatron_fsdp.training.data import data_args_problems  # noqa: E402
from megatron_fsdp.training.data.tokenizers import build_tokenizer  # noqa: E402

MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b" a", b"an", b"and", b" and"]
TEXTS = ["the theory and the thing", "Hello, World!\n\n  tabs\tand  spaces", "naïve café: 日本語 and 123456",
         "one document</s>the next <pad> and <s>"]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    tokens = [bytes([i]) for i in range(256)] + MERGES
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
               for i, t in enumerate(tokens)]
    path = tmp_path_factory.mktemp("tiktoken") / "vocab.json"
    path.write_text(json.dumps(entries))
    return str(path), 1000 + len(tokens)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_ids_equal_megatron_cores(vocab_file, pattern):
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer
    path, size = vocab_file
    ours = build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=size, tiktoken_pattern=pattern)
    theirs = TikTokenTokenizer(path, pattern=pattern, vocab_size=size, num_special_tokens=1000)
    assert ours.vocab_size == theirs.vocab_size == size and ours.eod == theirs.eod == 2
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == theirs.text_to_ids(text), text
        assert ours.detokenize(ids) == text


def test_ids_follow_the_documented_layout(vocab_file):
    path, size = vocab_file
    tok = build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=size)
    assert tok.tokenize("the") == [1000 + 256 + MERGES.index(b"the")]  # a file rank after the 1000 specials
    assert tok.tokenize("</s>") == [2] and tok.tokenize("<pad>") == [4]
    custom = build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=size - 1000 + 8, tiktoken_num_special_tokens=8,
                             special_tokens=["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<tool>"])
    assert custom.tokenize("<tool>the") == [7, 8 + 256 + MERGES.index(b"the")]


def test_bad_flags_are_named(vocab_file, tmp_path):
    path, size = vocab_file
    args = Namespace(mock_data=True, data_path=None, split="1,0,0", tokenizer_type="TikTokenizer",
                     tokenizer_model=str(tmp_path / "missing.json"), vocab_file=None, merge_file=None,
                     vocab_size=None, tiktoken_pattern="v3")
    problems = " ".join(data_args_problems(args))
    assert "missing.json" in problems and "--tiktoken-pattern 'v3' is not one of v1, v2" in problems
    with pytest.raises(ValueError, match="at least 130072 entries"):
        build_tokenizer("TikTokenizer", tokenizer_model=path)  # the default 2**17 vocabulary needs a bigger file
    with pytest.raises(ValueError, match="must be unique, include"):
        build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=size, special_tokens=["<s>", "</s>"])
