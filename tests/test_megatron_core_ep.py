"""Megatron-core's MoE GPT at expert-parallel size > 1 through ``FullyShardedDataParallel``.

The model is megatron-core 0.16's ``GPTModel`` with the local layer spec: every layer's
MLP a ``MoELayer`` (``TopKRouter``, ``MoEAlltoAllTokenDispatcher``, ``SequentialMLP``
experts; no TransformerEngine, no grouped GEMM), on CPU/gloo under tests/mcore_cpu_shim.py
(its items 4 and 5 are what MoE needs beyond the dense GPT: CUDA streams of the token
dispatcher and a name megatron-core leaves undefined without TransformerEngine).

Three runs see the same weights and the same global batch, two microbatches per step
(four where the one-rank group case needs them), fp32:

* ours: ``FullyShardedDataParallel`` on megatron-core's parallel state
  (``initialize_model_parallel(expert_model_parallel_size=EP)``);
* Megatron-core's own ``DistributedDataParallel`` on the same model and parallel state
  (the reference; with HSDP its distributed-optimizer shards of the gradients are
  gathered, which is what its ``DistributedOptimizer`` steps on);
* one process training the full model, all experts, on the global batch (built on
  one-rank groups, so no collective runs).

They agree within 1e-5 on the losses, on every gradient of the first step (the direct
check of the expert gradient scaling: an expert's gradient already sums the tokens of its
expert-parallel group, and must end as the sum over all data-parallel ranks' tokens / dp,
with ``average_in_collective`` too, where the engine multiplies by edp/dp before an AVG
over the edp ranks), on every parameter after three steps (SGD with momentum, AdamW with
eps=1e-4), on the gradient norm (``clip_grad_norm_``, combined over the expert-parallel
ranks through the expert mesh's ``ep`` dimension) and on megatron-core's
distributed-checkpoint pieces (``sharded_state_dict``: keys, global expert offsets,
values). Layouts: EP 2 at world 4 (expert data-parallel groups of 2), EP 4 at world 4 and
EP 2 at world 2 (one-rank expert data-parallel groups: Megatron-LM issue 6660, gradients
doubled per microbatch), EP 2 with HSDP over two distributed-optimizer instances at world 4
(expert shard group of one rank, outer group of two; megatron-core's hierarchical groups
built through the shim's einops stand-in), groups from parallel_state or from a
``ProcessGroupCollection``. ``MFSDP_EPCP_LONG=1`` adds every strategy for each layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import types
from typing import Any

import pytest


pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import conftest  # noqa: E402
from grids import grid  # noqa: E402
import megatron_fsdp as mf  # noqa: E402
from mcore_cpu_shim import cpu_shim, hierarchical_groups_without_einops  # noqa: E402
from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel, build_dist_index  # noqa: E402

LONG = bool(os.environ.get("MFSDP_EPCP_LONG"))
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TOL = 1e-5
SEQ, VOCAB, HIDDEN, EXPERTS, MICRO_BATCH = 8, 64, 16, 4, 2  # MICRO_BATCH sequences per microbatch


# -- megatron-core's parallel state --------------------------------------------------------------
_STATES: dict[tuple, dict] = {}
"""(ep, instances) -> megatron-core's parallel-state globals right after initializing them:
each pooled worker creates the groups of a layout once (as tests/test_megatron_core_tp.py's
[Note: pooled parallel state] explains) and puts them back for every test."""


@contextlib.contextmanager
def moe_parallel_state(ep: int, instances: int = 1):
    """Megatron-core's groups for expert-parallel size ``ep`` (HSDP over ``instances``
    distributed-optimizer instances) and the CPU shim; torn down afterwards."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    key = (ep, instances)
    if key in _STATES:
        vars(ps).update(_STATES[key])
    else:
        with hierarchical_groups_without_einops():
            ps.initialize_model_parallel(expert_model_parallel_size=ep, num_distributed_optimizer_instances=instances,
                                         create_gloo_process_groups=False)
        _STATES[key] = {k: v for k, v in vars(ps).items() if k.startswith("_") and k[1:2].isupper()}
    try:
        with cpu_shim(ep_rank=ps.get_expert_model_parallel_rank()):
            yield ps
    finally:
        ps.destroy_model_parallel()


