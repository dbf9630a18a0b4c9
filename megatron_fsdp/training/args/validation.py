"""Validation of the parsed flags: the argument table's verdict on each given flag,
Megatron-LM's rules for the values, this script's limits, and the fields derived
once the flags are known to be consistent.

Each rule returns its problem as a sentence naming the offending value and the fix;
``collect_problems`` gathers them so one run reports every mistake at once. Rules
that mirror Megatron-LM say so; the rest are limits of this script. Nothing here
starts a process group.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re

from ...comm import device as device_mod
from ...enums import ShardingStrategy
from ...models.config import megatron_swiglu_ffn_hidden_size
from . import (activation_offload_flags, checkpoint_flags, ep_cp_flags, fsdp_v2_flags, mla_flags, mtp_flags, muon_flags,
               torch_fsdp2_flags, tp_flags)
from .. import determinism
from ..data import tokenizers
from .arg_types import BYTE_VOCAB_SIZE, DataParallelPath, LRDecayStyle, Precision, TokenizerType, recompute_granularity
from .flag_table import FlagSpec, FlagStatus


# -- the table's verdict ----------------------------------------------------------------
def _values(value) -> list[str]:
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def flag_policy(args: argparse.Namespace, given: dict[str, FlagSpec]) -> tuple[list[str], list[str]]:
    """(problems, warnings) for the flags present on the command line / in the config."""
    problems, warnings = [], []
    for flag, spec in sorted(given.items()):
        value = getattr(args, spec.dest)
        shown = flag if spec.is_bool else f"{flag} {' '.join(_values(value))}"
        match spec.status:
            case FlagStatus.UNLISTED:
                problems.append(f"{flag} is a Megatron-LM flag ({spec.group}) that this launcher does not implement; "
                                "drop it (megatron_fsdp/training/args/flag_data/launcher_flags.table lists what is "
                                "supported)")
            case FlagStatus.REJECTED:
                problems.append(f"{shown}: {spec.note}")
            case FlagStatus.ONLY | FlagStatus.NOOP_ONLY if not spec.is_bool:
                bad = [v for v in _values(value) if v not in spec.supported]
                if bad:
                    problems.append(f"{flag} {' '.join(bad)} is not supported here; supported: "
                                    f"{', '.join(spec.supported)} ({spec.note})")
                elif spec.status is FlagStatus.NOOP_ONLY:
                    warnings.append(f"{shown}: accepted, no effect here: {spec.note}")
            case FlagStatus.NOOP:
                warnings.append(f"{shown}: accepted, no effect here: {spec.note}")
    return problems, warnings


def collect_problems(args: argparse.Namespace, world_size: int) -> list[str]:
    """Every rule's problems. The tensor-, context- and expert-parallel rules read the world;
    the rest read the data-parallel size (the world over TP x CP), as Megatron-LM's batch
    rules do."""
    problems = tp_flags.tp_problems(args, world_size) + ep_cp_flags.ep_cp_problems(args, world_size)
    data_parallel = tp_flags.data_parallel_size(args, world_size)
    for rule in (_required, _model_shape, _model_features, _multi_latent_attention, _multi_token_prediction,
                 _recompute, _batch, _eval_batch, _batch_rampup, _schedule, _data_parallel, _megatron_fsdp,
                 _precision, _determinism, _data, _fim, _io, _optional_packages, _muon, _activation_offload,
                 _rerun, _profiling):
        problems += rule(args, data_parallel)  # the rules' second parameter: the data-parallel size
    return problems


def _required(args, world_size) -> list[str]:
    # Megatron-LM requires the network size; this script also needs a training
    # budget (iterations or samples), a micro batch and a learning rate.
    missing = [
        f"--{name.replace('_', '-')}"
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                     "micro_batch_size", "lr")
        if getattr(args, name) is None
    ]
    if args.train_iters is None and args.train_samples is None:
        missing.append("--train-iters (or --train-samples)")
    if missing:
        return [f"missing {', '.join(missing)}: pass them on the command line or in --config FILE.yaml "
                "(configs/gpt_tiny_cpu.yaml has working values)"]
    return []


def _positive(args, names) -> list[str]:
    return [
        f"--{n.replace('_', '-')}={getattr(args, n)} must be a positive integer"
        for n in names
        if getattr(args, n) is not None and getattr(args, n) <= 0
    ]


def _model_shape(args, world_size) -> list[str]:
    problems = _positive(args, ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                "max_position_embeddings", "ffn_hidden_size", "vocab_size", "kv_channels"))
    if problems or args.hidden_size is None or args.num_attention_heads is None:
        return problems
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        problems.append(f"--hidden-size={args.hidden_size} is not divisible by --num-attention-heads="
                        f"{args.num_attention_heads}; pick a head count that divides the hidden size "
                        "(or set --kv-channels)")
    if args.swiglu and args.ffn_hidden_size is None and megatron_swiglu_ffn_hidden_size(args.hidden_size) == 0:
        problems.append(f"--swiglu with --hidden-size={args.hidden_size} and no --ffn-hidden-size: Megatron-LM's "
                        "default (2/3 x 4 x hidden, rounded down to a multiple of 64) is 0; pass --ffn-hidden-size")
    if args.seq_length is not None and args.max_position_embeddings is not None:
        if args.position_embedding_type == "learned_absolute" and args.max_position_embeddings < args.seq_length:
            problems.append(f"--max-position-embeddings={args.max_position_embeddings} is smaller than "
                            f"--seq-length={args.seq_length}; raise it to at least {args.seq_length}")
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups is None or groups <= 0 or args.num_attention_heads % groups:
            problems.append(f"--num-query-groups={groups} must divide --num-attention-heads="
                            f"{args.num_attention_heads} (Megatron-LM's rule for grouped-query attention)")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(args, name)
        if not 0.0 <= value < 1.0:
            problems.append(f"--{name.replace('_', '-')}={value} must be in [0, 1)")
    if not 0.0 < args.rotary_percent <= 1.0:
        problems.append(f"--rotary-percent={args.rotary_percent} must be in (0, 1]")
    if not args.add_position_embedding and args.position_embedding_type != "rope":  # Megatron-LM's validate_args
        problems.append(f"--no-position-embedding with --position-embedding-type {args.position_embedding_type}: "
                        "Megatron-LM refuses the deprecated flag unless the positions are rotary; say what you mean "
                        "with --position-embedding-type (rope) and drop --no-position-embedding")
    return problems


_LAYER_PATTERN_CHARS = frozenset("0123456789,[]()+*")
"""What Megatron-LM's ``_eval_pattern`` lets through to ``eval`` (no spaces, no names)."""


