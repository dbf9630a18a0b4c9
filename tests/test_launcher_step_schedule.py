"""``--step-batch-size-schedule`` (megatron_fsdp/training/microbatches.py, [Note: step
batch-size schedule]) against Megatron-LM's ``StepBatchsizeNumMicroBatchesCalculator``
(its commit 532ad926; not in megatron-core 0.16.1, so its rules are written out here):

* parsing: thresholds are tokens (K/M/B/T suffixes), // --seq-length gives samples;
  Megatron-LM's own schedules (the GPT-3 15B recipes, the GPT-3 175B example) land
  where its parser puts them;
* the batch of each iteration, the boundaries (a batch applies from its threshold on,
  and an iteration started below it trains the old batch whole), the --train-samples
  iteration budget (Megatron-LM's ``update_train_iters`` loop, written out below);
* bad input is refused before training, naming the value and the fix; reached batches
  are checked up front, unreached or passed ones are not (as Megatron-LM);
* a 2-rank launcher run (in the shared gloo pool) logs the stepping global batch,
  saves where the micro batch count changes, and resumes mid-schedule with the same
  batches, learning rates and losses.
"""

from __future__ import annotations

import re
import shlex

import pytest

from launcher_inprocess import run_launcher
from megatron_fsdp.training.args.arguments import ArgumentError, parse_args
from megatron_fsdp.training.optim.lr_schedule import LRSchedule
from megatron_fsdp.training.microbatches import BatchSchedule, BatchSteps



def _schedule(text: str, seq_length: int, micro_batch_size: int = 1, data_parallel_size: int = 2) -> BatchSchedule:
    steps = BatchSteps.parse(text, seq_length)
    return BatchSchedule(global_batch_size=steps.final_global_batch_size, micro_batch_size=micro_batch_size,
                         data_parallel_size=data_parallel_size, steps=steps)


def _megatron_train_iters(schedule: BatchSchedule, train_samples: int) -> int:
    """Megatron-LM's update_train_iters with a step schedule: add the current batch
    while fewer than --train-samples samples are consumed."""
    iterations = consumed = 0
    while consumed < train_samples:
        consumed += schedule.global_batch_size_at(consumed)
        iterations += 1
    return iterations


