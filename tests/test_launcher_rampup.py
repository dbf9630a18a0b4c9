"""``--rampup-batch-size`` and ``--decrease-batch-size-if-needed``
(megatron_fsdp/training/microbatches.py) against Megatron-LM's batch-size ramp-up.

* the global batch, the batch trained on and the micro batches per rank of every
  iteration equal megatron-core's own ``RampupBatchsizeNumMicroBatchesCalculator``
  (megatron-core 0.16.1, installed here) stepped the way Megatron-LM's training loop
  steps it, for several settings; the iteration budget of ``--train-samples`` equals
  Megatron-LM's ``update_train_iters`` count; one case is also written out by hand;
* the LR schedule's clock is the consumed samples;
* bad input is refused before training, naming the value and the fix;
* a 2-rank CPU run logs the ramping global batch, saves a checkpoint where the micro
  batch count changes (Megatron-LM does), and a run resumed mid-ramp continues the
  same batches and losses.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron_fsdp.training.args.arguments import ArgumentError, parse_args
from megatron_fsdp.training.optim.lr_schedule import LRSchedule
from megatron_fsdp.training.microbatches import BatchRampup, BatchSchedule

REPO = Path(__file__).resolve().parents[1]

# (global batch, micro batch, data-parallel size, (start, increment, ramp samples), decrease if needed)
SETTINGS = {
    "tiny": (8, 1, 2, (2, 2, 12), False),
    "docstring_shape": (1024, 4, 2, (16, 8, 30000), False),  # Megatron-LM's example: 16 -> 1024 by 8
    "skips_increments": (96, 2, 4, (8, 8, 100), False),  # ramp samples per increment < batch: steps skipped
    "decrease_rounds_down": (60, 2, 3, (10, 5, 400), True),  # 10, 15, 20, ... rounded to multiples of 6
    "decrease_odd_steps": (32, 1, 4, (5, 3, 150), True),
}


def _schedule(name: str) -> BatchSchedule:
    gbs, mbs, dp, (start, inc, samples), decrease = SETTINGS[name]
    return BatchSchedule(global_batch_size=gbs, micro_batch_size=mbs, data_parallel_size=dp,
                         rampup=BatchRampup(start=start, increment=inc, ramp_samples=samples),
                         decrease_batch_size_if_needed=decrease)


def _megatron_calculator(name: str):
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    gbs, mbs, dp, (start, inc, samples), decrease = SETTINGS[name]
    return RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, decrease, 1, start, inc, samples)


def _megatron_iterations(name: str, iterations: int) -> list[tuple[int, int, int, int]]:
    """(consumed before, global batch, running batch, micro batches) per iteration, as
    Megatron-LM's loop drives the calculator: update on the consumed samples (with its
    divisibility check), train, add micro batches x micro batch x DP to the consumed."""
    calc = _megatron_calculator(name)
    gbs, mbs, dp, *_ = SETTINGS[name]
    consumed, out = 0, []
    for _ in range(iterations):
        calc.update(consumed, True)
        out.append((consumed, calc.get_current_global_batch_size(), calc.get_current_running_global_batch_size(),
                    calc.get()))
        consumed += calc.get() * mbs * dp
    return out


def _megatron_train_iters(name: str, train_samples: int) -> int:
    """Megatron-LM's update_train_iters for sample-based training with a ramp: count
    ramp iterations (by the calculator's global batch) while the consumed samples are
    within the ramp and the budget, then whole target batches of what is left."""
    calc = _megatron_calculator(name)
    gbs, _, _, (_, _, ramp_samples), _ = SETTINGS[name]
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        calc.update(consumed, False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    return iterations + max(train_samples - consumed, 0) // gbs


# -- the calculator ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SETTINGS))
def test_batches_per_iteration_equal_megatron_cores_calculator(name):
    pytest.importorskip("megatron.core")
    schedule = _schedule(name)
    ramp_iterations = sum(1 for _ in schedule.iterations(0, 10**6))  # up to the first target batch
    expected = _megatron_iterations(name, ramp_iterations + 2)  # the whole ramp and a few target batches
    consumed, ours = 0, []
    for _ in expected:
        batch = schedule.at(consumed)
        ours.append((consumed, batch.global_batch_size, batch.running_global_batch_size, batch.num_microbatches))
        consumed += batch.running_global_batch_size
    assert ours == expected
    assert len({b for _, b, _, _ in ours}) > 2  # it does ramp
    assert ours[-1][1] == schedule.global_batch_size


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0, 2.5])
def test_train_iters_equal_megatron_lms_update_train_iters(name, fraction):
    pytest.importorskip("megatron.core")
    schedule = _schedule(name)
    train_samples = int(schedule.rampup.ramp_samples * fraction) + 5
    assert schedule.train_iters(train_samples) == _megatron_train_iters(name, train_samples)


def test_ramp_written_out_by_hand():
    """With start 2, increment 2, 12 ramp samples, target 8: 3 increments, one
    every 4 samples; the batch is 8 once more than 12 samples are consumed."""
    schedule = _schedule("tiny")
    consumed, batches = 0, []
    for _ in range(9):
        batches.append(schedule.at(consumed).global_batch_size)
        consumed += batches[-1]
    assert batches == [2, 2, 4, 6, 8, 8, 8, 8, 8]
    assert schedule.train_iters(60) == 9  # 4 ramp iterations (14 samples), then (60 - 14) // 8 = 5
    rounded = _schedule("decrease_rounds_down")
    assert [rounded.at(c).running_global_batch_size for c in (0, 40, 80)] == [6, 12, 18]  # 10, 15, 20 rounded
    assert rounded.at(40).skipped_samples == 3


# -- the launcher's validation and schedule ------------------------------------------------------
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--lr 1e-3 --micro-batch-size 1 --global-batch-size 8").split()


def _parse(extra: str, world_size: int = 2, base=BASE):
    return parse_args(base + extra.split(), world_size=world_size)


def test_launcher_derives_the_ramp_and_a_sample_clock():
    args = _parse("--rampup-batch-size 2 2 12 --train-samples 60 --lr-decay-style linear --min-lr 1e-5")
    assert args.train_iters == 9 and args.num_microbatches == 4  # evaluation batches: the target's
    sched = LRSchedule.from_args(args)
    assert sched.per_sample and sched.decay_steps == 60
    consumed = 0
    for _ in range(args.train_iters):  # Megatron-LM steps its scheduler by the samples trained on
        assert sched.num_steps == consumed
        assert sched.lr_at(sched.num_steps) == pytest.approx(1e-5 + (1e-3 - 1e-5) * (1 - consumed / 60))
        batch = args.batch_schedule.at(consumed)
        sched.step(batch.running_global_batch_size)
        consumed += batch.running_global_batch_size
    assert consumed == 2 + 2 + 4 + 6 + 5 * 8


@pytest.mark.parametrize("extra, world_size, message", [
    ("--rampup-batch-size 2 2 12 --train-iters 10", 2, "ramps the batch in sample-based training only; give "
                                                       "--train-samples"),
    ("--rampup-batch-size 8 2 12 --train-samples 60", 2, "the start batch size must be smaller than "
                                                         "--global-batch-size 8"),
    ("--rampup-batch-size 2 4 12 --train-samples 60", 2, "minus the start 2 is not a multiple of the increment 4"),
    ("--rampup-batch-size 2 2 0 --train-samples 60", 2, "must all be positive"),
    ("--rampup-batch-size 0 2 12 --train-samples 60", 2, "must all be positive"),
    # 8 = 2 x 2 x 2 ranks, but the ramp passes 6: Megatron-LM would assert mid-run.
    ("--rampup-batch-size 4 2 40 --train-samples 100 --micro-batch-size 2", 2,
     "the global batch size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    ("--rampup-batch-size 2 2 40 --train-samples 100 --micro-batch-size 2 --decrease-batch-size-if-needed", 2,
     "would train on 0 samples"),
    ("--rampup-batch-size 2 2 12 --train-samples 60 --global-batch-size 9", 2, "--global-batch-size=9 is not "
                                                                               "divisible"),
])
def test_bad_ramps_are_refused_before_training(extra, world_size, message):
    with pytest.raises(ArgumentError) as info:
        _parse(extra, world_size)
    assert message in str(info.value)


def test_decrease_batch_size_if_needed_accepts_the_ramp_megatron_lm_accepts():
    args = _parse("--rampup-batch-size 4 2 40 --train-samples 100 --micro-batch-size 2 "
                  "--decrease-batch-size-if-needed")
    assert [args.batch_schedule.at(c).global_batch_size for c in (0, 20, 40)] == [4, 6, 8]
    assert [args.batch_schedule.at(c).running_global_batch_size for c in (0, 20, 40)] == [4, 4, 8]
    assert args.batch_schedule.at(20).skipped_samples == 2
    # Without a ramp the flag leaves a divisible batch alone, as Megatron-LM's constant calculator.
    assert _parse("--decrease-batch-size-if-needed --train-iters 2").batch_schedule.at(0).num_microbatches == 4


# -- a 2-rank CPU run --------------------------------------------------------------------------
RUN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
       "--micro-batch-size 1 --global-batch-size 8 --rampup-batch-size 2 2 12 --train-samples 60 --lr 1e-3 "
       "--lr-decay-style cosine --log-interval 1 --eval-iters 0 --plot-path none --hidden-dropout 0 "
       "--attention-dropout 0").split()
LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.* learning rate: (\S+) \| "
                  r"global batch size:\s+(\d+) \| lm loss: (\S+) \|")


def _run(pool, extra: list[str]) -> list[tuple[int, int, int, float, int, float]]:
    """A 2-rank launcher run in the shared gloo pool: its iteration lines, parsed."""
    from launcher_inprocess import launch_task

    output = "\n".join(pool.run(launch_task, flags=shlex.join([*RUN, *extra]))[0])
    rows = [(int(m[1]), int(m[2]), int(m[3]), float(m[4]), int(m[5]), float(m[6])) for m in LINE.finditer(output)]
    assert rows, output[-2000:]
    return rows


def test_cpu_run_ramps_the_batch_and_resumes_mid_ramp(pool2, tmp_path):
    full = _run(pool2, [])
    assert [r[0] for r in full] == list(range(1, 10)) and {r[1] for r in full} == {9}
    assert [r[4] for r in full] == [2, 2, 4, 6, 8, 8, 8, 8, 8]  # the logged global batch ramps
    assert [r[2] for r in full] == [2, 4, 8, 14, 22, 30, 38, 46, 54]  # consumed samples follow it
    # Stop after iteration 3 (mid-ramp); Megatron-LM also saves where the micro batch count changes.
    ckpt = tmp_path / "ckpt"
    first = _run(pool2, ["--save", str(ckpt), "--save-interval", "100", "--exit-interval", "3"])
    assert first == full[:3]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000002", "iter_0000003"]
    resumed = _run(pool2, ["--load", str(ckpt)])
    assert [r[:3] + r[4:5] for r in resumed] == [r[:3] + r[4:5] for r in full[3:]]  # same batches, same samples
    for ours, theirs in zip(resumed, full[3:]):
        assert ours[3] == pytest.approx(theirs[3], rel=1e-6)  # learning rate
        assert abs(ours[5] - theirs[5]) <= 1e-6, (ours, theirs)  # lm loss