def parse_layer_freq(text) -> "int | list[int]":
    """Megatron-LM's ``--moe-layer-freq`` (its ``moe_freq_type``): text without ``[`` is
    an int N (layer i is MoE when i % N == 0); text with ``[`` is a Python list
    expression of digits, ``,[]()+*`` only, such as ``([0]+[1]*23)``, here read by
    walking its syntax tree instead of Megatron-LM's ``eval``. Raises ``ValueError``
    naming what is wrong; per-layer checks (length, 0/1, N > 0) are ``layer_freq_problem``'s."""
    import ast

    def value(node):
        match node:
            case ast.Constant(value=int() as v) if not isinstance(v, bool):
                return v
            case ast.List(elts=elts) | ast.Tuple(elts=elts):
                items = [value(e) for e in elts]
                return items if isinstance(node, ast.List) else tuple(items)
            case ast.BinOp(left=left, op=ast.Mult(), right=right):
                return value(left) * value(right)
            case ast.BinOp(left=left, op=ast.Add(), right=right):
                return value(left) + value(right)
        raise ValueError(f"unsupported expression {ast.unparse(node)!r}")

    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if isinstance(text, list):
        return text
    text = str(text).strip().strip("'\"")
    if "[" not in text:
        return int(text)  # Megatron-LM: int(x); a ValueError for anything else
    bad = sorted(set(text) - _LAYER_PATTERN_CHARS)
    if bad:
        raise ValueError(f"the characters {''.join(bad)!r} are not allowed (Megatron-LM accepts digits and ,[]()+* "
                         "only; write it without spaces)")
    try:
        result = value(ast.parse(text, mode="eval").body)
    except SyntaxError as exc:
        raise ValueError(f"not a Python list expression ({exc.msg})") from None
    if not isinstance(result, list):
        raise ValueError(f"evaluates to {result!r}, not a list")
    return result


def layer_freq_problem(freq, num_layers: int) -> "str | None":
    """Why megatron-core's ``get_gpt_decoder_layer_specs`` would fail on ``freq`` (parsed
    ``--moe-layer-freq``) for ``num_layers`` layers, or None: a list needs one 0 or 1 per
    layer; an int must be positive (Megatron-LM divides by it: 0 crashes, and a negative
    N would silently act as -N)."""
    if isinstance(freq, int):
        return None if freq > 0 else f"must be a positive integer N (every N-th layer is MoE), got {freq}"
    if any(isinstance(v, bool) or v not in (0, 1) for v in freq):
        return f"must hold only 0 (dense) and 1 (MoE), got {freq}"
    if len(freq) != num_layers:
        return f"has {len(freq)} entries for --num-layers={num_layers}; give one 0/1 per layer"
    return None


