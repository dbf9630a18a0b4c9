"""``ParallelDims`` (megatron_fsdp/parallel_dims.py) lays out data, tensor, context and
expert ranks as Megatron-LM's ``parallel_state`` does ([Note: rank order]): for each
layout, the groups along every mesh dimension equal megatron-core's ``RankGenerator``
groups (dense ``tp-cp-ep-dp-pp``, experts ``tp-ep-dp-pp`` with expert TP 1), and with HSDP
the outer blocks are megatron-core's partial data-parallel groups. The meshes are built
on torch's fake process group in a subprocess (the fake group must not meet the test
pools); refusals are plain arithmetic.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_fsdp.parallel_dims import SHARD_CP_DIM, ParallelDims

LAYOUTS = [dict(world=16, tp=2), dict(world=16, tp=2, outer=2), dict(world=16, cp=2), dict(world=16, cp=4, tp=2),
           dict(world=16, cp=2, tp=2, outer=2), dict(world=16, ep=4), dict(world=16, ep=2, cp=2, outer=2),
           dict(world=8, ep=8), dict(world=16, cp=2, ep=8)]

_BUILD = r"""
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from megatron_fsdp.parallel_dims import ParallelDims

def groups(mesh, dims):
    # The rank groups along ``dims`` (adjacent, in order) of a root mesh's whole grid.
    names = list(mesh.mesh_dim_names)
    grid = mesh.mesh
    first, last = names.index(dims[0]), names.index(dims[-1])
    moved = grid.movedim(tuple(range(first, last + 1)), tuple(range(grid.ndim - (last - first + 1), grid.ndim)))
    size = 1
    for name in dims:
        size *= grid.shape[names.index(name)]
    return sorted(moved.reshape(-1, size).tolist())

out = []
for kw in json.loads(sys.argv[1]):
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=kw["world"])
    dims = ParallelDims(**kw)
    mesh = dims.build_mesh("cpu")
    experts = dims.build_expert_mesh("cpu") if dims.tp == 1 else None  # MoE is refused with TP
    found = {"tp": groups(mesh, ["tp"]), "cp": groups(mesh, ["cp"]) if dims.cp > 1 else None,
             "dp": groups(mesh, [n for n in ("dp_outer", "dp_shard") if n in mesh.mesh_dim_names]),
             "dp_cp": groups(mesh, [n for n in ("dp_outer", "dp_shard", "cp") if n in mesh.mesh_dim_names]),
             "shard": groups(mesh, ["dp_shard", "cp"] if dims.cp > 1 else ["dp_shard"])} if mesh is not None else {}
    if experts is not None:
        found["ep"] = groups(experts, ["ep"])
        found["edp"] = groups(experts, [n for n in experts.mesh_dim_names if n != "ep"])
        found["edp_shard"] = groups(experts, [dims.shard_dim])
    found["shard_group"] = (dist.get_process_group_ranks(mesh[dims.shard_dim].get_group())
                            if mesh is not None else None)
    out.append(found)
    dist.destroy_process_group()
print(json.dumps(out))
"""


def _megatron_groups(kw: dict) -> dict:
    """megatron-core's groups for the layout (parallel_state's generators and partial groups)."""
    from megatron.core.parallel_state import RankGenerator

    world, tp, cp, ep, outer = kw["world"], kw.get("tp", 1), kw.get("cp", 1), kw.get("ep", 1), kw.get("outer", 1)
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp), pp=1, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=1, ep=ep, dp=world // ep, pp=1, cp=1, order="tp-cp-ep-dp-pp")

    def partial(groups: list[list[int]]) -> list[list[int]]:  # the intra-instance blocks
        return sorted(g[i * len(g) // outer:(i + 1) * len(g) // outer] for g in groups for i in range(outer))

    return {"tp": sorted(dense.get_ranks("tp")), "cp": sorted(dense.get_ranks("cp")) if cp > 1 else None,
            "dp": sorted(dense.get_ranks("dp")), "dp_cp": sorted(dense.get_ranks("dp-cp")),
            "shard": partial(dense.get_ranks("dp-cp")), "ep": sorted(expert.get_ranks("ep")),
            "edp": sorted(expert.get_ranks("dp")), "edp_shard": partial(expert.get_ranks("dp"))}


def test_meshes_hold_megatron_lm_groups():
    proc = subprocess.run([sys.executable, "-c", _BUILD, json.dumps(LAYOUTS)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    for kw, found in zip(LAYOUTS, built):
        expected = _megatron_groups(kw)
        for key in ("ep", "edp", "edp_shard") if kw.get("tp", 1) == 1 else ():
            assert found[key] == expected[key], (kw, key, found[key], expected[key])
        if kw.get("tp", 1) == 1 and kw.get("cp", 1) == 1 and kw.get("outer", 1) == 1:
            assert found["shard_group"] is None  # the engine's default group: every rank
            continue
        for key in ("tp", "cp", "dp", "dp_cp", "shard"):
            assert found[key] == expected[key], (kw, key, found[key], expected[key])
        assert found["shard_group"] in expected["shard"]  # rank 0's shard group is one of them


def test_sizes_and_ranks():
    dims = ParallelDims(world=16, tp=2, cp=2, outer=2)
    assert (dims.dp, dims.dp_shard, dims.shard_dim) == (4, 2, SHARD_CP_DIM)
    assert [dims.data_parallel_rank(r) for r in (0, 3, 4, 15)] == [0, 0, 1, 3]
    assert [dims.context_parallel_rank(r) for r in (0, 1, 2, 3, 4)] == [0, 0, 1, 1, 0]
    experts = ParallelDims(world=8, ep=4, cp=2)
    assert (experts.dp, experts.edp) == (4, 2)
    assert [experts.expert_parallel_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert ParallelDims(world=4).shard_dim == "fsdp" and ParallelDims(world=4, tp=2).shard_dim == "dp_shard"


@pytest.mark.parametrize("kw, match", [
    (dict(world=8, tp=3), "does not divide the world size 8"),
    (dict(world=8, cp=3), "does not divide the world size 8"),
    (dict(world=8, outer=3), "optimizer instances do not divide the data-parallel size 8"),
    (dict(world=8, ep=3), "expert-model-parallel size 3 does not divide"),
    (dict(world=8, ep=2, tp=2), "not supported together with tensor parallelism"),
    (dict(world=8, ep=8, outer=2), "do not divide the expert data-parallel size 1"),
    (dict(world=8, cp=0), "cp=0 must be a positive integer"),
])
def test_refused_layouts(kw, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kw)