_SOLO: dict[str, Any] = {}


def solo_collection():
    """A ``ProcessGroupCollection`` whose every group is this rank alone: megatron-core's
    model of the whole, unsharded computation (made once per pooled worker)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if "pgc" not in _SOLO:
        me, _ = dist.new_subgroups(group_size=1)
        pgc = ProcessGroupCollection()
        for name in ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
                     "tp_dp_cp", "dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp"):
            setattr(pgc, name, me)
        _SOLO["pgc"] = pgc
    return _SOLO["pgc"]


# -- the model ----------------------------------------------------------------------------------
def moe_config(ep: int, **overrides):
    """Without linear biases: at expert-parallel and expert tensor-parallel size 1 (the
    one-process model) megatron-core 0.16's expert fc2 hands its output through
    ``reduce_from_tensor_model_parallel_region``, which at one rank returns its input as
    is, and its MLP then adds the bias in place: autograd refuses to modify that view,
    on GPU as on CPU."""
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=EXPERTS,
        moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        expert_model_parallel_size=ep, use_cpu_initialization=True, init_method_std=0.1, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
    )
    return TransformerConfig(**{**fields, **overrides})


def build_gpt(config, pg_collection=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pg_collection=pg_collection)


def full_model():
    """The whole model, all experts, on one-rank groups; every rank draws the same one."""
    torch.manual_seed(0)
    return build_gpt(moe_config(1), solo_collection())


def global_name(name: str, ep_rank: int, ep: int) -> str:
    """The full model's name of a parameter: local expert ``i`` of expert-parallel rank
    ``r`` is global expert ``r * EXPERTS / ep + i`` (megatron-core's assignment)."""
    found = re.search(r"local_experts\.(\d+)\.", name)
    if found is None:
        return name
    index = ep_rank * (EXPERTS // ep) + int(found.group(1))
    return name.replace(found.group(0), f"local_experts.{index}.")


@torch.no_grad()
def expert_parallel_copy(full, ps):
    """Megatron-core's model at this rank's expert-parallel layout with ``full``'s weights."""
    ep, rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    model, weights = build_gpt(moe_config(ep)), dict(full.named_parameters())
    for name, p in model.named_parameters():
        p.copy_(weights[global_name(name, rank, ep)])
    return model


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
    return model(inputs, positions, None, labels=labels).mean()  # per-token losses [b, s]; None: causal


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)


def full_weights(fsdp) -> dict:
    names = {n for n, _ in fsdp.named_parameters()}
    return {n: v for n, v in mf.get_full_state_dict(fsdp.module).items() if n in names}


@torch.no_grad()
def full_grads(fsdp) -> dict:
    """The reduced gradients, whole: the engine gathers main weights only, so an optimizer
    step writes each gradient piece into its weight piece (the pieces share one layout),
    the full weights are read, and the weights put back, through the same step protocol."""
    params = dict(fsdp.named_parameters())
    saved = {n: p.detach().clone() for n, p in params.items()}
    for p in params.values():
        p.detach().copy_(p.grad)
    fsdp.install_optimized_model_weights()
    grads = full_weights(fsdp)
    for n, p in params.items():
        p.detach().copy_(saved[n])
    fsdp.install_optimized_model_weights()
    return grads


# -- one training run per side -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    strategy: str = "optim_grads_params"
    opt: str = "sgd"
    average_in_collective: bool = False
    micro: int = 2
    outer: str = "no_shard"  # HSDP's outer strategy ("optim": HFSDP)
    pg_collection: bool = False  # groups from ProcessGroupCollection.use_mpu_process_groups(), not parallel_state


@dataclasses.dataclass
class Run:
    """What one side saw: per-step global losses, first-step gradients and final weights
    (both keyed by the names of that side's model), first-step gradient norm."""

    losses: list = dataclasses.field(default_factory=list)
    grads: dict = dataclasses.field(default_factory=dict)
    weights: dict = dataclasses.field(default_factory=dict)
    norm: float = math.nan
    checkpoint: dict = dataclasses.field(default_factory=dict)
    """Megatron-core's distributed-checkpoint pieces at the end: key -> (global offset, tensor)."""


def _global_mean(value: torch.Tensor, ps) -> float:
    value = value.detach().clone()
    dist.all_reduce(value, group=ps.get_data_parallel_group())
    return value.item() / ps.get_data_parallel_world_size()


def train_distributed(model, opt, data, ps, case: Case, *, after_sync, after_step, grads_of, norm_of) -> Run:
    """Megatron-LM's step on this data-parallel rank's share: zero the grad buffer,
    microbatches (all but the last under ``no_sync``), finish the gradient sync, step."""
    run, rank, size = Run(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    for step, tokens in enumerate(data):
        model.zero_grad_buffer()
        opt.zero_grad()
        total = torch.zeros(())
        for i, chunk in enumerate(tokens.chunk(size)[rank].chunk(case.micro)):
            with model.no_sync() if i < case.micro - 1 else contextlib.nullcontext():
                loss = lm_loss(model, chunk) / case.micro
                loss.backward()
            total += loss.detach()
        model.finish_grad_sync()
        after_sync()
        if step == 0:
            run.grads, run.norm = grads_of(), norm_of()
        opt.step()
        after_step()
        run.losses.append(_global_mean(total, ps))
    return run


def train_single(model, data, case: Case, dp: int) -> Run:
    """One process, the full model, the global batch in the same microbatches."""
    run, opt = Run(), make_optimizer(case.opt, model.parameters())
    for step, tokens in enumerate(data):
        chunks = tokens.chunk(dp * case.micro)
        total = 0.0
        for chunk in chunks:
            loss = lm_loss(model, chunk) / len(chunks)
            loss.backward()
            total += loss.item()
        if step == 0:
            run.grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            run.norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        opt.step()
        opt.zero_grad()
        run.losses.append(total)
    run.weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


def train_megatron_ddp(model, data, ps, case: Case, instances: int) -> Run:
    """Megatron-core's DDP; the optimizer reads ``main_grad`` through ``grad``, as its
    ``FP32Optimizer`` does. With HSDP it must use the distributed optimizer, whose
    reduced gradients are valid in this rank's shard only: the shards are gathered over
    the instance (what its optimizer's parameter all-gather amounts to)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed import DistributedDataParallelConfig as McoreDDPConfig

    ddp = DistributedDataParallel(model.config, McoreDDPConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=instances > 1,
        num_distributed_optimizer_instances=instances, average_in_collective=case.average_in_collective), model)
    opt = make_optimizer(case.opt, ddp.parameters())

    def after_sync():
        if instances > 1:
            _gather_distributed_optimizer_shards(ddp)
        for p in ddp.parameters():
            p.grad = p.main_grad

    run = train_distributed(ddp, opt, data, ps, case, after_sync=after_sync, after_step=lambda: None,
                            grads_of=lambda: {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()},
                            norm_of=lambda: math.nan)
    run.weights = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    run.checkpoint = checkpoint_pieces(ddp.module.sharded_state_dict())
    return run


def checkpoint_pieces(sharded: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {k: (tuple(v.global_offset), v.data.detach().clone()) for k, v in sharded.items()
            if isinstance(v, ShardedTensor)}


def _gather_distributed_optimizer_shards(ddp) -> None:
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        size = bucket_group.intra_distributed_optimizer_instance_size
        rank = bucket_group.intra_distributed_optimizer_instance_rank
        group = bucket_group.intra_distributed_optimizer_instance_group
        for bucket in bucket_group.buckets:
            mine = shard_buffer(bucket.grad_data, size)[rank].clone()
            dist.all_gather_into_tensor(bucket.grad_data, mine, group=group)


def train_ours(model, data, ps, case: Case, instances: int) -> tuple[Run, dict]:
    from megatron.core.distributed import DistributedDataParallelConfig as McoreDDPConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    marked = sum(1 for p in model.parameters() if not getattr(p, "allreduce", True))  # megatron-core's expert mark
    fsdp = FullyShardedDataParallel(model.config, McoreDDPConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=case.strategy != "no_shard",
        data_parallel_sharding_strategy=case.strategy, num_distributed_optimizer_instances=instances,
        outer_dp_sharding_strategy=case.outer, average_in_collective=case.average_in_collective,
        overlap_grad_reduce=True, overlap_param_gather=True), model,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups() if case.pg_collection else None)
    opt = make_optimizer(case.opt, fsdp.parameters())
    run = train_distributed(
        fsdp, opt, data, ps, case, after_sync=lambda: None, after_step=fsdp.install_optimized_model_weights,
        grads_of=lambda: full_grads(fsdp),
        norm_of=lambda: fsdp.module.clip_grad_norm_(math.inf).item(),
    )
    fsdp.finish_param_sync()
    run.weights = full_weights(fsdp)
    run.checkpoint = checkpoint_pieces(fsdp.sharded_state_dict())
    index = fsdp.megatron_fsdp_dist_index
    experts = index.groups_for(True)
    ep_group = index.expt_parallel_group
    layout = dict(marked_experts=marked, expert_shard=experts.shard_size, expert_outer=experts.outer_size,
                  expert_scaling=experts.scaling_size, dense_ranks=index.dp_size,
                  expert_mesh=tuple(index.expt_device_mesh.mesh_dim_names),
                  ep_group=[] if ep_group is None else dist.get_process_group_ranks(ep_group))
    return run, layout


def _max_diff(ours: dict, theirs: dict, rename=lambda n: n) -> float:
    return max((ours[n] - theirs[rename(n)]).abs().max().item() for n in ours)


def compare(ours: Run, ref: Run, single: Run, to_full) -> dict:
    """Largest differences of ours against the reference and the one process (whose
    names are the full model's: ``to_full``), and of the reference against the one process."""
    return dict(
        names_match=set(ours.grads) == set(ref.grads) == set(ours.weights) == set(ref.weights)
        and all(to_full(n) in single.grads for n in ours.grads),
        expert_params=sum(1 for n in ours.grads if "local_experts" in n),
        loss_vs_ref=max(abs(a - b) for a, b in zip(ours.losses, ref.losses)),
        loss_vs_single=max(abs(a - b) for a, b in zip(ours.losses, single.losses)),
        grad_vs_ref=_max_diff(ours.grads, ref.grads),
        grad_vs_single=_max_diff(ours.grads, single.grads, to_full),
        ref_grad_vs_single=_max_diff(ref.grads, single.grads, to_full),
        param_vs_ref=_max_diff(ours.weights, ref.weights),
        param_vs_single=_max_diff(ours.weights, single.weights, to_full),
        norm_vs_single=abs(ours.norm - single.norm),
        checkpoint_keys_match=sorted(ours.checkpoint) == sorted(ref.checkpoint) and len(ours.checkpoint) > 0,
        checkpoint_vs_ref=max(max(abs(a - b) for a, b in zip(ours.checkpoint[k][0], ref.checkpoint[k][0]))
                              + (ours.checkpoint[k][1] - ref.checkpoint[k][1]).abs().max().item()
                              for k in ours.checkpoint),
        expert_grad_scale=_expert_grad_ratio(ours.grads, single.grads, to_full),
        trains=ours.losses[-1] < ours.losses[0],
    )


def parity_worker(rank, world, *, ep: int, cases: list, instances: int = 1, steps: int = 3):
    with moe_parallel_state(ep, instances) as ps:
        full, out = full_model(), []
        dp, ep_rank = ps.get_data_parallel_world_size(), ps.get_expert_model_parallel_rank()
        for case in cases:
            g = torch.Generator().manual_seed(1)
            shape = (dp * case.micro * MICRO_BATCH, SEQ + 1)  # the global batch of one step
            data = [torch.randint(0, VOCAB, shape, generator=g) for _ in range(steps)]
            single = train_single(full_model(), data, case, dp)
            ref = train_megatron_ddp(expert_parallel_copy(full, ps), data, ps, case, instances)
            ours, layout = train_ours(expert_parallel_copy(full, ps), data, ps, case, instances)
            to_full = functools.partial(global_name, ep_rank=ep_rank, ep=ep)
            out.append(dict(case=case, layout=layout, **compare(ours, ref, single, to_full)))
        return out


def _expert_grad_ratio(ours: dict, single: dict, rename) -> float:
    """|our expert gradients| / |the full model's|: 1 when scaled right (ep or 2**k off when not)."""
    names = [n for n in ours if "local_experts" in n]
    mine = torch.stack([ours[n].norm() for n in names]).norm()
    return (mine / torch.stack([single[rename(n)].norm() for n in names]).norm()).item()


def assert_parity(results, *, ep: int, world: int, instances: int = 1) -> None:
    for per_rank in results:
        for r in per_rank:
            layout = r["layout"]
            assert r["names_match"] and r["expert_params"] == layout["marked_experts"] > 0, r
            assert r["checkpoint_keys_match"], r
            # Experts shard over world / ep ranks and average over the dense data-parallel size.
            assert layout["expert_shard"] * layout["expert_outer"] == world // ep, r
            assert layout["expert_outer"] == instances and layout["expert_scaling"] == layout["dense_ranks"] == world, r
            assert len(layout["ep_group"]) == ep and layout["expert_mesh"][-1] == "ep", r
            for key in ("loss_vs_ref", "loss_vs_single", "grad_vs_ref", "grad_vs_single", "ref_grad_vs_single",
                        "param_vs_ref", "param_vs_single", "norm_vs_single", "checkpoint_vs_ref"):
                assert r[key] < TOL, (key, r)
            assert abs(r["expert_grad_scale"] - 1.0) < 1e-4, r
            assert r["trains"], r


# -- the layouts -------------------------------------------------------------------------------
BOTH = dict(sgd=dict(opt="sgd"), adamw_avg=dict(opt="adamw", average_in_collective=True, pg_collection=True))


@pytest.mark.parametrize("strategy", grid(STRATEGIES, ("optim", "optim_grads_params"), "MFSDP_EPCP_LONG"))
def test_ep2_world4_matches_megatron_ddp_and_one_process(pool4, strategy):
    """EP 2 at world 4: expert data-parallel groups of 2, dense data parallelism over 4."""
    cases = [Case(strategy=strategy, **kw) for kw in BOTH.values()]
    assert_parity(pool4.run(parity_worker, ep=2, cases=cases), ep=2, world=4)


def test_ep4_world4_one_rank_expert_groups(pool4):
    """EP = world: every expert data-parallel group is one rank (Megatron-LM issue 6660:
    gradients doubled per microbatch under ZeRO-3); four microbatches would show 2**3."""
    cases = [Case(strategy="optim_grads_params", micro=4),
             Case(strategy="optim_grads", opt="adamw", micro=4, average_in_collective=True)]
    assert_parity(pool4.run(parity_worker, ep=4, cases=cases), ep=4, world=4)


def test_ep2_world2(pool2):
    """EP 2 at world 2 (one-rank expert groups again, dense data parallelism over 2)."""
    cases = [Case(strategy="optim_grads_params", micro=4), Case(strategy="no_shard", opt="adamw")]
    assert_parity(pool2.run(parity_worker, ep=2, cases=cases), ep=2, world=2)


def test_ep2_hsdp_world4(pool4):
    """EP 2 with HSDP over 2 distributed-optimizer instances: the expert shard group is
    megatron-core's intra-partial expert data-parallel group (one rank), the outer its
    inter-instance group (two); and HFSDP (the optimizer sharded over the outer group too)."""
    cases = [Case(strategy="optim_grads_params", opt="adamw"),
             Case(strategy="optim_grads_params", outer="optim", pg_collection=True)]
    results = pool4.run(parity_worker, ep=2, cases=cases, instances=2)
    assert_parity(results, ep=2, world=4, instances=2)
    for per_rank in results:
        assert per_rank[0]["layout"]["expert_mesh"] == ("outer_fsdp_dp", "dp_cp", "ep")
        assert per_rank[0]["layout"]["expert_shard"] == 1  # megatron-core's intra-partial expert dp group


@pytest.mark.skipif(not LONG, reason="the full EP grid: MFSDP_EPCP_LONG=1")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_long_grid(strategy):
    """Every strategy at EP 4 (world 4), EP 2 (world 2) and EP 2 with HSDP (world 4), each
    with SGD and AdamW with ``average_in_collective``, four microbatches; HFSDP for ZeRO-3."""
    cases = [Case(strategy=strategy, micro=4, **kw) for kw in BOTH.values()]
    assert_parity(conftest.get_pool(4).run(parity_worker, ep=4, cases=cases), ep=4, world=4)
    assert_parity(conftest.get_pool(2).run(parity_worker, ep=2, cases=cases), ep=2, world=2)
    if strategy == "optim_grads_params":
        cases.append(Case(strategy=strategy, opt="adamw", outer="optim", average_in_collective=True))
    results = conftest.get_pool(4).run(parity_worker, ep=2, cases=cases, instances=2)
    assert_parity(results, ep=2, world=4, instances=2)


def rng_worker(rank, world):
    from megatron.core import tensor_parallel

    with moe_parallel_state(ep=2) as ps:
        state = tensor_parallel.get_cuda_rng_tracker().get_states()["expert-parallel-rng"]
        expected = torch.Generator().manual_seed(1234 + 1024 + 100 * ps.get_expert_model_parallel_rank()).get_state()
        return bool(torch.equal(state, expected))


def test_shim_seeds_expert_rng_per_ep_rank(pool4):
    """The shim's tracker gives each expert-parallel rank megatron-core's expert seed."""
    assert all(pool4.run(rng_worker))


# -- refusals -----------------------------------------------------------------------------------
def _error(build) -> str:
    try:
        build()
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def refusal_worker(rank, world):
    import megatron_fsdp as mf

    cfg = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    hsdp = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                            num_distributed_optimizer_instances=2)
    moe, cpu, out = types.SimpleNamespace(num_moe_experts=EXPERTS), torch.device("cpu"), {}
    with moe_parallel_state(ep=2) as ps:
        ep, edp = ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group()
        # A (dp 2 x tp 2) layout, built from the EP state's groups, with experts spread over 2 ranks.
        with_tp = types.SimpleNamespace(dp_cp=edp, tp=ep, ep=ep, expt_tp=None)
        out["ep_tp"] = _error(lambda: build_dist_index(cfg, cpu, with_tp, moe))
        dense = ps.get_data_parallel_group()
        out["no_expt_dp"] = _error(lambda: build_dist_index(cfg, cpu, types.SimpleNamespace(dp_cp=dense, ep=ep), moe))
        out["no_ep"] = _error(lambda: build_dist_index(cfg, cpu, types.SimpleNamespace(dp_cp=dense, expt_dp=edp), moe))
        intra, inter = ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group()  # a 2 x 2 HSDP grid
        no_intra = types.SimpleNamespace(dp_cp=dense, intra_dp_cp=intra, inter_dist_opt=inter, ep=ep, expt_dp=edp)
        out["hsdp_no_intra_expt_dp"] = _error(lambda: build_dist_index(hsdp, cpu, no_intra, moe))
        dense_index = build_dist_index(cfg, cpu, types.SimpleNamespace(dp_cp=dense), moe)  # no ep: experts are dense
        out["dense_experts"] = dense_index.expt_device_mesh is dense_index.device_mesh
    return out


def test_refusals(pool4):
    for out in pool4.run(refusal_worker):
        ep_tp = out["ep_tp"]
        assert ep_tp.startswith("NotImplementedError") and "EP size 2" in ep_tp and "TP size 2" in ep_tp, out
        assert "would need" in ep_tp and "use expert_model_parallel_size=1" in ep_tp, out  # what, why, remedy
        assert out["no_expt_dp"].startswith("ValueError") and "['expt_dp']" in out["no_expt_dp"], out
        assert out["no_ep"].startswith("ValueError") and "pg_collection.ep is not set" in out["no_ep"], out
        no_intra = out["hsdp_no_intra_expt_dp"]
        assert no_intra.startswith("ValueError") and "intra_expt_dp" in no_intra, out
        assert out["dense_experts"], out
