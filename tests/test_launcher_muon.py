"""``--optimizer muon`` (megatron_fsdp/training/optim/muon.py, muon_optimizer.py, muon_flags.py)
against Megatron-LM's Muon (its ``emerging_optimizers`` formulas, written out here:
that package is not installed):

* the Newton-Schulz iteration equals a float64 iteration written independently (the
  polynomial a X + b (X X^T) X + c (X X^T)^2 X on the wide orientation, upstream's
  coefficient tables copied as data), for every coefficient set, step counts past the
  set's length, tall and wide matrices; ``medium`` precision runs it in bf16;
* the scale modes, the QKV split (megatron-core's per-group layout and the embedded
  GPT's one-block layout give the same update), one optimizer step by hand (weight
  decay, EMA momentum, Nesterov, scales, lr), AdamW's groups bit-equal to torch's;
* Megatron-LM's routing: which weights of a GPT get Muon;
* a 2-rank launcher run (PyTorch DDP, and the sharded path of --use-distributed-optimizer,
  whose owner ranks orthogonalise whole matrices) equals a single process on the same
  global batch; a resume from its checkpoint restores Muon's momentum;
* what Megatron-LM refuses is refused before training.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from conftest import get_pool
from launcher_inprocess import run_launcher
from megatron_fsdp.training.args.arg_types import ArgumentError
from megatron_fsdp.training.args.arguments import parse_args
from megatron_fsdp.training.optim.muon import (
    CoefficientType,
    FusedRows,
    MatmulPrecision,
    MuonConfig,
    ScaleMode,
    newton_schulz,
    update_scale,
)
from megatron_fsdp.training.optim.muon_optimizer import MuonAdamW, assign_owners, qkv_split, uses_muon


# emerging_optimizers' coefficient tables (muon_utils.py), as data.
UPSTREAM_COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
}


def reference_ns(x: torch.Tensor, steps: int, kind: str) -> torch.Tensor:
    """Newton-Schulz in float64, written as the polynomial; step i uses set i mod len
    (polar_express: min(i, len - 1))."""
    table = UPSTREAM_COEFFICIENTS[kind]
    tall = x.shape[0] > x.shape[1]
    X = (x.T if tall else x).double()
    X = X / max(torch.linalg.matrix_norm(X).item(), 1e-7)
    for i in range(steps):
        a, b, c = table[min(i, len(table) - 1)] if kind == "polar_express" else table[i % len(table)]
        G = X @ X.T
        X = a * X + b * (G @ X) + c * (G @ G @ X)
    return (X.T if tall else X).float()


@pytest.mark.parametrize("kind", list(UPSTREAM_COEFFICIENTS))
def test_newton_schulz_equals_a_float64_iteration(kind):
    gen = torch.Generator().manual_seed(0)
    for shape, steps in (((12, 5), 5), ((5, 12), 7), ((9, 9), 11), ((1, 6), 3)):
        x = torch.randn(*shape, generator=gen)
        ours = newton_schulz(x, steps, CoefficientType(kind))
        assert ours.shape == x.shape and ours.dtype == torch.float32
        torch.testing.assert_close(ours, reference_ns(x, steps, kind), rtol=0, atol=2e-5)
    # Orthogonal enough: quintic's five steps put every singular value of a well-conditioned matrix near 1.
    s = torch.linalg.svdvals(newton_schulz(torch.randn(16, 8, generator=gen), 5, CoefficientType.QUINTIC))
    assert 0.6 < s.min() and s.max() < 1.25, s


def test_medium_precision_runs_the_iteration_in_bf16_and_restores_the_setting():
    x = torch.randn(24, 10, generator=torch.Generator().manual_seed(1))
    before = torch.get_float32_matmul_precision()
    exact = MuonConfig(matmul_precision=MatmulPrecision.HIGH).orthogonalize(x)
    medium = MuonConfig(matmul_precision=MatmulPrecision.MEDIUM).orthogonalize(x)
    low = MuonConfig(matmul_precision=MatmulPrecision.LOW).orthogonalize(x)
    assert torch.get_float32_matmul_precision() == before
    assert torch.equal(low, exact)  # low: torch ignores it, fp32 (on CPU "high" is fp32 too)
    diff = (medium - exact).abs().max().item()
    assert 1e-4 < diff < 0.1, diff  # bf16 rounding: visibly not fp32, still the same matrix
    scale = 24 ** 0.5
    torch.testing.assert_close(exact, reference_ns(x, 5, "quintic") * scale, rtol=0, atol=1e-4)


def test_scale_modes_follow_upstream_formulas():
    assert update_scale(32, 8, ScaleMode.SPECTRAL) == 32 ** 0.5
    assert update_scale(8, 32, ScaleMode.SPECTRAL) == 32 ** 0.5
    assert update_scale(32, 8, ScaleMode.SHAPE_SCALING) == 2.0
    assert update_scale(8, 32, ScaleMode.SHAPE_SCALING) == 1.0
    assert update_scale(32, 8, ScaleMode.UNIT_RMS_NORM) == 2.0
    assert update_scale(8, 32, ScaleMode.UNIT_RMS_NORM) == 0.5


def test_qkv_split_gives_the_same_update_in_either_layout():
    """megatron-core's fused QKV interleaves [q | gate | k | v] per key/value group; the
    embedded GPT stacks [q | k | v | gate]: the same four matrices, so the same update."""
    heads, groups, d, hidden = 4, 2, 3, 10
    q, kv = heads * d, groups * d
    gen = torch.Generator().manual_seed(2)
    Q, K, V, G = (torch.randn(n, hidden, generator=gen) for n in (q, kv, kv, q))
    embedded = torch.cat([Q, K, V, G])
    per = heads // groups * d
    mcore = torch.cat([torch.cat([Q[g * per:(g + 1) * per], G[g * per:(g + 1) * per], K[g * d:(g + 1) * d],
                                  V[g * d:(g + 1) * d]]) for g in range(groups)])
    args = type("A", (), dict(num_attention_heads=heads, num_query_groups=groups, kv_channels=d,
                              attention_output_gate=True))
    cfg = MuonConfig(matmul_precision=MatmulPrecision.HIGH, scale_mode=ScaleMode.UNIT_RMS_NORM)
    ours = cfg.orthogonalize(embedded, qkv_split("blocks.0.attn.qkv.weight", args))
    theirs = cfg.orthogonalize(mcore, qkv_split("decoder.layers.0.self_attention.linear_qkv.weight", args))
    pieces = ours.split([q, kv, kv, q])
    for name, got, block in zip("QKVG", pieces, (Q, K, V, G)):  # each projection alone, its own scale
        torch.testing.assert_close(got, cfg.orthogonalize(block), rtol=0, atol=1e-6, msg=name)
    back = torch.cat([theirs.view(groups, -1, hidden)[:, :per].reshape(-1, hidden),
                      theirs.view(groups, -1, hidden)[:, 2 * per:2 * per + d].reshape(-1, hidden),
                      theirs.view(groups, -1, hidden)[:, 2 * per + d:].reshape(-1, hidden),
                      theirs.view(groups, -1, hidden)[:, per:2 * per].reshape(-1, hidden)])
    torch.testing.assert_close(back, ours, rtol=0, atol=1e-6)
    assert (cfg.orthogonalize(embedded) - ours).abs().max() > 0.1  # unsplit is another update
    no_split = MuonConfig(matmul_precision=MatmulPrecision.HIGH, scale_mode=ScaleMode.UNIT_RMS_NORM, split_qkv=False)
    assert torch.equal(no_split.orthogonalize(embedded, FusedRows(blocks=1, pieces=(q, kv, kv, q))),
                       cfg.orthogonalize(embedded))


@pytest.mark.parametrize("nesterov", [False, True])
def test_two_steps_by_hand(nesterov):
    """W -= lr wd W; M = lerp(M, G, 1 - beta); U = lerp(G, M, beta) or M;
    W -= lr NS(U) scale extra. The AdamW groups equal torch.optim.AdamW bit for bit."""
    gen = torch.Generator().manual_seed(3)
    w, bias, emb = torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen), torch.randn(5, 4, generator=gen)
    params = [torch.nn.Parameter(t.clone()) for t in (w, bias, emb)]
    twins = [torch.nn.Parameter(t.clone()) for t in (bias, emb)]
    cfg = MuonConfig(momentum=0.8, nesterov=nesterov, extra_scale_factor=0.5, scale_mode=ScaleMode.SHAPE_SCALING,
                     matmul_precision=MatmulPrecision.HIGH)
    opt = MuonAdamW([{"params": params[:1], "weight_decay": 0.1, "use_muon": True},
                     {"params": params[1:], "weight_decay": 0.0}], muon=cfg, lr=0.02, betas=(0.9, 0.95), eps=1e-6)
    adamw = torch.optim.AdamW([{"params": twins, "weight_decay": 0.0}], lr=0.02, betas=(0.9, 0.95), eps=1e-6)
    ref, m = w.double(), torch.zeros(6, 4, dtype=torch.float64)
    for step, lr in enumerate((0.02, 0.01)):
        grads = [torch.randn(t.shape, generator=gen) for t in (w, bias, emb)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        for p, g in zip(twins, grads[1:]):
            p.grad = g.clone()
        for group in (*opt.param_groups, *adamw.param_groups):
            group["lr"] = lr
        opt.step()
        adamw.step()
        g = grads[0].double()
        ref = ref - lr * 0.1 * ref
        m = m + 0.2 * (g - m)
        u = g + 0.8 * (m - g) if nesterov else m
        ref = ref - lr * reference_ns(u.float(), 5, "quintic").double() * (6 / 4) ** 0.5 * 0.5
        torch.testing.assert_close(params[0].detach().double(), ref, rtol=0, atol=2e-6, msg=f"step {step}")
        torch.testing.assert_close(opt.state[params[0]]["momentum_buffer"].double(), m, rtol=0, atol=1e-6)
        for ours, theirs in zip(params[1:], twins):
            assert torch.equal(ours, theirs)
    assert set(opt.state[params[1]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_assign_owners_balances_the_largest_first():
    assert assign_owners([1, 100, 50, 50, 1], 2) == [0, 0, 1, 1, 1]  # 100 | 50+50 | then 1s alternate
    assert assign_owners([5, 5, 5], 4) == [0, 1, 2]
    assert assign_owners([], 3) == []


# -- the launcher -------------------------------------------------------------------------------
BASE = ("--num-layers 1 --hidden-size 16 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--seq-length 8 --max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 4 --train-iters 4 "
        "--num-experts 2 --moe-ffn-hidden-size 8 --swiglu --ffn-hidden-size 32 --lr 1e-2 --weight-decay 0.1 "
        "--lr-decay-style cosine --adam-eps 1e-4 --optimizer muon --muon-momentum 0.8 --muon-nesterov "
        "--muon-extra-scale-factor 0.5 --log-interval 1 --eval-iters 0 --plot-path none --seed 7 "
        "--hidden-dropout 0 --attention-dropout 0 ")  # dropout draws differ per rank
HIGH = "--muon-fp32-matmul-prec high "  # fp32 Newton-Schulz: ranks differ in rounding only


def test_routing_follows_megatron_lm():
    from megatron_fsdp.models.gpt import GPT
    from megatron_fsdp.training.model_setup import build_optimizer, gpt_config_from_args

    args = parse_args(shlex.split(BASE), world_size=1)
    model = GPT(gpt_config_from_args(args))
    opt = build_optimizer(model, args)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"])
    assert muon == ["blocks.0.attn.proj.weight", "blocks.0.attn.qkv.weight",
                    "blocks.0.mlp.experts.0.fc.weight", "blocks.0.mlp.experts.0.proj.weight",
                    "blocks.0.mlp.experts.1.fc.weight", "blocks.0.mlp.experts.1.proj.weight",
                    "blocks.0.mlp.router.weight", "wpe.weight"]  # megatron-core marks only wte / lm_head
    assert all(uses_muon(p) == g["use_muon"] for g in opt.param_groups for p in g["params"])
    assert all(g["weight_decay"] == 0.1 for g in opt.param_groups if g["use_muon"])
    assert [layout.fused for layouts in opt.layouts if layouts for layout in layouts
            if layout.fused is not None] == [FusedRows(blocks=1, pieces=(16, 8, 8))]


def launcher_task(rank: int, world: int, *, flags: str) -> None:
    """scripts/pretrain_gpt.py's ``run`` on this pool rank."""
    run_launcher(BASE + flags, world)


