"""Hugging Face ``config.json`` to and from the embedded GPT's ``GPTConfig``.

One table drives all three directions: ``_required_fields(hf_config, family)`` gives, for a
``config.json`` of a supported family, the ``GPTConfig`` fields that decide the model's
numbers and the values they must have. ``gpt_config_from_hf`` builds a config from them,
``check_gpt_config_against_hf`` compares a given config with them field by field, and
``hf_config_from_gpt`` writes a ``config.json`` and then checks it the same way, so a
configuration the family cannot express is refused by the same rules that read it.
``hf_family_for`` picks the family for a model that did not come from a ``config.json``.

[Note: what is refused] Anything the embedded GPT would compute differently raises
``HFConfigUnsupported`` naming the field and its value, before any weight is read: RoPE
scaling (``rope_type`` other than ``default``), a sliding window shorter than the
sequence, biases on some attention projections but not the layers our config biases
together, activations other than SiLU (gated) or GELU (GPT-2), a jittered or top-1 Mixtral
router. Training-only settings (dropout, ``initializer_range``) are carried but not checked.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from typing import Any

from ..models.config import GPTConfig, MoELoadBalancing, Normalization, PositionEmbeddingType, ScoreFunction


class HFFamily(enum.Enum):
    """A Hugging Face model family the embedded GPT reads and writes."""

    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    MIXTRAL = "mixtral"
    GPT2 = "gpt2"

    @property
    def architecture(self) -> str:
        """The ``*ForCausalLM`` class name ``config.json``'s ``architectures`` lists."""
        return _ARCHITECTURES[self]

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "HFFamily":
        """The family of a ``config.json`` (its ``model_type``, else its ``architectures``)."""
        model_type = hf_config.get("model_type")
        for member in cls:
            if model_type == member.value:
                return member
        for arch in hf_config.get("architectures") or ():
            for member in cls:
                if arch == member.architecture:
                    return member
        names = ", ".join(m.value for m in cls)
        raise HFConfigUnsupported(
            f"config.json has model_type={model_type!r} (architectures={hf_config.get('architectures')!r}), which "
            f"is not a family the embedded GPT reads ({names}); wrap the transformers model itself with "
            "fully_shard_model and load it with identity_name_map")


_ARCHITECTURES = {
    HFFamily.LLAMA: "LlamaForCausalLM", HFFamily.MISTRAL: "MistralForCausalLM", HFFamily.QWEN2: "Qwen2ForCausalLM",
    HFFamily.QWEN3: "Qwen3ForCausalLM", HFFamily.MIXTRAL: "MixtralForCausalLM", HFFamily.GPT2: "GPT2LMHeadModel",
}
_TIED_BY_DEFAULT = {HFFamily.GPT2}
"""Families whose config class ties the output layer when ``tie_word_embeddings`` is absent."""
_GPT2_GELU = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": None, "gelu": False}
"""GPT-2 ``activation_function`` -> ``openai_gelu`` (tanh form); None: not representable."""


class HFConfigUnsupported(ValueError):
    """A ``config.json`` (or a ``GPTConfig``) uses something the other side cannot represent exactly."""


class HFConfigMismatch(ValueError):
    """A ``GPTConfig`` field differs from what a ``config.json`` requires."""


def read_hf_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of a Hugging Face model directory (or the file itself) as a dict."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json at {file!r}; pass a Hugging Face model directory (with config.json)")
    with open(file, encoding="utf-8") as handle:
        return json.load(handle)


# -- what a config.json requires ---------------------------------------------------------------
def _unsupported(family: HFFamily, field: str, value: Any, why: str) -> HFConfigUnsupported:
    return HFConfigUnsupported(f"{family.value} config.json field {field}={value!r}: {why}")


