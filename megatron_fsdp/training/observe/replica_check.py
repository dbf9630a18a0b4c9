"""``--check-weight-hash-across-dp-replicas-interval N``: every N iterations, confirm
that the data-parallel replicas of the weights are bit-identical, as Megatron-LM's
``check_param_hashes_across_dp_replicas(cross_check=True)`` does: a SHA-1 of each
parameter's compute weights on every rank, gathered and compared. A mismatch (silent
data corruption, a rank that diverged) stops the run, naming the parameters and the
ranks, before the next iteration changes anything.

The compute weights are whole on every rank under PyTorch DDP and Megatron-FSDP's
``no_shard``, ``optim`` and ``optim_grads``; ``optim_grads_params`` shards them, and
Megatron-LM refuses the check there too (validation.py). Like Megatron-LM's, the
check copies every weight to the host: it is meant for an interval of hundreds of
iterations, not every one.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp as mf


class ReplicaMismatchError(RuntimeError):
    """The data-parallel replicas of some weights differ."""


def _megatron_fsdp(model: nn.Module):
    """The MegatronFSDP wrapper of ``model`` (itself, or inside Megatron-core's adapter), or None."""
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, mf.MegatronFSDP):
            return candidate
    return None


def _digests(named) -> list[tuple[str, bytes]]:
    return [(name, hashlib.sha1(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).digest())
            for name, p in named]


def weight_digests(model: nn.Module) -> list[tuple[str, bytes]]:
    """(name, SHA-1 of the compute weights) per parameter, on this rank."""
    fsdp = _megatron_fsdp(model)
    if fsdp is None:  # PyTorch DDP: its parameters are the weights every replica holds
        return _digests(getattr(model, "module", model).named_parameters())
    fsdp.settle_weights_for_reading()  # the weight refresh of the last step, and any edits since
    with fsdp.compute_params_registered() as module:
        return _digests(module.named_parameters())


def check_weight_replicas(model: nn.Module, iteration: int) -> None:
    """Raise ``ReplicaMismatchError`` on every rank when any replica differs. Collective."""
    mine = weight_digests(model)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differing = sorted({name for theirs in everyone for (name, digest), (_, first) in zip(theirs, everyone[0])
                        if digest != first})
    if differing:
        ranks = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
        raise ReplicaMismatchError(
            f"iteration {iteration}: the data-parallel replicas of {', '.join(differing)} differ (ranks {ranks} "
            "against rank 0; --check-weight-hash-across-dp-replicas-interval). A rank's weights were corrupted or "
            "it diverged: restart from the last checkpoint, and check the hardware of those ranks"
        )


__all__ = ["ReplicaMismatchError", "check_weight_replicas", "weight_digests"]
