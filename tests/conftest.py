import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Scripts the tests launch (bench, gpu_check, data tools) import this checkout's
# package, whatever an installed (possibly editable, elsewhere) copy points at.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))

from dist_pool import WorkerPool  # noqa: E402

_pools: dict[int, WorkerPool] = {}


def get_pool(world: int) -> WorkerPool:
    if world not in _pools:
        _pools[world] = WorkerPool(world)
    return _pools[world]


@pytest.fixture(scope="session")
def pool2() -> WorkerPool:
    return get_pool(2)


@pytest.fixture(scope="session")
def pool4() -> WorkerPool:
    return get_pool(4)


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def pool(request) -> WorkerPool:
    return get_pool(request.param)


def pytest_sessionfinish(session, exitstatus):
    for p in _pools.values():
        p.close()
