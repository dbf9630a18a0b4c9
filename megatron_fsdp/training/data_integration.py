"""The launcher's side of the data module: validation of the data flags, the
model's vocabulary size from the tokenizer, and the (train, valid) sources.

The data module (``megatron_fsdp/training/data``) owns datasets and tokenizers.
When it provides Megatron-LM's pieces (``data_path_problems`` for indexed
``--data-path`` prefixes and blends, ``build_tokenizer_from_args`` for
``GPT2BPETokenizer`` / ``HuggingFaceTokenizer``) the launcher uses them; otherwise
it trains on text files through the byte tokenizer (or ``--mock-data``), and flags
that need those pieces are a clear error.
"""

from __future__ import annotations

import os

from . import data as data_mod
from .arg_types import TokenizerType
from .validation import padded_vocab_size

_LOCAL_TOKENIZERS = (TokenizerType.BYTE.value, TokenizerType.NULL.value)


def has_indexed_data() -> bool:
    return hasattr(data_mod, "data_path_problems") and hasattr(data_mod, "build_tokenizer_from_args")


def _tokenizer_problems_fn():
    try:
        from . import tokenizers
    except ImportError:
        return None
    return getattr(tokenizers, "tokenizer_problems", None)


def validate(args) -> list[str]:
    if has_indexed_data():
        problems = list(data_mod.data_path_problems(args.data_path))
        check = _tokenizer_problems_fn()
        if check is not None and args.tokenizer_type not in _LOCAL_TOKENIZERS:
            problems += check(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                              tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
        return problems
    problems = []
    if args.tokenizer_type not in (None, *_LOCAL_TOKENIZERS):
        problems.append(f"--tokenizer-type {args.tokenizer_type} needs the data module's tokenizers, which this "
                        "checkout lacks; use ByteTokenizer (text files) or NullTokenizer with --mock-data")
    for path in args.data_path or ():
        if not os.path.isfile(path):
            problems.append(f"--data-path {path!r}: no such file; this checkout reads plain-text files (or drop "
                            "--data-path for the corpus in data/)")
    return problems


def build_sources(args):
    """(train, valid) sample sources; valid may be None. Sets ``args.padded_vocab_size``
    from a file-based tokenizer (Megatron-LM pads it to ``--make-vocab-size-divisible-by``)."""
    if args.tokenizer_type not in _LOCAL_TOKENIZERS and has_indexed_data():
        tokenizer = data_mod.build_tokenizer_from_args(args)
        args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by)
    return data_mod.build_datasets(args)
