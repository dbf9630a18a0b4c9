"""DTensors whose shards are uneven along their sharded dimension: helpers under
upstream's module name ``megatron_fsdp.uneven_dtensor`` (re-exported there).

Standard DTensor APIs assume ``torch.chunk``-style shards (ceil-sized, the last
ones short or empty). A DTensor built with ``DTensor.from_local`` from shards of
other sizes (Megatron-LM's checkpoint converters make them; upstream's FSDP
parameters are such shards) holds the right data, but ``full_tensor()`` and DCP
would misplace it. These helpers learn every rank's real extent with one small
``all_gather_object`` per sharded mesh dimension and use it:

* ``uneven_dtensor_to_full_tensor``: the full tensor, on every rank;
* ``update_uneven_dtensor_chunk_metadata`` / ``preprocess_state_dict_for_uneven_dtensor``:
  tell DCP the real extent (it asks the local tensor through the hooks DTensor
  forwards), so saving and resharded loading place the data right;
* ``split_dtensor``: split along a dimension without any communication of data.

``model.state_dict()`` and ``optimizer.state_dict()`` of this package already
hold standard shards (model_state_dict.py, optimizer_state_dict.py), so none of this is
needed for our own checkpoints; loading accepts uneven DTensors (their real
extents, through ``uneven_dtensor_to_full_tensor``). All of it is collective
over the DTensor's mesh. ``make_fsdp_dtensor`` (utils.py) builds upstream's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..buffers.piece_dtensor import PieceDTensor

__all__ = [
    "filter_unflattened_state_dict",
    "gather_and_compute_chunk_metadata",
    "gather_uneven_dtensor_to_full_tensor",
    "get_unflattened_state_dict",
    "preprocess_state_dict_for_uneven_dtensor",
    "redistribute_uneven_dtensor_to_replicated",
    "split_dtensor",
    "uneven_dtensor_to_full_tensor",
    "update_uneven_dtensor_chunk_metadata",
    "validate_uneven_dtensor",
]


def _shard_dim(placement: Any, mesh_dim: int) -> int:
    if isinstance(placement, Shard):  # _StridedShard is a Shard too
        return placement.dim
    raise ValueError(
        f"placement {placement} on mesh dimension {mesh_dim} is neither Shard nor Replicate; "
        "uneven DTensor helpers handle Shard(d) / Replicate() placements only"
    )


def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """Offsets and sizes of this rank's local tensor inside the global tensor.

    Mesh dimensions are walked innermost first: along each sharded one, a rank's
    offset grows by the extents of the ranks before it, and the extent becomes
    the sum over the group (the piece the next outer dimension splits)."""
    local_shape = tuple(dtensor.to_local().shape)
    offsets = [0] * len(local_shape)
    extent = list(local_shape)
    mesh = dtensor.device_mesh
    for mesh_dim in reversed(range(mesh.ndim)):
        placement = dtensor.placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        dim = _shard_dim(placement, mesh_dim)
        group = mesh.get_group(mesh_dim)
        extents: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(extents, extent[dim], group=group)
        offsets[dim] += sum(extents[: dist.get_rank(group)])
        extent[dim] = sum(extents)
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local_shape))


def validate_uneven_dtensor(dtensor: DTensor) -> None:
    """Raise ``ValueError`` when this rank's chunk falls outside the global shape or
    the shards do not reach the end of every sharded dimension."""
    meta = gather_and_compute_chunk_metadata(dtensor)
    for dim, (offset, size) in enumerate(zip(meta.offsets, meta.sizes)):
        if offset < 0 or offset + size > dtensor.shape[dim]:
            raise ValueError(
                f"uneven DTensor: local chunk at offsets {tuple(meta.offsets)} sizes {tuple(meta.sizes)} lies "
                f"outside the global shape {tuple(dtensor.shape)}; the local tensors do not tile it"
            )
    reaches_end = torch.tensor(
        [int(o + s == dtensor.shape[d]) for d, (o, s) in enumerate(zip(meta.offsets, meta.sizes))] or [1],
        device=dtensor.to_local().device,
    )
    for mesh_dim, placement in enumerate(dtensor.placements):
        if not isinstance(placement, Replicate):
            dist.all_reduce(reaches_end, op=dist.ReduceOp.MAX, group=dtensor.device_mesh.get_group(mesh_dim))
    if not bool(reaches_end.all()):
        raise ValueError(
            f"uneven DTensor of shape {tuple(dtensor.shape)}: no shard reaches the end of some dimension; "
            "the local tensors are smaller than the global shape says"
        )


def _create_chunk_list(meta: ChunkStorageMetadata) -> list[ChunkStorageMetadata]:
    return [meta]


def _create_write_items(meta: ChunkStorageMetadata, fqn: str, tensor: Any) -> list[WriteItem]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.numel() == 0:
        return []
    return [
        WriteItem(
            index=MetadataIndex(fqn, meta.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=meta, properties=TensorProperties.create_from_tensor(local), size=tensor.size()),
        )
    ]


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> None:
    """Give DCP this rank's real extent: attaches ``__create_chunk_list__`` and
    ``__create_write_items__`` to the local tensor (``functools.partial`` of
    module-level functions, so the tensor still pickles). Collective."""
    meta = gather_and_compute_chunk_metadata(dtensor)
    local = dtensor._local_tensor
    local.__create_chunk_list__ = functools.partial(_create_chunk_list, meta)
    local.__create_write_items__ = functools.partial(_create_write_items, meta)


def filter_unflattened_state_dict(state_dict: dict, key_chain: Sequence[str] = (), visit_condition: Callable[[Any], bool] = lambda x: False) -> list[list[str]]:
    """Key paths (lists of keys) of the nested ``state_dict``'s values that satisfy ``visit_condition``."""
    found = []
    for key, value in state_dict.items():
        if isinstance(value, dict):
            found += filter_unflattened_state_dict(value, [*key_chain, key], visit_condition)
        elif visit_condition(value):
            found.append([*key_chain, key])
    return found


