"""Where each tensor of the embedded GPT lives in a megatron-core ``torch_dist`` checkpoint.

[Note: megatron-core's stacked keys] megatron-core 0.16's ``GPTModel.sharded_state_dict()``
does not key a decoder layer's tensors per layer: every layer's ``linear_qkv.weight`` is one
slice of a single global tensor ``decoder.layers.self_attention.linear_qkv.weight`` whose
leading axis is the layer (shape ``(num_layers, 3 * hidden, hidden)`` for a GPT-2 block).
An expert's tensors get a second leading axis, the expert:
``decoder.layers.mlp.experts.experts.linear_fc1.weight`` has shape ``(num_layers,
num_experts, rows, cols)``. Embeddings, the final norm and the output layer keep their own
shapes. So our ``blocks.<i>.<rest>`` becomes one key plus leading indices ``(i,)`` (and
``(i, e)`` for expert ``e``), which ``McoreTarget`` records.

[Note: layer specs and norm names] Which module owns a layer's norms depends on the layer
spec. TransformerEngine's spec (Megatron-LM's default ``--transformer-impl
transformer_engine``) fuses the input norm into ``linear_qkv`` and, in dense layers, the
pre-MLP norm into ``mlp.linear_fc1`` (``...linear_qkv.layer_norm_weight``); an MoE layer
keeps a separate ``pre_mlp_layernorm``. The local spec (``--transformer-impl local``) maps
both norms to the fused names in every layer, MoE layers included, so its checkpoints load
into TransformerEngine models. ``spec="te"`` and ``spec="local"`` write what each writes;
they differ only in an MoE layer's pre-MLP norm and in TransformerEngine's attention extra
state (``core_attention._extra_state``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..models import GPTConfig
from ..models.config import PositionEmbeddingType
from ..models.mcore import _grouped_qkv, _mcore_name

SPECS = ("te", "local")
_WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_LAYERS = "decoder.layers."
_MCORE_ROOTS = frozenset({"embedding", "decoder", "output_layer"})  # megatron-core GPTModel's top-level modules
_EXPERT = "mlp.experts.local_experts."
_FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# The linear modules whose (empty) extra state megatron-core checkpoints per layer.
_LAYER_EXTRA_STATES = ("self_attention.linear_qkv", "self_attention.linear_proj")
_DENSE_EXTRA_STATES = ("mlp.linear_fc1", "mlp.linear_fc2")
_SHARED_EXTRA_STATES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
_EXPERT_EXTRA_STATES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")


@dataclasses.dataclass(frozen=True)
class McoreTarget:
    """One of our tensors in the checkpoint: ``key`` holds it at leading indices ``index``
    (the layer, then the expert) of a global tensor whose leading axes have sizes ``counts``."""

    key: str
    index: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    grouped_qkv: bool = False
    """Rows reordered to megatron-core's per-group QKV layout (``models.mcore._grouped_qkv``)."""


def check_spec(spec: str) -> str:
    if spec not in SPECS:
        raise ValueError(f"spec={spec!r} is not one of {', '.join(SPECS)}; use 'te' for Megatron-LM's default "
                         "--transformer-impl transformer_engine, 'local' for --transformer-impl local")
    return spec


def check_supported(cfg: GPTConfig) -> None:
    """Refuse what this map does not cover, before anything is read or written."""
    if cfg.mtp_num_layers:
        raise ValueError(f"mtp_num_layers={cfg.mtp_num_layers}: multi-token prediction layers are not mapped to "
                         "megatron-core's torch_dist keys; save the model without MTP layers or use the "
                         "fsdp_dtensor format")
    if cfg.multi_latent_attention:
        raise ValueError("multi_latent_attention=True: MLA layers are not mapped to megatron-core's torch_dist keys; "
                         "use the fsdp_dtensor format")


def our_name(key: str) -> str:
    """A state-dict key of our GPT without the segments wrappers add (``module.``, ...)."""
    parts = key.split(".")
    while parts and parts[0] in _WRAPPER_SEGMENTS:
        parts = parts[1:]
    return ".".join(p for p in parts if p != "_checkpoint_wrapped_module")


def _is_moe_layer(cfg: GPTConfig, layer: int) -> bool:
    return cfg.num_moe_experts is not None and bool(cfg.moe_layer_pattern[layer])


def _layer_rest(rest: str, *, moe_layer: bool, spec: str) -> str:
    for ours, fused in _FUSED_NORMS.items():
        if rest.startswith(ours) and not (spec == "te" and moe_layer and ours == "pre_mlp_layernorm."):
            return fused + rest[len(ours):]
    return rest


