"""What the megatron-core parity tests share: the device megatron-core builds on, and
our GPT with the token batch both models see."""

from __future__ import annotations

import torch

from megatron_fsdp.models import GPT, GPTConfig

# The parity tests' sizes: a small GPT, and the Llama-style architecture flags.
SEQ, VOCAB = 16, 64
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB)
LLAMA = dict(swiglu=True, ffn_hidden_size=40, normalization="RMSNorm", position_embedding_type="rope",
             num_query_groups=2, untie_embeddings_and_output_weights=True, add_bias_linear=False)


def mcore_device() -> torch.device:
    """megatron-core builds on the current CUDA device where there is one (the CPU shim
    stands in for it elsewhere): our model and the inputs follow it there."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def ours_and_tokens(cfg: GPTConfig, *, seq: int, vocab: int, device: torch.device):
    """(our GPT seeded with 0, inputs, targets, position ids): a (2, seq) batch."""
    torch.manual_seed(0)
    ours = GPT(cfg).to(device)
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq, device=device).unsqueeze(0).expand_as(inputs)
    return ours, inputs, targets, positions
