"""``--tensor-model-parallel-size`` and ``--sequence-parallel`` in the launcher.

* Validation: the batch arithmetic uses the data-parallel size (world / TP), the
  vocabulary is padded to a multiple of ``--make-vocab-size-divisible-by`` x TP, and the
  combinations the TP plan or the launcher cannot run yet are refused by name.
* Runs on 4 gloo ranks (the script's ``run`` inside the shared pool): DP 2 x TP 2, with
  and without sequence parallelism, equals PyTorch DDP over 4 ranks at every iteration
  (lm loss, gradient norm and validation loss within 1e-5, fp32, dropout 0) for a
  Llama-style and a GPT-style model; for the Llama-style one also DP 4 x TP 1
  Megatron-FSDP, DP 2 x TP 2 from a meta-device init, with --calculate-per-token-loss,
  and under Megatron-core DDP on the engine.
* A DP 2 x TP 2 torch_dist checkpoint resumes at DP 4 x TP 1 (and the other way round)
  as the uninterrupted run continues.
* megatron-core's GPTModel (``--use-mcore-models``, GeLU) at DP 2 x TP 2 under
  Megatron-FSDP equals the same model at DP 4 x TP 1 per iteration: megatron-core draws
  each TP weight whole on CPU (``use_cpu_initialization``) and keeps its rank's piece, so
  both runs start from the same weights. Its CUDA calls are bridged by tests/mcore_cpu_shim.py.
* With ``MFSDP_TP_LONG=1``, world 8: HSDP (2 optimizer instances) x DP 2 x TP 2 with
  sequence parallelism equals PyTorch DDP over 8 ranks.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shlex
from unittest import mock

import pytest
import torch

import conftest
from launcher_inprocess import LogLines, pretrain_script, run_launcher
from megatron_fsdp.training.args.arguments import ArgumentError, parse_args

TOL = 1e-5
COMMON = ("--seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 8 "
          "--train-iters 4 --lr 3e-3 --adam-eps 1e-4 --seed 7 --lr-decay-style cosine --lr-warmup-iters 1 "
          "--clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 1 "
          "--eval-interval 2 --plot-path none ")
MODELS = {
    "llama": "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
             "--ffn-hidden-size 64 --swiglu --normalization RMSNorm --position-embedding-type rope "
             "--untie-embeddings-and-output-weights --disable-bias-linear ",
    "gpt": "--num-layers 2 --hidden-size 32 --num-attention-heads 4 ",  # learned positions, tied, GELU, biases
}
FSDP = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
TP2 = FSDP + "--tensor-model-parallel-size 2 "
RUNS = {
    "ddp": "",
    "tp2": TP2,
    "tp2_sp": TP2 + "--sequence-parallel ",
}
"""Both models; the Llama-style one also runs the rest of ``LLAMA_RUNS``."""
LLAMA_RUNS = dict(RUNS, **{
    "fsdp": FSDP,
    "tp2_sp_meta": TP2 + "--sequence-parallel --init-model-with-meta-device ",
    "tp2_per_token": TP2 + "--calculate-per-token-loss ",  # the token count is summed over data-parallel ranks
    "tp2_mcore_ddp": "--use-distributed-optimizer --tensor-model-parallel-size 2 ",
})


def _parse(flags: str, world: int = 4, model: str = "llama"):
    return parse_args(shlex.split(MODELS[model] + COMMON + flags), world_size=world)


# -- validation ------------------------------------------------------------------------------
def test_batches_are_counted_per_data_parallel_rank():
    args = _parse(TP2 + "--global-batch-size 6 --micro-batch-size 1")
    assert (args.world_size, args.data_parallel_size, args.num_microbatches) == (4, 2, 3)
    with pytest.raises(ArgumentError, match=r"not divisible by --micro-batch-size=1 x data-parallel size 4"):
        _parse(FSDP + "--global-batch-size 6 --micro-batch-size 1")


def test_vocabulary_is_padded_per_tensor_parallel_rank():
    flags = "--mock-data --tokenizer-type NullTokenizer --vocab-size 200 --make-vocab-size-divisible-by 64 "
    assert _parse(FSDP + flags).padded_vocab_size == 256
    assert _parse(TP2 + flags).padded_vocab_size == 256
    tp4 = FSDP + "--tensor-model-parallel-size 4 "
    assert _parse(tp4 + flags, model="gpt").padded_vocab_size == 256
    assert _parse(tp4 + flags.replace("200", "260"), model="gpt").padded_vocab_size == 512


def test_sequence_parallel_at_tp1_warns_and_is_off():
    args = _parse(FSDP + "--sequence-parallel")
    assert not args.sequence_parallel
    assert any(w.startswith("--sequence-parallel: accepted, no effect here") for w in args.flag_warnings)
    assert _parse(TP2 + "--sequence-parallel").sequence_parallel


@pytest.mark.parametrize("flags, world, words", [
    (TP2, 3, "does not divide the world size 3"),
    ("--tensor-model-parallel-size 2 ", 4, "PyTorch DDP does not take DTensor parameters"),
    (TP2 + "--num-experts 4 ", 4, "train MoE models at TP 1"),
    (TP2 + "--use-mcore-models --sequence-parallel ", 4, "WrappedTorchNorm refuses sequence_parallel"),
    (TP2 + "--use-mcore-models ", 4, "partition_stride=2"),  # the Llama-style model is SwiGLU
    (TP2 + "--use-mcore-models --num-experts 4 ", 4, "train MoE models at TP 1"),
    ("--use-distributed-optimizer --tensor-model-parallel-size 2 --use-mcore-models ", 4,
     "--use-mcore-models without --use-megatron-fsdp"),
    (TP2 + "--ckpt-format torch ", 4, "use --ckpt-format torch_dist"),
    (TP2.replace("optim_grads_params", "optim") + "--check-weight-hash-across-dp-replicas-interval 2 ", 4,
     "TP ranks hold different pieces"),
    (TP2 + "--optimizer muon ", 4, "Muon orthogonalises whole matrices"),
    ("--use-torch-fsdp2 --tensor-model-parallel-size 2 ", 4, "with --use-torch-fsdp2"),
    (TP2.replace("2 ", "4 ") + "--group-query-attention --num-query-groups 2 ", 4, "--num-query-groups=2"),
    (TP2 + "--sequence-parallel --seq-length 15 --max-position-embeddings 15 ", 4,
     "--seq-length (with --sequence-parallel)=15"),
    ("--tensor-model-parallel-size 0 ", 4, "must be a positive integer"),
])
def test_unsupported_combinations_are_refused_by_name(flags, world, words):
    with pytest.raises(ArgumentError) as info:
        _parse(flags, world)
    assert words in str(info.value)


# -- runs ------------------------------------------------------------------------------------
def run_task(rank: int, world: int, *, flags: str) -> list[str]:
    return [line for line in run_launcher(flags, world) if "tensor parallelism" in line]


def _metrics(path) -> dict:
    return json.loads(path.read_text())


LONG_ONLY = pytest.mark.skipif(os.environ.get("MFSDP_TP_LONG") != "1",
                               reason="a longer launcher run: MFSDP_TP_LONG=1 (the suite's time budget)")


@pytest.mark.parametrize("model", [m if m == "gpt" else pytest.param(m, marks=LONG_ONLY) for m in sorted(MODELS)])
def test_dp2_tp2_equals_dp4_and_ddp(pool4, tmp_path, model):
    results = {}
    for name, flags in (LLAMA_RUNS if model == "llama" else RUNS).items():
        path = tmp_path / f"{name}.json"
        lines = pool4.run(run_task, flags=MODELS[model] + COMMON + flags + f"--log-json {path}")
        assert bool(lines[0]) == name.startswith("tp2"), (name, lines)  # the TP plan was applied
        results[name] = _metrics(path)
    reference = results.pop("ddp")
    assert reference["iterations"] == [1, 2, 3, 4] and len(reference["validation"]) == 3
    for name, got in results.items():
        for key in ("lm_loss", "grad_norm"):
            assert got[key] == pytest.approx(reference[key], rel=0, abs=TOL), (name, key)
        assert [v for _, v in got["validation"]] == pytest.approx([v for _, v in reference["validation"]],
                                                                   rel=0, abs=TOL), name
    assert reference["lm_loss"][-1] < reference["lm_loss"][0]


@pytest.mark.parametrize("first, second", [(TP2, FSDP), pytest.param(FSDP, TP2 + "--sequence-parallel ", marks=LONG_ONLY)],
                         ids=["dp2xtp2_to_dp4", "dp4_to_dp2xtp2_sp"])
def test_checkpoint_resumes_at_another_tensor_parallel_size(pool4, tmp_path, first, second):
    saved, base = tmp_path / "saved", MODELS["llama"] + COMMON + "--eval-iters 0 --ckpt-format torch_dist "
    pool4.run(run_task, flags=base + first + f"--save {saved} --save-interval 2 --log-json {tmp_path / 'full.json'}")
    pool4.run(run_task, flags=base + second + f"--load {saved} --ckpt-step 2 --log-json {tmp_path / 'resumed.json'}")
    full, resumed = _metrics(tmp_path / "full.json"), _metrics(tmp_path / "resumed.json")
    assert resumed["iterations"] == [3, 4]
    for key in ("lm_loss", "grad_norm"):
        assert resumed[key] == pytest.approx(full[key][2:], rel=0, abs=TOL), key
    assert abs(resumed["lm_loss"][0] - full["lm_loss"][0]) > 1e-3  # it continued from the saved weights


def mcore_run_task(rank: int, world: int, *, flags: str) -> tuple[list[str], int]:
    """``run_task`` for megatron-core's GPTModel on CPU (validation told CUDA is there: it
    refuses --use-mcore-models without; megatron-core's CUDA calls bridged by the shim),
    with megatron-core's TP size after the run and the whole-model parameter count logged."""
    from megatron.core import parallel_state

    from mcore_cpu_shim import cpu_shim
    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.models import mcore as mcore_models

    with mock.patch.object(device_mod, "cuda_available", lambda: True), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: world):
        args = parse_args(shlex.split(flags + "--distributed-backend nccl"), world_size=world)
    root, handler = logging.getLogger(), LogLines()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with cpu_shim(), mock.patch.object(mcore_models, "build_mcore_gpt",
                                           functools.partial(mcore_models.build_mcore_gpt, allow_cpu=True)):
            pretrain_script().run(args, torch.device("cpu"))
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    lines = [line for line in handler.lines if "tensor parallelism" in line or "number of parameters" in line]
    return lines, parallel_state.get_tensor_model_parallel_world_size()


@LONG_ONLY
def test_mcore_dp2_tp2_equals_dp4(pool4, tmp_path):
    pytest.importorskip("megatron.core")
    flags = MODELS["gpt"] + COMMON + FSDP + ("--use-mcore-models --mock-data --tokenizer-type NullTokenizer "
                                             "--vocab-size 64 --make-vocab-size-divisible-by 16 ")
    results = {}
    for name, extra in (("dp4", ""), ("dp2xtp2", "--tensor-model-parallel-size 2 ")):
        path = tmp_path / f"{name}.json"
        (lines, tp), *_ = pool4.run(mcore_run_task, flags=flags + extra + f"--log-json {path} ")
        assert tp == (2 if name == "dp2xtp2" else 1) and any("tensor parallelism" in line for line in lines) == (tp > 1)
        results[name] = _metrics(path), [line for line in lines if "number of parameters" in line]
    (reference, ref_count), (got, count) = results["dp4"], results["dp2xtp2"]
    assert count == ref_count and len(count) == 1, (count, ref_count)  # TP pieces counted whole
    assert reference["iterations"] == [1, 2, 3, 4] and reference["lm_loss"][-1] < reference["lm_loss"][0]
    for key in ("lm_loss", "grad_norm"):
        assert got[key] == pytest.approx(reference[key], rel=0, abs=TOL), (key, got[key], reference[key])
    assert [v for _, v in got["validation"]] == pytest.approx([v for _, v in reference["validation"]], rel=0, abs=TOL)


@pytest.mark.skipif(os.environ.get("MFSDP_TP_LONG") != "1", reason="world 8 (a pool of 8 processes): set "
                    "MFSDP_TP_LONG=1, as for test_tensor_parallel.py's world-8 grid")
def test_hsdp_with_tp_equals_ddp_world8(tmp_path):
    pool, results = conftest.get_pool(8), {}
    hsdp = TP2 + "--sequence-parallel --num-distributed-optimizer-instances 2 "
    runs = {"ddp": "", "hsdp_tp2_sp": hsdp, "hfsdp_tp2_sp": hsdp + "--outer-dp-sharding-strategy optim "}
    for name, flags in runs.items():
        path = tmp_path / f"{name}.json"
        lines = pool.run(run_task, flags=MODELS["llama"] + COMMON + flags + f"--log-json {path}")
        assert bool(lines[0]) == (name != "ddp"), (name, lines)
        results[name] = _metrics(path)
    reference = results.pop("ddp")
    for name, got in results.items():
        for key in ("lm_loss", "grad_norm"):
            assert got[key] == pytest.approx(reference[key], rel=0, abs=TOL), (name, key)
