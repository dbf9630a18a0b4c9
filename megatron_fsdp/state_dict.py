"""State dicts of a sharded model: sharded (DTensor) for checkpoints, full for export.

[Note: uneven DTensor shards] A parameter's local shard is a flat slice of a flat
buffer: possibly uneven across ranks, possibly empty, possibly starting mid-row.
DTensor's own metadata assumes ``torch.chunk``-style splits, so for
``torch.distributed.checkpoint`` each local tensor carries its true extent: the
flat slice is cut into rectangular boxes (``layout.flat_range_boxes``) addressed by
global offsets. DCP asks the local tensor for them through the hooks DTensor
forwards (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``). Because loads plan reads from global offsets, a
checkpoint written with one world size / strategy loads into another.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .layout import flat_range_boxes

if TYPE_CHECKING:
    from .megatron_fsdp import MegatronFSDP

logger = logging.getLogger(__name__)


class StateDictMismatchError(RuntimeError):
    """Keys or shapes of a state dict / checkpoint do not match the model."""


# -- DCP metadata for flat shards -----------------------------------------------------
def attach_dcp_chunks(local: torch.Tensor, global_shape: torch.Size, flat_start: int) -> None:
    """Teach DCP where the flat ``local`` slice (starting at ``flat_start`` in the
    parameter's flat order) lies inside the global tensor (see the note above)."""
    boxes = flat_range_boxes(tuple(global_shape), flat_start, flat_start + local.numel())
    by_offsets = {box.offsets: box for box in boxes}
    size = torch.Size(global_shape)

    def chunk(box) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))

    def create_write_items(fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk(box), properties=properties, size=size),
            )
            for box in boxes
        ]

    def create_chunk_list() -> list[ChunkStorageMetadata]:
        return [chunk(box) for box in boxes]

    def get_tensor_shard(index: MetadataIndex) -> torch.Tensor:
        box = by_offsets[tuple(index.offset)]
        return local[box.flat_start : box.flat_start + box.numel].view(box.sizes)

    local.__create_write_items__ = create_write_items
    local.__create_chunk_list__ = create_chunk_list
    local.__get_tensor_shard__ = get_tensor_shard
    local.__megatron_fsdp_extent__ = (size, flat_start)


def clone_for_load(value: Any) -> Any:
    """A private copy to load into, keeping the DCP chunk metadata of ``value``."""
    if not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    if isinstance(value, DTensor):
        extent = getattr(value._local_tensor, "__megatron_fsdp_extent__", None)
        if extent is not None:
            attach_dcp_chunks(copy._local_tensor, *extent)
    return copy


def checkpointable(value: torch.Tensor, like: torch.Tensor, flat_start: int) -> torch.Tensor:
    """A detached DTensor sharing ``value``'s storage, with DCP chunk metadata."""
    if not isinstance(value, DTensor):
        return value.detach()
    fresh = value.detach()
    attach_dcp_chunks(fresh._local_tensor, like.shape, flat_start)
    return fresh


# -- model state dicts -----------------------------------------------------------------
def sharded_state_dict(model: "MegatronFSDP", *, prefix: str = "", keep_vars: bool = False) -> "OrderedDict[str, Any]":
    """Main weights (DTensors where sharded) and persistent buffers, keyed like the wrapped module."""
    buffer = model.param_and_grad_buffer
    out: "OrderedDict[str, Any]" = OrderedDict()
    preprocess = getattr(model, "preproc_state_dict_for_dcp_ckpt", True)
    for name, param in buffer.named_dist_params():
        if keep_vars:
            out[prefix + name] = param
        elif preprocess:
            out[prefix + name] = checkpointable(param, param, buffer.local_flat_start(param))
        else:
            out[prefix + name] = param.detach()
    for name, value in _persistent_buffers(model.module):
        out[prefix + name] = value if keep_vars else value.detach()
    return out


