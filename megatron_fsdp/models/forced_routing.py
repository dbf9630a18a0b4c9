"""Forced load balancing (Megatron-LM's ``--moe-router-force-load-balancing``): a
benchmarking mode in which every MoE router throws its logits away and routes on
standard-normal noise, so the experts receive statistically even loads whatever the
weights have learnt. The noise stands in for the logits everywhere downstream (the
top-k choice, score function, expert bias, group limit, scaling factor, balancing
losses, expert-bias counts); in backward the gradient of the noise is handed to the
real logits unchanged (a straight-through estimator), so the gating weights still
train.

[Note: the forced-routing stream] megatron-core (``moe_utils.RandomSTE``) draws the
noise ``logits.clone().normal_()`` -- the logits' shape, dtype and device -- inside a
fork of its CUDA RNG tracker's expert-parallel stream, seeded once with
``seed + 1024 + 100 * expert-parallel rank + expert-tensor-parallel rank``; one stream
serves every layer, each forward advances it, and the default generators are left
alone. Here, with expert tensor-parallel size 1 and one pipeline stage, that is
seed + 1024 + 100 x EP rank: ``ForcedRoutingStream`` is that stream, a
``torch.Generator`` on the logits' device seeded with the seed ``torch.manual_seed``
last set when the model was built (the launcher's ``--seed``) plus 1024, shared by all
routers of a model and drawn in forward order; ``apply_expert_parallel`` moves it to its
EP rank's seed (``for_expert_parallel_rank``). Consequences, all as in megatron-core: at
expert-parallel size 1 every data-parallel rank draws the same noise, so a micro batch
of the same shape is routed identically on every rank; under expert parallelism the EP
ranks draw different noise (so the routing is not expert-parallel size 1's); and the
noise of a given token is the same as megatron-core's because it is drawn in
megatron-core's (sequence, batch) order and transposed to our batch-major rows.

Not reproduced: where the stream stands at the first forward of a Megatron-LM run.
Megatron-LM initialising its expert weights on the GPU draws them from the same
stream first (``_initialize_affine_weight_gpu``), and resuming from a checkpoint
restores it; this stream starts fresh at every launch. Given the same stream state the
numbers are megatron-core's bit for bit (tests/test_moe_force_load_balancing.py).

[Note: forced routing under recomputation] Full recomputation re-runs a chunk of
blocks inside backward; its routers must see the noise the first forward drew, or the
recomputed activations belong to another routing and the gradients are silently
wrong. ``checkpoint_contexts`` is the ``context_fn`` of torch's non-reentrant
checkpoint: it records the stream when the checkpointed forward starts and replays
from there during the recomputation, then puts the stream back where it was (what
megatron-core's ``CheckpointFunction`` does with its tracker's states).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

EXPERT_STREAM_SEED_OFFSET = 1024
"""megatron-core's expert-parallel stream seed: seed + 1024 (+ 100 x EP rank + ETP rank, the latter 0 here)."""
EXPERT_RANK_SEED_STRIDE = 100
"""megatron-core's seed step between expert-parallel ranks."""


class ForcedRoutingStream:
    """The model's forced-routing noise: one generator per device, seeded ``seed``, its
    position advanced by every draw. See [Note: the forced-routing stream]."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @classmethod
    def from_torch_seed(cls) -> "ForcedRoutingStream":
        """The stream of a model built after ``torch.manual_seed(seed)``: seed + 1024."""
        return cls(torch.initial_seed() + EXPERT_STREAM_SEED_OFFSET)

    def for_expert_parallel_rank(self, ep_rank: int) -> "ForcedRoutingStream":
        """A fresh stream for EP rank ``ep_rank``: this one's seed + 100 x ``ep_rank`` (build the
        model's stream at EP rank 0's seed, then move every rank's here once, before any draw)."""
        return ForcedRoutingStream(self.seed + EXPERT_RANK_SEED_STRIDE * ep_rank)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return generator

    def draw(self, logits: torch.Tensor, sequences: int) -> torch.Tensor:
        """Standard-normal noise like ``logits`` (n, E), n = sequences x tokens per sequence
        in batch-major order; drawn as megatron-core draws its (tokens, sequences, E) logits."""
        n, experts = logits.shape
        noise = torch.empty(n // sequences, sequences, experts, dtype=logits.dtype, device=logits.device)
        noise.normal_(generator=self._generator(logits.device))  # (t, b, E): megatron-core's order
        return noise.transpose(0, 1).reshape(n, experts)  # (b * t, E)

    # -- recomputation -----------------------------------------------------------------
    def _states(self) -> dict[torch.device, torch.Tensor]:
        return {device: generator.get_state() for device, generator in self._generators.items()}

    def _restore(self, states: dict[torch.device, torch.Tensor]) -> None:
        for device, generator in self._generators.items():
            if device in states:
                generator.set_state(states[device])
            else:  # first used after the snapshot: it was fresh then
                generator.manual_seed(self.seed)

    @contextlib.contextmanager
    def _replaying(self, snapshot: dict[torch.device, torch.Tensor]) -> Iterator[None]:
        current = self._states()
        self._restore(snapshot)
        try:
            yield
        finally:
            self._restore(current)

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
        (forward context, recomputation context). See [Note: forced routing under recomputation]."""
        return contextlib.nullcontext(), self._replaying(self._states())


class _RandomLogits(torch.autograd.Function):
    """Forward: the stream's noise in place of the logits; backward: the identity."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, stream: ForcedRoutingStream, sequences: int) -> torch.Tensor:
        return stream.draw(logits, sequences)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def random_logits(logits: torch.Tensor, stream: ForcedRoutingStream, sequences: int) -> torch.Tensor:
    """logits (n, E), batch-major rows of ``sequences`` sequences -> the noise that replaces
    them (n, E), same dtype and device, carrying their gradient straight through."""
    if logits.shape[0] % sequences:
        raise ValueError(f"{logits.shape[0]} token rows do not split into sequences={sequences} equal sequences; "
                         f"pass the batch size of the (batch, time) tokens the rows were flattened from")
    return _RandomLogits.apply(logits, stream, sequences)


def share_stream(routers, stream: Optional[ForcedRoutingStream] = None) -> Optional[ForcedRoutingStream]:
    """Make every router with forced routing draw from one stream (``stream``, or the first
    router's), as megatron-core's layers share one tracker stream. Returns that stream."""
    forced = [r for r in routers if getattr(r, "forced_routing", None) is not None]
    if forced and stream is None:
        stream = forced[0].forced_routing
    for router in forced:
        router.forced_routing = stream
    return stream if forced else None
