"""The launcher's ``--use-mcore-models --use-megatron-fsdp`` path (Megatron-FSDP's own
recipes: megatron-core's GPTModel in Megatron-core's ``FullyShardedDataParallel``)
trains through ``train_step`` as the same model under Megatron-core's DDP does.

Megatron-core's ``FullyShardedDataParallel`` defers every gradient sync until
``finish_grad_sync()``, which Megatron-LM calls in ``finalize_model_grads``; the
launcher's step used to skip it, so clipping refused to read the deferred gradients.
megatron-core's CUDA calls are bridged on CPU by the tests' shim.
"""

from __future__ import annotations

import functools
import shlex
from unittest import mock

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TOL = 1e-5
STEPS = 4
FLAGS = """
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16
    --swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope
    --micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 3e-3 --adam-eps 1e-4 --clip-grad 1.0
    --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer --vocab-size 64
    --use-mcore-models --distributed-backend nccl
"""
FSDP = " --use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy {}"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float().clone()


def mcore_train_worker(rank, world, *, strategy, extra=""):
    """Losses, gradient norms and final weights of STEPS launcher iterations of
    megatron-core's GPTModel (``strategy`` None: Megatron-core's DDP)."""
    from megatron.core.transformer.moe import moe_utils

    from mcore_cpu_shim import cpu_shim as _mcore_on_cpu
    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.models import mcore as mcore_models
    from megatron_fsdp.training.args.arguments import parse_args
    from megatron_fsdp.training.data import BatchLayout, MockDataset
    from megatron_fsdp.training.optim.lr_schedule import LRSchedule
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer
    from megatron_fsdp.training.training_step import StepContext, TrainState, train_step

    flags = FLAGS + extra + (FSDP.format(strategy) if strategy else "")
    if hasattr(moe_utils, "te_general_gemm") and moe_utils.te_general_gemm is None:
        del moe_utils.te_general_gemm  # as after a fresh import without TransformerEngine
    # Validation refuses --use-mcore-models without CUDA; the shim provides what megatron-core needs.
    with mock.patch.object(device_mod, "cuda_available", lambda: True), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: world):
        args = parse_args(shlex.split(flags), world_size=world)
    with _mcore_on_cpu(), mock.patch.object(mcore_models, "build_mcore_gpt",
                                            functools.partial(mcore_models.build_mcore_gpt, allow_cpu=True)):
        torch.manual_seed(0)
        bundle = setup_model_and_optimizer(args, torch.device("cpu"))
        ctx = StepContext(bundle=bundle, schedule=LRSchedule.from_args(args), scaler=None, device=torch.device("cpu"),
                          layout=BatchLayout(micro_batch_size=2, num_microbatches=2, dp_rank=rank, dp_size=world),
                          clip_grad=1.0, per_token_loss=False, check_for_nan=True, seq_length=16)
        source, state = MockDataset(64, 16, seed=1), TrainState()
        results = []
        for _ in range(STEPS):
            results.append(train_step(ctx, state, source))
        model = bundle.model
        if hasattr(model, "finish_param_sync"):
            model.finish_param_sync()
        # Megatron-core's DDP keys its state_dict with "module.", ours with megatron-core's
        # own keys (standard DTensors).
        weights = {k.removeprefix("module."): _full(v) for k, v in model.state_dict().items()
                   if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)}
    dist.barrier()
    return dict(wrapper=type(model).__name__, losses=[r.lm_loss for r in results],
                norms=[r.grad_norm for r in results], weights=weights)


MODELS = {"dense": "", "moe": " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --moe-aux-loss-coeff 1e-2"}


@pytest.fixture(scope="module")
def references(pool2):
    return {name: pool2.run(mcore_train_worker, strategy=None, extra=extra)[0] for name, extra in MODELS.items()}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mcore_models_under_megatron_fsdp_train_as_under_ddp(pool2, references, strategy, model):
    """MoE without TransformerEngine: megatron-core 0.16.1 leaves its router's
    ``te_general_gemm`` undefined; build_mcore_gpt defines the fallback it meant."""
    reference = references[model]
    ours = pool2.run(mcore_train_worker, strategy=strategy, extra=MODELS[model])[0]
    assert ours["wrapper"] == "FullyShardedDataParallel" and reference["wrapper"] == "DistributedDataParallel"
    assert ours["losses"][-1] < ours["losses"][0]  # it trains
    for a, b in zip(ours["losses"] + ours["norms"], reference["losses"] + reference["norms"]):
        assert abs(a - b) <= TOL, (ours["losses"], reference["losses"], ours["norms"], reference["norms"])
    assert sorted(ours["weights"]) == sorted(reference["weights"])
    diff = max((ours["weights"][n] - w).abs().max().item() for n, w in reference["weights"].items())
    assert diff <= TOL, diff
