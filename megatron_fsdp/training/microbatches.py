"""The global batch of each iteration: Megatron-LM's number-of-microbatches
calculator, as pure arithmetic on the samples consumed so far.

Without ``--rampup-batch-size`` every iteration trains on ``--global-batch-size``
samples (``--micro-batch-size`` x micro batches x data-parallel ranks). With
``--decrease-batch-size-if-needed`` a global batch that is not a whole number of
micro batches on every rank is rounded down to one, and the samples left out are
counted as skipped (Megatron-LM's ``skipped_train_samples``).

[Note: batch-size ramp-up] ``--rampup-batch-size s d R`` with target global batch G:
the batch grows from s to G in n = (G - s) / d steps of d, one step every
r = R / n consumed samples (r is a float, as in Megatron-LM). After c consumed
samples the global batch is

    G                          when c > R
    s + floor(c / r) * d       otherwise

Each iteration trains on that batch (rounded down with
``--decrease-batch-size-if-needed``), adds what it trained on to the consumed
samples, and a sample-counting LR schedule advances by the same amount; the number
of micro batches per rank follows. Ramp-up needs sample-based training
(``--train-samples``); the iteration budget is what Megatron-LM's
``update_train_iters`` counts: iterations of the ramp while at most R (and at most
``--train-samples``) samples are consumed, then whole target batches of the rest.

Megatron-LM checks that each batch divides into micro batches only when an
iteration reaches it (an assertion mid-run); ``BatchSchedule.first_problem`` walks
the batches a run will train on before it starts.

Provenance: Megatron-LM ran this ramp (megatron-core's
``RampupBatchsizeNumMicroBatchesCalculator``, unchanged in megatron-core 0.16.1,
which the tests compare against) until its commit 532ad926 (April 2026), which
replaced it by ``--step-batch-size-schedule``. The pinned commit
(flag_data/megatron_lm_flags.csv) still parses ``--rampup-batch-size`` but no longer
reads it; this launcher keeps the ramp's meaning instead of ignoring the flag.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchRampup:
    """``--rampup-batch-size <start> <increment> <ramp samples>``."""

    start: int
    """Global batch size of the first iteration."""
    increment: int
    """Growth of the global batch at each step of the ramp."""
    ramp_samples: int
    """Consumed samples over which the batch grows from ``start`` to the target."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class IterationBatch:
    """The batch one iteration trains on."""

    global_batch_size: int
    """Megatron-LM's current global batch size: the ramp's value, or the target."""
    running_global_batch_size: int
    """Samples the iteration trains on: ``global_batch_size``, rounded down to a whole
    number of micro batches per rank with ``--decrease-batch-size-if-needed``."""
    num_microbatches: int
    """Micro batches per data-parallel rank."""

    @property
    def skipped_samples(self) -> int:
        """Samples of the global batch left out by ``--decrease-batch-size-if-needed``."""
        return self.global_batch_size - self.running_global_batch_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSchedule:
    """Global batch per iteration, a function of the consumed samples (see the
    module's [Note: batch-size ramp-up])."""

    global_batch_size: int
    """The target (``--global-batch-size``): the batch after the ramp, or always."""
    micro_batch_size: int
    data_parallel_size: int
    rampup: Optional[BatchRampup] = None
    decrease_batch_size_if_needed: bool = False
    """Round a batch that does not split into whole micro batches per rank down to one
    that does, instead of refusing it."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        problem = rampup_problem(self.rampup, self.global_batch_size) if self.rampup else None
        if problem:
            raise ValueError(problem)

    @classmethod
    def from_args(cls, args, data_parallel_size: int) -> "BatchSchedule":
        rampup = None
        if args.rampup_batch_size is not None:
            start, increment, samples = (int(v) for v in args.rampup_batch_size)
            rampup = BatchRampup(start=start, increment=increment, ramp_samples=samples)
        global_batch = args.global_batch_size or args.micro_batch_size * data_parallel_size
        return cls(global_batch_size=global_batch, micro_batch_size=args.micro_batch_size,
                   data_parallel_size=data_parallel_size, rampup=rampup,
                   decrease_batch_size_if_needed=bool(args.decrease_batch_size_if_needed))

    @property
    def samples_per_step(self) -> int:
        """Samples of one micro batch on every rank: the unit a global batch is made of."""
        return self.micro_batch_size * self.data_parallel_size

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Megatron-LM's current global batch size after ``consumed_samples``."""
        ramp = self.rampup
        if ramp is None or consumed_samples > ramp.ramp_samples:
            return self.global_batch_size
        per_increment = ramp.ramp_samples / ((self.global_batch_size - ramp.start) // ramp.increment)
        return ramp.start + int(consumed_samples / per_increment) * ramp.increment

    def at(self, consumed_samples: int) -> IterationBatch:
        """The batch of the iteration that starts after ``consumed_samples``; raises
        ``ValueError`` (what, why, the fix) for a batch that cannot be trained."""
        batch = self.global_batch_size_at(consumed_samples)
        running = batch
        if batch % self.samples_per_step:
            if not self.decrease_batch_size_if_needed:
                raise ValueError(self._indivisible(batch, consumed_samples))
            running = batch // self.samples_per_step * self.samples_per_step
        if running == 0:
            raise ValueError(
                f"the global batch size {batch} (after {consumed_samples} consumed samples) is smaller than "
                f"--micro-batch-size {self.micro_batch_size} x data-parallel size {self.data_parallel_size} = "
                f"{self.samples_per_step}, so --decrease-batch-size-if-needed would train on 0 samples; use a "
                f"batch of at least {self.samples_per_step} or fewer ranks / a smaller micro batch")
        return IterationBatch(global_batch_size=batch, running_global_batch_size=running,
                              num_microbatches=running // self.samples_per_step)

    def _indivisible(self, batch: int, consumed_samples: int) -> str:
        where = "--global-batch-size" if self.rampup is None else (
            f"--rampup-batch-size {self.rampup.start} {self.rampup.increment} {self.rampup.ramp_samples}: after "
            f"{consumed_samples} consumed samples the global batch size")
        return (f"{where} {batch} is not divisible by --micro-batch-size {self.micro_batch_size} x data-parallel "
                f"size {self.data_parallel_size} = {self.samples_per_step} (Megatron-LM asserts this when the "
                f"iteration reaches it); make every batch size of the ramp a multiple of {self.samples_per_step}, "
                "or pass --decrease-batch-size-if-needed to train on it rounded down")

    def iterations(self, consumed_samples: int, count: int) -> Iterator[tuple[int, IterationBatch]]:
        """(consumed samples before it, batch) of the next ``count`` iterations; stops
        early once the batch no longer changes (after the ramp). Raises as ``at``."""
        for _ in range(count):
            batch = self.at(consumed_samples)
            yield consumed_samples, batch
            if self.rampup is None or consumed_samples > self.rampup.ramp_samples:
                return
            consumed_samples += batch.running_global_batch_size

    def first_problem(self, consumed_samples: int, count: int) -> Optional[str]:
        """Why one of the next ``count`` iterations from ``consumed_samples`` cannot
        train, or None (checked before a run or a resume starts)."""
        try:
            for _ in self.iterations(consumed_samples, count):
                pass
        except ValueError as exc:
            return str(exc)
        return None

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` budget, as Megatron-LM's
        ``update_train_iters`` counts them: constant batches of ``global_batch_size``
        (a partial last batch dropped), or the ramp's batches while at most the ramp
        samples and at most ``train_samples`` are consumed, then whole target batches
        of the rest. (It advances by the ramp's batch, not the one trained on after
        ``--decrease-batch-size-if-needed``, as Megatron-LM does.)"""
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iterations = consumed = 0
        while consumed <= self.rampup.ramp_samples and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations


def rampup_problem(ramp: BatchRampup, global_batch_size: int) -> Optional[str]:
    """Why ``--rampup-batch-size`` cannot ramp to ``global_batch_size``, or None:
    Megatron-LM's calculator asserts start, increment > 0 and G - start a non-negative
    multiple of the increment, and divides by the number of increments and by the
    samples per increment, so a ramp of no steps or over 0 samples crashes it."""
    flag = f"--rampup-batch-size {ramp.start} {ramp.increment} {ramp.ramp_samples}"
    if ramp.start <= 0 or ramp.increment <= 0 or ramp.ramp_samples <= 0:
        return (f"{flag}: the start batch size, the increment and the ramp-up samples must all be positive "
                "(<start batch size> <batch size increment> <ramp-up samples>)")
    if ramp.start >= global_batch_size:
        return (f"{flag}: the start batch size must be smaller than --global-batch-size {global_batch_size} (the "
                "batch the ramp grows to); lower the start, or drop --rampup-batch-size for a constant batch")
    if (global_batch_size - ramp.start) % ramp.increment:
        steps = math.ceil((global_batch_size - ramp.start) / ramp.increment)
        return (f"{flag}: --global-batch-size {global_batch_size} minus the start {ramp.start} is not a multiple of "
                f"the increment {ramp.increment} (Megatron-LM's rule); e.g. --global-batch-size "
                f"{ramp.start + steps * ramp.increment}, or an increment that divides {global_batch_size - ramp.start}")
    return None


def batch_problems(args, world_size: int) -> list[str]:
    """Megatron-LM's rules for ``--rampup-batch-size`` / ``--decrease-batch-size-if-needed``,
    and every batch of the ramp checked up front (see ``BatchSchedule.first_problem``)."""
    if args.micro_batch_size is None or args.micro_batch_size <= 0 or (args.global_batch_size or 1) <= 0:
        return []  # reported by the batch rule
    problems = []
    if args.rampup_batch_size is not None and args.train_iters is not None:
        problems.append(f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))} with --train-iters: "
                        "Megatron-LM ramps the batch in sample-based training only; give --train-samples (and "
                        "--lr-decay-samples / --lr-warmup-samples) instead of --train-iters")
    try:
        schedule = BatchSchedule.from_args(args, world_size)
    except ValueError as exc:
        return problems + [str(exc)]
    if schedule.rampup is None or schedule.global_batch_size % schedule.samples_per_step:
        # The target's divisibility is the batch rule's (Megatron-LM asserts it for the
        # evaluation batch, --global-batch-size by default, whatever the flags).
        return problems
    iterations = schedule.train_iters(args.train_samples) if (args.train_samples or 0) > 0 else 1
    problem = schedule.first_problem(0, iterations)
    return problems + ([problem] if problem else [])
