"""The launcher's ``--mtp-num-layers`` / ``--mtp-loss-scaling-factor`` (multi-token
prediction; the model itself is checked against megatron-core in test_models_mtp.py):

* the gradient one iteration accumulates is that of Megatron-LM's objective, (1 / micro
  batches) x sum over micro batches of [LM token mean + factor / D x sum of the depths'
  token means] (per-token mode: the token sums, each depth's rescaled to the micro
  batch's tokens), against a reference written out here from the model's own modules;
* a 2-rank run under Megatron-FSDP equals the same run under PyTorch DDP every
  iteration within 1e-5, the log line keeps ``lm loss`` the main loss and adds Megatron-LM's
  ``mtp_1 loss`` / ``mtp_2 loss`` fields;
* what Megatron-LM or megatron-core refuse is refused with the reason.
"""

from __future__ import annotations

import shlex

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from launcher_inprocess import run_launcher
from megatron_fsdp.training.args.arg_types import ArgumentError
from megatron_fsdp.training.args.arguments import parse_args

TOL = 1e-5
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --adam-eps 1e-4 --seed 7 --clip-grad 1.0 "
        "--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
        "--hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 ")
# The last decoder layer is MoE, so both MTP depths are (their experts on the expert mesh).
MTP = ("--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3 --num-experts 4 --moe-router-topk 2 "
       "--moe-aux-loss-coeff 1e-2 --moe-layer-freq ([0]+[1]) ")


