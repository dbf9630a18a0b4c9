"""Reference models that ship with the package (used by the scripts, the benchmark and tests).

``GPT`` covers the GPT-2/3 and Llama families Megatron-LM's model flags describe
(``GPTConfig``), dense or mixture-of-experts; ``presets`` names configurations of
record (Llama-3-8B, GPT-3 sizes, tiny CPU versions); ``mcore`` builds
megatron-core's ``GPTModel`` from the same configuration.
"""

from .config import (
    GPTConfig,
    Normalization,
    PositionEmbeddingType,
    RecomputeGranularity,
    RecomputeMethod,
    RopeType,
    RouterDtype,
    vocab_size_with_padding,
)
from .gpt import GPT, gpt_loss
from .moe import MoELayer, expert_device_mesh, has_expert_parameters
from .transformer import TransformerBlock

__all__ = [
    "GPT",
    "GPTConfig",
    "MoELayer",
    "Normalization",
    "PositionEmbeddingType",
    "RecomputeGranularity",
    "RecomputeMethod",
    "RopeType",
    "RouterDtype",
    "TransformerBlock",
    "expert_device_mesh",
    "gpt_loss",
    "has_expert_parameters",
    "vocab_size_with_padding",
]
