"""``--eval-global-batch-size`` / ``--eval-micro-batch-size`` against Megatron-LM (its
arguments.py, evaluate() and get_train_valid_test_num_samples at the pinned commit):

* defaults are the training batch and micro batch (micro batch x DP under
  --step-batch-size-schedule), and the evaluation batch must be a whole number of
  evaluation micro batches on every data-parallel rank;
* the validation split is sized (train_iters // eval_interval + 1) x eval_iters x
  evaluation batch (test: eval_iters x evaluation batch);
* a 2-rank run (shared gloo pool, weights held still by --lr 0) logs, at every evaluation,
  the loss of exactly the validation samples Megatron-LM reads: --eval-iters batches of
  --eval-global-batch-size from where the previous evaluation stopped. A run whose training
  batch equals that evaluation batch reads the same samples, so its losses are the reference.
"""

from __future__ import annotations

import shlex

import pytest

from launcher_inprocess import load_pretrain_script, run_launcher
from megatron_fsdp.training import data as data_mod
from megatron_fsdp.training.data import from_args
from megatron_fsdp.training.args.arguments import ArgumentError, parse_args
from megatron_fsdp.training.data import TrainValidTestDatasets, train_valid_test_num_samples

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--lr 1e-3 --micro-batch-size 1")


def _parse(extra: str, world_size: int = 2):
    return parse_args(shlex.split(BASE + " " + extra), world_size=world_size)


def test_defaults_and_derived_micro_batches():
    args = _parse("--train-iters 4 --global-batch-size 4")
    assert (args.eval_global_batch_size, args.eval_micro_batch_size, args.eval_num_microbatches) == (4, 1, 2)
    args = _parse("--train-iters 4 --global-batch-size 4 --eval-global-batch-size 24 --eval-micro-batch-size 3")
    assert (args.eval_global_batch_size, args.eval_micro_batch_size, args.eval_num_microbatches) == (24, 3, 4)
    assert args.num_microbatches == 2  # training keeps its own
    # With a step schedule Megatron-LM's default is micro batch x DP; an explicit one is independent of the steps.
    steps = "--step-batch-size-schedule '0:2 96:4' --train-samples 40"
    assert _parse(steps).eval_global_batch_size == 2
    args = _parse(steps + " --eval-global-batch-size 8")
    assert (args.eval_global_batch_size, args.eval_num_microbatches, args.batch_schedule.at(6).global_batch_size) == \
        (8, 4, 4)


@pytest.mark.parametrize("extra, message", [
    ("--global-batch-size 4 --eval-global-batch-size 5", "the evaluation batch 5 (--eval-global-batch-size, default "
     "--global-batch-size) is not divisible by --eval-micro-batch-size 1 (default --micro-batch-size) x "
     "data-parallel size 2 = 2 (Megatron-LM's rule)"),
    ("--global-batch-size 4 --eval-micro-batch-size 4", "the evaluation batch 4 (--eval-global-batch-size, default "
     "--global-batch-size) is not divisible by --eval-micro-batch-size 4"),
    ("--eval-global-batch-size 0", "--eval-global-batch-size=0 must be a positive integer"),
    ("--eval-micro-batch-size -1", "--eval-micro-batch-size=-1 must be a positive integer"),
])
def test_refusals(extra, message):
    with pytest.raises(ArgumentError) as info:
        _parse("--train-iters 4 " + extra)
    assert message in str(info.value)


def test_validation_split_is_sized_by_the_evaluation_batch(monkeypatch):
    # Megatron-LM's get_train_valid_test_num_samples with --eval-global-batch-size.
    assert train_valid_test_num_samples(train_iters=100, global_batch_size=8, eval_interval=10, eval_iters=2,
                                        eval_global_batch_size=32) == (800, 11 * 2 * 32, 2 * 32)
    assert train_valid_test_num_samples(train_iters=None, global_batch_size=4, eval_interval=5, eval_iters=1,
                                        train_samples=40, eval_global_batch_size=6) == (40, 3 * 6, 6)
    # ... and the launcher asks the dataset builder for exactly that.
    asked = []

    def fake_build(**kwargs):
        asked.append(tuple(kwargs["num_samples"]))
        return TrainValidTestDatasets(train=None, valid=None, test=None, backend=data_mod.Backend.NATIVE)

    monkeypatch.setattr(from_args, "build_train_valid_test_datasets", fake_build)
    args = _parse("--train-iters 20 --global-batch-size 2 --eval-interval 10 --eval-iters 3 "
                  "--eval-global-batch-size 8 --mock-data --vocab-size 64")
    from_args.build_datasets(args)
    assert asked == [(40, 3 * 3 * 8, 3 * 8)]


# -- a 2-rank launcher run, in the shared gloo pool ------------------------------------------------
RUN = (BASE + " --lr 0 --train-iters 2 --eval-interval 1 --eval-iters 2 --log-interval 1 --plot-path none "
       "--hidden-dropout 0 --attention-dropout 0 --seed 7")
_SCRIPT = []  # this file's own copy of scripts/pretrain_gpt.py: the test patches it


def launcher_task(rank: int, world: int, *, extra: str) -> list:
    """scripts/pretrain_gpt.py's ``run`` on this pool rank: (iteration, validation loss) of
    every evaluation, at full precision, and whether the evaluation batch was described."""
    if not _SCRIPT:
        _SCRIPT.append(load_pretrain_script("pretrain_gpt_eval_batch"))
    script = _SCRIPT[0]
    losses = []
    script.log_validation = lambda iteration, loss, label="validation": losses.append((iteration, loss))
    lines = run_launcher(RUN + " " + extra, world, script=script)
    described = any("> evaluation: global batch 8 = micro batch 2 x 2 micro batches x 2 ranks" in line
                    for line in lines)
    return [losses, described]


def test_two_rank_evaluation_reads_megatron_lms_samples(pool2):
    # Evaluation batch 8 (2 micro batches of 2 per rank) while training on batches of 2: each evaluation
    # reads 2 x 8 validation samples, the next ones each time: [0, 16), [16, 32), [32, 48).
    ours, described = pool2.run(launcher_task, extra="--global-batch-size 2 --eval-global-batch-size 8 "
                                                     "--eval-micro-batch-size 2")[0]
    # The reference: training (and so evaluating) on batches of 8 in micro batches of 1 reads the same samples.
    reference, _ = pool2.run(launcher_task, extra="--global-batch-size 8")[0]
    assert described
    assert [i for i, _ in ours] == [i for i, _ in reference] == [1, 2, 2]  # interval 1, and once more at the end
    for (_, mine), (_, theirs) in zip(ours, reference):
        assert mine == pytest.approx(theirs, rel=1e-6, abs=0)
    assert len({round(loss, 6) for _, loss in ours}) == 3  # three different windows of the validation split
