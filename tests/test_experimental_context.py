"""megatron_fsdp.experimental: the behaviour upstream's mfsdp_v2 tests pin down for
contexts, profiler annotations and communication overlap, in our terms:

* contexts: modules built in one ``fully_shard_context`` share it from the moment
  they are sharded; roots follow construction order; nested modules follow a
  depth-first order (backward: children in reverse); a context does not nest, a
  model runs only after it exits, and a parent cannot join a context other than its
  sharded children's;
* annotations: each module's forward and backward is one profiler range, nested as
  the modules are, balanced for frozen modules, absent where no gradient flows;
* overlap: per optimizer step with two microbatches, ZeRO-1 gathers once and
  reduce-scatters once per module, ZeRO-2 reduce-scatters per microbatch, ZeRO-3
  gathers per forward and backward; and each module's gather is in flight before
  the module computes (prefetch), which is what lets it overlap compute on a GPU.

Every distributed test runs at world sizes 2 and 4 (gloo, shared pool).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from megatron_fsdp import record_collectives
from megatron_fsdp.experimental import (
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)

ZERO3 = Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)])
ZERO2 = Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Shard(0)], optimizer=[Shard(0)])
ZERO1 = Placements(dp_axes=[0], parameter=[Replicate()], gradient=[Partial("avg")], optimizer=[Shard(0)])


class BiasThenLayers(nn.Module):
    """A root-owned bias used first, then ``n`` linear children."""

    def __init__(self, dim: int = 4, n: int = 2) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.ones(dim))
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.bias
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class LayersThenBias(BiasThenLayers):
    """The first layer takes the input directly (no gradient reaches it if frozen)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.layers[0](x))
        return torch.relu(self.layers[1](x + self.bias))


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(self.proj(x))


class LeftRight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))
        self.left = Inner()
        self.right = nn.Linear(4, 4)

    def forward(self, x):
        return self.right(self.left(x + self.bias))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.embed(tokens)).sum()


def _mesh(world):
    return init_device_mesh("cpu", (world,))


# -- contexts ----------------------------------------------------------------------------------
def context_worker(rank, world):
    mesh = _mesh(world)
    out = {}
    model = LeftRight()
    with fully_shard_context() as context:
        fully_shard(model.left.inner, mesh=mesh, placements=ZERO3)
        fully_shard(model.left, mesh=mesh, placements=ZERO3)
        out["eager_context"] = model.left.context is context and model.left.inner.context is context
        fully_shard(model.right, mesh=mesh, placements=ZERO3)
        fully_shard(model, mesh=mesh, placements=ZERO3)
    names = lambda order: [m.name for m in order]  # noqa: E731
    out["nested_forward"] = names(context.forward_order)
    out["nested_backward"] = names(context.backward_order)
    out["roots"] = [m.name for m in context.forward_order if m.is_root()]

    siblings = LeftRight()
    with fully_shard_context() as context:
        fully_shard(siblings.left.inner, mesh=mesh, placements=ZERO3)
        fully_shard(siblings.left, mesh=mesh, placements=ZERO3)
        fully_shard(siblings.right, mesh=mesh, placements=ZERO3)
    order = {id(siblings.left): "left", id(siblings.left.inner): "left.inner", id(siblings.right): "right"}
    out["sibling_forward"] = [order[id(m)] for m in context.forward_order]
    out["sibling_backward"] = [order[id(m)] for m in context.backward_order]
    out["sibling_roots"] = [siblings.left.is_root(), siblings.right.is_root(), siblings.left.inner.is_root()]
    siblings(torch.ones(2, 4)).sum().backward()  # runs with two roots

    def nest():
        with fully_shard_context():
            with fully_shard_context():
                pass

    def run_inside():
        layer = nn.Linear(4, 4)
        with fully_shard_context():
            fully_shard(layer, mesh=mesh, placements=ZERO3)
            layer(torch.ones(1, 4))

    def other_context():
        nested = Inner()
        with fully_shard_context():
            fully_shard(nested.inner, mesh=mesh, placements=ZERO3)
        with fully_shard_context():
            fully_shard(nested, mesh=mesh, placements=ZERO3)

    for key, fn in {"nest": nest, "run_inside": run_inside, "other_context": other_context}.items():
        try:
            fn()
            out[key] = None
        except (RuntimeError, ValueError) as e:
            out[key] = f"{type(e).__name__}: {e}"
    return out


