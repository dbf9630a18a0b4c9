"""Enums and the error type shared by the launcher's argument parsing and validation
(kept apart so ``arguments.py`` and ``validation.py`` do not import each other)."""

from __future__ import annotations

import enum


class ArgumentError(ValueError):
    """A flag value or combination the script cannot run; the message names the
    offending value and the fix."""


def recompute_granularity(args) -> "str | None":
    """The recomputation Megatron-LM applies: ``--recompute-activations`` is its older
    spelling of ``--recompute-granularity selective`` and wins over it."""
    return "selective" if args.recompute_activations else args.recompute_granularity


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


class DataParallelPath(enum.Enum):
    """How the launcher wraps the model (``derive_fields`` picks it from the flags).

    [Note: Megatron-core DDP on this engine] Without ``--use-megatron-fsdp``,
    Megatron-LM trains with megatron-core's DDP: the model in its compute dtype, a
    gradient buffer (fp32 for bf16 models unless ``--grad-reduce-in-bf16``; the model's
    dtype for fp16 unless ``--accumulate-allreduce-grads-in-fp32``), fp32 main weights
    in the optimizer, and with ``--use-distributed-optimizer`` the optimizer state and
    main weights sharded (ZeRO-1). Megatron-FSDP's ``no_shard`` and ``optim``
    strategies are that design, so such runs use them with those dtypes. PyTorch DDP
    remains for fp32 without a distributed optimizer, where it gives the same numbers
    (up to the order of the gradient sum); PyTorch DDP with bf16/fp16 would keep fp32
    weights under autocast (an fp32 residual stream and norms, unlike Megatron-LM)."""

    MEGATRON_FSDP = "megatron-fsdp"
    """``--use-megatron-fsdp``: the strategy of ``--data-parallel-sharding-strategy``."""
    MEGATRON_DDP = "megatron-ddp"
    """Megatron-core DDP (+ distributed optimizer): ``no_shard`` or ``optim``."""
    TORCH_DDP = "torch-ddp"
    """fp32, no distributed optimizer: PyTorch DDP."""
    TORCH_FSDP2 = "torch-fsdp2"
    """``--use-torch-fsdp2``: PyTorch's FSDP2 (``fully_shard``), fp32 or bf16 (torch_fsdp2.py)."""
    MEGATRON_FSDP_V2 = "megatron-fsdp-v2"
    """``--use-megatron-fsdp --megatron-fsdp-version 2``: the per-module API, ZeRO-3, a plain
    optimizer on the sharded main weights (megatron_fsdp_v2.py)."""


BYTE_VOCAB_SIZE = 256