def _metrics(path: Path) -> dict:
    return json.loads(path.read_text())


def test_two_ranks_equal_one_process_and_resume_restores_the_momentum(pool2, tmp_path):
    ckpt = tmp_path / "ckpt"
    get_pool(1).run(launcher_task, flags=HIGH + f"--log-json {tmp_path / 'one.json'}")
    pool2.run(launcher_task, flags=HIGH + f"--log-json {tmp_path / 'ddp.json'}")
    pool2.run(launcher_task, flags=HIGH + f"--use-distributed-optimizer --log-json {tmp_path / 'sharded.json'} "
                                          f"--save {ckpt} --save-interval 2")
    one, ddp, sharded = (_metrics(tmp_path / f"{n}.json") for n in ("one", "ddp", "sharded"))
    assert one["iterations"] == [1, 2, 3, 4]
    assert one["lm_loss"][0] - one["lm_loss"][-1] > 0.05  # Muon moves the weights
    for name, run in (("ddp", ddp), ("sharded", sharded)):
        for key in ("lm_loss", "grad_norm"):
            assert max(abs(a - b) for a, b in zip(run[key], one[key])) <= 1e-5, (name, key, run[key], one[key])
    # Resume the sharded run from iteration 2 (DCP): iterations 3 and 4 as uninterrupted.
    pool2.run(launcher_task, flags=HIGH + f"--use-distributed-optimizer --load {ckpt} --ckpt-step 2 "
                                          f"--log-json {tmp_path / 'resumed.json'}")
    resumed = _metrics(tmp_path / "resumed.json")
    assert resumed["iterations"] == [3, 4]
    assert max(abs(a - b) for a, b in zip(resumed["lm_loss"], sharded["lm_loss"][2:])) <= 1e-6, \
        (resumed["lm_loss"], sharded["lm_loss"])