def _rope_theta(hf: dict, family: HFFamily) -> float:
    """RoPE's base, from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for field, source in (("rope_parameters.rope_type", params), ("rope_scaling.rope_type", scaling)):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind not in ("default", None):
            raise _unsupported(family, field, kind, "RoPE scaling is not implemented by the embedded GPT (plain "
                               "RoPE only); use a model without rope scaling or wrap the transformers model itself")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return int(theta) if float(theta).is_integer() else float(theta)


def _check_window(hf: dict, family: HFFamily, seq_length: int) -> None:
    window = hf.get("sliding_window")
    if family in (HFFamily.QWEN2, HFFamily.QWEN3) and not hf.get("use_sliding_window", False):
        return
    if window is not None and window < seq_length:
        raise _unsupported(family, "sliding_window", window, f"attention over a window shorter than seq_length="
                           f"{seq_length} is not implemented; pass seq_length <= {window} or a config without it")


def _attention_biases(hf: dict, family: HFFamily) -> dict[str, bool]:
    """``add_bias_linear`` / ``add_qkv_bias`` for the family's bias settings."""
    if family is HFFamily.QWEN2:
        return dict(add_bias_linear=False, add_qkv_bias=True)  # q/k/v biased, o_proj and MLP not
    attention, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention != mlp:
        field = "attention_bias/mlp_bias" if family is HFFamily.LLAMA else "attention_bias"
        raise _unsupported(family, field, (attention, mlp) if family is HFFamily.LLAMA else attention,
                           "biases on the attention projections but not the MLP (or the reverse) are not "
                           "representable: add_bias_linear biases both")
    return dict(add_bias_linear=attention, add_qkv_bias=False)


def _gated_fields(hf: dict, family: HFFamily) -> dict[str, Any]:
    """Llama-shaped families: RMSNorm, RoPE, SiLU-gated MLP, group-query attention."""
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(family, "hidden_act", hf.get("hidden_act"), "only SiLU (swiglu) is implemented")
    heads = hf["num_attention_heads"]
    fields = dict(
        hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
        swiglu=True, normalization=Normalization.RMS_NORM, norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        position_embedding_type=PositionEmbeddingType.ROPE, rotary_base=_rope_theta(hf, family),
        rotary_percent=float(hf.get("partial_rotary_factor", 1.0)), rotary_interleaved=False,
        qk_layernorm=family is HFFamily.QWEN3, num_moe_experts=None, **_attention_biases(hf, family))
    if family is HFFamily.MIXTRAL:
        fields.update(_mixtral_fields(hf))
    return fields


def _mixtral_fields(hf: dict) -> dict[str, Any]:
    family = HFFamily.MIXTRAL
    if hf.get("router_jitter_noise", 0.0):
        raise _unsupported(family, "router_jitter_noise", hf["router_jitter_noise"],
                           "router input jitter is not implemented; set it to 0")
    topk = hf.get("num_experts_per_tok", 2)
    if topk < 2:
        raise _unsupported(family, "num_experts_per_tok", topk, "Mixtral renormalises the top-1 weight to 1, "
                           "which Megatron's top-1 routing (pre-softmax probability) does not")
    return dict(num_moe_experts=hf.get("num_local_experts", 8), moe_router_topk=topk,
                moe_ffn_hidden_size=hf["intermediate_size"], moe_router_pre_softmax=False,
                moe_router_score_function=ScoreFunction.SOFTMAX, moe_router_topk_scaling_factor=None,
                moe_router_num_groups=None, moe_router_enable_expert_bias=False,
                moe_shared_expert_intermediate_size=None, moe_layer_freq=1)


def _gpt2_fields(hf: dict) -> dict[str, Any]:
    family = HFFamily.GPT2
    act = hf.get("activation_function", "gelu_new")
    if _GPT2_GELU.get(act) is None:
        raise _unsupported(family, "activation_function", act, "only gelu_new / gelu_pytorch_tanh (tanh GELU) "
                           "and gelu (exact) are implemented")
    for field, good in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if hf.get(field, good) != good:
            raise _unsupported(family, field, hf[field], f"only {field}={good} is implemented")
    embd = hf.get("n_embd", 768)
    return dict(
        hidden_size=embd, num_layers=hf.get("n_layer", 12), num_attention_heads=hf.get("n_head", 12),
        num_query_groups=hf.get("n_head", 12), kv_channels=embd // hf.get("n_head", 12),
        ffn_hidden_size=hf.get("n_inner") or 4 * embd, swiglu=False, openai_gelu=_GPT2_GELU[act],
        normalization=Normalization.LAYER_NORM, norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        position_embedding_type=PositionEmbeddingType.LEARNED_ABSOLUTE, seq_length=hf.get("n_positions", 1024),
        add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False, num_moe_experts=None)


