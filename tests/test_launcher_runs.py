"""2-rank CPU runs of scripts/pretrain_gpt.py with command lines written like
Megatron-LM's example scripts (scaled down), and the launcher's exit / checkpoint /
dashboard flags.

* GPT-3 (examples/gpt3/train_gpt3_175b_distributed.sh shape, fp32 so that the two
  wrappers are comparable bit for bit): Megatron-FSDP ZeRO-3 equals PyTorch DDP at
  every iteration (1e-5) and the loss falls. The Megatron-FSDP runs also recompute
  activations (uniform, block or selective), which must not change a number.
* ``--async-save`` publishes Megatron's layout; ``--finetune`` restarts from its
  weights at iteration 0; ``--no-load-optim`` resumes progress without optimizer state.
* ``--exit-signal-handler`` / ``--exit-duration-in-mins``: every rank stops together.
* ``--wandb-project`` logs through the wandb package (a recording stand-in here).

The GPT-3 command and the W&B run go through torchrun and scripts/pretrain_gpt.py (the
path users launch); the others run the same driver in the shared gloo pool.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from launcher_inprocess import launch_task

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "pretrain_gpt.py"

# Megatron-LM's GPT-3 175B script, scaled down: 96 -> 2 layers, 12288 -> 64 hidden, 2 CPU ranks,
# TP 8 / PP 16 -> 1 (no pipeline parallelism here), --fp16 left out (see the module docstring).
GPT3_STYLE = """
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
    --attention-backend auto
    --micro-batch-size 2 --global-batch-size 8 --train-iters 12 --weight-decay 0.1 --adam-beta1 0.9
    --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --lr 6.0e-3 --lr-decay-style cosine
    --min-lr 6.0e-4 --lr-warmup-fraction .1 --lr-decay-iters 12
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --split 949,50,1
    --log-interval 4 --eval-interval 6 --eval-iters 1 --plot-path none
    --hidden-dropout 0.0 --attention-dropout 0.0
"""
FSDP_FLAGS = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor"
RECOMPUTE = {"uniform": " --recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
             "block": " --recompute-granularity full --recompute-method block --recompute-num-layers 1",
             "selective": " --recompute-activations"}


def torchrun(args: list[str], env_extra: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    # CPU/gloo also on a GPU machine: two ranks here compare with DDP on gloo.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    env.update(env_extra or {})
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if "WANDB_MODE" not in (env_extra or {}):
        env.pop("WANDB_MODE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def launch(pool, args: list[str]) -> str:
    """The same run in the shared gloo pool (no torchrun start-up): rank 0's log lines."""
    return "\n".join(pool.run(launch_task, flags=shlex.join(args))[0])


