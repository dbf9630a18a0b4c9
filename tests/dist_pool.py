"""A pool of gloo worker processes shared by the distributed tests.

Spawning and initialising a process group costs seconds per rank; doing it once
per world size (instead of per test) keeps the suite fast. A test sends a
top-level function; every rank runs ``fn(rank, world, **kwargs)`` and the results
come back as a list indexed by rank. A failing or hung task tears the pool down so
the next test starts from a clean one.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from typing import Any, Callable

TASK_TIMEOUT_S = float(os.environ.get("MFSDP_TEST_TASK_TIMEOUT", "180"))
# A collective blocked longer than this fails instead of hanging the pool.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("MFSDP_TEST_COLLECTIVE_TIMEOUT", "60"))


class RemoteError(RuntimeError):
    """A task raised on a worker; carries the remote traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world: int, port: int, tasks: "mp.Queue", results: "mp.Queue") -> None:
    import torch.distributed as dist

    from megatron_fsdp.training.local_group import init_local_gloo

    init_local_gloo(rank, world, port, COLLECTIVE_TIMEOUT_S)
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, fn_name, kwargs = task
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((rank, True, fn(rank, world, **kwargs)))
        except BaseException:  # report everything, including assertion failures
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    os._exit(0)


class WorkerPool:
    def __init__(self, world: int) -> None:
        self.world = world
        self._procs: list[mp.Process] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._procs = [
            ctx.Process(target=_worker_main, args=(r, self.world, port, self._tasks[r], self._results), daemon=True)
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], timeout: float = TASK_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world, **kwargs)`` on every rank; return the per-rank results."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        module = sys.modules[fn.__module__]
        module_name = module.__spec__.name if module.__spec__ else fn.__module__
        for q in self._tasks:
            q.put((module_name, fn.__name__, kwargs))
        out: list[Any] = [None] * self.world
        errors = []
        try:
            for _ in range(self.world):
                rank, ok, value = self._results.get(timeout=timeout)
                if ok:
                    out[rank] = value
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
                    if len(errors) == 1:
                        # Other ranks may be stuck in a collective with the failed one;
                        # give them a moment to fail too, then stop waiting.
                        timeout = min(timeout, COLLECTIVE_TIMEOUT_S + 15)
        except queue.Empty:
            self.close()
            detail = "\n".join(errors)
            raise TimeoutError(f"{fn.__name__}: no result from every rank within {timeout}s\n{detail}") from None
        if errors:
            self.close()
            raise RemoteError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return out

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self._procs = []
