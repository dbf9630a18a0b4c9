"""Tensor parallelism for the embedded GPT: torchtitan's plan on PyTorch's DTensor API.

    model = GPT(cfg)                                    # the whole model, the same seed on every rank
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True)
    model = fully_shard_model(model, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp", ...)

The plan (``parallelize_module`` styles, per ``TransformerBlock`` then the model):

    wte                  RowwiseParallel      vocabulary-parallel table; tokens replicated
    blocks.i.ln_1/ln_2   SequenceParallel     only with sequence parallelism (else replicated)
    blocks.i.attn.qkv    FusedColwiseParallel heads and query groups split over TP ([Note: fused projections])
    blocks.i.attn.q_/k_layernorm  SequenceParallel(sequence_dim=1)   per-head norms on the local heads
    blocks.i.attn.proj   RowwiseParallel      sums the heads' parts (reduce-scatter over the sequence with SP)
    blocks.i.mlp.fc      ColwiseParallel, or FusedColwiseParallel with swiglu ([gate | up])
    blocks.i.mlp.proj    RowwiseParallel
    ln_f                 SequenceParallel     only with sequence parallelism
    lm_head              ColwiseParallel      vocabulary-parallel logits, gathered (no loss parallelism)

Activations between the plan's layers are replicated over the TP ranks, or split
along the sequence (dim 1) with ``sequence_parallel``. Learned absolute positions
(``wpe``) stay replicated: the embeddings are summed whole, then split along the
sequence at the first block, as Megatron-LM scatters them after adding the positions.
A tied output layer and embedding are both ``Shard(0)`` over the vocabulary, so they
stay one DTensor parameter.

The plan runs on the unwrapped model, before FSDP: megatron_fsdp then shards each
TP-local piece over the data-parallel ranks (buffers/tensor_parallel.py,
[Note: tensor-parallel parameters]). Every parameter keeps its name, shape (as a
DTensor's global shape) and layout, so a checkpoint saved at one TP size loads at
any other. Refused (``tensor_parallel_problems``): mixture of experts, multi-latent
attention, multi-token prediction, and sizes the TP size does not divide.

Dropout: the TP ranks must hold the same generator state (the launcher seeds every
rank alike; they then draw in step), so that dropout on replicated activations draws
the same mask on each. Masks on split activations (a rank's heads, its part of the
sequence) then repeat from rank to rank, and every mask differs from a one-process
run's; with dropout 0 the TP model computes what the whole model computes.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from .config import GPTConfig, PositionEmbeddingType
from .gpt import GPT

__all__ = ["FusedColwiseParallel", "apply_tensor_parallel", "tensor_parallel_problems"]


class FusedColwiseParallel(ParallelStyle):
    """[Note: fused projections] A column-parallel linear whose output rows are sections
    laid side by side: the attention's ``qkv`` ([q | k | v (| gate)]) and the swiglu
    MLP's ``fc`` ([gate | up]).

    A plain ``Shard(0)`` of such a weight hands TP rank 0 the first rows, e.g. all of q
    and none of k at TP 2, so no rank could compute whole heads. Megatron-LM avoids it
    by storing QKV per query group and the swiglu rows per TP rank; doing either here
    would make the parameter's layout depend on the TP size (a TP 2 checkpoint would not
    load at TP 1, and meta-device init, which draws each TP parameter whole and keeps
    its ``Shard(0)`` piece, would no longer match an eager build). So the weight keeps
    its one-process layout and plain ``Shard(0)``; each rank computes its contiguous
    rows of the output (1/TP of the GEMM), the output is all-gathered over TP, and each
    rank keeps the r-th piece of every section: [q_r | k_r | v_r (| gate_r)], its own
    heads and groups (or [gate_r | up_r], its own channels), which the module code reads
    as a smaller model of the same kind (``CausalSelfAttention`` takes its local head
    count from the width it receives; the MLP's ``chunk(2)`` needs nothing).

    Backward: each rank's gradient of the gathered output is non-zero on its own pieces
    only, so it is a ``Partial`` sum over TP, reduce-scattered back to the rank's rows
    (``to_local(grad_placements=[Partial()])``). Cost: one all-gather of the projection's
    output in forward and one reduce-scatter in backward, beyond Megatron-LM's
    communication; an all-to-all (each rank needs 1/TP of the gathered width) would
    carry TP times fewer bytes."""

    def __init__(self, sections: Sequence[int], *, input_layouts: Placement | None = None) -> None:
        super().__init__()
        if not sections or any(s < 0 for s in sections):
            raise ValueError(f"sections={tuple(sections)} must be non-negative output widths, one per section")
        self.sections = tuple(int(s) for s in sections)
        self.input_layouts = input_layouts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FusedColwiseParallel shards an nn.Linear, got {type(module).__name__}")
        if sum(self.sections) != module.out_features:
            raise ValueError(f"sections {self.sections} sum to {sum(self.sections)}, not the {module.out_features} "
                             "output features of the linear; pass its sections' widths")
        tp = device_mesh.size()
        if any(s % tp for s in self.sections):
            raise ValueError(f"sections {self.sections} are not all divisible by the tensor-parallel size {tp}: "
                             "every rank takes an equal piece of each")
        style = ColwiseParallel(input_layouts=self.input_layouts, use_local_output=False)
        style.src_data_rank = self.src_data_rank
        module = parallelize_module(module, device_mesh, style)
        module.register_forward_hook(functools.partial(_own_pieces, self.sections, device_mesh))
        return module


def _own_pieces(sections: tuple[int, ...], mesh: DeviceMesh, module: nn.Module, inputs, output: DTensor):
    """(..., sum(sections)) ``Shard(-1)`` output -> this rank's (..., sum(sections) / TP) local
    tensor [s0_r | s1_r | ...] (see [Note: fused projections])."""
    whole = output.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    rank, tp = mesh.get_local_rank(), mesh.size()
    pieces = [part.narrow(-1, rank * (size // tp), size // tp)
              for part, size in zip(whole.split(list(sections), dim=-1), sections) if size]
    return torch.cat(pieces, dim=-1)


def tensor_parallel_problems(cfg: GPTConfig, tp: int, *, sequence_parallel: bool) -> list[str]:
    """Why ``apply_tensor_parallel`` cannot split a GPT of ``cfg`` over ``tp`` ranks (empty: it can).
    Pure; the launcher's validation asks the same in flag names."""
    return _unsupported_features(cfg) + _indivisible_sizes(cfg, tp, sequence_parallel)


def _unsupported_features(cfg: GPTConfig) -> list[str]:
    unsupported = [(cfg.num_moe_experts is not None, "mixture of experts (num_moe_experts)",
                    "expert parallelism with TP is not implemented; train MoE models at TP 1"),
                   (cfg.multi_latent_attention, "multi-latent attention",
                    "its low-rank projections have no TP plan yet; use TP 1"),
                   (cfg.mtp_num_layers is not None, "multi-token prediction (mtp_num_layers)",
                    "its depths have no TP plan yet; use TP 1")]
    return [f"{name} with tensor parallelism: {remedy}" for on, name, remedy in unsupported if on]


def _indivisible_sizes(cfg: GPTConfig, tp: int, sequence_parallel: bool) -> list[str]:
    sizes = [("num_attention_heads", cfg.num_attention_heads, "each rank computes whole heads"),
             ("num_query_groups", cfg.num_query_groups, "each rank holds whole key/value groups with their "
                                                         "query heads (Megatron-LM's rule)"),
             ("ffn_hidden_size", cfg.ffn_hidden_size, "each rank holds an equal share of the MLP channels"),
             ("vocab_size", cfg.vocab_size, "the vocabulary is split evenly; pad it with "
                                            f"vocab_size_with_padding(..., tensor_model_parallel_size={tp})")]
    if sequence_parallel:
        sizes.append(("seq_length", cfg.seq_length, "sequence parallelism splits every sequence evenly (inputs "
                                                     "must have a length divisible by it too)"))
    return [f"{name}={value} is not divisible by the tensor-parallel size {tp}: {why}"
            for name, value, why in sizes if value % tp]


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> GPT:
    """Split ``model`` (the whole GPT, same weights on every rank of ``tp_mesh``) over the
    1-D mesh ``tp_mesh`` in place, per the module docstring's plan; returns it. Before
    any FSDP wrapping. Parameters keep their attributes (``is_embedding_or_output_parameter``)."""
    if not isinstance(model, GPT):
        raise TypeError(f"apply_tensor_parallel takes the embedded GPT (megatron_fsdp.models.GPT), got "
                        f"{type(model).__name__}; write a plan for other models with parallelize_module")
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh has {tp_mesh.ndim} dimensions {tp_mesh.mesh_dim_names}; pass the 1-D "
                         "tensor-parallel sub-mesh, e.g. mesh['tp']")
    already = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if already:
        raise ValueError(f"parameter {already[0]!r} is already a DTensor: the model was tensor-parallelised (or "
                         "wrapped) before; apply the plan once, to the plain model, before FSDP")
    cfg, tp = model.config, tp_mesh.size()
    for error, problems in ((NotImplementedError, _unsupported_features(cfg)),
                            (ValueError, _indivisible_sizes(cfg, tp, sequence_parallel))):
        if problems:
            raise error("cannot apply tensor parallelism: " + "; ".join(problems))
    marks = _parameter_marks(model)
    tied = model.lm_head.weight is model.wte.weight
    for block in model.blocks:
        parallelize_module(block, tp_mesh, _block_plan(block, cfg, sequence_parallel))
    parallelize_module(model, tp_mesh, _model_plan(cfg, sequence_parallel))
    if tied:  # both Shard(0) over the vocabulary: one DTensor parameter again
        model.lm_head.weight = model.wte.weight
    _restore_marks(model, marks)
    if sequence_parallel:
        model.register_forward_pre_hook(functools.partial(_check_sequence_length, tp))
    return model