_ALWAYS = dict(squared_relu=False, apply_layernorm_1p=False, attention_output_gate=False,
               multi_latent_attention=False, mtp_num_layers=None)
"""Fields no supported family has: they must keep these values."""


def _required_fields(hf: dict, family: HFFamily) -> dict[str, Any]:
    """The ``GPTConfig`` fields ``hf`` decides, with their values (see the module docstring)."""
    fields = _gpt2_fields(hf) if family is HFFamily.GPT2 else _gated_fields(hf, family)
    fields.update(_ALWAYS)
    fields["vocab_size"] = hf["vocab_size"]
    tied = hf.get("tie_word_embeddings", family in _TIED_BY_DEFAULT)
    fields["untie_embeddings_and_output_weights"] = not tied
    return fields


def _training_fields(hf: dict, family: HFFamily) -> dict[str, Any]:
    """Settings that change training but not a forward in eval mode: carried, not checked."""
    if family is HFFamily.GPT2:
        return dict(hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
                    init_method_std=hf.get("initializer_range", 0.02))
    return dict(attention_dropout=hf.get("attention_dropout", 0.0), init_method_std=hf.get("initializer_range", 0.02))


# -- the three directions ----------------------------------------------------------------------
def gpt_config_from_hf(hf_config: dict, **overrides: Any) -> tuple[GPTConfig, HFFamily]:
    """The ``GPTConfig`` of a ``config.json`` and its family. ``overrides`` are ``GPTConfig``
    fields: a padded ``vocab_size`` (``vocab_size_with_padding``), a shorter ``seq_length``
    (RoPE families; default ``max_position_embeddings``), dropout, recomputation...; one
    that contradicts the checkpoint raises ``HFConfigMismatch``."""
    family = HFFamily.from_hf_config(hf_config)
    fields = _training_fields(hf_config, family)
    if family is not HFFamily.GPT2:
        fields["seq_length"] = hf_config.get("max_position_embeddings", 2048)
    fields.update(_required_fields(hf_config, family))
    fields.update(overrides)
    if family is not HFFamily.GPT2:
        _check_window(hf_config, family, fields["seq_length"])
    cfg = GPTConfig(**fields)
    check_gpt_config_against_hf(cfg, hf_config)
    return cfg, family


def _differs(name: str, ours: Any, theirs: Any) -> bool:
    if isinstance(ours, enum.Enum) and isinstance(theirs, str):
        return ours.value != theirs
    if isinstance(theirs, float) or isinstance(ours, float):
        return ours is None or theirs is None or not math.isclose(float(ours), float(theirs), rel_tol=1e-12)
    return ours != theirs


def check_gpt_config_against_hf(cfg: GPTConfig, hf_config: dict) -> None:
    """Raise ``HFConfigMismatch`` (naming the field, our value and the checkpoint's) unless
    ``cfg`` computes what ``hf_config``'s model computes. ``vocab_size`` may be padded above
    the checkpoint's; ``seq_length`` is free with RoPE and must equal GPT-2's ``n_positions``."""
    family = HFFamily.from_hf_config(hf_config)
    required = _required_fields(hf_config, family)
    problems = []
    for name, theirs in required.items():
        ours = getattr(cfg, name)
        if name == "vocab_size":
            if ours < theirs:
                problems.append(f"vocab_size: ours {ours} < the checkpoint's {theirs} (it may only be padded above)")
        elif name == "num_moe_experts" or cfg.num_moe_experts is not None or not name.startswith("moe_"):
            if _differs(name, ours, theirs):
                problems.append(f"{name}: ours {ours!r}, the checkpoint's {theirs!r}")
    if cfg.num_moe_experts is not None and cfg.moe_router_load_balancing_type is MoELoadBalancing.SINKHORN:
        problems.append(f"moe_router_load_balancing_type: ours 'sinkhorn', {family.value} routes by softmax top-k")
    if problems:
        raise HFConfigMismatch(f"GPTConfig does not match the {family.value} config.json: " + "; ".join(problems)
                               + ". Build the config with gpt_config_from_hf, or change these fields")
    if family is not HFFamily.GPT2:
        _check_window(hf_config, family, cfg.seq_length)


