"""The launcher's side of the data module: the model's vocabulary size from the
tokenizer, and the (train, valid) sources.

The data module (``megatron_fsdp/training/data``) owns datasets and tokenizers; the
launcher asks it through two calls: ``data_args_problems`` (every problem of
``--data-path``/``--mock-data``/``--split`` and the tokenizer flags, called by
validation before any process group) and ``build_datasets`` (here).
"""

from __future__ import annotations

from . import from_args as data_mod
from ..args.arg_types import TokenizerType
from ..args.validation import padded_vocab_size

_LOCAL_TOKENIZERS = (TokenizerType.BYTE.value, TokenizerType.NULL.value)


def build_sources(args):
    """(train, valid) sample sources; valid may be None. Sets ``args.padded_vocab_size``
    from a file-based tokenizer (Megatron-LM pads it to ``--make-vocab-size-divisible-by``)."""
    if args.tokenizer_type not in _LOCAL_TOKENIZERS:
        tokenizer = data_mod.build_tokenizer_from_args(args)
        args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by)
    return data_mod.build_datasets(args)
