"""``--use-torch-fsdp2``: scripts/pretrain_gpt.py wraps the model with PyTorch FSDP2
(megatron_fsdp/training/torch_fsdp2.py), as Megatron-LM's TorchFullyShardedDataParallel.

* fp32: a 2-rank gloo launcher run (2 micro batches per rank, clipping, weight decay,
  --decoupled-lr for the embedding/output marks) equals the PyTorch DDP run at every
  iteration (loss, grad norm) and in its final weights (1e-5); a run resumed from its
  iteration-2 checkpoint ends bit for bit where the uninterrupted run ends.
* --bf16: Megatron-LM's mixed precision (bf16 compute and reduce-scatter, fp32 main
  weights starting from the bf16 values) -- bit for bit the Megatron-core DDP path with
  --grad-reduce-in-bf16, for the embedded GPT and megatron-core's GPTModel (whose fp32
  rotary frequencies FSDP2 must not cast).
* Megatron-LM's asserts for the flag, and what FSDP2 cannot do right, are validation
  errors; its functional-test recipes with the flag validate (model-parallel sizes 1).

The runs call the script's ``run`` inside the shared gloo pool (no torchrun start-up).
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
from pathlib import Path
from unittest import mock

import pytest
import torch

from launcher_inprocess import REPO, load_pretrain_script
from megatron_fsdp.training.args.arg_types import ArgumentError, DataParallelPath
from megatron_fsdp.training.args.arguments import parse_args

TOL = 1e-5
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 3e-3 --adam-eps 1e-4 --clip-grad 1.0 "
        "--weight-decay 0.1 --hidden-dropout 0.0 --attention-dropout 0.0 "
        "--untie-embeddings-and-output-weights --decoupled-lr 1e-2 "
        "--log-interval 1 --eval-iters 0 --plot-path none ")
FSDP2 = " --use-torch-fsdp2 --no-gradient-accumulation-fusion"
# One micro batch per rank and no clipping: the bf16 runs then do the same arithmetic in the same order.
BF16 = " --bf16 --global-batch-size 4 --clip-grad 0"
MCORE = (" --use-mcore-models --distributed-backend nccl --swiglu --disable-bias-linear --normalization RMSNorm "
         "--position-embedding-type rope")


@contextlib.contextmanager
def _mcore_on_cpu(world: int):
    """What tests/test_launcher_mcore.py does to run megatron-core's GPTModel on CPU."""
    from megatron.core.transformer.moe import moe_utils

    from mcore_cpu_shim import cpu_shim
    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.models import mcore as mcore_models

    if hasattr(moe_utils, "te_general_gemm") and moe_utils.te_general_gemm is None:
        del moe_utils.te_general_gemm
    with cpu_shim(), mock.patch.object(device_mod, "cuda_available", lambda: True), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: world), \
            mock.patch.object(mcore_models, "build_mcore_gpt",
                              functools.partial(mcore_models.build_mcore_gpt, allow_cpu=True)):
        yield


def run_task(rank: int, world: int, *, flags: str) -> dict:
    """One launcher run; the wrapper it built and how its weights are held (from inside)."""
    with (_mcore_on_cpu(world) if "--use-mcore-models" in flags else contextlib.nullcontext()):
        return launch_and_look(BASE + flags, world, "pretrain_gpt_torch_fsdp2")


def launch_and_look(flags: str, world: int, script_name: str) -> dict:
    """Run the launcher on ``flags``; return the wrapper it built and, per parameter, whether it
    is a Shard(0) DTensor, its dtype, and its local and whole sizes."""
    script = load_pretrain_script(script_name)  # patched below: a copy of its own
    seen = {}
    setup = script.setup_model_and_optimizer

    def setup_and_look(args, device):
        from torch.distributed.tensor import DTensor, Shard

        bundle = setup(args, device)
        seen.update(wrapper=type(bundle.model).__name__, params={
            name: (isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),), str(p.dtype),
                   p.to_local().numel() if isinstance(p, DTensor) else p.numel(), p.numel())
            for name, p in bundle.model.named_parameters()})
        return bundle

    with mock.patch.object(script, "setup_model_and_optimizer", setup_and_look):
        script.run(parse_args(shlex.split(flags), world_size=world), torch.device("cpu"))
    return seen


def _metrics(path: Path) -> dict:
    return json.loads(path.read_text())