def _model_features(args, world_size) -> list[str]:
    """Model flags need the embedded GPTConfig field they map to (see
    ``model_setup.MODEL_FLAG_FIELDS``); a checkout without it says so instead of
    training another architecture silently."""
    problems = []
    if args.num_experts is not None:
        if args.num_experts <= 0:
            problems.append(f"--num-experts={args.num_experts} must be positive")
        elif not 0 < args.moe_router_topk <= args.num_experts:
            problems.append(f"--moe-router-topk={args.moe_router_topk} must be in [1, --num-experts="
                            f"{args.num_experts}]")
    try:
        freq = parse_layer_freq(args.moe_layer_freq)
    except ValueError as exc:
        problems.append(f"--moe-layer-freq {args.moe_layer_freq!r} is neither an integer nor a list expression "
                        f"({exc}); write e.g. 2 (every other layer MoE) or ([0]+[1]*23) (Megatron-LM's syntax)")
    else:
        # Megatron-LM reads it only for --num-experts models (megatron-core's block spec).
        why = layer_freq_problem(freq, args.num_layers) if args.num_experts is not None and args.num_layers else None
        if why:
            problems.append(f"--moe-layer-freq {args.moe_layer_freq} {why}")
        elif args.num_experts is not None and 0 < args.moe_router_topk <= args.num_experts:
            problems += ep_cp_flags.expert_model_problems(args, freq)
    if args.squared_relu and args.swiglu:  # Megatron-LM's assertion
        problems.append("--squared-relu and --swiglu both choose the MLP's activation; keep one")
    elif args.squared_relu and args.add_bias_linear and args.bias_gelu_fusion:
        # megatron-core's TransformerConfig: a fused bias-activation kernel exists for gelu and swiglu only.
        problems.append("--squared-relu with the bias-GELU fusion on (Megatron-LM's default with biased linear "
                        "layers): megatron-core refuses it; add --no-bias-gelu-fusion or --disable-bias-linear")
    if args.rotary_interleaved and args.multi_latent_attention:  # megatron-core's TransformerConfig rule
        problems.append("--rotary-interleaved does not work with --multi-latent-attention (megatron-core refuses "
                        "the pair); drop --rotary-interleaved")
    if args.attention_output_gate and args.multi_latent_attention:  # megatron-core's MLATransformerConfig rule
        problems.append("--attention-output-gate with --multi-latent-attention: megatron-core has no output gate for "
                        "MLA (NotImplementedError); drop one of the two")
    types = args.moe_router_load_balancing_type
    if isinstance(types, list) and len(types) > 1:
        problems.append(f"--moe-router-load-balancing-type {' '.join(types)}: combining balancing losses is not "
                        "implemented here; pass one type")
    coeffs = args.moe_aux_loss_coeff if isinstance(args.moe_aux_loss_coeff, list) else [args.moe_aux_loss_coeff]
    if len(coeffs) > 1:
        problems.append(f"--moe-aux-loss-coeff {' '.join(map(str, coeffs))}: one coefficient per load-balancing "
                        "type is not implemented here; pass one value")
    if args.num_experts is not None and args.num_experts > 0 and not problems:
        problems += _moe_router_problems(args)
    problems += ep_cp_flags.capacity_problems(args)
    if args.use_mcore_models:
        return problems + _mcore_model_problems(args)
    from ..model_setup import missing_model_fields

    for flag, field in missing_model_fields(args):
        problems.append(f"{flag} needs the embedded model's GPTConfig.{field}, which this checkout does not have; "
                        "update megatron_fsdp (megatron_fsdp/models) or drop the flag")
    return problems


def _moe_router_problems(args) -> list[str]:
    """megatron-core's router rules (``GPTConfig._check_router``, which mirrors its
    TransformerConfig) on the router flags, at parse time, in flag names."""
    from ...models.config import GPTConfig

    first = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731  (nargs="+", one value checked above)
    try:
        GPTConfig(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                  moe_aux_loss_coeff=first(args.moe_aux_loss_coeff),
                  moe_router_load_balancing_type=first(args.moe_router_load_balancing_type),
                  moe_router_pre_softmax=args.moe_router_pre_softmax,
                  moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
                  moe_router_score_function=args.moe_router_score_function,
                  moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
                  moe_router_bias_update_rate=args.moe_router_bias_update_rate,
                  moe_router_num_groups=args.moe_router_num_groups, moe_router_group_topk=args.moe_router_group_topk)
    except ValueError as exc:
        return [re.sub(r"\bmoe_[a-z_]+", lambda m: "--" + m.group(0).replace("_", "-"), str(exc))]
    return []


def _mcore_model_problems(args) -> list[str]:
    """What Megatron-LM itself cannot build for ``--use-mcore-models`` (see
    [Note: zero-centred norms in megatron-core] in models/mcore.py)."""
    problems = []
    if args.layernorm_zero_centered_gamma and args.transformer_impl == "local" and args.normalization == "RMSNorm":
        problems.append("--apply-layernorm-1p with --normalization RMSNorm and --transformer-impl local: Megatron-LM's "
                        "local spec builds RMSNorm from torch (WrappedTorchNorm), which refuses zero-centred gamma; "
                        "use --transformer-impl transformer_engine (Megatron-LM's default, whose TENorm has it), "
                        "LayerNorm, or drop --apply-layernorm-1p")
    return problems


def _muon(args, world_size) -> list[str]:
    return muon_flags.muon_problems(args)


def _multi_latent_attention(args, world_size) -> list[str]:
    return mla_flags.mla_problems(args)


def _multi_token_prediction(args, world_size) -> list[str]:
    return mtp_flags.mtp_problems(args)


def _activation_offload(args, world_size) -> list[str]:
    return activation_offload_flags.offload_problems(args)


def _profiling(args, world_size) -> list[str]:
    """observe/profiling.py [Note: the profiling window]."""
    if not args.profile:
        return []
    problems = []
    if args.profile_step_end <= args.profile_step_start or args.profile_step_start < 0:
        problems.append(f"--profile-step-start {args.profile_step_start} and --profile-step-end "
                        f"{args.profile_step_end}: the window needs 0 <= start < end")
    on_cuda = device_mod.cuda_available() and args.distributed_backend != "gloo"  # nccl, the default with CUDA
    if not args.use_pytorch_profiler and not on_cuda:
        problems.append("--profile without --use-pytorch-profiler opens the range of an external CUDA profiler "
                        "(nsys), which needs CUDA; add --use-pytorch-profiler for a torch.profiler trace")
    return problems