def metrics(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def data_flags(tmp_path_factory) -> list[str]:
    """Megatron's data flags for an indexed BPE dataset of data/corpus.txt, built here by
    scripts/preprocess_data.py with the shipped GPT-2 BPE vocabulary; the byte-level
    corpus (no flags) in a checkout without the vocabulary."""
    vocab, merges = REPO / "data" / "bpe" / "vocab.json", REPO / "data" / "bpe" / "merges.txt"
    preprocess = REPO / "scripts" / "preprocess_data.py"
    if not (preprocess.is_file() and vocab.is_file()):
        return []
    out = tmp_path_factory.mktemp("bpe_data")
    subprocess.run([sys.executable, str(preprocess), "--input", str(REPO / "data" / "corpus.txt"),
                    "--output-prefix", str(out / "corpus"), "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", str(vocab), "--merge-file", str(merges), "--append-eod", "--workers", "1"],
                   check=True, cwd=REPO, capture_output=True, timeout=300)
    return ["--data-path", str(out / "corpus_text_document"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(vocab), "--merge-file", str(merges), "--data-cache-path", str(out / "cache")]


def test_gpt3_style_command_fsdp_equals_ddp_every_iteration(tmp_path, data_flags):
    ddp = tmp_path / "ddp.json"
    fsdp = tmp_path / "fsdp.json"
    torchrun(shlex.split(GPT3_STYLE) + data_flags + ["--log-json", str(ddp)])
    # The Megatron-FSDP run also recomputes activations (whole groups of 2 blocks): still the same numbers.
    proc = torchrun(shlex.split(GPT3_STYLE + FSDP_FLAGS + RECOMPUTE["uniform"]) + data_flags + ["--log-json", str(fsdp)])
    assert "Megatron-FSDP (optim_grads_params)" in proc.stdout
    a, b = metrics(fsdp), metrics(ddp)
    assert a["iterations"] == b["iterations"] == list(range(1, 13))
    for it, x, y in zip(a["iterations"], a["lm_loss"], b["lm_loss"]):
        assert abs(x - y) <= 1e-5, f"iteration {it}: Megatron-FSDP {x} vs DDP {y}"
    assert a["learning_rate"] == b["learning_rate"]
    assert sum(a["lm_loss"][-3:]) / 3 < sum(a["lm_loss"][:3]) / 3 - 0.5, a["lm_loss"]


# Megatron-LM's Llama-3-8B Megatron-FSDP script, scaled down (32 -> 2 layers, 4096 -> 64 hidden, 32 -> 4
# heads with 8 -> 2 query groups, 14336 -> 192 FFN; the indexed BPE corpus instead of mock data).
LLAMA3_STYLE = """
    --use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32
    --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
    --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
    --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
    --micro-batch-size 1 --global-batch-size 8 --train-samples 96 --lr-decay-samples 96 --lr-warmup-samples 8
    --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9
    --adam-beta2 0.95 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
    --split '99,1,0'
    --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
    --log-interval 4 --eval-iters 1 --eval-interval 6 --log-throughput --distributed-timeout-minutes 60
    --plot-path none
"""
# The script's Megatron-FSDP branch (with its DDP_ARGS); the reference is PyTorch DDP (no such flags).
LLAMA3_FSDP = """--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion
    --init-model-with-meta-device --ckpt-format fsdp_dtensor --fsdp-double-buffer
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"""
MOE = " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 1e-2 --moe-layer-freq [0]*1+[1]*1 "


@pytest.mark.parametrize("family", [
    "llama3",
    pytest.param("llama3_moe", marks=pytest.mark.skipif(not os.environ.get("MFSDP_LAUNCHER_LONG"), reason=(
        "MoE through the launcher is run by test_launcher_ep_cp.py and test_launcher_recipe_flags.py; "
        "MFSDP_LAUNCHER_LONG=1")))])
def test_llama3_style_command_fsdp_equals_ddp_every_iteration(pool2, tmp_path, family, data_flags):
    # --use-mcore-models needs CUDA; on CPU the same command trains the embedded model.
    base = LLAMA3_STYLE.replace("--use-mcore-models", "") + (MOE if family == "llama3_moe" else "")
    ddp, fsdp = tmp_path / "ddp.json", tmp_path / "fsdp.json"
    launch(pool2, shlex.split(base) + data_flags + ["--log-json", str(ddp)])
    # Megatron-FSDP with activation recomputation against DDP without it.
    recompute = RECOMPUTE["selective" if family == "llama3_moe" else "block"]
    stdout = launch(pool2, shlex.split(base + LLAMA3_FSDP + recompute) + data_flags + ["--log-json", str(fsdp)])
    assert "WARNING: --apply-layernorm-1p" not in stdout  # zero-centred norms are used now
    a, b = metrics(fsdp), metrics(ddp)
    assert a["iterations"] == b["iterations"] == list(range(1, 13))
    for it, x, y in zip(a["iterations"], a["lm_loss"], b["lm_loss"]):
        assert abs(x - y) <= 1e-5, f"iteration {it}: Megatron-FSDP {x} vs DDP {y}"
    assert sum(a["lm_loss"][-3:]) / 3 < sum(a["lm_loss"][:3]) / 3 - 0.3, a["lm_loss"]
    if family == "llama3_moe":  # Megatron-LM's MoE log: the balancing loss (no coefficient), DP-averaged
        assert "| load_balancing_loss: " in stdout
        assert len(a["load_balancing_loss"]) == 12 and all(0.5 < v < 4 for v in a["load_balancing_loss"])
        for x, y in zip(a["load_balancing_loss"], b["load_balancing_loss"]):
            assert abs(x - y) <= 1e-4


def test_async_save_then_finetune_and_no_load_optim(pool2, tmp_path):
    ckpt = tmp_path / "ckpt"
    base = shlex.split(GPT3_STYLE + FSDP_FLAGS)
    first = tmp_path / "first.json"
    stdout = launch(pool2, base + ["--train-iters", "8", "--lr-decay-iters", "8", "--save", str(ckpt),
                            "--save-interval", "4", "--async-save", "--log-json", str(first)])
    assert "successfully saved checkpoint from iteration       8" in stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000004", "iter_0000008",
                                                      "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "8"

    tuned = tmp_path / "tuned.json"
    stdout = launch(pool2, base + ["--train-iters", "2", "--lr-decay-iters", "2", "--lr-warmup-fraction", "0",
                            "--load", str(ckpt), "--finetune", "--log-json", str(tuned)])
    assert "--finetune: loaded the weights only" in stdout
    tuned_metrics = metrics(tuned)
    assert tuned_metrics["iterations"] == [1, 2]  # progress restarts
    # The weights were loaded: the first loss is that of the trained model, not of a fresh one.
    assert tuned_metrics["lm_loss"][0] < metrics(first)["lm_loss"][0] - 0.5

    resumed = tmp_path / "resumed.json"
    # --no-load-optim: as in Megatron-LM, which loads the schedule and loss scale with the optimizer,
    # all three start fresh (a longer schedule than the checkpoint's needs no override flag), while
    # the iteration count goes on: iteration 5 runs at the restarted warmup's first LR, 0.
    stdout = launch(pool2, base + ["--train-iters", "10", "--lr-decay-iters", "10", "--load", str(ckpt), "--ckpt-step", "4",
                            "--no-load-optim", "--log-json", str(resumed)])
    assert "resuming at iteration 4" in stdout and "--no-load-optim: optimizer, learning-rate" in stdout
    assert metrics(resumed)["iterations"] == list(range(5, 11))
    assert metrics(resumed)["learning_rate"][0] == 0.0 and metrics(resumed)["learning_rate"][1] > 0


# -- exit conditions (in the shared gloo worker pool) ---------------------------------------
def _exit_task(rank: int, world: int, *, which: str) -> str | None:
    import time

    import torch

    from megatron_fsdp.training.exit_conditions import ExitConditions

    args = types.SimpleNamespace(exit_interval=None, exit_duration_in_mins=None, exit_signal_handler=False,
                                 exit_signal="SIGTERM")
    if which == "signal":
        args.exit_signal_handler = True
    else:
        args.exit_duration_in_mins = 1
    exits = ExitConditions(args, torch.device("cpu"))
    try:
        before = exits.reason(1)
        if rank == 0:  # only one rank is signalled / over time: the decision is still collective
            if which == "signal":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
            else:
                exits.start -= 120
        return f"{before}|{exits.reason(2)}"
    finally:
        exits.close()


@pytest.mark.parametrize("which, reason", [("signal", "signal SIGTERM (--exit-signal-handler)"),
                                           ("duration", "--exit-duration-in-mins 1")])
def test_exit_conditions_stop_every_rank_together(pool2, which, reason):
    assert pool2.run(_exit_task, which=which) == [f"None|{reason}"] * 2


# -- W&B ------------------------------------------------------------------------------------
FAKE_WANDB = '''
import json, os
_log = os.environ["FAKE_WANDB_LOG"]
class _Run:
    def log(self, data, step=None):
        with open(_log, "a") as f: f.write(json.dumps({"log": data, "step": step}) + "\\n")
    def finish(self):
        with open(_log, "a") as f: f.write(json.dumps({"finish": True}) + "\\n")
def init(**kwargs):
    with open(_log, "a") as f:
        f.write(json.dumps({"init": {k: kwargs[k] for k in ("project", "name")}, "mode": os.environ.get("WANDB_MODE")}) + "\\n")
    return _Run()
'''


def test_wandb_project_logs_offline_through_wandb(tmp_path):
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "wandb.py").write_text(FAKE_WANDB)
    log = tmp_path / "wandb.jsonl"
    env = {"PYTHONPATH": f"{stub}{os.pathsep}{REPO}", "FAKE_WANDB_LOG": str(log)}
    torchrun(shlex.split(GPT3_STYLE) + ["--train-iters", "3", "--lr-decay-iters", "3", "--wandb-project", "proj",
                                        "--wandb-exp-name", "run1", "--wandb-save-dir", str(tmp_path / "w")],
             env_extra=env)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0] == {"init": {"project": "proj", "name": "run1"}, "mode": "offline"}  # one writer: rank 0
    losses = [r for r in records if "log" in r and "lm loss" in r["log"]]
    assert [r["step"] for r in losses] == [1, 2, 3]
    assert records[-1] == {"finish": True}


