"""End-to-end tests of scripts/pretrain_gpt.py: 2-rank runs on CPU/gloo (through torchrun
where the launch itself is under test, else the same driver in the shared gloo pool).

* DDP and Megatron-FSDP (each of the four strategies) train the same tiny GPT on the
  same deterministic global batches: the loss falls and every iteration's loss of
  every FSDP run equals DDP's within 1e-5.
* A run saves Megatron-style checkpoints at iterations 10 and 20; a fresh process
  resuming from iteration 10 reproduces the uninterrupted run's iterations 11-20.
* Bad flags / config files exit non-zero with a message naming the value and the fix.

The training runs are launched once per module (about 5 s each on 2 cores) and
shared by the tests that read them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher_inprocess import launch_task, pretrain_script
from megatron_fsdp.comm import device as device_mod
from megatron_fsdp.training.args.arguments import ArgumentError, LRDecayStyle, parse_args
from megatron_fsdp.training.data import BatchLayout, TextDataset
from megatron_fsdp.training.optim.lr_schedule import LRSchedule

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "pretrain_gpt.py"
LONG = bool(os.environ.get("MFSDP_LAUNCHER_LONG"))
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"] if LONG else ["optim_grads_params"]
"""Each strategy is a run of its own; by default ZeRO-3 alone (the in-process launcher tests run
every strategy against DDP), all four with MFSDP_LAUNCHER_LONG=1. The ZeRO-3 run goes through
torchrun and this script's path, as users launch it; the others run the same driver in the
shared gloo pool (no torchrun start-up)."""
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8",  # 2 micro batches per rank: exercises no_sync
    "--train-iters", "20", "--lr", "3e-3", "--seed", "1234",
    "--adam-eps", "1e-4",  # the house rule for AdamW parity: see test_fsdp_matches_ddp_every_iteration
    "--log-interval", "5", "--eval-interval", "10", "--eval-iters", "1",
]
FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--no-gradient-accumulation-fusion",
        "--overlap-grad-reduce", "--overlap-param-gather"]


def _env() -> dict:
    # This checkout's package, whatever an editable install elsewhere points at.
    # CPU/gloo also on a GPU machine (CUDA_VISIBLE_DEVICES=""): the runs compare with DDP on gloo.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    return env


def torchrun(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def run_ok(args: list[str]) -> subprocess.CompletedProcess:
    proc = torchrun(args)
    assert proc.returncode == 0, f"pretrain_gpt.py {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def run_in_pool(pool, args: list[str]) -> str:
    """The run in the shared gloo pool: rank 0's log lines, as torchrun's output holds them."""
    return "\n".join(pool.run(launch_task, flags=shlex.join(args))[0])


def load_metrics(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pool2) -> dict:
    """The DDP reference and one run per Megatron-FSDP strategy: {name: (metrics, stdout, extra)}.
    The optim_grads_params run also saves checkpoints at iterations 10 and 20."""
    out = tmp_path_factory.mktemp("pretrain_runs")
    results = {}
    stdout = run_in_pool(pool2, TINY + ["--log-json", str(out / "ddp.json"), "--plot-path", str(out / "ddp.png")])
    results["ddp"] = (load_metrics(out / "ddp.json"), stdout, out / "ddp.png")
    for strategy in STRATEGIES:
        path = out / f"{strategy}.json"
        args = TINY + FSDP + ["--data-parallel-sharding-strategy", strategy, "--log-json", str(path), "--plot-path",
                              "none"]
        if strategy == "optim_grads_params":
            stdout = run_ok(args + ["--save", str(out / "ckpt"), "--save-interval", "10"]).stdout
        else:
            stdout = run_in_pool(pool2, args)
        results[strategy] = (load_metrics(path), stdout, out / "ckpt" if strategy == "optim_grads_params" else None)
    # Megatron-LM's most common launch: DDP + distributed optimizer, no FSDP flag.
    stdout = run_in_pool(pool2, TINY + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                                        "--log-json", str(out / "ddp_distopt.json"), "--plot-path", "none"])
    results["ddp_distopt"] = (load_metrics(out / "ddp_distopt.json"), stdout, None)
    return results


# -- training -----------------------------------------------------------------------
def test_ddp_loss_falls_and_writes_plot(runs):
    metrics, _, plot = runs["ddp"]
    losses = metrics["lm_loss"]
    assert metrics["iterations"] == list(range(1, 21))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    assert plot.is_file() and plot.stat().st_size > 1000


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp_matches_ddp_every_iteration(runs, strategy):
    fsdp, stdout, _ = runs[strategy]
    ddp = runs["ddp"][0]
    assert f"Megatron-FSDP ({strategy})" in stdout
    assert fsdp["iterations"] == ddp["iterations"]
    for it, a, b in zip(fsdp["iterations"], fsdp["lm_loss"], ddp["lm_loss"]):
        # fp32, AdamW eps=1e-4: only reduction order differs (a tiny eps would turn
        # its rounding in near-zero gradients into large update differences).
        assert abs(a - b) <= 1e-5, f"{strategy}: iteration {it}: loss {a} vs DDP {b}"
    for (it_a, a), (it_b, b) in zip(fsdp["validation"], ddp["validation"]):
        assert it_a == it_b and abs(a - b) <= 1e-5
    assert fsdp["lm_loss"][-1] < fsdp["lm_loss"][0] - 1.0


def test_megatron_ddp_with_distributed_optimizer_matches_ddp(runs):
    """[Note: Megatron-core DDP on this engine]: --use-distributed-optimizer without
    --use-megatron-fsdp runs Megatron-FSDP's optim strategy (it used to be refused)."""
    metrics, stdout, _ = runs["ddp_distopt"]
    assert "Megatron-core DDP + distributed optimizer on Megatron-FSDP's optim" in stdout
    ddp = runs["ddp"][0]
    for it, a, b in zip(metrics["iterations"], metrics["lm_loss"], ddp["lm_loss"]):
        assert abs(a - b) <= 1e-5, f"iteration {it}: loss {a} vs DDP {b}"
    assert len(metrics["iterations"]) == len(ddp["iterations"])