def _checkpoint(root: Path, iteration: int) -> dict[str, torch.Tensor]:
    """The whole (unsharded) model and optimizer tensors of a DCP checkpoint, read here."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = root.parent / f"{root.name}_{iteration}.pt"
    dcp_to_torch_save(str(root / f"iter_{iteration:07d}"), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def _assert_runs_match(ours: dict, reference: dict, tol: float) -> None:
    assert ours["iterations"] == reference["iterations"]
    for key in ("lm_loss", "grad_norm"):
        for it, a, b in zip(ours["iterations"], ours[key], reference[key]):
            assert abs(a - b) <= tol, f"iteration {it} {key}: FSDP2 {a} vs reference {b}"


def torch_dist_weights_task(rank: int, world: int, *, root: str) -> dict[str, torch.Tensor]:
    """The whole weights of a megatron-core torch_dist checkpoint (what --ckpt-format torch_dist
    writes for the DDP paths), under the model's own names, prefixed as _checkpoint keys them."""
    import megatron_fsdp as mf
    from megatron_fsdp.convert.model_io import open_checkpoint

    model, _ = open_checkpoint(root)
    return {f"model.{k}": v for k, v in mf.get_full_state_dict(model).items()}


def _weights(checkpoint: dict) -> dict[str, torch.Tensor]:
    # Megatron-FSDP's checkpoints (the Megatron-core DDP path) name the weights "model.module.*".
    return {k.removeprefix("model.").removeprefix("module."): v for k, v in checkpoint.items()
            if k.startswith("model.")}


def _max_weight_diff(ours: dict, reference: dict) -> float:
    ours, reference = _weights(ours), _weights(reference)
    assert reference and sorted(ours) == sorted(reference), (sorted(ours), sorted(reference))
    return max((ours[n].float() - reference[n].float()).abs().max().item() for n in reference)


def test_fsdp2_trains_as_ddp_and_resumes_bit_for_bit(pool2, tmp_path):
    full, ddp, resumed = tmp_path / "full", tmp_path / "ddp", tmp_path / "resumed"
    seen = pool2.run(run_task, flags=FSDP2 + f" --save {full} --save-interval 2 --log-json {tmp_path / 'full.json'}")
    pool2.run(run_task, flags=f" --save {ddp} --save-interval 4 --log-json {tmp_path / 'ddp.json'}")
    # Sharded for real: every weight a Shard(0) DTensor whose local piece is about half of it.
    assert seen[0]["wrapper"] == "TorchFullyShardedDataParallel"
    for name, (sharded, _, local, numel) in seen[0]["params"].items():
        assert sharded and local <= (numel + 1) // 2, name
    ours, reference = _metrics(tmp_path / "full.json"), _metrics(tmp_path / "ddp.json")
    assert ours["iterations"] == [1, 2, 3, 4] and ours["lm_loss"][-1] < ours["lm_loss"][0]
    _assert_runs_match(ours, reference, TOL)
    end = _checkpoint(full, 4)
    assert _max_weight_diff(end, pool2.run(torch_dist_weights_task, root=str(ddp))[0]) <= TOL

    pool2.run(run_task, flags=FSDP2 + f" --load {full} --ckpt-step 2 --save {resumed} --save-interval 2 "
                                      f"--log-json {tmp_path / 'resumed.json'}")
    again = _metrics(tmp_path / "resumed.json")
    assert again["iterations"] == [3, 4]
    assert again["lm_loss"] == ours["lm_loss"][2:] and again["grad_norm"] == ours["grad_norm"][2:]
    end_resumed = _checkpoint(resumed, 4)
    assert sorted(end_resumed) == sorted(end) and any(k.startswith("optimizer.state.") for k in end)
    for key, value in end.items():  # weights and Adam moments
        assert torch.equal(value, end_resumed[key]), key


