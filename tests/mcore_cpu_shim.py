"""Test-only shim: run megatron-core 0.16's GPTModel (local layer spec, dense or MoE
with the all-to-all token dispatcher) and its DistributedDataParallel on a CPU-only torch.

megatron-core assumes CUDA in these places on this path (the MoE layer adds the fourth,
and a missing TransformerEngine the fifth), and nowhere else that the tests reach:

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
   as on GPU (its own stream, the outer stream restored afterwards). Its seeds are
   ``model_parallel_cuda_manual_seed``'s at TP rank 0; the expert-parallel state
   takes this rank's ``ep_rank`` / ``etp_rank`` when given (``seed + 1024 + 100 *
   ep_rank + etp_rank``, so that experts on different expert-parallel ranks draw
   different dropout masks and GPU-path initializations, as on GPU).

4. Streams: the MoE all-to-all token dispatcher (``MoEAlltoAllTokenDispatcher``)
   creates a class-wide side ``torch.cuda.Stream()`` for its device-to-host copies of
   the token counts, records an event on it and synchronizes with it; Megatron's DDP
   with several distributed-optimizer instances makes a communication stream and
   waits on ``torch.cuda.default_stream()``. On the CPU every op has finished when it
   returns, so the shim's ``torch.cuda.Stream`` is a stream whose waits, events and
   synchronization do nothing (``_CpuStream``), and ``torch.cuda.current_stream`` /
   ``default_stream`` / ``stream`` answer with such a stream. Its copies
   (``maybe_move_tensor_to_cpu``) return GPU tensors on the host, the split sizes as
   numpy arrays (``as_numpy=True``) that ``all_to_all_single`` takes as lists; they
   leave CPU tensors as they are, so the all-to-all would get tensors for its split
   sizes and refuse them. The shim's copy does on the CPU what the GPU one returns:
   the same tensor, as numpy where asked.
5. Not CUDA but TransformerEngine: the MoE router's ``RouterGatingLinearFunction``
   tests ``te_general_gemm is not None`` to choose TE's GEMM over ``torch.mm``, but
   without TransformerEngine megatron-core 0.16 never defines that name (its import
   sits in a ``try`` whose ``except`` sets only ``HAVE_TE = False``), so the router
   stops with a ``NameError``. The shim defines it as ``None``: the torch branch the
   code means to take without TE.

Not CUDA either: megatron-core builds the hierarchical (HSDP) data-parallel groups of
``initialize_model_parallel(num_distributed_optimizer_instances > 1)`` with
``einops.rearrange``, and its ``--no-deps`` install lacks einops.
``hierarchical_groups_without_einops`` supplies the one rearrangement it uses.

Everything is undone when the context exits, so other tests that share a pooled
worker process see an untouched torch and megatron-core. With CUDA present the
shim does nothing. It lives in tests/ on purpose: the package never patches
megatron-core.
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import numpy as np
import torch

_TRACKER_SEED_OFFSETS = {
    # name -> offset, mirroring model_parallel_cuda_manual_seed's seeds for TP = EP = 1.
    "data-parallel-rng": 0,
    "model-parallel-rng": 2718,
    "expert-parallel-rng": 1024,
}
_EXPERT_RANK_STRIDE = 100
"""model_parallel_cuda_manual_seed's expert seed: ``seed + 1024 + 100 * ep_rank + etp_rank``."""


def _cpu_state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def seed_rng_tracker(seed: int = 1234, *, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Give Megatron's RNG tracker CPU generator states (replaces
    ``model_parallel_cuda_manual_seed``, which needs CUDA); the expert-parallel state is
    ``ep_rank`` / ``etp_rank``'s (item 3 of the module docstring)."""
    from megatron.core import tensor_parallel

    offsets = dict(_TRACKER_SEED_OFFSETS)
    offsets["expert-parallel-rng"] += _EXPERT_RANK_STRIDE * ep_rank + etp_rank
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.set_states({name: _cpu_state(seed + offset) for name, offset in offsets.items()})


def _get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()  # True = masked out


class _CpuEvent:
    """A CUDA event's interface where work is synchronous: always complete."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """A CUDA stream's interface for the CPU: ops run in program order, so there is
    nothing to wait for (item 4 of the module docstring)."""

    def __init__(self, device=None, priority: int = 0, **unused) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


@contextlib.contextmanager
def _on_cpu_stream(stream=None) -> Iterator[None]:
    yield


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` for tensors already on the host."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _patch_streams(stack: contextlib.ExitStack) -> None:
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    stack.enter_context(mock.patch.object(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _CPU_STREAM))
    stack.enter_context(mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", _to_host))
    stack.enter_context(mock.patch("torch.cuda.Stream", _CpuStream))
    stack.enter_context(mock.patch("torch.cuda.current_stream", lambda device=None: _CPU_STREAM))
    stack.enter_context(mock.patch("torch.cuda.default_stream", lambda device=None: _CPU_STREAM))
    stack.enter_context(mock.patch("torch.cuda.stream", _on_cpu_stream))
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        stack.enter_context(mock.patch.object(moe_utils, "te_general_gemm", None, create=True))


@contextlib.contextmanager
def cpu_shim(seed: int = 1234, *, ep_rank: int = 0, etp_rank: int = 0) -> Iterator[None]:
    """Patch what megatron-core needs to run on the CPU, seed its RNG tracker (the
    expert-parallel state for ``ep_rank`` / ``etp_rank``), and restore everything on exit."""
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
        _patch_streams(stack)
        seed_rng_tracker(seed, ep_rank=ep_rank, etp_rank=etp_rank)
        yield


class _EinopsStandIn:
    """``einops.rearrange`` for the one pattern megatron-core's ``create_hierarchical_groups``
    uses: a list of ranks ``(l s u)`` regrouped into the rows ``(l u)`` of ``s`` ranks."""

    @staticmethod
    def rearrange(ranks, pattern: str, *, l: int, s: int, u: int) -> np.ndarray:  # noqa: E741 (einops' names)
        if pattern != "(l s u) -> (l u) s":
            raise NotImplementedError(f"the einops stand-in knows only megatron-core's hierarchical-group pattern, "
                                      f"not {pattern!r}; install einops")
        return np.asarray(ranks).reshape(l, s, u).transpose(0, 2, 1).reshape(l * u, s)


@contextlib.contextmanager
def hierarchical_groups_without_einops() -> Iterator[None]:
    """Let ``parallel_state.initialize_model_parallel(num_distributed_optimizer_instances > 1)``
    build its hierarchical groups without einops (a no-op where einops is installed)."""
    from megatron.core import parallel_state

    if parallel_state.HAVE_EINOPS:
        yield
        return
    with mock.patch.object(parallel_state, "HAVE_EINOPS", True), \
            mock.patch.object(parallel_state, "einops", _EinopsStandIn, create=True):
        yield
