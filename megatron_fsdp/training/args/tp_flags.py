"""Validation of the tensor-parallel flags (``--tensor-model-parallel-size``,
``--sequence-parallel``), called by ``validation.py``: problems (a sentence naming the
value and the fix each) before any process group, warnings for what has no effect, and
the data-parallel size the batch rules use.

Tensor parallelism here is the embedded GPT's DTensor plan (``models/tensor_parallel.py``)
under Megatron-FSDP or Megatron-core DDP on this engine, or megatron-core's own TP layers
(``--use-mcore-models``) under Megatron-FSDP (``model_setup.py`` lays the ranks out as
Megatron-LM: TP fastest). What the plan or the launcher cannot run with it yet is
refused by name. Pure argument handling, no torch.
"""

from __future__ import annotations

import argparse

from ...models.config import megatron_swiglu_ffn_hidden_size
from .mtp_flags import mtp_enabled


def tensor_parallel_size(args: argparse.Namespace) -> int:
    return args.tensor_model_parallel_size


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    """Megatron-LM's data-parallel size: the world over the tensor- x context-parallel size
    (the world itself while that does not divide it, which ``tp_problems`` /
    ``ep_cp_flags`` report)."""
    model = tensor_parallel_size(args) * getattr(args, "context_parallel_size", 1)
    return world_size // model if model >= 1 and world_size % model == 0 else world_size


def tp_problems(args: argparse.Namespace, world_size: int) -> list[str]:
    tp = tensor_parallel_size(args)
    flag = f"--tensor-model-parallel-size {tp}"
    if tp < 1:
        return [f"{flag} must be a positive integer (1: no tensor parallelism)"]
    if tp == 1:
        return []
    if world_size % tp:
        return [f"{flag} does not divide the world size {world_size} (Megatron-LM's rule: world = TP x DP); launch "
                f"a multiple of {tp} ranks or pick a divisor of {world_size}"]
    return _unsupported(args, flag) + _indivisible(args, flag, tp)


def _unsupported(args: argparse.Namespace, flag: str) -> list[str]:
    """Features the tensor-parallel plan or this launcher cannot combine with TP yet."""
    torch_ddp = not (args.use_megatron_fsdp or args.use_torch_fsdp2 or args.use_distributed_optimizer or args.bf16
                     or args.fp16 or args.ddp_average_in_collective)
    refused = [
        (args.num_experts is not None, "--num-experts", "expert parallelism with TP is not implemented; train MoE "
                                                         "models at TP 1"),
        (args.multi_latent_attention, "--multi-latent-attention", "MLA has no TP plan here yet; use TP 1"),
        (mtp_enabled(args), "--mtp-num-layers", "multi-token prediction has no TP plan here yet; use TP 1"),
        (args.use_torch_fsdp2, "--use-torch-fsdp2", "the FSDP2 path does not lay out a TP mesh; use "
                                                     "--use-megatron-fsdp"),
        (torch_ddp, "PyTorch DDP (an fp32 run without --use-megatron-fsdp or --use-distributed-optimizer)",
         "PyTorch DDP does not take DTensor parameters; add --use-megatron-fsdp, or --use-distributed-optimizer "
         "for Megatron-core DDP on this engine"),
        (args.ckpt_format == "torch", "--ckpt-format torch", "the torch format's whole-tensor files are written "
                                                              "per data-parallel rank 0 without TP pieces; use "
                                                              "--ckpt-format torch_dist (resharded on load at any TP "
                                                              "size)"),
        (args.check_weight_hash_across_dp_replicas_interval is not None,
         "--check-weight-hash-across-dp-replicas-interval", "the check compares every rank's weights with rank 0's, "
                                                            "and TP ranks hold different pieces; drop it"),
        (args.optimizer == "muon", "--optimizer muon", "Muon orthogonalises whole matrices, and their TP pieces are "
                                                        "not gathered here; use adam or sgd"),
    ]
    refused += _mcore_refused(args) if args.use_mcore_models else []
    return [f"{flag} with {name}: {why}" for on, name, why in refused if on]


def _mcore_refused(args: argparse.Namespace) -> list[tuple[bool, str, str]]:
    """megatron-core's GPTModel (``--use-mcore-models``) with its own TP layers: what its
    local spec or this launcher cannot run with TP."""
    return [
        (not args.use_megatron_fsdp, "--use-mcore-models without --use-megatron-fsdp",
         "megatron-core's TP layers are wired into Megatron-FSDP's FullyShardedDataParallel only; add "
         "--use-megatron-fsdp"),
        (args.sequence_parallel, "--use-mcore-models and --sequence-parallel",
         "megatron-core's local-spec norms cannot run sequence-parallel here: FusedLayerNorm needs apex (absent, "
         "and CUDA-only) and its torch fallback WrappedTorchNorm refuses sequence_parallel; drop "
         "--sequence-parallel (or train the embedded GPT)"),
        (args.swiglu, "--use-mcore-models and --swiglu", "megatron-core's SwiGLU linear_fc1 holds [gate | up] "
                                                         "per TP rank (partition_stride=2), an interleaved layout "
                                                         "Megatron-FSDP refuses; use GeLU, or TP 1"),
        (args.num_distributed_optimizer_instances > 1, "--use-mcore-models and "
         "--num-distributed-optimizer-instances > 1", "the launcher does not build megatron-core's HSDP groups "
                                                      "with TP; use 1 instance, or TP 1"),
    ]


def _indivisible(args: argparse.Namespace, flag: str, tp: int) -> list[str]:
    """Sizes every TP rank must hold an equal share of (Megatron-LM asserts the same)."""
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    sizes = [("--num-attention-heads", heads), ("--num-query-groups", groups), ("--ffn-hidden-size",
                                                                                _ffn_hidden_size(args))]
    if args.sequence_parallel:
        sizes.append(("--seq-length (with --sequence-parallel)", args.seq_length))
    return [f"{flag} does not divide {name}={value}: every TP rank holds an equal share; pick a TP size that "
            "divides it" for name, value in sizes if value is not None and value > 0 and value % tp]


def _ffn_hidden_size(args: argparse.Namespace):
    if args.ffn_hidden_size is not None or args.hidden_size is None:
        return args.ffn_hidden_size
    return megatron_swiglu_ffn_hidden_size(args.hidden_size) if args.swiglu else 4 * args.hidden_size


def tp_warnings(args: argparse.Namespace) -> list[str]:
    """``--sequence-parallel`` at TP 1: Megatron-LM turns it off with a warning; so does this."""
    if args.sequence_parallel and tensor_parallel_size(args) == 1:
        args.sequence_parallel = False
        return ["--sequence-parallel: accepted, no effect here: sequence parallelism splits the activations over "
                "the tensor-parallel ranks, and --tensor-model-parallel-size is 1 (Megatron-LM turns it off too)"]
    return []
