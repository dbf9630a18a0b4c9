"""Tensor-parallel parameters: what each one is across the ``tp`` mesh dimension.

[Note: tensor-parallel parameters] FSDP composes with tensor parallelism by sharding
each rank's *TP-local* tensor over the data-parallel ranks that hold the same TP
piece (torchtitan and FSDP2 do the same). So the engine (layouts, buffers, gathers,
reductions) only ever sees plain local tensors: at wrapping, a parameter that is a
DTensor over the tensor-parallel mesh (PyTorch's ``parallelize_module``, Hugging
Face ``tp_plan``) is replaced by a plain parameter holding its local tensor, and a
``TPSpec`` remembers the rest: the mesh, the placement, the global shape. The spec
is used in three places:

* while the module runs, its code reads a DTensor view of the compute parameter
  (``TPSpec.module_view``), as the TP plan's hooks expect. ``DTensor.from_local`` is
  differentiable and its backward redistributes the gradient to the parameter's
  placement: a ``Partial`` gradient (a ``Replicate`` norm weight under sequence
  parallelism) is summed over the TP ranks there, as FSDP2 does before its
  reduce-scatter, and the engine receives the plain local gradient;
* the distributed parameters are DTensors over the data-parallel dimensions *and*
  ``tp``, so norms and clipping count a TP-sharded element once on its TP rank and
  a replicated one once (``with_dp``);
* state dicts hand out DTensors over the same mesh whose ``full_tensor()`` is the
  whole weight, and loading cuts this rank's TP piece from any layout (``local_of``).

Megatron-core's tensor-parallel layers keep plain parameters marked
``tensor_model_parallel`` / ``partition_dim`` and do their own communication; their
spec only serves the last two uses (``TPKind.MEGATRON``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..param_marks import is_expert_param

__all__ = ["TPKind", "TPSpec", "check_tensor_parallel", "extract_tensor_parallel", "restore_dtensor_params",
           "tp_mesh_matches"]


class TPKind(enum.Enum):
    DTENSOR = enum.auto()
    """The module's code reads a DTensor over the TP mesh (PyTorch's TP plans)."""
    MEGATRON = enum.auto()
    """Megatron-core's TP layers: the module reads the plain local tensor."""
    REPLICATED = enum.auto()
    """A plain parameter of a TP model: the same on every TP rank, read as is."""


