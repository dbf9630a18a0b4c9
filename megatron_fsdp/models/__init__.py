"""Reference models that ship with the package (used by the scripts, the benchmark and tests).

``GPT`` covers the GPT-2/3 and Llama families Megatron-LM's model flags describe
(``GPTConfig``), dense or mixture-of-experts; ``presets`` names configurations of
record (Llama-3-8B, GPT-3 sizes, tiny CPU versions); ``mcore`` builds
megatron-core's ``GPTModel`` from the same configuration.

Modules, one concern each:

- ``config.py``: ``GPTConfig`` and its enums (normalisation, position embedding, routing,
  recompute), vocabulary padding.
- ``layers.py``: leaf layers: initialised linears and embeddings, norms.
- ``rope.py``, ``yarn.py``: rotary position embeddings in megatron-core's two layouts; YaRN.
- ``mla.py``: multi-latent attention (DeepSeek-V2/V3).
- ``transformer.py``: self-attention and the transformer block (the FSDP unit).
- ``moe.py``: mixture-of-experts layers (experts, shared expert, expert mesh).
- ``router.py``: MoE routing: gating, top-k, load-balancing losses.
- ``forced_routing.py``: ``--moe-router-force-load-balancing``'s forced routing.
- ``mtp.py``: multi-token prediction (DeepSeek-V3's MTP).
- ``losses.py``: Megatron's language-model cross-entropy; side losses attached to the graph.
- ``gpt.py``: ``GPT`` and ``gpt_loss``.
- ``tensor_parallel.py``: ``apply_tensor_parallel``, the GPT's tensor-parallel plan (PyTorch DTensor
  styles, torchtitan's order), applied before FSDP wrapping.
- ``context_parallel.py``: ``apply_context_parallel``, Megatron-LM's load-balanced sequence split, the
  K/V all-gather exchange of each attention layer and Megatron-LM's context-parallel loss.
- ``expert_parallel.py``: ``apply_expert_parallel`` (each EP rank keeps its block of experts under
  their global names; tokens exchanged all-to-all, Megatron's dispatcher), ``set_expert_capacity``
  (token dropping).
- ``presets.py``: named configurations of record.
- ``mcore.py``: megatron-core's ``GPTModel`` from a ``GPTConfig`` and our weights in its layout;
  ``mcore_mla.py`` and ``mcore_mtp.py`` its MLA and MTP parts; ``mcore_specs.py`` the
  layer-spec and MTP helpers the three share.
"""

from .config import (
    GPTConfig,
    MoELoadBalancing,
    Normalization,
    PositionEmbeddingType,
    RecomputeGranularity,
    RecomputeMethod,
    RopeType,
    RouterDtype,
    ScoreFunction,
    vocab_size_with_padding,
)
from .gpt import GPT, gpt_loss
from .moe import MoELayer, expert_device_mesh, has_expert_parameters
from .router import finish_global_batch
from .transformer import TransformerBlock

__all__ = [
    "GPT",
    "GPTConfig",
    "MoELayer",
    "MoELoadBalancing",
    "Normalization",
    "PositionEmbeddingType",
    "RecomputeGranularity",
    "RecomputeMethod",
    "RopeType",
    "RouterDtype",
    "ScoreFunction",
    "TransformerBlock",
    "expert_device_mesh",
    "finish_global_batch",
    "gpt_loss",
    "has_expert_parameters",
    "vocab_size_with_padding",
]