# -- parsing ---------------------------------------------------------------------------------
def test_megatron_lms_schedules_parse_to_its_samples():
    # The GPT-3 15B recipes (tests/functional_tests/test_cases/gpt/gpt3_15b_8t_release*), --seq-length 4096:
    # 200B tokens = 48,828,125 samples.
    recipe = BatchSteps.parse("0:384 200B:768 400B:1152", 4096)
    assert [(s.samples, s.global_batch_size) for s in recipe.steps] == [(0, 384), (48828125, 768), (97656250, 1152)]
    # examples/gpt3/train_gpt3_175b_distributed.sh (--seq-length 2048) replaced --rampup-batch-size 16 16 5859375:
    # its last step starts at 12B tokens = the ramp's 5,859,375 samples.
    gpt3 = BatchSteps.parse("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048)
    assert [s.samples for s in gpt3.steps] == [0, 1171875, 2343750, 3515625, 4687500, 5859375]
    # Any order, commas, lower-case suffixes, suffixed batch sizes; thresholds below one sample are 0.
    same = BatchSteps.parse("1.5k:2K, 10:8 3m:4000", 16)
    assert [(s.samples, s.global_batch_size) for s in same.steps] == [(0, 8), (93, 2000), (187500, 4000)]


def test_float_rounding_of_megatron_lms_parser_is_refused_where_it_matters():
    # Megatron-LM reads 32.3K as int(32.3 * 1000) = 32299.
    with pytest.raises(ValueError, match=r"reads the batch size '32.3K' as 32299 .*write it as 32300"):
        BatchSteps.parse("0:32.3K", 16)
    with pytest.raises(ValueError, match=r"reads the threshold '32.3K' as 32299 tokens = 32299 samples"):
        BatchSteps.parse("0:8 32.3K:16", 1)
    assert BatchSteps.parse("0:8 32.3K:16", 64).steps[1].samples == 504  # the same sample either way: accepted


# -- batches, boundaries, budget -------------------------------------------------------------
def test_batches_written_out_by_hand():
    """Steps at 0, 96 and 224 tokens of 16 = samples 0, 6 and 14, with 1 x 2 ranks."""
    schedule = _schedule("0:2 96:4 224:8", 16)
    consumed, rows = 0, []
    for _ in range(9):
        batch = schedule.at(consumed)
        rows.append((consumed, batch.global_batch_size, batch.num_microbatches))
        consumed += batch.running_global_batch_size
    assert rows == [(0, 2, 1), (2, 2, 1), (4, 2, 1), (6, 4, 2), (10, 4, 2), (14, 8, 4), (22, 8, 4), (30, 8, 4),
                    (38, 8, 4)]
    # The batch applies from its threshold on; an iteration that starts below it trains the old batch whole.
    assert [schedule.global_batch_size_at(c) for c in (5, 6, 13, 14, 10**12)] == [2, 4, 4, 8, 8]
    overshoot = _schedule("0:4 112:8", 16)  # the step at 7 samples is first seen at 8
    assert [overshoot.at(c).global_batch_size for c in (0, 4, 8)] == [4, 4, 8]
    # The budget: iterations while fewer than --train-samples are consumed; the last one may pass it.
    assert [schedule.train_iters(n) for n in (1, 2, 3, 6, 7, 14, 15, 38, 39, 46)] == [1, 1, 2, 3, 4, 5, 6, 8, 9, 9]


@pytest.mark.parametrize("text, seq_length, budgets", [
    ("0:2 96:4 224:8", 16, range(1, 120)),
    ("0:6 50:12 51:18 400:6", 1, range(1, 700, 7)),  # steps closer than one batch: some are skipped
    ("0:384 200B:768 400B:1152", 4096, (4882812, 19531250, 48828125, 48828126, 60000000)),  # the recipes' budgets
])
def test_train_iters_equal_megatron_lms_update_train_iters(text, seq_length, budgets):
    schedule = _schedule(text, seq_length)
    for budget in budgets:
        assert schedule.train_iters(budget) == _megatron_train_iters(schedule, budget), budget
    assert _schedule("0:384 200B:768 400B:1152", 4096).train_iters(19531250) == 50863  # 19,531,250 / 384, rounded up


def test_only_the_batches_a_run_reaches_are_checked():
    schedule = _schedule("0:2 96:6 224:8", 16, micro_batch_size=1, data_parallel_size=4)  # 6 needs 6 x 1
    assert "global batch size 2 is not divisible by --micro-batch-size 1 x data-parallel size 4" in \
        schedule.first_problem(0, 3)
    # Resumed past both with 4 ranks (Megatron-LM checks the current batch only): fine.
    assert schedule.first_problem(14, 10) is None
    two_ranks = _schedule("0:2 96:6 224:8", 16)
    assert two_ranks.first_problem(0, 3) is None  # 3 iterations of 2 stop at 6 samples: 6 is not reached
    assert two_ranks.first_problem(0, 5) is None  # 2, 2, 2, 6, 6: all divide by 2
    falling = _schedule("0:4 96:2", 16)
    assert falling.first_problem(0, 1) is None  # the drop at 6 samples is never reached in one iteration
    assert "drops from 4 to 2" in falling.first_problem(0, 3)
    assert falling.first_problem(8, 10) is None  # a resume after the drop (Megatron-LM compares within a run)


# -- the launcher's validation and schedule ------------------------------------------------------
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--lr 1e-3 --micro-batch-size 1")


def _parse(extra: str, world_size: int = 2):
    return parse_args(shlex.split(BASE + " " + extra), world_size=world_size)


def test_launcher_derives_the_schedule_and_a_sample_clock():
    args = _parse("--step-batch-size-schedule '0:2 96:4 224:8' --train-samples 40 --lr-decay-style linear "
                  "--min-lr 1e-5")
    assert args.train_iters == 9
    assert args.global_batch_size == 2 and args.num_microbatches == 1  # evaluation: micro batch x DP, as Megatron-LM
    sched = LRSchedule.from_args(args)
    assert sched.per_sample and sched.decay_steps == 40
    consumed = 0
    for _ in range(args.train_iters):  # Megatron-LM steps its scheduler by the samples trained on
        assert sched.lr_at(sched.num_steps) == pytest.approx(1e-5 + (1e-3 - 1e-5) * max(0, 1 - consumed / 40))
        batch = args.batch_schedule.at(consumed)
        sched.step(batch.running_global_batch_size)
        consumed += batch.running_global_batch_size
    assert consumed == 46


# The GPT-3 15B recipes' batch and schedule flags (tensor / pipeline parallel 1 here); the *_gb200 ones
# differ only in --eval-global-batch-size (tests/test_launcher_eval_batch.py) and the parallel layout.
RECIPES = {
    "gpt3_15b_8t_release": 19531250,
    "gpt3_15b_8t_release_sm": 4882812,
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("world_size", [8, 32])
def test_recipe_flags_parse_and_validate(recipe, world_size):
    args = _parse(f"--micro-batch-size 4 --step-batch-size-schedule '0:384 200B:768 400B:1152' "
                  f"--train-samples {RECIPES[recipe]} --seq-length 4096 --max-position-embeddings 4096 "
                  "--lr 4.5e-4 --min-lr 4.5e-5 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 "
                  "--lr-decay-style cosine --eval-iters 32 --eval-interval 2000", world_size)
    assert args.train_iters == -(-RECIPES[recipe] // 384)
    assert args.batch_schedule.at(0).num_microbatches == 384 // (4 * world_size)
    assert (args.schedule.decay_steps, args.schedule.warmup_steps, args.schedule.unit) == \
        (1949218748, 3906252, "samples")
    assert args.global_batch_size == 4 * world_size  # Megatron-LM's evaluation batch without --global-batch-size


@pytest.mark.parametrize("extra, message", [
    ("'0:2 96:3' --train-samples 40", "after 6 consumed samples the global batch size 3 is not divisible by "
                                      "--micro-batch-size 1 x data-parallel size 2 = 2"),
    ("'0:4 96:2' --train-samples 40", "the global batch size drops from 4 to 2"),
    ("'0:4' --train-samples 40 --global-batch-size 4", "with --global-batch-size 4: Megatron-LM refuses the pair"),
    ("'0:4' --train-samples 40 --decrease-batch-size-if-needed", "with --decrease-batch-size-if-needed: Megatron-LM "
                                                                 "refuses the pair"),
    ("'0:4' --train-iters 10", "with --train-iters: Megatron-LM would size the training data"),
    ("'0:4' --train-samples 40 --rampup-batch-size 2 2 12", "with --rampup-batch-size"),
    ("'' --train-samples 40", "has no entries"),
    ("'0:4 8:8' --train-samples 40", "entries '0:4' and '8:8' both start at 0 consumed samples (thresholds are "
                                     "tokens, // --seq-length 16)"),
    ("'16:4 96:8' --train-samples 40", "the first entry must start at 0, but the smallest threshold '16:4' is 1"),
    ("'0:4 -16:8' --train-samples 40", "has a negative threshold"),
    ("'0:4.5' --train-samples 40", "is not a positive whole number"),
    ("'0:0' --train-samples 40", "is not a positive whole number"),
    ("'0:4 1X:8' --train-samples 40", "the threshold '1X' is not a number"),
    ("'0:nan' --train-samples 40", "the batch size 'nan' is not a number"),
    ("'0=4' --train-samples 40", "entry '0=4' is not THRESHOLD:BATCH_SIZE"),
])
def test_bad_schedules_are_refused_before_training(extra, message):
    with pytest.raises(ArgumentError) as info:
        _parse("--step-batch-size-schedule " + extra)
    assert message in str(info.value)


# -- a 2-rank launcher run, in the shared gloo pool ------------------------------------------------
RUN = (BASE + " --step-batch-size-schedule '0:2 96:4 224:8' --train-samples 40 --lr-decay-style cosine "
       "--log-interval 1 --eval-iters 0 --plot-path none --hidden-dropout 0 --attention-dropout 0 --seed 7")
# (the byte-level corpus data/corpus.txt: --mock-data would import megatron-core, seconds per worker)
LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.* learning rate: (\S+) \| "
                  r"global batch size:\s+(\d+) \| lm loss: (\S+) \|")


def launcher_task(rank: int, world: int, *, extra: str) -> list:
    """scripts/pretrain_gpt.py's ``run`` on this pool rank: its iteration lines, parsed."""
    text = "\n".join(run_launcher(RUN + " " + extra, world))
    rows = [(int(m[1]), int(m[2]), int(m[3]), float(m[4]), int(m[5]), float(m[6])) for m in LINE.finditer(text)]
    return [rows, text.count("stepping batch size to")]


def test_launcher_run_steps_the_batch_and_resumes_mid_schedule(pool2, tmp_path):
    full, changes = pool2.run(launcher_task, extra="")[0]
    assert [r[0] for r in full] == list(range(1, 10)) and {r[1] for r in full} == {9}
    assert [r[4] for r in full] == [2, 2, 2, 4, 4, 8, 8, 8, 8]  # the logged global batch steps
    assert [r[2] for r in full] == [2, 4, 6, 10, 14, 22, 30, 38, 46]  # consumed samples follow it
    assert changes == 2
    # Stop after iteration 4 (mid-schedule); Megatron-LM also saves where the micro batch count changes (after 3).
    ckpt = tmp_path / "ckpt"
    first, _ = pool2.run(launcher_task, extra=f"--save {ckpt} --save-interval 100 --exit-interval 4")[0]
    assert first == full[:4]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000003", "iter_0000004"]
    resumed, _ = pool2.run(launcher_task, extra=f"--load {ckpt}")[0]
    assert [r[:3] + r[4:5] for r in resumed] == [r[:3] + r[4:5] for r in full[4:]]  # same batches, same samples
    for ours, theirs in zip(resumed, full[4:]):
        assert ours[3] == pytest.approx(theirs[3], rel=1e-6)  # learning rate
        assert abs(ours[5] - theirs[5]) <= 1e-6, (ours, theirs)  # lm loss