@pytest.mark.parametrize("model", ["embedded", "mcore"])
def test_fsdp2_bf16_is_megatron_lm_mixed_precision(pool2, tmp_path, model):
    """Megatron-LM's FSDP2 under --bf16 (its Float16Module + Float16Optimizer): bf16 forward,
    backward and reduce-scatter, fp32 main weights that start as the bf16-rounded initial
    ones. The Megatron-core DDP path with bf16 gradient reduction does exactly that."""
    if model == "mcore":
        pytest.importorskip("megatron.core")
    extra = BF16 + (MCORE if model == "mcore" else "")
    ours, reference = tmp_path / "fsdp2", tmp_path / "megatron_ddp"
    seen = pool2.run(run_task, flags=FSDP2 + extra + f" --save {ours} --save-interval 4 --log-json {ours}.json")
    pool2.run(run_task, flags=extra + f" --grad-reduce-in-bf16 --save {reference} --save-interval 4 "
                                      f"--log-json {reference}.json")
    assert {dtype for _, dtype, *_ in seen[0]["params"].values()} == {"torch.float32"}  # the main weights
    a, b = _metrics(Path(f"{ours}.json")), _metrics(Path(f"{reference}.json"))
    assert a["lm_loss"] == b["lm_loss"], (a["lm_loss"], b["lm_loss"])
    _assert_runs_match(a, b, 1e-6)  # the norms: the same terms summed in another order
    reference_weights = (_checkpoint(reference, 4) if model == "mcore"  # megatron-core models keep the DCP layout
                         else pool2.run(torch_dist_weights_task, root=str(reference))[0])
    assert _max_weight_diff(_checkpoint(ours, 4), reference_weights) == 0.0


# -- validation --------------------------------------------------------------------------------
def _parse(flags: str, world: int = 2, env: dict | None = None):
    with mock.patch.dict("os.environ", env or {}):
        return parse_args(shlex.split(BASE + flags), world_size=world)


def test_flag_picks_fsdp2_and_its_reshard_setting():
    args = _parse(FSDP2 + " --bf16")
    assert args.dp_path is DataParallelPath.TORCH_FSDP2 and args.torch_fsdp2_reshard_after_forward
    assert not _parse(FSDP2 + " --torch-fsdp2-no-reshard-after-forward").torch_fsdp2_reshard_after_forward


@pytest.mark.parametrize("flags, message", [
    (FSDP2 + " --use-distributed-optimizer", "drop --use-distributed-optimizer"),
    (" --use-torch-fsdp2", "needs --no-gradient-accumulation-fusion"),
    (FSDP2 + " --fp16", "Megatron-LM does not support FSDP2 with fp16"),
    (FSDP2 + " --ckpt-format torch", "use --ckpt-format torch_dist"),
    (FSDP2 + " --calculate-per-token-loss", "skips the division of the gradients by the global token count"),
    (FSDP2 + " --check-weight-hash-across-dp-replicas-interval 2", "no rank holds a replica"),
    (FSDP2 + " --ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor is only used with --use-megatron-fsdp"),
    (FSDP2 + " --use-megatron-fsdp", "mutually exclusive"),
])
def test_what_fsdp2_cannot_do_is_refused(flags, message):
    with pytest.raises(ArgumentError, match=message):
        _parse(flags)


