"""The byte-level data the launcher used before indexed datasets: the text corpus
that ships in ``data/`` cut into fixed windows (one token per byte, vocabulary 256),
and the generated sequences of the legacy ``--mock-data``. Samples follow
[Note: stateless data position] in ``batching.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

# megatron_fsdp/training/data/byte_corpus.py -> the repository root
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEFAULT_CORPUS = os.path.join(REPO_ROOT, "data", "corpus.txt")
# A large odd multiplier keeps per-sample generator seeds of neighbouring samples apart.
_SEED_STRIDE = 1_000_003


def load_corpus_tokens(paths: Sequence[str] | None) -> torch.Tensor:
    """Bytes of the text files as int64 tokens (vocabulary 256), files joined by a blank line."""
    paths = list(paths) if paths else [DEFAULT_CORPUS]
    if not os.path.isfile(paths[0]):
        raise FileNotFoundError(
            f"corpus file {paths[0]!r} is missing; restore data/corpus.txt from git, pass --data-path FILE.txt, "
            "or use --mock-data"
        )
    chunks = []
    for path in paths:
        with open(path, "rb") as f:
            chunks.append(f.read())
    raw = b"\n\n".join(chunks)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def split_windows(num_tokens: int, seq_length: int, weights: Sequence[float]) -> list[range]:
    """Window indices of the train / valid / test splits, contiguous in text order.

    Window ``i`` covers tokens ``[i*seq, (i+1)*seq + 1)``: inputs and shifted targets.
    """
    windows = max(0, (num_tokens - 1) // seq_length)
    weights = list(weights) + [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + round(windows * w / total))
    bounds[-1] = windows
    return [range(bounds[i], bounds[i + 1]) for i in range(3)]


class TextDataset:
    """Fixed-length windows of a token stream, reshuffled every epoch with a seeded permutation."""

    def __init__(self, tokens: torch.Tensor, windows: range, seq_length: int, seed: int) -> None:
        if len(windows) == 0:
            raise ValueError(
                f"the corpus split has no windows of {seq_length + 1} tokens; use a larger corpus, "
                "a shorter --seq-length or other --split weights"
            )
        self.tokens = tokens
        self.windows = windows
        self.seq_length = seq_length
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.windows)

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + epoch)
            self._perms = {epoch: torch.randperm(len(self.windows), generator=gen)}  # keep one epoch cached
        return self._perms[epoch]

    def sample(self, index: int) -> torch.Tensor:
        epoch, offset = divmod(index, len(self.windows))
        window = self.windows[int(self._perm(epoch)[offset])]
        start = window * self.seq_length
        return self.tokens[start : start + self.seq_length + 1]


class MockDataset:
    """Generated sequences ``(a + b*t) mod vocab`` with per-sample random ``a, b``:
    learnable in context, so the loss falls, yet no file is needed."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, *, offset: int = 0, size: int = 1 << 30) -> None:
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.offset = offset  # validation samples live far from training ones
        self.size = size

    def __len__(self) -> int:
        return self.size

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + self.offset + index)
        start, stride = torch.randint(0, self.vocab_size, (2,), generator=gen).tolist()
        stride = stride % 16 + 1  # small strides keep the pattern easy to pick up
        return (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size
