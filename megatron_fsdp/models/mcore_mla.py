"""megatron-core's multi-latent attention for ``build_mcore_gpt`` (``--use-mcore-models
--multi-latent-attention``). Imported by ``mcore.py`` only for an MLA config, so it
may import megatron-core at the top.

[Note: MLA on megatron-core's local spec] megatron-core 0.16.1's local layer spec with
``multi_latent_attention=True`` cannot be built as shipped: ``MLASelfAttention`` hands
its core attention ``k_channels`` / ``v_channels`` (the query/key and value widths,
which TransformerEngine's ``TEDotProductAttention`` takes), and the local
``DotProductAttention`` has no such parameters ("unexpected keyword argument
'k_channels'"). ``MLADotProductAttention`` takes the spec's place: it accepts the two
widths and is otherwise megatron-core's ``DotProductAttention`` unchanged. That
attention reads widths from the tensors it is given except for its output, shaped
kv_channels * heads, so the config's ``kv_channels`` is set to ``v_head_dim`` (MLA reads
kv_channels nowhere else; Megatron-LM's TransformerEngine path ignores it).

[Note: MLA without TransformerEngine] Nor can megatron-core 0.16.1 build MLA at all
when TransformerEngine is not installed: its TE extension module then stands
``unittest.mock.MagicMock`` objects in for TE's classes, ``multi_latent_attention``
imports them without an ImportError and so sets its ``HAVE_TE`` True, and
``isinstance(self.linear_proj, TELinear)`` raises TypeError. ``require_buildable_mla``
says so up front. (The tests set that module's ``HAVE_TE`` to the False it means,
inside their CPU shim.)
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer import MLATransformerConfig
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention

from .config import GPTConfig
from .mcore_specs import swap_in_spec


class MLADotProductAttention(DotProductAttention):
    """[Note: MLA on megatron-core's local spec]: megatron-core's local attention core
    with the ``k_channels`` / ``v_channels`` arguments MLA passes."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.hidden_size_per_attention_head:
            raise ValueError(f"v_channels={v_channels} but this attention shapes its output as kv_channels="
                             f"{self.hidden_size_per_attention_head} per head; build the config with "
                             "kv_channels = v_head_dim (mla_transformer_config does)")


def require_buildable_mla() -> None:
    """Raise where megatron-core's MLA cannot be built ([Note: MLA without TransformerEngine])."""
    if multi_latent_attention.HAVE_TE and not isinstance(multi_latent_attention.TELinear, type):
        raise RuntimeError(
            "megatron-core's multi-latent attention cannot be built without TransformerEngine: megatron-core 0.16.1 "
            "then takes its TE placeholders for TE classes and fails in MLASelfAttention (isinstance TypeError). "
            "Install transformer_engine, or drop --use-mcore-models (the embedded GPT's MLA computes the same)")


def with_mla_core_attention(spec):
    """``spec`` (a megatron-core ModuleSpec / submodules tree) with ``DotProductAttention``
    replaced by ``MLADotProductAttention``; copies, never edits, megatron-core's objects."""
    require_buildable_mla()
    return swap_in_spec(spec, lambda leaf: MLADotProductAttention if leaf is DotProductAttention else None)


def mla_transformer_config(config, cfg: GPTConfig, changes: dict) -> MLATransformerConfig:
    """What Megatron-LM builds for ``--multi-latent-attention``: an ``MLATransformerConfig``
    with ``config``'s fields, ``changes`` and MLA's own (from ``cfg``), kv_channels =
    v_head_dim ([Note: MLA on megatron-core's local spec])."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields.update(changes)
    fields.update(
        multi_latent_attention=True, kv_channels=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
        v_head_dim=cfg.v_head_dim, rope_type=cfg.rope_type.value, rotary_base=cfg.rotary_base,
        rotary_percent=cfg.rotary_percent, rotary_scaling_factor=cfg.rotary_scaling_factor, mscale=cfg.mscale,
        mscale_all_dim=cfg.mscale_all_dim, original_max_position_embeddings=cfg.original_max_position_embeddings,
        beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow,
    )
    return MLATransformerConfig(**fields)
