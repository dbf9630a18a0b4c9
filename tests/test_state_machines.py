"""The engine's state machines: each enum's legal transitions (pure, no process group),
and the states one wrapped model's step walks through (a world of one).

grad_reduce_pipeline.py [Note: the reduction lifecycle]; hooks.py [Note: several
forwards, one backward], [Note: higher-order gradients], [Note: compiled graphs and
unit hooks]."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import get_pool
from megatron_fsdp.enums import BackwardMode, GroupReduceState, MainGradState, StateTransitionError, TrainingState
from megatron_fsdp.runtime.grad_reduce_pipeline import _GroupGradState

R, M, B = GroupReduceState, MainGradState, BackwardMode

# The specification, written out: every pair not listed must be refused.
LEGAL = {
    GroupReduceState: {
        (R.IDLE, R.REQUESTED), (R.IDLE, R.LAUNCHED),
        (R.REQUESTED, R.LAUNCHED), (R.REQUESTED, R.IDLE),
        (R.LAUNCHED, R.IDLE),
    },
    MainGradState: {
        (M.ACCUMULATING, M.REDUCED), (M.ACCUMULATING, M.OUTER_REDUCED),
        (M.REDUCED, M.OUTER_REDUCED), (M.REDUCED, M.ACCUMULATING),
        (M.OUTER_REDUCED, M.ACCUMULATING),
    },
    BackwardMode: {
        (B.IDLE, B.OVERLAPPED), (B.IDLE, B.SEVERAL_FORWARDS), (B.IDLE, B.CREATE_GRAPH),
        (B.GRAPH_RETAINED, B.CREATE_GRAPH), (B.GRAPH_RETAINED, B.AFTER_CREATE_GRAPH),
        (B.OVERLAPPED, B.IDLE), (B.SEVERAL_FORWARDS, B.IDLE), (B.AFTER_CREATE_GRAPH, B.IDLE),
        (B.CREATE_GRAPH, B.GRAPH_RETAINED),
    },
}


# -- pure: the transition checks ------------------------------------------------------------
@pytest.mark.parametrize("machine", list(LEGAL), ids=lambda m: m.__name__)
def test_every_legal_transition_is_accepted(machine):
    for old, new in LEGAL[machine]:
        assert old.check_transition(new, owner="test") is new


@pytest.mark.parametrize("machine", list(LEGAL), ids=lambda m: m.__name__)
def test_every_other_transition_is_refused(machine):
    for old, new in itertools.product(machine, repeat=2):
        if (old, new) in LEGAL[machine]:
            continue
        with pytest.raises(StateTransitionError) as info:
            old.check_transition(new, owner="parameter group unit0/float32/g2")
        message = str(info.value)
        assert "internal error" in message and "unit0/float32/g2" in message, message
        assert f"{old.name} -> {new.name}" in message, message


def test_group_state_moves_are_checked():
    """``_GroupGradState.move`` is the one door for both machines: a move to the current
    state changes nothing, an illegal one raises naming the group and both states."""
    state = _GroupGradState(label="unit1/bfloat16/g3", used=torch.zeros(2, dtype=torch.int32))
    state.move(R.IDLE)  # no transition
    state.move(R.REQUESTED)
    state.move(R.REQUESTED)
    state.move(R.LAUNCHED)
    state.move(M.REDUCED)
    state.move(M.OUTER_REDUCED)
    assert (state.reduce, state.main_grads) == (R.LAUNCHED, M.OUTER_REDUCED)
    with pytest.raises(StateTransitionError, match=r"unit1/bfloat16/g3.*LAUNCHED -> REQUESTED"):
        state.move(R.REQUESTED)
    with pytest.raises(StateTransitionError, match=r"unit1/bfloat16/g3.*OUTER_REDUCED -> REDUCED"):
        state.move(M.REDUCED)
    assert (state.reduce, state.main_grads) == (R.LAUNCHED, M.OUTER_REDUCED)  # a refused move leaves it


def test_backward_mode_properties():
    """Between passes nothing is released or reduced at the end; only the create_graph
    modes (and the pause between them) keep a graph that reads the weights."""
    assert {m for m in B if not m.in_backward} == {B.IDLE, B.GRAPH_RETAINED}
    assert all(m.in_backward for m in B if m.reduces_at_end)
    assert {m for m in B if m.graph_reads_weights} == {B.GRAPH_RETAINED, B.CREATE_GRAPH, B.AFTER_CREATE_GRAPH}
    assert {s for s in TrainingState if s.in_backward} == {TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD}


# -- end to end: what one step walks through ---------------------------------------------------
def walk_worker(rank, world, *, strategy, penalty):
    """Two steps of the "net" model; the second one's transitions, recorded at the two
    doors (``_GroupGradState.move``, ``HookRuntime._enter``), and the unit states each
    time the backward walk hands passed units over."""
    import megatron_fsdp as mf
    from megatron_fsdp.runtime import grad_reduce_pipeline as grp, hooks
    from models import Block, loss_fn, make_batches, make_model, make_optimizer, train_steps

    moves, modes, units = [], [], []
    real_move, real_enter, real_pass = grp._GroupGradState.move, hooks.HookRuntime._enter, hooks.HookRuntime._request_passed_units

    def move(self, new):
        old = self.reduce if isinstance(new, GroupReduceState) else self.main_grads
        real_move(self, new)
        if old is not new:
            moves.append((self.label, old, new))

    def enter(self, mode):
        modes.append((self._mode, mode))
        real_enter(self, mode)

    def passed(self, current=None):
        real_pass(self, current)
        units.append([u.state for u in self.units])

    grp._GroupGradState.move, hooks.HookRuntime._enter, hooks.HookRuntime._request_passed_units = move, enter, passed
    try:
        model, opt = mf.fully_shard(make_model("net"), make_optimizer("sgd"), fsdp_unit_modules=[Block],
                                    zero_dp_strategy=strategy)
        batches = make_batches("net", 2, batch=4)
        train_steps(model, opt, batches[:1], rank, world)  # the first step fixes the unit order
        moves.clear(), modes.clear(), units.clear()
        x, y = batches[1]
        opt.zero_grad()
        if penalty:  # hooks.py [Note: higher-order gradients]
            x = x.clone().requires_grad_(True)
            out = model(x)
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (loss_fn("net", out, y) + 0.1 * gx.pow(2).mean()).backward()
        else:
            loss_fn("net", model(x), y).backward()
        opt.step()
        order = [g.label for g in model.grad_reduce_pipeline.groups]
        return moves, modes, units, order
    finally:
        grp._GroupGradState.move, hooks.HookRuntime._enter, hooks.HookRuntime._request_passed_units = (
            real_move, real_enter, real_pass)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_a_step_walks_the_reduction_states(strategy):
    """Every group goes IDLE -> REQUESTED -> LAUNCHED -> IDLE once, launched in the fixed
    order; ZeRO-1's main gradients are rebased to ACCUMULATING by the zeroing and become
    REDUCED as each reduction finishes (ZeRO-3's shards need neither: no outer group);
    every unit ends the walk POST_BACKWARD; the backward runs OVERLAPPED."""
    ((moves, modes, units, order),) = get_pool(1).run(walk_worker, strategy=strategy, penalty=False)
    for label in order:
        walk = [(old, new) for g, old, new in moves if g == label and isinstance(new, GroupReduceState)]
        assert walk == [(R.IDLE, R.REQUESTED), (R.REQUESTED, R.LAUNCHED), (R.LAUNCHED, R.IDLE)], (label, walk)
        grads = [(old, new) for g, old, new in moves if g == label and isinstance(new, MainGradState)]
        expected = [(M.REDUCED, M.ACCUMULATING), (M.ACCUMULATING, M.REDUCED)] if strategy == "optim" else []
        assert grads == expected, (label, grads)
    assert [g for g, _, new in moves if new is R.LAUNCHED] == order
    assert units and all(state is TrainingState.POST_BACKWARD for state in units[-1]), units
    assert modes == [(B.IDLE, B.OVERLAPPED), (B.OVERLAPPED, B.IDLE)]


def test_a_create_graph_step_walks_the_backward_modes():
    """ZeRO-3 with a gradient penalty: the create_graph backward, the pause that keeps
    the weights for the graph it built, and the backward through that graph. Two ranks:
    in a world of one no weight is ever released, and every backward runs OVERLAPPED."""
    for moves, modes, _, order in get_pool(2).run(walk_worker, strategy="optim_grads_params", penalty=True):
        _check_create_graph_walk(moves, modes, order)


def _check_create_graph_walk(moves, modes, order):
    assert modes == [(B.IDLE, B.CREATE_GRAPH), (B.CREATE_GRAPH, B.GRAPH_RETAINED),
                     (B.GRAPH_RETAINED, B.AFTER_CREATE_GRAPH), (B.AFTER_CREATE_GRAPH, B.IDLE)]
    for label in order:  # one reduction per backward pass
        assert [new for g, _, new in moves if g == label and new is R.LAUNCHED] == [R.LAUNCHED] * 2, label


# -- the process-wide dynamo setting -------------------------------------------------------
_GUARD_SCRIPT = textwrap.dedent("""
    import logging
    import torch._dynamo.config as config
    config.skip_nnmodule_hook_guards = True
    import megatron_fsdp, megatron_fsdp.megatron_fsdp, megatron_fsdp.experimental.fully_shard
    from megatron_fsdp.runtime.hooks import guard_hooks_under_compile
    assert config.skip_nnmodule_hook_guards is True, "changed at import"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_fsdp.runtime.hooks").addHandler(handler)
    logging.getLogger("megatron_fsdp.runtime.hooks").setLevel(logging.INFO)
    guard_hooks_under_compile()  # what the first wrap does
    assert config.skip_nnmodule_hook_guards is False, "not turned on by the first wrap"
    assert len(records) == 1 and "skip_nnmodule_hook_guards" in records[0].getMessage(), records
    config.skip_nnmodule_hook_guards = True  # the process's own later choice
    guard_hooks_under_compile()  # a later wrap
    assert config.skip_nnmodule_hook_guards is True and len(records) == 1, "changed again"
    print("ok")
""")


def test_hook_guards_turn_on_once_per_process_and_never_at_import():
    """hooks.py [Note: compiled graphs and unit hooks], in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", _GUARD_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
