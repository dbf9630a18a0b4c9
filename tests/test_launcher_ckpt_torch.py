"""``--ckpt-format torch``: Megatron-LM's legacy one-file checkpoint
(``iter_X/mp_rank_00/model_optim_rng.pt``) from scripts/pretrain_gpt.py.

* A 2-rank gloo DDP run of 4 iterations (dropout on, so the RNG state matters) saves at
  iterations 2 and 4; a run resumed from iteration 2 ends with the same weights and
  optimizer state (bit for bit) and the same losses at iterations 3 and 4.
* The file holds Megatron-LM's keys, loads with ``weights_only``, and one rng entry
  per data-parallel rank; ``--save-retain-interval`` retires checkpoints as in DCP.
* The same with --bf16 (Megatron-FSDP's no_shard engine), --bf16
  --use-distributed-optimizer (ZeRO-1: the sharded state gathered to rank 0, with
  Megatron-LM's separate distrib_optim.pt) and --fp16 with dynamic loss scaling:
  bf16/fp16 model entry (the module's state dict, loadable into the unwrapped GPT), fp32
  main weights in the optimizer's entries, bit-equal resume.
* A distributed-optimizer checkpoint loads at another data-parallel size and into runs of
  the other optimizer forms, a PyTorch-DDP one into a distributed-optimizer run: saved
  again from there, the main weights and optimizer state are the same tensors.
* A damaged file or another model's is refused before any weight changes.
* The combinations Megatron-LM refuses (Megatron-FSDP, --async-save, the distributed
  optimizer without gloo groups) are refused at validation.
* --overlap-param-gather-with-optimizer-step (two recipes pair it with this format) is
  accepted with a warning under Megatron-LM's rules and changes no number; those recipes'
  shape (megatron-core's GPTModel, bf16, distributed optimizer, both overlaps, dropout on)
  resumes bit for bit (megatron-core's RNG tracker streams included), and its model entry
  loads into megatron-core's GPTModel.

The runs call the script's ``run`` inside the shared gloo pool (no torchrun start-up).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from launcher_inprocess import pretrain_script, run_launcher
from megatron_fsdp.training.args.arg_types import ArgumentError
from megatron_fsdp.training.args.arguments import parse_args

REPO = Path(__file__).resolve().parents[1]
BASE = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 4 --train-iters 4 --lr 3e-3 --adam-eps 1e-4 --seed 7 "
        "--lr-decay-style cosine --lr-warmup-iters 1 "
        "--log-interval 1 --eval-iters 0 --plot-path none --ckpt-format torch ")


def run_task(rank: int, world: int, *, flags: str) -> None:
    run_launcher(BASE + flags, world)


def _file(root: Path, iteration: int) -> dict:
    from megatron_fsdp.training.checkpoint.torch_checkpoint import _read, model_file

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

    from megatron_fsdp.state.checkpoint import CheckpointReadError
    from megatron_fsdp.state.model_state_dict import StateDictMismatchError
    from megatron_fsdp.training.checkpoint import torch_checkpoint
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
    ("--use-distributed-optimizer --disable-gloo-process-groups", "over a gloo process group.*Megatron-LM's rule"),
    ("--save /tmp/x --save-interval 2 --async-save", "Megatron-LM has no asynchronous save for its legacy"),
])
def test_unsupported_combinations_are_refused(flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(shlex.split(BASE + flags), world_size=2)


@pytest.mark.parametrize("flags, path", [("", "torch-ddp"), ("--bf16", "megatron-ddp"), ("--fp16", "megatron-ddp"),
                                         ("--bf16 --use-distributed-optimizer", "megatron-ddp"),
                                         ("--use-distributed-optimizer", "megatron-ddp"),
                                         ("--ddp-average-in-collective", "megatron-ddp")])
def test_ddp_paths_accept_the_torch_format(flags, path):
    args = parse_args(shlex.split(BASE + "--save /tmp/x --save-interval 2 " + flags), world_size=2)
    assert args.ckpt_format == "torch" and args.dp_path.value == path


# -- bf16 / fp16 / distributed optimizer ---------------------------------------------------------
# Dynamic loss scaling that moves within the run: doubled after iterations 1-2 (--loss-scale-window 2),
# iteration 3 overflows (skipped) and halves it.
FP16 = "--fp16 --initial-loss-scale 65536 --loss-scale-window 2 --hysteresis 1 "
MIXED = [pytest.param("--bf16 --decoupled-lr 6e-3", id="bf16-decoupled-lr"),  # the recipes' flags
         pytest.param("--bf16 --use-distributed-optimizer", id="bf16-distributed-optimizer"),
         pytest.param(FP16, id="fp16-dynamic-scale"),
         pytest.param(FP16 + "--use-distributed-optimizer", id="fp16-dynamic-scale-distributed-optimizer"),
         pytest.param("--use-distributed-optimizer", id="fp32-distributed-optimizer")]
KEYS = ("model", "optimizer", "opt_param_scheduler", "rng_state", "iteration", "megatron_fsdp")


def _distrib(root: Path, iteration: int) -> dict:
    from megatron_fsdp.training.checkpoint.torch_checkpoint import _read, distrib_optim_file

    return _read(distrib_optim_file(str(root), iteration), key="param")


def _main_weights(saved: dict, distrib) -> dict:
    """name -> fp32 main weights, from the optimizer's entries (Megatron-LM's keys)."""
    names = saved["megatron_fsdp"]["param_names"]
    lists = distrib["param"] if distrib is not None else saved["optimizer"]["fp32_from_fp16_params"]
    return {name: value for group, values in zip(names, lists) for name, value in zip(group, values, strict=True)}


@pytest.mark.parametrize("precision", MIXED)
def test_mixed_precision_resume_from_torch_format_matches_an_uninterrupted_run(pool2, tmp_path, precision):
    from megatron_fsdp.models.gpt import GPT
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    distributed = "--use-distributed-optimizer" in precision
    half = torch.float16 if "--fp16" in precision else torch.bfloat16 if "--bf16" in precision else torch.float32
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    pool2.run(run_task, flags=f"{precision} --save {full} --save-interval 2 --log-json {tmp_path / 'full.json'}")
    files = sorted(p.name for p in (full / "iter_0000002" / "mp_rank_00").iterdir())
    assert files == ["checksums.json"] + ["distrib_optim.pt"] * distributed + ["model_optim_rng.pt"]
    saved = _file(full, 2)
    distrib = _distrib(full, 2) if distributed else None
    # The model entry is the module's own state dict in its compute dtype (Megatron-LM's `model`) ...
    args = parse_args(shlex.split(BASE + precision), world_size=2)
    GPT(gpt_config_from_args(args)).to(half).load_state_dict(saved["model"])  # strict: the same keys
    assert {v.dtype for v in saved["model"].values()} == {half}
    # ... the cast of the fp32 main weights, which the optimizer's entries hold (Megatron-LM's keys).
    main = _main_weights(saved, distrib)
    assert main.keys() == dict(GPT(gpt_config_from_args(args)).named_parameters()).keys()
    for name, value in main.items():
        assert value.dtype == torch.float32 and torch.equal(value.to(half), saved["model"][name]), name
    if half is not torch.float32:  # more than the model's precision
        assert not all(torch.equal(v, v.to(half).float()) for v in main.values())
    wte = [n for group in saved["megatron_fsdp"]["param_names"] for n in group].index("wte.weight")
    if distributed:
        assert saved["optimizer"].keys() <= {"optimizer", "grad_scaler"}
        assert all("params" not in g for g in saved["optimizer"]["optimizer"]["param_groups"])
        assert distrib["format"] == "megatron_fsdp" and distrib["state"][wte]["exp_avg"].shape == (256, 16)
    else:
        assert saved["optimizer"]["optimizer"]["state"][wte]["exp_avg"].shape == (256, 16)
    if half is torch.float16:
        scaler = saved["optimizer"]["grad_scaler"]
        assert scaler.keys() == {"scale", "growth_tracker", "hysteresis_tracker"}
        assert float(scaler["scale"]) == 2 * 65536 and scaler["growth_tracker"] == 0  # doubled at iteration 2
    else:
        assert "grad_scaler" not in saved["optimizer"]

    pool2.run(run_task, flags=f"{precision} --load {full} --ckpt-step 2 --save {resumed} --save-interval 2 "
                              f"--log-json {tmp_path / 'resumed.json'}")
    end, end_resumed = _file(full, 4), _file(resumed, 4)
    for key in KEYS:
        _assert_same(end[key], end_resumed[key], key)
    if distributed:
        _assert_same(_distrib(full, 4), _distrib(resumed, 4), "distrib_optim")
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("full", "resumed"))
    assert b["iterations"] == [3, 4] and b["lm_loss"] == a["lm_loss"][2:]
    if half is torch.float16:  # iteration 3 overflowed in both runs
        assert float(end_resumed["optimizer"]["grad_scaler"]["scale"]) == 65536


def resave_task(rank: int, world: int, *, root: str, out: str, flags: str) -> None:
    """Load iteration 2 of ``root`` into a run with ``flags`` on ``world`` ranks and save it
    again, untouched, to ``out``."""
    from megatron_fsdp.training.checkpoint import torch_checkpoint
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer

    args = parse_args(shlex.split(BASE + flags), world_size=world)
    bundle = setup_model_and_optimizer(args, torch.device("cpu"))
    extra = torch_checkpoint.load(root, bundle.model, bundle.optimizer, step=2)
    torch_checkpoint.save(out, 2, bundle.model, bundle.optimizer, extra, args)


def engine_refusal_task(rank: int, world: int, *, root: str) -> dict:
    """On the sharded engine: another parameter grouping (--decoupled-lr) and a damaged
    distrib_optim.pt are refused; neither run's weights change."""
    import shutil

    import megatron_fsdp as mf
    from megatron_fsdp.state.checkpoint import CheckpointReadError
    from megatron_fsdp.state.model_state_dict import StateDictMismatchError
    from megatron_fsdp.training.checkpoint import torch_checkpoint
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer

    out = {}
    regrouped = setup_model_and_optimizer(
        parse_args(shlex.split(BASE + "--bf16 --use-distributed-optimizer --decoupled-lr 6e-3"), world_size=world),
        torch.device("cpu"))
    same = setup_model_and_optimizer(parse_args(shlex.split(BASE + "--bf16 --use-distributed-optimizer"),
                                                world_size=world), torch.device("cpu"))
    before = [mf.get_full_state_dict(b.model) for b in (regrouped, same)]
    try:
        torch_checkpoint.load(root, regrouped.model, regrouped.optimizer, step=2)
    except StateDictMismatchError as exc:
        out["regrouped"] = str(exc)
    damaged = f"{root}_damaged"
    if rank == 0:
        shutil.copytree(root, damaged)
        with open(torch_checkpoint.distrib_optim_file(damaged, 2), "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0xFF]))
    torch.distributed.barrier()
    try:
        torch_checkpoint.load(damaged, same.model, same.optimizer, step=2)
    except CheckpointReadError as exc:
        out["damaged"] = str(exc)
    after = [mf.get_full_state_dict(b.model) for b in (regrouped, same)]
    out["unchanged"] = all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)
    return out


