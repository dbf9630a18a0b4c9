"""Tiny ``transformers`` models of the families this package reads and writes, built locally
(no hub access): a few thousand parameters, fp32, attention on CPU.

- ``tiny_hf_config(family, *, tied=False, **overrides)``: the family's ``PretrainedConfig``.
- ``tiny_hf_model(family, *, seed=0, tied=False, **overrides)``: its ``*ForCausalLM`` with
  weights drawn under ``seed`` (norm weights and biases randomised too, so a checkpoint
  round trip that dropped or swapped one of them shows in the logits).
- ``decoder_layer_class(model)``: the family's decoder-layer class (the natural FSDP unit).

Families: ``FAMILIES`` = llama, mistral, qwen2, qwen3, mixtral, gpt2. Sizes: hidden 32,
2 layers, 4 query heads, 2 key/value heads where the family has group-query attention,
vocabulary 96, sequences up to 64 tokens.
"""

from __future__ import annotations

import importlib

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "gpt2")

_CLASSES = {
    # family: (module, config class, causal-LM class, decoder-layer class)
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", "LlamaDecoderLayer"),
    "mistral": ("mistral", "MistralConfig", "MistralForCausalLM", "MistralDecoderLayer"),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "Qwen2DecoderLayer"),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3DecoderLayer"),
    "mixtral": ("mixtral", "MixtralConfig", "MixtralForCausalLM", "MixtralDecoderLayer"),
    "gpt2": ("gpt2", "GPT2Config", "GPT2LMHeadModel", "GPT2Block"),
}

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, MAX_POSITIONS = 32, 2, 4, 2, 96, 64


def _module(family: str):
    if family not in _CLASSES:
        raise ValueError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    return importlib.import_module(f"transformers.models.{_CLASSES[family][0]}.modeling_{_CLASSES[family][0]}")


def _family_kwargs(family: str) -> dict:
    """The family's tiny sizes, in its own config's field names."""
    if family == "gpt2":
        return dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS, vocab_size=VOCAB,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    kwargs = dict(hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS,
                  rms_norm_eps=1e-6, attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    if family in ("mistral", "mixtral", "qwen2", "qwen3"):
        kwargs["sliding_window"] = None  # full attention: the embedded GPT has no sliding window
    if family == "qwen3":
        kwargs["head_dim"] = 16  # Qwen3 states its head width; wider than hidden / heads here
    if family == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    return kwargs


def tiny_hf_config(family: str, *, tied: bool = False, **overrides):
    """The family's tiny config; ``tied``: the output layer shares the embedding matrix
    (GPT-2 always ties). ``overrides`` are the family's own config fields."""
    config_cls = getattr(_module(family), _CLASSES[family][1], None)
    if config_cls is None:  # configs live in configuration_<family>.py
        config_cls = getattr(importlib.import_module(
            f"transformers.models.{family}.configuration_{family}"), _CLASSES[family][1])
    kwargs = _family_kwargs(family)
    kwargs["tie_word_embeddings"] = True if family == "gpt2" else tied
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"  # exact, and available everywhere
    return config


def tiny_hf_model(family: str, *, seed: int = 0, tied: bool = False, **overrides):
    """The family's ``*ForCausalLM`` in fp32, eval mode, every parameter drawn under ``seed``:
    matrices ~ N(0, 0.02) as transformers initialises them, then norm weights ~ 1 + N(0, 0.1)
    and biases ~ N(0, 0.1) so that each of them matters in the logits."""
    config = tiny_hf_config(family, tied=tied, **overrides)
    model_cls = getattr(_module(family), _CLASSES[family][2])
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() == 1 and name.endswith("weight"):  # norm scales
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.02 * noise)
    return model


def decoder_layer_class(model) -> type:
    """The decoder-layer class of ``model``'s family (``LlamaDecoderLayer`` ... ``GPT2Block``)."""
    model_type = model.config.model_type
    if model_type not in _CLASSES:
        raise ValueError(f"model_type={model_type!r} is not one of {', '.join(FAMILIES)}")
    return getattr(_module(model_type), _CLASSES[model_type][3])


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """model(tokens).logits (b, t, vocab) with no cache, under no_grad."""
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits
