"""Tokenizers that work offline with the user's own files, with Megatron-LM's names.

Entry point for the launcher and ``scripts/preprocess_data.py``::

    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file="data/bpe/vocab.json",
                                merge_file="data/bpe/merges.txt")
    ids = tokenizer.tokenize("Hello world")           # list[int]
    text = tokenizer.detokenize(ids)                  # str
    tokenizer.vocab_size, tokenizer.eod               # ints
    padded = vocab_size_with_padding(tokenizer.vocab_size, make_vocab_size_divisible_by=128)

Every tokenizer has Megatron-LM's interface (``vocab_size``, ``tokenize``, ``detokenize``,
``eod``) plus ``unique_identifiers``, which megatron-core's datasets hash into the names
of their cached index files.

[Note: GPT-2 byte-level BPE] ``GPT2BPETokenizer`` reads GPT-2's two files: ``vocab.json``
(token string -> id, tokens spelled in GPT-2's printable stand-ins for the 256 bytes)
and ``merges.txt`` (one merge ``a b`` per line, best first, after a ``#version`` line).
Text is cut into words by GPT-2's pattern (contractions, letter runs, digit runs,
punctuation runs, whitespace), each word's UTF-8 bytes become stand-in characters, and
the lowest-ranked adjacent pair is merged until no listed merge applies. The encoder is
our own; when the ``tokenizers`` package is installed it does the same job faster, and
``tests/test_tokenizers.py`` checks that both give the same ids.

GPTSentencePieceTokenizer, Llama2Tokenizer and SentencePieceTokenizer read a SentencePiece
``--tokenizer-model`` file with the optional ``sentencepiece`` package; they live in
``sentencepiece_tokenizers.py`` (see its [Note: the three SentencePiece types]).
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import math
import os
import sys
import unicodedata
from collections import OrderedDict
from typing import Protocol, Sequence

from . import sentencepiece_tokenizers, tiktoken_tokenizer

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
BYTE_VOCAB_SIZE = 256


class TokenizerType(enum.Enum):
    """``--tokenizer-type`` values this project builds (Megatron-LM's names)."""

    BYTE = "ByteTokenizer"
    """One token per UTF-8 byte (vocabulary 256, end of document = byte 0): needs no files."""
    NULL = "NullTokenizer"
    """Megatron-LM's placeholder for ``--mock-data``: ``--vocab-size`` ids, eod = the last one."""
    GPT2_BPE = "GPT2BPETokenizer"
    """GPT-2 byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file`` (merges.txt)."""
    HUGGINGFACE = "HuggingFaceTokenizer"
    """``--tokenizer-model``: a local directory (or tokenizer.json) read by ``transformers`` or ``tokenizers``."""
    GPT_SENTENCEPIECE = "GPTSentencePieceTokenizer"
    """``--tokenizer-model`` SentencePiece file: its ids as they are, eod = its eos (needs ``sentencepiece``)."""
    LLAMA2 = "Llama2Tokenizer"
    """``--tokenizer-model`` SentencePiece file: bos then its ids, eod = its eos (needs ``sentencepiece``)."""
    SENTENCEPIECE = "SentencePieceTokenizer"
    """``--tokenizer-model`` SentencePiece file plus Megatron-LM's <CLS>/<SEP>/<EOD>/<MASK> tokens and
    ``--vocab-extra-ids``; eod = <EOD> (needs ``sentencepiece``)."""
    TIKTOKEN = "TikTokenizer"
    """``--tokenizer-model`` tiktoken JSON vocabulary after Megatron-LM's special ids, ``--tiktoken-pattern``,
    ``--tiktoken-num-special-tokens``, ``--tokenizer-special-tokens``; eod = </s> (needs ``tiktoken``)."""


# Megatron-LM accepts these too; they need files or libraries this project does not
# read, so they are refused with a pointer to what works instead.
UNSUPPORTED_TOKENIZERS = (
    "BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer",
    "NullMultimodalTokenizer", "SFTTokenizer",
)
_SENTENCEPIECE_KINDS = (TokenizerType.GPT_SENTENCEPIECE, TokenizerType.LLAMA2, TokenizerType.SENTENCEPIECE)
TOKENIZER_CHOICES = tuple(t.value for t in TokenizerType) + UNSUPPORTED_TOKENIZERS


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer (Megatron-LM's MegatronTokenizer)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    @property
    def unique_identifiers(self) -> OrderedDict: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


CACHE_KEY_MODULE = "megatron_fsdp.training.tokenizers"
"""[Note: pinned dataset cache keys] The module path our tokenizers are named by in
``unique_identifiers``. megatron-core's datasets hash those identifiers into the names of
their ``--data-cache-path`` files, so the path is part of every cached index's key: it
stays the one these classes had before they moved to ``training/data/``, and a cache built
then is still found (the test pins the description)."""


def cache_key_class(cls: type, module_name: str, pinned: str) -> str:
    """``cls``'s name in dataset cache keys: under ``pinned`` for the classes of
    ``module_name`` itself, under their real module for others (a user's subclass)."""
    module = pinned if cls.__module__ == module_name else cls.__module__
    return f"{module}.{cls.__qualname__}"


class _TokenizerBase:
    """Shared ``unique_identifiers``; subclasses fill ``_identity`` with what defines them."""

    _identity: dict

    @property
    def unique_identifiers(self) -> OrderedDict:
        ident = OrderedDict(cls=cache_key_class(type(self), __name__, CACHE_KEY_MODULE))
        ident.update(self._identity)
        return ident

    @property
    def eos(self) -> int:
        return self.eod  # type: ignore[attr-defined]


class ByteTokenizer(_TokenizerBase):
    """UTF-8 bytes as ids; byte 0 (NUL, absent from text) marks the end of a document."""

    def __init__(self) -> None:
        self._identity = {"vocab_size": BYTE_VOCAB_SIZE}

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def eod(self) -> int:
        return 0

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class NullTokenizer(_TokenizerBase):
    """Megatron-LM's NullTokenizer: text is space-separated ids; eod is ``vocab_size - 1``."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 2, got {vocab_size!r}")
        self._vocab_size = int(vocab_size)
        self._identity = {"vocab_size": self._vocab_size, "eod_id": self._vocab_size - 1}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


# ---------------------------------------------------------------------------------
# GPT-2 byte-level BPE (see [Note: GPT-2 byte-level BPE])

# \p{L} letters, \p{N} numbers; Python's ``re`` lacks these classes, so without the
# ``regex`` package they are spelled out from unicodedata (see _unicode_class).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the
    other 68 bytes (controls, space, ...) take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_alphabet() -> list[str]:
    """The 256 base tokens in GPT-2's id order (printable bytes first, then the rest)."""
    table = bytes_to_unicode()
    printable = [b for b in range(256) if table[b] == chr(b)]
    return [table[b] for b in printable] + [table[b] for b in range(256) if table[b] != chr(b)]


def _unicode_class(major: str) -> str:
    """A ``re`` character-class body matching every code point whose Unicode category starts with ``major``."""
    ranges, start = [], None
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and unicodedata.category(chr(cp)).startswith(major)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    esc = lambda cp: f"\\U{cp:08x}"  # noqa: E731
    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges)


@functools.lru_cache(maxsize=1)
def gpt2_pretokenizer():
    """GPT-2's word pattern, compiled by ``regex`` if installed, else by ``re`` with spelled-out classes."""
    try:
        import regex

        return regex.compile(_GPT2_PATTERN)
    except ImportError:
        import re

        letters, numbers = _unicode_class("L"), _unicode_class("N")
        pattern = _GPT2_PATTERN.replace(r"[^\s\p{L}\p{N}]", f"[^\\s{letters}{numbers}]")
        pattern = pattern.replace(r"\p{L}", f"[{letters}]").replace(r"\p{N}", f"[{numbers}]")
        return re.compile(pattern)


def read_merges(merge_file: str) -> list[tuple[str, str]]:
    """Merges of a GPT-2 ``merges.txt``, best first (the ``#version`` line is skipped)."""
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{merge_file}:{lineno}: a merge line is two tokens separated by one space, "
                                 f"got {line!r}; pass GPT-2's merges.txt as --merge-file")
            merges.append((parts[0], parts[1]))
    return merges