def mcore_target(name: str, cfg: GPTConfig, spec: str) -> Optional[McoreTarget]:
    """Where our tensor ``name`` (wrapper segments stripped) goes; ``None`` for a tensor
    megatron-core does not store (a tied output layer, an unused position table). A name of
    megatron-core's GPTModel itself (``decoder.layers.<i>...``: a wrapped ``--use-mcore-models``
    model) is already in its layout and only gets stacked."""
    if name in ("lm_head.weight", "output_layer.weight") and not cfg.untie_embeddings_and_output_weights:
        return None  # megatron-core shares the embedding
    learned = cfg.position_embedding_type is PositionEmbeddingType.LEARNED_ABSOLUTE
    if name in ("wpe.weight", "embedding.position_embeddings.weight") and not learned:
        return None
    mcore_model = name.split(".", 1)[0] in _MCORE_ROOTS  # megatron-core's GPTModel, its own names and layout
    full = name if mcore_model else _mcore_name(name)  # decoder.layers.<i>.<rest> for a layer's tensor
    if not full.startswith(_LAYERS):
        return McoreTarget(full)
    layer_text, rest = full[len(_LAYERS):].split(".", 1)
    layer = int(layer_text)
    if rest.startswith(_EXPERT):
        expert_text, leaf = rest[len(_EXPERT):].split(".", 1)
        return McoreTarget(f"{_LAYERS}mlp.experts.experts.{leaf}", (layer, int(expert_text)),
                           (cfg.num_layers, cfg.num_moe_experts))
    rest = _layer_rest(rest, moe_layer=_is_moe_layer(cfg, layer), spec=spec)
    grouped = not mcore_model and ".attn.qkv." in name
    return McoreTarget(_LAYERS + rest, (layer,), (cfg.num_layers,), grouped_qkv=grouped)


def qkv_source_rows(rows: int, cfg: GPTConfig) -> torch.Tensor:
    """``src`` with megatron-core's fused QKV row ``j`` = our row ``src[j]``: (rows,) int64."""
    return _grouped_qkv(torch.arange(rows), cfg)


@dataclasses.dataclass(frozen=True)
class ExtraStateObject:
    """An (empty) module extra state megatron-core's model checkpoints as a ``ShardedObject``:
    ``key`` at ``offset`` of a grid of ``shape`` (one per layer, or per layer and expert)."""

    key: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]


def extra_state_objects(cfg: GPTConfig, spec: str) -> list[ExtraStateObject]:
    """The extra-state objects megatron-core's GPTModel (``spec``) checkpoints: a model
    built from that spec asks for them on load."""
    layers = cfg.num_layers
    modules = list(_LAYER_EXTRA_STATES) + (["self_attention.core_attention"] if spec == "te" else [])
    out = [ExtraStateObject(f"{_LAYERS}{m}._extra_state", (layers,), (i,)) for m in modules for i in range(layers)]
    for i in range(layers):
        if _is_moe_layer(cfg, i):
            if cfg.moe_shared_expert_intermediate_size:
                out += [ExtraStateObject(f"{_LAYERS}{m}._extra_state", (layers,), (i,)) for m in _SHARED_EXTRA_STATES]
            out += [ExtraStateObject(f"{_LAYERS}{m}._extra_state", (layers, cfg.num_moe_experts), (i, e))
                    for m in _EXPERT_EXTRA_STATES for e in range(cfg.num_moe_experts)]
        else:
            out += [ExtraStateObject(f"{_LAYERS}{m}._extra_state", (layers,), (i,)) for m in _DENSE_EXTRA_STATES]
    return out


def check_mcore_experts(names: list[str], cfg: GPTConfig) -> None:
    """Refuse megatron-core's own MoE model split over expert-parallel ranks: its
    ``local_experts.<j>`` counts from 0 on every rank, so the names alone do not say which
    global expert a tensor is (our embedded GPT keys experts by their global index)."""
    seen: dict[str, set[str]] = {}
    for name in names:
        if name.startswith(_LAYERS) and ".mlp.experts.local_experts." in name:
            layer, rest = name[len(_LAYERS):].split(".", 1)
            seen.setdefault(layer, set()).add(rest[len(_EXPERT):].split(".", 1)[0])
    short = {layer: len(experts) for layer, experts in seen.items() if len(experts) < (cfg.num_moe_experts or 0)}
    if short:
        raise ValueError(f"megatron-core's MoE layers hold {sorted(set(short.values()))} of "
                         f"{cfg.num_moe_experts} experts on this rank (expert parallelism): their local expert "
                         "numbers do not name global experts. Save or load at expert-parallel size 1, or use the "
                         "embedded GPT (which keys experts globally)")
