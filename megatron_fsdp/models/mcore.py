"""megatron-core's ``GPTModel`` built from a ``GPTConfig`` (Megatron-LM's
``--use-mcore-models``), and our weights in its layout.

megatron-core is optional and imported only inside these functions. The model
uses megatron-core's *local* layer spec (its pure-PyTorch modules: no
TransformerEngine, no apex). What megatron-core cannot run is refused up front,
naming the reason:

* no CUDA: megatron-core's GPT forward allocates on ``torch.cuda.current_device()``
  and forks its CUDA RNG tracker in every attention, so on a CPU-only torch the
  model builds but cannot run. ``build_mcore_gpt`` raises unless the caller says
  it provides a CPU bridge (``allow_cpu=True``; the tests use tests/mcore_cpu_shim.py).

Two settings reach megatron-core through its own extension point, the layer spec:

* ``moe_layer_freq``: the decoder is built from ``get_gpt_decoder_block_spec`` (dense
  and MoE layer specs per megatron-core's own reading of ``moe_layer_freq``), as
  Megatron-LM's ``gpt_builder`` does for every ``--num-experts`` model;
* ``apply_layernorm_1p`` (megatron-core's ``layernorm_zero_centered_gamma``): see
  [Note: zero-centred norms in megatron-core] below.

``to_mcore_state_dict`` maps the embedded GPT's state dict onto megatron-core's
names and fused-QKV layout, so the same weights can run in both (the tests use it
to check that the two compute the same logits).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import device
from .config import GPTConfig, MoELoadBalancing, Normalization, PositionEmbeddingType, RecomputeGranularity
from .layers import ZeroCenteredNorm
from .mcore_specs import per_token_rolled_count_problem, swap_in_spec


def mcore_unsupported(cfg: GPTConfig) -> list[str]:
    """Why megatron-core's local GPT cannot represent ``cfg`` (empty when it can).
    Every ``GPTConfig`` setting is mapped today; a setting added to ``GPTConfig``
    before its mapping exists belongs here, so it is refused rather than dropped."""
    return []


class ZeroCenteredMcoreNorm(ZeroCenteredNorm):
    """[Note: zero-centred norms in megatron-core] megatron-core realises
    ``layernorm_zero_centered_gamma`` in the norm module its spec names, never in
    the layer: TransformerEngine's ``TENorm`` (LayerNorm and RMSNorm, Megatron-LM's
    default ``--transformer-impl transformer_engine``) and apex's ``FusedLayerNorm``
    (LayerNorm; the local spec with apex) store the weight w, start it at 0 (bias at
    0) and normalise with 1 + w. The local spec's fallback without apex,
    ``WrappedTorchNorm``, asserts the setting off, and neither apex nor
    TransformerEngine is needed here, so this module takes the norm's place in the
    spec: megatron-core's norm constructor signature, the same arithmetic as those
    modules (``layers.ZeroCenteredNorm``), the same parameter names (``weight``,
    ``bias``), so checkpoints keep megatron-core's keys. Like theirs its weight is
    1-D, so Megatron-LM's optimizer groups give it no weight decay (the q/k norms do
    decay with ``--apply-wd-to-qk-layernorm``, towards a scale of 1)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str | None = None) -> None:
        kind = Normalization.parse(normalization or config.normalization, arg_name="normalization")
        super().__init__(hidden_size, eps, kind)


def _zero_centred(spec):
    """``spec`` with every torch/apex norm class replaced by ``ZeroCenteredMcoreNorm``."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return swap_in_spec(spec, lambda leaf: ZeroCenteredMcoreNorm if leaf in (WrappedTorchNorm, FusedLayerNorm) else None)


def _decoder_spec(cfg: GPTConfig, config):
    """The decoder spec Megatron-LM's ``gpt_builder`` picks with ``--transformer-impl
    local``: ``get_gpt_decoder_block_spec`` for an MoE model (megatron-core lays out
    dense and MoE layers per ``config.moe_layer_freq``), the local layer spec
    otherwise; zero-centred norms swapped in for ``apply_layernorm_1p``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    normalization = cfg.normalization.value
    if cfg.num_moe_experts is not None:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization=normalization,
                                        multi_latent_attention=cfg.multi_latent_attention)
    if cfg.multi_latent_attention:
        from .mcore_mla import with_mla_core_attention

        spec = with_mla_core_attention(spec)
    if not cfg.apply_layernorm_1p:
        return spec
    if not isinstance(spec, TransformerBlockSubmodules):
        # What TransformerBlock would derive from a layer spec, with the final norm explicit.
        spec = TransformerBlockSubmodules(layer_specs=[spec] * cfg.num_layers, layer_norm=WrappedTorchNorm)
    return _zero_centred(spec)


