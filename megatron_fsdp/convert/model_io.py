"""The model in between: built from the input's ``GPTConfig``, read from the input format and
written in the output one, by the same library calls the launcher uses.

One process holds the whole model; under ``torchrun`` it is sharded with ZeRO-3
(``fully_shard_model``), so that each rank reads and holds only its part (``hf`` and
``torch_dist`` read per-rank slices; ``hf`` output is gathered one tensor at a time).
Weights only: optimizer state is not converted (outputs resume with ``--finetune`` or
``--no-load-optim``, as a converted Megatron-LM checkpoint does).
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp as mf
from megatron_fsdp.interop.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from megatron_fsdp.interop.hf_config import HFFamily
from megatron_fsdp.interop.torch_dist import CONFIG_KEY, load_torch_dist, plain_config, save_torch_dist
from megatron_fsdp.models.gpt import GPT, TransformerBlock
from megatron_fsdp.parallel_dims import ParallelDims
from megatron_fsdp.training.checkpoint import dcp_checkpoint, torch_checkpoint

from .architecture import Source, read_source
from .formats import CheckpointFormat, Located, locate

__all__ = ["build_model", "open_checkpoint", "read_into", "write_from"]

CONVERTED_KEY = "converted_from"
"""Extra-state key of an ``fsdp_dtensor`` output: the input's format and directory."""


def build_model(source: Source) -> nn.Module:
    """The embedded GPT for ``source`` on the CPU; ZeRO-3-sharded over the ranks when there
    are several (its initial values are overwritten by the read)."""
    torch.manual_seed(0)
    model = GPT(source.config)
    if dist.get_world_size() == 1:
        return model
    experts = {}
    if source.config.num_moe_experts:  # experts shard over the same ranks (expert parallelism 1)
        experts["expt_device_mesh"] = ParallelDims(world=dist.get_world_size()).build_expert_mesh("cpu")
    return mf.fully_shard_model(model, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy="optim_grads_params",
                                device=torch.device("cpu"), **experts)


def read_into(model: nn.Module, located: Located, source: Source) -> None:
    """Load the input checkpoint's weights into ``model`` (everything is checked before a
    weight changes, by the format's own loader)."""
    if located.format is CheckpointFormat.HF:
        load_hf_checkpoint(model, located.data_dir, config=source.config)
    elif located.format is CheckpointFormat.TORCH_DIST:
        load_torch_dist(model, located.data_dir, config=source.config)
    elif located.format is CheckpointFormat.FSDP_DTENSOR:
        dcp_checkpoint.load(located.root, model, None, step=located.iteration)
    else:
        torch_checkpoint.load(located.root, model, None, step=located.iteration, finetune=True)


def open_checkpoint(path: str) -> tuple[nn.Module, Source]:
    """The checkpoint at ``path`` (any format, detected) in the embedded GPT it describes,
    sharded over the ranks as ``build_model`` shards it; collective."""
    located = locate(path)
    source = read_source(located)
    model = build_model(source)
    read_into(model, located, source)
    return model, source


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    if dist.get_world_size() == 1:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return mf.get_full_state_dict(model)


def _write_torch(model: nn.Module, out: str, iteration: int, source: Source) -> None:
    """Megatron-LM's legacy file (``args``, ``iteration``, ``model``; the configuration under
    ``CONFIG_KEY``), then the tracker."""
    state = _full_state(model)
    if dist.get_rank() == 0:
        path = torch_checkpoint.model_file(out, iteration)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"args": argparse.Namespace(**source.args), "checkpoint_version": 3.0, "iteration": iteration,
                    "model": state, CONFIG_KEY: plain_config(source.config)}, path)
        dcp_checkpoint.publish_checkpoint(out, iteration, None)
    dist.barrier()


def _write_torch_dist(model: nn.Module, out: str, iteration: int, source: Source) -> None:
    common = {"iteration": iteration}
    if source.args:
        common["args"] = argparse.Namespace(**source.args)
    save_torch_dist(model, dcp_checkpoint.checkpoint_dir(out, iteration), config=source.config,
                    common_state=common)
    if dist.get_rank() == 0:
        dcp_checkpoint.publish_checkpoint(out, iteration, None)
    dist.barrier()


def write_from(model: nn.Module, out: str, fmt: CheckpointFormat, located: Located, source: Source, *,
               family: Optional[HFFamily], tokenizer_dir: Optional[str], dtype: Optional[torch.dtype]) -> None:
    """Write ``model`` to ``out`` in ``fmt`` (Megatron-style outputs at the input's iteration)."""
    iteration = located.iteration
    if fmt is CheckpointFormat.HF:
        save_hf_checkpoint(model, out, config=source.config, family=family, hf_config=source.hf_config,
                           tokenizer_dir=tokenizer_dir, dtype=dtype)
    elif fmt is CheckpointFormat.TORCH_DIST:
        _write_torch_dist(model, out, iteration, source)
    elif fmt is CheckpointFormat.FSDP_DTENSOR:
        extra = {"args": source.args, CONFIG_KEY: plain_config(source.config),
                 CONVERTED_KEY: f"{located.format.value}:{located.data_dir}"}
        dcp_checkpoint.save(out, iteration, model, None, extra)
    else:
        _write_torch(model, out, iteration, source)