def test_engine_refuses_before_loading(pool2, tmp_path):
    root = tmp_path / "ckpt"
    pool2.run(run_task, flags=f"--bf16 --use-distributed-optimizer --train-iters 2 --lr-decay-iters 4 --save {root} "
                              "--save-interval 2")
    for out in pool2.run(engine_refusal_task, root=str(root)):
        assert "parameter groups hold" in out["regrouped"] and "--no-load-optim" in out["regrouped"]
        assert "distrib_optim.pt does not match its checksum" in out["damaged"]
        assert out["unchanged"]


def _logical(root: Path, iteration: int = 2) -> dict:
    """What a checkpoint of any optimizer form holds, by parameter name: the fp32 main
    weights and torch.optim's per-parameter state."""
    saved = _file(root, iteration)
    progress = saved["megatron_fsdp"]
    names = [name for group in progress["param_names"] for name in group]
    if progress["optimizer_form"] == "distributed":
        distrib = _distrib(root, iteration)
        main, state = [v for group in distrib["param"] for v in group], distrib["state"]
    elif progress["optimizer_form"] == "float16":
        main = [v for group in saved["optimizer"]["fp32_from_fp16_params"] for v in group]
        state = saved["optimizer"]["optimizer"]["state"]
    else:
        main, state = [saved["model"][name] for name in names], saved["optimizer"]["state"]
    return {"main": dict(zip(names, main, strict=True)), "state": {names[i]: v for i, v in state.items()},
            "train_state": progress["train_state"], "opt_param_scheduler": saved["opt_param_scheduler"]}


