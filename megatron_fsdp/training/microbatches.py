"""The global batch of each iteration: Megatron-LM's number-of-microbatches
calculator, as pure arithmetic on the samples consumed so far.

Without ``--rampup-batch-size`` or ``--step-batch-size-schedule`` every iteration
trains on ``--global-batch-size`` samples (``--micro-batch-size`` x micro batches x
data-parallel ranks). With ``--decrease-batch-size-if-needed`` a global batch that is
not a whole number of micro batches on every rank is rounded down to one, and the
samples left out are counted as skipped (Megatron-LM's ``skipped_train_samples``).

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

[Note: step batch-size schedule] ``--step-batch-size-schedule "0:384 200B:768"``
(Megatron-LM since its commit 532ad926, ``StepBatchsizeNumMicroBatchesCalculator``):
space- or comma-separated ``THRESHOLD:BATCH`` entries, each number with an optional
K/M/B/T suffix (10^3 ... 10^12). Megatron-LM hands the calculator ``--seq-length``,
so a threshold counts *tokens*, converted to consumed samples by
``tokens // seq_length`` (200B tokens at 4096 = 48,828,125 samples); entries are
sorted by that, must start at 0 samples and strictly increase. After c consumed
samples the global batch is the batch of the last entry whose threshold c has
reached (``c >= threshold``). The schedule sets every training batch, so
``--global-batch-size`` is refused with it and defaults to micro batch x DP size
(the evaluation batch, as in Megatron-LM); ``--decrease-batch-size-if-needed`` is
refused too. ``--train-samples`` gives ``update_train_iters``'s count: iterations
while the consumed samples are below the budget, so a last batch that passes it is
trained whole. Megatron-LM checks a batch's divisibility (and that the micro batches
never decrease) only when an iteration reaches it, so entries a run never reaches (or
already passed, on a resume with more ranks) may be anything; ``first_problem``
checks the reached ones up front.

Two deliberate differences, both refusals rather than other numbers: Megatron-LM
parses each number as ``int(float(text) * multiplier)``, which reads ``32.3K`` as
32299; where that changes a batch size or a threshold's samples the value is
refused (write it in whole units), and a fractional batch size (which it truncates)
too. And it accepts ``--train-iters`` with a schedule, but then sizes the training
data and the LR horizon by micro batch x DP size while the schedule trains larger
batches; a schedule here needs ``--train-samples``.

Provenance of the ramp: Megatron-LM ran it (megatron-core's
``RampupBatchsizeNumMicroBatchesCalculator``, unchanged in megatron-core 0.16.1,
which the tests compare against) until its commit 532ad926 (April 2026), which
replaced it by ``--step-batch-size-schedule``. The pinned commit
(flag_data/megatron_lm_flags.csv) still parses ``--rampup-batch-size`` but no longer
reads it; this launcher keeps the ramp's meaning instead of ignoring the flag.
"""

from __future__ import annotations