def test_log_lines_follow_megatron_format(runs):
    _, stdout, _ = runs["optim_grads_params"]
    lines = [line for line in stdout.splitlines() if " iteration " in line and "consumed samples" in line]
    # Megatron-LM logs iteration 1 of a run, then every --log-interval (5) iterations.
    assert [int(re.search(r"iteration +(\d+)/", line).group(1)) for line in lines] == [1, 5, 10, 15, 20]
    pattern = re.compile(
        r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +20/ +20 \| consumed samples: +160 \| "
        r"elapsed time per iteration \(ms\): [\d.]+ \| "
        r"learning rate: \d\.\d{6}E[-+]\d\d \| global batch size: +8 \| lm loss: \d\.\d{6}E[-+]\d\d \| "
        r"loss scale: 1\.0 \| grad norm: [\d.]+ \| number of skipped iterations: +0 \| "
        r"number of nan iterations: +0 \|$"
    )
    assert pattern.match(lines[-1]), lines[-1]
    memory = [line for line in stdout.splitlines() if "memory (MB)" in line]
    # After the first logged iteration and after the next one (with optimizer state), per rank.
    assert [m.split(")")[0] for m in memory] == ["[Rank 0] (after 1 iterations", "[Rank 1] (after 1 iterations",
                                                 "[Rank 0] (after 5 iterations", "[Rank 1] (after 5 iterations"]
    assert "megatron_fsdp persistent buffers" in memory[0] and "peak temporary" in memory[0]
    assert "validation loss at iteration 10" in stdout


def test_checkpoints_follow_megatron_layout(runs):
    _, stdout, ckpt = runs["optim_grads_params"]
    # Saving did not perturb training: that run still matched DDP (test above).
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000010", "iter_0000020",
                                                      "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert "successfully saved checkpoint from iteration      10" in stdout