def _rerun(args, world_size) -> list[str]:
    # megatron-core's rerun machine consults the error injector only while it validates
    # results (--rerun-mode validate_results, Megatron-LM's default); disabled, a rate changes nothing.
    if args.error_injection_rate > 0 and args.rerun_mode != "disabled":
        return [f"--error-injection-rate {args.error_injection_rate} with --rerun-mode {args.rerun_mode}: Megatron-LM "
                "would inject faults into 1 in that many validated results and re-run or stop the iteration they "
                "hit (its rerun machine's diagnosis), which is not implemented here; pass --error-injection-rate 0 "
                "or --rerun-mode disabled"]
    return []


def _recompute(args, world_size) -> list[str]:
    """Megatron-LM's rules for activation recomputation (its TransformerConfig's):
    full needs a method and a layer count, selective takes neither."""
    granularity = recompute_granularity(args)
    method, layers = args.recompute_method, args.recompute_num_layers
    problems = []
    if granularity == "full":
        if method is None:
            problems.append("--recompute-granularity full needs --recompute-method uniform|block (Megatron-LM's "
                            "rule); add e.g. --recompute-method uniform --recompute-num-layers 1 to recompute "
                            "every block")
        if layers is None:
            problems.append("--recompute-granularity full needs --recompute-num-layers N (Megatron-LM's rule): "
                            "blocks per checkpointed group (uniform) or checkpointed blocks (block)")
        elif args.num_layers is not None and not 1 <= layers <= args.num_layers:
            problems.append(f"--recompute-num-layers={layers} must be between 1 and --num-layers={args.num_layers}")
    elif granularity == "selective":
        if method is not None:
            problems.append(f"--recompute-method {method} does not apply to selective recomputation (Megatron-LM's "
                            "rule); drop it, or use --recompute-granularity full")
        if layers is not None:
            problems.append(f"--recompute-num-layers={layers} does not apply to selective recomputation "
                            "(Megatron-LM's rule); drop it, or use --recompute-granularity full")
    return problems


