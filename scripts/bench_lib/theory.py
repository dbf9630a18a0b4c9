"""What each implementation should move and hold: the theoretical minimum bytes per
collective per step, and the ZeRO memory formula per rank. Pure arithmetic.

[Note: the wrapping-aware minimum]
Both FSDP2 and megatron_fsdp shard the transformer blocks as units; the
parameters outside every block (embeddings, final norm, the tied head: the "root")
are gathered once before forward and kept until backward ends, since the
embedding is used first in forward and last in backward. So a ZeRO-3 step gathers
the block parameters twice and the root parameters once::

    all_gather     = elem * (2 * P_blocks + P_root)      (textbook ZeRO-3: 2 * P)
    reduce_scatter = elem * P

megatron_fsdp also keeps the last block gathered from its forward into its
backward (which follows at once), so it gathers ``P_last_block`` less.

The records carry both numbers; the test compares with the wrapping-aware one.
"""

from __future__ import annotations

import dataclasses

from .config import Family, ImplSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamCounts:
    total: int
    """Unique parameters (tied weights counted once)."""
    root: int
    """Parameters outside every transformer block."""
    last_block: int = 0
    """Parameters of the last transformer block."""

    @property
    def blocks(self) -> int:
        return self.total - self.root


def min_comm_bytes(spec: ImplSpec, counts: ParamCounts, elem: int) -> dict[str, int]:
    """Least payload per step per collective kind (``elem``: bytes per element on the wire)."""
    if spec.zero_level == 0:
        # DDP / ZeRO-0: one all-reduce of the gradients.
        return {"all_reduce": elem * counts.total}
    gathered = 2 * counts.blocks + counts.root if spec.gathers_params_twice else counts.total
    if spec.family is Family.EXPERIMENTAL:
        gathered = 2 * counts.total  # every module, the root too, is gathered again for backward
    if spec.gathers_params_twice and spec.family is Family.MEGATRON_FSDP:
        gathered -= counts.last_block
    return {"all_gather": elem * gathered, "reduce_scatter": elem * counts.total}


def textbook_comm_bytes(spec: ImplSpec, counts: ParamCounts, elem: int) -> dict[str, int]:
    """The same, ignoring that the root stays gathered (ZeRO-3 all-gathers 2 * P)."""
    if spec.zero_level == 0:
        return {"all_reduce": elem * counts.total}
    factor = 2 if spec.gathers_params_twice else 1
    return {"all_gather": elem * factor * counts.total, "reduce_scatter": elem * counts.total}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElementSizes:
    """Bytes per element of each kind of state, as the implementation stores it."""

    weights: int
    """Compute (model) weights."""
    main_weights: int = 4
    grads: int = 4
    optimizer_state: int = 8
    """AdamW: exp_avg + exp_avg_sq, fp32."""


def zero_formula(level: int, counts: ParamCounts, world: int, sizes: ElementSizes) -> dict[str, float]:
    """Textbook ZeRO per-rank bytes: 0 all replicated; 1 optimizer state / W; 2 grads / W too;
    3 weights / W too. No separate main weights."""
    p = counts.total
    return {
        "weights": sizes.weights * p / (world if level >= 3 else 1),
        "main_weights": 0.0,
        "grads": sizes.grads * p / (world if level >= 2 else 1),
        "optimizer_state": sizes.optimizer_state * p / (world if level >= 1 else 1),
    }


def expected_memory(spec: ImplSpec, counts: ParamCounts, world: int, sizes: ElementSizes) -> dict[str, float]:
    """The formula the implementation's persistent memory should match.

    megatron_fsdp keeps a main-weight buffer beside the model weights only when
    the compute dtype is narrower than the main dtype (bf16 compute, fp32 main):
    replicated at ZeRO-0 and sharded like the optimizer state from ZeRO-1 on. An
    fp32 model's weights are its main weights; the rest is the textbook formula.
    """
    formula = zero_formula(spec.zero_level, counts, world, sizes)
    if spec.family is Family.MEGATRON_FSDP and sizes.weights != sizes.main_weights:
        formula["main_weights"] = sizes.main_weights * counts.total / (world if spec.zero_level >= 1 else 1)
    return formula
