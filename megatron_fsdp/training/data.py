"""Deterministic training data: the byte-tokenized text corpus that ships in
``data/`` (or the user's text files), or generated ``--mock-data``.

[Note: stateless data position] A sample is a pure function of its global index
(and the seed), so the whole data position is ``consumed_samples``: resuming from
a checkpoint only needs that number, and every data-parallel layout (FSDP or DDP,
any world size) sees the same global batch. Each micro batch of the global batch is
laid out like Megatron-LM's pretraining sampler: micro batch ``m`` of data-parallel
rank ``r`` holds global samples ``consumed + m*mbs*dp + r*mbs + [0, mbs)``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Protocol, Sequence

import torch

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CORPUS = os.path.join(REPO_ROOT, "data", "corpus.txt")
# A large odd multiplier keeps per-sample generator seeds of neighbouring samples apart.
_SEED_STRIDE = 1_000_003


class SampleSource(Protocol):
    def __len__(self) -> int: ...

    def sample(self, index: int) -> torch.Tensor:
        """Tokens of global sample ``index`` (any non-negative int): int64, shape (seq_length + 1,)."""


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How a global batch is cut into micro batches across data-parallel ranks."""

    micro_batch_size: int
    num_microbatches: int
    dp_rank: int
    dp_size: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp_size

    def sample_indices(self, consumed_samples: int, microbatch: int) -> range:
        """Global sample indices of this rank's micro batch (see [Note: stateless data position])."""
        start = consumed_samples + (microbatch * self.dp_size + self.dp_rank) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)


def get_microbatch(source: SampleSource, layout: BatchLayout, consumed_samples: int, microbatch: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (micro_batch_size, seq_length) int64 on ``device``."""
    tokens = torch.stack([source.sample(i) for i in layout.sample_indices(consumed_samples, microbatch)])
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def build_datasets(args) -> tuple[SampleSource, SampleSource | None]:
    """(train, valid) sources for the parsed flags; valid is None when the split has none."""
    if args.mock_data:
        train = MockDataset(args.vocab_size, args.seq_length, args.seed)
        valid = MockDataset(args.vocab_size, args.seq_length, args.seed, offset=1 << 40)
        return train, valid
    tokens = load_corpus_tokens(args.data_path)
    weights = [float(w) for w in args.split.replace(" ", "").split(",")]
    train_w, valid_w, _ = split_windows(tokens.numel(), args.seq_length, weights)
    train = TextDataset(tokens, train_w, args.seq_length, args.seed)
    valid = TextDataset(tokens, valid_w, args.seq_length, args.seed + 1) if len(valid_w) else None
    if valid is None and args.eval_iters > 0:
        logger.warning("the validation split of --split %s is empty; evaluation is skipped", args.split)
    return train, valid
