"""The embedded GPT's configuration: the architecture knobs Megatron-LM's flags describe.

Field names follow Megatron-LM's argument names (``--num-query-groups`` ->
``num_query_groups``) so the launcher maps flags to fields one to one. Defaults
are Megatron-core's ``TransformerConfig`` defaults, with two deliberate
exceptions, both so that ``GPTConfig()`` stays the model this package always
shipped:

* ``hidden_dropout`` and ``attention_dropout`` default to 0.0 here, not Megatron's
  0.1. A ``GPTConfig()`` built in a test or the README is then deterministic and
  compares exactly with single-process training; the launcher passes Megatron's
  0.1 defaults through its flags, so ``pretrain_gpt.py`` behaves like Megatron-LM.
* ``openai_gelu`` (GELU's tanh approximation) defaults to True. Megatron-LM picks
  the GELU flavour through its fused bias-GELU kernel (tanh form, on by default
  for a GELU MLP with biases; ``--no-bias-gelu-fusion`` or ``--disable-bias-linear``
  give the exact erf GELU), and the launcher sets the field the same way.

Megatron-LM fills some sizes in during validation and so does ``__post_init__``:
``kv_channels``, ``num_query_groups``, ``ffn_hidden_size`` (with ``--swiglu``
Megatron-LM's default is 2/3 of 4 * hidden rounded down to 64, not 4 * hidden)
and ``moe_ffn_hidden_size``.

``GPTConfig()`` builds the same model, parameter for parameter and number for
number, as before these fields existed (a GPT-2 shaped LayerNorm/GELU model with
learned positions and tied embeddings).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional, Union


class _ParsedEnum(enum.Enum):
    """An enum whose members are also accepted as their (case-insensitive) strings."""

    @classmethod
    def parse(cls, value: "Union[_ParsedEnum, str]", *, arg_name: str):
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.strip().lower() == member.value.lower():
                    return member
        names = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{arg_name}={value!r} is not one of {names}; pass one of those")


class Normalization(_ParsedEnum):
    """Megatron's ``--normalization``."""

    LAYER_NORM = "LayerNorm"
    """(x - mean) / sqrt(var + eps) * weight + bias."""
    RMS_NORM = "RMSNorm"
    """x / sqrt(mean(x^2) + eps) * weight; no bias (Llama)."""


class PositionEmbeddingType(_ParsedEnum):
    """Megatron's ``--position-embedding-type``."""

    LEARNED_ABSOLUTE = "learned_absolute"
    """A learned (seq_length, hidden) table added to the token embeddings (GPT-2/3)."""
    ROPE = "rope"
    """Rotary embeddings applied to queries and keys inside attention (Llama)."""
    NONE = "none"
    """No position information besides the causal mask (NoPE)."""


class RopeType(_ParsedEnum):
    """Megatron's ``--rope-type``: the rotary embedding of multi-latent attention."""

    ROPE = "rope"
    """Plain RoPE on the positional channels (``rotary_base``, ``rotary_percent``)."""
    YARN = "yarn"
    """YaRN: RoPE whose low frequencies are interpolated by ``rotary_scaling_factor``,
    with its cos/sin scaled by the ``mscale`` concentration factor (megatron-core's
    default for MLA)."""


class RouterDtype(_ParsedEnum):
    """Megatron's ``--moe-router-dtype``: the precision the MoE router computes in."""

    FP32 = "fp32"
    """Gating linear, top-k, softmax and balancing loss in float32 (DeepSeek-V3's
    recipes): under bf16 the k largest logits are picked among fp32 values, so
    near-ties resolve as in an fp32 model instead of by bf16 rounding."""
    FP64 = "fp64"
    """Gating linear and top-k in float64; the softmaxes are still taken in fp32 (as
    Megatron's) and the routing weights handed back in float64."""