# -- the objective one iteration's gradient belongs to ----------------------------------------
def _shifted_ce(logits: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """Sum of the cross-entropies of positions whose label lies k places ahead, and their count."""
    t = labels.shape[1]
    kept = logits[:, : t - k]
    return F.cross_entropy(kept.reshape(-1, kept.shape[-1]).float(), labels[:, k:].reshape(-1), reduction="sum"), \
        labels[:, k:].numel()


def _reference_objective(gpt, inputs, targets, factor: float, per_token: bool) -> torch.Tensor:
    """Megatron-LM's objective of one micro batch, written out from the GPT's modules (no
    MTP loss attachment): LM loss plus factor / D x the depths' losses."""
    b, t = inputs.shape
    positions = torch.arange(t).expand(b, t)
    h = gpt._embed(inputs, positions[0])
    for block in gpt.blocks:
        h = block(h)
    h = gpt.ln_f(h)
    lm, tokens = _shifted_ce(gpt.lm_head(h), targets, 0)
    total = lm if per_token else lm / tokens
    depths = gpt.mtp.layers
    for k, layer in enumerate(depths, start=1):
        rolled = torch.cat([inputs[:, k:], inputs.new_zeros(b, k)], dim=1)
        rolled_pos = torch.cat([positions[:, k:], positions.new_zeros(b, k)], dim=1)
        h = layer(h, gpt._embed(rolled, rolled_pos))
        loss_sum, count = _shifted_ce(gpt.lm_head(h), targets, k)
        total = total + factor / len(depths) * loss_sum / count * (tokens if per_token else 1)
    return total


def objective_worker(rank, world, *, per_token):
    """Gradients of one iteration's micro batches through the launcher (PyTorch DDP), and of
    the written-out objective on the same weights and batches (averaged over the ranks)."""
    import copy

    from megatron_fsdp.training.data import BatchLayout, MockDataset, get_microbatch
    from megatron_fsdp.training.optim.lr_schedule import LRSchedule
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer
    from megatron_fsdp.training.training_step import StepContext, _forward_backward

    flags = BASE + MTP + "--train-iters 1" + (" --calculate-per-token-loss" if per_token else "")
    args = parse_args(shlex.split(flags), world_size=world)
    bundle = setup_model_and_optimizer(args, torch.device("cpu"))
    reference = copy.deepcopy(bundle.model.module)
    layout = BatchLayout(micro_batch_size=2, num_microbatches=2, dp_rank=rank, dp_size=world)
    ctx = StepContext(bundle=bundle, schedule=LRSchedule.from_args(args), scaler=None, device=torch.device("cpu"),
                      layout=layout, clip_grad=1.0, per_token_loss=per_token, check_for_nan=True, seq_length=16)
    source = MockDataset(64, 16, seed=1)
    sums = _forward_backward(ctx, source, 0)
    # The MoE balancing losses attach themselves, with the launcher's factor (training_step.py).
    reference.set_moe_aux_loss_scale(2 * 16 if per_token else 1 / 2)
    for m in range(2):
        inputs, targets = get_microbatch(source, layout, 0, m, torch.device("cpu"))
        objective = _reference_objective(reference, inputs, targets, 0.3, per_token)
        (objective if per_token else objective / 2).backward()
    names = dict(bundle.model.module.named_parameters())
    diff, mtp_only = 0.0, 0.0
    for name, p in reference.named_parameters():
        dist.all_reduce(p.grad)
        p.grad /= world  # PyTorch DDP averages
        diff = max(diff, (names[name].grad - p.grad).abs().max().item())
        if name.startswith("mtp."):
            mtp_only = max(mtp_only, p.grad.abs().max().item())
    return dict(diff=diff, mtp_only=mtp_only, mtp_losses=sums.mtp.tolist())


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
def test_one_iteration_follows_megatron_lms_objective(pool2, per_token):
    result = pool2.run(objective_worker, per_token=per_token)[0]
    assert result["mtp_only"] > 1e-3, result  # the MTP depths did learn something
    assert result["diff"] < 1e-6 * (32 if per_token else 1), result  # per-token grads are token sums
    assert len(result["mtp_losses"]) == 2


# -- Megatron-FSDP against PyTorch DDP, through the script ----------------------------------
def launcher_worker(rank, world, *, flags):
    """The script's run on 2 gloo ranks: its metrics and rank 0's log lines."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/metrics.json" if rank == 0 else None
        extra = f" --log-json {out}" if out else ""
        lines = run_launcher(BASE + flags + " --log-interval 1 --eval-iters 0 --plot-path none" + extra, world)
        metrics = json.load(open(out)) if out else None
    return dict(metrics=metrics, lines=[line for line in lines if " iteration " in line])


def test_megatron_fsdp_trains_mtp_as_pytorch_ddp(pool2):
    flags = MTP + "--train-iters 3"
    ddp = pool2.run(launcher_worker, flags=flags)[0]
    # Built on the meta device as Megatron-FSDP's DeepSeek-V3 example does: the MTP layers, built
    # after the output layer tied to the embedding, get the eager build's initial weights.
    fsdp = pool2.run(launcher_worker, flags=flags + " --use-megatron-fsdp --data-parallel-sharding-strategy "
                                                    "optim_grads_params --init-model-with-meta-device")[0]
    a, b = ddp["metrics"], fsdp["metrics"]
    assert len(a["mtp_losses"]) == 3 and all(len(v) == 2 for v in a["mtp_losses"])
    for key in ("lm_loss", "grad_norm", "load_balancing_loss"):
        assert b[key] == pytest.approx(a[key], rel=0, abs=TOL), key
    flat = [v for row in a["mtp_losses"] for v in row]
    assert [v for row in b["mtp_losses"] for v in row] == pytest.approx(flat, rel=0, abs=TOL)
    assert a["lm_loss"][-1] < a["lm_loss"][0] and a["mtp_losses"][-1][0] < a["mtp_losses"][0][0]  # both learn
    # Megatron-LM's fields: lm loss (the main model's), then the balancing loss, then mtp_k loss.
    line = ddp["lines"][0]
    assert line.index(" lm loss: ") < line.index(" load_balancing_loss: ") < line.index(" mtp_1 loss: ") \
        < line.index(" mtp_2 loss: "), line
    assert f" lm loss: {a['lm_loss'][0]:.6E} |" in line and f" mtp_1 loss: {a['mtp_losses'][0][0]:.6E} |" in line


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    ("--mtp-num-layers 1 --position-embedding-type learned_absolute",
     "Megatron-LM refuses multi-token prediction without rotary"),
    ("--mtp-num-layers -1", "--mtp-num-layers=-1 must be a positive"),
    ("--mtp-num-layers 1 --recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
     "unless --recompute-num-layers is 1"),
    ("--mtp-num-layers 1 --mtp-detach-heads", "--mtp-detach-heads"),
])
def test_refused_with_the_reason(extra, message):
    with pytest.raises(ArgumentError, match=message.replace("-", r"\-").replace("(", r"\(")):
        parse_args(shlex.split(BASE + "--train-iters 1 " + extra), world_size=1)


def test_scaling_factor_without_depths_warns_and_zero_depths_is_none():
    args = parse_args(shlex.split(BASE + "--train-iters 1 --mtp-num-layers 0 --mtp-loss-scaling-factor 0.2"),
                      world_size=1)
    assert args.mtp_num_layers is None
    assert any("--mtp-loss-scaling-factor 0.2: no effect" in w for w in args.flag_warnings)


# -- --use-mcore-models: megatron-core's MTP block in the launcher ------------------------------
def mcore_or_embedded_worker(rank, world, *, flags, mcore):
    """3 iterations through ``train_step``: the embedded GPT under PyTorch DDP, or megatron-core's
    GPTModel (CPU shim) under Megatron-FSDP starting from the embedded GPT's initial weights."""
    import contextlib
    from unittest import mock

    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.models import GPT
    from megatron_fsdp.models import mcore as mcore_models
    from megatron_fsdp.training.data import BatchLayout, MockDataset
    from megatron_fsdp.training.optim.lr_schedule import LRSchedule
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer
    from megatron_fsdp.training.training_step import StepContext, TrainState, train_step

    flags = BASE + MTP + "--train-iters 3 " + flags
    if mcore:
        flags += (" --use-mcore-models --distributed-backend nccl --use-megatron-fsdp "
                  "--data-parallel-sharding-strategy optim_grads_params")
    with mock.patch.object(device_mod, "cuda_available", lambda: mcore), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: world):
        args = parse_args(shlex.split(flags), world_size=world)

    build = mcore_models.build_mcore_gpt

    def build_from_embedded(cfg, **kwargs):
        model = build(cfg, allow_cpu=True, **kwargs)
        torch.manual_seed(args.seed)  # what the embedded launcher draws its GPT from
        model.load_state_dict(mcore_models.to_mcore_state_dict(GPT(cfg).state_dict(), cfg), strict=False)
        return model

    bridge = contextlib.nullcontext()
    if mcore:
        from test_models_mtp import _mtp_on_cpu

        bridge = _mtp_on_cpu()
    with bridge, mock.patch.object(mcore_models, "build_mcore_gpt", build_from_embedded):
        bundle = setup_model_and_optimizer(args, torch.device("cpu"))
        ctx = StepContext(bundle=bundle, schedule=LRSchedule.from_args(args), scaler=None, device=torch.device("cpu"),
                          layout=BatchLayout(micro_batch_size=2, num_microbatches=2, dp_rank=rank, dp_size=world),
                          clip_grad=1.0, per_token_loss=args.calculate_per_token_loss, check_for_nan=True,
                          seq_length=16)
        source, state = MockDataset(64, 16, seed=1), TrainState()
        results = [train_step(ctx, state, source) for _ in range(3)]
    return dict(wrapper=type(bundle.model).__name__,
                numbers=[[r.lm_loss, r.grad_norm, r.load_balancing_loss, *r.mtp_losses] for r in results])


@pytest.mark.parametrize("flags", ["", "--calculate-per-token-loss --mtp-num-layers 1"], ids=["mean", "per_token"])
def test_mcore_models_mtp_trains_as_the_embedded_gpt(pool2, flags):
    """megatron-core's MTP block driven by the launcher (its MTPLossAutoScaler factor, the
    0.16.1 per-token correction, its loss tracker; its routers' MoEAuxLossAutoScaler factor)
    under Megatron-FSDP, from the same weights: the embedded GPT's numbers every iteration.
    (Per-token with two depths is refused for megatron-core 0.16.1: mcore_mtp.py.)"""
    pytest.importorskip("megatron.core")
    ours = pool2.run(mcore_or_embedded_worker, flags=flags, mcore=False)[0]
    theirs = pool2.run(mcore_or_embedded_worker, flags=flags, mcore=True)[0]
    assert theirs["wrapper"] == "FullyShardedDataParallel", theirs
    for a, b in zip(ours["numbers"], theirs["numbers"]):
        assert b == pytest.approx(a, rel=0, abs=TOL), (ours["numbers"], theirs["numbers"])
