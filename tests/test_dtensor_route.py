"""[Note: DTensor subclass routes] (dtensor_dispatch.py): which route a torch takes, and
the PieceDTensor / FlatDTensor guards through the torch 2.10/2.11 route, forced here
on the installed torch (the GPU image runs torch 2.11, where it is the only route)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fsdp.buffers import dtensor_dispatch as dtensor_route
from megatron_fsdp.buffers.dtensor_dispatch import DispatchRoute, route_for

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "version, route",
    [("2.6.0", DispatchRoute.TORCH_DISPATCH), ("2.9.1+cu128", DispatchRoute.TORCH_DISPATCH),
     ("2.10.0", DispatchRoute.TORCH_FUNCTION), ("2.11.0+cu130", DispatchRoute.TORCH_FUNCTION),
     ("2.12.0", DispatchRoute.TORCH_DISPATCH), ("2.13.0+cpu", DispatchRoute.TORCH_DISPATCH),
     ("2.14.0.dev20261101", DispatchRoute.TORCH_DISPATCH)],
)
def test_route_follows_the_torch_version(version, route):
    assert route_for(version) is route


def test_route_override():
    assert route_for("2.13.0", "torch_function") is DispatchRoute.TORCH_FUNCTION
    assert route_for("2.11.0", "torch_dispatch") is DispatchRoute.TORCH_DISPATCH
    with pytest.raises(ValueError, match="MFSDP_DTENSOR_ROUTE='dispatch': expected one of torch_dispatch, torch_function"):
        route_for("2.13.0", "dispatch")


# The DTensor APIs on both engines' parameters (exact or refused) and GradScaler's
# foreach unscale while training on every strategy and API.
_ROUTED_TESTS = [
    "tests/test_experimental_dtensor.py",
    "tests/test_registered_params.py::test_dtensor_apis_on_parameters_are_exact_or_refused",
    "tests/test_patterns_amp.py::test_grad_scaler_skips_the_step_on_every_rank",
    "tests/test_post_wrap_init.py",
]


@pytest.mark.skipif(dtensor_route.ROUTE is DispatchRoute.TORCH_FUNCTION,
                    reason="this torch takes the torch_function route already: the whole suite runs through it")
def test_guards_through_the_torch_function_route():
    env = dict(os.environ, MFSDP_DTENSOR_ROUTE="torch_function", OMP_NUM_THREADS="1")
    # World 2 only: a second pool of 4 ranks would double the start-up this test pays for.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not world4",
                           *_ROUTED_TESTS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-500:]


def unrouted_worker(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megatron_fsdp.buffers.piece_dtensor import PieceDTensor, piece_dtensor

    mesh = init_device_mesh("cpu", (world,))
    local = torch.zeros(4)
    piece_dtensor(local, mesh, [Shard(0)], shape=torch.Size([4 * world]), stride=(1,))  # the route works here
    plain = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    class Unrouted(DTensor):  # a DTensor subclass with no guard: its alias comes back as a plain DTensor
        pass

    try:
        dtensor_route.verify(Unrouted(plain._local_tensor, plain._spec, requires_grad=False), Unrouted)
    except RuntimeError as exc:
        return str(exc), PieceDTensor in dtensor_route._verified
    return None, PieceDTensor in dtensor_route._verified


def test_a_subclass_whose_ops_skip_the_route_is_refused(pool2):
    """A torch that bypassed the route chosen for its version would run every op
    unguarded: the first instance's alias tells, at wrap time."""
    for message, piece_verified in pool2.run(unrouted_worker):
        assert message is not None and "does not route Unrouted's ops through" in message, message
        assert "MFSDP_DTENSOR_ROUTE=torch_function" in message and piece_verified