@pytest.mark.parametrize("saving, world, loading", [
    ("--bf16 --use-distributed-optimizer", 4, "--bf16 --use-distributed-optimizer"),
    ("--bf16 --use-distributed-optimizer", 2, "--bf16"),
    ("--bf16 --use-distributed-optimizer", 2, ""),
    ("", 2, "--bf16 --use-distributed-optimizer"),
], ids=["distributed-4-ranks", "distributed-to-no-shard", "distributed-to-pytorch-ddp", "pytorch-ddp-to-distributed"])
def test_checkpoint_loads_across_data_parallel_sizes_and_forms(pool2, pool4, tmp_path, saving, world, loading):
    """Saved by 2 ranks, loaded by 4 (each cuts its pieces, some empty) or into a run of
    another optimizer form (fp32 PyTorch DDP included), and saved again from there: the
    same fp32 main weights, optimizer state, progress and schedule."""
    root, again = tmp_path / "ckpt", tmp_path / "again"
    pool2.run(run_task, flags=f"{saving} --train-iters 2 --lr-decay-iters 4 --save {root} --save-interval 2")
    (pool4 if world == 4 else pool2).run(resave_task, root=str(root), out=str(again), flags=loading)
    _assert_same(_logical(root), _logical(again), "checkpoint")
    if saving == loading:
        _assert_same(_file(root, 2)["model"], _file(again, 2)["model"], "model")


