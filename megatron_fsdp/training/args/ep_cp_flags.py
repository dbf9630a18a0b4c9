"""Validation of the context- and expert-parallel flags (``--context-parallel-size``,
``--expert-model-parallel-size``, ``--expert-tensor-parallel-size`` and the MoE dispatcher
flags that only mean something with experts spread over ranks) and of the expert capacity
(``--moe-expert-capacity-factor``, ``--moe-token-drop-policy``,
``--moe-pad-expert-input-to-capacity``), called by ``validation.py``: problems (a sentence
naming the value and the fix each) before any process group, and warnings for what has no
effect.

Context parallelism here is the embedded GPT's (``models/context_parallel.py``: every CP
rank holds 2 of the 2 x CP chunks of each sequence, attention all-gathers K/V over the CP
group), expert parallelism the embedded MoE's (``models/expert_parallel.py``: each EP rank
keeps E / EP experts and exchanges tokens all-to-all). Both run on this engine (the
Megatron-FSDP path, or Megatron-core DDP on the engine), whose meshes ``ParallelDims``
lays out in Megatron-LM's rank order (``model_setup.py``). What the models or the launcher
cannot run with them is refused by name; the models' own rules come from
``context_parallel_problems`` and ``expert_parallel_problems``. No process group.
"""

from __future__ import annotations

import argparse

from ...models.config import GPTConfig
from ...models.context_parallel import context_parallel_problems
from ...models.expert_parallel import expert_parallel_problems


def context_parallel_size(args: argparse.Namespace) -> int:
    return getattr(args, "context_parallel_size", 1)


def expert_parallel_size(args: argparse.Namespace) -> int:
    return getattr(args, "expert_model_parallel_size", 1)


def on_the_engine(args: argparse.Namespace) -> bool:
    """Whether the flags wrap the model with this engine (Megatron-FSDP, or Megatron-core DDP on
    its no_shard/optim strategies: ``validation._data_parallel_path``), not PyTorch DDP / FSDP2."""
    if args.use_megatron_fsdp:
        return True
    if args.use_torch_fsdp2:
        return False
    return bool(args.use_distributed_optimizer or args.bf16 or args.fp16 or args.ddp_average_in_collective)


def ep_cp_problems(args: argparse.Namespace, world_size: int) -> list[str]:
    """Every problem of the two flags (an empty list at sizes 1)."""
    return _context_parallel_problems(args, world_size) + _expert_parallel_problems(args, world_size)


# -- context parallelism ------------------------------------------------------------------
def _context_parallel_problems(args: argparse.Namespace, world_size: int) -> list[str]:
    cp = context_parallel_size(args)
    flag = f"--context-parallel-size {cp}"
    if cp < 1:
        return [f"{flag} must be a positive integer (1: no context parallelism)"]
    if cp == 1:
        return []
    tp = args.tensor_model_parallel_size
    problems = []
    if tp >= 1 and world_size % (tp * cp):
        problems.append(f"{flag} x --tensor-model-parallel-size {tp} = {tp * cp} does not divide the world size "
                        f"{world_size} (Megatron-LM's rule: world = TP x CP x DP); launch a multiple of {tp * cp} "
                        "ranks")
    if args.seq_length is not None and args.seq_length > 0 and args.seq_length % (2 * cp):
        # Megatron-LM's validate_args asserts it: each sequence is cut into 2 x CP equal chunks.
        problems.append(f"{flag} with --seq-length {args.seq_length}: the sequence length must be a multiple of "
                        f"2 x CP = {2 * cp} (Megatron-LM's rule: every CP rank holds 2 of 2 x CP equal chunks of "
                        f"each sequence); use e.g. --seq-length {_round_up(args.seq_length, 2 * cp)}")
    local = args.seq_length // cp if args.seq_length else None
    if args.sequence_parallel and tp > 1 and local and local % tp:
        problems.append(f"{flag} with --sequence-parallel and --tensor-model-parallel-size {tp}: each CP rank's "
                        f"{local} tokens per sequence are split over the TP ranks, so --seq-length / CP must be a "
                        f"multiple of TP; use a --seq-length that is a multiple of {2 * cp * tp}")
    problems += [f"{flag} with {name}: {why}" for on, name, why in _shared_refusals(args, "context") if on]
    return problems + [f"{flag}: {why}" for why in _model_refusals(args, cp)]


