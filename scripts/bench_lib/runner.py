"""The coordinator: launches one group of rank processes per implementation and
alternates them round by round (A B C, B C A, C A B, ...), so that drift of a
shared machine hits every implementation alike; the order rotates so that no
implementation always runs right after the same neighbour.

Rank processes come from a ``forkserver`` that imported torch and megatron_fsdp
once: each rank then starts in a fraction of a second instead of re-importing
torch, and none inherits threads from this process.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import queue
import socket
import time
from typing import Any

import torch

from megatron_fsdp.models import GPT

from .config import BenchConfig, ImplSpec
from .impls import param_counts
from .theory import ElementSizes, expected_memory

logger = logging.getLogger(__name__)

PROCESS_BASE_BYTES = 300 * 2**20
"""Rough resident size of a rank before its model: torch, gloo, Python."""
ACTIVATION_FACTOR = 1.5
"""Headroom over the persistent state for activations and gathered weights."""


class WorkerError(RuntimeError):
    """A rank raised or died; carries the rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron_fsdp", "bench_lib.worker"])
    return ctx


class WorkerGroup:
    """The ``world`` rank processes of one implementation."""

    def __init__(self, spec: ImplSpec, cfg: BenchConfig, ctx: mp.context.BaseContext) -> None:
        self.spec = spec
        self.cfg = cfg
        self.ctx = ctx
        self.procs: list[Any] = []
        self.description: dict = {}

    def start(self) -> dict:
        from .worker import worker_main

        port = _free_port()
        self.results = self.ctx.Queue()
        self.commands = [self.ctx.Queue() for _ in range(self.cfg.world)]
        for rank in range(self.cfg.world):
            proc = self.ctx.Process(
                target=worker_main,
                args=(rank, self.cfg.world, port, self.spec, self.cfg, self.commands[rank], self.results),
                daemon=True,
                name=f"bench-{self.spec.name}-r{rank}",
            )
            proc.start()
            self.procs.append(proc)
        self.description = self._collect("start")[0]
        return self.description

    def call(self, *command: Any) -> list[dict]:
        for q in self.commands:
            q.put(command)
        return self._collect(command[0])

    def _collect(self, what: str) -> list[dict]:
        out: list[Any] = [None] * self.cfg.world
        pending = set(range(self.cfg.world))
        deadline = time.monotonic() + self.cfg.collective_timeout_s + 60
        while pending:
            try:
                rank, ok, payload = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.stop()
                    reason = f"{', '.join(dead)} exited" if dead else f"no answer in {self.cfg.collective_timeout_s + 60:.0f}s"
                    raise WorkerError(
                        f"{self.spec.name}: {what} failed: {reason}; rerun with fewer --impls to isolate it"
                    ) from None
                continue
            if not ok:
                self.stop()
                raise WorkerError(f"{self.spec.name}: {what} failed on rank {rank}:\n{payload}")
            out[rank] = payload
            pending.discard(rank)
        return out

    def stop(self) -> None:
        for q, proc in zip(self.commands, self.procs):
            if proc.is_alive():
                q.put(("stop",))
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.procs = []


def _available_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def choose_isolation(cfg: BenchConfig, specs: list[ImplSpec]) -> str:
    """persistent when every implementation's group fits in half the free memory at once."""
    if cfg.isolation != "auto":
        return cfg.isolation
    with torch.device("meta"):
        counts = param_counts(GPT(cfg.gpt_config))
    elem = 2 if cfg.dtype == "bf16" else 4
    need = 0.0
    for spec in specs:
        state = sum(expected_memory(spec, counts, cfg.world, ElementSizes(weights=elem)).values())
        need += cfg.world * (PROCESS_BASE_BYTES + ACTIVATION_FACTOR * (state + 4 * counts.total))
    available = _available_memory()
    choice = "persistent" if need < 0.5 * available else "fresh"
    logger.info("isolation=%s: all groups at once need ~%.1f GiB of %.1f GiB available",
                choice, need / 2**30, available / 2**30)
    return choice


@dataclasses.dataclass
class Cell:
    """One implementation's measured block in one round: per-rank results."""

    round: int
    impl: str
    ranks: list[dict]


def run_bench(cfg: BenchConfig) -> tuple[list[Cell], dict[str, dict], str]:
    """Run every round; returns the cells, each implementation's description and the isolation used."""
    specs = cfg.selected_impls()
    isolation = choose_isolation(cfg, specs)
    ctx = _context()
    live: dict[str, WorkerGroup] = {}
    descriptions: dict[str, dict] = {}
    cells: list[Cell] = []
    try:
        for round_index in range(cfg.rounds):
            shift = round_index % len(specs)
            for spec in specs[shift:] + specs[:shift]:
                group = live.get(spec.name)
                if group is None:
                    group = WorkerGroup(spec, cfg, ctx)
                    descriptions[spec.name] = group.start()
                    group.call("warmup", cfg.warmup)
                    if isolation == "persistent":
                        live[spec.name] = group
                logger.info("round %d/%d: %s", round_index + 1, cfg.rounds, spec.name)
                cells.append(Cell(round_index, spec.name, group.call("measure", cfg.steps)))
                if isolation == "fresh":
                    group.stop()
    finally:
        for group in live.values():
            group.stop()
    return cells, descriptions, isolation