# -- --overlap-param-gather-with-optimizer-step -------------------------------------------------
OVERLAP = "--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
WITH_STEP = OVERLAP + "--overlap-param-gather-with-optimizer-step "


def test_overlap_param_gather_with_optimizer_step_changes_no_number(pool2, tmp_path):
    """The recipes' combination (bf16, distributed optimizer, both overlaps, torch format):
    the flag warns, and the run, saved and resumed, equals the run without it bit for bit."""
    args = parse_args(shlex.split(BASE + WITH_STEP), world_size=2)
    assert [w for w in args.flag_warnings if w.startswith("--overlap-param-gather-with-optimizer-step: accepted, "
                                                          "no effect here")]
    runs = {name: tmp_path / name for name in ("with", "without", "resumed")}
    pool2.run(run_task, flags=f"{WITH_STEP} --save {runs['with']} --save-interval 2 --log-json {tmp_path / 'with.json'}")
    pool2.run(run_task, flags=f"{OVERLAP} --save {runs['without']} --save-interval 4 "
                              f"--log-json {tmp_path / 'without.json'}")
    pool2.run(run_task, flags=f"{WITH_STEP} --load {runs['with']} --ckpt-step 2 --save {runs['resumed']} "
                              f"--save-interval 2 --log-json {tmp_path / 'resumed.json'}")
    for other in ("without", "resumed"):
        end, end_other = _file(runs["with"], 4), _file(runs[other], 4)
        for key in KEYS:
            _assert_same(end[key], end_other[key], f"{other}: {key}")
        _assert_same(_distrib(runs["with"], 4), _distrib(runs[other], 4), f"{other}: distrib_optim")
    losses = {n: json.loads((tmp_path / f"{n}.json").read_text())["lm_loss"] for n in ("with", "without", "resumed")}
    assert losses["with"] == losses["without"] and losses["resumed"] == losses["with"][2:]


@pytest.mark.parametrize("flags, message", [
    ("--overlap-grad-reduce --overlap-param-gather --overlap-param-gather-with-optimizer-step",
     "--overlap-param-gather-with-optimizer-step is only supported with the distributed optimizer"),
    ("--use-distributed-optimizer --overlap-param-gather-with-optimizer-step",
     "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather"),
    (WITH_STEP + "--ckpt-format torch_dist", "not supported with distributed checkpointing .* torch_dist"),
])
def test_overlap_param_gather_with_optimizer_step_keeps_megatron_lm_rules(flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(shlex.split(BASE + flags), world_size=2)


MCORE = ("--use-mcore-models --distributed-backend nccl --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
         + WITH_STEP)


def mcore_run_task(rank: int, world: int, *, flags: str) -> None:
    """``run_task`` for megatron-core's GPTModel on CPU (the tests' shim, as test_launcher_mcore.py);
    then every rank loads the saved model entry into a fresh bf16 GPTModel (strict)."""
    import functools
    from unittest import mock

    from mcore_cpu_shim import cpu_shim
    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.models import mcore as mcore_models
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    with mock.patch.object(device_mod, "cuda_available", lambda: True), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: world):  # validation wants CUDA for megatron-core
        args = parse_args(shlex.split(BASE + MCORE + flags), world_size=world)
    with cpu_shim():
        build = functools.partial(mcore_models.build_mcore_gpt, allow_cpu=True)
        with mock.patch.object(mcore_models, "build_mcore_gpt", build):
            pretrain_script().run(args, torch.device("cpu"))
        saved = _file(Path(args.save), args.train_iters)
        build(gpt_config_from_args(args), seed=args.seed, params_dtype=torch.bfloat16).load_state_dict(saved["model"])


def test_mcore_recipe_shape_resumes_from_torch_format(pool2, tmp_path):
    pytest.importorskip("megatron.core")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    pool2.run(mcore_run_task, flags=f"--save {full} --save-interval 2 --log-json {tmp_path / 'full.json'}")
    saved = _file(full, 2)
    assert {v.dtype for v in saved["model"].values() if isinstance(v, torch.Tensor)} == {torch.bfloat16}
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in saved["model"]
    assert saved["rng_state"][0]["rng_tracker_states"].keys() >= {"model-parallel-rng", "data-parallel-rng"}
    pool2.run(mcore_run_task, flags=f"--load {full} --ckpt-step 2 --save {resumed} --save-interval 2 "
                                    f"--log-json {tmp_path / 'resumed.json'}")
    end, end_resumed = _file(full, 4), _file(resumed, 4)
    for key in KEYS:
        _assert_same(end[key], end_resumed[key], key)
    _assert_same(_distrib(full, 4), _distrib(resumed, 4), "distrib_optim")
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("full", "resumed"))
    assert b["lm_loss"] == a["lm_loss"][2:]
