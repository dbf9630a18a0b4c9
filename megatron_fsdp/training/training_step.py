"""One training iteration (micro batches, gradient sync, clipping, health checks,
optimizer step) and evaluation, the same code for Megatron-FSDP and DDP.

[Note: loss normalisation] Each micro batch contributes ``sum(token losses) / tokens
/ num_microbatches`` and data-parallel averaging divides by the DP size, so the
gradient is that of the mean token loss over the global batch. With
``--calculate-per-token-loss`` the micro batches contribute raw sums, nothing is
divided during the reduction, and the gradients are divided once by the global
batch's token count after the backward passes (Megatron-LM's per-token mode). The
logged ``lm loss`` is the global batch's mean token loss either way.

[Note: loss under context parallelism] With ``--context-parallel-size`` C each CP rank
holds T / C tokens of every sequence of its data-parallel rank's micro batch, and the
engine averages gradients over the data x context ranks (dp x C). A CP rank's micro
batch contributes ``sum(its token losses) / its tokens / num_microbatches``, as above:
its tokens are the whole micro batch's / C, so that is C x its share of the micro
batch's mean, and the average over the C ranks of one data-parallel rank is the
gradient of the micro batch's mean token loss (Megatron-LM's forward step divides
each rank's loss sum by its own token count the same way). Token counts and loss sums
are summed over the data x context ranks (``ModelBundle.loss_group``), so the logged
loss and the per-token divisor are the global batch's, as Megatron-LM reduces them over
its data-parallel group with context parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

from ..models.router import balancing_logged_as_rank_sum, finish_global_batch
from ..param_marks import is_expert_param
from .data import BatchLayout, SampleSource, get_microbatch
from .optim.loss_scaler import LossScaler
from .optim.lr_schedule import LRSchedule
from .model_setup import ModelBundle
from .observe.timers import Timers


class NaNLossError(RuntimeError):
    """A NaN/Inf loss or gradient with ``--check-for-nan-in-loss-and-grad`` (Megatron-LM raises too)."""


@dataclasses.dataclass(kw_only=True)
class TrainState:
    """Progress that a checkpoint must restore for a resumed run to match an uninterrupted one."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    """Validation samples evaluated so far: as Megatron-LM, each evaluation reads the
    next ``--eval-iters`` global batches of the validation split, not the first ones again."""
    floating_point_operations_so_far: float = 0.0
    skipped_train_samples: int = 0
    """Samples of ramped global batches left out by ``--decrease-batch-size-if-needed``
    (Megatron-LM's ``skipped_train_samples``)."""

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for field in dataclasses.fields(self):
            if field.name in ("consumed_valid_samples", "skipped_train_samples"):
                # Checkpoints written before these fields existed: 0, as Megatron-LM reads a
                # checkpoint without them.
                setattr(self, field.name, state.get(field.name, 0))
            else:
                setattr(self, field.name, state[field.name])


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepResult:
    lm_loss: float
    grad_norm: Optional[float]
    learning_rate: float
    skipped: bool
    nan: bool
    loss_scale: float
    params_norm: Optional[float] = None
    num_zeros: Optional[int] = None
    load_balancing_loss: Optional[float] = None
    """MoE models: Megatron-LM's ``load_balancing_loss`` of this iteration (see
    ``_moe_balancing_loss``); None for dense models."""
    mtp_losses: Optional[tuple[float, ...]] = None
    """``--mtp-num-layers`` models: Megatron-LM's ``mtp_1 loss``, ``mtp_2 loss`` ... of this
    iteration (each depth's token-mean loss, averaged over micro batches and data-parallel
    ranks); None without MTP."""


@dataclasses.dataclass(kw_only=True)
class StepContext:
    """Everything ``train_step`` reads besides the state it advances."""

    bundle: ModelBundle
    schedule: LRSchedule
    scaler: Optional[LossScaler]
    layout: BatchLayout
    device: torch.device
    clip_grad: float
    per_token_loss: bool
    check_for_nan: bool
    timers: Timers = dataclasses.field(default_factory=lambda: Timers(log_level=0))
    log_params_norm: bool = False
    log_num_zeros: bool = False
    seq_length: int = 0


def _global_sums(values: torch.Tensor, device: torch.device, group=None) -> torch.Tensor:
    """Sum a float64 vector over the data x context ranks (``group``, ModelBundle's
    ``loss_group``: every rank without tensor parallelism, whose TP ranks hold copies of the
    same losses), on ``device`` (no host read: see [Note: one host sync per iteration])."""
    values = values.to(device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(values, group=group)
    return values


@dataclasses.dataclass(kw_only=True)
class _MicroBatchSums:
    """What the micro batches of one iteration leave behind, on the device."""

    loss: torch.Tensor
    """Sum of the token losses (float64)."""
    tokens: int
    nonfinite: torch.Tensor
    """How many micro batches had a NaN/Inf loss (float64, for one all-reduce with ``loss``)."""
    balancing: Optional[torch.Tensor] = None
    """MoE: the sum over micro batches of the balancing loss (None: none recorded, as for
    a dense model, a zero coefficient or a balancing type without a loss)."""
    mtp: Optional[torch.Tensor] = None
    """MTP: the sum over micro batches of each depth's token-mean loss (D,), float64."""


def _forward_backward(ctx: StepContext, source: SampleSource, consumed: int) -> _MicroBatchSums:
    """[Note: one host sync per iteration] Nothing here reads a device value on the
    host: inputs are copied asynchronously from pinned memory, losses and NaN flags
    accumulate on the device, and ``train_step`` reads everything it needs at once."""
    bundle, layout = ctx.bundle, ctx.layout
    sums = _MicroBatchSums(loss=torch.zeros((), dtype=torch.float64, device=ctx.device), tokens=0,
                           nonfinite=torch.zeros((), dtype=torch.float64, device=ctx.device))
    scale = ctx.scaler.scale if ctx.scaler is not None else 1.0
    _set_moe_aux_loss_scale(ctx, scale)
    mtp = _mtp_driver(ctx)
    if mtp is not None:
        _set_mtp_loss_scale(ctx, mtp, scale)
    for m in range(layout.num_microbatches):
        with ctx.timers.time("batch-generator"):
            inputs, targets = get_microbatch(source, layout, consumed, m, ctx.device)
        last = m == layout.num_microbatches - 1
        # Gradients are synchronised only after the last micro batch (ZeRO-2/3 still reduce-scatter each one).
        sync = contextlib.nullcontext() if last else bundle.model.no_sync()
        with sync:
            if bundle.moe_balancing is not None:
                bundle.moe_balancing.clear()
            if bundle.mtp is not None:
                bundle.mtp.clear()
            with ctx.timers.time("forward-compute"):
                loss_sum, tokens = bundle.loss_fn(inputs, targets)
            mtp_losses = None if mtp is None else mtp.mtp_losses()
            if mtp_losses is not None:
                mtp_losses = mtp_losses.detach().to(device=ctx.device, dtype=torch.float64)
                sums.mtp = mtp_losses if sums.mtp is None else sums.mtp + mtp_losses
            balancing = _moe_balancing_loss(ctx)
            if balancing is not None:
                balancing = balancing.detach().to(device=ctx.device, dtype=torch.float64)
                sums.balancing = balancing if sums.balancing is None else sums.balancing + balancing
            if ctx.check_for_nan:
                sums.nonfinite += (~torch.isfinite(loss_sum.detach())).double()
            divisor = 1.0 if ctx.per_token_loss else tokens * layout.num_microbatches
            with ctx.timers.time("backward-compute"):
                (loss_sum * (scale / divisor)).backward()
        sums.loss += loss_sum.detach().double()
        sums.tokens += tokens
    return sums


def _moe_balancing_loss(ctx: StepContext) -> Optional[torch.Tensor]:
    """The MoE load-balancing loss of the forward just run, as Megatron-LM logs it (the
    embedded GPT's ``moe_load_balancing_loss`` or megatron-core's tracker: no
    coefficient, mean over MoE layers, on the device); None when none is recorded."""
    if ctx.bundle.moe_balancing is not None:
        return ctx.bundle.moe_balancing()
    module = getattr(ctx.bundle.model, "module", ctx.bundle.model)
    report = getattr(module, "moe_load_balancing_loss", None)
    return report() if report is not None else None


def _module(ctx: StepContext) -> torch.nn.Module:
    return getattr(ctx.bundle.model, "module", ctx.bundle.model)


def _mtp_driver(ctx: StepContext):
    """What sets the MTP loss's gradient factor and reports its per-depth losses: the
    embedded GPT itself, or megatron-core's ``McoreMTPLoss``; None without MTP."""
    if ctx.bundle.mtp is not None:
        return ctx.bundle.mtp
    module = _module(ctx)
    return module if isinstance(getattr(module, "mtp", None), torch.nn.Module) else None  # the GPT's MTP block


def _set_mtp_loss_scale(ctx: StepContext, mtp, scale: float) -> None:
    """The MTP loss gets the LM loss's factor of one micro batch, as Megatron-LM's forward
    step sets ``MTPLossAutoScaler``: the loss scale over the micro batches, or the loss
    scale alone in per-token mode (each depth's loss then enters as a token sum rescaled to
    this micro batch's tokens, and the gradients are divided by the global token count
    afterwards: models/mtp.py, [Note: per-token MTP loss])."""
    factor = scale if ctx.per_token_loss else scale / ctx.layout.num_microbatches
    mtp.set_mtp_loss_settings(backward_scale=factor, per_token=ctx.per_token_loss)


def _finalize_model_grads(ctx: StepContext) -> None:
    """Megatron-LM's ``finalize_model_grads``, once per global batch after the last
    backward and before the optimizer step (also of a step that is then skipped):
    - the wrapper's ``finish_grad_sync()`` (Megatron-core's ``FullyShardedDataParallel``
      defers every gradient sync until it is called, as upstream; ``fully_shard_model``
      has synced at the last micro batch already and returns at once);
    - the MoE routers: expert biases updated from the tokens per expert summed over the
      data-parallel ranks (every rank: MoE runs at tensor, pipeline and context parallel
      sizes 1 here), global-aux-loss counts reset (models/router.py, [Note: expert bias])."""
    finish = getattr(ctx.bundle.model, "finish_grad_sync", None)
    if finish is not None:
        finish()
    finish_global_batch(_module(ctx))


def _set_moe_aux_loss_scale(ctx: StepContext, scale: float) -> None:
    """MoE load-balancing losses get the factor the LM loss of one micro batch gets
    (see megatron_fsdp/models/moe.py, [Note: attaching the aux loss]): 1/micro-batches
    times the loss scale, or in per-token mode the micro batch's token count (the
    gradients are divided by the global token count afterwards). megatron-core models
    get Megatron-LM's own factor (its router multiplies by the tokens in per-token mode).

    With context parallelism the embedded MoE layers multiply this factor by CP
    themselves (``MoELayer.set_context_parallel_group``: Megatron-LM's schedule factor
    loss scale x CP / micro batches, which the gradient average over the data x context
    ranks divides out again), so it is set here without CP: 1 / micro batches as at CP 1,
    and in per-token mode this rank's tokens, T / CP per sequence (Megatron-LM's router
    multiplies by its local tokens x CP: the same product)."""
    if ctx.bundle.moe_balancing is not None:
        ctx.bundle.moe_balancing.set_moe_aux_loss_scale(
            scale if ctx.per_token_loss else scale / ctx.layout.num_microbatches)
        return
    module = getattr(ctx.bundle.model, "module", ctx.bundle.model)
    set_scale = getattr(module, "set_moe_aux_loss_scale", None)
    if set_scale is None:
        return
    tokens = ctx.layout.micro_batch_size * ctx.seq_length // ctx.layout.cp_size  # this CP rank's tokens
    set_scale(scale * (tokens if ctx.per_token_loss else 1.0 / ctx.layout.num_microbatches))


def _grad_norm(bundle: ModelBundle, params: list[torch.Tensor], clip_grad: float) -> torch.Tensor:
    """Clip (when ``clip_grad > 0``) and return the global gradient norm as a device
    scalar; works on sharded DTensor parameters, whose norm is reduced across the
    shard group. With experts spread over expert-parallel ranks (``expert_parallel_group``)
    the wrapper's own ``clip_grad_norm_`` does it: torch's cannot mix the dense and the
    expert meshes, and each EP rank's expert norm covers its own experts only."""
    max_norm = clip_grad if clip_grad > 0 else math.inf
    if bundle.expert_parallel_group is not None:
        norm = bundle.model.clip_grad_norm_(max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach().double().reshape(1)


@torch.no_grad()
def params_l2_norm(params: list[torch.Tensor], expert_parallel_group: Optional[dist.ProcessGroup] = None) -> float:
    """Norm of the (main) weights after the step, over all shards (``--log-params-norm``).
    ``expert_parallel_group``: experts spread over those ranks (EP > 1), each holding other
    experts, whose squared norms add up over it; the dense weights' are every rank's."""
    dense = [p for p in params if expert_parallel_group is None or not is_expert_param(p)]
    experts = [p for p in params if expert_parallel_group is not None and is_expert_param(p)]
    total = _squared_norm(dense)
    if experts:
        mine = _squared_norm(experts)
        dist.all_reduce(mine, group=expert_parallel_group)
        total = total + mine
    return float(total.sqrt())


def _squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm (float64) of sharded tensors, one norm per mesh (torch's cannot mix meshes)."""
    by_mesh: dict = {}
    for t in tensors:
        by_mesh.setdefault(getattr(t, "device_mesh", None), []).append(t.detach())
    total = torch.zeros((), dtype=torch.float64)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total = total + norm.double().cpu() ** 2
    return total


@torch.no_grad()
def count_zeros(params: list[torch.Tensor]) -> int:
    """Zero entries of the reduced gradients, over all shards (``--log-num-zeros-in-grad``)."""
    total = 0
    for p in params:
        if p.grad is None:
            continue
        zeros = (p.grad == 0).sum()
        total += int(zeros.full_tensor() if hasattr(zeros, "full_tensor") else zeros)
    return total


@torch.no_grad()
def _scale_grads(params: list[torch.Tensor], factor: float) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def train_step(ctx: StepContext, state: TrainState, source: SampleSource) -> StepResult:
    """One iteration. [Note: one host sync per iteration] The step reads the device
    once, after clipping and before the optimizer step: the global loss and token
    sums, the NaN flags of the micro batches and the gradient norm come back
    together (a loss scaler, ``--calculate-per-token-loss``, ``--log-num-zeros-in-grad``
    and ``--log-params-norm`` add reads of their own)."""
    bundle = ctx.bundle
    iteration = state.iteration + 1
    lr = ctx.schedule.apply(bundle.optimizer)
    bundle.optimizer.zero_grad()
    try:
        with ctx.timers.time("forward-backward"):
            sums = _forward_backward(ctx, source, state.consumed_train_samples)
    except FloatingPointError as exc:
        # Megatron-FSDP's check_for_nan_in_grad found a NaN/Inf gradient at the last
        # micro batch's gradient sync (a NaN loss gets there before the check below).
        raise NaNLossError(
            f"iteration {iteration}: {exc}. Lower --lr, check the data, or pass "
            "--no-check-for-nan-in-loss-and-grad to skip such steps"
        ) from exc
    _finalize_model_grads(ctx)
    parts = [sums.loss.reshape(1), torch.full((1,), float(sums.tokens), dtype=torch.float64, device=ctx.device),
             sums.nonfinite.reshape(1)]
    if sums.balancing is not None:
        parts.append(sums.balancing.reshape(1))
    if sums.mtp is not None:
        parts.append(sums.mtp.reshape(-1))
    totals = _global_sums(torch.cat(parts), ctx.device, ctx.bundle.loss_group)
    params = bundle.params
    if ctx.per_token_loss:
        # Megatron-FSDP summed over ranks (no DP scaling); DDP always averages, so undo its 1/dp.
        dp = ctx.layout.dp_size
        _scale_grads(params, (1.0 if bundle.is_fsdp else dp) / float(totals[1]))
    found_inf = False
    if ctx.scaler is not None:
        found_inf = ctx.scaler.unscale_and_check(params)
        ctx.scaler.update(found_inf)
    norm = None if found_inf else _grad_norm(bundle, params, ctx.clip_grad)
    host = (totals if norm is None else torch.cat([totals, norm])).tolist()  # the one host sync
    global_loss, global_tokens, nonfinite = host[0], int(host[1]), int(host[2])
    grad_norm = None if norm is None else host[-1]
    if nonfinite and ctx.check_for_nan:
        raise NaNLossError(
            f"iteration {iteration}: {nonfinite} micro batch loss(es) across the data-parallel ranks are NaN/Inf "
            f"(global loss sum {global_loss}); no weight was updated. Lower --lr, check the data, or pass "
            "--no-check-for-nan-in-loss-and-grad to skip such steps"
        )
    nan = grad_norm is not None and not math.isfinite(grad_norm)
    if nan and ctx.check_for_nan:
        names = bundle.nan_grad_names()
        raise NaNLossError(
            f"iteration {iteration}: the gradient norm is {grad_norm}; NaN/Inf in the reduced gradient of "
            f"{', '.join(names) or 'an unnamed parameter'}. Lower --lr or --initial-loss-scale, keep --clip-grad, "
            "check the data, or pass --no-check-for-nan-in-loss-and-grad to skip such steps"
        )
    skipped = found_inf or nan
    num_zeros = count_zeros(params) if ctx.log_num_zeros else None
    if skipped:
        bundle.optimizer.zero_grad()  # drop the bad gradients; weights stay as they were
    else:
        with ctx.timers.time("optimizer"):
            bundle.optimizer.step()
        # Megatron-LM: the schedule only advances on applied updates, by the samples trained on.
        ctx.schedule.step(ctx.layout.global_batch_size)
    params_norm = params_l2_norm(params, bundle.expert_parallel_group) if ctx.log_params_norm else None
    state.iteration += 1
    state.consumed_train_samples += ctx.layout.global_batch_size
    load_balancing, mtp_losses = _side_losses(ctx, sums, host)
    return StepResult(
        lm_loss=global_loss / global_tokens,
        grad_norm=grad_norm,
        learning_rate=lr,
        skipped=skipped,
        nan=nan or not math.isfinite(global_loss),
        loss_scale=ctx.scaler.scale if ctx.scaler is not None else 1.0,
        params_norm=params_norm,
        num_zeros=num_zeros,
        load_balancing_loss=load_balancing,
        mtp_losses=mtp_losses,
    )


def _side_losses(ctx: StepContext, sums: _MicroBatchSums, host: list[float]):
    """The logged MoE balancing loss and MTP losses from the all-reduced sums (``host``:
    loss, tokens, non-finite flag, then the balancing sum if any, then each MTP depth)."""
    dp = dist.get_world_size(ctx.bundle.data_parallel_group) if dist.is_initialized() else 1
    micro = ctx.layout.num_microbatches
    # Megatron-LM: the per-micro-batch balancing losses summed, times 1 / micro batches, averaged over DP
    # (summed for the global aux loss, whose ranks each hold a part of one loss). The sums run over the
    # data x context ranks: a CP rank's balancing loss is its share of its sequences' (moe.py), so the
    # CP ranks add up to the whole loss and only the data-parallel size divides.
    world = 1 if balancing_logged_as_rank_sum(_module(ctx)) else dp
    load_balancing = None if sums.balancing is None else host[3] / world / micro
    mtp_losses = None
    if sums.mtp is not None:  # Megatron-LM: summed over micro batches, averaged over DP, times 1 / micro batches
        first = 3 + (sums.balancing is not None)
        mtp_losses = tuple(v / dp / micro for v in host[first:first + sums.mtp.numel()])
    return load_balancing, mtp_losses


@torch.no_grad()
def evaluate(ctx: StepContext, source: SampleSource, eval_iters: int, consumed_samples: int = 0) -> float:
    """Mean token loss over ``eval_iters`` global batches of ``source`` starting at sample
    ``consumed_samples`` (``TrainState.consumed_valid_samples``; losses summed on the
    device, read once at the end)."""
    loss_total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    tokens_total = 0
    for it in range(eval_iters):
        consumed = consumed_samples + it * ctx.layout.global_batch_size
        for m in range(ctx.layout.num_microbatches):
            inputs, targets = get_microbatch(source, ctx.layout, consumed, m, ctx.device)
            loss_sum, tokens = ctx.bundle.loss_fn(inputs, targets)
            loss_total += loss_sum.double()
            tokens_total += tokens
    totals = _global_sums(torch.stack([loss_total, torch.tensor(float(tokens_total), dtype=torch.float64,
                                                                  device=ctx.device)]), ctx.device,
                          ctx.bundle.loss_group).tolist()
    return totals[0] / totals[1]