@pytest.mark.parametrize("flags, message", [
    ("--use-megatron-fsdp", "Megatron-LM does not support emerging optimizers with Megatron-FSDP"),
    ("--use-torch-fsdp2 --untie-embeddings-and-output-weights --no-gradient-accumulation-fusion",
     "Megatron-LM does not support emerging optimizers with Torch-FSDP2"),
    ("--fp16", "Megatron-LM does not support emerging optimizers with fp16"),
    ("--ckpt-format torch_dcp", "save torch and torch_dist checkpoints only"),
    ("--muon-num-ns-steps 0", "--muon-num-ns-steps=0 must be at least 1"),
    ("--use-distributed-optimizer --num-distributed-optimizer-instances 2",
     "the sharded Muon step is implemented for one optimizer instance"),
    ("--muon-coefficient-type custom", "--muon-coefficient-type custom is not supported here"),
    ("--muon-scalar-optimizer lion", "--muon-scalar-optimizer lion is not supported here"),
])
def test_what_megatron_lm_refuses_is_refused(flags, message):
    with pytest.raises(ArgumentError) as info:
        parse_args(shlex.split(BASE + flags), world_size=4)
    assert message in str(info.value)


def test_muon_flags_without_muon_warn():
    args = parse_args(shlex.split(BASE.replace("--optimizer muon ", "")), world_size=1)
    warned = [w for w in args.flag_warnings if "has no effect without --optimizer muon" in w]
    assert len(warned) == 3 and "--muon-momentum" in warned[0]
    args = parse_args(shlex.split(BASE + "--muon-tp-mode blockwise --no-use-layer-wise-param-layout"), world_size=1)
    assert [w.split(":")[0] for w in args.flag_warnings] == ["--muon-tp-mode blockwise",
                                                             "--no-use-layer-wise-param-layout"]


def test_loading_another_optimizers_state_is_refused():
    w = torch.nn.Parameter(torch.randn(4, 4))
    b = torch.nn.Parameter(torch.randn(4))
    opt = MuonAdamW([{"params": [w], "use_muon": True}, {"params": [b]}], muon=MuonConfig())
    other = torch.optim.AdamW([{"params": [w]}, {"params": [b]}])
    with pytest.raises(ValueError, match="saved by another optimizer.*--no-load-optim"):
        opt.load_state_dict(other.state_dict())