class MoELoadBalancing(_ParsedEnum):
    """Megatron's ``--moe-router-load-balancing-type``: which balancing loss the router adds."""

    AUX_LOSS = "aux_loss"
    """The Switch loss over all tokens of the micro batch."""
    SEQ_AUX_LOSS = "seq_aux_loss"
    """The Switch loss of each sequence on its own, averaged over the sequences."""
    GLOBAL_AUX_LOSS = "global_aux_loss"
    """The Switch loss with the expert counts of the whole global batch: summed over the
    data-parallel ranks, averaged over the micro batches run so far in the iteration
    (see router.py, [Note: global aux loss])."""
    SINKHORN = "sinkhorn"
    """No loss: experts are picked on the Sinkhorn-balanced scores in training (S-BASE);
    needs ``moe_aux_loss_coeff=0``."""
    NONE = "none"
    """No balancing loss, whatever ``moe_aux_loss_coeff`` says."""

    @property
    def log_name(self) -> str:
        """The name Megatron-LM logs this loss under (megatron-core's tracker entry)."""
        return {MoELoadBalancing.SEQ_AUX_LOSS: "seq_load_balancing_loss",
                MoELoadBalancing.GLOBAL_AUX_LOSS: "global_load_balancing_loss"}.get(self, "load_balancing_loss")

    @property
    def logged_as_rank_sum(self) -> bool:
        """Whether Megatron-LM logs the sum over data-parallel ranks rather than their mean:
        each rank's global loss divides by the tokens of every rank, so the ranks' values are
        parts of one loss (megatron-core reduces that tracker entry over its DP-including group)."""
        return self is MoELoadBalancing.GLOBAL_AUX_LOSS


class ScoreFunction(_ParsedEnum):
    """Megatron's ``--moe-router-score-function``: how the router turns logits into scores."""

    SOFTMAX = "softmax"
    """Softmax: over the k largest logits (or over all experts with ``moe_router_pre_softmax``)."""
    SIGMOID = "sigmoid"
    """sigmoid(logit) per expert, independent of the others (DeepSeek-V3); with k > 1 the k
    chosen scores are divided by their sum, so each token's weights sum to 1 (before
    ``moe_router_topk_scaling_factor``)."""


class RecomputeGranularity(_ParsedEnum):
    """Megatron's ``--recompute-granularity``."""

    FULL = "full"
    """Checkpoint every transformer block: keep only block inputs, recompute the rest."""
    SELECTIVE = "selective"
    """Checkpoint only the attention core (softmax(QK^T)V), Megatron's ``core_attn``."""


class RecomputeMethod(_ParsedEnum):
    """Megatron's ``--recompute-method``: which blocks full recomputation checkpoints."""

    UNIFORM = "uniform"
    """Split the blocks into chunks of ``recompute_num_layers``; checkpoint each chunk
    (only its input is kept)."""
    BLOCK = "block"
    """Checkpoint the first ``recompute_num_layers`` blocks one by one, keep the rest."""


