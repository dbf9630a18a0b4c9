"""Public entry points of experimental fully_shard: ``Placements``,
``fully_shard_context``, ``fully_shard`` and ``microbatch``.

Usage, bottom-up like FSDP2::

    mesh = init_device_mesh("cpu", (world,))
    with fully_shard_context() as context:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, placements=placements)
        fully_shard(model, mesh=mesh, placements=placements)
    optimizer = torch.optim.AdamW(model.parameters(), ...)
    fully_shard_optimizer(optimizer)

Code written for upstream's 0.6.1 release (no context, its own ``Replicate`` / ``Partial``,
``microbatch(model, is_last)``) runs unchanged: see upstream_placements.py [Note: two
generations of the experimental API] and ``_implicit_context``.

With tensor parallelism, as FSDP2: one mesh, the TP plan on its ``tp`` part, the
data-parallel part to ``fully_shard`` (tensor_parallel.py [Note: tensor-parallel
modules])::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
    with fully_shard_context():
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], placements=placements)
        fully_shard(model, mesh=mesh["dp"], placements=placements)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Optional, Union

import torch
from torch import nn
from torch.distributed import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from ..comm import device as device_lib
from ..runtime.hooks import guard_hooks_under_compile
from ..mixed_precision import MixedPrecisionPolicy
from ..runtime.wrapped_model_guards import refuse_new_parameters
from .module import FsdpContext, FsdpModule
from .parameter_group import owns_parameter
from .upstream_placements import as_torch_placement

__all__ = ["Placements", "fully_shard", "fully_shard_context", "microbatch"]

MeshAxis = Union[int, str]

_CONTEXT: contextvars.ContextVar[Optional[FsdpContext]] = contextvars.ContextVar("mfsdp_experimental", default=None)
_IMPLICIT: contextvars.ContextVar[Optional[FsdpContext]] = contextvars.ContextVar("mfsdp_experimental_implicit",
                                                                                  default=None)


@dataclasses.dataclass(frozen=True)
class Placements:
    """Placements of parameters, gradients and optimizer state along the data-parallel
    mesh axes (use torch's ``Shard(0)``, ``Replicate()``, ``Partial("avg")``).

    ZeRO-3: all ``Shard(0)``. ZeRO-1: parameter ``Replicate``, gradient ``Partial``,
    optimizer ``Shard(0)``. HSDP on a 2-d mesh: ``[Replicate, Shard(0)]`` with
    gradient ``[Partial, Shard(0)]``.
    """

    dp_axes: Sequence[MeshAxis]
    """Mesh axes (index or name) forming data parallelism, in mesh order; today every axis."""
    parameter: Sequence[Placement]
    """Compute-weight placements, one per dp axis."""
    gradient: Sequence[Placement]
    """Main-gradient placements between microbatches, one per dp axis."""
    optimizer: Sequence[Placement]
    """Main-weight (optimizer) placements, one per dp axis."""

    def __post_init__(self) -> None:
        for field in ("parameter", "gradient", "optimizer"):
            value = tuple(as_torch_placement(p) for p in getattr(self, field))  # upstream 0.6.1's classes
            object.__setattr__(self, field, value)
            if len(value) != len(self.dp_axes):
                raise ValueError(
                    f"Placements.{field} has {len(value)} entries for {len(self.dp_axes)} dp_axes; give one per axis"
                )


@contextlib.contextmanager
def fully_shard_context(
    device: Optional[torch.device] = None,
    *,
    use_symmetric_memory: bool = False,
    unify_communication_stream: bool = False,
) -> Iterator[FsdpContext]:
    """Build FsdpModules that share prefetch orders and microbatch state; the model
    may run once the block exits.

    Args:
        device: where sharded buffers live; default: the current CUDA device under
            NCCL, else the CPU (upstream requires CUDA; this one also runs on gloo).
        use_symmetric_memory: NCCL symmetric-memory buffers; not supported here.
        unify_communication_stream: accepted, inert (no side streams here).
    """
    if _CONTEXT.get() is not None:
        raise RuntimeError("fully_shard_context does not nest; shard every module inside one context")
    if use_symmetric_memory:
        raise NotImplementedError(
            "use_symmetric_memory=True (NCCL symmetric memory) is not implemented in megatron_fsdp.experimental; "
            "leave it False"
        )
    context = FsdpContext(device_lib.resolve_device(device), unify_communication_stream=unify_communication_stream)
    token = _CONTEXT.set(context)
    try:
        yield context
        context.finalize()
    finally:
        _CONTEXT.reset(token)


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements,
    mixed_precision_policy: Optional[MixedPrecisionPolicy] = None,
    grad_divisor: int = 1,
    *,
    use_symm_mem: bool = False,
) -> FsdpModule:
    """Shard the parameters of ``module`` not already owned by a sharded descendant,
    in place.

    The module's class becomes a subclass of ``FsdpModule`` (it keeps its identity,
    so parents need no rewiring; ``isinstance(module, FsdpModule)`` holds); its
    parameters become sharded DTensors. Returns ``module`` itself, as torch FSDP2's
    ``fully_shard`` does (upstream returns ``None``; code written for either works:
    ``model = fully_shard(model, ...)`` and a bare ``fully_shard(block, ...)``).

    Args:
        mesh: device mesh whose axes are the data-parallel axes. For a module whose
            parameters are DTensors of a tensor-parallel plan, the data-parallel part
            of the mesh the plan's ``tp`` mesh was taken from (``mesh["dp"]``, or
            ``mesh["dp_outer", "dp_shard"]`` for HSDP): the TP-local tensors are sharded,
            gathered and reduced over it, and the sharded parameters are DTensors over
            its axes and tp.
        placements: see ``Placements``.
        mixed_precision_policy: default fp32 main weights, main gradients in the
            parameter dtype (build the model in bf16 for bf16 compute).
        grad_divisor: extra divisor of the reduced gradient, on top of the mean over
            the mesh: ``ep_size`` for expert weights whose gradients already sum
            over the expert-parallel ranks' tokens.
        use_symm_mem: upstream 0.6.1's NCCL symmetric-memory staging buffers; not
            supported here (``True`` raises).

    Outside a ``fully_shard_context`` (upstream 0.6.1's usage) the modules sharded until the
    model first runs share one implicit context (``_implicit_context``).
    """
    if isinstance(module, FsdpModule):
        raise ValueError(f"{type(module).__name__} is already sharded by fully_shard; call it once per module")
    _check_upstream_options(grad_divisor, use_symm_mem)
    context = _CONTEXT.get() or _implicit_context()
    for name, sub in module.named_modules():
        if isinstance(sub, FsdpModule) and sub.context is not context:
            raise ValueError(
                f"submodule {name!r} of this {type(module).__name__} was sharded in another fully_shard_context; "
                "a model's modules share one context (their prefetch orders span it): shard them all "
                "inside one `with fully_shard_context():`, or all outside any context before the model first runs"
            )
    if not isinstance(placements, Placements):
        raise TypeError(
            f"fully_shard(placements={placements!r}): pass a megatron_fsdp.experimental.Placements naming the "
            "data-parallel mesh axes and the parameter, gradient and optimizer placements, e.g. "
            "Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)]) for ZeRO-3"
        )
    _check_dp_axes(mesh, placements.dp_axes)
    guard_hooks_under_compile()  # hooks.py [Note: compiled graphs and unit hooks]
    policy = mixed_precision_policy or MixedPrecisionPolicy()
    original = type(module)
    module.__class__ = type(f"ExperimentalFsdp{original.__name__}", (FsdpModule, original), {})
    try:
        cast_module: FsdpModule = module  # type: ignore[assignment]
        cast_module._fsdp_init(
            context,
            mesh,
            model_weight_placements=tuple(placements.parameter),
            main_grad_placements=tuple(placements.gradient),
            main_weight_placements=tuple(placements.optimizer),
            mixed_precision_policy=policy,
            grad_divisor=grad_divisor,
        )
    except Exception:
        module.__class__ = original
        raise
    # wrapped_model_guards.py [Note: parameters added after wrapping]: the groups write their
    # own parameters back into the modules, over any assigned later.
    refuse_new_parameters(module, owns=owns_parameter)
    return cast_module


def _check_upstream_options(grad_divisor: object, use_symm_mem: bool) -> None:
    """Upstream 0.6.1's fifth parameter is ``use_symm_mem``, this one's ``grad_divisor``: a
    boolean there is 0.6.1 code passing it by position, never a divisor."""
    if isinstance(grad_divisor, bool):
        raise TypeError(
            f"fully_shard's fifth positional argument is grad_divisor here, got {grad_divisor}: upstream 0.6.1 code "
            "passes use_symm_mem there; pass it by keyword (use_symm_mem=...)")
    if use_symm_mem:
        raise NotImplementedError(
            "fully_shard(use_symm_mem=True) (NCCL symmetric-memory staging buffers) is not implemented in "
            "megatron_fsdp.experimental; leave it False")


def _implicit_context() -> FsdpContext:
    """[Note: the implicit context] Upstream 0.6.1 has no ``fully_shard_context``: its modules
    find their root when the model first runs. Here the ``fully_shard`` calls made outside any
    context join one implicit context, which finalizes itself (roots, names, prefetch orders)
    at the model's first forward; a ``fully_shard`` after that opens a new one (a new model)."""
    context = _IMPLICIT.get()
    if context is None or context.finalized:
        context = FsdpContext(device_lib.resolve_device(None), implicit=True)
        _IMPLICIT.set(context)
    return context


def _check_dp_axes(mesh: DeviceMesh, dp_axes: Sequence[MeshAxis]) -> None:
    names = mesh.mesh_dim_names or ()
    indices = []
    for axis in dp_axes:
        if isinstance(axis, str):
            if axis not in names:
                raise ValueError(f"dp axis {axis!r} is not a mesh dim name ({names})")
            axis = names.index(axis)
        elif not -mesh.ndim <= axis < mesh.ndim:
            raise ValueError(f"dp axis {axis} is out of range for a {mesh.ndim}-d mesh")
        indices.append(axis % mesh.ndim)
    if indices != list(range(mesh.ndim)):
        raise NotImplementedError(
            f"dp_axes={list(dp_axes)} must name every mesh axis in order; pass the data-parallel "
            "sub-mesh (e.g. mesh['dp']) instead of a larger mesh"
        )


@contextlib.contextmanager
def microbatch(context: Union[FsdpContext, nn.Module, None] = None, is_last: Optional[bool] = None, *,
               module: Optional[nn.Module] = None) -> Iterator[None]:
    """Mark the microbatches of a gradient-accumulation step. Needed where gradients
    rest Partial across microbatches (HSDP, ZeRO-1/2): only the last one reduces
    them. Plain ZeRO-3 reduces every backward and accumulates either way.

    ``context``: the ``fully_shard_context``'s context, or a module whose tree holds the
    sharded modules (upstream 0.6.1's form, also by its keyword ``module=``)."""
    if (context is None) == (module is None) or is_last is None:
        raise TypeError("microbatch(context_or_module, is_last): pass the context (or the sharded model) and is_last")
    target = context if context is not None else module
    contexts = [target] if isinstance(target, FsdpContext) else _contexts_of(target)
    previous = []
    for each in contexts:
        each.ensure_finalized()
        previous.append(each.is_last_microbatch)
        each.is_last_microbatch = is_last
    try:
        yield
    finally:
        for each, was in zip(contexts, previous):
            each.is_last_microbatch = was


def _contexts_of(module: nn.Module) -> list[FsdpContext]:
    """The contexts of the sharded modules in ``module``'s tree, each once."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"microbatch({module!r}, ...): pass the fully_shard_context's context or the sharded model")
    found = {id(m.context): m.context for m in module.modules() if isinstance(m, FsdpModule)}
    if not found:
        raise ValueError(f"microbatch: no module in this {type(module).__name__} was sharded by fully_shard")
    return list(found.values())
