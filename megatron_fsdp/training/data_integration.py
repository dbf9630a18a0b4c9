"""The launcher's side of the data module: validation of the data flags and the
(train, valid) sources for a run.

The data module (``megatron_fsdp/training/data``) owns datasets and tokenizers.
When it provides Megatron-LM's builders (``build_tokenizer``,
``build_train_valid_test_datasets``) the launcher uses them for indexed datasets
and the file-based tokenizers; otherwise it trains on text files through the byte
tokenizer (or ``--mock-data``), and flags that need the builders are a clear error.
"""

from __future__ import annotations

import os

from . import data as data_mod
from .arg_types import TokenizerType

_LOCAL_TOKENIZERS = (TokenizerType.BYTE.value, TokenizerType.NULL.value)


def has_megatron_builders() -> bool:
    return hasattr(data_mod, "build_train_valid_test_datasets") and hasattr(data_mod, "build_tokenizer")


def validate(args) -> list[str]:
    if has_megatron_builders():
        validate_fn = getattr(data_mod, "validate_data_args", None)
        return list(validate_fn(args)) if validate_fn else []
    problems = []
    if args.tokenizer_type not in (None, *_LOCAL_TOKENIZERS):
        problems.append(f"--tokenizer-type {args.tokenizer_type} needs the data module's tokenizer builders, which "
                        "this checkout lacks; use ByteTokenizer (text files) or NullTokenizer with --mock-data")
    for path in args.data_path or ():
        if not os.path.isfile(path):
            problems.append(f"--data-path {path!r}: no such file; this checkout reads plain-text files (or drop "
                            "--data-path for the corpus in data/)")
    return problems


def build_sources(args):
    """(train, valid) sample sources; valid may be None."""
    if has_megatron_builders():
        tokenizer = data_mod.build_tokenizer(args)
        train, valid, _ = data_mod.build_train_valid_test_datasets(args, tokenizer)
        return train, valid
    return data_mod.build_datasets(args)
