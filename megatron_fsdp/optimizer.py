"""How an optimizer drives a ``MegatronFSDP`` model: step hooks, eager state, rebuild.

``fully_shard_optimizer`` extends the user's optimizer only through PyTorch's own
extension points (``register_step_pre_hook`` / ``register_step_post_hook``, and
``register_state_dict_post_hook`` / ``register_load_state_dict_pre_hook`` for the
standard state-dict form of optimizer_state_dict.py): its ``step`` and
``state_dict`` stay the class's methods, so LR schedulers, ``step(closure)`` and
pickling of its state dict behave as with any optimizer.

Per ``optimizer.step(...)``::

    pre-hook    call the closure (if any) -> finish the gradient sync (auto-sync off)
                -> swap DTensor parameters for their local pieces (elementwise
                   optimizers only: [Note: local pieces])
    step        the optimizer's own math, on local tensors (or on the DTensors)
    post-hook   swap back -> install the updated main weights into the model weights

Gradient zeroing needs no hook: ``optimizer.zero_grad()`` (or ``model.zero_grad()``,
or ``p.grad = None``) clears the distributed parameters' ``.grad``, and the model
zeroes the matching gradient buffers when the next backward pass begins.

An optimizer built by hand on a wrapped model's parameters is bound at its first
step, and one that misuses them is refused, by torch's global step pre-hook, which
the first wrapped model registers ([Note: step checks]); importing registers nothing.
"""

from __future__ import annotations

import inspect
import logging
import operator
import weakref
from typing import Any, Optional, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from .runtime.owners import compute_owner_of, owner_of
from .state.eager_state import init_optimizer_state
from .state.optimizer_state_dict import state_dict_hooks
from .buffers.piece_dtensor import FLAT_START_ATTR, PieceDTensor, is_flat_piece, piece_dtensor

__all__ = [  # what optimizers written for sharded parameters use (the launcher's Muon)
    "ELEMENTWISE_ATTR", "FLAT_START_ATTR", "bind_optimizer", "is_flat_piece", "rebuild_optimizer",
    "updates_elementwise",
]

logger = logging.getLogger(__name__)

_STEP_KWARGS = ("sync_grad_before_optimizer_step", "install_optimized_model_weights")


class SteppedModel(Protocol):
    """What an optimizer reads from the models it steps (``megatron_fsdp.MegatronFSDP``,
    which imports this module to guard optimizer steps: [Note: step checks])."""

    model_auto_sync: bool
    param_and_grad_buffer: Any
    replaced_params: dict
    """id(a parameter the wrapped module had) -> the parameter that replaced it at wrapping."""

    def check_distributed_params(self) -> None: ...

    def finish_grad_sync(self) -> None: ...

    def install_optimized_model_weights(self) -> None: ...


