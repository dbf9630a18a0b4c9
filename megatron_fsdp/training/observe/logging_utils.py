"""What the launcher prints: Megatron-LM's iteration line, per-rank memory, the
validation box and the JSON metrics
file. Only rank 0 logs (through ``logging``); other ranks report errors only.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import resource
import sys
from typing import Optional

import torch
import torch.distributed as dist

from megatron_fsdp.comm import device as device_mod

logger = logging.getLogger("megatron_fsdp.pretrain")

_MB = 1024 * 1024


def setup_logging(rank: int, level: Optional[int] = None) -> None:
    """Rank 0 logs at ``level`` (``--logging-level``, default INFO) to stdout; other
    ranks only WARNING and above, prefixed by rank."""
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or logging.INFO) if rank == 0 else max(level or 0, logging.WARNING))


@dataclasses.dataclass(kw_only=True)
class IntervalStats:
    """Sums over the current log interval, as Megatron-LM's ``total_loss_dict``: the
    loss is averaged over *advanced* iterations only (a skipped iteration's loss is
    not in the average), elapsed time over advanced + skipped ones."""

    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    elapsed_s: float = 0.0
    loss_sum: float = 0.0
    load_balancing_sum: Optional[float] = None
    """MoE: the sum of ``load_balancing_loss`` over the interval's iterations, skipped ones
    included, as Megatron-core adds it to ``total_loss_dict`` (still divided by the
    advanced iterations); None for dense models."""
    balancing_name: str = "load_balancing_loss"
    """Megatron-core's name of that loss (``seq_load_balancing_loss`` for seq_aux_loss)."""
    mtp_sums: Optional[list[float]] = None
    """``--mtp-num-layers``: each depth's ``mtp_k loss`` summed over the interval's iterations,
    skipped ones included (megatron-core's MTP tracker adds every iteration), None without MTP."""

    @property
    def iterations(self) -> int:
        return self.advanced + self.skipped

    def add(self, result, elapsed_s: float) -> None:
        self.elapsed_s += elapsed_s
        balancing = getattr(result, "load_balancing_loss", None)
        if balancing is not None:
            self.load_balancing_sum = (self.load_balancing_sum or 0.0) + balancing
        mtp = getattr(result, "mtp_losses", None)
        if mtp is not None:
            self.mtp_sums = [a + b for a, b in zip(self.mtp_sums or [0.0] * len(mtp), mtp)]
        if result.skipped:
            self.skipped += 1
            self.nan += int(result.nan)
        else:
            self.advanced += 1
            self.loss_sum += result.lm_loss

    @property
    def mean_loss(self) -> Optional[float]:
        return self.loss_sum / self.advanced if self.advanced else None

    @property
    def mean_load_balancing_loss(self) -> Optional[float]:
        if self.load_balancing_sum is None:
            return None
        return self.load_balancing_sum / max(self.advanced, 1)

    @property
    def mean_mtp_losses(self) -> Optional[list[float]]:
        """Each depth's ``mtp_k loss`` over the interval, divided by the advanced iterations
        as Megatron-LM divides every ``total_loss_dict`` entry."""
        return None if self.mtp_sums is None else [v / max(self.advanced, 1) for v in self.mtp_sums]


def format_iteration_line(*, iteration: int, train_iters: int, consumed_samples: int, stats: IntervalStats,
                          throughput: Optional[float], learning_rate: Optional[float], global_batch_size: int,
                          loss_scale: float, grad_norm: Optional[float], num_zeros: Optional[int] = None,
                          params_norm: Optional[float] = None, now: Optional[datetime.datetime] = None,
                          skipped_samples: int = 0) -> str:
    """Megatron-LM's ``training_log`` line, field for field: ``throughput`` only with
    ``--log-throughput`` (None otherwise), ``num zeros`` / ``params norm`` only when
    computed (``--log-num-zeros-in-grad`` / ``--log-params-norm``), for MoE models
    (``--num-experts``) ``load_balancing_loss`` after ``lm loss``, and with
    ``--mtp-num-layers`` ``mtp_1 loss``, ``mtp_2 loss`` ... after those."""
    ms = 1000.0 * stats.elapsed_s / max(stats.iterations, 1)
    line = f" [{(now or datetime.datetime.now()).strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    line += f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    if skipped_samples > 0:  # --decrease-batch-size-if-needed
        line += f" skipped samples: {skipped_samples:12d} |"
    line += f" elapsed time per iteration (ms): {ms:.1f} |"
    if throughput is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    if learning_rate is not None:
        line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    loss = stats.mean_loss
    if loss is not None and loss >= 0.0:
        line += f" lm loss: {loss:.6E} |"
    balancing = stats.mean_load_balancing_loss  # MoE models: Megatron-core's name, after lm loss
    if balancing is not None and balancing >= 0.0:
        line += f" {stats.balancing_name}: {balancing:.6E} |"
    for depth, mtp_loss in enumerate(stats.mean_mtp_losses or [], start=1):  # megatron-core's MTP tracker names
        if mtp_loss >= 0.0:
            line += f" mtp_{depth} loss: {mtp_loss:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        line += f" num zeros: {num_zeros} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {stats.skipped:3d} |"
    line += f" number of nan iterations: {stats.nan:3d} |"
    return line


