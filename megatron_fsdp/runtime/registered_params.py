"""Which tensors the wrapped module's registered parameters are.

[Note: registered parameters] Between steps the wrapped module's parameters are
the *distributed* parameters (the optimizer's, ``MegatronFSDP.parameters()``),
as in upstream Megatron-FSDP and PyTorch FSDP2. While the module runs, from the
wrapper's forward until its output is returned, and again from the first
gradient of a backward until its end-of-backward callback, the *compute*
parameters (views of the gathered model-weight buckets) are registered, since
the module's code reads ``self.weight`` and autograd accumulates into them.

So, between steps, anything walking ``model.module`` (an optimizer or
``clip_grad_norm_`` built on ``model.module.parameters()``, a container holding
the wrapper, ``torch.compile``'s ``OptimizedModule``, an EMA reading ``p.norm()``)
sees the main weights and the reduced gradients, never compute weights whose
storage ZeRO-3 has released.

The swap is root-level (upstream's choice) rather than per unit (FSDP2's):
registration only decides what the module's code and the user's walks see;
autograd keeps the compute tensors it saved whatever is registered. Per-unit
swapping would add work to every unit hook for no gain: units run only inside
the wrapper's forward and backward, where every compute parameter is valid to
read (gathered units) or at least as valid as it always was (released units
are never read by correct code). The backward window also covers activation
recomputation (hooks.py [Note: activation recomputation]): a checkpointed region
re-runs its forward inside backward and must read compute weights, whether or
not it is a unit.

[Note: gradient hooks on distributed parameters] DDP's habit
``for p in model.parameters(): p.register_hook(clip_or_mask)`` registers on the
distributed parameters, which autograd never reaches: the hooks would silently never
run. So each distributed parameter shares its compute twin's tensor-hook dictionary
(``_backward_hooks``): a hook registered on either runs on the compute parameter's
incoming gradient, this rank's local one before any reduction, as under DDP (and
``handle.remove()`` works on both). ``register_post_accumulate_grad_hook`` on a
distributed parameter cannot mean what it means under DDP (the engine takes the
accumulated gradient into its buffers first), so the next forward refuses it.

Tied weights (one parameter registered on two modules) stay tied: every
registration of a compute parameter gets the same distributed twin. The cost is
one dictionary store per registration per swap, what FSDP2's
``unsafe_setattr_param`` pays.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn


def wrapper_address(tensor: torch.Tensor) -> Optional[int]:
    """[Note: data assignment] ``param.data = value`` on a DTensor parameter (an old
    initialisation habit; torch's ``vector_to_parameters`` does it too) replaces only
    the wrapper's own storage: the local tensor, this rank's piece of the buffers that
    the optimizer and the forward use, keeps its values, so training would go on from
    the old weights. The wrapper's data pointer is where that replacement shows."""
    try:
        # A read, not an op: skipping the subclass's ``__torch_function__`` (no aten op
        # runs for it to route) gives the same pointer without a Python dispatch.
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.data_ptr(tensor)
    except RuntimeError:  # a torch whose wrappers have no pointer to read: nothing to compare
        return None


@dataclasses.dataclass(frozen=True)
class _Registration:
    module: nn.Module
    name: str
    compute: nn.Parameter
    dist: nn.Parameter
    dist_address: Optional[int]


def _set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """As FSDP2's ``unsafe_setattr_param``: write ``_parameters`` directly unless the
    module overrides ``__setattr__`` (then respect the override)."""
    if getattr(module.__setattr__, "__func__", None) is nn.Module.__setattr__:
        module._parameters[name] = param
    else:
        setattr(module, name, param)


def share_grad_hooks(compute: nn.Parameter, dist: nn.Parameter) -> None:
    """[Note: gradient hooks on distributed parameters] One hook dictionary for both
    (the compute parameter's, holding any hook the user registered before wrapping).
    The experimental engine shares its sharded and unsharded parameters' the same way."""
    hooks = compute._backward_hooks
    if hooks is None:
        hooks = compute._backward_hooks = collections.OrderedDict()
    dist._backward_hooks = hooks


_POST_ACCUMULATE_MESSAGE = (
    "megatron_fsdp: a post-accumulate-grad hook is registered on the distributed parameter {name} "
    "(model.parameters()): autograd never accumulates into it, and the engine takes each accumulated "
    "gradient of its compute twin into its buffers first, so the hook would never run. Register a "
    "tensor hook instead (p.register_hook: it runs on this rank's local gradient, as under DDP), or "
    "act after the gradient sync (after backward, or before optimizer.step())"
)


def data_assignment_message(name: str) -> str:
    """[Note: data assignment]: what happened and the fix (both engines)."""
    return (
        f"{name}.data was assigned after wrapping (param.data = value, or torch.nn.utils.vector_to_parameters): on "
        "megatron_fsdp's DTensor parameters that replaces only the wrapper, not the values the optimizer and the "
        "forward use, so training would go on from the old weights ([Note: data assignment] in registered_params.py); "
        "the assignment changed no weight. Load new values with model.load_state_dict({name: full_tensor, ...}, "
        "strict=False), or edit in place under torch.no_grad() (p.mul_(...), p.zero_(), "
        "torch.nn.init.constant_(p, v))"
    )


_REMOVED_MESSAGE = (
    "{name} is no longer the parameter megatron_fsdp registered there at wrapping (deleted, replaced, or moved "
    "by a parametrization such as weight_norm registered after wrapping): the wrapper would put its own weight "
    "back and silently undo the change. Make such changes before wrapping. No weight has changed"
)


_SWAPPED_MESSAGE = (
    "{name} holds a tensor other than the parameter megatron_fsdp registered there at wrapping "
    "(torch.func.functional_call and torch.nn.utils.stateless put the tensors they are given there for the "
    "call; so does writing module._parameters directly): the wrapper runs the module on the weights it gathers "
    "itself, so it cannot run it on other tensors. functional_call(model, dict(model.named_parameters()), ...) "
    "with the wrapper's own parameters works; to run the model on other weights (an EMA, a MAML inner step), "
    "load them into an unwrapped copy of the module (built before wrapping, or from "
    "megatron_fsdp.get_full_state_dict(model)) and call that. No weight has changed"
)


def direct_call_message(what: str) -> str:
    """[Note: direct calls of the wrapped module]: ``what`` names the module called."""
    return (
        f"{what} was called directly, outside the megatron_fsdp wrapper's forward (model.module(x) or "
        "model.module.<submodule>(x), DDP habits): between steps its parameters are this rank's shards, and the "
        "wrapper's forward is what gathers them and prepares the gradient sync. Call the wrapper instead "
        "(model(x) returns what the module returns); to run the module or a part of it without the wrapper "
        "(evaluation, HF generate), load megatron_fsdp.get_full_state_dict(model) into an unwrapped copy. "
        "No weight has changed"
    )


def _refuse_direct_call(registered: "weakref.ref[RegisteredParams]", module: nn.Module, args: tuple) -> None:
    alive = registered()
    if alive is not None and not alive.compute_registered:
        raise RuntimeError(direct_call_message(f"{type(module).__name__}(...), the wrapped module,"))


class RegisteredParams:
    """Swaps every registration of a wrapped module's parameters between the compute
    parameter and its distributed twin."""

    def __init__(
        self,
        module: nn.Module,
        dist_of: dict[nn.Parameter, nn.Parameter],
        views: Optional[dict[nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]] = None,
    ) -> None:
        """``dist_of``: compute parameter -> distributed parameter, for every parameter
        the wrapper manages (all of the module's). ``views``: compute parameter -> what
        the module's code reads instead while compute parameters are registered
        ([Note: module views of compute parameters])."""
        self._views = views or {}
        self._registrations: list[_Registration] = []
        for sub in module.modules():
            for name, param in sub._parameters.items():
                if param is None:
                    continue
                dist = dist_of.get(param)
                if dist is None:
                    raise AssertionError(f"parameter {name!r} of {type(sub).__name__} has no distributed twin")
                self._registrations.append(_Registration(sub, name, param, dist, wrapper_address(dist)))
        for r in self._registrations:
            share_grad_hooks(r.compute, r.dist)
        self._viewed = [r for r in self._registrations if r.compute in self._views]
        """The registrations whose module reads a view."""
        self.compute_registered = True
        """Whether the compute parameters are the registered ones (as at wrapping)."""
        # [Note: direct calls of the wrapped module] DDP's ``model.module(x)`` runs a
        # full replica; here it would run on the distributed parameters, and fail deep
        # inside with DTensor errors that name no cause. Prepended: before any user
        # hook on the module has a side effect. Compute parameters are registered
        # exactly while the wrapper's forward or a backward (a recompute) runs. A weak
        # reference: the user's module must not keep the wrapper's weights alive.
        # Units called directly (model.module.blocks[0](x)) are refused by their own
        # pre-forward hook (hooks.py); other submodules still fail inside DTensor.
        self._direct_call_hook = module.register_forward_pre_hook(
            functools.partial(_refuse_direct_call, weakref.ref(self)), prepend=True)

    def release(self) -> None:
        """The module is unwrapped (``unshard_module``): direct calls are its own again."""
        self._direct_call_hook.remove()

    def check_distributed(self) -> None:
        """Refuse what would make the distributed parameters silently stop meaning the
        weights (the next forward and every optimizer step check, before any change)."""
        # Attribute reads of the distributed parameters run no op for the subclass to
        # route: its ``__torch_function__`` would cost a Python dispatch and change nothing.
        with torch._C.DisableTorchFunctionSubclass():
            self._check_distributed()

    def _check_distributed(self) -> None:
        for r in self._registrations:
            if r.dist._post_accumulate_grad_hooks is not None:
                raise RuntimeError(_POST_ACCUMULATE_MESSAGE.format(name=f"{type(r.module).__name__}.{r.name}"))
            if r.dist_address is not None and wrapper_address(r.dist) != r.dist_address:
                raise RuntimeError(data_assignment_message(f"{type(r.module).__name__}.{r.name}"))

    def check_swappable(self) -> None:
        """Every refusal of ``register_compute``, without swapping anything. The wrapper's
        forward runs it before its first collective or weight refresh, so that a refused
        forward (functional_call on other tensors) leaves no gather or disarmed edit check
        behind: an in-place edit made after it must still reach the next forward."""
        if self.compute_registered:
            return
        self.check_distributed()
        for r in self._registrations:
            current = r.module._parameters.get(r.name)
            if current is not r.dist:
                # wrapped_model_guards.py [Note: parameters added after wrapping]: a deletion, a
                # parametrization that moved the parameter, or functional_call's swap
                # (which writes ``_parameters`` directly) escapes the registration hooks.
                message = _REMOVED_MESSAGE if current is None else _SWAPPED_MESSAGE
                raise RuntimeError(message.format(name=f"{type(r.module).__name__}.{r.name}"))

    @torch.compiler.disable  # a graph break (hooks.py [Note: hooks under torch.compile])
    def register_compute(self, *, checked: bool = False) -> None:
        """``checked``: ``check_swappable`` has just run (the wrapper's forward), with
        nothing but the wrapper's own bookkeeping since."""
        if self.compute_registered:
            return
        if not checked:
            self.check_swappable()  # every check before the first swap: all or nothing
        for r in self._registrations:
            _set_param(r.module, r.name, r.compute)
        self._install_views()
        self.compute_registered = True

    def _install_views(self) -> None:
        """[Note: module views of compute parameters] A tensor-parallel model's code reads
        DTensors over the TP mesh (buffers/tensor_parallel.py [Note: tensor-parallel
        parameters]) while the engine keeps the plain local compute parameter registered
        (its gradient is what the engine reduces). An instance attribute shadows
        ``_parameters`` for ``module.weight``, and ``named_parameters()`` still walks
        the compute parameter. Made with gradients enabled even when registered at the
        start of a backward: a recomputed forward (activation checkpointing) reads them
        and its gradient must reach the compute parameter."""
        if not self._viewed:
            return
        with torch.enable_grad():
            made: dict[nn.Parameter, torch.Tensor] = {}
            for r in self._viewed:
                if r.compute not in made:
                    made[r.compute] = self._views[r.compute](r.compute)  # tied weights read one view
                r.module.__dict__[r.name] = made[r.compute]

    def _remove_views(self) -> None:
        for r in self._viewed:
            r.module.__dict__.pop(r.name, None)

    @torch.compiler.disable
    def register_dist(self) -> None:
        if not self.compute_registered:
            return
        self._remove_views()
        for r in self._registrations:
            _set_param(r.module, r.name, r.dist)
        self.compute_registered = False

