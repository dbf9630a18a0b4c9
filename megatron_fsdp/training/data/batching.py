"""How a global batch is cut into micro batches, and what a data source must offer.

[Note: stateless data position] A sample is a pure function of its global index
(and the seed), so the whole data position is ``consumed_samples``: resuming from
a checkpoint only needs that number, and every data-parallel layout (FSDP or DDP,
any world size) sees the same global batch. Each micro batch of the global batch is
laid out like Megatron-LM's pretraining sampler: micro batch ``m`` of data-parallel
rank ``r`` holds global samples ``consumed + m*mbs*dp + r*mbs + [0, mbs)``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from megatron_fsdp.comm import device as device_mod


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
    tokens = device_mod.host_to_device(tokens, device)
    return tokens[:, :-1], tokens[:, 1:]
