"""Build the model, wrap it for data parallelism (Megatron-FSDP, its per-module version 2
with ``--megatron-fsdp-version 2``: megatron_fsdp_v2.py, PyTorch DDP, or PyTorch FSDP2 with
``--use-torch-fsdp2``: torch_fsdp2.py) and build its optimizer, from the parsed flags.

With ``--tensor-model-parallel-size`` > 1 the embedded GPT is split by its tensor-parallel
plan (``models/tensor_parallel.py``) on the mesh's ``tp`` dimension before Megatron-FSDP
wraps it over the data-parallel dimensions (ranks in Megatron-LM's order:
parallel_dims.py, [Note: rank order]). With ``--expert-model-parallel-size`` > 1 each MoE
layer keeps its EP rank's block of experts (``models/expert_parallel.py``), which the
engine shards over the expert mesh's data-parallel dimension; with
``--context-parallel-size`` > 1 the model takes its CP rank's chunks of each sequence
(``models/context_parallel.py``) and the dense weights are sharded over the data x
context ranks (see [Note: the run's process layout]). Megatron-core's GPTModel is built with its own TP
layers on megatron-core's parallel state, initialised here with the TP size in the same
order, and its ``FullyShardedDataParallel`` takes the mesh from those groups.

The embedded GPT (``megatron_fsdp.models.gpt``) is the default; ``--use-mcore-models``
swaps in Megatron-core's GPTModel with the same architecture through
``megatron_fsdp.models.mcore``, imported only then so megatron-core stays optional.

With ``--bf16/--fp16`` the model is cast before wrapping and the optimizer steps
fp32 main weights, under Megatron-FSDP and Megatron-core DDP alike (the latter runs
on this engine's ``no_shard``/``optim`` strategies: [Note: Megatron-core DDP on this
engine] in arg_types.py); PyTorch DDP wraps fp32 runs without a distributed optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import megatron_fsdp as mf
from megatron_fsdp.comm import device as device_mod
from megatron_fsdp.models.context_parallel import apply_context_parallel
from megatron_fsdp.models.expert_parallel import apply_expert_parallel, set_expert_capacity
from megatron_fsdp.models.gpt import GPT, GPTConfig, TransformerBlock
from megatron_fsdp.models.tensor_parallel import apply_tensor_parallel
# LogitsGradInBF16 lived here before: importable from here still.
from megatron_fsdp.models.losses import LogitsGradInBF16, token_cross_entropy  # noqa: F401

from . import megatron_fsdp_v2, torch_fsdp2
from .args.arg_types import DataParallelPath, Precision
from megatron_fsdp.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

_ENGINE_PATHS = (DataParallelPath.MEGATRON_FSDP, DataParallelPath.MEGATRON_DDP)
"""The data-parallel paths that wrap the model with this engine (TP, CP and EP run on them only)."""
_PRECISION_DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}

# (inputs, targets) -> (sum of token losses, number of tokens)
LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]


@dataclasses.dataclass(kw_only=True)
class ModelBundle:
    """The wrapped model and what the training step needs to drive it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    is_fsdp: bool
    """Wrapped by megatron_fsdp (the Megatron-FSDP and Megatron-core DDP paths), not PyTorch
    DDP or FSDP2 (whose reductions average over the data-parallel ranks)."""
    num_parameters: int
    moe_balancing: Optional[Any] = None
    """megatron-core MoE models: ``models.mcore.McoreBalancingLoss`` (``clear()`` before a
    micro batch's forward, called after it). The embedded GPT reports its own."""
    mtp: Optional[Any] = None
    """megatron-core models with ``--mtp-num-layers``: ``models.mcore_mtp.McoreMTPLoss`` (the
    MTP loss's gradient factor and per-depth losses). The embedded GPT drives its own."""
    data_parallel_rank: int = 0
    """This rank's data-parallel rank, whose samples it trains on (the TP ranks of one
    data-parallel rank read the same ones: parallel_dims.py, [Note: rank order])."""
    data_parallel_group: Optional[dist.ProcessGroup] = None
    """The data-parallel ranks of this rank's TP piece and CP part (its size is Megatron-LM's
    data-parallel size, which the logged side losses are averaged over); None: every rank."""
    loss_group: Optional[dist.ProcessGroup] = None
    """The group the training step sums losses and token counts over: the data x context
    ranks of this rank's TP piece (Megatron-LM's data-parallel group with context
    parallelism); None: every rank."""
    context_parallel_rank: int = 0
    """Which CP chunks of each sequence this rank trains on (``BatchLayout.cp_rank``)."""
    context_parallel_size: int = 1
    expert_parallel_group: Optional[dist.ProcessGroup] = None
    """The expert-parallel group when experts are spread over ranks (EP > 1), else None:
    gradient and weight norms then combine the experts' over it (each EP rank holds others)."""

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def nan_grad_names(self) -> list[str]:
        """Names of parameters whose reduced gradient holds NaN/Inf, from every rank."""
        if self.is_fsdp and hasattr(self.model, "report_nan_in_param_grad"):
            local = self.model.report_nan_in_param_grad()
        else:
            # FSDP2's gradients are DTensors: each rank checks its own shard.
            local = [n for n, p in self.model.named_parameters()
                     if p.grad is not None and not bool(torch.isfinite(_local_tensor(p.grad)).all())]
        if not dist.is_initialized():
            return local
        gathered: list[list[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        return sorted({name for names in gathered for name in names})


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# [Note: the run's process layout] ``ParallelDims`` (parallel_dims.py) lays the ranks out in
# Megatron-LM's order and builds the meshes; the launcher only picks them up. The dense
# mesh (None when neither TP, CP nor HSDP needs one: the engine then shards over every
# rank) carries TP's ``tp`` and CP's ``cp`` dimension; the dense weights shard over its
# data x context dimension. The expert mesh (MoE models) carves EP groups of consecutive
# ranks out of the data x context ranks and shards each expert over the ranks holding the
# same experts. The training step sums its losses and token counts over the data x context
# ranks of one TP piece (``loss_group``), as Megatron-LM reduces its reported loss over the
# data-parallel group with context parallelism. The MoE routers sum their global-aux-loss
# and expert-bias counts over every rank (their default group, ``GPT.set_moe_data_parallel_group``
# left unset, and ``finish_global_batch``'s): Megatron-LM's tensor x data x context group,
# since MoE runs at TP 1 here.
@dataclasses.dataclass(kw_only=True)
class ParallelLayout:
    """The run's meshes and groups (see [Note: the run's process layout])."""

    dims: ParallelDims
    mesh: Optional[DeviceMesh] = None
    """The wrapper's dense mesh; None: the engine's default group (every rank)."""
    data_parallel_group: Optional[dist.ProcessGroup] = None
    loss_group: Optional[dist.ProcessGroup] = None
    expert_mesh: Optional[DeviceMesh] = None
    """MoE models on this engine: ``(dp_outer, <shard_dim>, ep)``; None otherwise."""

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        return self.dims.tp_mesh(self.mesh)

    @property
    def cp_mesh(self) -> Optional[DeviceMesh]:
        return self.dims.cp_mesh(self.mesh)

    @property
    def ep_mesh(self) -> Optional[DeviceMesh]:
        return self.dims.ep_mesh(self.expert_mesh)


def _parallel_layout(args, device: torch.device) -> ParallelLayout:
    """The run's ``ParallelLayout``. Collective. Megatron-core models get megatron-core's
    parallel state instead (``_mcore_parallel_state``), from whose groups its adapter builds
    the mesh; the PyTorch wrappers lay out their own groups."""
    dims = ParallelDims.from_args(args, dist.get_world_size() if dist.is_initialized() else 1)
    # validation refuses these (tp_flags.py, ep_cp_flags.py); a caller that skipped it learns why here
    if (dims.cp > 1 or dims.ep > 1) and (args.use_mcore_models or args.dp_path not in _ENGINE_PATHS):
        raise ValueError(f"--context-parallel-size {dims.cp} / --expert-model-parallel-size {dims.ep} need the "
                         f"embedded GPT on this engine, not {args.dp_path.name}"
                         f"{' with --use-mcore-models' if args.use_mcore_models else ''}; add --use-megatron-fsdp")
    if args.use_mcore_models:
        if dims.tp > 1 and args.dp_path is not DataParallelPath.MEGATRON_FSDP:
            raise ValueError(f"--tensor-model-parallel-size {dims.tp} with --use-mcore-models needs Megatron-FSDP "
                             f"(megatron-core's TP layers in its FullyShardedDataParallel), not "
                             f"{args.dp_path.name}; add --use-megatron-fsdp")
        group = _mcore_parallel_state(dims) if dist.is_initialized() else None
        return ParallelLayout(dims=dims, data_parallel_group=group, loss_group=group)
    if args.dp_path not in _ENGINE_PATHS:
        if dims.tp > 1:
            raise ValueError(f"--tensor-model-parallel-size {dims.tp} needs Megatron-FSDP or Megatron-core DDP on "
                             f"this engine, not {args.dp_path.name}; add --use-megatron-fsdp")
        return ParallelLayout(dims=dims)
    device_type = device_mod.mesh_device_type(device)
    mesh = dims.build_mesh(device_type)
    dp_group = dims.data_parallel_group(mesh)
    loss_group = dims.data_context_group(mesh) if dims.cp > 1 else dp_group
    expert_mesh = dims.build_expert_mesh(device_type) if args.num_experts is not None else None
    return ParallelLayout(dims=dims, mesh=mesh, data_parallel_group=dp_group, loss_group=loss_group,
                          expert_mesh=expert_mesh)


def _mcore_parallel_state(dims: ParallelDims) -> Optional[dist.ProcessGroup]:
    """Megatron-core's parallel state for ``dims.tp`` (megatron-core's default order, TP
    fastest, is [Note: rank order]'s), re-initialised when a state of another TP size is
    there (a process that trained another run: the test pools); returns its data-parallel
    group, or None at TP 1 (every rank). Its adapter builds the mesh from these groups
    (mcore_fsdp_adapter.build_dist_index)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() != dims.tp:
        ps.destroy_model_parallel()  # forgets the groups, leaves them open (they may back cached meshes)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=1,
                                     create_gloo_process_groups=False)
    if dims.tp == 1:
        return None
    group = ps.get_data_parallel_group()
    ranks, me = dist.get_process_group_ranks(group), dist.get_rank()
    expected = [d * dims.tp + me % dims.tp for d in range(dims.dp)]
    if ranks != expected:  # a state another caller initialised with another order
        raise ValueError(f"megatron-core's data-parallel group {ranks} of rank {me} is not Megatron-LM's TP-fastest "
                         f"{expected}; initialise its parallel state with the default order (tp-cp-ep-dp-pp)")
    return group


def setup_model_and_optimizer(args, device: torch.device) -> ModelBundle:
    layout = _parallel_layout(args, device)
    dims = layout.dims
    if args.use_mcore_models:
        module, loss_fn_factory, unit_modules = _build_mcore_model(args, device)
    else:
        module, loss_fn_factory, unit_modules = _build_embedded_gpt(args, device, tp_mesh=layout.tp_mesh)
    if dims.tp > 1:
        logger.info("> tensor parallelism: %d ranks per data-parallel rank x %d data-parallel ranks%s", dims.tp,
                    dims.dp, ", sequence parallel" if dims.sequence_parallel else "")
    num_parameters = _whole_model_numel(module, dims.tp if args.use_mcore_models else 1)  # before EP drops experts
    if not args.use_mcore_models:
        if args.num_experts is not None and args.moe_expert_capacity_factor is not None:
            set_expert_capacity(module, args.moe_expert_capacity_factor, args.moe_token_drop_policy,
                                pad_to_capacity=args.moe_pad_expert_input_to_capacity)
        module = _apply_context_and_expert_parallel(module, layout, args.num_experts)
    dtype = _PRECISION_DTYPES[args.precision]
    if args.dp_path is DataParallelPath.TORCH_DDP:
        model = _wrap_ddp(module, args, device)
        optimizer = build_optimizer(model, args)
    elif args.dp_path is DataParallelPath.TORCH_FSDP2:
        model = torch_fsdp2.wrap_torch_fsdp2(module, torch_fsdp2.TorchFSDP2Config.from_args(args), device,
                                             recompute=args.recompute_granularity is not None)
        optimizer = build_optimizer(model, args)  # plain AdamW/SGD on the fp32 shards (DTensors)
    elif args.dp_path is DataParallelPath.MEGATRON_FSDP_V2:
        policy = ddp_config_from_args(args).mixed_precision_policy()  # [Note: v2 mixed precision]
        units = unit_modules if unit_modules is not None else megatron_fsdp_v2.mcore_layer_types()
        model = megatron_fsdp_v2.wrap_megatron_fsdp_v2(module, units, policy, device,
                                                       None if dtype is torch.float32 else dtype)
        optimizer = megatron_fsdp_v2.adapt_optimizer(build_optimizer(model, args))
    else:
        if dtype is not torch.float32:
            module = module.to(dtype)
        mesh_kwargs = dims.wrap_kwargs(layout.mesh, layout.data_parallel_group)
        model = _wrap_megatron_fsdp(module, args, device, unit_modules, mesh_kwargs, layout.expert_mesh)
        optimizer = mf.fully_shard_optimizer(build_optimizer(model, args))
    balancing = None
    if args.use_mcore_models:
        from megatron_fsdp.models import mcore as mcore_models

        balancing = mcore_models.balancing_loss_reader(gpt_config_from_args(args))
        mtp = mcore_models.mtp_loss_reader(gpt_config_from_args(args), sequence_length=args.seq_length,
                                           per_token=args.calculate_per_token_loss)
    rank = dist.get_rank()
    return ModelBundle(model=model, optimizer=optimizer, loss_fn=loss_fn_factory(model),
                       is_fsdp=args.dp_path in _ENGINE_PATHS,
                       num_parameters=num_parameters,
                       moe_balancing=balancing, mtp=mtp if args.use_mcore_models else None,
                       data_parallel_rank=dims.data_parallel_rank(rank),
                       data_parallel_group=layout.data_parallel_group, loss_group=layout.loss_group,
                       context_parallel_rank=dims.context_parallel_rank(rank), context_parallel_size=dims.cp,
                       expert_parallel_group=None if layout.ep_mesh is None else layout.ep_mesh.get_group())


def _apply_context_and_expert_parallel(module: GPT, layout: ParallelLayout, num_experts: Optional[int]) -> GPT:
    """The embedded GPT's expert-parallel plan (each MoE layer keeps its EP rank's experts)
    and context-parallel plan (attention over the CP group's chunks, MoE counts over it),
    in place, before wrapping; one log line names the layout."""
    dims = layout.dims
    if layout.ep_mesh is not None:
        module = apply_expert_parallel(module, layout.ep_mesh)
    if layout.cp_mesh is not None:
        module = apply_context_parallel(module, layout.cp_mesh)
    if dims.cp > 1 or dims.ep > 1:
        parts = [f"{dims.dp} data-parallel x {dims.cp} context-parallel x {dims.tp} tensor-parallel ranks"]
        if dims.cp > 1:
            parts.append(f"each sequence in {2 * dims.cp} chunks, 2 per context-parallel rank")
        if dims.ep > 1:
            parts.append(f"{num_experts // dims.ep} of {num_experts} experts per expert-parallel rank ({dims.ep} "
                         f"ranks), each sharded over {dims.edp} expert data-parallel ranks")
        logger.info("> parallel layout: %s", "; ".join(parts))
    return module


def _whole_model_numel(module: nn.Module, tp: int) -> int:
    """The whole model's parameter count (the FLOPs estimate reads it): megatron-core's TP
    weights (``tensor_model_parallel``) hold 1 / ``tp`` of theirs; DTensors count whole."""
    params = {id(p): p for p in module.parameters()}.values()
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in params)


# -- models -----------------------------------------------------------------------
# [Note: model flags] Megatron-LM's model flags map onto fields of the embedded
# GPTConfig. A field this checkout's GPTConfig lacks is simply not passed when the
# flag was not given (the model keeps its own behaviour, the "baseline" below); a
# flag that was given with a value the model cannot express without the field is a
# validation error naming the field, never a silently different architecture.
@dataclasses.dataclass(frozen=True)
class ModelFlag:
    dest: str
    field: str
    baseline: object
    """What the embedded model does without the field."""


MODEL_FLAG_FIELDS = (
    ModelFlag("swiglu", "swiglu", False),
    ModelFlag("squared_relu", "squared_relu", False),
    ModelFlag("normalization", "normalization", "LayerNorm"),
    ModelFlag("layernorm_epsilon", "norm_epsilon", 1e-5),  # --norm-epsilon
    ModelFlag("position_embedding_type", "position_embedding_type", "learned_absolute"),
    ModelFlag("rotary_base", "rotary_base", 10000),
    ModelFlag("rotary_percent", "rotary_percent", 1.0),
    ModelFlag("rotary_interleaved", "rotary_interleaved", False),
    ModelFlag("num_query_groups", "num_query_groups", None),
    ModelFlag("kv_channels", "kv_channels", None),
    ModelFlag("untie_embeddings_and_output_weights", "untie_embeddings_and_output_weights", False),
    ModelFlag("add_bias_linear", "add_bias_linear", True),
    ModelFlag("add_qkv_bias", "add_qkv_bias", False),
    ModelFlag("hidden_dropout", "hidden_dropout", 0.0),
    ModelFlag("attention_dropout", "attention_dropout", 0.0),
    ModelFlag("init_method_std", "init_method_std", 0.02),
    ModelFlag("qk_layernorm", "qk_layernorm", False),
    ModelFlag("attention_output_gate", "attention_output_gate", False),
    ModelFlag("recompute_granularity", "recompute_granularity", None),
    ModelFlag("recompute_method", "recompute_method", None),
    ModelFlag("recompute_num_layers", "recompute_num_layers", None),
    ModelFlag("layernorm_zero_centered_gamma", "apply_layernorm_1p", False),  # --apply-layernorm-1p
    ModelFlag("num_experts", "num_moe_experts", None),
    ModelFlag("moe_router_topk", "moe_router_topk", 2),
    ModelFlag("moe_ffn_hidden_size", "moe_ffn_hidden_size", None),
    ModelFlag("moe_aux_loss_coeff", "moe_aux_loss_coeff", 0.0),
    ModelFlag("moe_router_load_balancing_type", "moe_router_load_balancing_type", "aux_loss"),
    ModelFlag("moe_router_pre_softmax", "moe_router_pre_softmax", False),
    ModelFlag("moe_layer_freq", "moe_layer_freq", 1),
    ModelFlag("moe_router_topk_scaling_factor", "moe_router_topk_scaling_factor", None),
    ModelFlag("moe_shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", None),
    ModelFlag("moe_shared_expert_gate", "moe_shared_expert_gate", False),
    ModelFlag("moe_router_dtype", "moe_router_dtype", None),
    ModelFlag("moe_router_score_function", "moe_router_score_function", "softmax"),
    ModelFlag("moe_router_enable_expert_bias", "moe_router_enable_expert_bias", False),
    ModelFlag("moe_router_bias_update_rate", "moe_router_bias_update_rate", 1e-3),
    ModelFlag("moe_router_num_groups", "moe_router_num_groups", None),
    ModelFlag("moe_router_group_topk", "moe_router_group_topk", None),
    ModelFlag("moe_router_force_load_balancing", "moe_router_force_load_balancing", False),
    ModelFlag("multi_latent_attention", "multi_latent_attention", False),
    ModelFlag("q_lora_rank", "q_lora_rank", None),
    ModelFlag("kv_lora_rank", "kv_lora_rank", 32),
    ModelFlag("qk_head_dim", "qk_head_dim", 128),
    ModelFlag("qk_pos_emb_head_dim", "qk_pos_emb_head_dim", 64),
    ModelFlag("v_head_dim", "v_head_dim", 128),
    ModelFlag("rope_type", "rope_type", None),
    ModelFlag("rotary_scaling_factor", "rotary_scaling_factor", 1.0),
    ModelFlag("mscale", "mscale", 1.0),
    ModelFlag("mscale_all_dim", "mscale_all_dim", 0.0),
    ModelFlag("mtp_num_layers", "mtp_num_layers", None),
    ModelFlag("mtp_loss_scaling_factor", "mtp_loss_scaling_factor", 0.1),
)
# Read by multi-latent attention only: without it any value is the baseline.
_MLA_ONLY_DESTS = {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                   "rotary_scaling_factor", "mscale", "mscale_all_dim"}
# Older GPTConfig spellings of the same settings.
_LEGACY_FIELDS = {"untie_embeddings_and_output_weights": ("tie_embeddings", lambda v: not v),
                  "recompute_granularity": ("recompute", lambda v: v == "full")}


def _gpt_config_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(GPTConfig)}


def _baseline_ok(flag: ModelFlag, args) -> bool:
    value = getattr(args, flag.dest)
    if flag.dest == "num_query_groups":
        return value in (None, args.num_attention_heads)
    if flag.dest == "kv_channels":
        return value is None or value * args.num_attention_heads == args.hidden_size
    if flag.dest in ("rotary_base", "rotary_percent"):
        return args.position_embedding_type != "rope" or value == flag.baseline
    if flag.dest in ("moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff", "moe_router_pre_softmax",
                     "moe_layer_freq", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
                     "moe_shared_expert_gate",
                     "moe_router_dtype", "moe_router_load_balancing_type", "moe_router_score_function",
                     "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_num_groups",
                     "moe_router_group_topk", "moe_router_force_load_balancing"):
        return args.num_experts is None or value == flag.baseline
    if flag.dest in _MLA_ONLY_DESTS:
        return not args.multi_latent_attention or value == flag.baseline
    if flag.dest == "mtp_loss_scaling_factor":
        return not args.mtp_num_layers or value == flag.baseline
    if isinstance(value, list):
        value = value[0]
    return value == flag.baseline


def missing_model_fields(args) -> list[tuple[str, str]]:
    """(flag, GPTConfig field) for each given model flag the embedded model cannot honour."""
    fields = _gpt_config_fields()
    given = {spec.dest: name for name, spec in getattr(args, "given_flags", {}).items()}
    missing = []
    for flag in MODEL_FLAG_FIELDS:
        if flag.field in fields or flag.dest not in given:
            continue
        legacy = _LEGACY_FIELDS.get(flag.field)
        if legacy and legacy[0] in fields:
            continue
        if not _baseline_ok(flag, args):
            missing.append((given[flag.dest], flag.field))
    if args.num_experts is not None and "num_moe_experts" not in fields and ("--num-experts", "num_moe_experts") \
            not in missing:
        missing.append(("--num-experts", "num_moe_experts"))
    return missing


def gpt_config_from_args(args) -> GPTConfig:
    fields = _gpt_config_fields()
    kwargs = dict(vocab_size=args.padded_vocab_size, seq_length=args.max_position_embeddings,
                  num_layers=args.num_layers, hidden_size=args.hidden_size,
                  num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size)
    for flag in MODEL_FLAG_FIELDS:
        value = getattr(args, flag.dest)
        if flag.field in ("recompute_method", "recompute_num_layers") and args.recompute_granularity != "full":
            value = None  # Megatron-LM reads them with full recomputation only (validation warned)
        if flag.field in fields:
            kwargs[flag.field] = value
        elif flag.field in _LEGACY_FIELDS and _LEGACY_FIELDS[flag.field][0] in fields:
            legacy, convert = _LEGACY_FIELDS[flag.field]
            kwargs[legacy] = convert(value)
    if "openai_gelu" in fields:
        kwargs["openai_gelu"] = megatron_gelu_is_tanh(args)
    return GPTConfig(**kwargs)


def megatron_gelu_is_tanh(args) -> bool:
    """Whether Megatron-LM's GELU MLP computes the tanh approximation for these flags.

    Its MLP applies GELU through the fused bias-GELU kernel, whose formula is the tanh
    approximation, whenever that fusion is on (the default; ``--no-bias-gelu-fusion``
    turns it off) and fc1 has a bias (``--disable-bias-linear`` turns the fusion off);
    otherwise it calls torch's exact erf GELU. Megatron-LM parses ``--openai-gelu`` but
    never reads it, so it plays no part. Irrelevant with ``--swiglu``."""
    return bool(args.bias_gelu_fusion and args.add_bias_linear)


def _build_embedded_gpt(args, device: torch.device, tp_mesh=None):
    """The embedded GPT for the flags; with ``tp_mesh`` split by its tensor-parallel plan
    (after DDP's materialisation: the plan takes each rank's piece of the whole weights)."""
    cfg = gpt_config_from_args(args)
    # Same seed on every rank: identical initial weights without a broadcast.
    torch.manual_seed(args.seed)
    if args.init_model_with_meta_device:
        with torch.device("meta"):
            module = GPT(cfg)
        if args.dp_path is not DataParallelPath.MEGATRON_FSDP:  # DDP paths start from real weights
            module = _materialize(module, device)
    else:
        module = GPT(cfg).to(device)
    if tp_mesh is not None:
        apply_tensor_parallel(module, tp_mesh, sequence_parallel=args.sequence_parallel)

    bf16_logits_grad = args.cross_entropy_loss_fusion
    module.set_mtp_loss_settings(bf16_logits_grad=bf16_logits_grad)  # the MTP heads' loss too
    mtp = bool(cfg.mtp_num_layers)

    def loss_fn_factory(model: nn.Module) -> LossFn:
        def loss_fn(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
            # The labels reach the model only for multi-token prediction, which attaches its loss there.
            logits = model(inputs, labels=targets) if mtp else model(inputs)  # (b, t, vocab)
            loss = token_cross_entropy(logits, targets, bf16_logits_grad=bf16_logits_grad, reduction="sum")
            return loss, targets.numel()

        return loss_fn

    return module, loss_fn_factory, [TransformerBlock]


def _materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """DDP has no sharded initialisation: allocate and re-run every module's own init, in
    module order, as the eager build ran them.

    ``to_empty`` gives every module slot a new Parameter (a meta tensor cannot be moved
    in place), so a tied weight (the output layer sharing the embedding) came back as two
    and training went on untied, and the attributes read from parameters
    (``is_embedding_or_output_parameter``: --decoupled-lr's groups; expert marks) were
    dropped. Each parameter is one object again, with its attributes; a module whose
    weight is tied to an earlier one still draws its init (the eager build did), which is
    then discarded."""
    slots = [(sub, name, p) for sub in module.modules() for name, p in sub._parameters.items() if p is not None]
    module = module.to_empty(device=device)
    fresh: dict[int, nn.Parameter] = {}
    for sub, name, old in slots:
        new = fresh.setdefault(id(old), sub._parameters[name])
        new.__dict__.update({k: v for k, v in vars(old).items() if k not in vars(new)})
        sub._parameters[name] = new
    initialised: set[int] = set()
    for sub in module.modules():
        own = [p for p in sub._parameters.values() if p is not None]
        if hasattr(sub, "reset_parameters"):
            tied = {id(p): p.detach().clone() for p in own if id(p) in initialised}
            sub.reset_parameters()
            with torch.no_grad():
                for p in own:
                    if id(p) in tied:
                        p.copy_(tied[id(p)])
        initialised.update(id(p) for p in own)
    return module


def _build_mcore_model(args, device: torch.device):
    """megatron-core's GPTModel (local spec) with the architecture the flags give the
    embedded GPT (``megatron_fsdp.models.mcore.build_mcore_gpt``: MoE, recomputation,
    RoPE, GQA, ... carried over; what the local spec cannot express was refused by
    validation). Its state dict keys are megatron-core's own."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "--use-mcore-models needs megatron-core, which is not installed; install it with "
            "`pip install --no-deps megatron-core` (see README), or drop --use-mcore-models to train the embedded GPT"
        ) from exc
    from megatron_fsdp.models import mcore as mcore_models

    torch.manual_seed(args.seed)
    module = mcore_models.build_mcore_gpt(gpt_config_from_args(args), seed=args.seed,
                                          params_dtype=_PRECISION_DTYPES[args.precision],
                                          cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
                                          calculate_per_token_loss=args.calculate_per_token_loss)
    if not args.init_model_with_meta_device:
        module = module.to(device)

    def loss_fn_factory(model: nn.Module) -> LossFn:
        def loss_fn(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
            positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
            # Megatron-core's GPTModel returns the per-token loss (b, t) when given labels.
            per_token = model(input_ids=inputs, position_ids=positions, attention_mask=None, labels=targets)
            return per_token.float().sum(), targets.numel()

        return loss_fn

    return module, loss_fn_factory, None


# -- wrappers ---------------------------------------------------------------------
def ddp_config_from_args(args) -> mf.DistributedDataParallelConfig:
    """Megatron's DDP config for these flags; also the single dtype-flag -> policy mapping."""
    return mf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=args.zero_strategy.label,
        outer_dp_sharding_strategy=args.outer_strategy.label,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        use_megatron_fsdp=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        average_in_collective=args.ddp_average_in_collective,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        megatron_fsdp_main_params_dtype=args.megatron_fsdp_main_params_dtype,
        megatron_fsdp_main_grads_dtype=args.megatron_fsdp_main_grads_dtype,
        megatron_fsdp_grad_comm_dtype=args.megatron_fsdp_grad_comm_dtype,
        # --use-nccl-ub implies the double buffer (as upstream); the flag table already
        # warned, on rank 0 only, that the registration itself has no effect here.
        fsdp_double_buffer=args.fsdp_double_buffer or args.nccl_ub,
        suggested_communication_unit_size=args.suggested_communication_unit_size,
    )


def _wrap_megatron_fsdp(module: nn.Module, args, device: torch.device, unit_modules, mesh_kwargs: dict,
                        expert_mesh: Optional[DeviceMesh] = None) -> nn.Module:
    """``mesh_kwargs``: ``ParallelDims.wrap_kwargs`` (the TP / CP / HSDP mesh; empty: the default
    group); ``expert_mesh``: ``ParallelDims.build_expert_mesh``'s, where the experts go."""
    ddp_config = ddp_config_from_args(args)
    if args.use_mcore_models:
        from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        return FullyShardedDataParallel(config=module.config, ddp_config=ddp_config, module=module,
                                        fsdp_unit_modules=unit_modules, device=device)
    return mf.fully_shard_model(
        module,
        fsdp_unit_modules=unit_modules,
        zero_dp_strategy=args.zero_strategy,
        outer_dp_sharding_strategy=args.outer_strategy,
        device=device,
        init_model_with_meta_device=args.init_model_with_meta_device and args.dp_path is DataParallelPath.MEGATRON_FSDP,
        mixed_precision_policy=ddp_config.mixed_precision_policy(),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        calculate_per_token_loss=args.calculate_per_token_loss,
        average_in_collective=args.ddp_average_in_collective,
        fsdp_double_buffer=args.fsdp_double_buffer or args.nccl_ub,  # as ddp_config_from_args
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        suggested_communication_unit_size=args.suggested_communication_unit_size,
        **mesh_kwargs,
        **_expert_kwargs(module, expert_mesh),
    )


def _expert_kwargs(module: nn.Module, expert_mesh: Optional[DeviceMesh]) -> dict:
    """Expert parameters (MoE) go to the expert mesh (``ParallelDims.build_expert_mesh``:
    with expert-parallel size 1 its shard dimension spans the dense data-parallel ranks, with
    HSDP laid out and named as the dense mesh; MoE is refused with tensor parallelism)."""
    from megatron_fsdp.models import has_expert_parameters

    if not has_expert_parameters(module):
        return {}
    if expert_mesh is None:
        raise ValueError("the model has expert parameters but no expert mesh was built (--num-experts unset?); "
                         "build the layout with _parallel_layout")
    return dict(expt_device_mesh=expert_mesh)


def needs_find_unused_parameters(module: nn.Module) -> bool:
    """Whether PyTorch DDP must look for parameters without a gradient after each backward.

    Not for the two models this launcher builds, MoE included: every expert runs every
    step, on the (possibly empty) slice of tokens routed to it, so an expert no token
    picked still gets a gradient (zeros) -- the embedded GPT's ``MoELayer`` by design (see
    megatron_fsdp/models/moe.py), megatron-core's ``SequentialMLP`` by splitting the tokens
    per expert. The search costs a graph traversal per iteration, so it is kept for an
    MoE model this launcher does not know."""
    from megatron_fsdp.models import has_expert_parameters

    if isinstance(module, GPT) or type(module).__module__.startswith("megatron.core."):
        return False
    return has_expert_parameters(module)


def _wrap_ddp(module: nn.Module, args, device: torch.device) -> nn.Module:
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(module, device_ids=device_ids,
                                               find_unused_parameters=needs_find_unused_parameters(module))


# -- optimizer --------------------------------------------------------------------
def build_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """Megatron-LM's grouping: no weight decay on biases and 1-D (norm) parameters (but
    the q/k layer norms with ``--apply-wd-to-qk-layernorm``); with
    ``--decoupled-lr``, the embedding and output weights (``is_embedding_or_output_parameter``,
    as megatron-core marks them) in groups of their own whose ``max_lr``/``min_lr`` the
    schedule follows (``LRSchedule.apply``)."""
    decoupled = args.decoupled_lr is not None
    buckets: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decays = not (param.ndim == 1 or name.endswith(".bias"))
        if args.apply_wd_to_qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name):
            decays = True  # Megatron-LM's Qwen3-Next rule: the q/k norms decay too
        own_lr = decoupled and getattr(param, "is_embedding_or_output_parameter", False)
        buckets.setdefault((decays, own_lr), []).append(param)
    groups = []
    for decays, own_lr in ((True, False), (False, False), (True, True), (False, True)):
        if (decays, own_lr) not in buckets:
            continue
        group = {"params": buckets[decays, own_lr], "weight_decay": args.weight_decay if decays else 0.0}
        if own_lr:
            min_lr = args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr
            group.update(max_lr=args.decoupled_lr, min_lr=min_lr)
        groups.append(group)
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum)
    if args.optimizer == "muon":  # Muon on the hidden matrices, AdamW on the rest (muon_optimizer.py)
        from .optim.muon_optimizer import build_muon_optimizer

        return build_muon_optimizer(model, groups, args)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
