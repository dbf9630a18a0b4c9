"""Megatron-LM's ``--tokenizer-type TikTokenizer``: a byte-level BPE read from a tiktoken JSON
vocabulary (``--tokenizer-model vocab.json``), run by the ``tiktoken`` package.

[Note: the TikTokenizer's ids] The vocabulary file is a list of ``{"rank", "token_bytes"
(base64), "token_str"}`` entries in rank order, the first 256 the single bytes. Megatron-LM
puts ``--tiktoken-num-special-tokens`` (1000) special ids first: ``--tokenizer-special-tokens``
(by default ``<unk> <s> </s> <mask> <pad> <cls> <sep>``, which any custom list must contain),
then ``<SPECIAL_k>`` fillers; a file rank ``r`` is id ``r + num_special_tokens``, and the file
is cut to ``--vocab-size`` (131072 when not given) minus those. Text is split by the ``v1`` or
``v2`` pattern (``--tiktoken-pattern``, v2 by default), special tokens written in the text are
encoded as themselves, and the end of a document is ``</s>``. The same file and flags give
megatron-core's ids (``tests/test_tokenizers_tiktoken.py`` compares them).
"""

from __future__ import annotations

import base64
import json
import os
from collections import OrderedDict
from typing import Optional, Sequence

DEFAULT_VOCAB_SIZE = 2 ** 17
DEFAULT_NUM_SPECIAL_TOKENS = 1000
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
           r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
"""tiktoken's split patterns by Megatron-LM's names."""


def tiktoken_problems(model_file: Optional[str], pattern: Optional[str] = None) -> list[str]:
    """What stops a TikTokenizer from these flags (empty if nothing)."""
    problems = []
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        problems.append("--tokenizer-type TikTokenizer needs the tiktoken package: pip install tiktoken")
    if not model_file:
        problems.append("--tokenizer-type TikTokenizer needs --tokenizer-model VOCAB.json (a tiktoken JSON vocabulary)")
    elif not os.path.isfile(model_file) or not model_file.endswith(".json"):
        problems.append(f"--tokenizer-model {model_file!r}: not a .json file (TikTokenizer reads a tiktoken JSON "
                        "vocabulary: a list of rank/token_bytes/token_str entries)")
    if pattern is not None and pattern not in PATTERNS:
        problems.append(f"--tiktoken-pattern {pattern!r} is not one of {', '.join(PATTERNS)}")
    return problems


def _special_tokens(special_tokens: Optional[Sequence[str]], count: int) -> list[str]:
    tokens = list(special_tokens) if special_tokens else list(REQUIRED_SPECIAL_TOKENS)
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in tokens]
    if missing or len(set(tokens)) != len(tokens) or len(tokens) > count:
        raise ValueError(f"--tokenizer-special-tokens {tokens}: must be unique, include {list(REQUIRED_SPECIAL_TOKENS)} "
                         f"(missing {missing}) and number at most --tiktoken-num-special-tokens {count}")
    return tokens + [f"<SPECIAL_{i}>" for i in range(len(tokens), count)]


def _mergeable_ranks(path: str, inner_size: int, offset: int) -> dict[bytes, int]:
    """The file's first ``inner_size`` tokens, each at its rank plus ``offset``."""
    with open(path) as f:
        entries = json.load(f)
    if not isinstance(entries, list) or len(entries) < inner_size:
        raise ValueError(f"{path}: a tiktoken vocabulary of at least {inner_size} entries (--vocab-size minus the "
                         f"special tokens) is needed, found {len(entries) if isinstance(entries, list) else 'no list'}")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(entries[:inner_size]):
        token = base64.b64decode(entry["token_bytes"])
        if entry["rank"] != i or (i < 256 and token != bytes([i])):
            raise ValueError(f"{path}: entry {i} has rank {entry['rank']} and bytes {token!r}; ranks must count "
                             "from 0 and the first 256 entries be the single bytes")
        ranks[token] = i + offset
    return ranks


class TikTokenizer:
    """Megatron-LM's TikTokenizer (see [Note: the TikTokenizer's ids])."""

    def __init__(self, model_file: str, *, pattern: Optional[str] = None, vocab_size: Optional[int] = None,
                 num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
                 special_tokens: Optional[Sequence[str]] = None) -> None:
        import tiktoken

        problems = tiktoken_problems(model_file, pattern)
        if problems:
            raise ValueError("; ".join(problems))
        self.model_file, self.pattern = model_file, pattern or "v2"
        self._vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        if not 0 < num_special_tokens < self._vocab_size:
            raise ValueError(f"--tiktoken-num-special-tokens {num_special_tokens} must be positive and below the "
                             f"vocabulary size {self._vocab_size}")
        self.special_tokens = _special_tokens(special_tokens, num_special_tokens)
        ranks = _mergeable_ranks(model_file, self._vocab_size - num_special_tokens, num_special_tokens)
        self._encoding = tiktoken.Encoding(name=os.path.basename(os.path.dirname(model_file)) or "tiktoken",
                                           pat_str=PATTERNS[self.pattern], mergeable_ranks=ranks,
                                           special_tokens={t: i for i, t in enumerate(self.special_tokens)})

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self.special_tokens.index("</s>")

    @property
    def bos(self) -> int:
        return self.special_tokens.index("<s>")

    @property
    def pad(self) -> int:
        return self.special_tokens.index("<pad>")

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(**{"class": f"{type(self).__module__}.{type(self).__qualname__}",
                              "tokenizer_path": [self.model_file], "pattern": self.pattern,
                              "vocab_size": self._vocab_size, "special_tokens": self.special_tokens[:16],
                              "num_special_tokens": len(self.special_tokens)})

    def tokenize(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))
