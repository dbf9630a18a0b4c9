"""Temporary (unsharded) bucket memory and the package's buffer accounting.

Temporary buckets are released by resizing their storage to zero rather than by
dropping the tensor: parameters and autograd's saved tensors keep *views* of a
weight bucket, and a view stays valid across a release/re-allocate cycle as long
as the tensor object (and its storage object) survive. On CUDA the resize returns
the block to the caching allocator at once instead of whenever Python drops the
last reference.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch


@dataclasses.dataclass
class BufferAccounting:
    """Bytes held by the package's buffers.

    ``persistent`` is by category (``model_weights``, ``main_weights``, ``main_grads``);
    ``temporary`` counts unsharded buckets alive right now and ``peak_temporary`` the
    most that were alive at once. Tests and the benchmark read these numbers.
    """

    persistent: Counter = dataclasses.field(default_factory=Counter)
    temporary: int = 0
    peak_temporary: int = 0
    temporary_allocations: int = 0

    def add_persistent(self, category: str, nbytes: int) -> None:
        self.persistent[category] += nbytes

    def on_alloc(self, nbytes: int) -> None:
        self.temporary += nbytes
        self.temporary_allocations += 1
        self.peak_temporary = max(self.peak_temporary, self.temporary)

    def on_free(self, nbytes: int) -> None:
        self.temporary -= nbytes
        assert self.temporary >= 0, "temporary bucket accounting went negative"

    def reset_peak(self) -> None:
        self.peak_temporary = self.temporary

    @property
    def total_persistent(self) -> int:
        return sum(self.persistent.values())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


class StorageResizeAllocator:
    """Allocates and releases temporary buckets by storage resize, with accounting."""

    def __init__(self, accounting: BufferAccounting) -> None:
        self.accounting = accounting

    def empty_unallocated(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of the right shape whose storage holds nothing yet."""
        tensor = torch.empty(numel, dtype=dtype, device=device)
        tensor.untyped_storage().resize_(0)
        return tensor

    def allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        """Give ``tensor`` (made by ``empty_unallocated``) its storage back."""
        if not is_allocated(tensor):
            tensor.untyped_storage().resize_(_nbytes(tensor))
            self.accounting.on_alloc(_nbytes(tensor))
        return tensor

    def new(self, numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
        """A fresh temporary bucket; hand it back with ``release``."""
        tensor = torch.zeros(numel, dtype=dtype, device=device) if zero else torch.empty(numel, dtype=dtype, device=device)
        self.accounting.on_alloc(_nbytes(tensor))
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        if is_allocated(tensor):
            self.accounting.on_free(_nbytes(tensor))
            tensor.untyped_storage().resize_(0)
