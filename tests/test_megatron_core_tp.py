"""Megatron-core's tensor-parallel layers (``VocabParallelEmbedding``,
``ColumnParallelLinear``, ``RowParallelLinear``) with FSDP over the data-parallel
ranks, through ``FullyShardedDataParallel`` and ``fully_shard_model``: the mesh is
built from megatron-core's parallel state ([Note: the mesh of Megatron-core's groups]
in mcore_fsdp_adapter.py), and training equals one process training the same full
model on the global batch, with and without sequence parallelism, whichever way the
gradients are finished: ``finish_grad_sync()`` alone or megatron-core's
``finalize_model_grads`` (compat/megatron_core.py [Note: tensor-parallel partial
gradients]). Gradient norms agree three ways: torch's ``clip_grad_norm_`` on the
DTensor parameters, megatron-core's optimizer rule ([Note: Megatron-core's gradient
norm]) and the reference's.

Megatron-core's local-spec norms cannot run sequence-parallel here: ``FusedLayerNorm``
needs apex, and its torch fallback ``WrappedTorchNorm`` refuses ``sequence_parallel``.
So the model's norms are ``torch.nn.LayerNorm`` marked ``sequence_parallel`` as
``FusedLayerNorm`` marks its parameters. Everything else is megatron-core's own code
on CPU/gloo (its CUDA allocations bridged by tests/mcore_cpu_shim.py).

World 4 (DP 2 x TP 2) runs by default; world 8 (HSDP 2 x DP 2 x TP 2, DP 4 x TP 2)
with ``MFSDP_TP_LONG=1``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import types
from typing import Any

import pytest


pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import conftest  # noqa: E402
from grids import STRATEGY_ENDS, grid  # noqa: E402
import megatron_fsdp as mf  # noqa: E402
from mcore_cpu_shim import cpu_shim  # noqa: E402
from megatron_fsdp.compat import megatron_core as mcore  # noqa: E402
from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel, build_dist_index  # noqa: E402

LONG = os.environ.get("MFSDP_TP_LONG") == "1"
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TOL = 1e-5
VOCAB, HIDDEN, FFN, SEQ, DEPTH = 16, 8, 16, 8, 2  # SEQ divisible by TP (sequence parallelism splits it)


# -- the models ---------------------------------------------------------------------------------
def transformer_config(tp: int, sp: bool, **overrides):
    from megatron.core.transformer import TransformerConfig

    fields = dict(num_layers=DEPTH, hidden_size=HIDDEN, num_attention_heads=2, tensor_model_parallel_size=tp,
                  sequence_parallel=sp, use_cpu_initialization=True, gradient_accumulation_fusion=False)
    return TransformerConfig(**{**fields, **overrides})


def _norm(config) -> nn.LayerNorm:
    norm = nn.LayerNorm(HIDDEN)
    for p in norm.parameters():  # as megatron-core's FusedLayerNorm marks them
        p.sequence_parallel = config.sequence_parallel
    return norm


class TPBlock(nn.Module):
    """Pre-norm MLP block: column-parallel up, row-parallel down ([s, b, h] layout)."""

    def __init__(self, config) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.norm = _norm(config)
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=nn.init.zeros_, bias=True,
                                        gather_output=False)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, config=config, init_method=nn.init.zeros_, bias=True,
                                     input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(self.norm(x))
        y, _ = self.fc2(F.gelu(h))
        return x + y


class TPNet(nn.Module):
    """Tokens [b, s] -> logits [b, s, vocab]. Under sequence parallelism the
    activations between layers are [s / tp, b, h]; the head gathers the sequence and
    its output's vocabulary pieces."""

    def __init__(self, config) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

        super().__init__()
        self.config = config  # megatron-core's get_model_config finds it here
        self.embedding = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=nn.init.zeros_, config=config,
                                                reduce_scatter_embeddings=config.sequence_parallel)
        self.blocks = nn.ModuleList(TPBlock(config) for _ in range(DEPTH))
        self.norm = _norm(config)
        self.head = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=nn.init.zeros_, bias=False,
                                         gather_output=True)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Megatron-core's distributed-checkpoint description, layer by layer (as its
        ``MegatronModule`` does for its children)."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        subs = [("embedding", self.embedding), ("norm", self.norm), ("head", self.head)]
        subs += [(f"blocks.{i}.{n}", m) for i, block in enumerate(self.blocks) for n, m in block.named_children()]
        out = {}
        for name, sub in subs:
            out.update(sharded_state_dict_default(sub, f"{prefix}{name}.", sharded_offsets, metadata))
        return out

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        if not self.config.sequence_parallel:
            x = x.transpose(0, 1)  # [b, s, h] -> [s, b, h]
        for block in self.blocks:
            x = block(x)
        logits, _ = self.head(self.norm(x))
        return logits.transpose(0, 1)


class RefBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class RefNet(nn.Module):
    """The same model in one process (same parameter names, whole tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(RefBlock() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def reference() -> RefNet:
    torch.manual_seed(0)
    ref = RefNet()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:  # not the default ones and zeros
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.1, 0.1)
    return ref


@torch.no_grad()
def tp_model_from(ref: RefNet, config) -> TPNet:
    """Megatron-core's layers holding this TP rank's pieces of ``ref``'s weights."""
    from megatron.core import parallel_state as ps

    model, full = TPNet(config), dict(ref.named_parameters())
    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for name, p in model.named_parameters():
        value = full[name]
        if getattr(p, "tensor_model_parallel", False):
            value = value.chunk(size, dim=p.partition_dim)[rank]
        p.copy_(value)
    return model


# -- megatron-core's parallel state -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Parallel:
    """Megatron-core's parallel state, and for HSDP the groups handed to the wrappers
    (megatron-core builds its own only with einops, which its --no-deps install lacks)."""

    ps: Any
    instances: int = 1
    pg_collection: Any = None
    instance_group: Any = None
    """The ranks of one distributed optimizer instance (megatron-core's grad-stats group)."""

    @property
    def dp_rank(self) -> int:
        return self.ps.get_data_parallel_rank(with_context_parallel=True)

    @property
    def dp_size(self) -> int:
        return self.ps.get_data_parallel_world_size(with_context_parallel=True)