# -- DDP and MoE: no search for unused parameters -------------------------------------------
def _ddp_moe_task(rank: int, world: int) -> dict:
    from unittest import mock

    import torch

    from megatron_fsdp.models import GPT, GPTConfig, gpt_loss, moe
    from megatron_fsdp.training.model_setup import needs_find_unused_parameters

    def to_first_two(logits, topk, *_, **__):  # experts 2 and 3 get no token at all
        probs = torch.softmax(logits[:, :topk], dim=-1)
        return probs, torch.arange(topk).expand(logits.shape[0], topk)

    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                          num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2))
    find_unused = needs_find_unused_parameters(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    with mock.patch.object(moe, "route", to_first_two):
        for _ in range(3):  # DDP would fail from the 2nd iteration on if a gradient were missing
            opt.zero_grad()
            gpt_loss(ddp(tokens[:, :-1]), tokens[:, 1:]).backward()
            opt.step()
    idle = model.blocks[0].mlp.experts[3].fc.weight.grad
    return dict(find_unused=find_unused, idle_grad_is_zero=idle is not None and bool((idle == 0).all()))


def test_ddp_moe_needs_no_unused_parameter_search(pool2):
    assert pool2.run(_ddp_moe_task) == [dict(find_unused=False, idle_grad_is_zero=True)] * 2
    import torch

    from megatron_fsdp.models.moe import mark_expert_parameters
    from megatron_fsdp.training.model_setup import needs_find_unused_parameters

    other = torch.nn.Linear(2, 2)
    assert not needs_find_unused_parameters(other)
    mark_expert_parameters(other)  # an MoE model this launcher does not know: DDP searches
    assert needs_find_unused_parameters(other)


# -- Megatron-core DDP on this engine ---------------------------------------------------
def _ddp_path_task(rank: int, world: int, *, flags: list[str]) -> dict:
    import torch

    from megatron_fsdp.training.args.arguments import parse_args
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer

    args = parse_args(("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
                       "--max-position-embeddings 8 --micro-batch-size 1 --lr 1e-3 --train-iters 2 --mock-data "
                       "--vocab-size 64").split() + flags, world_size=world)
    bundle = setup_model_and_optimizer(args, torch.device("cpu"))
    model = bundle.model
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return dict(path=args.dp_path.value, wrapper="torch")
    with model.compute_params_registered() as module:  # the weights forward computes with
        weights = {p.dtype for p in module.parameters()}
    main = {p.dtype for g in bundle.optimizer.param_groups for p in g["params"]}
    return dict(path=args.dp_path.value, strategy=args.zero_strategy.label, weights=sorted(map(str, weights)),
                main=sorted(map(str, main)), grads=str(model.mp_policy.main_grads_dtype))


@pytest.mark.parametrize("flags, expected", [
    ([], dict(path="torch-ddp", wrapper="torch")),
    (["--use-distributed-optimizer"], dict(strategy="optim", weights=["torch.float32"], grads="torch.float32")),
    (["--bf16"], dict(strategy="no_shard", weights=["torch.bfloat16"], grads="torch.float32")),
    (["--bf16", "--grad-reduce-in-bf16"], dict(strategy="no_shard", grads="torch.bfloat16")),
    (["--fp16"], dict(strategy="no_shard", weights=["torch.float16"], grads="torch.float16")),
    (["--fp16", "--accumulate-allreduce-grads-in-fp32", "--use-distributed-optimizer"],
     dict(strategy="optim", grads="torch.float32")),
])
def test_ddp_path_follows_megatron_core_ddp(pool2, flags, expected):
    # megatron/training/arguments.py: bf16 accumulates and reduces gradients in fp32 unless
    # --grad-reduce-in-bf16; fp16 keeps them in fp16 unless --accumulate-allreduce-grads-in-fp32;
    # the optimizer always steps fp32 main weights.
    for result in pool2.run(_ddp_path_task, flags=flags):
        assert {k: result[k] for k in expected} == expected, (result, expected)
        if result.get("wrapper") != "torch":
            assert result["path"] == "megatron-ddp" and result["main"] == ["torch.float32"], result


# -- --check-weight-hash-across-dp-replicas-interval -------------------------------------
def _replica_check_task(rank: int, world: int, *, flags: list[str], corrupt: bool) -> str:
    import torch

    from megatron_fsdp.training.args.arguments import parse_args
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer
    from megatron_fsdp.training.observe.replica_check import ReplicaMismatchError, check_weight_replicas

    args = parse_args(("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
                       "--max-position-embeddings 8 --micro-batch-size 1 --lr 1e-3 --train-iters 2 --mock-data "
                       "--vocab-size 64 --check-weight-hash-across-dp-replicas-interval 1").split() + flags,
                      world_size=world)
    model = setup_model_and_optimizer(args, torch.device("cpu")).model
    if corrupt and rank == 1:  # one replica's weight changes on its own (a bit flip, a diverged rank)
        with torch.no_grad():
            next(iter(model.parameters())).add_(1.0)
    try:
        check_weight_replicas(model, iteration=5)
        return "match"
    except ReplicaMismatchError as exc:
        return str(exc)


@pytest.mark.parametrize("flags", [[], ["--bf16"], ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                                    "no_shard"]], ids=["torch_ddp", "megatron_ddp", "fsdp_no_shard"])
def test_weight_replica_check(pool2, flags):
    assert pool2.run(_replica_check_task, flags=flags, corrupt=False) == ["match"] * 2
    for message in pool2.run(_replica_check_task, flags=flags, corrupt=True):
        assert "iteration 5: the data-parallel replicas of" in message and "ranks [1]" in message, message


def test_weight_replica_check_refused_with_sharded_weights():
    from megatron_fsdp.training.args.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match="not supported with --data-parallel-sharding-strategy optim_grads_params"):
        parse_args("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
                   "--micro-batch-size 1 --lr 1e-3 --train-iters 2 --mock-data --vocab-size 64 --use-megatron-fsdp "
                   "--check-weight-hash-across-dp-replicas-interval 10".split(), world_size=2)
