"""``--ckpt-format torch``: Megatron-LM's legacy one-file checkpoint
(``iter_X/mp_rank_00/model_optim_rng.pt``) from scripts/pretrain_gpt.py.

* A 2-rank gloo DDP run of 4 iterations (dropout on, so the RNG state matters) saves at
  iterations 2 and 4; a run resumed from iteration 2 ends with the same weights and
  optimizer state (bit for bit) and the same losses at iterations 3 and 4.
* The file holds Megatron-LM's keys, loads with ``weights_only``, and one rng entry
  per data-parallel rank; ``--save-retain-interval`` retires checkpoints as in DCP.
* A damaged file or another model's is refused before any weight changes.
* The combinations Megatron-LM refuses (Megatron-FSDP, --async-save) and the sharded
  Megatron-core DDP path are refused at validation.

The runs call the script's ``run`` inside the shared gloo pool (no torchrun start-up).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_fsdp.training.arg_types import ArgumentError
from megatron_fsdp.training.arguments import parse_args

REPO = Path(__file__).resolve().parents[1]
BASE = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 4 --train-iters 4 --lr 3e-3 --adam-eps 1e-4 --seed 7 "
        "--lr-decay-style cosine --lr-warmup-iters 1 "
        "--log-interval 1 --eval-iters 0 --plot-path none --ckpt-format torch ")


def _script():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_ckpt_torch", REPO / "scripts" / "pretrain_gpt.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def run_task(rank: int, world: int, *, flags: str) -> None:
    args = parse_args(shlex.split(BASE + flags), world_size=world)
    _script().run(args, torch.device("cpu"))


def _file(root: Path, iteration: int) -> dict:
    from megatron_fsdp.training.torch_checkpoint import _read, model_file

    return _read(model_file(str(root), iteration))


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, (torch.Tensor, np.ndarray)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_resume_from_torch_format_matches_an_uninterrupted_run(pool2, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    pool2.run(run_task, flags=f"--save {full} --save-interval 2 --log-json {tmp_path / 'full.json'}")
    assert sorted(p.name for p in full.iterdir()) == ["iter_0000002", "iter_0000004",
                                                      "latest_checkpointed_iteration.txt"]
    assert (full / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(p.name for p in (full / "iter_0000002" / "mp_rank_00").iterdir()) == ["checksums.json",
                                                                                        "model_optim_rng.pt"]
    saved = _file(full, 2)  # weights_only, with Megatron-LM's keys
    assert {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler", "rng_state",
            "num_floating_point_operations_so_far"} <= saved.keys()
    assert saved["iteration"] == 2 and saved["checkpoint_version"] == 3.0
    assert isinstance(saved["args"], argparse.Namespace) and saved["args"].consumed_train_samples == 8
    assert saved["args"].hidden_size == 16 and len(saved["rng_state"]) == 2  # one per data-parallel rank
    assert "blocks.0.attn.qkv.weight" in saved["model"] and saved["optimizer"]["state"]

    pool2.run(run_task, flags=f"--load {full} --ckpt-step 2 --save {resumed} --save-interval 1 "
                              f"--save-retain-interval 2 --log-json {tmp_path / 'resumed.json'}")
    # --save-retain-interval 2: iteration 3's checkpoint went when 4's was published.
    assert sorted(p.name for p in resumed.iterdir()) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    end, end_resumed = _file(full, 4), _file(resumed, 4)
    for key in ("model", "optimizer", "opt_param_scheduler", "rng_state", "iteration", "megatron_fsdp"):
        _assert_same(end[key], end_resumed[key], key)
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("full", "resumed"))
    assert b["iterations"] == [3, 4] and b["lm_loss"] == a["lm_loss"][2:]


def refusal_task(rank: int, world: int, *, root: str) -> dict:
    """Load a damaged copy and another model's checkpoint: each refused, nothing changed."""
    import shutil

    from megatron_fsdp.checkpoint import CheckpointReadError
    from megatron_fsdp.state_dict import StateDictMismatchError
    from megatron_fsdp.training import torch_checkpoint
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer

    args = parse_args(shlex.split(BASE.replace("--hidden-size 16", "--hidden-size 32")), world_size=world)
    bundle = setup_model_and_optimizer(args, torch.device("cpu"))
    before = {k: v.clone() for k, v in bundle.model.module.state_dict().items()}
    out = {}
    try:
        torch_checkpoint.load(root, bundle.model, bundle.optimizer, step=2)
    except StateDictMismatchError as exc:
        out["mismatch"] = str(exc)
    damaged = f"{root}_damaged"
    if rank == 0:  # one flipped byte in a copy
        shutil.copytree(root, damaged)
        path = torch_checkpoint.model_file(damaged, 2)
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))
    torch.distributed.barrier()
    try:
        torch_checkpoint.load(damaged, bundle.model, bundle.optimizer, step=2)
    except CheckpointReadError as exc:
        out["damaged"] = str(exc)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in bundle.model.module.state_dict().items())
    return out


def test_damaged_or_foreign_checkpoint_is_refused_before_loading(pool2, tmp_path):
    root = tmp_path / "ckpt"
    pool2.run(run_task, flags=f"--train-iters 2 --lr-decay-iters 4 --save {root} --save-interval 2")
    for out in pool2.run(refusal_task, root=str(root)):
        assert "does not fit this model" in out["mismatch"] and "blocks.0.attn.qkv.weight" in out["mismatch"]
        assert "does not match its checksum" in out["damaged"]
        assert out["unchanged"]


@pytest.mark.parametrize("flags, message", [
    ("--use-megatron-fsdp", "cannot be used with --use-megatron-fsdp .*use --ckpt-format fsdp_dtensor"),
    ("--bf16", "only for PyTorch DDP runs .* with --bf16 .*use --ckpt-format torch_dist"),
    ("--use-distributed-optimizer", "with --use-distributed-optimizer the model and optimizer state are DTensors"),
    ("--save /tmp/x --save-interval 2 --async-save", "Megatron-LM has no asynchronous save for its legacy"),
])
def test_unsupported_combinations_are_refused(flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(shlex.split(BASE + flags), world_size=2)


def test_plain_ddp_accepts_the_torch_format():
    args = parse_args(shlex.split(BASE + "--save /tmp/x --save-interval 2"), world_size=2)
    assert args.ckpt_format == "torch" and args.dp_path.value == "torch-ddp"