def mcore_args(cfg: GPTConfig, *, seed: int = 1234, params_dtype: torch.dtype = torch.float32,
               calculate_per_token_loss: bool = False, tensor_model_parallel_size: int = 1) -> argparse.Namespace:
    """``cfg`` under Megatron-LM's argument names (what ``transformer_config_from_args`` reads)."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size, kv_channels=cfg.kv_channels, num_query_groups=cfg.num_query_groups,
        seq_length=cfg.seq_length, max_position_embeddings=cfg.seq_length, padded_vocab_size=cfg.vocab_size,
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std, normalization=cfg.normalization.value, norm_epsilon=cfg.norm_epsilon,
        disable_bias_linear=not cfg.add_bias_linear, swiglu=cfg.swiglu, qk_layernorm=cfg.qk_layernorm,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type.value, rotary_base=cfg.rotary_base,
        rotary_percent=cfg.rotary_percent, seed=seed,
        bf16=params_dtype is torch.bfloat16, fp16=params_dtype is torch.float16,
        calculate_per_token_loss=calculate_per_token_loss, tensor_model_parallel_size=tensor_model_parallel_size,
    )


def _mcore_balancing_type(cfg: GPTConfig) -> str:
    """megatron-core's type string: sinkhorn as is (it takes no coefficient), a loss type
    only with a positive coefficient (its aux-loss types with 0 add nothing either)."""
    balancing = cfg.moe_router_load_balancing_type
    if balancing is MoELoadBalancing.SINKHORN or cfg.moe_aux_loss_coeff > 0:
        return balancing.value
    return "none"


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _transformer_config(cfg: GPTConfig, args: argparse.Namespace, *, cross_entropy_loss_fusion: bool = False):
    from megatron_fsdp.compat.megatron_core import transformer_config_from_args

    changes: dict = {}
    if cross_entropy_loss_fusion:
        changes["cross_entropy_loss_fusion"] = True  # megatron-core's own fused loss (bf16 logits gradient)
    if cfg.squared_relu:
        from megatron.core.activations import squared_relu

        changes["activation_func"] = squared_relu  # Megatron-LM: --squared-relu
    elif not cfg.swiglu and cfg.openai_gelu:
        changes["activation_func"] = _gelu_tanh  # the formula of Megatron's fused bias-GELU kernel
    if cfg.recompute_granularity is RecomputeGranularity.FULL:
        method, layers = cfg.recompute_plan
        changes.update(recompute_granularity="full", recompute_method=method.value, recompute_num_layers=layers)
    elif cfg.recompute_granularity is RecomputeGranularity.SELECTIVE:
        changes.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    if cfg.num_moe_experts is not None:
        changes.update(num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
                       moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
                       moe_router_pre_softmax=cfg.moe_router_pre_softmax, moe_token_dispatcher_type="allgather",
                       moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
                       moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                       moe_shared_expert_gate=cfg.moe_shared_expert_gate,
                       moe_router_load_balancing_type=_mcore_balancing_type(cfg),
                       moe_router_score_function=cfg.moe_router_score_function.value,
                       moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
                       moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
                       moe_router_num_groups=cfg.moe_router_num_groups,
                       moe_router_group_topk=cfg.moe_router_group_topk,
                       moe_router_dtype=cfg.moe_router_dtype.value if cfg.moe_router_dtype is not None else None,
                       moe_router_force_load_balancing=cfg.moe_router_force_load_balancing,
                       moe_layer_freq=cfg.moe_layer_freq)
    if cfg.qk_layernorm:
        changes["qk_layernorm"] = True  # read by get_gpt_decoder_block_spec (Megatron-LM: --qk-layernorm)
    if cfg.add_qkv_bias:
        changes["add_qkv_bias"] = True  # Megatron-LM: --add-qkv-bias (Qwen2's biased q/k/v)
    if cfg.apply_layernorm_1p:
        changes["layernorm_zero_centered_gamma"] = True  # Megatron-LM: --apply-layernorm-1p
    if cfg.rotary_interleaved:
        changes["rotary_interleaved"] = True  # Megatron-LM: --rotary-interleaved
    if cfg.attention_output_gate:
        changes["attention_output_gate"] = True  # Megatron-LM: --attention-output-gate
    if cfg.mtp_num_layers:  # Megatron-LM: --mtp-num-layers, --mtp-loss-scaling-factor
        changes.update(mtp_num_layers=cfg.mtp_num_layers, mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor)
    config = transformer_config_from_args(args)
    if cfg.multi_latent_attention:
        from .mcore_mla import mla_transformer_config

        return mla_transformer_config(config, cfg, changes)
    # replace() re-runs TransformerConfig's validation with the added fields.
    return dataclasses.replace(config, **changes) if changes else config


def build_mcore_gpt(cfg: GPTConfig, *, seed: int = 1234, params_dtype: torch.dtype = torch.float32,
                    allow_cpu: bool = False, cross_entropy_loss_fusion: bool = False,
                    calculate_per_token_loss: bool = False) -> nn.Module:
    """megatron-core's ``GPTModel`` (local spec) with ``cfg``'s architecture
    (``cross_entropy_loss_fusion``: Megatron-LM's ``--cross-entropy-loss-fusion`` for
    the loss it computes when given labels; ``calculate_per_token_loss``: Megatron-LM's
    ``--calculate-per-token-loss``, read by its MoE and MTP losses and by Megatron-FSDP's
    gradient reduction). With ``cfg.mtp_num_layers`` the model carries megatron-core's
    multi-token prediction block (mcore_mtp.py).

    Needs megatron-core and an initialised ``torch.distributed`` (its parallel state
    is set up for TP = PP = EP = 1 if it is not yet). The model is built for the
    parallel state's TP size (its TP layers split their weights over that group).
    Weights come from torch's global RNG: seed it first for reproducible weights."""
    from megatron_fsdp.compat.megatron_core import ensure_model_parallel_initialized, require_megatron_core

    require_megatron_core("build_mcore_gpt (--use-mcore-models)")
    reasons = mcore_unsupported(cfg)
    if reasons:
        raise ValueError("megatron-core's local GPTModel cannot represent this config: " + "; ".join(reasons)
                         + ". Train the embedded GPT (drop --use-mcore-models) or change those settings")
    if not device.cuda_available() and not allow_cpu:
        raise RuntimeError(
            "megatron-core's GPTModel needs CUDA to run: its attention allocates buffers on "
            "torch.cuda.current_device() and forks the CUDA RNG tracker on every forward, and this torch has no "
            "CUDA. Train the embedded GPT on CPU (drop --use-mcore-models), run on a GPU, or pass allow_cpu=True "
            "if you bridge those calls yourself (as tests/mcore_cpu_shim.py does)")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel

    ensure_model_parallel_initialized()
    if cfg.num_moe_experts:
        _define_missing_te_gemm()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    args = mcore_args(cfg, seed=seed, params_dtype=params_dtype, calculate_per_token_loss=calculate_per_token_loss,
                      tensor_model_parallel_size=tp)
    config = _transformer_config(cfg, args, cross_entropy_loss_fusion=cross_entropy_loss_fusion)
    if device.cuda_available() and not tensor_parallel.get_cuda_rng_tracker().is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    decoder_spec = _decoder_spec(cfg, config)
    mtp_spec = None
    if cfg.mtp_num_layers:
        from .mcore_mtp import mtp_block_spec

        problem = per_token_rolled_count_problem(cfg.mtp_num_layers, calculate_per_token_loss)
        if problem:
            raise ValueError(problem)
        mtp_spec = mtp_block_spec(config, decoder_spec)
        if cfg.apply_layernorm_1p:
            mtp_spec = _zero_centred(mtp_spec)  # its enorm / hnorm / final norm too
    return GPTModel(
        config=config, transformer_layer_spec=decoder_spec, vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=True, post_process=True, parallel_output=True,
        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type.value, rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base, mtp_block_spec=mtp_spec,
    )


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router gating reads ``moe_utils.te_general_gemm`` and falls
    back to ``torch.mm`` when it is None, but without TransformerEngine the name is never
    defined (its import fails before the assignment), so every MoE forward raised
    NameError. Define it as None, which is the fallback megatron-core meant."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# -- weights ---------------------------------------------------------------------------------
