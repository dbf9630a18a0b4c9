"""Reference models that ship with the package (used by the scripts, the benchmark and tests)."""

from .gpt import GPT, GPTConfig, TransformerBlock

__all__ = ["GPT", "GPTConfig", "TransformerBlock"]
