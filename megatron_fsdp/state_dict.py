"""Whole (unsharded) state dicts: export a sharded model as plain tensors."""

from __future__ import annotations

from typing import Optional

import torch

from . import collectives
from .megatron_fsdp import MegatronFSDP


@torch.no_grad()
def get_full_state_dict(model: MegatronFSDP, *, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Gather every parameter's main weights (and the module's buffers) as plain,
    full tensors on every rank, keyed like the unwrapped module. Collective: every
    rank of the shard group must call it."""
    buffer = model.param_and_grad_buffer
    model.all_gather_pipeline.wait_all()
    full: dict[str, torch.Tensor] = {}
    for group in buffer.groups:
        source = group.main_weight_source
        flat = source.data
        if source.is_distributed:
            flat = torch.empty(group.layout.padded_numel, dtype=source.dtype, device=source.device)
            collectives.all_gather(flat, source.data, source.group, async_op=False, label=f"export:{group.label}")
        for index, (name, param) in enumerate(zip(group.names, group.params)):
            start, end = group.layout.item_range(index)
            value = flat[start:end].view(param.shape).clone()
            full[name] = value if dtype is None else value.to(dtype)
    out = {name: full[name] for name in buffer.param_names.values()}
    for name, tensor in model.state_dict().items():
        if name not in out:
            out[name] = tensor.clone()
    return out