def _grouped_qkv(qkv: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Our fused rows [q (h*d) | k (g*d) | v (g*d) | gate (h*d, with attention_output_gate)]
    -> megatron-core's, grouped per key/value head: for each group, [its h/g query heads |
    their h/g gate heads, if any | its key | its value]."""
    d, g, h = cfg.kv_channels, cfg.num_query_groups, cfg.num_attention_heads
    gate_size = h * d if cfg.attention_output_gate else 0
    q, k, v, gate = qkv.split([h * d, g * d, g * d, gate_size])
    tail = qkv.shape[1:]  # (hidden,) for a weight, () for a bias
    parts = [q.reshape(g, (h // g) * d, *tail)]
    if gate_size:
        parts.append(gate.reshape(g, (h // g) * d, *tail))
    per_group = torch.cat(parts + [k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1)
    return per_group.reshape(qkv.shape)


_LAYER_NAMES = {  # ours (inside blocks.i.) -> megatron-core's (inside decoder.layers.i.)
    "ln_1": "input_layernorm", "ln_2": "pre_mlp_layernorm", "attn.proj": "self_attention.linear_proj",
    "attn.q_layernorm": "self_attention.q_layernorm", "attn.k_layernorm": "self_attention.k_layernorm",
    "mlp.fc": "mlp.linear_fc1", "mlp.proj": "mlp.linear_fc2", "mlp.router": "mlp.router",
    "mlp.shared_experts.fc": "mlp.shared_experts.linear_fc1", "mlp.shared_experts.proj": "mlp.shared_experts.linear_fc2",
}
_LEAF_NAMES = {  # modules whose single weight megatron-core keeps on the parent, under its own name
    "mlp.shared_experts.gate": "mlp.shared_experts.gate_weight",
}


_MLA_NAMES = {f"attn.{n}" for n in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                     "linear_kv_up_proj", "kv_layernorm")}


def _mcore_name(name: str) -> str:
    top = {"wte.weight": "embedding.word_embeddings.weight", "wpe.weight": "embedding.position_embeddings.weight",
           "lm_head.weight": "output_layer.weight"}
    if name in top:
        return top[name]
    if name.startswith("ln_f."):
        return "decoder.final_layernorm." + name[len("ln_f."):]
    if name.startswith("mtp."):
        return _mcore_mtp_name(name)
    _, index, rest = name.split(".", 2)  # blocks.<i>.<rest>
    return _mcore_layer_name(f"decoder.layers.{index}", rest)


def _mcore_layer_name(prefix: str, rest: str) -> str:
    """``rest`` inside one of our ``TransformerBlock`` -> megatron-core's name inside the
    ``TransformerLayer`` at ``prefix``."""
    if rest.startswith("mlp.experts."):
        _, _, expert, module, leaf = rest.split(".")  # mlp.experts.<e>.<fc|proj>.<leaf>
        linear = {"fc": "linear_fc1", "proj": "linear_fc2"}[module]
        return f"{prefix}.mlp.experts.local_experts.{expert}.{linear}.{leaf}"
    module, leaf = rest.rsplit(".", 1)
    if module in _LEAF_NAMES:
        return f"{prefix}.{_LEAF_NAMES[module]}"
    if module in _MLA_NAMES:  # MultiLatentAttention's own names are megatron-core's
        return f"{prefix}.self_attention.{module[len('attn.'):]}.{leaf}"
    if module == "attn.qkv":
        return f"{prefix}.self_attention.linear_qkv.{leaf}"
    return f"{prefix}.{_LAYER_NAMES[module]}.{leaf}"


_MTP_NAMES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_norm": "final_layernorm"}


def _mcore_mtp_name(name: str) -> str:
    """mtp.layers.<k>.<rest> (models/mtp.py) -> megatron-core's MultiTokenPredictionLayer names."""
    _, _, depth, rest = name.split(".", 3)
    prefix = f"mtp.layers.{depth}"
    if rest.startswith("block."):
        return _mcore_layer_name(f"{prefix}.transformer_layer", rest[len("block."):])
    module, leaf = rest.split(".", 1)
    return f"{prefix}.{_MTP_NAMES[module]}.{leaf}"


