"""``--megatron-fsdp-version 2``: the launcher shards the model with the per-module API
(megatron_fsdp/training/megatron_fsdp_v2.py), as Megatron-LM's FullyShardedDataParallelV2.

* fp32, 2 gloo ranks, 2 micro batches per rank, clipping, weight decay, --decoupled-lr: every
  iteration's loss and grad norm and the final weights equal version 1's (ZeRO-3 with the
  distributed optimizer) within 1e-5; every weight is a Shard(0) DTensor holding about half;
  a run resumed from its iteration-2 checkpoint ends bit for bit where the uninterrupted one ends.
* --bf16: fp32 main weights under bf16 compute, the loss curve version 1's within bf16 rounding.
* Megatron-LM's rules for version 2, and what it does not run here, are validation errors.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from megatron_fsdp.training.args.arg_types import ArgumentError, DataParallelPath
from megatron_fsdp.training.args.arguments import parse_args
from test_launcher_torch_fsdp2 import _assert_runs_match, _checkpoint, _max_weight_diff, _metrics, launch_and_look

TOL = 1e-5
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 3e-3 --adam-eps 1e-4 --clip-grad 1.0 "
        "--weight-decay 0.1 --hidden-dropout 0.0 --attention-dropout 0.0 --decoupled-lr 1e-2 "
        "--log-interval 1 --eval-iters 0 --plot-path none --use-megatron-fsdp --ckpt-format fsdp_dtensor ")
V2 = " --megatron-fsdp-version 2 --no-gradient-accumulation-fusion"


def run_task(rank: int, world: int, *, flags: str) -> dict:
    """One launcher run; the wrapper it built and how its weights are held (from inside)."""
    return launch_and_look(BASE + flags, world, "pretrain_gpt_fsdp_v2")


def test_version_2_trains_as_version_1_and_resumes_bit_for_bit(pool2, tmp_path):
    v2, v1, resumed = tmp_path / "v2", tmp_path / "v1", tmp_path / "resumed"
    seen = pool2.run(run_task, flags=V2 + f" --save {v2} --save-interval 2 --log-json {v2}.json")
    pool2.run(run_task, flags=f" --save {v1} --save-interval 4 --log-json {v1}.json")
    assert seen[0]["wrapper"] == "MegatronFSDPV2"
    for name, (sharded, dtype, local, numel) in seen[0]["params"].items():
        assert sharded and dtype == "torch.float32", name
    # Row-aligned flat buffers split a unit's rows (a small tensor may sit whole on one rank):
    # each rank holds about half of the weights, and together all of them.
    held = [sum(entry[2] for entry in rank["params"].values()) for rank in seen]
    whole = sum(entry[3] for entry in seen[0]["params"].values())
    assert max(held) <= 0.55 * whole and sum(held) >= whole, (held, whole)
    ours, reference = _metrics(Path(f"{v2}.json")), _metrics(Path(f"{v1}.json"))
    assert ours["iterations"] == [1, 2, 3, 4] and ours["lm_loss"][-1] < ours["lm_loss"][0]
    _assert_runs_match(ours, reference, TOL)
    end = _checkpoint(v2, 4)
    assert _max_weight_diff(end, _checkpoint(v1, 4)) <= TOL

    pool2.run(run_task, flags=V2 + f" --load {v2} --ckpt-step 2 --save {resumed} --save-interval 2 "
                                   f"--log-json {resumed}.json")
    again = _metrics(Path(f"{resumed}.json"))
    assert again["iterations"] == [3, 4]
    assert again["lm_loss"] == ours["lm_loss"][2:] and again["grad_norm"] == ours["grad_norm"][2:]
    end_resumed = _checkpoint(resumed, 4)
    assert sorted(end_resumed) == sorted(end) and any(k.startswith("optimizer.state.") for k in end)
    for key, value in end.items():  # weights and Adam moments
        assert torch.equal(value, end_resumed[key]), key


def mcore_task(rank: int, world: int, *, flags: str) -> dict:
    from test_launcher_torch_fsdp2 import _mcore_on_cpu

    with _mcore_on_cpu(world):
        return run_task(rank, world, flags=flags)


def test_version_2_shards_megatron_core_models_as_version_1_trains_them(pool2, tmp_path):
    mcore = (" --use-mcore-models --distributed-backend nccl --swiglu --disable-bias-linear --normalization RMSNorm "
             "--position-embedding-type rope --untie-embeddings-and-output-weights")
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    seen = pool2.run(mcore_task, flags=V2 + mcore + f" --log-json {v2}.json")
    pool2.run(mcore_task, flags=mcore + f" --log-json {v1}.json")
    assert seen[0]["wrapper"] == "MegatronFSDPV2"
    assert any(name.startswith("module.decoder.layers.0.") for name in seen[0]["params"])
    _assert_runs_match(_metrics(Path(f"{v2}.json")), _metrics(Path(f"{v1}.json")), TOL)


def test_version_2_bf16_keeps_fp32_main_weights(pool2, tmp_path):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    seen = pool2.run(run_task, flags=V2 + f" --bf16 --log-json {v2}.json")
    pool2.run(run_task, flags=f" --bf16 --log-json {v1}.json")
    assert {dtype for _, dtype, *_ in seen[0]["params"].values()} == {"torch.float32"}
    a, b = _metrics(Path(f"{v2}.json")), _metrics(Path(f"{v1}.json"))
    # The same bf16 arithmetic, the gradients summed in another order: bf16 rounding apart.
    assert a["iterations"] == b["iterations"] == [1, 2, 3, 4]
    for it, x, y in zip(a["iterations"], a["lm_loss"], b["lm_loss"]):
        assert abs(x - y) <= 2 ** -8 * abs(y), (it, x, y)


# -- validation --------------------------------------------------------------------------------
def _parse(flags: str, world: int = 2):
    return parse_args(shlex.split(BASE + flags), world_size=world)


def test_the_flag_picks_version_2_without_the_distributed_optimizer():
    args = _parse(V2 + " --bf16")
    assert args.dp_path is DataParallelPath.MEGATRON_FSDP_V2 and not args.use_distributed_optimizer
    version_1 = _parse("")
    assert version_1.dp_path is DataParallelPath.MEGATRON_FSDP and version_1.use_distributed_optimizer


@pytest.mark.parametrize("flags, message", [
    (V2 + " --use-distributed-optimizer", "drop --use-distributed-optimizer"),
    (" --megatron-fsdp-version 2", "needs --no-gradient-accumulation-fusion"),
    (V2 + " --data-parallel-sharding-strategy optim_grads", "use --data-parallel-sharding-strategy optim_grads_params"),
    (V2 + " --calculate-per-token-loss", "does not normalise gradients by the global token count"),
    (V2 + " --tensor-model-parallel-size 2", "--tensor-model-parallel-size 2: v2 shards over data parallelism only"),
    (V2 + " --fp16", "v2 runs fp32 or --bf16 here"),
    (V2 + " --ckpt-format torch", "use --ckpt-format fsdp_dtensor"),
    (V2 + " --init-model-with-meta-device", "v2 shards a model built with its weights here"),
])
def test_what_version_2_does_not_run_is_refused(flags, message):
    with pytest.raises(ArgumentError, match=message):
        _parse(flags, world=4 if "tensor-model" in flags else 2)


def test_version_2_needs_megatron_fsdp():
    with pytest.raises(ArgumentError, match="needs --use-megatron-fsdp"):
        parse_args(shlex.split(BASE.replace("--use-megatron-fsdp --ckpt-format fsdp_dtensor ", "") + V2), world_size=2)