def _hsdp(ps, instances: int) -> Parallel:
    """Megatron-core's HSDP layout over its data-parallel groups: ``instances`` replicas of
    shard groups of consecutive data-parallel ranks. Every rank creates every group, in one order."""
    tp, world = ps.get_tensor_model_parallel_world_size(), dist.get_world_size()
    columns = [list(range(t, world, tp)) for t in range(tp)]  # each TP rank's data-parallel ranks
    shard = len(columns[0]) // instances
    intra = [dist.new_group(c[i * shard:(i + 1) * shard]) for c in columns for i in range(instances)]
    inter = [dist.new_group(c[j::shard]) for c in columns for j in range(shard)]
    per_instance = world // instances
    whole = [dist.new_group(list(range(i * per_instance, (i + 1) * per_instance))) for i in range(instances)]
    me = dist.get_rank()
    mine = [g for g in intra + inter if me in dist.get_process_group_ranks(g)]
    collection = types.SimpleNamespace(
        tp=ps.get_tensor_model_parallel_group(), intra_dp_cp=mine[0], inter_dist_opt=mine[1],
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
    )
    return Parallel(ps, instances, collection, whole[me // per_instance])


_STATES: dict[tuple, tuple[dict, Parallel]] = {}
"""(tp, ep, instances) -> megatron-core's parallel-state globals right after initializing
them, and the HSDP groups: each pooled worker creates every group once ([Note: pooled
parallel state])."""


@contextlib.contextmanager
def megatron_parallel_state(tp: int, instances: int = 1, ep: int = 1):
    """[Note: pooled parallel state] Megatron-core's groups for TP ``tp`` (EP ``ep``; HSDP
    over ``instances``) and the CPU shim, torn down afterwards so that later tests in the
    pooled worker find no state (they initialize their own). ``destroy_model_parallel``
    forgets the groups but leaves them open (about 90 sockets per rank at world 4), and
    closing them would break torch's cache of sliced device meshes, which hands an equal
    mesh's old sub-meshes to a new one; so the groups made for these tests are made once
    per worker and their globals put back for every test."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    key = (tp, ep, instances)
    if key in _STATES:
        saved, par = _STATES[key]
        vars(ps).update(saved)
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     create_gloo_process_groups=False)
        saved = {k: v for k, v in vars(ps).items() if k.startswith("_") and k[1:2].isupper()}
        par = _hsdp(ps, instances) if instances > 1 else Parallel(ps)
        _STATES[key] = saved, par
    try:
        with cpu_shim():
            yield par
    finally:
        ps.destroy_model_parallel()


# -- one training run ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    entry: str = "adapter"  # FullyShardedDataParallel, or fully_shard_model
    strategy: str = "optim_grads_params"
    opt: str = "sgd"
    sp: bool = False
    clip: float = 0.0
    sync: str = "finish"  # finish_grad_sync() alone, or megatron-core's finalize_model_grads
    outer: str = "no_shard"  # HSDP's outer strategy (world 8)


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)


def _wrap(case: Case, model: TPNet, par: Parallel):
    cfg = mf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=case.strategy, num_distributed_optimizer_instances=par.instances,
        outer_dp_sharding_strategy=case.outer,
    )
    if case.entry == "adapter":
        return FullyShardedDataParallel(model.config, cfg, model, fsdp_unit_modules=[TPBlock],
                                        pg_collection=par.pg_collection)
    # The adapter's mesh from megatron-core's groups.
    index = build_dist_index(cfg, torch.device("cpu"), par.pg_collection)
    wrapped = mf.fully_shard_model(
        model, device_mesh=index.device_mesh, dp_shard_dim=index.dp_shard_dim, dp_outer_dim=index.dp_outer_dim,
        tp_dim=index.tp_dim, hybrid_fsdp_group=index.hybrid_fsdp_group, fsdp_unit_modules=[TPBlock],
        zero_dp_strategy=case.strategy, outer_dp_sharding_strategy=case.outer if par.instances > 1 else 0,
    )
    return wrapped  # partial TP gradients completed by the engine, as under the adapter


def megatron_rule_norm(model: nn.Module, par: Parallel, sharded: bool) -> float:
    """The gradient norm as megatron-core's optimizer computes it: its
    ``get_main_grads_for_grad_norm``, then ``get_grad_norm_fp32``'s sums (without
    its CUDA buffers) over the distributed optimizer instance, or the model-parallel
    group without the distributed optimizer."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    stub = types.SimpleNamespace(
        get_parameters=lambda: list(model.parameters()), tp_group=par.ps.get_tensor_model_parallel_group(),
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
    )
    grads = MegatronOptimizer.get_main_grads_for_grad_norm(stub)
    dp_group = None
    for grad in grads:
        dp_group = get_data_parallel_group_if_dtensor(grad, dp_group)
    total = torch.zeros(())
    for grad in grads:
        total += to_local_if_dtensor(grad).float().pow(2).sum()
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    stats = (par.instance_group or par.ps.get_intra_distributed_optimizer_instance_group()) if sharded else \
        par.ps.get_model_parallel_group()
    dist.all_reduce(total, group=stats)
    return total.sqrt().item()


def _step(case: Case, model, optimizer, tokens: torch.Tensor, par: Parallel, micro: int) -> tuple[float, float]:
    """Megatron-LM's step on this replica's share; returns (torch's norm, megatron-core's norm)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    adapter = case.entry == "adapter"
    if adapter:
        model.zero_grad_buffer()
    for i, chunk in enumerate(tokens.chunk(micro)):
        last = i == micro - 1
        with model.no_sync() if adapter and not last else contextlib.nullcontext():
            logits = model(chunk[:, :-1])
            (F.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1)) / micro).backward()
    if case.sync == "finalize":
        finalize_model_grads([model])
    else:
        model.finish_grad_sync()
    # Every entry point's parameters carry the mark megatron-core's optimizer reads ([Note:
    # Megatron-core's gradient norm]).
    mcore_norm = megatron_rule_norm(model, par, sharded=case.strategy != "no_shard")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip or math.inf)
    optimizer.step()
    optimizer.zero_grad()
    if adapter:
        model.install_optimized_model_weights()
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm), mcore_norm


def train_reference(ref: RefNet, data, case: Case, replicas: int, micro: int) -> list[float]:
    optimizer = make_optimizer(case.opt, ref.parameters())
    norms = []
    for tokens in data:
        chunks = tokens.chunk(replicas * micro)
        for chunk in chunks:
            (F.cross_entropy(ref(chunk[:, :-1]).reshape(-1, VOCAB), chunk[:, 1:].reshape(-1)) / len(chunks)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), case.clip or math.inf)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _compare(model, ref: RefNet, par: Parallel) -> dict:
    """Full weights against the reference; the state dict's DTensors, and for the adapter
    megatron-core's distributed-checkpoint pieces, against the full weights."""
    inner = model.module if isinstance(model, FullyShardedDataParallel) else model
    full = mf.get_full_state_dict(inner)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    sd_diff, meshes = 0.0, set()
    for key, value in model.state_dict().items():
        name = key.removeprefix("module.")
        if name in full:
            assert isinstance(value, DTensor), key
            meshes.add(tuple(value.device_mesh.mesh_dim_names))
            sd_diff = max(sd_diff, (value.full_tensor() - full[name]).abs().max().item())
    result = dict(diff=diff, sd_diff=sd_diff, meshes=sorted(meshes))
    if inner is not model:
        result["ckpt_diff"] = _checkpoint_diff(model, full, par)
    return result


