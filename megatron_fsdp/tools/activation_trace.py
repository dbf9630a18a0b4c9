"""Activation bytes of one microbatch, traced on fake tensors (no memory, no compute).

``trace_activations(cfg, dtype, micro_batch_size, seq_length)`` builds the embedded GPT
under ``FakeTensorMode`` and runs one forward (logits and loss included) and its backward
while a dispatch mode counts the bytes of every storage an operator creates, until that
storage dies. What it returns is the model's own transient bytes, apart from the weights:

    forward_blocks   the largest live total in the embedding and the blocks
    forward_head     ... in the final norm, the logits and the loss
    forward_end      live at the end of the forward: what backward needs (saved
                     activations), the logits and the loss
    backward_head    the largest live total in the loss's and the head's backward
    backward_blocks  ... in the blocks' backward

each parameter's gradient dropped once it is accumulated (the engine moves it into its
gradient buffer; the plan counts that buffer as persistent state).

[Note: counting storages, not tensors] Views share their base's storage and in-place ops
create none, so bytes are counted for the outputs of operators whose schema says they
alias nothing (below autograd a view does not call itself one: ``_is_view()`` is false
there), once per storage, from the moment an operator returns it to the moment its last
reference dies (a weak-reference finalizer on the storage, which torch keeps as one
Python object while the storage lives). The same counter runs on real CPU tensors
(``LiveBytes``): the tests check that the fake trace equals it within 0.1%, and that the
whole step's prediction matches the allocator's bytes (``peak_measure.py``).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..models.gpt import GPT, GPTConfig, gpt_loss


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created by operators since entry and still alive, and the
    largest such total (``peak``), per named phase (``phase``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def mark(self, phase: str) -> None:
        """Start a new phase; its peak starts from what is live now."""
        self.phase = phase
        self.peaks[phase] = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            # a view or an in-place result allocates nothing ([Note: counting storages, not tensors])
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t.untyped_storage())
        self.peak = max(self.peak, self.live)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.live)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        weakref.finalize(storage, self._free, key, nbytes)


@dataclasses.dataclass(frozen=True)
class ActivationTrace:
    """One microbatch's transient bytes beside the weights ([module docstring]), the largest
    live total per phase (``run_microbatch``)."""

    forward_blocks: int
    """Embedding and transformer blocks."""
    forward_head: int
    """Final norm, logits and loss."""
    forward_end: int
    """Live when the forward is done: what backward needs, the logits and the loss."""
    backward_head: int
    """The loss's and the output layer's backward (the logits' gradient)."""
    backward_blocks: int
    """The blocks' backward (with recomputation, each block's forward again)."""
    logits: int
    """Bytes of the logits tensor alone (b, s, V), in the compute dtype."""

    @property
    def forward_peak(self) -> int:
        return max(self.forward_blocks, self.forward_head)

    @property
    def backward_peak(self) -> int:
        return max(self.backward_head, self.backward_blocks)

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


def _drop_grads(model: torch.nn.Module) -> list:
    """Free every parameter gradient as soon as it is accumulated ([module docstring])."""

    def drop(p: torch.Tensor) -> None:
        p.grad = None

    return [p.register_post_accumulate_grad_hook(drop) for p in model.parameters()]


def _head_marks(model: torch.nn.Module, counter) -> Optional[torch.utils.hooks.RemovableHandle]:
    """Mark ``forward_head`` when the final norm starts, and ``backward_blocks`` when the
    gradient reaches its input (the head's backward is done, the blocks' begins)."""
    norm = next((m for name, m in model.named_modules() if name.split(".")[-1] == "ln_f"), None)
    if norm is None:
        return None

    def pre_hook(module, args):
        counter.mark("forward_head")
        if args[0].requires_grad:
            args[0].register_hook(lambda grad: counter.mark("backward_blocks"))

    return norm.register_forward_pre_hook(pre_hook)


def run_microbatch(model: torch.nn.Module, tokens: torch.Tensor, counter) -> None:
    """Forward, loss and backward of ``tokens`` (b, s+1), phases marked on ``counter``:
    ``forward`` (embedding and blocks), ``forward_head`` (final norm, logits, loss),
    ``forward_end``, ``backward`` (the loss and the head), ``backward_blocks``, ``end``."""
    handle = _head_marks(model, counter)
    try:
        counter.mark("forward")
        loss = gpt_loss(model(tokens[:, :-1]), tokens[:, 1:])
        counter.mark("forward_end")
        counter.mark("backward")
        loss.backward()
        counter.mark("end")
    finally:
        if handle is not None:
            handle.remove()


def trace_activations(cfg: GPTConfig, dtype: torch.dtype, micro_batch_size: int,
                      seq_length: Optional[int] = None) -> ActivationTrace:
    """Trace one microbatch of ``micro_batch_size`` x ``seq_length`` tokens of the GPT
    ``cfg`` (recomputation as ``cfg`` sets it) in ``dtype``, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seq = seq_length or cfg.seq_length
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # fake parameters cannot be swapped by ``.to(dtype)``
    try:
        with FakeTensorMode():
            model = GPT(cfg)
            hooks = _drop_grads(model)
            tokens = torch.zeros(micro_batch_size, seq + 1, dtype=torch.long)
            counter = LiveBytes()
            with counter:
                run_microbatch(model, tokens, counter)
            for hook in hooks:
                hook.remove()
    finally:
        torch.set_default_dtype(default)
    logits = micro_batch_size * seq * cfg.vocab_size * torch.empty((), dtype=dtype).element_size()
    peaks = counter.peaks
    return ActivationTrace(forward_blocks=peaks["forward"], forward_head=peaks["forward_head"],
                           forward_end=peaks["forward_end"], backward_head=peaks["backward"],
                           backward_blocks=peaks["backward_blocks"], logits=logits)