class OptimizerBinding:
    """The models one optimizer updates, the step hooks that keep them in sync, and
    the state-dict hooks that hand out (and take back) its state in standard form.
    Stored on the optimizer as ``optimizer.megatron_fsdp_binding``."""

    def __init__(self, optimizer: torch.optim.Optimizer, models: list[SteppedModel]) -> None:
        self.models = models
        self._install = True
        self._swapped: Optional[_LocalSwap] = None
        self._told_dtensor_steps = False
        self._handles = [
            optimizer.register_step_pre_hook(self.pre_step),
            optimizer.register_step_post_hook(self.post_step),
            *state_dict_hooks(optimizer),
        ]

    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        sync = kwargs.pop("sync_grad_before_optimizer_step", True)
        self._install = kwargs.pop("install_optimized_model_weights", True)
        closure = kwargs.pop("closure", None)
        if len(args) > 1:  # args[0] is the optimizer itself
            closure, args = args[1], args[:1] + args[2:]
        if closure is not None:
            if isinstance(optimizer, torch.optim.LBFGS):
                raise NotImplementedError(
                    "LBFGS calls its closure several times inside one step, and each call would need a gradient "
                    "sync that megatron_fsdp cannot run from inside step(); use a first-order optimizer"
                )
            # As torch optimizers do: the closure recomputes the loss and its gradients.
            with torch.enable_grad():
                loss = closure()
            kwargs["closure"] = _Returns(loss)
        for model in self.models:
            model.check_distributed_params()
        if sync:
            for model in self.models:
                if not model.model_auto_sync:
                    model.finish_grad_sync()
        if self._swapped is not None:  # a previous step raised before its post-hook
            self._swapped.restore()
        pieces = any(is_flat_piece(p) for g in optimizer.param_groups for p in g["params"])
        if pieces:
            refuse_whole_tensor_optimizer(optimizer)
        # Replicated groups' local tensors are whole parameters: any optimizer is exact there.
        local = not pieces or updates_elementwise(optimizer)
        if not local and not self._told_dtensor_steps:
            self._told_dtensor_steps = True
            logger.info(
                "%s is not a known elementwise optimizer: it steps the sharded DTensors (exact, slower than the "
                "local pieces); set optimizer.%s = True if its update is elementwise", type(optimizer).__name__,
                ELEMENTWISE_ATTR,
            )
        self._swapped = _LocalSwap(optimizer) if local else None
        return args, kwargs

    def post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._swapped is not None:
            self._swapped.restore()
            self._swapped = None
        if self._install:
            for model in self.models:
                model.install_optimized_model_weights()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Returns:
    """A closure handed to the optimizer's own ``step`` after the real one ran: it
    returns the loss already computed (a class, not a lambda: picklable)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


def bind_optimizer(optimizer: torch.optim.Optimizer, *, create_state: bool = True) -> OptimizerBinding:
    """Find the models owning ``optimizer``'s parameters and hook the optimizer to them."""
    existing = getattr(optimizer, "megatron_fsdp_binding", None)
    if existing is not None:
        return existing
    models: list[SteppedModel] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = owner_of(param)
            if owner is None:
                raise ValueError(_foreign_param_message(param))
            if owner not in models:
                models.append(owner)
    if not models:
        raise ValueError("fully_shard_optimizer: the optimizer has no parameters")
    binding = OptimizerBinding(optimizer, models)
    optimizer.megatron_fsdp_binding = binding
    optimizer.megatron_fsdp_models = models
    if create_state:
        init_optimizer_state(optimizer)
    return binding


def _foreign_param_message(param: torch.Tensor) -> str:
    if compute_owner_of(param) is not None:
        return (
            "the optimizer holds a compute parameter of the wrapped module (a reference taken before wrapping): "
            "those are compute weights that megatron_fsdp overwrites after every step. Build the optimizer from the "
            "wrapper's parameters instead: opt = Opt(model.parameters()) (likewise clip_grad_norm_(model.parameters(), ...))"
        )
    return (
        "fully_shard_optimizer: a parameter of the optimizer does not belong to a MegatronFSDP model; "
        "build the optimizer from the wrapped model's parameters: opt = Opt(model.parameters())"
    )


