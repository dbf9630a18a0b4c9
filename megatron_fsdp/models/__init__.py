"""Reference models that ship with the package (used by the scripts, the benchmark and tests).

``GPT`` covers the GPT-2/3 and Llama families Megatron-LM's model flags describe
(``GPTConfig``), dense or mixture-of-experts; ``presets`` names configurations of
record (Llama-3-8B, GPT-3 sizes, tiny CPU versions); ``mcore`` builds
megatron-core's ``GPTModel`` from the same configuration.
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