import bisect
import dataclasses
import decimal
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
class BatchStep:
    """One entry of ``--step-batch-size-schedule``, in samples."""

    samples: int
    """Consumed samples from which the entry's batch applies (its tokens // --seq-length)."""
    global_batch_size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSteps:
    """``--step-batch-size-schedule`` (see the module's [Note: step batch-size schedule])."""

    text: str
    """The flag's value as given, for messages."""
    steps: tuple[BatchStep, ...]
    """By ``samples``: the first at 0, strictly increasing."""

    def __post_init__(self) -> None:
        starts = [step.samples for step in self.steps]
        if not starts or starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])):
            raise ValueError(f"--step-batch-size-schedule {self.text!r}: the steps must start at 0 samples and "
                             f"strictly increase, got starts {starts}")
        if any(step.global_batch_size <= 0 for step in self.steps):
            raise ValueError(f"--step-batch-size-schedule {self.text!r}: every batch size must be positive")

    @classmethod
    def parse(cls, text: str, seq_length: int) -> "BatchSteps":
        """The flag's value, thresholds in tokens of ``seq_length`` (Megatron-LM passes
        ``--seq-length``); raises ``ValueError`` naming the entry and the fix."""
        entries = text.replace(",", " ").split()
        if not entries:
            raise ValueError(f"--step-batch-size-schedule {text!r} has no entries; give THRESHOLD:BATCH pairs, "
                             "thresholds in tokens from 0, e.g. '0:384 200B:768 400B:1152'")
        parsed: dict[int, str] = {}
        steps = []
        for entry in entries:
            step = _parse_entry(text, entry, seq_length)
            if step.samples in parsed:
                raise ValueError(
                    f"--step-batch-size-schedule {text!r}: entries {parsed[step.samples]!r} and {entry!r} both start "
                    f"at {step.samples} consumed samples (thresholds are tokens, // --seq-length {seq_length}); "
                    f"put them at least {seq_length} tokens apart, or drop one")
            parsed[step.samples] = entry
            steps.append(step)
        steps.sort(key=lambda step: step.samples)
        if steps[0].samples != 0:
            first = parsed[steps[0].samples]
            raise ValueError(
                f"--step-batch-size-schedule {text!r}: the first entry must start at 0, but the smallest threshold "
                f"{first!r} is {steps[0].samples} samples (thresholds are tokens, // --seq-length {seq_length}); add "
                "a 0:<batch size> entry for the start of training")
        return cls(text=text, steps=tuple(steps))

    @property
    def final_global_batch_size(self) -> int:
        return self.steps[-1].global_batch_size

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The batch of the last step whose start ``consumed_samples`` has reached."""
        index = bisect.bisect_right([step.samples for step in self.steps], consumed_samples) - 1
        return self.steps[max(index, 0)].global_batch_size

    def next_start(self, consumed_samples: int) -> Optional[int]:
        """The first step start after ``consumed_samples``; None past the last."""
        return next((step.samples for step in self.steps if step.samples > consumed_samples), None)


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _parse_count(text: str, entry: str, what: str) -> tuple[decimal.Decimal, int]:
    """(exact value, Megatron-LM's value) of a number with an optional K/M/B/T suffix:
    Megatron-LM reads it as ``int(float(number) * multiplier)``, which can land one
    below the exact value (``32.3K`` -> 32299)."""
    body = text.strip().upper()
    multiplier = _SUFFIXES.get(body[-1:], 1)
    if multiplier != 1:
        body = body[:-1]
    try:
        exact = decimal.Decimal(body) * multiplier
        theirs = int(float(body) * multiplier)
    except (ArithmeticError, ValueError):  # decimal.InvalidOperation, inf (OverflowError), nan
        raise ValueError(f"--step-batch-size-schedule entry {entry!r}: the {what} {text!r} is not a number; write "
                         "digits with an optional K, M, B or T suffix (10^3 ... 10^12), e.g. 250B") from None
    return exact, theirs


def _parse_entry(text: str, entry: str, seq_length: int) -> BatchStep:
    flag = f"--step-batch-size-schedule {text!r}"
    if ":" not in entry:
        raise ValueError(f"{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. 200B:768, the threshold in "
                         "tokens)")
    threshold, batch = entry.split(":", 1)
    tokens, tokens_theirs = _parse_count(threshold, entry, "threshold")
    size, size_theirs = _parse_count(batch, entry, "batch size")
    if tokens < 0:
        raise ValueError(f"{flag}: entry {entry!r} has a negative threshold; thresholds count tokens from 0")
    if size <= 0 or size != size.to_integral_value():  # Megatron-LM truncates a fraction: refused here
        raise ValueError(f"{flag}: entry {entry!r} has batch size {batch!r}, which is not a positive whole number "
                         "of samples")
    if size_theirs != size:
        raise ValueError(f"{flag}: entry {entry!r}: Megatron-LM's parser reads the batch size {batch!r} as "
                         f"{size_theirs} (floating-point rounding), not {int(size)}; write it as {int(size)}")
    samples, samples_theirs = int(tokens) // seq_length, tokens_theirs // seq_length
    if samples != samples_theirs:
        raise ValueError(f"{flag}: entry {entry!r}: Megatron-LM's parser reads the threshold {threshold!r} as "
                         f"{tokens_theirs} tokens = {samples_theirs} samples (floating-point rounding), not "
                         f"{samples}; write it in whole tokens, e.g. {int(tokens)}")
    return BatchStep(samples=samples, global_batch_size=int(size))


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
    module's [Note: batch-size ramp-up] and [Note: step batch-size schedule])."""

    global_batch_size: int
    """The target (``--global-batch-size``): the batch after the ramp, or always; with
    ``steps``, the last step's batch."""
    micro_batch_size: int
    data_parallel_size: int
    rampup: Optional[BatchRampup] = None
    steps: Optional[BatchSteps] = None
    """``--step-batch-size-schedule``; exclusive with ``rampup``."""
    decrease_batch_size_if_needed: bool = False
    """Round a batch that does not split into whole micro batches per rank down to one
    that does, instead of refusing it (not with ``steps``, as Megatron-LM)."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        problem = rampup_problem(self.rampup, self.global_batch_size) if self.rampup else None
        if problem:
            raise ValueError(problem)
        if self.steps is not None:
            if self.rampup is not None:
                raise ValueError("--rampup-batch-size and --step-batch-size-schedule are exclusive (the step "
                                 "schedule replaced the ramp in Megatron-LM); keep one")
            if self.decrease_batch_size_if_needed:
                raise ValueError(f"--step-batch-size-schedule {self.steps.text!r} with --decrease-batch-size-if-"
                                 "needed: Megatron-LM refuses the pair (a step schedule never rounds a batch); drop "
                                 "--decrease-batch-size-if-needed and make each batch size a multiple of "
                                 f"--micro-batch-size x data-parallel size = {self.samples_per_step}")
            if self.global_batch_size != self.steps.final_global_batch_size:
                raise ValueError(f"global_batch_size={self.global_batch_size} must be the step schedule's last batch "
                                 f"{self.steps.final_global_batch_size}")

    @classmethod
    def from_args(cls, args, data_parallel_size: int) -> "BatchSchedule":
        """Raises ``ValueError`` for a bad ``--rampup-batch-size`` / ``--step-batch-size-schedule``."""
        rampup = steps = None
        if args.rampup_batch_size is not None:
            start, increment, samples = (int(v) for v in args.rampup_batch_size)
            rampup = BatchRampup(start=start, increment=increment, ramp_samples=samples)
        global_batch = args.global_batch_size or args.micro_batch_size * data_parallel_size
        if getattr(args, "step_batch_size_schedule", None) is not None:
            steps = BatchSteps.parse(args.step_batch_size_schedule, seq_length=args.seq_length)
            global_batch = steps.final_global_batch_size
        return cls(global_batch_size=global_batch, micro_batch_size=args.micro_batch_size,
                   data_parallel_size=data_parallel_size, rampup=rampup, steps=steps,
                   decrease_batch_size_if_needed=bool(args.decrease_batch_size_if_needed))

    @property
    def samples_per_step(self) -> int:
        """Samples of one micro batch on every rank: the unit a global batch is made of."""
        return self.micro_batch_size * self.data_parallel_size

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Megatron-LM's current global batch size after ``consumed_samples``."""
        if self.steps is not None:
            return self.steps.global_batch_size_at(consumed_samples)
        ramp = self.rampup
        if ramp is None or consumed_samples > ramp.ramp_samples:
            return self.global_batch_size
        per_increment = ramp.ramp_samples / ((self.global_batch_size - ramp.start) // ramp.increment)
        return ramp.start + int(consumed_samples / per_increment) * ramp.increment

    def settled(self, consumed_samples: int) -> bool:
        """Whether the batch stays the same from ``consumed_samples`` on."""
        if self.steps is not None:
            return consumed_samples >= self.steps.steps[-1].samples
        return self.rampup is None or consumed_samples > self.rampup.ramp_samples

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
        per_step = (f"--micro-batch-size {self.micro_batch_size} x data-parallel size {self.data_parallel_size} = "
                    f"{self.samples_per_step}")
        if self.steps is not None:
            return (f"--step-batch-size-schedule {self.steps.text!r}: after {consumed_samples} consumed samples the "
                    f"global batch size {batch} is not divisible by {per_step} (Megatron-LM asserts this when the "
                    f"iteration reaches it); make every batch size the run reaches a multiple of "
                    f"{self.samples_per_step}, or change the micro batch / number of ranks")
        where = "--global-batch-size" if self.rampup is None else (
            f"--rampup-batch-size {self.rampup.start} {self.rampup.increment} {self.rampup.ramp_samples}: after "
            f"{consumed_samples} consumed samples the global batch size")
        return (f"{where} {batch} is not divisible by {per_step} (Megatron-LM asserts this when the iteration "
                f"reaches it); make every batch size of the ramp a multiple of {self.samples_per_step}, or pass "
                "--decrease-batch-size-if-needed to train on it rounded down")

    def iterations(self, consumed_samples: int, count: int) -> Iterator[tuple[int, IterationBatch]]:
        """(consumed samples before it, batch) of the next ``count`` iterations; stops
        early once the batch no longer changes. Raises as ``at``."""
        for _ in range(count):
            batch = self.at(consumed_samples)
            yield consumed_samples, batch
            if self.settled(consumed_samples):
                return
            consumed_samples += batch.running_global_batch_size

    def _batch_changes(self, consumed_samples: int, count: int) -> Iterator[tuple[int, IterationBatch]]:
        """As ``iterations``, but a step schedule's run of equal batches is jumped over:
        only the first iteration of each step the next ``count`` iterations reach."""
        if self.steps is None:
            yield from self.iterations(consumed_samples, count)
            return
        while count > 0:
            batch = self.at(consumed_samples)
            yield consumed_samples, batch
            end = self.steps.next_start(consumed_samples)
            if end is None:
                return
            stay = min(count, -(-(end - consumed_samples) // batch.running_global_batch_size))
            consumed_samples += stay * batch.running_global_batch_size
            count -= stay

    def first_problem(self, consumed_samples: int, count: int) -> Optional[str]:
        """Why one of the next ``count`` iterations from ``consumed_samples`` cannot
        train, or None (checked before a run or a resume starts)."""
        previous = None
        try:
            for consumed, batch in self._batch_changes(consumed_samples, count):
                if previous is not None and batch.num_microbatches < previous.num_microbatches:
                    flag = f"--step-batch-size-schedule {self.steps.text!r}" if self.steps else "the batch schedule"
                    return (f"{flag}: at {consumed} consumed samples the global batch size drops from "
                            f"{previous.global_batch_size} to {batch.global_batch_size}, and Megatron-LM stops a run "
                            "whose micro batches per rank decrease (it asserts they only grow); make the batch "
                            "sizes non-decreasing")
                previous = batch
        except ValueError as exc:
            return str(exc)
        return None

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` budget, as Megatron-LM's
        ``update_train_iters`` counts them: constant batches of ``global_batch_size``
        (a partial last batch dropped); the ramp's batches while at most the ramp
        samples and at most ``train_samples`` are consumed, then whole target batches
        of the rest (it advances by the ramp's batch, not the one trained on after
        ``--decrease-batch-size-if-needed``, as Megatron-LM does); a step schedule's
        batches while fewer than ``train_samples`` are consumed (a last batch that
        passes the budget counts)."""
        if self.steps is not None:
            iterations = consumed = 0
            while consumed < train_samples:  # a step at a time (Megatron-LM adds one batch at a time)
                batch = self.steps.global_batch_size_at(consumed)
                end = min(train_samples, self.steps.next_start(consumed) or train_samples)
                stay = -(-(end - consumed) // batch)
                consumed, iterations = consumed + stay * batch, iterations + stay
            return iterations
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
    """Megatron-LM's rules for ``--rampup-batch-size`` / ``--step-batch-size-schedule`` /
    ``--decrease-batch-size-if-needed``, and every batch a ramp or step schedule reaches
    checked up front (see ``BatchSchedule.first_problem``)."""
    if args.micro_batch_size is None or args.micro_batch_size <= 0 or (args.global_batch_size or 1) <= 0:
        return []  # reported by the batch rule
    problems = []
    if args.rampup_batch_size is not None and args.train_iters is not None:
        problems.append(f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))} with --train-iters: "
                        "Megatron-LM ramps the batch in sample-based training only; give --train-samples (and "
                        "--lr-decay-samples / --lr-warmup-samples) instead of --train-iters")
    if getattr(args, "step_batch_size_schedule", None) is not None:
        problems += _step_schedule_combinations(args)
        if problems or args.seq_length is None or args.seq_length <= 0:
            return problems  # a missing or bad --seq-length is the model-shape rules'
    try:
        schedule = BatchSchedule.from_args(args, world_size)
    except ValueError as exc:
        return problems + [str(exc)]
    if schedule.rampup is None and schedule.steps is None:
        return problems
    if schedule.rampup is not None and schedule.global_batch_size % schedule.samples_per_step:
        # The target's divisibility is the batch rule's (Megatron-LM asserts it for the
        # evaluation batch, --global-batch-size by default, whatever the flags).
        return problems
    iterations = schedule.train_iters(args.train_samples) if (args.train_samples or 0) > 0 else 1
    problem = schedule.first_problem(0, iterations)
    return problems + ([problem] if problem else [])


def _step_schedule_combinations(args) -> list[str]:
    """Flags ``--step-batch-size-schedule`` does not go with."""
    flag = f"--step-batch-size-schedule {args.step_batch_size_schedule!r}"
    problems = []
    if args.global_batch_size is not None:
        problems.append(f"{flag} with --global-batch-size {args.global_batch_size}: Megatron-LM refuses the pair "
                        "(the schedule sets every training batch; evaluation then uses --micro-batch-size x "
                        "data-parallel size); drop --global-batch-size")
    if args.rampup_batch_size is not None:
        problems.append(f"{flag} with --rampup-batch-size: the step schedule replaced the ramp in Megatron-LM and "
                        "they are exclusive here; keep one")
    if args.decrease_batch_size_if_needed:
        problems.append(f"{flag} with --decrease-batch-size-if-needed: Megatron-LM refuses the pair (a step "
                        "schedule never rounds a batch); drop --decrease-batch-size-if-needed and make each batch "
                        "size a multiple of --micro-batch-size x data-parallel size")
    if args.train_iters is not None:
        problems.append(f"{flag} with --train-iters: Megatron-LM would size the training data and the learning-rate "
                        "horizon by --micro-batch-size x data-parallel size (its default --global-batch-size) while "
                        "the schedule trains larger batches; give --train-samples (and --lr-decay-samples / "
                        "--lr-warmup-samples) instead of --train-iters")
    return problems