def test_context_membership_orders_and_misuse(pool):
    for out in pool.run(context_worker):
        assert out["eager_context"]
        assert out["nested_forward"] == ["<root>", "left", "left.inner", "right"]
        assert out["nested_backward"] == ["<root>", "right", "left", "left.inner"]
        assert out["roots"] == ["<root>"]
        # Two roots: construction order forward, its reverse in backward.
        assert out["sibling_forward"] == ["left", "left.inner", "right"]
        assert out["sibling_backward"] == ["right", "left", "left.inner"]
        assert out["sibling_roots"] == [True, True, False]
        assert out["nest"].startswith("RuntimeError") and "does not nest" in out["nest"]
        assert out["run_inside"].startswith("RuntimeError") and "after leaving" in out["run_inside"]
        assert out["other_context"].startswith("ValueError") and "another fully_shard_context" in out["other_context"]


# -- annotations -------------------------------------------------------------------------------
def _record_ranges(events: list):
    """Replace the module's range functions with a recorder (in this worker only)."""
    from megatron_fsdp.experimental import module as runtime

    def push(label):
        events.append(("push", label))
        return label

    def pop(label):
        events.append(("pop", label))

    saved = runtime._range_push, runtime._range_pop
    runtime._range_push, runtime._range_pop = push, pop
    return lambda: setattr(runtime, "_range_push", saved[0]) or setattr(runtime, "_range_pop", saved[1])


def _shard_layers(model: nn.Module, mesh, *, root: bool) -> nn.Module:
    """ZeRO-3 on each of ``model.layers`` (and on ``model`` itself when ``root``), in one context."""
    with fully_shard_context():
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, placements=ZERO3)
        if root:
            fully_shard(model, mesh=mesh, placements=ZERO3)
    return model


def annotation_worker(rank, world, *, case):
    mesh = _mesh(world)
    events: list = []
    restore = _record_ranges(events)
    try:
        if case == "nested":
            model = _shard_layers(BiasThenLayers(), mesh, root=True)
            model(torch.ones(2, 4)).sum().backward()
        elif case == "sibling_roots":
            model = _shard_layers(BiasThenLayers(), mesh, root=False)
            model(torch.ones(2, 4)).sum().backward()
        elif case == "frozen":
            model = nn.Linear(4, 4, bias=False).requires_grad_(False)
            with fully_shard_context():
                fully_shard(model, mesh=mesh, placements=ZERO3)
            model(torch.ones(2, 4, requires_grad=True)).sum().backward()
        elif case == "frozen_child_without_grad":
            model = LayersThenBias()
            model.layers[0].requires_grad_(False)
            model = _shard_layers(model, mesh, root=True)
            model(torch.ones(2, 4)).sum().backward()
        elif case == "tied_two_steps":
            model = TiedLM()
            with fully_shard_context():
                fully_shard(model, mesh=mesh, placements=ZERO3)
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                model(torch.arange(8).reshape(2, 4)).backward()
    finally:
        restore()
    return [(kind, label.removeprefix("megatron_fsdp::")) for kind, label in events]


def _ranges(*spans):
    """("forward", "<root>", [...inner spans...]) -> the push/pop sequence."""
    out = []
    for phase, name, inner in spans:
        out.append(("push", f"{phase}:{name}"))
        out.extend(_ranges(*inner))
        out.append(("pop", f"{phase}:{name}"))
    return out