def bpe_word(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the characters of ``word`` by ``ranks`` (lower merges first) into BPE tokens."""
    parts = list(word)
    while len(parts) > 1:
        best_rank, best = None, None
        for pair in zip(parts, parts[1:]):
            rank = ranks.get(pair)
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best = rank, pair
        if best is None:
            break
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and parts[i] == best[0] and parts[i + 1] == best[1]:
                merged.append(best[0] + best[1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


class GPT2BPETokenizer(_TokenizerBase):
    """GPT-2 byte-level BPE from a ``vocab.json`` and ``merges.txt`` (Megatron-LM's GPT2BPETokenizer)."""

    def __init__(self, vocab_file: str, merge_file: str, *, use_fast: bool = True) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(
                    f"GPT2BPETokenizer needs {flag} FILE, got {path!r} (no such file); pass GPT-2's "
                    "vocab.json and merges.txt, or the small vocabulary shipped in data/bpe/")
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        if END_OF_TEXT not in self.encoder:
            raise ValueError(f"{vocab_file} has no {END_OF_TEXT!r} token, which GPT2BPETokenizer uses as "
                             "the end-of-document id; add it to the vocabulary")
        self.decoder = {i: s for s, i in self.encoder.items()}
        self.merges = read_merges(merge_file)
        self.ranks = {pair: i for i, pair in enumerate(self.merges)}
        self._byte_encoder = bytes_to_unicode()
        self._byte_decoder = {c: b for b, c in self._byte_encoder.items()}
        self._cache: dict[str, list[int]] = {}
        self._fast = _fast_bpe(self.encoder, self.merges) if use_fast else None
        self._identity = {"vocab_file": os.path.abspath(vocab_file), "merge_file": os.path.abspath(merge_file)}

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def vocab(self) -> dict[str, int]:
        return self.encoder

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self.decoder

    @property
    def eod(self) -> int:
        return self.encoder[END_OF_TEXT]

    @property
    def backend(self) -> str:
        return "tokenizers" if self._fast is not None else "python"

    def tokenize(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text).ids
        return self.tokenize_python(text)

    def tokenize_python(self, text: str) -> list[int]:
        """Our own encoder (the reference the ``tokenizers`` backend is tested against)."""
        ids: list[int] = []
        for word in gpt2_pretokenizer().findall(text):
            cached = self._cache.get(word)
            if cached is None:
                chars = "".join(self._byte_encoder[b] for b in word.encode("utf-8"))
                cached = [self._token_id(t) for t in bpe_word(chars, self.ranks)]
                if len(self._cache) < 100_000:
                    self._cache[word] = cached
            ids.extend(cached)
        return ids

    def _token_id(self, token: str) -> int:
        try:
            return self.encoder[token]
        except KeyError:
            raise ValueError(f"BPE token {token!r} is missing from the vocabulary: vocab.json and merges.txt "
                             "do not belong together (every merge result must be in the vocabulary)") from None

    def detokenize(self, ids: Sequence[int]) -> str:
        chars = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self._byte_decoder[c] for c in chars).decode("utf-8", errors="replace")


def _fast_bpe(encoder: dict[str, int], merges: list[tuple[str, str]]):
    """The ``tokenizers`` package's byte-level BPE over the same files, or None when it is not installed."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers
    except ImportError:
        return None
    fast = HFTokenizer(models.BPE(vocab=dict(encoder), merges=list(merges)))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    return fast


# ---------------------------------------------------------------------------------
# HuggingFace tokenizers from a local directory


class HuggingFaceTokenizer(_TokenizerBase):
    """A local HuggingFace tokenizer: ``transformers.AutoTokenizer`` when installed, else
    ``tokenizers`` reading ``tokenizer.json``. Nothing is downloaded."""

    def __init__(self, tokenizer_model: str) -> None:
        if not tokenizer_model or not os.path.exists(tokenizer_model):
            raise FileNotFoundError(
                f"HuggingFaceTokenizer needs --tokenizer-model DIR, a local directory with the tokenizer files "
                f"(tokenizer.json, tokenizer_config.json, ...); got {tokenizer_model!r}, which does not exist. "
                "Hub names are not downloaded here: save the tokenizer to a directory first")
        self._identity = {"tokenizer_model": os.path.abspath(tokenizer_model)}
        self._hf = _load_transformers(tokenizer_model)
        self._fast = None if self._hf is not None else _load_tokenizer_json(tokenizer_model)
        self._eod = self._find_eod()

    def _find_eod(self) -> int:
        if self._hf is not None:
            for token_id in (self._hf.eos_token_id, self._hf.pad_token_id):
                if token_id is not None:
                    return int(token_id)
        else:
            for token in (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>"):
                token_id = self._fast.token_to_id(token)
                if token_id is not None:
                    return int(token_id)
        raise ValueError(f"the tokenizer in {self._identity['tokenizer_model']} defines no end-of-sequence "
                         "token; set eos_token in its tokenizer_config.json")

    @property
    def vocab_size(self) -> int:
        return len(self._hf) if self._hf is not None else self._fast.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return self._fast.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        return self._hf.decode(ids) if self._hf is not None else self._fast.decode(ids, skip_special_tokens=False)


def _load_transformers(path: str):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _load_tokenizer_json(path: str):
    json_path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ImportError(
            f"--tokenizer-type HuggingFaceTokenizer needs the `transformers` or the `tokenizers` package to read "
            f"{path!r}; install one (`pip install tokenizers`, no torch needed; scripts/setup_env.sh does it)"
        ) from None
    if not os.path.isfile(json_path):
        raise FileNotFoundError(f"{path!r} has no tokenizer.json, and without `transformers` only that file can "
                                "be read; install transformers or save the tokenizer with its tokenizer.json")
    return HFTokenizer.from_file(json_path)


# ---------------------------------------------------------------------------------
# Factory


def tokenizer_problems(tokenizer_type: str | None, *, vocab_file: str | None = None,
                       merge_file: str | None = None, tokenizer_model: str | None = None,
                       vocab_size: int | None = None, tiktoken_pattern: str | None = None) -> list[str]:
    """What is wrong with these tokenizer flags (empty if nothing): for validation, before any process group."""
    if tokenizer_type is None:
        return []
    if tokenizer_type in UNSUPPORTED_TOKENIZERS:
        return [f"--tokenizer-type {tokenizer_type} is not supported here; use GPT2BPETokenizer (--vocab-file "
                "--merge-file), HuggingFaceTokenizer (--tokenizer-model LOCAL_DIR), GPTSentencePieceTokenizer / "
                "Llama2Tokenizer / SentencePieceTokenizer (--tokenizer-model FILE.model), TikTokenizer "
                "(--tokenizer-model VOCAB.json), NullTokenizer (--vocab-size) or ByteTokenizer"]
    try:
        kind = TokenizerType(tokenizer_type)
    except ValueError:
        return [f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_CHOICES)}"]
    problems = []
    if kind is TokenizerType.GPT2_BPE:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                problems.append(f"--tokenizer-type GPT2BPETokenizer needs {flag} (e.g. data/bpe/"
                                f"{'vocab.json' if flag == '--vocab-file' else 'merges.txt'})")
            elif not os.path.isfile(path):
                problems.append(f"{flag} {path!r}: no such file")
    elif kind is TokenizerType.HUGGINGFACE:
        if not tokenizer_model:
            problems.append("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model LOCAL_DIR")
        elif not os.path.exists(tokenizer_model):
            problems.append(f"--tokenizer-model {tokenizer_model!r}: no such directory (hub names are not "
                            "downloaded here; save the tokenizer to a local directory)")
    elif kind in _SENTENCEPIECE_KINDS:
        problems += sentencepiece_tokenizers.sentencepiece_problems(kind.value, tokenizer_model)
    elif kind is TokenizerType.TIKTOKEN:
        problems += tiktoken_tokenizer.tiktoken_problems(tokenizer_model, tiktoken_pattern)
    elif kind is TokenizerType.NULL and vocab_size is None:
        problems.append("--tokenizer-type NullTokenizer needs --vocab-size")
    return problems


def build_tokenizer(tokenizer_type: str | TokenizerType, *, vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_model: str | None = None,
                    vocab_size: int | None = None, vocab_extra_ids: int = 0,
                    tiktoken_pattern: str | None = None,
                    tiktoken_num_special_tokens: int = tiktoken_tokenizer.DEFAULT_NUM_SPECIAL_TOKENS,
                    special_tokens: Sequence[str] | None = None) -> Tokenizer:
    """The tokenizer for Megatron-LM's ``--tokenizer-type`` and its file flags.

    ``vocab_size`` is used by NullTokenizer and TikTokenizer only, ``vocab_extra_ids`` by
    SentencePieceTokenizer only, the ``tiktoken_*`` and ``special_tokens`` options by
    TikTokenizer only. The model's (padded) vocabulary is
    ``vocab_size_with_padding(tokenizer.vocab_size, make_vocab_size_divisible_by)``.
    """
    value = tokenizer_type.value if isinstance(tokenizer_type, TokenizerType) else tokenizer_type
    problems = tokenizer_problems(value, vocab_file=vocab_file, merge_file=merge_file,
                                  tokenizer_model=tokenizer_model, vocab_size=vocab_size,
                                  tiktoken_pattern=tiktoken_pattern)
    if problems:
        raise ValueError("; ".join(problems))
    match TokenizerType(value):
        case TokenizerType.BYTE:
            return ByteTokenizer()
        case TokenizerType.NULL:
            return NullTokenizer(vocab_size)
        case TokenizerType.GPT2_BPE:
            return GPT2BPETokenizer(vocab_file, merge_file)
        case TokenizerType.HUGGINGFACE:
            return HuggingFaceTokenizer(tokenizer_model)
        case TokenizerType.GPT_SENTENCEPIECE:
            return sentencepiece_tokenizers.GPTSentencePieceTokenizer(tokenizer_model)
        case TokenizerType.LLAMA2:
            return sentencepiece_tokenizers.Llama2Tokenizer(tokenizer_model)
        case TokenizerType.SENTENCEPIECE:
            return sentencepiece_tokenizers.SentencePieceTokenizer(tokenizer_model,
                                                                  vocab_extra_ids=vocab_extra_ids or 0)
        case TokenizerType.TIKTOKEN:
            return tiktoken_tokenizer.TikTokenizer(tokenizer_model, pattern=tiktoken_pattern, vocab_size=vocab_size,
                                                   num_special_tokens=tiktoken_num_special_tokens,
                                                   special_tokens=special_tokens)
    raise AssertionError(value)  # every TokenizerType is matched above


def vocab_size_with_padding(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Megatron-LM's padded embedding size: the next multiple of divisible_by x TP."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    if multiple < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got {make_vocab_size_divisible_by}")
    return int(math.ceil(vocab_size / multiple) * multiple)