def _model_refusals(args: argparse.Namespace, cp: int) -> list[str]:
    """What ``apply_context_parallel`` would refuse for the model of these flags
    (``context_parallel_problems``, the model's own rules), but the sequence length, whose
    rule is stated above in flag terms."""
    if args.use_mcore_models or args.seq_length is None or args.seq_length % (2 * cp):
        return []
    try:  # only the fields the CP rules read; the other rules report bad values of these flags
        cfg = GPTConfig(seq_length=args.seq_length, attention_dropout=args.attention_dropout,
                        mtp_num_layers=args.mtp_num_layers or None, num_moe_experts=args.num_experts,
                        moe_router_topk=min(args.moe_router_topk, args.num_experts or args.moe_router_topk),
                        multi_latent_attention=args.multi_latent_attention)
    except (ValueError, TypeError):
        return []
    return context_parallel_problems(cfg, cp)


# -- expert parallelism -------------------------------------------------------------------
def _expert_parallel_problems(args: argparse.Namespace, world_size: int) -> list[str]:
    ep = expert_parallel_size(args)
    flag = f"--expert-model-parallel-size {ep}"
    if ep < 1:
        return [f"{flag} must be a positive integer (1: every rank holds every expert)"]
    if ep == 1:
        return []
    experts = args.num_experts
    if experts is None:  # Megatron-LM's rule
        return [f"{flag} needs a mixture-of-experts model (Megatron-LM's rule); add --num-experts, or use "
                "--expert-model-parallel-size 1"]
    problems = []
    if experts > 0 and experts % ep:  # Megatron-LM's rule
        problems.append(f"{flag} does not divide --num-experts {experts} (Megatron-LM's rule: every EP rank holds "
                        f"an equal block of experts); use a divisor of {experts}")
    tp, cp = args.tensor_model_parallel_size, max(context_parallel_size(args), 1)
    if tp > 1:
        problems.append(f"{flag} with --tensor-model-parallel-size {tp}: experts are not supported together with "
                        "tensor parallelism here (they would need an expert tensor-parallel layout); use TP 1")
    elif world_size % cp == 0 and world_size % ep:
        problems.append(f"{flag} does not divide the data x context-parallel size {world_size} (world / TP) that "
                        f"the expert-parallel groups are carved out of; use a divisor of {world_size}")
    refused = _shared_refusals(args, "expert") + [
        (args.check_weight_hash_across_dp_replicas_interval is not None,
         "--check-weight-hash-across-dp-replicas-interval", "the check compares every rank's weights with rank "
                                                            "0's, and EP ranks hold different experts; drop it"),
    ]
    return problems + [f"{flag} with {name}: {why}" for on, name, why in refused if on]