ANNOTATIONS = {
    "nested": _ranges(
        ("forward", "<root>", [("forward", "layers.0", []), ("forward", "layers.1", [])]),
        ("backward", "<root>", [("backward", "layers.1", []), ("backward", "layers.0", [])]),
    ),
    "sibling_roots": _ranges(
        ("forward", "<root>", []), ("forward", "<root>", []), ("backward", "<root>", []), ("backward", "<root>", [])
    ),
    "frozen": _ranges(("forward", "<root>", []), ("backward", "<root>", [])),
    "frozen_child_without_grad": _ranges(
        ("forward", "<root>", [("forward", "layers.0", []), ("forward", "layers.1", [])]),
        ("backward", "<root>", [("backward", "layers.1", [])]),
    ),
    "tied_two_steps": _ranges(("forward", "<root>", []), ("backward", "<root>", [])) * 2,
}


@pytest.mark.parametrize("case", list(ANNOTATIONS))
def test_phase_ranges_nest_and_balance(pool, case):
    for events in pool.run(annotation_worker, case=case):
        assert events == ANNOTATIONS[case], events


def profiler_worker(rank, world):
    """The ranges reach torch.profiler with the collectives inside them."""
    model = BiasThenLayers()
    with fully_shard_context():
        for layer in model.layers:
            fully_shard(layer, mesh=_mesh(world), placements=ZERO3)
        fully_shard(model, mesh=_mesh(world), placements=ZERO3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.ones(2, 4)).sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("megatron_fsdp::")})


def test_phase_ranges_reach_the_profiler(pool2):
    names = pool2.run(profiler_worker)[0]
    for phase in ("forward", "backward"):
        for module in ("<root>", "layers.0", "layers.1"):
            assert f"megatron_fsdp::{phase}:{module}" in names, names
    assert "megatron_fsdp::all_gather:layers.0" in names, names


# -- overlap -----------------------------------------------------------------------------------
def overlap_worker(rank, world, *, zero):
    """Sibling-root children (the root's bias stays unsharded), two microbatches per
    step; collective counts of the second step, and what is in flight when each
    child starts computing."""
    n = 4
    placements = {1: ZERO1, 2: ZERO2, 3: ZERO3}[zero]
    torch.manual_seed(0)
    model = BiasThenLayers(dim=8, n=n)
    with fully_shard_context() as context:
        for layer in model.layers:
            fully_shard(layer, mesh=_mesh(world), placements=placements)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    fully_shard_optimizer(optimizer)
    x = torch.randn(4, 8, requires_grad=True)
    in_flight: list = []
    for layer in model.layers:
        layer.register_forward_pre_hook(
            lambda m, _a: in_flight.append((m.name, [o.name for o in context.forward_order if o._in_flight])) and None
        )

    def step():
        optimizer.zero_grad(set_to_none=True)
        for i in range(2):
            with microbatch(context, is_last=i == 1):
                model(x).sum().backward()
        optimizer.step()

    step()
    in_flight.clear()
    with record_collectives() as recorder:
        step()
    return {"counts": dict(recorder.counts), "in_flight": in_flight[:n], "names": [m.name for m in context.forward_order]}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_collective_counts_and_prefetch_per_zero_level(pool, zero):
    n = 4
    expected = {
        1: {"all_gather": n, "reduce_scatter": n},
        2: {"all_gather": n, "reduce_scatter": 2 * n},
        3: {"all_gather": 4 * n, "reduce_scatter": 2 * n},
    }[zero]
    for out in pool.run(overlap_worker, zero=zero):
        assert out["counts"] == expected, (zero, out["counts"])
        if zero == 3:
            # Sibling roots prefetch across roots: when a child starts computing, the
            # next child's gather is already in flight.
            for (name, flying), following in zip(out["in_flight"], out["in_flight"][1:]):
                assert following[0] in flying, (name, flying)
