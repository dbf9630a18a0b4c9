"""State dicts of a sharded model: sharded (DTensor) for checkpoints, full for export.

[Note: standard state-dict DTensors] The optimizer's distributed parameters are
flat slices of flat buffers: possibly uneven, empty, or starting mid-row. No
DTensor placement describes such a slice, so ``model.state_dict()`` does not hand
them out. It gathers each parameter group's main weights (one collective per
group, the group's unsharded size in temporary memory) and keeps, per parameter,
the rows a ``Shard(0)`` DTensor holds on this rank (``torch.chunk`` split over the
dp-shard mesh dimension, replicated over an outer one). Those DTensors behave
under every standard API: ``full_tensor()``, ``redistribute``,
``torch.distributed.checkpoint`` (which reshards on load) and
``torch.distributed.checkpoint.state_dict.get_model_state_dict``; and they carry
no closures, so ``torch.save`` pickles them. Loading turns any DTensor layout back
into this rank's flat slice (``full_tensor()`` per parameter, then a slice).

The optimizer's state dict takes the same form (optimizer_state_dict.py), so
``torch.save(optimizer.state_dict())`` works and DCP reshards optimizer state too.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..runtime.owners import owner_of
from .full_state_dict import gather_full_state_dict
from .gather import gather_main_weights
from .keys import alias_names, extra_states, persistent_buffers, torch_key
from .sharded_model import ShardedModel
from .uneven_dtensor import uneven_dtensor_to_full_tensor
from ..buffers.tensor_parallel import TPSpec

logger = logging.getLogger(__name__)


class StateDictMismatchError(RuntimeError):
    """Keys or shapes of a state dict / checkpoint do not match the model."""


def clone_for_load(value: Any) -> Any:
    """A private host (CPU) copy of a state-dict value, to load a checkpoint into
    before anything live changes (or to stage an asynchronous save).

    Host memory, not the device: a GPU run would otherwise hold a second copy of
    its model and optimizer state on the GPU while loading. A DTensor keeps its
    mesh and placements (torch's own CPU staging does the same): DCP only reads
    and writes the local tensor; ``full_value`` moves it back one tensor at a time."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().to("cpu", copy=True)


def full_value(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor of a state-dict value on ``device``: a plain tensor as is;
    a DTensor of any layout gathered (a collective over its mesh), the uneven ones
    of upstream's ``update_uneven_dtensor_chunk_metadata`` by their real extents."""
    if not isinstance(value, DTensor):
        return value.to(device)
    if value.to_local().device != device:
        value = value.to(device)  # a host copy from clone_for_load: back for the collective
    if all(isinstance(p, Replicate) for p in value.placements):
        return value.to_local()
    if hasattr(value.to_local(), "__create_chunk_list__"):  # upstream's uneven rows
        return uneven_dtensor_to_full_tensor(value)
    return value.full_tensor()


# -- model state dicts -----------------------------------------------------------------
MODULE_PREFIX = "module."
"""Upstream Megatron-FSDP keys its state dict through the wrapper's ``module``
attribute (``module.<name>``); so do we, and loading accepts both forms."""


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the rows ``rank`` holds when ``rows`` are split as
    ``torch.chunk`` / DTensor ``Shard(0)`` split them (ceil-sized chunks, the last
    ranks possibly empty)."""
    size = -(-rows // world) if rows else 0
    start = min(rank * size, rows)
    return start, min(start + size, rows)


_STATE_DICT_DEVICE: ContextVar[Optional[torch.device]] = ContextVar("megatron_fsdp_state_dict_device", default=None)


@contextlib.contextmanager
def state_dicts_on(device: "torch.device | str") -> Iterator[None]:
    """``model.state_dict()`` / ``optimizer.state_dict()`` built inside hand out
    their fresh standard pieces on ``device``. ``load_checkpoint`` builds them in
    host memory: beyond the live state the accelerator then holds one group's
    gathered bucket and one piece in flight, never a second copy of the state."""
    token = _STATE_DICT_DEVICE.set(torch.device(device))
    try:
        yield
    finally:
        _STATE_DICT_DEVICE.reset(token)


def standard_dtensor(group, full: torch.Tensor, spec: Optional[TPSpec] = None) -> DTensor:
    """``full`` (this parameter's unsharded main weights) as a DTensor whose local
    piece is what standard DTensor APIs expect: whole rows split like
    ``torch.chunk`` over the dp-shard mesh dimension (the mesh's last), replicated
    over any outer dimension; ``Replicate()`` everywhere for replicated groups and
    0-d parameters. ``full_tensor()``, ``redistribute`` and DCP need nothing more.
    See [Note: standard state-dict DTensors]. A tensor-parallel parameter's ``full``
    is its TP piece: the DTensor spans the data-parallel dims and ``tp``
    (buffers/tensor_parallel.py [Note: tensor-parallel parameters])."""
    mesh = group.dp.mesh
    if not group.strategy.shards_optimizer or full.dim() == 0:
        piece = full
        placements = (Replicate(),) * mesh.ndim
    else:
        world = mesh.size(mesh.ndim - 1)
        rank = mesh.get_local_rank(mesh.ndim - 1)
        start, end = chunk_rows(full.shape[0], world, rank)
        piece = full[start:end]
        placements = (Replicate(),) * (mesh.ndim - 1) + (Shard(0),)
    shape, stride = full.shape, full.stride()
    if spec is not None:
        mesh, placements = group.dp.mesh_with_tp, spec.with_dp(placements)
        shape, stride = spec.global_shape, spec.global_stride
    # A copy, not a view of the flat bucket: torch.save would otherwise pickle the
    # whole bucket's storage (and cannot read a resizable one).
    device = _STATE_DICT_DEVICE.get()
    if device is None:
        return DTensor.from_local(piece.clone(), mesh, placements, run_check=False, shape=shape, stride=stride)
    # from_local would move a host piece to the mesh's device: wrap the view, then copy.
    view = DTensor.from_local(piece, mesh, placements, run_check=False, shape=shape, stride=stride)
    return view.to(device, copy=True)


def sharded_state_dict(
    model: ShardedModel, *, prefix: str = "", keep_vars: bool = False, module_prefix: bool = True,
    extra_state: bool = False,
) -> "OrderedDict[str, Any]":
    """Main weights, persistent buffers and (``extra_state``) modules' extra state,
    keyed ``module.<name>`` like upstream (``module_prefix=False``: keyed like the
    wrapped module).

    Sharded weights are gathered per parameter group (a collective over its data-
    parallel group) and handed out as standard DTensors (``standard_dtensor``):
    fresh tensors (replicated ones too), so loading goes through ``load_state_dict``.
    ``keep_vars=True`` hands out the distributed parameters themselves (the
    optimizer's flat shards)."""
    buffer = model.param_and_grad_buffer
    base = prefix + (MODULE_PREFIX if module_prefix else "")
    values: dict[str, Any] = {}
    if keep_vars:
        values = dict(buffer.named_dist_params())
    else:
        model.settle_weights_for_reading()  # edits since the step included
        for group in buffer.groups:
            flat, _ = gather_main_weights(group, model.all_gather_pipeline.timeout)
            for index, (name, param) in enumerate(zip(group.names, group.params)):
                start, end = group.layout.item_range(index)
                spec = buffer.tp_spec(param)
                values[name] = standard_dtensor(group, flat[start:end].view(param.shape).detach(), spec)
    out: "OrderedDict[str, Any]" = OrderedDict()
    for alias, name in alias_names(model).items():
        out[base + alias] = values[name]
    for name, value in persistent_buffers(model.module):
        out[base + torch_key(name)] = value if keep_vars else value.detach()
    if extra_state:
        for key, sub in extra_states(model.module):
            out[base + key] = sub.get_extra_state()
    return out


def _describe(value: Any) -> str:
    return f"{tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _own_keys(model: ShardedModel, state_dict: Mapping[str, Any]) -> tuple[dict[str, str], list[str], list[str]]:
    """Match the given keys (``module.<name>`` or ``<name>``, tied aliases optional)
    to the model's canonical names in ``torch_key`` form: (canonical -> given key,
    missing, unexpected)."""
    aliases = {alias: torch_key(name) for alias, name in alias_names(model).items()}
    buffers = [torch_key(n) for n, _ in persistent_buffers(model.module)]
    extras = [key for key, _ in extra_states(model.module)]
    canonical = list(dict.fromkeys(aliases.values())) + buffers
    known = set(aliases) | set(canonical) | set(extras)
    given: dict[str, str] = {}
    named: dict[str, str] = {}  # name -> the key that gave it
    unexpected, twice = [], []
    own = _own_objects(model)
    for key in state_dict:
        name = torch_key(key)  # [Note: checkpoint_wrapper keys]: either form loads
        if name not in known and name.startswith(MODULE_PREFIX) and name[len(MODULE_PREFIX):] in known:
            name = name[len(MODULE_PREFIX):]
        if name not in known:
            unexpected.append(key)
            continue
        if name in named:  # both `module.<name>` and `<name>`
            # [Note: a key given twice] torch's set_model_state_dict(full_state_dict=True)
            # passes the parameters it found by walking the model next to the loaded
            # ones; a value that is the model's own tensor carries nothing to load.
            first = named[name]
            if id(state_dict[key]) in own or state_dict[key] is state_dict[first]:
                continue
            if id(state_dict[first]) not in own:
                twice.append(f"{first!r} and {key!r}")
                continue
            replaced = first  # the first was the model's own tensor: this key replaces it
        else:
            replaced = None
        named[name] = key
        target = aliases.get(name, name)
        if target not in given or name == target or given[target] == replaced:
            given[target] = key  # the canonical key wins over an alias
    if twice:
        raise StateDictMismatchError(
            "cannot load the state dict into the model (nothing was loaded): these keys name the same tensor "
            f"with different values: {'; '.join(twice)}; keep one form (module.<name> or <name>)"
        )
    if model.keeps_extra_state:  # [Note: extra state]: expected where state_dict() gives it
        canonical += extras
    missing = [MODULE_PREFIX + n for n in canonical if n not in given]
    return given, missing, unexpected


def _own_objects(model: ShardedModel) -> set[int]:
    """ids of the tensors the model itself holds (registered parameters and buffers,
    distributed parameters): values that load nothing."""
    tensors = [p for _, p in model.module.named_parameters(remove_duplicate=False)] + list(model.module.buffers())
    tensors += [p for g in model.param_and_grad_buffer.groups for p in g.dist_params]
    return {id(t) for t in tensors}


@torch.no_grad()
def load_sharded_state_dict(model: ShardedModel, state_dict: Mapping[str, Any], *, strict: bool = True):
    """Load main weights from DTensors (our ``state_dict()`` as DCP filled it, any
    DTensor layout of the full weights, the distributed parameters themselves) or
    from plain full tensors (a pretrained model); then refresh the compute weights.

    Everything is validated (and every collective run) before anything is written,
    so a mismatch never leaves the model half-loaded. Collective.
    """
    own = sharded_state_dict(model, keep_vars=True, module_prefix=False)
    given, missing, unexpected = _own_keys(model, state_dict)
    extras = {key: sub for key, sub in extra_states(model.module) if key in given}
    mismatched = [
        f"{given[k]}: checkpoint {_describe(state_dict[given[k]])} vs model {_describe(own[k])}"
        for k in given
        if k not in extras
        and (not isinstance(state_dict[given[k]], torch.Tensor) or state_dict[given[k]].shape != own[k].shape)
    ]
    problems = []
    if mismatched:
        problems.append("shape mismatch for " + "; ".join(mismatched))
    if strict and missing:
        problems.append(f"missing keys {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if problems:
        raise StateDictMismatchError(
            "cannot load the state dict into the model (nothing was loaded): " + "; ".join(problems)
        )
    sources = {}
    for key in own:  # the model's order: the same collectives on every rank
        if key in given:
            try:
                sources[key] = _local_source(model, given[key], own[key], state_dict[given[key]])
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
    for key, sub in extras.items():
        sub.set_extra_state(state_dict[given[key]])
    model.install_optimized_model_weights()
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _local_source(model: ShardedModel, key: str, own: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The part of ``value`` that this rank's ``own`` tensor (a distributed
    parameter or a buffer) holds."""
    if isinstance(value, DTensor):
        if owner_of(value) is not None:  # a distributed parameter: flat shards
            local = own.to_local() if isinstance(own, DTensor) else own
            if value.to_local().shape != local.shape:
                raise ValueError(
                    f"{key}: the distributed parameter's shard {tuple(value.to_local().shape)} was cut for another "
                    f"sharding than this model's {tuple(local.shape)}; pass model.state_dict() or full tensors"
                )
            return value.to_local()
        value = full_value(value, own.device if not isinstance(own, DTensor) else own.to_local().device)
    spec = model.param_and_grad_buffer.tp_spec(own)
    if spec is not None:
        value = spec.local_of(value)  # this rank's tensor-parallel piece
    if not isinstance(own, DTensor) or own.to_local().shape == value.shape:
        return value
    local = own.to_local()
    start = model.param_and_grad_buffer.local_flat_start(own)
    return value.reshape(-1)[start : start + local.numel()]


def get_full_state_dict(
    model: ShardedModel,
    *,
    dtype: Optional[torch.dtype] = None,
    device: "torch.device | str" = "cpu",
    rank0_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Every parameter's full main weights (and the module's buffers) as plain
    tensors keyed like the unwrapped module, gathered one group at a time into
    ``device`` (host memory by default); ``rank0_only``: the other ranks get ``{}``.
    Collective: every rank of the shard group must call it (full_state_dict.py)."""

    return gather_full_state_dict(model, dtype=dtype, device=device, rank0_only=rank0_only)


def save_full_state_dict(model: ShardedModel, path: str, *, dtype: Optional[torch.dtype] = None) -> None:
    """Export: rank 0 writes a plain ``torch.save`` state dict loadable by the
    unwrapped model class. Collective."""
    full = get_full_state_dict(model, dtype=dtype, rank0_only=True)
    if torch.distributed.get_rank() == 0:
        torch.save(full, path)
    torch.distributed.barrier()


def load_full_state_dict(model: ShardedModel, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True):
    """Import a plain (unsharded) state dict, e.g. pretrained weights, into a sharded model.
    Under expert parallelism the whole model's dict holds every expert; each rank loads
    its own and leaves those the other expert-parallel ranks hold (collective then)."""
    others = other_ranks_expert_keys(model)
    if others:
        state_dict = {k: v for k, v in state_dict.items() if torch_key(k).removeprefix(MODULE_PREFIX) not in others}
    return load_sharded_state_dict(model, state_dict, strict=strict)


def other_ranks_expert_keys(model: ShardedModel) -> set[str]:
    """The parameter names the other expert-parallel ranks hold (in ``torch_key`` form)."""
    group = model.dist_index.expt_parallel_group
    if group is None:
        return set()
    mine = {torch_key(n) for g in model.param_and_grad_buffer.groups if g.dp is model.dist_index.groups_for(True)
            for n in g.names}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, sorted(mine), group=group)
    return {name for names in everyone for name in names} - mine