def test_tied_embeddings_and_one_cuda_connection_are_refused():
    with pytest.raises(ArgumentError, match="needs --untie-embeddings-and-output-weights"):
        parse_args(shlex.split(BASE.replace("--untie-embeddings-and-output-weights", "") + FSDP2), world_size=2)
    with pytest.raises(ArgumentError, match="CUDA_DEVICE_MAX_CONNECTIONS unset or > 1"):
        _parse(FSDP2, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def test_flags_without_effect_under_fsdp2_warn():
    args = _parse(FSDP2 + " --grad-reduce-in-bf16 --ddp-average-in-collective --data-parallel-sharding-strategy "
                          "optim_grads")
    said = "\n".join(args.flag_warnings)
    for flag in ("--grad-reduce-in-bf16", "--ddp-average-in-collective", "--data-parallel-sharding-strategy"):
        assert f"{flag} has no effect with --use-torch-fsdp2" in said
    assert args.dp_path is DataParallelPath.TORCH_FSDP2
    alone = _parse(" --torch-fsdp2-no-reshard-after-forward")
    assert any("has no effect without --use-torch-fsdp2" in w for w in alone.flag_warnings)


# Megatron-LM's functional-test recipes with --use-torch-fsdp2 (tests/functional_tests/test_cases/gpt/
# gpt3_mcore_te_tp2_pp1_fsdp2_resume_torch_dist and gpt3_mcore_tp1_pp1_fsdp2_resume_torch_dist_te), their
# MODEL_ARGS with the tensor-parallel size 2 -> 1 (the launcher refuses TP with --use-torch-fsdp2).
RECIPE_BF16 = """\
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 8
  NVTE_ALLOW_NONDETERMINISTIC_ALGO: 0
  NCCL_ALGO: Ring
  CUBLAS_WORKSPACE_CONFIG: :4096:8
MODEL_ARGS:
  --num-layers: 12
  --hidden-size: 512
  --num-attention-heads: 8
  --log-params-norm: true
  --log-num-zeros-in-grad: true
  --log-validation-ppl-to-tensorboard: true
  --log-timers-to-tensorboard: true
  --tensorboard-dir: ${TENSORBOARD_PATH}
  --micro-batch-size: 4
  --global-batch-size: 32
  --seq-length: 1024
  --max-position-embeddings: 1024
  --train-iters: 100
  --timing-log-level: 0
  --lr-decay-iters: 320000
  --save: ${CHECKPOINT_SAVE_PATH}
  --load: ${CHECKPOINT_LOAD_PATH}
  --data-path: ${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document
  --vocab-file: ${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json
  --merge-file: ${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt
  --split: 949,50,1
  --distributed-backend: nccl
  --lr: 0.00015
  --lr-decay-style: cosine
  --min-lr: 1.0e-5
  --weight-decay: 1e-2
  --clip-grad: 1.0
  --lr-warmup-fraction: .01
  --log-interval: 1
  --save-interval: 50
  --eval-interval: 1000
  --eval-iters: 10
  --transformer-impl: transformer_engine
  --tensor-model-parallel-size: 1
  --pipeline-model-parallel-size: 1
  --use-torch-fsdp2: true
  --untie-embeddings-and-output-weights: true
  --deterministic-mode: true
  --no-gradient-accumulation-fusion: true
  --attention-softmax-in-fp32: true
  --use-checkpoint-opt_param-scheduler: true
  --use-mcore-models: true
  --ckpt-format: torch_dist
  --dist-ckpt-strictness: log_all
  --data-cache-path: ${DATA_CACHE_PATH}
  --bf16: true
  --log-memory-to-tensorboard: true
  --async-save: true
  --use-persistent-ckpt-worker: true
TEST_TYPE: ckpt-resume
"""
# The tp1 recipe differs in: no untied embeddings, --fp16 instead of --bf16, and these.
RECIPE_FP16_CHANGES = {"  --untie-embeddings-and-output-weights: true\n": "",
                       "  --bf16: true\n": "  --fp16: true\n  --apply-query-key-layer-scaling: true\n"
                                           "  --dist-ckpt-optim-fully-reshardable: true\n"}


def _recipe_env(tmp_path: Path, monkeypatch) -> None:
    """The recipes' data, as the repo's indexed corpus and GPT-2 vocabulary under their names."""
    data = tmp_path / "data" / "text" / "common_pile" / "v01_filtered_data"
    (data / "bpe").mkdir(parents=True)
    for suffix in ("bin", "idx"):
        (data / f"my-gpt3_00_text_document.{suffix}").symlink_to(REPO / "data" / f"corpus_text_document.{suffix}")
    for name in ("vocab.json", "merges.txt"):
        (data / "bpe" / name).symlink_to(REPO / "data" / "bpe" / name)
    for var, sub in (("TENSORBOARD_PATH", "tb"), ("CHECKPOINT_SAVE_PATH", "save"), ("CHECKPOINT_LOAD_PATH", "load"),
                     ("DATA_PATH", "data"), ("DATA_CACHE_PATH", "cache")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)


def _parse_recipe(tmp_path: Path, text: str):
    from megatron_fsdp.comm import device as device_mod

    config = tmp_path / "model_config.yaml"
    config.write_text(text)
    # --use-mcore-models and --distributed-backend nccl are validated as on a GPU node of 8.
    with mock.patch.object(device_mod, "cuda_available", lambda: True), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: 8):
        return parse_args(["--config", str(config)], world_size=8)


def test_megatron_lm_fsdp2_recipes_validate(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")  # the recipe sets --use-mcore-models
    _recipe_env(tmp_path, monkeypatch)
    args = _parse_recipe(tmp_path, RECIPE_BF16)
    assert args.dp_path is DataParallelPath.TORCH_FSDP2 and args.use_mcore_models and args.bf16
    assert args.torch_fsdp2_reshard_after_forward and args.ckpt_format == "torch_dist"
    fp16 = RECIPE_BF16
    for old, new in RECIPE_FP16_CHANGES.items():
        fp16 = fp16.replace(old, new)
    # Megatron-LM's own asserts refuse its tp1 recipe (tied embeddings, fp16); so does the launcher.
    with pytest.raises(ArgumentError) as info:
        _parse_recipe(tmp_path, fp16)
    assert "needs --untie-embeddings-and-output-weights" in str(info.value)
    assert "Megatron-LM does not support FSDP2 with fp16" in str(info.value)
    assert str(info.value).count("\n  - ") == 2
