"""How a global batch is cut into micro batches, and what a data source must offer.

[Note: stateless data position] A sample is a pure function of its global index
(and the seed), so the whole data position is ``consumed_samples``: resuming from
a checkpoint only needs that number, and every data-parallel layout (FSDP or DDP,
any world size) sees the same global batch. Each micro batch of the global batch is
laid out like Megatron-LM's pretraining sampler: micro batch ``m`` of data-parallel
rank ``r`` holds global samples ``consumed + m*mbs*dp + r*mbs + [0, mbs)``.

[Note: context-parallel batches] With context parallelism every CP rank of a
data-parallel rank reads that rank's micro batch (the same samples, as its TP ranks do)
and keeps its CP shard of the inputs and of the targets: of 2 x CP equal chunks of each
sequence, chunks ``cp_rank`` and ``2 x CP - 1 - cp_rank`` (Megatron-LM's
``get_batch_on_this_cp_rank``, ``models.context_parallel.context_parallel_shard``). The
targets are cut after the shift by one, so each kept input token keeps its own next token.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from megatron_fsdp.comm import device as device_mod
from megatron_fsdp.models.context_parallel import context_parallel_shard


class SampleSource(Protocol):
    def __len__(self) -> int: ...

    def sample(self, index: int) -> torch.Tensor:
        """Tokens of global sample ``index`` (any non-negative int): int64, shape (seq_length + 1,)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How a global batch is cut into micro batches across data-parallel ranks."""

    micro_batch_size: int
    num_microbatches: int
    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    """Which chunks of each sequence this rank keeps (see [Note: context-parallel batches])."""
    cp_size: int = 1

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp_size

    def sample_indices(self, consumed_samples: int, microbatch: int) -> range:
        """Global sample indices of this rank's micro batch (see [Note: stateless data position])."""
        start = consumed_samples + (microbatch * self.dp_size + self.dp_rank) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)


def get_microbatch(source: SampleSource, layout: BatchLayout, consumed_samples: int, microbatch: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (micro_batch_size, seq_length / cp_size) int64 on ``device``:
    this rank's CP shard of its data-parallel rank's micro batch."""
    tokens = torch.stack([source.sample(i) for i in layout.sample_indices(consumed_samples, microbatch)])
    tokens = device_mod.host_to_device(tokens, device)  # (mbs, seq_length + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (mbs, seq_length) each
    if layout.cp_size > 1:
        inputs = context_parallel_shard(inputs, layout.cp_rank, layout.cp_size, seq_dim=1)
        targets = context_parallel_shard(targets, layout.cp_rank, layout.cp_size, seq_dim=1)
    return inputs, targets