def _activations(sequence_parallel: bool) -> Placement:
    """The layout of the activations between the plan's layers."""
    return Shard(1) if sequence_parallel else Replicate()


def _block_plan(block: nn.Module, cfg: GPTConfig, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    attn, mlp, seq = block.attn, block.mlp, _activations(sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        "attn.qkv": FusedColwiseParallel([attn.q_size, attn.kv_size, attn.kv_size, attn.gate_size],
                                         input_layouts=seq),
        "attn.proj": RowwiseParallel(output_layouts=seq),
        "mlp.fc": FusedColwiseParallel([cfg.ffn_hidden_size] * 2, input_layouts=seq) if mlp.swiglu
        else ColwiseParallel(input_layouts=seq),
        "mlp.proj": RowwiseParallel(output_layouts=seq),
    }
    if attn.qk_layernorm:
        # (b, heads, t, d): the local heads are the rank's Shard(1); the norm weight's gradient
        # is then a Partial sum over TP, which the Replicate weight's backward adds up.
        for name in ("attn.q_layernorm", "attn.k_layernorm"):
            plan[name] = SequenceParallel(sequence_dim=1, use_local_output=True)
    if sequence_parallel:
        plan["ln_1"] = SequenceParallel()
        plan["ln_2"] = SequenceParallel()
    return plan


def _model_plan(cfg: GPTConfig, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    learned = cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE
    seq = _activations(sequence_parallel)
    plan: dict[str, ParallelStyle] = {
        # With learned positions the embeddings are summed whole, then split at the first block.
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate() if learned else seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
        if learned:
            plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True)
    return plan


def _parameter_marks(model: nn.Module) -> dict[tuple[str, str], dict]:
    """(module name, parameter name) -> the parameter's public attributes: the TP styles
    replace parameters by new DTensor ones, which would drop them."""
    return {(mod_name, name): {k: v for k, v in vars(p).items() if not k.startswith("_")}
            for mod_name, module in model.named_modules() for name, p in module._parameters.items()
            if p is not None and vars(p)}


def _restore_marks(model: nn.Module, marks: dict[tuple[str, str], dict]) -> None:
    modules = dict(model.named_modules())
    for (mod_name, name), attrs in marks.items():
        param = modules[mod_name]._parameters[name]
        for key, value in attrs.items():
            if not hasattr(param, key):
                setattr(param, key, value)


def _check_sequence_length(tp: int, module: nn.Module, args) -> None:
    tokens = args[0] if args else None
    if isinstance(tokens, torch.Tensor) and tokens.ndim >= 2 and tokens.shape[1] % tp:
        raise ValueError(f"a sequence of {tokens.shape[1]} tokens under sequence parallelism over {tp} ranks: "
                         f"the length must be divisible by {tp}; pad or trim the batch")
