"""Test-only shim: run megatron-core 0.16's GPTModel (local layer spec) and its
DistributedDataParallel on a CPU-only torch.

megatron-core assumes CUDA in three places on this path, and nowhere else that the
tests reach:

1. Allocation on ``torch.cuda.current_device()``: the attention score buffer
   (``GlobalMemoryBuffer.get_tensor``, used by local ``DotProductAttention``) and
   the gradient buffers of Megatron's ``DistributedDataParallel``. The shim makes
   ``torch.cuda.current_device()`` answer ``"cpu"``, so those tensors land on the
   CPU like everything else.
2. ``get_default_causal_mask`` (used by the local softmax when the caller
   passes ``attention_mask=None``) builds its mask with ``device="cuda"``; the
   shim substitutes the same mask built on the CPU.
3. The RNG tracker: local attention always enters
   ``get_cuda_rng_tracker().fork()``, which reads and writes CUDA generator state,
   and seeding it (``model_parallel_cuda_manual_seed``) needs CUDA too. The shim
   gives the tracker seeded CPU generator states and makes megatron's private
   ``_get/_set_cuda_rng_state`` swap the CPU generator instead, so a fork behaves
   as on GPU (its own stream, the outer stream restored afterwards).

Everything is undone when the context exits, so other tests that share a pooled
worker process see an untouched torch and megatron-core. With CUDA present the
shim does nothing. It lives in tests/ on purpose: the package never patches
megatron-core.
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import torch

_TRACKER_SEED_OFFSETS = {
    # name -> offset, mirroring model_parallel_cuda_manual_seed's seeds for TP = EP = 1.
    "data-parallel-rng": 0,
    "model-parallel-rng": 2718,
    "expert-parallel-rng": 1024,
}


def _cpu_state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def seed_rng_tracker(seed: int = 1234) -> None:
    """Give Megatron's RNG tracker CPU generator states (replaces
    ``model_parallel_cuda_manual_seed``, which needs CUDA)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.set_states({name: _cpu_state(seed + offset) for name, offset in _TRACKER_SEED_OFFSETS.items()})


def _get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()  # True = masked out


@contextlib.contextmanager
def cpu_shim(seed: int = 1234) -> Iterator[None]:
    """Patch what megatron-core needs to run on the CPU, seed its RNG tracker, and
    restore everything on exit."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(mcore_random, "_get_cuda_rng_state", _get_rng_state))
        stack.enter_context(mock.patch.object(mcore_random, "_set_cuda_rng_state", _set_rng_state))
        stack.enter_context(mock.patch.object(fused_softmax, "get_default_causal_mask", _cpu_causal_mask))
        seed_rng_tracker(seed)
        yield