def test_resume_reproduces_uninterrupted_run(runs, pool2, tmp_path):
    reference, _, ckpt = runs["optim_grads_params"]
    # A new run picks the torchrun run up at its iteration-10 checkpoint and trains to 20.
    stdout = run_in_pool(pool2, TINY + FSDP + ["--plot-path", "none", "--load", str(ckpt), "--ckpt-step", "10",
                                               "--log-json", str(tmp_path / "resumed.json")])
    assert "resuming at iteration 10, 80 samples consumed" in stdout
    resumed = load_metrics(tmp_path / "resumed.json")
    assert resumed["iterations"] == list(range(11, 21))
    for it, a, b in zip(range(11, 21), resumed["lm_loss"], reference["lm_loss"][10:]):
        assert abs(a - b) <= 1e-6, f"iteration {it}: resumed {a} vs uninterrupted {b}"
    # Megatron-LM evaluates at 10 and 20 (--eval-interval) and once more after the last
    # iteration, each time on the next validation batches; the position is checkpointed.
    assert [it for it, _ in reference["validation"]] == [10, 20, 20]
    assert resumed["validation"] == [[it, pytest.approx(v, abs=1e-6)] for it, v in reference["validation"][1:]]


# -- bad flags ----------------------------------------------------------------------
def run_main_directly(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """The driver's ``main`` in this process, as ``python scripts/pretrain_gpt.py`` runs it for
    rank 0 of 2: validation refuses before torch.distributed starts. (exit code, stderr)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    try:
        code = pretrain_script().main(args)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--use-megatorn-fsdp"], "unrecognized arguments: --use-megatorn-fsdp (did you mean --use-megatron-fsdp?)"),
        (FSDP + ["--use-torch-fsdp2"], "--use-megatron-fsdp and --use-torch-fsdp2 are mutually exclusive"),
        (FSDP + ["--data-parallel-sharding-strategy", "zero3"], "invalid choice: 'zero3'"),
    ],
    ids=["unknown-flag", "conflicting-flags", "invalid-strategy"],
)
def test_bad_flags_exit_with_clear_message(extra, message, monkeypatch, capsys):
    code, stderr = run_main_directly(TINY + extra, monkeypatch, capsys)
    assert code not in (0, None)
    assert message in stderr, stderr


def test_unknown_yaml_key_exits_with_clear_message(tmp_path, monkeypatch, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("num-layers: 2\ndata_paralel_sharding_strategy: optim\n")
    code, stderr = run_main_directly(TINY + ["--config", str(config)], monkeypatch, capsys)
    assert code not in (0, None)
    assert "unknown key 'data_paralel_sharding_strategy' (did you mean 'data-parallel-sharding-strategy'?)" \
        in stderr


def _parse(extra: list[str], world_size: int = 2):
    return parse_args(TINY + extra, world_size=world_size)


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (FSDP + ["--outer-dp-sharding-strategy", "optim", "--data-parallel-sharding-strategy", "optim_grads",
                 "--num-distributed-optimizer-instances", "2"], 4, "needs --data-parallel-sharding-strategy="
                                                                  "optim_grads_params"),
        (FSDP + ["--outer-dp-sharding-strategy", "optim"], 2, "--num-distributed-optimizer-instances >= 2"),
        (["--global-batch-size", "6"], 2, "not divisible by --micro-batch-size=2 x data-parallel size 2"),
        (["--overlap-param-gather"], 2, "--overlap-param-gather needs --use-distributed-optimizer"),
        (["--num-distributed-optimizer-instances", "2"], 2, "add --use-distributed-optimizer"),
        (["--bf16", "--fp16"], 2, "--bf16 and --fp16 are mutually exclusive"),
        (["--max-position-embeddings", "16"], 2, "raise it to at least 32"),
        (["--min-lr", "1.0"], 2, "--min-lr=1.0 is larger than --lr"),
        (["--save", "/tmp/x"], 2, "needs a positive --save-interval"),
        (["--ckpt-step", "10"], 2, "--ckpt-step=10 needs --load DIR"),
        (["--fsdp-double-buffer"], 2, "only applies to Megatron-FSDP"),
        (["--mock-data", "--data-path", str(REPO / "data" / "corpus.txt")], 2, "--mock-data and --data-path"),
        (FSDP + ["--num-distributed-optimizer-instances", "3"], 4, "does not divide the data-parallel size 4"),
    ],
)
def test_megatron_validation_rules(extra, world, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        _parse(extra, world)


def test_config_file_values_and_command_line_override(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("data_parallel_sharding_strategy: optim\nuse-megatron-fsdp: true\n"
                      "use_distributed_optimizer: true\nno-gradient-accumulation-fusion: true\nlr: 1.0e-2\n")
    args = _parse(["--config", str(config), "--lr", "5e-4"])
    assert args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim"
    assert args.gradient_accumulation_fusion is False
    assert args.lr == 5e-4  # the command line wins
    assert args.global_batch_size == 8 and args.num_microbatches == 2


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_are_valid(name):
    # HSDP configs are for 4 ranks and the GPU config for 8; every other one for 2.
    world = 4 if "hsdp" in name else 8 if "gpu" in name else 2
    args = parse_args(["--config", str(REPO / "configs" / name)], world_size=world)
    assert args.train_iters > 0 and args.global_batch_size % (args.micro_batch_size * world) == 0


def test_mcore_models_and_nccl_on_cpu_are_clear_errors():
    if device_mod.cuda_available():
        pytest.skip("with CUDA, --use-mcore-models and nccl are valid requests")
    with pytest.raises(ArgumentError, match=r"--use-mcore-models needs (megatron-core|CUDA)"):
        _parse(["--use-mcore-models"])
    with pytest.raises(ArgumentError, match="--distributed-backend nccl needs CUDA"):
        _parse(["--distributed-backend", "nccl"])


# -- pieces (no processes) ------------------------------------------------------------
def test_batch_layout_covers_the_global_batch_once():
    dp, mbs, micro, consumed = 4, 3, 2, 48
    seen = []
    for rank in range(dp):
        layout = BatchLayout(micro_batch_size=mbs, num_microbatches=micro, dp_rank=rank, dp_size=dp)
        for m in range(micro):
            seen += list(layout.sample_indices(consumed, m))
    assert sorted(seen) == list(range(consumed, consumed + dp * mbs * micro))


def test_text_dataset_is_deterministic_and_reshuffles_each_epoch():
    tokens = torch.arange(1000) % 256
    a, b = (TextDataset(tokens, range(0, 30), seq_length=32, seed=7) for _ in range(2))
    assert all(torch.equal(a.sample(i), b.sample(i)) for i in range(60))
    first_epoch = [int(a.sample(i)[0]) for i in range(30)]
    second_epoch = [int(a.sample(i)[0]) for i in range(30, 60)]
    assert sorted(first_epoch) == sorted(second_epoch) and first_epoch != second_epoch
    assert a.sample(3).shape == (33,)


@pytest.mark.parametrize("style", list(LRDecayStyle))
def test_lr_schedule_warms_up_then_decays_to_min(style):
    sched = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=100, style=style)
    assert sched.lr_at(0) == 0.0 and sched.lr_at(5) == pytest.approx(0.5) and sched.lr_at(10) == 1.0
    end = sched.lr_at(100)
    expected = {LRDecayStyle.CONSTANT: 1.0, LRDecayStyle.INVERSE_SQUARE_ROOT: (10 / 100) ** 0.5}.get(style, 0.1)
    assert end == pytest.approx(expected)
    assert sched.lr_at(1000) == pytest.approx(max(0.1, (10 / 1000) ** 0.5) if style is LRDecayStyle.INVERSE_SQUARE_ROOT
                                              else expected)


def test_gradient_health_stops_or_skips_divergent_iterations(pool2):
    """A divergent run (absurd learning rate): with --check-for-nan-in-loss-and-grad
    it stops with a clear error, as Megatron-LM does; without, the bad iterations are
    skipped and counted in the iteration line."""
    diverge = TINY + FSDP + ["--lr", "1e30", "--min-lr", "0", "--clip-grad", "0", "--train-iters", "4",
                             "--log-interval", "1", "--eval-interval", "100", "--plot-path", "none"]
    checked = torchrun(diverge + ["--check-for-nan-in-loss-and-grad"])
    assert checked.returncode != 0
    assert re.search(r"(NaN|nan|inf)", checked.stdout + checked.stderr)
    assert "--no-check-for-nan-in-loss-and-grad" in checked.stdout + checked.stderr
    unchecked = run_in_pool(pool2, diverge + ["--no-check-for-nan-in-loss-and-grad"])
    counts = [int(n) for n in re.findall(r"number of nan iterations: +(\d+)", unchecked)]
    assert counts and max(counts) > 0, unchecked[-2000:]