def _persistent_buffers(module: nn.Module):
    for name, value in module.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if attr not in owner._non_persistent_buffers_set:
            yield name, value


def _describe(value: Any) -> str:
    return f"{tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


@torch.no_grad()
def load_sharded_state_dict(model: "MegatronFSDP", state_dict: Mapping[str, Any], *, strict: bool = True):
    """Load main weights from DTensors of the same sharding (e.g. filled by DCP) or
    from plain full tensors (a pretrained model); then refresh the compute weights.

    Everything is validated before anything is written, so a mismatch never leaves
    the model half-loaded.
    """
    own = sharded_state_dict(model, keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    mismatched = [
        f"{k}: checkpoint {_describe(state_dict[k])} vs model {_describe(own[k])}"
        for k in own
        if k in state_dict and (not isinstance(state_dict[k], torch.Tensor) or state_dict[k].shape != own[k].shape)
    ]
    problems = []
    if mismatched:
        problems.append("shape mismatch for " + "; ".join(mismatched))
    if strict and missing:
        problems.append(f"missing keys {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected}")
    sources = {}
    for key in own:
        if key in state_dict and not mismatched:
            try:
                sources[key] = _local_source(model, key, own[key], state_dict[key])
            except ValueError as exc:
                problems.append(str(exc))
    if problems:
        raise StateDictMismatchError(
            "cannot load the state dict into the model (nothing was loaded): " + "; ".join(problems)
        )
    if missing or unexpected:
        logger.warning("load_state_dict(strict=False): missing keys %s, unexpected keys %s", missing, unexpected)
    for key, source in sources.items():
        target = own[key].to_local() if isinstance(own[key], DTensor) else own[key]
        if source.data_ptr() != target.data_ptr():
            target.copy_(source.view_as(target))
    model.install_optimized_model_weights()
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _local_source(model: "MegatronFSDP", key: str, own: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The part of ``value`` that this rank's ``own`` tensor holds."""
    if not isinstance(own, DTensor):
        return value.to_local() if isinstance(value, DTensor) else value
    local = own.to_local()
    if isinstance(value, DTensor):
        if value.to_local().shape != local.shape:
            raise ValueError(
                f"{key}: the DTensor's local shard {tuple(value.to_local().shape)} was cut for another sharding "
                f"than this model's {tuple(local.shape)}; load it through torch.distributed.checkpoint, which "
                "reshards, or pass full tensors"
            )
        return value.to_local()
    start = model.param_and_grad_buffer.local_flat_start(own)
    return value.reshape(-1)[start : start + local.numel()]


def get_full_state_dict(
    model: "MegatronFSDP",
    *,
    dtype: Optional[torch.dtype] = None,
    device: "torch.device | str" = "cpu",
    rank0_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Every parameter's full main weights (and the module's buffers) as plain
    tensors keyed like the unwrapped module, gathered one group at a time into
    ``device`` (host memory by default); ``rank0_only``: the other ranks get ``{}``.
    Collective: every rank of the shard group must call it (full_state_dict.py)."""
    from .full_state_dict import gather_full_state_dict

    return gather_full_state_dict(model, dtype=dtype, device=device, rank0_only=rank0_only)


def save_full_state_dict(model: "MegatronFSDP", path: str, *, dtype: Optional[torch.dtype] = None) -> None:
    """Export: rank 0 writes a plain ``torch.save`` state dict loadable by the
    unwrapped model class. Collective."""
    full = get_full_state_dict(model, dtype=dtype, rank0_only=True)
    if torch.distributed.get_rank() == 0:
        torch.save(full, path)
    torch.distributed.barrier()


def load_full_state_dict(model: "MegatronFSDP", state_dict: Mapping[str, torch.Tensor], *, strict: bool = True):
    """Import a plain (unsharded) state dict, e.g. pretrained weights, into a sharded model."""
    return load_sharded_state_dict(model, state_dict, strict=strict)
