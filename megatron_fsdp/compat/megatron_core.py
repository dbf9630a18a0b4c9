"""What megatron_fsdp knows about Megatron-core: whether it is installed, its layer
classes, its parallel state, which gradients its tensor-parallel layers leave partial
over the TP ranks, and how to build its ``GPTModel`` from Megatron-LM style arguments.

megatron-core is optional. Nothing here imports it at module import time; the
functions that need it raise ``ImportError`` naming the feature and the install
step. This module never patches megatron-core: on a CPU-only machine its
``GPTModel.forward`` still calls CUDA (see ``build_megatron_core_gpt``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..comm import device

logger = logging.getLogger(__name__)

INSTALL_HINT = "install it with `bash scripts/setup_megatron_core.sh` (pip install --no-deps megatron-core==0.16.1)"

# Layer classes that make good FSDP units: each is one repeated block of the
# model, so gathering one at a time bounds the unsharded weights to one block.
# MoE models are built of TransformerLayer too (their MoELayer is the layer's
# MLP), so TransformerLayer covers them; a nested MoELayer unit can still be
# asked for explicitly through fsdp_unit_modules.
_UNIT_LAYER_CLASSES = (
    "megatron.core.transformer.transformer_layer.TransformerLayer",
    "megatron.core.ssm.mamba_layer.MambaLayer",
)


def require_megatron_core(feature: str) -> None:
    """Raise a clear ``ImportError`` when ``feature`` needs megatron-core and it is absent."""
    try:
        importlib.import_module("megatron.core")
    except ImportError as exc:
        raise ImportError(f"{feature} needs megatron-core, which is not importable ({exc}); {INSTALL_HINT}") from exc


def loaded_module(name: str) -> Optional[Any]:
    """``sys.modules[name]`` if that module was imported already, else ``None``.

    A model holding Megatron-core layers, or an initialized Megatron-core parallel
    state, implies their modules were imported; looking them up here (instead of
    importing) keeps plain PyTorch models free of megatron-core's import cost.
    """
    return sys.modules.get(name)


def _loaded_class(path: str) -> Optional[type]:
    """The class at ``path`` ("package.module.Class") if its module was imported already."""
    module_path, _, attr = path.rpartition(".")
    cls = getattr(loaded_module(module_path), attr, None)
    return cls if isinstance(cls, type) else None


def megatron_core_unit_classes() -> list[type]:
    """Megatron-core's layer classes usable as FSDP units, among those already
    imported (empty without megatron-core)."""
    classes = [_loaded_class(path) for path in _UNIT_LAYER_CLASSES]
    return [c for c in classes if c is not None and issubclass(c, nn.Module)]


# -- parallel state ---------------------------------------------------------------------
def ensure_model_parallel_initialized() -> None:
    """Initialize Megatron-core's parallel state with TP = PP = 1 unless it already is.

    Idempotent: a process that builds several models (or a worker reused across
    tests) initializes once. An existing state with other sizes is left alone.
    """
    require_megatron_core("Megatron-core's parallel state")
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "(e.g. launch with torchrun) before building a Megatron-core model"
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    logger.info("megatron_fsdp: initialized Megatron-core parallel state (TP=1, PP=1, DP=%d)", dist.get_world_size())


def _seed_cuda_rng_tracker(seed: int) -> None:
    """Megatron-core's attention forks its CUDA RNG tracker even without dropout, so
    the tracker must hold seeded states before the first forward. Only possible on
    CUDA; on a CPU machine the caller must provide them (tests/mcore_cpu_shim.py)."""
    from megatron.core import tensor_parallel

    if tensor_parallel.get_cuda_rng_tracker().is_initialized():
        return
    if device.cuda_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    logger.warning(
        "megatron_fsdp: no CUDA: Megatron-core's GPTModel.forward needs its CUDA RNG tracker and allocates "
        "attention buffers with torch.cuda.current_device(); on a CPU-only machine run it under a "
        "compatibility shim such as tests/mcore_cpu_shim.py"
    )


# -- tensor-parallel layers -----------------------------------------------------------------
_TP_LAYER_CLASSES = (
    "megatron.core.tensor_parallel.layers.ColumnParallelLinear",
    "megatron.core.tensor_parallel.layers.RowParallelLinear",
    "megatron.core.tensor_parallel.layers.VocabParallelEmbedding",
)


def check_tp_marks(module: nn.Module) -> None:
    """Refuse a weight of megatron-core's tensor-parallel layers without the
    ``tensor_model_parallel`` mark: megatron-core sets it only when it initializes
    the weight (``config.perform_initialization``), and an unmarked piece would be
    taken for a replicated tensor, its gradient norm counted on one TP rank only."""
    classes = tuple(c for c in (_loaded_class(path) for path in _TP_LAYER_CLASSES) if c is not None)
    for name, sub in module.named_modules():
        weight = getattr(sub, "weight", None) if classes and isinstance(sub, classes) else None
        if isinstance(weight, torch.Tensor) and not hasattr(weight, "tensor_model_parallel"):
            raise ValueError(
                f"{name}.weight of megatron-core's {type(sub).__name__} has no tensor_model_parallel mark "
                "(megatron-core sets it only with config.perform_initialization=True), so its tensor-parallel "
                "piece would pass for a replicated tensor; build the model with perform_initialization=True, or "
                "mark it: megatron.core.tensor_parallel.set_tensor_model_parallel_attributes(weight, True, "
                "partition_dim, stride)"
            )


# -- gradients partial over the tensor-parallel ranks ----------------------------------------
TP_AVERAGED_ATTR = "average_gradients_across_tp_domain"
"""Megatron-core's mark for a parameter whose gradient ``finalize_model_grads`` averages
over the TP ranks (it checks this mark first)."""


def partial_tp_grad_ops(module: nn.Module, config: Any) -> dict[str, "dist.ReduceOp"]:
    """Parameter name -> how megatron-core completes its gradient over the TP ranks, for
    the replicated parameters whose gradients its layers leave partial there; the rule
    of megatron-core 0.16's ``finalize_model_grads`` (``_allreduce_non_tensor_model_
    parallel_grads``): ``AVG`` for parameters marked ``average_gradients_across_tp_domain``;
    ``SUM`` for parameters marked ``sequence_parallel`` when ``config.sequence_parallel``
    (norms and row-parallel biases see their rank's part of the sequence) and for
    ``q_layernorm`` / ``k_layernorm`` ones when ``config.qk_layernorm`` (their rank's
    heads). Read from the unwrapped module: the marks are its parameters'."""
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    qk_layernorm = bool(getattr(config, "qk_layernorm", False))
    ops: dict[str, dist.ReduceOp] = {}
    for name, param in module.named_parameters():
        if getattr(param, TP_AVERAGED_ATTR, False):
            ops[name] = dist.ReduceOp.AVG
        elif (sequence_parallel and getattr(param, "sequence_parallel", False)) or (
            qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
        ):
            ops[name] = dist.ReduceOp.SUM
    return ops


def reduce_partial_tp_grads(
    model: nn.Module, ops: dict[str, "dist.ReduceOp"], tp_group: dist.ProcessGroup
) -> list[RemovableHandle]:
    """[Note: tensor-parallel partial gradients] Megatron-core's layers leave some
    replicated parameters with a gradient that is partial over the TP ranks
    (``partial_tp_grad_ops``). Megatron-core completes them in ``finalize_model_grads``,
    after the data-parallel sync, on ``.grad._local_tensor`` of Megatron-FSDP's
    parameters; never in ``finish_grad_sync``. A loop that calls only
    ``finish_grad_sync`` (this repository's launcher, a user's loop, the step of
    ``fully_shard_optimizer``) would train them on a partial gradient.

    So the reduction happens once, wherever the step goes: a tensor hook on each such
    parameter all-reduces its local gradient over ``tp_group`` as autograd produces it
    (``ops[name]``), before the engine accumulates it and reduces it over the
    data-parallel ranks (the engine's DTensor TP path does the same through DTensor's
    backward, as FSDP2 does before its reduce-scatter). After the data-parallel sync
    the gradient is complete and identical on every TP rank. The parameters are then
    marked ``average_gradients_across_tp_domain``, which ``finalize_model_grads`` tests
    before its sequence-parallel and q/k-layernorm rule: its pass, if it runs,
    averages identical values (no change) instead of summing them a second time.
    Cost: one small all-reduce per such parameter per backward (megatron-core
    coalesces one per step). A parameter frozen when this is called gets neither
    hook nor mark, so ``finalize_model_grads`` stays its only reduction.

    ``model``: the wrapped model (its ``named_parameters()`` are the distributed
    parameters, whose tensor hooks run on their compute twins' local gradients) or
    a plain one. Returns the hooks' handles."""
    if not ops or dist.get_world_size(tp_group) <= 1:
        return []
    params = dict(model.named_parameters())
    missing = sorted(set(ops) - set(params))
    if missing:
        raise ValueError(
            f"reduce_partial_tp_grads: {missing} are not parameters of {type(model).__name__}; "
            "take the names from the same model (partial_tp_grad_ops on the module before wrapping)"
        )
    handles = []
    for name, op in ops.items():
        param = params[name]
        if param.requires_grad:
            handles.append(param.register_hook(functools.partial(_tp_complete_grad, group=tp_group, op=op)))
            setattr(param, TP_AVERAGED_ATTR, True)
    return handles


def _tp_complete_grad(grad: torch.Tensor, *, group: dist.ProcessGroup, op: "dist.ReduceOp") -> torch.Tensor:
    """[Note: tensor-parallel partial gradients]: this rank's gradient, reduced over the TP ranks."""
    with torch.profiler.record_function("megatron_fsdp::tp_partial_grad_all_reduce"):
        out = grad.clone(memory_format=torch.contiguous_format)  # a hook must not change its argument
        dist.all_reduce(out, op=op, group=group)
    return out


# -- GPTModel from Megatron-LM arguments ---------------------------------------------------
def _arg(args: Any, name: str, default: Any) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def _params_dtype(args: Any) -> torch.dtype:
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


def transformer_config_from_args(args: Any):
    """A Megatron-core ``TransformerConfig`` from Megatron-LM argument names.

    Required: ``num_layers``, ``hidden_size``, ``num_attention_heads``. Everything
    else falls back to Megatron-LM's defaults (dropout 0.1, LayerNorm, GELU MLP of
    4 x hidden, biases on, TP 1) except ``use_cpu_initialization``, which defaults to
    "no CUDA available" (megatron-core then draws each TP weight whole from torch's
    global RNG and keeps its rank's piece, so the weights do not depend on the TP size).
    """
    require_megatron_core("transformer_config_from_args")
    from megatron.core.transformer import TransformerConfig

    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads") if getattr(args, n, None) is None]
    if missing:
        raise ValueError(f"args lack {missing}; a Megatron-core GPT needs num_layers, hidden_size and num_attention_heads")
    dtype = _params_dtype(args)
    swiglu = bool(getattr(args, "swiglu", False))
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        kv_channels=getattr(args, "kv_channels", None),
        num_query_groups=getattr(args, "num_query_groups", None),
        hidden_dropout=_arg(args, "hidden_dropout", 0.1),
        attention_dropout=_arg(args, "attention_dropout", 0.1),
        init_method_std=_arg(args, "init_method_std", 0.02),
        normalization=_arg(args, "normalization", "LayerNorm"),
        layernorm_epsilon=_arg(args, "norm_epsilon", 1e-5),
        add_bias_linear=not getattr(args, "disable_bias_linear", False),
        gated_linear_unit=swiglu,
        activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        apply_residual_connection_post_layernorm=bool(getattr(args, "apply_residual_connection_post_layernorm", False)),
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        use_cpu_initialization=_arg(args, "use_cpu_initialization", not device.cuda_available()),
        calculate_per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
        tensor_model_parallel_size=_arg(args, "tensor_model_parallel_size", 1),
        # Fused kernels come from TransformerEngine/apex/CUDA; the local spec runs without them.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )


def build_megatron_core_gpt(args: Any) -> nn.Module:
    """Build Megatron-core's ``GPTModel`` with the *local* layer spec (pure PyTorch
    modules of Megatron-core: no TransformerEngine, no apex).

    ``args`` is an argparse-like namespace with Megatron-LM field names:
    ``num_layers``, ``hidden_size``, ``num_attention_heads``, ``seq_length``,
    ``max_position_embeddings`` (default ``seq_length``), ``padded_vocab_size``
    (else ``vocab_size``, else 256), ``untie_embeddings_and_output_weights``
    (default tied), ``position_embedding_type`` (``learned_absolute``), ``seed``
    and the fields ``transformer_config_from_args`` reads. Parallel state is
    initialized for TP = PP = 1 when it is not yet (needs torch.distributed).

    Parameters are initialized from torch's global RNG: seed it before calling
    for reproducible weights. On CPU-only torch the model builds, but its forward
    calls CUDA inside megatron-core (attention buffer, RNG tracker).
    """
    require_megatron_core("build_megatron_core_gpt")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    ensure_model_parallel_initialized()
    config = transformer_config_from_args(args)
    seq_length = getattr(args, "seq_length", None)
    max_positions = _arg(args, "max_position_embeddings", seq_length)
    if max_positions is None:
        raise ValueError("args need seq_length or max_position_embeddings (the longest sequence the model sees)")
    vocab_size = _arg(args, "padded_vocab_size", _arg(args, "vocab_size", 256))
    spec = get_gpt_layer_local_spec(
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        normalization=config.normalization,
    )
    _seed_cuda_rng_tracker(_arg(args, "seed", 1234))
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_positions,
        pre_process=True,
        post_process=True,
        fp16_lm_cross_entropy=bool(getattr(args, "fp16_lm_cross_entropy", False)),
        parallel_output=True,
        share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
        position_embedding_type=_arg(args, "position_embedding_type", "learned_absolute"),
        rotary_percent=_arg(args, "rotary_percent", 1.0),
        rotary_base=_arg(args, "rotary_base", 10000),
    )
    logger.info(
        "megatron_fsdp: built Megatron-core GPTModel (local spec): %d layers, hidden %d, %d heads, vocab %d, "
        "%d positions, %.2fM parameters",
        config.num_layers,
        config.hidden_size,
        config.num_attention_heads,
        vocab_size,
        max_positions,
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model


def gpt_args(**overrides: Any) -> argparse.Namespace:
    """A namespace with Megatron-LM's field names for a tiny GPT (fp32, no dropout),
    handy for tests and examples; ``overrides`` replace any field."""
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        max_position_embeddings=16,
        padded_vocab_size=256,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        seed=1234,
    )
    fields.update(overrides)
    return argparse.Namespace(**fields)
