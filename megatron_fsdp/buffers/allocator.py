"""Temporary (unsharded) bucket memory and the package's buffer accounting.

Two allocators, chosen by ``fsdp_double_buffer``:

* ``StorageResizeAllocator`` (default): temporary buckets are released by
  resizing their storage to zero rather than by dropping the tensor: parameters
  and autograd's saved tensors keep *views* of a weight bucket, and a view stays
  valid across a release/re-allocate cycle as long as the tensor object (and its
  storage object) survive. On CUDA the resize returns the block to the caching
  allocator at once instead of whenever Python drops the last reference. Memory
  is held only while used, but every use allocates afresh (on the CPU, large
  blocks come back from the kernel as zero-filled pages, every step).
* ``BufferPool`` (``fsdp_double_buffer=True``): memory is allocated once and
  reused every step. Unit weight buckets live in fixed *slots* (units.slot_plan:
  neighbouring units alternate between ``prefetch_depth + 1`` slots, two by
  default: a double buffer), enough for the unit computing and the ones
  prefetched. Gradient buckets are kept on release and handed out again for the
  same size. Nothing grows after the first step; the price is that pooled bytes
  stay held between uses.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from typing import Optional

import torch

from ..comm.release_after_wait import check_release


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
        check_release(tensor)
        if is_allocated(tensor):
            self.accounting.on_free(_nbytes(tensor))
            tensor.untyped_storage().resize_(0)


class SlotConflictError(NotImplementedError):
    """A unit needed a weight slot that another unit still held: a schedule the pooled
    buckets cannot serve (a NotImplementedError, and so a RuntimeError, as before)."""


class _Kind(enum.Enum):
    SLOT = enum.auto()
    """A range of a unit's weight slot, shared with the units that alternate with it."""
    KEPT = enum.auto()
    """Allocated at first use, never given back."""
    REUSABLE = enum.auto()
    """Cached on release, handed out again for the next request of its size."""


@dataclasses.dataclass(frozen=True)
class _Lease:
    """How a pooled bucket goes back to the pool (stored on the tensor: a bucket
    travels through code that knows nothing of the pool)."""

    kind: _Kind
    slot: Optional[tuple] = None
    """(dtype, device, slot index), for ``SLOT``."""
    unit: Optional[int] = None
    """The unit using the slot, for ``SLOT``."""


def _lease(tensor: torch.Tensor) -> Optional[_Lease]:
    return getattr(tensor, "_mfsdp_lease", None)


class BufferPool(StorageResizeAllocator):
    """Fixed slots for unit weight buckets; reuse for everything else (see above)."""

    def __init__(self, accounting: BufferAccounting, slot_of_unit: dict[int, int]) -> None:
        super().__init__(accounting)
        self.slot_of_unit = slot_of_unit
        """Unit index -> weight slot; units missing here allocate per use."""
        self._storage: dict[tuple, torch.UntypedStorage] = {}  # (dtype, device, slot) -> storage
        self._fill: dict[tuple, int] = {}  # (unit, dtype, device) -> elements reserved so far
        self._owner: dict[tuple, tuple[int, set]] = {}  # slot key -> (unit, ids of buckets holding it)
        self._cache: dict[tuple, list[torch.Tensor]] = {}  # (numel, dtype, device) -> released buckets

    @property
    def slot_bytes(self) -> int:
        """Bytes of all weight slots together."""
        return sum(storage.nbytes() for storage in self._storage.values())

    # -- unit weight buckets ---------------------------------------------------
    def slot_bucket(self, unit: int, numel: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """A bucket for one of ``unit``'s groups: the next free range of the unit's
        slot (units sharing a slot reuse the same bytes); ``None`` for a unit
        without a slot."""
        if unit not in self.slot_of_unit:
            return None
        key = (dtype, torch.device(device), self.slot_of_unit[unit])
        offset = self._fill.get((unit, dtype, key[1]), 0)
        self._fill[(unit, dtype, key[1])] = offset + numel
        storage = self._storage.get(key)
        itemsize = torch.empty((), dtype=dtype).element_size()
        needed = (offset + numel) * itemsize
        if storage is None:
            storage = self._storage[key] = torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
        if storage.nbytes() < needed:
            # Growing keeps the storage object, so buckets cut from it earlier stay valid.
            self.accounting.on_alloc(needed - storage.nbytes())
            storage.resize_(needed)
        bucket = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, (numel,))
        bucket._mfsdp_lease = _Lease(_Kind.SLOT, slot=key, unit=unit)
        return bucket

    def kept_bucket(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A bucket allocated at first use and never given back (the root's groups,
        gathered for the whole of every step anyway)."""
        bucket = self.empty_unallocated(numel, dtype, device)
        bucket._mfsdp_lease = _Lease(_Kind.KEPT)
        return bucket

    def allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        lease = _lease(tensor)
        if lease is None or lease.kind is not _Kind.SLOT:
            return super().allocate(tensor)
        key, unit = lease.slot, lease.unit
        owner, holders = self._owner.get(key, (unit, set()))
        if owner != unit and holders:
            raise SlotConflictError(
                f"fsdp_double_buffer: FSDP unit {unit} needs weight slot {key[2]} ({key[0]}), which unit "
                f"{owner} still holds. Slots assume units run one after another in module order, each "
                "releasing its weights once all its gradients arrived; this model runs them otherwise "
                "(another order, a unit called twice, several forwards before one backward, or parameters "
                "without gradients). "
                "Set fsdp_double_buffer=False (buckets allocated per use)."
            )
        holders.add(id(tensor))
        self._owner[key] = (unit, holders)
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        check_release(tensor)
        lease = _lease(tensor)
        match lease.kind if lease is not None else None:
            case _Kind.SLOT:
                _, holders = self._owner.get(lease.slot, (None, set()))
                holders.discard(id(tensor))
            case _Kind.KEPT:
                pass  # gathered again next step into the same bytes
            case _Kind.REUSABLE:
                self._cache.setdefault((tensor.numel(), tensor.dtype, tensor.device), []).append(tensor)
            case None:
                super().release(tensor)  # outside the slots: frozen groups, nested units

    # -- other temporary buckets ---------------------------------------------------
    def new(self, numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
        cached = self._cache.get((numel, dtype, torch.device(device)))
        if cached:
            tensor = cached.pop()
            return tensor.zero_() if zero else tensor
        tensor = super().new(numel, dtype, device, zero=zero)
        tensor._mfsdp_lease = _Lease(_Kind.REUSABLE)
        return tensor