def get_unflattened_state_dict(state_dict: dict, key_chain: Sequence[str] = ()) -> Any:
    """The value at ``key_chain`` in a nested state dict (``KeyError`` naming the path)."""
    current: Any = state_dict
    for key in key_chain:
        if not (isinstance(current, dict) and key in current):
            raise KeyError(f"key path {list(key_chain)} is not in the state dict")
        current = current[key]
    return current


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict) -> dict:
    """Attach DCP chunk metadata to every DTensor of a (nested) state dict, in sorted
    key order so all ranks run the same collectives; returns ``state_dict``."""
    paths = filter_unflattened_state_dict(state_dict, visit_condition=lambda v: isinstance(v, DTensor))
    for path in sorted(paths, key=lambda p: [str(k) for k in p]):
        update_uneven_dtensor_chunk_metadata(get_unflattened_state_dict(state_dict, path))
    return state_dict


def uneven_dtensor_to_full_tensor(dtensor: DTensor) -> torch.Tensor:
    """The full tensor of a DTensor with possibly uneven shards, on every rank.

    Innermost mesh dimension first, every rank gathers its group's chunks (their
    offsets and flattened data), so after the last sharded dimension each rank
    holds every chunk and places each at its offset. Collective."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"uneven_dtensor_to_full_tensor needs a DTensor, got {type(dtensor).__name__}")
    if isinstance(dtensor, PieceDTensor):
        # A distributed parameter, its gradient or optimizer state: a flat piece, not
        # rows (full_tensor() names the fix); a value reduced from pieces is whole.
        return dtensor.full_tensor()
    meta = gather_and_compute_chunk_metadata(dtensor)
    chunks = [(tuple(meta.offsets), tuple(meta.sizes))]
    data = dtensor.to_local().contiguous().reshape(-1)
    mesh = dtensor.device_mesh
    for mesh_dim in reversed(range(mesh.ndim)):
        if isinstance(dtensor.placements[mesh_dim], Replicate):
            continue
        group = mesh.get_group(mesh_dim)
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, chunks, group=group)
        # Padded to the largest: not every backend gathers tensors of different sizes.
        counts = [sum(_numel(s) for _, s in theirs) for theirs in everyone]
        padded = torch.zeros(max(counts), dtype=data.dtype, device=data.device)
        padded[: data.numel()] = data
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded, group=group)
        chunks = [c for theirs in everyone for c in theirs]
        data = torch.cat([piece[:n] for piece, n in zip(pieces, counts)])
    full = torch.empty(dtensor.shape, dtype=dtensor.dtype, device=data.device)
    start = 0
    for offsets, sizes in chunks:
        n = _numel(sizes)
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = data[start : start + n].view(sizes)
        start += n
    return full


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def redistribute_uneven_dtensor_to_replicated(dtensor: DTensor) -> DTensor:
    """The same data as a ``Replicate()`` DTensor on the same mesh. Collective."""
    full = uneven_dtensor_to_full_tensor(dtensor)
    return DTensor.from_local(full, dtensor.device_mesh, [Replicate()] * dtensor.device_mesh.ndim, run_check=False)


def gather_uneven_dtensor_to_full_tensor(dtensor: DTensor) -> DTensor:
    """Upstream's older name of ``redistribute_uneven_dtensor_to_replicated``."""
    return redistribute_uneven_dtensor_to_replicated(dtensor)


def split_dtensor(
    dtensor: DTensor,
    split_size_or_sections: Union[int, Sequence[int]],
    dim: int = 0,
    update_uneven_dtensor_chunk_meta: bool = False,
) -> Iterator[DTensor]:
    """Split along ``dim`` like ``torch.split``, each piece a DTensor with the same
    placements whose local part is this rank's share of it (possibly empty). No
    data moves: only the chunk extents are exchanged."""
    total = dtensor.shape[dim]
    if isinstance(split_size_or_sections, int):
        bounds = list(range(0, total, split_size_or_sections)) + [total]
    else:
        bounds = [0]
        for size in split_size_or_sections:
            bounds.append(bounds[-1] + size)
        if bounds[-1] != total:
            raise ValueError(f"split sections {list(split_size_or_sections)} sum to {bounds[-1]}, not dim {dim}'s size {total}")
    meta = gather_and_compute_chunk_metadata(dtensor)
    mine_start, mine_end = meta.offsets[dim], meta.offsets[dim] + meta.sizes[dim]
    local = dtensor.to_local()
    for start, end in zip(bounds[:-1], bounds[1:]):
        lo, hi = max(start, mine_start), min(end, mine_end)
        piece = local.narrow(dim, lo - mine_start, hi - lo) if lo < hi else local.narrow(dim, 0, 0)
        shape = list(dtensor.shape)
        shape[dim] = end - start
        stride = torch.empty(shape, device="meta").stride()
        out = DTensor.from_local(piece, dtensor.device_mesh, dtensor.placements, run_check=False, shape=torch.Size(shape), stride=stride)
        if update_uneven_dtensor_chunk_meta:
            update_uneven_dtensor_chunk_metadata(out)
        yield out
