"""The gradient norm of a sharded model, and clipping by it, for every layout.

[Note: the norm under expert parallelism] torch's ``clip_grad_norm_`` stacks the
per-parameter norms, which it can only do for DTensors on one mesh; a model whose
parameters live on several (dense data-parallel, tensor-parallel, expert
data-parallel) stops with "All operands ... must have the same mesh". And under expert
parallelism even one mesh would not do: each expert-parallel rank holds other experts,
so the expert mesh's norm is the norm of this rank's experts only. Here the parameters
are grouped by mesh; each group's norm is reduced over its own mesh (DTensor does it:
the pieces' partial norms), the expert group's is then combined over the
expert-parallel ranks (sum of p-th powers, or max for the inf norm), and the groups'
norms are combined once more. Every rank ends with the same total and scales its own
pieces, as Megatron-core's ``get_grad_norm_fp32`` with its model-parallel reduction and
torchtitan's expert-parallel clipping do. No host synchronisation: the total stays on
the device.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm", "total_grad_norm"]


def _norm_of(grads: list[torch.Tensor], norm_type: float, foreach: Optional[bool]) -> torch.Tensor:
    """The norm of one mesh's gradients, whole over that mesh, as a plain tensor."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _combine(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    stacked = torch.stack([n.float().reshape(()) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def _over_ranks(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """Combine this rank's norm of its own experts with the other expert-parallel ranks'."""
    if math.isinf(norm_type):
        norm = norm.clone()
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    power = norm.float().pow(norm_type)
    dist.all_reduce(power, group=group)
    return power.pow(1.0 / norm_type)


def total_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0, *,
                    expert_mesh_group: Optional[tuple] = None, foreach: Optional[bool] = None) -> torch.Tensor:
    """The norm of all gradients of ``params`` (distributed parameters), on the device.
    ``expert_mesh_group``: (the experts' DTensor mesh, the expert-parallel group) when
    experts are spread over several ranks; gradients on that mesh are combined over it."""
    by_mesh: dict = {}
    for param in params:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param.grad)
    norms = []
    for mesh, grads in by_mesh.items():
        norm = _norm_of(grads, norm_type, foreach)
        if expert_mesh_group is not None and mesh is not None and mesh == expert_mesh_group[0]:
            norm = _over_ranks(norm, norm_type, expert_mesh_group[1])
        norms.append(norm)
    if not norms:
        return torch.zeros(())
    return _combine(norms, norm_type)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                   error_if_nonfinite: bool = False, expert_mesh_group: Optional[tuple] = None,
                   foreach: Optional[bool] = None) -> torch.Tensor:
    """Scale the gradients so that their total norm is at most ``max_norm`` (torch's
    ``clip_grad_norm_`` rule: coefficient max_norm / (norm + 1e-6), clamped at 1) and
    return the total norm before clipping."""
    params = list(params)
    total = total_grad_norm(params, norm_type, expert_mesh_group=expert_mesh_group, foreach=foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
                           "clipped; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in params:
        if param.grad is not None:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            grad.mul_(coef.to(grad.device, grad.dtype))
    return total