def hf_family_for(cfg: GPTConfig) -> HFFamily:
    """The Hugging Face family whose model computes what ``cfg`` computes, for a model that did
    not come from a ``config.json`` (GPT-2: learned positions and GELU; the others RoPE and
    SwiGLU: Mixtral with experts, Qwen3 with QK norms, Qwen2 with QKV biases, else Llama).
    ``hf_config_from_gpt`` still checks every field the family must express."""
    if cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE and not cfg.swiglu:
        return HFFamily.GPT2
    if not cfg.swiglu or cfg.position_embedding_type is not PositionEmbeddingType.ROPE:
        raise HFConfigUnsupported(
            "no Hugging Face family holds this model (GPT-2: learned positions and GELU; the others: RoPE and "
            f"SwiGLU; it has position_embedding_type={cfg.position_embedding_type.value}, swiglu={cfg.swiglu}); "
            "keep it in a Megatron format, or name a family if you know one fits")
    if cfg.num_moe_experts:
        return HFFamily.MIXTRAL
    if cfg.qk_layernorm:
        return HFFamily.QWEN3
    if cfg.add_qkv_bias:
        return HFFamily.QWEN2
    return HFFamily.LLAMA


def hf_config_from_gpt(cfg: GPTConfig, family: HFFamily, *, vocab_size: int | None = None) -> dict:
    """A ``config.json`` dict that ``transformers`` loads as ``family``'s model computing what
    ``cfg`` computes; ``vocab_size``: the unpadded vocabulary (default ``cfg.vocab_size``).
    Raises ``HFConfigMismatch`` naming the fields the family cannot express."""
    family = HFFamily(family)
    vocab = cfg.vocab_size if vocab_size is None else vocab_size
    out: dict[str, Any] = {"architectures": [family.architecture], "model_type": family.value, "vocab_size": vocab,
                           "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
                           "initializer_range": cfg.init_method_std}
    out.update(_gpt2_config(cfg) if family is HFFamily.GPT2 else _gated_config(cfg, family))
    try:
        check_gpt_config_against_hf(dataclasses.replace(cfg, vocab_size=max(vocab, cfg.vocab_size)), out)
    except (HFConfigMismatch, HFConfigUnsupported) as exc:
        raise HFConfigMismatch(f"this GPTConfig cannot be written as a {family.value} config.json: {exc}") from None
    return out


def _gated_config(cfg: GPTConfig, family: HFFamily) -> dict[str, Any]:
    out = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_ffn_hidden_size if cfg.num_moe_experts
               else cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
               head_dim=cfg.kv_channels, hidden_act="silu" if cfg.swiglu else "gelu",
               max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_epsilon,
               rope_theta=cfg.rotary_base, rope_parameters={"rope_theta": cfg.rotary_base, "rope_type": "default"},
               attention_dropout=cfg.attention_dropout)
    if cfg.rotary_percent != 1.0:
        out["partial_rotary_factor"] = cfg.rotary_percent
    if family is HFFamily.LLAMA:
        out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
    elif family is HFFamily.QWEN3:
        out.update(attention_bias=cfg.add_bias_linear, use_sliding_window=False, sliding_window=None)
    elif family is HFFamily.QWEN2:
        out.update(use_sliding_window=False, sliding_window=None)
    else:
        out["sliding_window"] = None
    if family is HFFamily.MIXTRAL:
        out.update(num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                   router_jitter_noise=0.0)
    return out


def _gpt2_config(cfg: GPTConfig) -> dict[str, Any]:
    return dict(n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_attention_heads,
                n_inner=cfg.ffn_hidden_size, n_positions=cfg.seq_length,
                activation_function="gelu_new" if cfg.openai_gelu else "gelu", layer_norm_epsilon=cfg.norm_epsilon,
                resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout)