def to_mcore_state_dict(state_dict: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The embedded GPT's weights under megatron-core GPTModel's names and layout.
    A tied output layer is left out (megatron-core shares the embedding too)."""
    out = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and not cfg.untie_embeddings_and_output_weights:
            continue
        if ".attn.qkv." in name:
            tensor = _grouped_qkv(tensor, cfg)
        out[_mcore_name(name)] = tensor
    if cfg.position_embedding_type is not PositionEmbeddingType.LEARNED_ABSOLUTE:
        out.pop("embedding.position_embeddings.weight", None)
    return out


class McoreBalancingLoss:
    """megatron-core's ``load_balancing_loss`` of the latest forward, as Megatron-LM
    logs it and as the embedded GPT's ``moe_load_balancing_loss`` reports it: each
    MoE layer's aux loss without its coefficient, averaged over the MoE layers.

    megatron-core's routers add ``aux_loss / coeff`` per layer to a process-wide
    tracker (``moe_utils.get_moe_layer_wise_logging_tracker``) on every training
    forward; Megatron-LM's ``training_log`` reads and zeroes it once per iteration.
    Here ``clear()`` runs before a micro batch's forward (so evaluation forwards,
    which also record, never leak in) and ``__call__`` reads it after."""

    def __init__(self, num_moe_layers: int, name: str = "load_balancing_loss") -> None:
        self.num_moe_layers = num_moe_layers
        self.name = name
        """The tracker entry: ``MoELoadBalancing.log_name`` of the model's balancing type."""

    @staticmethod
    def _tracker() -> dict:
        from megatron.core.transformer.moe import moe_utils

        return moe_utils.get_moe_layer_wise_logging_tracker()

    def clear(self) -> None:
        entry = self._tracker().get(self.name)
        if entry is not None:
            entry["values"].zero_()

    @staticmethod
    def set_moe_aux_loss_scale(scale: float) -> None:
        """The gradient megatron-core's routers hand their aux losses (``MoEAuxLossAutoScaler``),
        which Megatron-LM's forward step sets every micro batch: the loss scale over the micro
        batches, the loss scale alone in per-token mode. Left at its default 1, a run of M
        micro batches weighed the balancing loss M times too much."""
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32))

    def __call__(self) -> "torch.Tensor | None":
        entry = self._tracker().get(self.name)
        if entry is None:  # coefficient 0 or no loss: megatron-core records nothing, Megatron-LM logs nothing
            return None
        return entry["values"].detach().sum() / self.num_moe_layers


def balancing_loss_reader(cfg: GPTConfig) -> "McoreBalancingLoss | None":
    """The reader for an MoE ``cfg``, averaging over its MoE layers (as Megatron-LM's
    ``track_moe_metrics`` with ``moe_layer_freq``), the MTP depths' included when they
    are MoE; ``None`` for a dense model."""
    from .mtp import mtp_moe_layers

    if cfg.num_moe_experts is None:
        return None
    return McoreBalancingLoss(sum(cfg.moe_layer_pattern) + mtp_moe_layers(cfg),
                              cfg.moe_router_load_balancing_type.log_name)


def mtp_loss_reader(cfg: GPTConfig, *, sequence_length: int, per_token: bool):
    """What the launcher drives of megatron-core's MTP (``mcore_mtp.McoreMTPLoss``) for an
    MTP ``cfg`` trained on ``sequence_length``-token samples; ``None`` without MTP."""
    if not cfg.mtp_num_layers:
        return None
    from .mcore_mtp import McoreMTPLoss

    return McoreMTPLoss(cfg, sequence_length=sequence_length, per_token=per_token)