def check_step_inputs(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Before any weight changes, through the global step pre-hook ([Note: step checks]).

    * An optimizer stepping the wrapped module's compute parameters would train
      silently wrong (they are overwritten after each step, and under ZeRO-1/2/3
      their gradients are not the reduced ones): refused.
    * [Note: plain optimizers] A plain torch optimizer built on ``model.parameters()``
      (DDP's habit, without ``fully_shard_optimizer``) is bound here, at its first
      step, exactly as ``fully_shard_optimizer`` would bind it (state stays lazy):
      its step then finishes a deferred gradient sync first and installs the
      updated weights after. Unbound it trained ZeRO-1/2 on stale compute weights
      and ZeRO-3 with deferred sync on stale root groups (0.007-0.06 off). The
      binding's own pre-hook, registered now, runs right after this one. State
      loaded before (a resume) is loaded again through the binding.
    * One optimizer over megatron_fsdp parameters and others: refused (the binding
      needs every parameter owned by a wrapped model)."""
    bound = getattr(optimizer, "megatron_fsdp_binding", None) is not None
    owned, foreign = False, None
    for group in optimizer.param_groups:
        for param in group["params"]:
            if compute_owner_of(param) is not None:
                raise ValueError(_foreign_param_message(param))
            if bound:  # bound: every parameter was checked at binding; only the above per step
                continue
            if owner_of(param) is not None:
                owned = True
            elif foreign is None:
                foreign = param
    if bound or not owned:
        return
    if foreign is not None:
        raise ValueError(
            f"{type(optimizer).__name__} holds megatron_fsdp parameters and others (one of shape "
            f"{tuple(foreign.shape)} belongs to no MegatronFSDP model): megatron_fsdp must finish each step of "
            "its parameters (gradient sync before, weight install after). Use one optimizer for the wrapped "
            "model's parameters (fully_shard_optimizer(Opt(model.parameters()))) and another for the rest"
        )
    # State loaded before the first step (a resume: load_state_dict of a standard-form
    # state dict) is in the layout of the state dict, not of the flat pieces the
    # step works on: load it again, through the binding's load hook.
    loaded = optimizer.state_dict() if optimizer.state else None
    bind_optimizer(optimizer, create_state=False)
    if loaded is not None:
        optimizer.load_state_dict(loaded)
    logger.info("megatron_fsdp: %s bound at its first step (as fully_shard_optimizer binds it)",
                type(optimizer).__name__)


# -- the process-wide step check: registered at the first wrap, free for other optimizers ---
class _Passed:
    """An optimizer's param groups (their parameters, in order) and binding as they
    were when its step last passed ``check_step_inputs``, in generation ``generation``
    of the wrapped models. Holds the parameters strongly, so that none of their ids
    is reused while the record stands."""

    def __init__(self, optimizer: torch.optim.Optimizer, generation: int) -> None:
        self.generation = generation
        self.binding = getattr(optimizer, "megatron_fsdp_binding", None)
        self.groups = [list(group["params"]) for group in optimizer.param_groups]

    def still(self, optimizer: torch.optim.Optimizer, generation: int) -> bool:
        groups = optimizer.param_groups
        return (
            generation == self.generation
            and getattr(optimizer, "megatron_fsdp_binding", None) is self.binding
            and len(groups) == len(self.groups)
            and all(
                len(group["params"]) == len(saved) and all(map(operator.is_, group["params"], saved))
                for group, saved in zip(groups, self.groups)
            )
        )


class _StepGuard:
    """[Note: step checks] ``check_step_inputs`` must see the step of every optimizer in
    the process: a hand-built one (on ``model.parameters()``, or on the compute
    parameters) is not known to megatron_fsdp before its first step, so only
    torch's global step pre-hook reaches it. Nothing is registered at import: each
    ``MegatronFSDP`` calls ``guard_optimizer_steps(self)`` once its parameters are
    registered as owned (runtime/owners.py), and the first call registers the hook.
    Until then no parameter of ours exists, so no step could be refused.

    Other optimizers then pay no ownership lookup per parameter per step:
    * while no wrapped model is alive the hook returns at once (no parameter has an
      owner: the owner maps hold their models weakly);
    * an optimizer whose step passed is remembered with its param groups and binding
      (``_Passed``); its later steps compare parameter identities (microseconds for
      hundreds of parameters) and skip the lookups while nothing changed. Wrapping a
      model is the only way a parameter gains an owner, and it starts a new
      generation, which sends every optimizer through the full check once more.
      Unwrapping or freeing a model only removes owners, which cannot turn a passed
      check into a refusal."""

    def __init__(self) -> None:
        self.handle: Optional[RemovableHandle] = None
        self.models: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self.generation = 0
        self.passed = WeakIdKeyDictionary()
        """Optimizer (by identity, held weakly) -> its ``_Passed``."""

    def watch(self, model: nn.Module) -> None:
        self.models.add(model)
        self.generation += 1
        if self.handle is None:
            self.handle = register_optimizer_step_pre_hook(self.pre_step)

    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self.models:
            return
        passed = self.passed.get(optimizer)
        if passed is not None and passed.still(optimizer, self.generation):
            return
        check_step_inputs(optimizer, args, kwargs)
        self.passed[optimizer] = _Passed(optimizer, self.generation)


_STEP_GUARD = _StepGuard()


def guard_optimizer_steps(model: nn.Module) -> None:
    """From now on every optimizer step in the process is checked against ``model``'s
    parameters ([Note: step checks]); the first call registers torch's global step
    pre-hook (process-wide, as the wrapping that calls it)."""
    _STEP_GUARD.watch(model)


# -- running the step on local tensors -----------------------------------------------------
_ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
    torch.optim.Rprop,
)
_FUSED_ELEMENTWISE = {"FusedAdam", "FusedSGD"}
"""apex's and TransformerEngine's fused optimizers (Megatron-LM's defaults), elementwise too."""
ELEMENTWISE_ATTR = "megatron_fsdp_elementwise"


def updates_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """[Note: local pieces] Whether ``optimizer`` may run on the plain local pieces of
    the sharded parameters. An elementwise update (every state and every new value
    computed entry by entry) gives the same numbers on any piece; anything that looks
    across a parameter (Adafactor's per-parameter RMS and row/column factors, Muon's
    matrix orthogonalisation, a user's own norm-scaled update) would get this rank's
    piece instead, silently. Those run on the DTensors, where full norms and sums are
    exact across the mesh and every other cross-element op raises with the remedy.
    Known elementwise: torch's SGD, Adam(W), Adagrad, Adadelta, Adamax, ASGD, NAdam,
    RAdam, RMSprop and Rprop (exactly these classes: a subclass may change the math),
    apex's and TransformerEngine's FusedAdam/FusedSGD. Set
    ``optimizer.megatron_fsdp_elementwise = True`` to vouch for another (faster:
    a step on DTensors dispatches every tensor through Python), or for one that
    gathers its whole-tensor part itself (the launcher's Muon: [Note: Muon on flat
    pieces] in training/optim/muon_optimizer.py)."""
    vouched = getattr(optimizer, ELEMENTWISE_ATTR, None)
    if vouched is not None:
        return bool(vouched)
    cls = type(optimizer)
    if cls in _ELEMENTWISE:
        return True
    return cls.__name__ in _FUSED_ELEMENTWISE and cls.__module__.startswith(("apex.", "transformer_engine."))


_WHOLE_TENSOR = {
    "Adafactor": "factors its second moment over each matrix's rows and columns and scales each update by "
                 "the parameter's RMS",
    "Muon": "orthogonalises each weight matrix's update (Newton-Schulz)",
}
"""torch optimizers whose update of a parameter needs all of it."""


def refuse_whole_tensor_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """[Note: local pieces] A torch optimizer known to need whole parameters, on
    sharded ones: refused before it changes anything, naming the choices."""
    cls = type(optimizer)
    why = _WHOLE_TENSOR.get(cls.__name__) if cls.__module__.startswith("torch.optim") else None
    if why is not None:
        raise NotImplementedError(
            f"torch.optim.{cls.__name__} {why}, so it needs whole parameters, but under this zero_dp_strategy "
            "each rank's optimizer holds a flat piece of each parameter. Use zero_dp_strategy='no_shard' "
            "(whole parameters on every rank) or an elementwise optimizer (AdamW, SGD, ...)"
        )


class _LocalSwap:
    """Run the optimizer's own step on the plain local pieces of DTensor parameters.

    An elementwise optimizer computes the same numbers on the local pieces, while a
    foreach op over DTensors dispatches every tensor through Python (tens of
    microseconds per tensor per op). Outside ``step()`` nothing changes: the param
    groups and the state hold DTensors, so norms, ``state_dict()`` and
    ``optimizer.state[param]`` keep their global meaning."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.swapped: list[tuple[dict, list]] = []
        self.twins: dict[torch.Tensor, torch.Tensor] = {}
        for group in optimizer.param_groups:
            params = group["params"]
            if not any(isinstance(p, DTensor) for p in params):
                continue
            local_params = []
            for p in params:
                local = p
                if isinstance(p, DTensor):
                    local = self.twins.get(p)
                    if local is None:
                        local = self.twins[p] = _local_twin(optimizer, p)
                local_params.append(local)
            self.swapped.append((group, params))
            group["params"] = local_params

    def restore(self) -> None:
        for group, params in self.swapped:
            group["params"] = params
        for p, local in self.twins.items():
            _restore_state(self.optimizer, p, local)
            local.grad = None
        self.swapped, self.twins = [], {}


def _local_twin(optimizer: torch.optim.Optimizer, param: DTensor) -> torch.Tensor:
    local = param._local_tensor.detach()  # shares storage with the parameter's shard
    with torch._C.DisableTorchFunctionSubclass():  # a read of .grad: no op for the subclass to route
        grad = param.grad
    if grad is not None:
        local.grad = grad._local_tensor if isinstance(grad, DTensor) else grad
    state = optimizer.state.pop(param, None)
    if state is not None:
        optimizer.state[local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state.items()}
        optimizer.state[local]["__dtensor_state__"] = state  # the DTensors to hand back
    return local


def _restore_state(optimizer: torch.optim.Optimizer, param: DTensor, local: torch.Tensor) -> None:
    state = optimizer.state.pop(local, None)
    if state is None:
        return
    previous = state.pop("__dtensor_state__", {})
    restored = {}
    for key, value in state.items():
        old = previous.get(key)
        if isinstance(old, DTensor) and old._local_tensor is value:
            restored[key] = old  # updated in place: the same DTensor
        elif isinstance(value, torch.Tensor) and value.shape == local.shape and value.dim() > 0:
            restored[key] = _like_param(value, param)
        else:
            restored[key] = value  # scalars such as Adam's step
    optimizer.state[param] = restored


# -- fully_shard(module, optimizer): the same optimizer over the sharded parameters -------
def rebuild_optimizer(old: torch.optim.Optimizer, module: torch.nn.Module, model: SteppedModel) -> torch.optim.Optimizer:
    """A new optimizer of ``old``'s class, hyper-parameters and param-group layout over
    ``model``'s distributed parameters. Only the keywords its ``__init__`` accepts
    are passed (``defaults`` also holds derived entries some versions add)."""
    # ``old`` holds the module's original parameters: the compute twins of the distributed ones.
    dist_of = {id(c): d for g in model.param_and_grad_buffer.groups for c, d in zip(g.params, g.dist_params)}
    # A TP plan's DTensor parameters were replaced by plain twins at wrapping.
    dist_of.update({key: dist_of[id(twin)] for key, twin in model.replaced_params.items()})
    accepted = _init_keywords(type(old))
    groups = []
    for group in old.param_groups:
        missing = [p for p in group["params"] if id(p) not in dist_of]
        if missing:
            raise ValueError("fully_shard: the optimizer holds parameters that are not in the module being sharded")
        derived = {k for k in old.defaults if accepted is not None and k not in accepted}
        new_group = {k: v for k, v in group.items() if k != "params" and k not in derived}
        new_group["params"] = [dist_of[id(p)] for p in group["params"]]
        groups.append(new_group)
    defaults = {k: v for k, v in old.defaults.items() if accepted is None or k in accepted}
    return type(old)(groups, **defaults)


def check_rebuildable(old: torch.optim.Optimizer) -> None:
    if old.state:
        raise ValueError(
            "fully_shard: the optimizer already holds state; build it before training, or pass a factory "
            "(lambda params: torch.optim.AdamW(params, ...))"
        )


def _init_keywords(cls: type) -> Optional[set[str]]:
    """Keyword names ``cls.__init__`` accepts (None: it takes ``**kwargs``)."""
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters} - {"self", "params"}


def _like_param(local: torch.Tensor, param: DTensor) -> DTensor:
    """``local`` as a DTensor laid out like ``param`` (its type too: piece_dtensor.py)."""
    if isinstance(param, PieceDTensor):
        return piece_dtensor(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