# -- memory -----------------------------------------------------------------------
def _rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process, from /proc (Linux) or getrusage."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024  # reported in kB
    except OSError:
        pass
    peak = fields.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return fields.get("VmRSS", peak), peak


def memory_snapshot(model, device: torch.device) -> dict:
    rss, max_rss = _rss_bytes()
    snap = {"rss": rss, "max_rss": max_rss,
            "allocated": device_mod.memory_allocated(device), "max_allocated": device_mod.max_memory_allocated(device)}
    accounting = getattr(model, "buffer_accounting", None)
    if accounting is not None:
        snap["persistent"] = dict(accounting.persistent)
        snap["temporary"] = accounting.temporary
        snap["peak_temporary"] = accounting.peak_temporary
    return snap


def log_memory(model, device: torch.device, iteration: int) -> list[dict]:
    """Gather every rank's memory to rank 0 and log one line per rank (collective)."""
    snap = memory_snapshot(model, device)
    snaps = [snap]
    if dist.is_initialized():
        snaps = [None] * dist.get_world_size()
        dist.all_gather_object(snaps, snap)
    for rank, s in enumerate(snaps):
        line = f"[Rank {rank}] (after {iteration} iterations) memory (MB) | rss: {s['rss'] / _MB:.1f} | " \
               f"max rss: {s['max_rss'] / _MB:.1f}"
        if device.type == "cuda":
            line += f" | allocated: {s['allocated'] / _MB:.1f} | max allocated: {s['max_allocated'] / _MB:.1f}"
        if "persistent" in s:
            buffers = ", ".join(f"{k}: {v / _MB:.3f}" for k, v in sorted(s["persistent"].items()))
            line += f" | megatron_fsdp persistent buffers: {{{buffers}}} | temporary: {s['temporary'] / _MB:.3f}" \
                    f" | peak temporary: {s['peak_temporary'] / _MB:.3f}"
        logger.info(line)
    return snaps


def validation_ppl(loss: float) -> float:
    return float("inf") if loss > 700 else float(torch.tensor(loss).exp())


def log_validation(iteration: int, loss: float, label: str = "validation") -> None:
    ppl = validation_ppl(loss)
    body = f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    bar = "-" * len(body)
    logger.info("%s\n%s\n%s", bar, body, bar)


# -- metrics file -----------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class MetricsRecorder:
    """Per-iteration metrics of this process, written as JSON by rank 0."""

    iterations: list[int] = dataclasses.field(default_factory=list)
    lm_loss: list[float] = dataclasses.field(default_factory=list)
    grad_norm: list[Optional[float]] = dataclasses.field(default_factory=list)
    learning_rate: list[float] = dataclasses.field(default_factory=list)
    load_balancing_loss: list[Optional[float]] = dataclasses.field(default_factory=list)
    """MoE models' per-iteration ``load_balancing_loss`` (empty for dense models)."""
    mtp_losses: list[list[float]] = dataclasses.field(default_factory=list)
    """``--mtp-num-layers`` models' per-iteration ``[mtp_1 loss, mtp_2 loss, ...]`` (empty without MTP)."""
    validation: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    memory: list[dict] = dataclasses.field(default_factory=list)

    def record(self, iteration: int, result) -> None:
        self.iterations.append(iteration)
        self.lm_loss.append(result.lm_loss)
        self.grad_norm.append(result.grad_norm)
        self.learning_rate.append(result.learning_rate)
        if getattr(result, "load_balancing_loss", None) is not None:
            self.load_balancing_loss.append(result.load_balancing_loss)
        if getattr(result, "mtp_losses", None) is not None:
            self.mtp_losses.append(list(result.mtp_losses))

    def write(self, path: str, **extra) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self) | extra, f, indent=1)