def _shared_refusals(args: argparse.Namespace, kind: str) -> list[tuple[bool, str, str]]:
    """What neither context nor expert parallelism runs with here (``kind``: their name)."""
    size = "--context-parallel-size 1" if kind == "context" else "--expert-model-parallel-size 1"
    return [
        (args.use_mcore_models, "--use-mcore-models", f"{kind} parallelism is the embedded GPT's here "
                                                      f"(megatron-core's is not wired into this launcher); drop "
                                                      f"--use-mcore-models or use {size}"),
        (args.use_torch_fsdp2, "--use-torch-fsdp2", f"the FSDP2 path does not lay out the {kind}-parallel mesh"
                                                    + (" (and Megatron-LM refuses FSDP2 with expert parallelism)"
                                                       if kind == "expert" else "") + "; use --use-megatron-fsdp"),
        (not args.use_torch_fsdp2 and not on_the_engine(args),
         "PyTorch DDP (an fp32 run without --use-megatron-fsdp or --use-distributed-optimizer)",
         f"PyTorch DDP does not lay out the {kind}-parallel mesh"
         + (" and would average different experts across ranks" if kind == "expert" else "")
         + "; add --use-megatron-fsdp, or --use-distributed-optimizer for Megatron-core DDP on this engine"),
        (args.ckpt_format == "torch", "--ckpt-format torch",
         ("its file is written by rank 0, which holds only its own block of experts"
          if kind == "expert" else "its writer is not wired with the data x context layout here")
         + "; use --ckpt-format torch_dist (resharded on load at any size)"),
        (args.optimizer == "muon", "--optimizer muon", f"Muon is not wired with {kind} parallelism here; use adam "
                                                       "or sgd"),
    ]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def expert_model_problems(args: argparse.Namespace, layer_freq) -> list[str]:
    """What ``apply_expert_parallel`` would refuse for the model of these flags
    (``expert_parallel_problems``: e.g. a ``--moe-layer-freq`` that leaves no MoE layer);
    ``layer_freq``: the parsed ``--moe-layer-freq``. Called once the MoE flags are valid."""
    ep = expert_parallel_size(args)
    if ep <= 1 or args.num_experts is None or args.use_mcore_models or not args.num_layers or args.num_experts % ep:
        return []  # E % EP is stated in flag terms by _expert_parallel_problems
    try:  # only the fields the EP rules read
        cfg = GPTConfig(num_layers=args.num_layers, num_moe_experts=args.num_experts,
                        moe_router_topk=min(args.moe_router_topk, args.num_experts), moe_layer_freq=layer_freq)
    except (ValueError, TypeError):
        return []
    return [f"--expert-model-parallel-size {ep}: {why}" for why in expert_parallel_problems(cfg, ep)]


# -- expert capacity ------------------------------------------------------------------------
def capacity_problems(args: argparse.Namespace) -> list[str]:
    """megatron-core's rules for the capacity flags (its TransformerConfig's), and what the
    launcher does not wire."""
    factor = args.moe_expert_capacity_factor
    dropless = factor is None or factor < 0  # megatron-core: a negative factor means none
    problems = []
    if args.moe_pad_expert_input_to_capacity and dropless:
        problems.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (megatron-core's "
                        "rule: there is no capacity to pad to); add a factor or drop the flag")
    if dropless or args.num_experts is None:
        return problems
    flag = f"--moe-expert-capacity-factor {factor}"
    balancing = args.moe_router_load_balancing_type
    balancing = balancing[0] if isinstance(balancing, list) else balancing
    if factor == 0:
        problems.append(f"{flag} would give every expert a capacity of 0 tokens; pass a positive factor (1.0: each "
                        "expert takes its even share of the picks), or a negative one / none for dropless routing")
    if balancing == "sinkhorn":
        problems.append(f"{flag} with --moe-router-load-balancing-type sinkhorn: megatron-core drops tokens only "
                        "with aux_loss, seq_aux_loss, global_aux_loss or none; pick one of those or stay dropless")
    if args.use_mcore_models:
        problems.append(f"{flag} with --use-mcore-models: the capacity is the embedded MoE's here "
                        "(models/expert_parallel.py set_expert_capacity), not passed to megatron-core's; drop "
                        "--use-mcore-models or the factor")
    return problems


def capacity_warnings(args: argparse.Namespace) -> list[str]:
    """The capacity flags without a capacity, or without experts, change nothing (as in Megatron-LM)."""
    given = getattr(args, "given_flags", {})
    factor = args.moe_expert_capacity_factor
    if args.num_experts is None:
        flags = [f for f in ("--moe-expert-capacity-factor", "--moe-token-drop-policy") if f in given]
        return [f"{f}: no effect without --num-experts (no MoE layer to drop tokens in)" for f in flags]
    if (factor is None or factor < 0) and "--moe-token-drop-policy" in given:
        return [f"--moe-token-drop-policy {args.moe_token_drop_policy}: no effect without a positive "
                "--moe-expert-capacity-factor (dropless routing drops nothing)"]
    return []