def _batch(args, data_parallel) -> list[str]:
    problems = _positive(args, ("micro_batch_size", "global_batch_size", "train_iters", "train_samples",
                                "log_interval"))
    if problems or args.micro_batch_size is None:
        return problems
    # Megatron-LM: a global batch is a whole number of micro batches on every DP rank.
    per_step = args.micro_batch_size * data_parallel
    if args.global_batch_size is not None and args.global_batch_size % per_step:
        problems.append(
            f"--global-batch-size={args.global_batch_size} is not divisible by --micro-batch-size="
            f"{args.micro_batch_size} x data-parallel size {data_parallel} = {per_step}; use a multiple of {per_step}"
        )
    for name in ("exit_interval", "exit_duration_in_mins"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            problems.append(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    return problems


def _eval_batch(args, data_parallel) -> list[str]:
    """--eval-global-batch-size / --eval-micro-batch-size (default: the training values). Megatron-LM's
    rule: the evaluation batch is a whole number of evaluation micro batches on every DP rank."""
    if args.eval_global_batch_size is None and args.eval_micro_batch_size is None:
        return []
    problems = _positive(args, ("eval_global_batch_size", "eval_micro_batch_size"))
    if problems or args.micro_batch_size is None or (args.global_batch_size or 1) <= 0:
        return problems
    micro = args.eval_micro_batch_size or args.micro_batch_size
    batch = args.eval_global_batch_size or args.global_batch_size or args.micro_batch_size * data_parallel
    if batch % (micro * data_parallel):
        problems.append(f"the evaluation batch {batch} (--eval-global-batch-size, default --global-batch-size) is not "
                        f"divisible by --eval-micro-batch-size {micro} (default --micro-batch-size) x data-parallel "
                        f"size {data_parallel} = {micro * data_parallel} (Megatron-LM's rule); use a multiple of it")
    return problems


def _batch_rampup(args, data_parallel) -> list[str]:
    """--rampup-batch-size / --step-batch-size-schedule / --decrease-batch-size-if-needed (microbatches.py)."""
    from ..microbatches import batch_problems

    return batch_problems(args, data_parallel)


def _schedule(args, world_size) -> list[str]:
    problems = []
    if args.lr is not None and args.min_lr > args.lr:  # Megatron-LM rule
        problems.append(f"--min-lr={args.min_lr} is larger than --lr={args.lr}; lower --min-lr")
    # Megatron-LM: iteration-based and sample-based settings do not mix.
    if args.train_iters is not None and args.train_samples is not None:
        problems.append("--train-iters and --train-samples are exclusive (Megatron-LM: iteration- or sample-based "
                        "training); keep one")
    elif args.train_samples is not None:
        for name, value in (("lr_decay_iters", args.lr_decay_iters), ("lr_warmup_iters", args.lr_warmup_iters or None)):
            if value is not None:
                problems.append(f"--{name.replace('_', '-')}={value} with --train-samples: sample-based training "
                                f"takes --{name.replace('_', '-').replace('iters', 'samples')} instead")
    else:
        for name, value in (("lr_decay_samples", args.lr_decay_samples),
                            ("lr_warmup_samples", args.lr_warmup_samples or None)):
            if value is not None:
                problems.append(f"--{name.replace('_', '-')}={value} needs sample-based training (--train-samples); "
                                f"with --train-iters use --{name.replace('_', '-').replace('samples', 'iters')}")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        problems.append("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive "
                        "(Megatron-LM's rule); keep one")
    if args.lr_warmup_iters < 0 or args.lr_warmup_samples < 0:
        problems.append("--lr-warmup-iters / --lr-warmup-samples must be >= 0")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction < 1.0:
        problems.append(f"--lr-warmup-fraction={args.lr_warmup_fraction} must be in [0, 1)")
    for name in ("lr_decay_iters", "lr_decay_samples"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            problems.append(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if args.clip_grad < 0:
        problems.append(f"--clip-grad={args.clip_grad} must be >= 0 (0 disables clipping)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        problems.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are exclusive "
                        "(Megatron-LM's rule): the command line's schedule or the checkpoint's; keep one")
    return problems


def _data_parallel(args, data_parallel) -> list[str]:
    problems = []
    if args.use_megatron_fsdp and args.use_torch_fsdp2:  # Megatron-LM: the two are exclusive
        problems.append("--use-megatron-fsdp and --use-torch-fsdp2 are mutually exclusive; keep --use-megatron-fsdp")
    problems += torch_fsdp2_flags.torch_fsdp2_problems(args, os.environ)
    problems += fsdp_v2_flags.fsdp_v2_problems(args)
    if args.overlap_param_gather:  # Megatron-LM rules
        if not (args.use_distributed_optimizer or args.use_megatron_fsdp):
            problems.append("--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp")
        if not args.overlap_grad_reduce:
            problems.append("--overlap-param-gather needs --overlap-grad-reduce; add --overlap-grad-reduce")
    if args.overlap_param_gather_with_optimizer_step:  # Megatron-LM's rules (a schedule: a no-op here)
        if not args.use_distributed_optimizer:
            problems.append("--overlap-param-gather-with-optimizer-step is only supported with the distributed "
                            "optimizer (Megatron-LM's rule); add --use-distributed-optimizer")
        if not args.overlap_param_gather:
            problems.append("--overlap-param-gather-with-optimizer-step needs --overlap-param-gather (Megatron-LM's "
                            "rule); add it")
        if args.ckpt_format != "torch":
            problems.append(f"--overlap-param-gather-with-optimizer-step is not supported with distributed "
                            f"checkpointing (Megatron-LM's rule), got --ckpt-format {args.ckpt_format}; use "
                            "--ckpt-format torch")
    instances = args.num_distributed_optimizer_instances
    if instances < 1:
        problems.append(f"--num-distributed-optimizer-instances={instances} must be >= 1")
    elif instances > 1 and data_parallel % instances:
        problems.append(f"--num-distributed-optimizer-instances={instances} does not divide the data-parallel "
                        f"size {data_parallel}; use a divisor of {data_parallel}")
    return problems


def _megatron_fsdp(args, world_size) -> list[str]:
    problems = []
    fsdp_only = {
        "--fsdp-double-buffer": args.fsdp_double_buffer,
        "--suggested-communication-unit-size": args.suggested_communication_unit_size is not None,
        f"--outer-dp-sharding-strategy={args.outer_dp_sharding_strategy}":
            args.outer_dp_sharding_strategy != ShardingStrategy.NO_SHARD.label,
        "--init-model-with-meta-device": args.init_model_with_meta_device,
    }
    if not args.use_megatron_fsdp:
        for flag, given in fsdp_only.items():
            if given and flag != "--init-model-with-meta-device":
                problems.append(f"{flag} only applies to Megatron-FSDP; add --use-megatron-fsdp or drop it")
        if args.num_distributed_optimizer_instances > 1 and not args.use_distributed_optimizer:
            problems.append(f"--num-distributed-optimizer-instances={args.num_distributed_optimizer_instances} "
                            "shards a distributed optimizer; add --use-distributed-optimizer (or "
                            "--use-megatron-fsdp) or drop it")
        if args.ckpt_format == "fsdp_dtensor":  # Megatron-LM rule
            problems.append("--ckpt-format fsdp_dtensor is only used with --use-megatron-fsdp (Megatron-LM's rule); "
                            "add --use-megatron-fsdp or use --ckpt-format torch_dist")
        return problems
    strategy = ShardingStrategy.parse(args.data_parallel_sharding_strategy, arg_name="--data-parallel-sharding-strategy")
    if args.outer_dp_sharding_strategy == ShardingStrategy.OPTIM.label:
        if strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
            problems.append(f"--outer-dp-sharding-strategy=optim (HFSDP) needs --data-parallel-sharding-strategy="
                            f"optim_grads_params, got {strategy.label}")
        if args.num_distributed_optimizer_instances < 2:
            problems.append("--outer-dp-sharding-strategy=optim needs an outer group: set "
                            "--num-distributed-optimizer-instances >= 2 (or use no_shard)")
    if args.init_model_with_meta_device and strategy is ShardingStrategy.NO_SHARD:  # Megatron-LM rule
        problems.append("--init-model-with-meta-device is not supported (nor needed) with "
                        "--data-parallel-sharding-strategy no_shard (Megatron-LM's rule); drop one")
    if args.suggested_communication_unit_size is not None and args.suggested_communication_unit_size <= 0:
        problems.append(f"--suggested-communication-unit-size={args.suggested_communication_unit_size} "
                        "must be a positive number of elements")
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":  # Megatron-LM rule for FSDP on GPUs
        problems.append("Megatron-FSDP needs CUDA_DEVICE_MAX_CONNECTIONS unset or > 1; unset it")
    return problems


def _precision(args, world_size) -> list[str]:
    problems = []
    if args.bf16 and args.fp16:  # Megatron-LM rule
        problems.append("--bf16 and --fp16 are mutually exclusive; pick one")
    if args.loss_scale is not None and not args.fp16:
        problems.append(f"--loss-scale={args.loss_scale} only applies to --fp16; add --fp16 or drop it")
    if args.loss_scale is not None and args.loss_scale <= 0:
        problems.append(f"--loss-scale={args.loss_scale} must be positive")
    return problems


def _determinism(args, world_size) -> list[str]:
    """Megatron-LM's --deterministic-mode rules (determinism.py)."""
    if not args.deterministic_mode:
        return []
    return determinism.option_problems(args) + determinism.environment_problems(os.environ)


def default_tokenizer_type(args: argparse.Namespace) -> None:
    """Megatron-LM's ``pretrain_gpt.py`` defaults ``--tokenizer-type`` to GPT2BPETokenizer,
    so a run that gives ``--vocab-file``/``--merge-file`` without a type trains GPT-2's
    50257 tokens there, so the launcher does too (the byte tokenizer, 256 ids, would
    ignore the files: a different model). Without the files
    Megatron-LM's default cannot start; the launcher keeps its own defaults then
    (``derive_fields``)."""
    if args.tokenizer_type is None and (args.vocab_file or args.merge_file):
        args.tokenizer_type = tokenizers.TokenizerType.GPT2_BPE.value


def _data(args, world_size) -> list[str]:
    """The data module's validation (``data_args_problems``: data path, mock data, split,
    tokenizer files) plus this launcher's byte-tokenizer rule."""
    problems = []
    tokenizer = args.tokenizer_type
    if tokenizer in (None, TokenizerType.BYTE.value) and args.vocab_size is not None \
            and args.vocab_size != BYTE_VOCAB_SIZE and not args.mock_data:
        problems.append(f"--vocab-size={args.vocab_size} needs --tokenizer-type NullTokenizer (or --mock-data); "
                        f"the byte tokenizer has {BYTE_VOCAB_SIZE} tokens")
    from ..data.from_args import data_args_problems

    return problems + data_args_problems(args)


def _fim(args, world_size) -> list[str]:
    """--fim-data and its flags (the data module's rules: data/fim.py)."""
    from ..data.fim import fim_problems

    return fim_problems(args)


def _io(args, world_size) -> list[str]:
    problems = checkpoint_flags.checkpoint_problems(args)
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is not None and interval <= 0:
        problems.append(f"--check-weight-hash-across-dp-replicas-interval={interval} must be a positive number "
                        "of iterations")
    if interval is not None and args.use_megatron_fsdp and \
            args.data_parallel_sharding_strategy == ShardingStrategy.OPTIM_GRADS_PARAMS.label:  # Megatron-LM rule
        problems.append("--check-weight-hash-across-dp-replicas-interval is not supported with "
                        "--data-parallel-sharding-strategy optim_grads_params (Megatron-LM's rule: the weights are "
                        "sharded, there are no replicas to compare); drop one")
    if args.eval_iters < 0:
        problems.append(f"--eval-iters={args.eval_iters} must be >= 0 (0 disables evaluation)")
    if args.eval_iters > 0 and args.eval_interval <= 0:
        problems.append(f"--eval-interval={args.eval_interval} must be positive when --eval-iters > 0")
    if args.timing_log_level not in (0, 1, 2):
        problems.append(f"--timing-log-level={args.timing_log_level} must be 0, 1 or 2")
    return problems


def _optional_packages(args, world_size) -> list[str]:
    # Checked here, before torch.distributed starts, so a missing package or device
    # is one message instead of a traceback from every rank.
    if args.distributed_backend == "nccl" and not device_mod.cuda_available():
        return ["--distributed-backend nccl needs CUDA, which this torch/machine lacks; use gloo (the default "
                "without CUDA)"]
    if (args.distributed_backend or "nccl") == "nccl" and device_mod.cuda_available():
        # NCCL gives each process a GPU of its own (cuda:LOCAL_RANK), as Megatron-LM does.
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), device_mod.cuda_device_count()
        if local_rank >= count:
            return [f"the nccl backend (the default with CUDA) gives each process its own GPU, but this is local "
                    f"rank {local_rank} and {count} CUDA device(s) are visible: launch at most {count} process(es) "
                    f"per node (torchrun --nproc-per-node {count}), or pass --distributed-backend gloo to train on CPU"]
    if not args.use_mcore_models:
        return []
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return ["--use-mcore-models needs megatron-core, which is not installed; run "
                "`bash scripts/setup_megatron_core.sh` (pip install --no-deps megatron-core), or drop the flag "
                "to train the embedded GPT"]
    if not device_mod.cuda_available() or args.distributed_backend == "gloo":
        # megatron-core's GPTModel allocates attention buffers and RNG state on torch.cuda.current_device().
        return ["--use-mcore-models needs CUDA: Megatron-core's GPTModel forward allocates on the current CUDA "
                "device; run it on GPUs with the nccl backend, or drop the flag to train the embedded GPT on CPU"]
    return []


# -- derived fields ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleUnits:
    """The LR schedule's clock (Megatron-LM's OptimizerParamScheduler): iterations,
    or samples with ``increment`` = global batch size per step."""

    warmup_steps: float
    """Fractional with ``--lr-warmup-fraction``: Megatron-LM does not round fraction x horizon."""
    decay_steps: int
    increment: int
    unit: str


def derive_schedule(args) -> ScheduleUnits:
    if args.train_samples is not None:
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warmup = args.lr_warmup_samples
        increment, unit = args.global_batch_size, "samples"
    else:
        decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
        warmup = args.lr_warmup_iters
        increment, unit = 1, "iterations"
    if args.lr_warmup_fraction is not None:
        # Unrounded, as Megatron-LM: 0.01 x 150 iterations is a warmup of 1.5 iterations
        # (its clock counts samples, 12 of 1200 at a global batch of 8), not of 1.
        warmup = args.lr_warmup_fraction * decay
    return ScheduleUnits(warmup_steps=warmup, decay_steps=decay, increment=increment, unit=unit)


def derive_fields(args: argparse.Namespace, world_size: int) -> None:
    """Fill Megatron-LM's derived values and parse strings into enums, once."""
    warnings = args.flag_warnings
    args.world_size = world_size
    # Batches are counted per data-parallel rank: the TP x CP ranks of one share its batch.
    data_parallel = args.data_parallel_size = tp_flags.data_parallel_size(args, world_size)
    warnings += tp_flags.tp_warnings(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * data_parallel
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * data_parallel)
    # Megatron-LM evaluates with its own batch, by default the training one (micro batch x DP with a step schedule).
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    if args.eval_micro_batch_size is None:
        args.eval_micro_batch_size = args.micro_batch_size
    args.eval_num_microbatches = args.eval_global_batch_size // (args.eval_micro_batch_size * data_parallel)
    from ..microbatches import BatchSchedule

    args.batch_schedule = BatchSchedule.from_args(args, data_parallel)
    if args.train_samples is not None:  # Megatron-LM's update_train_iters (ramp-up / step schedule included)
        args.train_iters = args.batch_schedule.train_iters(args.train_samples)
    args.schedule = derive_schedule(args)
    if args.schedule.warmup_steps and args.schedule.warmup_steps >= args.schedule.decay_steps:
        raise_problem(f"the warmup ({args.schedule.warmup_steps} {args.schedule.unit}) must end before the decay "
                      f"horizon ({args.schedule.decay_steps} {args.schedule.unit}); shorten the warmup or lengthen "
                      "the decay")
    if args.use_megatron_fsdp and args.megatron_fsdp_version == 1 and not args.use_distributed_optimizer:
        # Megatron-LM turns the distributed optimizer on itself for v1 (and warns); v2 refuses it.
        args.use_distributed_optimizer = True
    if args.async_save and not args.use_gloo_process_groups:
        # As Megatron-LM does when its background writer is unavailable: save synchronously
        # and say so. The checkpoint is the same; only its overlap with training is lost.
        args.async_save = False
        warnings.append("--async-save with --disable-gloo-process-groups: checkpoints are written synchronously (the "
                        "background writer, torch.distributed.checkpoint.async_save, coordinates on a gloo group, "
                        "which the flag forbids); the checkpoint written is the same")
    _derive_model_fields(args, warnings)
    if args.grad_reduce_in_bf16 and args.megatron_fsdp_grad_comm_dtype == "auto":
        args.megatron_fsdp_grad_comm_dtype = "bf16"
    args.split = args.split.strip().strip("'\"")
    args.precision = Precision.BF16 if args.bf16 else Precision.FP16 if args.fp16 else Precision.FP32
    args.dp_path = _data_parallel_path(args)
    warnings += torch_fsdp2_flags.torch_fsdp2_warnings(args)
    warnings += muon_flags.muon_warnings(args)
    if args.dp_path is DataParallelPath.MEGATRON_DDP:
        _megatron_ddp_fields(args)
    args.zero_strategy = ShardingStrategy.parse(args.data_parallel_sharding_strategy)
    args.outer_strategy = ShardingStrategy.parse(args.outer_dp_sharding_strategy)
    args.lr_decay = LRDecayStyle(args.lr_decay_style)
    if args.tokenizer_type is None:
        args.tokenizer_type = (TokenizerType.NULL.value if args.mock_data and args.vocab_size is not None
                               else TokenizerType.BYTE.value)
    if args.tokenizer_type == TokenizerType.BYTE.value:
        args.vocab_size = BYTE_VOCAB_SIZE
    # Megatron-LM's NullTokenizer (megatron.core.tokenizers) has exactly --vocab-size ids,
    # its end-of-document token being the last of them (the legacy one added an id after).
    args.padded_vocab_size = (padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                                args.tensor_model_parallel_size)
                              if args.vocab_size is not None else None)
    if args.plot_path is not None and args.plot_path.lower() == "none":
        args.plot_path = None
    # Megatron-LM: dynamic loss scaling treats Inf/NaN gradients as a signal, not an error.
    if args.fp16 and args.loss_scale is None:
        args.check_for_nan_in_loss_and_grad = False
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        warnings.append(f"--tensorboard-dir {args.tensorboard_dir}: the tensorboard package is not installed, so no "
                        "TensorBoard events will be written; `pip install tensorboard` (scripts/setup_env.sh does)")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        warnings.append(f"--wandb-project {args.wandb_project}: the wandb package is not installed, so nothing is "
                        "logged to Weights & Biases; `pip install wandb` (and WANDB_MODE=offline without a login)")


def _derive_model_fields(args: argparse.Namespace, warnings: list[str]) -> None:
    """Megatron-LM's derived model sizes and the model flags' single values (part of
    ``derive_fields``); flags without effect in the combination given add a warning."""
    if args.ffn_hidden_size is None:
        # Megatron-LM's default: 4 x hidden, or with --swiglu two thirds of it rounded
        # down to a multiple of 64 (the gate doubles the first projection).
        args.ffn_hidden_size = (megatron_swiglu_ffn_hidden_size(args.hidden_size) if args.swiglu
                                else 4 * args.hidden_size)
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    warnings += mla_flags.mla_warnings(args)
    warnings += mtp_flags.mtp_warnings(args)
    warnings += ep_cp_flags.capacity_warnings(args)
    if not mtp_flags.mtp_enabled(args):
        args.mtp_num_layers = None  # Megatron-LM: 0 builds no MTP layer
    if args.rotary_interleaved and args.position_embedding_type != "rope" and not args.multi_latent_attention:
        # Megatron-LM reads it only for rotary embeddings: ignored there without a word.
        warnings.append(f"--rotary-interleaved has no effect with --position-embedding-type "
                        f"{args.position_embedding_type} (no rotary embedding); add --position-embedding-type rope")
        args.rotary_interleaved = False
    if args.recompute_activations:  # Megatron-LM's alias
        args.recompute_granularity = "selective"
    if args.recompute_granularity is None and (args.recompute_method or args.recompute_num_layers):
        warnings.append("--recompute-method / --recompute-num-layers without --recompute-granularity full: no "
                        "recomputation (as in Megatron-LM); add --recompute-granularity full to use them")
    if isinstance(args.moe_aux_loss_coeff, list):
        args.moe_aux_loss_coeff = args.moe_aux_loss_coeff[0]
    if isinstance(args.moe_router_load_balancing_type, list):  # nargs="+"; one type (validated)
        args.moe_router_load_balancing_type = args.moe_router_load_balancing_type[0]
    args.moe_layer_freq = parse_layer_freq(args.moe_layer_freq)
    if args.moe_shared_expert_gate and (args.num_experts is None or args.moe_shared_expert_intermediate_size is None):
        # megatron-core builds the gate inside the shared expert only: ignored there without a word.
        warnings.append("--moe-shared-expert-gate has no effect without a shared expert (--num-experts and "
                        "--moe-shared-expert-intermediate-size), as in Megatron-LM; add them or drop the flag")
    if args.num_experts is not None and not args.swiglu and args.add_bias_linear and args.bias_gelu_fusion:
        # Megatron-core's experts raise "Only support fusion of swiglu and quick_gelu ..." here.
        warnings.append("--num-experts with a GELU MLP with biases and the bias-GELU fusion on: Megatron-LM refuses "
                        "this (its fused bias-GELU kernel takes no routing weights); here every MLP, experts "
                        "included, uses that kernel's tanh GELU. Add --no-bias-gelu-fusion for the exact GELU that "
                        "Megatron-LM then runs (or --swiglu)")


def _data_parallel_path(args) -> DataParallelPath:
    if args.use_megatron_fsdp:
        return DataParallelPath.MEGATRON_FSDP_V2 if args.megatron_fsdp_version == 2 else DataParallelPath.MEGATRON_FSDP
    if args.use_torch_fsdp2:
        return DataParallelPath.TORCH_FSDP2
    # --ddp-average-in-collective picks the collective's op, which PyTorch DDP does not expose.
    if args.use_distributed_optimizer or args.precision is not Precision.FP32 or args.ddp_average_in_collective:
        return DataParallelPath.MEGATRON_DDP
    return DataParallelPath.TORCH_DDP


def _megatron_ddp_fields(args) -> None:
    """Megatron-core DDP's design as Megatron-FSDP options ([Note: Megatron-core DDP on
    this engine]); the gradient dtype follows megatron/training/arguments.py: fp32 for
    bf16 models unless --grad-reduce-in-bf16, the model's dtype for fp16 models unless
    --accumulate-allreduce-grads-in-fp32."""
    args.data_parallel_sharding_strategy = (ShardingStrategy.OPTIM if args.use_distributed_optimizer
                                            else ShardingStrategy.NO_SHARD).label
    args.outer_dp_sharding_strategy = ShardingStrategy.NO_SHARD.label
    args.megatron_fsdp_main_params_dtype = "fp32"
    if args.precision is Precision.BF16:
        grads = "bf16" if args.grad_reduce_in_bf16 else "fp32"
    elif args.precision is Precision.FP16:
        grads = "fp32" if args.accumulate_allreduce_grads_in_fp32 else "fp16"
    else:
        grads = "fp32"
    args.megatron_fsdp_main_grads_dtype = grads
    args.megatron_fsdp_grad_comm_dtype = "auto"  # reduced in the buffer's dtype, as Megatron's DDP does


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int = 1) -> int:
    """Megatron-LM pads the vocabulary to a multiple of ``divisible_by`` x the TP size (so
    every TP rank holds an equal, friendly-sized slice of the embedding and the output layer)."""
    multiple = divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def raise_problem(message: str) -> None:
    from .arg_types import ArgumentError

    raise ArgumentError("invalid arguments:\n  - " + message)