def vocab_size_with_padding(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Megatron-LM's padded vocabulary: the next multiple of
    ``make_vocab_size_divisible_by * tensor_model_parallel_size`` at or above
    ``vocab_size`` (the extra rows are never-seen dummy tokens that make the
    embedding and output GEMMs a friendly size)."""
    for name, value in (("vocab_size", vocab_size), ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
                        ("tensor_model_parallel_size", tensor_model_parallel_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def megatron_swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's ``--ffn-hidden-size`` default with ``--swiglu``: two thirds of
    4 * hidden (the gate doubles the first projection, so the parameter count stays
    near a 4 * hidden GELU MLP), rounded down to a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


@dataclasses.dataclass(kw_only=True)
class GPTConfig:
    """Architecture of the embedded GPT (``megatron_fsdp.models.GPT``)."""

    # -- sizes ------------------------------------------------------------------------
    vocab_size: int = 256
    """Rows of the embedding table. Byte-level by default: the embedded corpus needs
    no tokenizer. Pad a tokenizer's vocabulary with ``vocab_size_with_padding``."""
    seq_length: int = 64
    """Longest sequence the model accepts (Megatron's ``--max-position-embeddings``)."""
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    """Key/value heads for group-query attention; ``None`` = one per query head (MHA)."""
    kv_channels: Optional[int] = None
    """Width of one attention head; ``None`` = hidden_size / num_attention_heads."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; ``None`` = 4 * hidden_size, or Megatron's swiglu default
    (``megatron_swiglu_ffn_hidden_size``) when ``swiglu``. Filled in by validation."""

    # -- architecture -----------------------------------------------------------------
    swiglu: bool = False
    """Gated SiLU MLP, silu(x W_gate) * (x W_up), instead of GELU."""
    squared_relu: bool = False
    """relu(x)^2 instead of GELU in the MLP (Megatron's ``--squared-relu``; not with swiglu)."""
    openai_gelu: bool = True
    """GELU by its tanh approximation (the formula of Megatron's fused bias-GELU
    kernel) instead of the exact erf GELU. True here, as this model always had. The
    launcher sets it as Megatron-LM ends up computing: tanh when the bias-GELU fusion
    is on (its default) and the linear layers have biases, exact otherwise
    (``--no-bias-gelu-fusion`` / ``--disable-bias-linear``); Megatron-LM never reads
    its own ``--openai-gelu``."""
    normalization: Union[Normalization, str] = Normalization.LAYER_NORM
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    """Zero-centred norm weights: the norm multiplies by (1 + weight) and weight starts
    at 0, so weight decay pulls the scale towards 1 (Megatron's ``--apply-layernorm-1p``)."""
    qk_layernorm: bool = False
    """Normalise each head's queries and keys (same norm type) before RoPE."""
    attention_output_gate: bool = False
    """Gated attention (Megatron's ``--attention-output-gate``): the fused QKV projection
    also yields one gate channel per query channel, and each head's attention output is
    multiplied by sigmoid(gate), computed in fp32, before the output projection. Not with
    multi-latent attention (megatron-core refuses it there too)."""
    position_embedding_type: Union[PositionEmbeddingType, str] = PositionEmbeddingType.LEARNED_ABSOLUTE
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates; the rest pass through."""
    rotary_interleaved: bool = False
    """RoPE turns adjacent channel pairs (0, 1), (2, 3), ... (GPT-J's layout, Megatron's
    ``--rotary-interleaved``) instead of channel j with j + rot_dim/2."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of the embedding's."""
    add_bias_linear: bool = True
    """Biases on the linear layers (Megatron's ``--disable-bias-linear`` sets False).
    Norms keep their own bias whatever this says, as in Megatron."""
    add_qkv_bias: bool = False
    """A bias on the fused QKV projection even when ``add_bias_linear`` is False (Megatron's
    ``--add-qkv-bias``; Qwen2's layout: biased q/k/v projections, unbiased output and MLP)."""

    # -- regularisation and init ------------------------------------------------------
    hidden_dropout: float = 0.0
    """Dropout on the embeddings and on each residual branch (Megatron default 0.1;
    0.0 here, see the module docstring)."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (Megatron default 0.1; 0.0 here)."""
    init_method_std: float = 0.02
    """Weights ~ N(0, std); the two residual output projections of every block use
    std / sqrt(2 * num_layers) (Megatron's scaled init). Biases start at zero."""
    recompute_granularity: Union[RecomputeGranularity, str, None] = None
    """Activation recomputation; ``None`` keeps every activation."""
    recompute_method: Union[RecomputeMethod, str, None] = None
    """With full recomputation: ``uniform`` or ``block``. ``None`` means uniform (Megatron-LM
    requires the flag; the default here keeps ``recompute=True`` meaning every block)."""
    recompute_num_layers: Optional[int] = None
    """Blocks per checkpointed chunk (uniform) or checkpointed blocks (block); ``None`` = 1."""

    # -- mixture of experts -----------------------------------------------------------
    num_moe_experts: Optional[int] = None
    """Experts per MoE layer; ``None`` = dense model (Megatron's ``--num-experts``)."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    """Width of one expert's MLP; ``None`` = ffn_hidden_size (as Megatron-LM)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the switch-transformer load-balancing loss of every MoE layer."""
    moe_router_load_balancing_type: Union[MoELoadBalancing, str] = MoELoadBalancing.AUX_LOSS
    """Which balancing loss ``moe_aux_loss_coeff`` weighs (``NONE``: none at all)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (probabilities not renormalised over the
    k chosen); by default softmax over the k chosen logits, as Megatron."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiply the k routing probabilities by this (DeepSeek); ``None`` = 1."""
    moe_router_score_function: Union[ScoreFunction, str] = ScoreFunction.SOFTMAX
    """Scores from logits: softmax (Megatron's default) or sigmoid (DeepSeek-V3). The
    balancing losses use the same function over all experts (sigmoid: normalised per token)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the sigmoid scores
    for choosing the experts only (the routing weights stay the unbiased scores), nudged
    after every global batch towards even loads. Needs the sigmoid score function. See
    router.py, [Note: expert bias]."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update: bias += rate * sign(mean load - expert's load)."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: the experts form this many equal groups (e.g. one per device or
    node); used with ``moe_router_group_topk``."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: each token first picks this many groups (by the sum of each
    group's top topk/group_topk scores), then its k experts among theirs. ``None``: off."""
    moe_router_force_load_balancing: bool = False
    """Benchmarking mode (Megatron's ``--moe-router-force-load-balancing``): every router
    routes on standard-normal noise instead of its logits, the gradient passing straight
    through to the logits. See forced_routing.py."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of a shared expert MLP that every token goes through besides its routed
    experts (its output is added); ``None`` = no shared expert. As in Megatron-core it
    takes no biases, so it needs ``add_bias_linear=False``. Its parameters are dense
    (not expert) parameters."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output per token by sigmoid(x . w), w a learned
    (1, hidden) weight initialised like the others (Megatron's ``--moe-shared-expert-gate``).
    No effect without a shared expert, as in megatron-core."""
    moe_router_dtype: Union[RouterDtype, str, None] = None
    """Precision of the router (Megatron's ``--moe-router-dtype``): the gating linear
    x W^T takes its inputs cast to this dtype, so the logits, the top-k choice, the
    softmax and the balancing loss are computed in it, and the routing weights stay in
    it until they scale the experts' activations. ``None``: the tokens' compute dtype
    (bf16 in a bf16 model), as Megatron. See [Note: router dtype] in moe.py."""
    moe_layer_freq: Union[int, list[int]] = 1
    """Which layers are MoE: every N-th layer (layer i when i % N == 0), or a 0/1 list
    with one entry per layer (Megatron's ``--moe-layer-freq``)."""

    # -- multi-latent attention (DeepSeek MLA; see mla.py) -------------------------------
    multi_latent_attention: bool = False
    """Attention through low-rank query / key-value latents with a decoupled rotary
    part (Megatron's ``--multi-latent-attention``); ``num_query_groups`` and
    ``kv_channels`` play no part then. Defaults below are Megatron-LM's flag defaults
    (MLATransformerConfig's own differ: ranks 512, rotary_scaling_factor 40)."""
    q_lora_rank: Optional[int] = None
    """Rank of the query latent; ``None`` projects queries straight from the hidden state."""
    kv_lora_rank: int = 32
    """Rank of the shared key/value latent."""
    qk_head_dim: int = 128
    """Per-head query/key channels without position information."""
    qk_pos_emb_head_dim: int = 64
    """Per-head query/key channels that carry the rotary embedding (the key's are shared
    by all heads)."""
    v_head_dim: int = 128
    """Per-head value channels."""
    rope_type: Union[RopeType, str, None] = None
    """MLA's rotary embedding; ``None`` = yarn with MLA (megatron-core's default). Without
    MLA only ``rope`` is accepted (Megatron-LM's rule) and it changes nothing."""
    rotary_scaling_factor: float = 1.0
    """YaRN's interpolation factor. It also enters MLA's softmax scale, with plain rope
    too: (0.1 * mscale_all_dim * ln(factor) + 1)^2 / sqrt(q head dim) when factor > 1."""
    mscale: float = 1.0
    """YaRN concentration: cos/sin are scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    mscale_all_dim: float = 0.0
    """See ``mscale`` and ``rotary_scaling_factor``."""
    original_max_position_embeddings: int = 4096
    """YaRN's pre-extension context length. Megatron-LM's flags never set it for MLA (its
    ``--yarn-*`` flags feed ``--position-embedding-type yarn`` only): megatron-core's default."""
    beta_fast: float = 32.0
    """YaRN's fast-rotation boundary (rotations over the original context); megatron-core's default."""
    beta_slow: float = 1.0
    """YaRN's slow-rotation boundary; megatron-core's default."""

    # -- multi-token prediction (DeepSeek-V3 MTP; see mtp.py) ---------------------------
    mtp_num_layers: Optional[int] = None
    """Prediction depths (Megatron's ``--mtp-num-layers``): depth k (1-based) reads the
    previous depth's hidden state and the embedding of the token k places ahead, runs one
    transformer layer of the last decoder layer's kind, and predicts the token k + 1
    places ahead through the shared output layer. Its loss only adds gradients; the
    logits and the language-model loss stay the main model's. ``None``: no MTP."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP loss (Megatron's ``--mtp-loss-scaling-factor``): the mean over
    the depths of their token-mean losses, times this, joins the training objective."""

    # -- legacy spellings (kept so existing callers keep working) --------------------
    tie_embeddings: Optional[bool] = None
    """Old name: ``tie_embeddings=False`` is ``untie_embeddings_and_output_weights=True``.
    Folded into that field by validation (and reset to ``None``)."""
    recompute: bool = False
    """Old name: ``recompute=True`` is ``recompute_granularity='full'``. Folded into that
    field by validation (and reset to ``False``)."""

    def __post_init__(self) -> None:
        self._resolve_legacy()
        self.normalization = Normalization.parse(self.normalization, arg_name="normalization")
        self.position_embedding_type = PositionEmbeddingType.parse(
            self.position_embedding_type, arg_name="position_embedding_type")
        self.moe_router_load_balancing_type = MoELoadBalancing.parse(
            self.moe_router_load_balancing_type, arg_name="moe_router_load_balancing_type")
        self.moe_router_score_function = ScoreFunction.parse(
            self.moe_router_score_function, arg_name="moe_router_score_function")
        if self.moe_router_dtype is not None:
            self.moe_router_dtype = RouterDtype.parse(self.moe_router_dtype, arg_name="moe_router_dtype")
        if self.recompute_granularity is not None:
            self.recompute_granularity = RecomputeGranularity.parse(
                self.recompute_granularity, arg_name="recompute_granularity")
        self._check_sizes()
        self._check_recompute()
        self._check_attention()
        self._check_activation()
        self._check_regularisation()
        self._check_moe()
        self._check_mla()
        self._check_mtp()

    # -- validation ----------------------------------------------------------------------
    def _resolve_legacy(self) -> None:
        if self.tie_embeddings is not None:
            if self.tie_embeddings and self.untie_embeddings_and_output_weights:
                raise ValueError("tie_embeddings=True contradicts untie_embeddings_and_output_weights=True; "
                                 "pass only untie_embeddings_and_output_weights")
            self.untie_embeddings_and_output_weights = not self.tie_embeddings
        if self.recompute:
            if self.recompute_granularity not in (None, "full", RecomputeGranularity.FULL):
                raise ValueError(f"recompute=True (full) contradicts recompute_granularity="
                                 f"{self.recompute_granularity!r}; pass only recompute_granularity")
            self.recompute_granularity = RecomputeGranularity.FULL
        # Folded into the new fields: clearing them keeps dataclasses.replace() from
        # re-applying a stale legacy value over a changed new field.
        self.tie_embeddings, self.recompute = None, False

    def _check_sizes(self) -> None:
        for name in ("vocab_size", "seq_length", "num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} must be divisible by num_attention_heads="
                    f"{self.num_attention_heads}, or pass kv_channels (the width of one head)")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        elif self.kv_channels <= 0:
            raise ValueError(f"kv_channels={self.kv_channels} must be positive")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = megatron_swiglu_ffn_hidden_size(self.hidden_size) if self.swiglu \
                else 4 * self.hidden_size
            if self.ffn_hidden_size <= 0:
                raise ValueError(
                    f"swiglu's default ffn_hidden_size (2/3 * 4 * hidden rounded down to 64) is 0 for "
                    f"hidden_size={self.hidden_size}; pass ffn_hidden_size explicitly")
        elif self.ffn_hidden_size <= 0:
            raise ValueError(f"ffn_hidden_size={self.ffn_hidden_size} must be positive")

    def _check_recompute(self) -> None:
        if self.recompute_granularity is not RecomputeGranularity.FULL:
            if self.recompute_method is not None or self.recompute_num_layers is not None:
                raise ValueError(
                    f"recompute_method={self.recompute_method!r} / recompute_num_layers={self.recompute_num_layers!r} "
                    f"apply to recompute_granularity='full' only (got {self.recompute_granularity!r}); drop them")
            return
        if self.recompute_method is not None:
            self.recompute_method = RecomputeMethod.parse(self.recompute_method, arg_name="recompute_method")
        if self.recompute_num_layers is not None and not 1 <= self.recompute_num_layers <= self.num_layers:
            raise ValueError(f"recompute_num_layers={self.recompute_num_layers} must be between 1 and "
                             f"num_layers={self.num_layers}")

    def _check_attention(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups <= 0 or self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups={self.num_query_groups} must divide num_attention_heads="
                f"{self.num_attention_heads} (each key/value head serves a whole group of query heads)")
        if self.norm_epsilon <= 0:
            raise ValueError(f"norm_epsilon={self.norm_epsilon} must be positive")
        if self.attention_output_gate and self.multi_latent_attention:
            raise ValueError("attention_output_gate=True with multi_latent_attention: megatron-core has no output "
                             "gate for MLA (its MLATransformerConfig refuses it); drop one of the two")
        if self.rotary_interleaved and (self.multi_latent_attention
                                        or self.position_embedding_type is not PositionEmbeddingType.ROPE):
            raise ValueError("rotary_interleaved=True needs position_embedding_type='rope' and no multi-latent "
                             "attention (megatron-core refuses it with MLA); drop rotary_interleaved")
        if self.position_embedding_type is PositionEmbeddingType.ROPE and not self.multi_latent_attention:
            if not 0.0 < self.rotary_percent <= 1.0:
                raise ValueError(f"rotary_percent={self.rotary_percent} must be in (0, 1]")
            if self.rotary_dim % 2 or self.rotary_dim == 0:
                raise ValueError(
                    f"RoPE rotates pairs of channels: kv_channels={self.kv_channels} * rotary_percent="
                    f"{self.rotary_percent} gives {self.rotary_dim} channels; choose values that give an even, "
                    "non-zero number")
            if self.rotary_base <= 0:
                raise ValueError(f"rotary_base={self.rotary_base} must be positive")

    def _check_activation(self) -> None:
        if self.squared_relu and self.swiglu:
            raise ValueError("squared_relu=True and swiglu=True both choose the MLP's activation (Megatron-LM "
                             "asserts not both); keep one")

    def _check_regularisation(self) -> None:
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.init_method_std <= 0:
            raise ValueError(f"init_method_std={self.init_method_std} must be positive")

    def _check_moe(self) -> None:
        if self.num_moe_experts is None:
            return
        if self.num_moe_experts <= 0:
            raise ValueError(f"num_moe_experts={self.num_moe_experts} must be positive (or None for a dense model)")
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} must be between 1 and num_moe_experts="
                             f"{self.num_moe_experts}")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and (shared <= 0 or self.add_bias_linear):
            raise ValueError(f"moe_shared_expert_intermediate_size={shared} needs a positive size and "
                             "add_bias_linear=False (shared experts take no biases, as in Megatron-core; "
                             "pass --disable-bias-linear)")
        if self.moe_router_topk_scaling_factor is not None and self.moe_router_topk_scaling_factor <= 0:
            raise ValueError(f"moe_router_topk_scaling_factor={self.moe_router_topk_scaling_factor} must be positive")
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0")
        self._check_router()
        pattern = self.moe_layer_pattern
        if len(pattern) != self.num_layers or any(v not in (0, 1) for v in pattern):
            raise ValueError(f"moe_layer_freq={self.moe_layer_freq!r} must be a positive int or a list of "
                             f"{self.num_layers} zeros and ones (one per layer)")

    def _check_router(self) -> None:
        """megatron-core's router rules (TransformerConfig.__post_init__), plus settings the
        chosen routing would silently ignore."""
        experts, topk = self.num_moe_experts, self.moe_router_topk
        sigmoid = self.moe_router_score_function is ScoreFunction.SIGMOID
        if self.moe_router_enable_expert_bias and not sigmoid:
            raise ValueError("moe_router_enable_expert_bias needs moe_router_score_function='sigmoid' (megatron-core "
                             "adds the bias to sigmoid scores only); pass --moe-router-score-function sigmoid")
        if self.moe_router_bias_update_rate < 0:
            raise ValueError(f"moe_router_bias_update_rate={self.moe_router_bias_update_rate} must be >= 0")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups is not None and groups <= 0:
            raise ValueError(f"moe_router_num_groups={groups} must be positive")
        if group_topk is not None:
            if groups is None:
                raise ValueError(f"moe_router_group_topk={group_topk} needs moe_router_num_groups (how many groups "
                                 "the experts form); pass --moe-router-num-groups")
            if experts % groups:
                raise ValueError(f"num_moe_experts={experts} must be divisible by moe_router_num_groups={groups} "
                                 "(the groups are equal-sized)")
            if not 1 <= group_topk <= min(groups, topk):
                raise ValueError(
                    f"moe_router_group_topk={group_topk} must be between 1 and min(moe_router_num_groups={groups}, "
                    f"moe_router_topk={topk}): a group is scored by the sum of its top topk // group_topk experts")
            if group_topk * (experts // groups) < topk:
                raise ValueError(f"moe_router_group_topk={group_topk} groups of {experts // groups} experts hold fewer "
                                 f"than moe_router_topk={topk} experts; choose more groups per token")
        if self.moe_router_load_balancing_type is MoELoadBalancing.SINKHORN:
            ignored = [name for name, on in (
                ("moe_aux_loss_coeff", self.moe_aux_loss_coeff > 0), ("moe_router_score_function='sigmoid'", sigmoid),
                ("moe_router_pre_softmax", self.moe_router_pre_softmax),
                ("moe_router_topk_scaling_factor", self.moe_router_topk_scaling_factor is not None),
                ("moe_router_enable_expert_bias", self.moe_router_enable_expert_bias),
                ("moe_router_group_topk", group_topk is not None)) if on]
            if ignored:
                raise ValueError(f"moe_router_load_balancing_type='sinkhorn' takes no {', '.join(ignored)}: Sinkhorn "
                                 "routing has its own scores and no aux loss (megatron-core rejects an aux-loss "
                                 "coefficient and ignores the rest); drop them")
        elif topk == 1 and not sigmoid and not self.moe_router_pre_softmax:
            raise ValueError("moe_router_topk=1 with the softmax score function needs moe_router_pre_softmax: a "
                             "softmax over the single chosen logit is 1 with zero gradient (megatron-core refuses it "
                             "too); pass --moe-router-pre-softmax")

    def _check_mla(self) -> None:
        if self.rope_type is not None:
            self.rope_type = RopeType.parse(self.rope_type, arg_name="rope_type")
        if not self.multi_latent_attention:
            if self.rope_type is RopeType.YARN:
                raise ValueError("rope_type='yarn' needs multi_latent_attention=True (Megatron-LM: common attention "
                                 "only supports rope_type='rope'); drop rope_type or turn MLA on")
            return
        if self.rope_type is None:
            self.rope_type = RopeType.YARN  # megatron-core's MLATransformerConfig default
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError(f"num_query_groups={self.num_query_groups} with multi_latent_attention: MLA has one "
                             "key/value per query head (Megatron-LM refuses group-query attention with MLA); drop it")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                     "original_max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"q_lora_rank={self.q_lora_rank!r} must be a positive integer, or None for no "
                             "query compression")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent={self.rotary_percent} must be in (0, 1]")
        if self.mla_rotary_dim % 2 or self.mla_rotary_dim == 0:
            raise ValueError(f"MLA rotates pairs of channels: qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} "
                             f"(times rotary_percent={self.rotary_percent} with rope_type='rope') gives "
                             f"{self.mla_rotary_dim}; choose an even, non-zero number")
        if self.rotary_base <= 0 or self.rotary_scaling_factor <= 0:
            raise ValueError(f"rotary_base={self.rotary_base} and rotary_scaling_factor={self.rotary_scaling_factor} "
                             "must be positive")
        from .yarn import yarn_mscale  # one-way: yarn.py imports nothing from here

        for name in ("mscale", "mscale_all_dim"):
            if yarn_mscale(self.rotary_scaling_factor, getattr(self, name)) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} with rotary_scaling_factor="
                                 f"{self.rotary_scaling_factor} gives a YaRN scale 0.1 * {name} * ln(factor) + 1 "
                                 "<= 0; use a larger value")

    def _check_mtp(self) -> None:
        depths = self.mtp_num_layers
        if depths is None:
            return
        if not isinstance(depths, int) or isinstance(depths, bool) or depths <= 0:
            raise ValueError(f"mtp_num_layers={depths!r} must be a positive integer, or None for no multi-token "
                             "prediction")
        if not math.isfinite(self.mtp_loss_scaling_factor) or self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"mtp_loss_scaling_factor={self.mtp_loss_scaling_factor} must be a finite number >= 0")
        method, layers = self.recompute_plan
        if self.recompute_granularity is RecomputeGranularity.FULL and method is RecomputeMethod.UNIFORM \
                and layers != 1:
            # megatron-core checkpoints each MTP layer on its own and asserts this.
            raise ValueError(f"mtp_num_layers with uniform full recomputation needs recompute_num_layers=1 "
                             f"(got {layers}; megatron-core refuses MTP otherwise); pass --recompute-num-layers 1 "
                             "or --recompute-method block")

    # -- derived -------------------------------------------------------------------------
    @property
    def mla_rotary_dim(self) -> int:
        """Channels of MLA's positional part that turn: all of them with yarn (megatron-core's
        YaRN ignores rotary_percent), int(qk_pos_emb_head_dim * rotary_percent) with rope."""
        if self.rope_type is RopeType.ROPE and self.rotary_percent < 1.0:
            return int(self.qk_pos_emb_head_dim * self.rotary_percent)
        return self.qk_pos_emb_head_dim

    @property
    def recompute_plan(self) -> tuple[RecomputeMethod, int]:
        """(method, layers) of full recomputation, defaults applied: uniform, 1 layer."""
        return self.recompute_method or RecomputeMethod.UNIFORM, self.recompute_num_layers or 1

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (Megatron: int(kv_channels * rotary_percent))."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def moe_layer_pattern(self) -> list[int]:
        """1 for each MoE layer, 0 for each dense layer."""
        if self.num_moe_experts is None:
            return [0] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            if freq <= 0:
                return []  # rejected by _check_moe
            return [1 if i % freq == 0 else 0 for i in range(self.num_layers)]
        return list(freq)

    def is_moe_layer(self, layer_number: int) -> bool:
        return bool(self.moe_layer_pattern[layer_number])