def _checkpoint_diff(model: FullyShardedDataParallel, full: dict, par: Parallel) -> float:
    """Each ``ShardedTensor`` of ``sharded_state_dict()`` against its place in the full weights."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    metadata = {"dp_cp_group": par.ps.get_data_parallel_group(with_context_parallel=True)}
    pieces = {k: v for k, v in model.sharded_state_dict(metadata=metadata).items() if isinstance(v, ShardedTensor)}
    assert sorted(pieces) == sorted(full), sorted(pieces)
    diffs = []
    for key, piece in pieces.items():
        where = tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.data.shape))
        assert tuple(piece.global_shape) == tuple(full[key].shape), key
        diffs.append((full[key][where] - piece.data).abs().max().item())
    return max(diffs)


def run_case(case: Case, par: Parallel, *, steps: int = 3, micro: int = 2) -> dict:
    ref = reference()
    config = transformer_config(par.ps.get_tensor_model_parallel_world_size(), case.sp)
    model = _wrap(case, tp_model_from(ref, config), par)
    optimizer = make_optimizer(case.opt, model.parameters())
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (par.dp_size * micro * 2, SEQ + 1), generator=g) for _ in range(steps)]
    norms = [_step(case, model, optimizer, tokens.chunk(par.dp_size)[par.dp_rank], par, micro) for tokens in data]
    ref_norms = train_reference(ref, data, case, par.dp_size, micro)
    result = _compare(model, ref, par)
    result["norm_diff"] = max(abs(a - r) for (a, _), r in zip(norms, ref_norms))
    result["mcore_norm_diff"] = max(abs(m - r) for (_, m), r in zip(norms, ref_norms))
    return result


def parity_worker(rank, world, *, cases: list, tp: int = 2, instances: int = 1):
    with megatron_parallel_state(tp, instances) as par:
        return [run_case(case, par) for case in cases]


def _assert_exact(results, *, mcore_norm: bool = True) -> None:
    for per_rank in results:
        for r in per_rank:
            assert r["diff"] < TOL, r
            assert r["sd_diff"] < TOL, r
            assert r.get("ckpt_diff", 0.0) < TOL, r
            assert r["norm_diff"] < TOL, r
            if mcore_norm and not math.isnan(r["mcore_norm_diff"]):
                assert r["mcore_norm_diff"] < TOL, r
            assert r["meshes"] and all(m[-1] == "tp" for m in r["meshes"]), r  # over the dp dims and tp


# -- the rule, without processes ---------------------------------------------------------------
def test_partial_tp_grad_rule():
    """megatron-core's finalize_model_grads rule: AVG for averaged parameters (checked
    first), SUM for sequence-parallel ones under config.sequence_parallel and q/k
    layernorms under config.qk_layernorm."""
    model = nn.ModuleDict(dict(norm=nn.LayerNorm(4), q_layernorm=nn.LayerNorm(4), hf=nn.Linear(2, 2),
                               plain=nn.Linear(2, 2)))
    for p in model["norm"].parameters():
        p.sequence_parallel = True
    for p in model["hf"].parameters():
        p.average_gradients_across_tp_domain = True
        p.sequence_parallel = True
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    both = mcore.partial_tp_grad_ops(model, types.SimpleNamespace(sequence_parallel=True, qk_layernorm=True))
    assert both == {"norm.weight": SUM, "norm.bias": SUM, "q_layernorm.weight": SUM, "q_layernorm.bias": SUM,
                    "hf.weight": AVG, "hf.bias": AVG}
    neither = mcore.partial_tp_grad_ops(model, types.SimpleNamespace(sequence_parallel=False, qk_layernorm=False))
    assert neither == {"hf.weight": AVG, "hf.bias": AVG}


# -- world 4: DP 2 x TP 2 -----------------------------------------------------------------------
ADAPTER_CASES = [
    dict(opt="sgd", sp=False, sync="finish"),
    dict(opt="adamw", sp=True, sync="finish", clip=0.05),
    dict(opt="adamw", sp=True, sync="finalize"),
]


# The engine's TP tests (test_tensor_parallel.py) run every strategy; here the adapter at both ends.
@pytest.mark.parametrize("strategy", grid(STRATEGIES, STRATEGY_ENDS, "MFSDP_TP_LONG"))
def test_adapter_dp2_tp2_equals_one_process(pool4, strategy):
    cases = [Case(strategy=strategy, **c) for c in ADAPTER_CASES]
    _assert_exact(pool4.run(parity_worker, cases=cases))


@pytest.mark.parametrize("strategy", grid(STRATEGIES, STRATEGY_ENDS, "MFSDP_TP_LONG"))
def test_fully_shard_model_dp2_tp2_equals_one_process(pool4, strategy):
    cases = [Case(entry="fully_shard_model", strategy=strategy, opt="sgd", sp=True, sync="finalize", clip=0.05),
             Case(entry="fully_shard_model", strategy=strategy, opt="adamw", sp=True, sync="finish")]
    _assert_exact(pool4.run(parity_worker, cases=cases))


# -- world 8 ------------------------------------------------------------------------------------
@pytest.mark.skipif(not LONG, reason="world-8 layouts: MFSDP_TP_LONG=1")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("instances", [2, 1], ids=["hsdp-2x2x2", "dp4-tp2"])
def test_world8_layouts(strategy, instances):
    cases = [Case(strategy=strategy, opt="adamw", sp=True, sync="finalize", clip=0.05),
             Case(entry="fully_shard_model", strategy=strategy, opt="sgd", sp=True, sync="finish")]
    if instances > 1 and strategy == "optim_grads_params":  # HFSDP: the optimizer sharded over the outer group too
        cases.append(Case(strategy=strategy, opt="adamw", sp=True, sync="finish", outer="optim"))
    results = conftest.get_pool(8).run(parity_worker, cases=cases, instances=instances)
    # Megatron-core's norm sums over one optimizer instance: short under HFSDP ([Note: Megatron-core's
    # gradient norm]), so the HFSDP case checks torch's norm only.
    _assert_exact([r[:2] for r in results])
    _assert_exact([r[2:] for r in results], mcore_norm=False)


# -- refusals -----------------------------------------------------------------------------------
def _error(build) -> str:
    try:
        build()
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def refusal_worker(rank, world):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    cfg = mf.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    out = {}
    with megatron_parallel_state(tp=2) as par:
        ps = par.ps
        config = transformer_config(2, sp=False)
        strided = nn.Sequential(ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=nn.init.zeros_, stride=2))
        out["stride"] = _error(lambda: FullyShardedDataParallel(config, cfg, strided))
        unmarked_config = transformer_config(2, sp=False, perform_initialization=False)  # megatron-core marks nothing
        unmarked = nn.Sequential(ColumnParallelLinear(HIDDEN, FFN, config=unmarked_config, init_method=nn.init.zeros_))
        out["unmarked"] = _error(lambda: FullyShardedDataParallel(config, cfg, unmarked))
        # TP groups that do not cross the data-parallel groups: {0, 3} and {1, 2}.
        crossed = [dist.new_group(r) for r in ([0, 3], [1, 2])]
        groups = types.SimpleNamespace(dp_cp=ps.get_data_parallel_group(), tp=crossed[0 if rank in (0, 3) else 1])
        out["grid"] = _error(lambda: build_dist_index(cfg, torch.device("cpu"), groups))
    with megatron_parallel_state(tp=2, ep=2):
        moe = types.SimpleNamespace(num_moe_experts=4)  # all build_dist_index reads of a MoE config
        out["ep"] = _error(lambda: build_dist_index(cfg, torch.device("cpu"), config=moe))
    return out


def test_refusals(pool4):
    for out in pool4.run(refusal_worker):
        assert out["stride"].startswith("NotImplementedError") and "partition_stride=2" in out["stride"], out
        assert out["unmarked"].startswith("ValueError") and "perform_initialization" in out["unmarked"], out
        assert out["grid"].startswith("ValueError") and "grid" in out["grid"], out
        assert out["ep"].startswith("NotImplementedError") and "EP size 2" in out["ep"], out