@dataclasses.dataclass(frozen=True, eq=False)
class TPSpec:
    """One parameter across the tensor-parallel ranks."""

    kind: TPKind
    mesh: DeviceMesh
    """The 1-D tensor-parallel mesh."""
    placement: Placement
    """``Shard(d)`` or ``Replicate()``."""
    global_shape: torch.Size
    global_stride: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        return isinstance(self.placement, Shard)

    def dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's TP piece) as the DTensor over the TP mesh it is a piece of
        (differentiable, as ``DTensor.from_local``)."""
        return DTensor.from_local(local, self.mesh, (self.placement,), run_check=False,
                                  shape=self.global_shape, stride=self.global_stride)

    def module_view(self, local: torch.Tensor) -> torch.Tensor:
        """What the module's code reads while it runs (a DTensor for PyTorch TP plans)."""
        return self.dtensor(local) if self.kind is TPKind.DTENSOR else local

    def with_dp(self, dp_placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """Placements over (data-parallel dims..., tp). A data-parallel ``Shard(0)`` of
        a tensor the TP dimension also splits on dim 0 holds rows of the TP piece, not
        of the whole: ``_StridedShard`` says so (FSDP2's 2-D layout)."""
        tp = self.mesh.size()
        dp = tuple(
            _StridedShard(0, split_factor=tp) if isinstance(p, Shard) and p.dim == 0 and self.sharded
            and self.placement.dim == 0 else p
            for p in dp_placements
        )
        return dp + (self.placement,)

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's piece of the whole tensor (``torch.chunk``'s split, as DTensor)."""
        if not self.sharded:
            return full
        dim = self.placement.dim
        pieces = torch.chunk(full, self.mesh.size(), dim=dim)
        rank = self.mesh.get_local_rank()
        if rank < len(pieces):
            return pieces[rank]
        return full.narrow(dim, full.shape[dim], 0)


def tp_mesh_matches(mesh: DeviceMesh, tp_mesh: Optional[DeviceMesh]) -> bool:
    """Whether a parameter's DTensor mesh is the wrapper's tensor-parallel sub-mesh (same ranks)."""
    return (
        tp_mesh is not None
        and mesh.ndim == 1
        and mesh.device_type == tp_mesh.device_type
        and torch.equal(mesh.mesh, tp_mesh.mesh)
    )


def _refuse(name: str, param: DTensor, tp_mesh: Optional[DeviceMesh], why: str) -> None:
    raise ValueError(
        f"parameter {name!r} is a DTensor on {param.device_mesh} with placements {tuple(param.placements)}: {why}. "
        "megatron_fsdp shards the data-parallel dimension of a tensor-parallel model: apply the TP plan on "
        "device_mesh[tp_dim] (one placement, Shard(d) or Replicate()) and wrap with the whole mesh, e.g. "
        "fully_shard_model(model, device_mesh=mesh, dp_shard_dim='dp', tp_dim='tp')"
        + ("" if tp_mesh is not None else "; no tp_dim of size > 1 was given")
    )


def _dtensor_spec(name: str, param: DTensor, tp_mesh: Optional[DeviceMesh]) -> TPSpec:
    if not tp_mesh_matches(param.device_mesh, tp_mesh):
        _refuse(name, param, tp_mesh, f"its mesh is not the wrapper's tensor-parallel mesh {tp_mesh}")
    (placement,) = param.placements
    if type(placement) not in (Shard, Replicate):
        _refuse(name, param, tp_mesh, f"{placement} cannot be sharded further")
    return TPSpec(TPKind.DTENSOR, tp_mesh, placement, param.shape, tuple(param.stride()))


def _megatron_spec(param: torch.Tensor, tp_mesh: DeviceMesh) -> TPSpec:
    if not getattr(param, "tensor_model_parallel", False):
        return TPSpec(TPKind.REPLICATED, tp_mesh, Replicate(), param.shape, tuple(param.stride()))
    dim = getattr(param, "partition_dim", 0)
    if getattr(param, "partition_stride", 1) != 1:
        raise NotImplementedError(
            f"a megatron-core tensor-parallel parameter of shape {tuple(param.shape)} has partition_stride="
            f"{param.partition_stride}: its TP pieces interleave, which no DTensor placement describes; "
            "build the layer with stride=1"
        )
    shape = list(param.shape)
    shape[dim] *= tp_mesh.size()
    return TPSpec(TPKind.MEGATRON, tp_mesh, Shard(dim), torch.Size(shape), _contiguous_stride(shape))


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _plain_twin(param: DTensor) -> nn.Parameter:
    local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
    for key, value in vars(param).items():  # Megatron attributes and megatron_fsdp marks
        if not key.startswith("_"):
            setattr(local, key, value)
    return local


def check_tensor_parallel(module: nn.Module, tp_mesh: Optional[DeviceMesh]) -> dict[int, TPSpec]:
    """Refuse, changing nothing, a DTensor parameter on any mesh but ``tp_mesh`` or with
    a placement the engine cannot shard, and expert parameters in a tensor-parallel
    model; ``id(parameter)`` -> spec of the DTensor ones."""
    specs = {id(p): _dtensor_spec(name, p, tp_mesh) for name, p in module.named_parameters()
             if isinstance(p, DTensor)}
    if specs or (tp_mesh is not None and tp_mesh.size() > 1):
        experts = [name for name, p in module.named_parameters() if is_expert_param(p)]
        if experts:
            raise NotImplementedError(
                f"expert parameters ({experts[0]!r} and {len(experts) - 1} more, marked allreduce=False) in a "
                "tensor-parallel model: expert parallelism combined with tensor parallelism is not implemented; "
                "use a tensor-parallel size of 1 for MoE models"
            )
    return specs


@torch.no_grad()
def extract_tensor_parallel(
    module: nn.Module, tp_mesh: Optional[DeviceMesh], replaced: Optional[dict[int, nn.Parameter]] = None
) -> dict[nn.Parameter, TPSpec]:
    """Replace every DTensor parameter on ``tp_mesh`` by a plain parameter holding its
    local tensor; return plain parameter -> ``TPSpec`` for every parameter when tensor
    parallelism is in use (``tp_mesh`` larger than 1, or DTensor parameters), else
    for none. A DTensor on any other mesh or placement is refused before anything
    changes. ``replaced`` receives ``id(DTensor parameter)`` -> its plain twin (an
    optimizer built on the original parameters is rebuilt through it)."""
    specs = check_tensor_parallel(module, tp_mesh)
    if tp_mesh is None or (tp_mesh.size() == 1 and not specs):
        return {}
    twins = replaced if replaced is not None else {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if isinstance(p, DTensor):
                twin = twins.setdefault(id(p), _plain_twin(p))  # tied weights stay tied
                sub._parameters[name] = twin
    result = {twins[key]: spec for key, spec in specs.items()}
    for _, p in module.named_parameters():
        if p not in result:
            result[p] = _megatron_spec(p, tp_mesh)
    return result


@torch.no_grad()
def restore_dtensor_params(module: nn.Module, specs: dict[nn.Parameter, TPSpec]) -> None:
    """Undo ``extract_tensor_parallel`` on an unwrapped module: plain TP pieces become
    DTensor parameters over the TP mesh again (tied ones stay tied)."""
    made: dict[nn.Parameter, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            spec = specs.get(p)
            if spec is not None and spec.kind is TPKind.DTENSOR:
                if p not in made:
                    made[p] = nn.Parameter(spec.module_view(p.detach()), requires_grad=p.requires_grad)
                sub._parameters[name] = made[p]
