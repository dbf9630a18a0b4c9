"""Enums and the error type shared by the launcher's argument parsing and validation
(kept apart so ``arguments.py`` and ``validation.py`` do not import each other)."""

from __future__ import annotations

import enum


class ArgumentError(ValueError):
    """A flag value or combination the script cannot run; the message names the
    offending value and the fix."""


class LRDecayStyle(enum.Enum):
    """Shape of the learning rate after warmup (Megatron-LM's ``--lr-decay-style``)."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"
    INVERSE_SQUARE_ROOT = "inverse-square-root"


class TokenizerType(enum.Enum):
    """Tokenizers this script can build without downloading anything (the data
    module may add more)."""

    BYTE = "ByteTokenizer"
    """One token per UTF-8 byte (vocabulary 256): the embedded corpus needs no files."""
    NULL = "NullTokenizer"
    """Megatron-LM's placeholder tokenizer for ``--mock-data`` with ``--vocab-size``."""


class Precision(enum.Enum):
    """Dtype of the model (compute) weights."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


BYTE_VOCAB_SIZE = 256
