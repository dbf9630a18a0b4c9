"""The rank side: one process per rank per implementation, driven by commands
from the coordinator (runner.py) over a queue.

Commands: ``("warmup", n)`` runs n unmeasured steps; ``("measure", n)`` runs n
timed steps with the collective counter on and returns what was seen;
``("stop",)`` leaves. Every rank replies ``(rank, ok, payload)``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

import megatron_fsdp as mf
from megatron_fsdp.training.local_group import init_local_gloo

from .config import BenchConfig, ImplSpec
from .counting import CollectiveCounter
from .impls import Trainer, build_trainer

logger = logging.getLogger(__name__)

DATA_BATCHES = 4
"""Distinct global batches, cycled; pre-built so data generation is never timed."""
_PAGE = os.sysconf("SC_PAGE_SIZE")


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_rss() -> int:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_batches(cfg: BenchConfig, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of the same seeded global batches on every implementation."""
    gpt = cfg.gpt_config
    generator = torch.Generator().manual_seed(cfg.seed)
    batches = []
    for _ in range(DATA_BATCHES):
        tokens = torch.randint(
            0, gpt.vocab_size, (cfg.micro_batch_size * world, gpt.seq_length + 1), generator=generator
        )
        local = tokens.chunk(world)[rank]
        batches.append((local[:, :-1].contiguous(), local[:, 1:].contiguous()))
    return batches


@dataclasses.dataclass(eq=False)
class WorkerSession:
    rank: int
    world: int
    trainer: Trainer
    counter: CollectiveCounter
    batches: list
    steps_done: int = 0

    def _one_step(self) -> tuple[float, torch.Tensor]:
        inputs, targets = self.batches[self.steps_done % len(self.batches)]
        start = time.perf_counter()
        loss = self.trainer.step(inputs, targets)
        elapsed = time.perf_counter() - start
        self.steps_done += 1
        return elapsed, loss

    def warmup(self, steps: int) -> dict:
        for _ in range(steps):
            self._one_step()
        self.trainer.drain()
        return {}

    def measure(self, steps: int) -> dict:
        # One untimed step first: this group slept while the others ran, and its
        # first step back pays for cold caches, whatever the implementation.
        self._one_step()
        self.trainer.drain()
        accounting = self.trainer.accounting
        if accounting is not None:
            accounting.reset_peak()
        dist.barrier()
        rss_before = current_rss()
        self.counter.reset()
        self.counter.enabled = True
        times, losses = [], []
        # The package's own recorder, only to cross-check the bench's counter.
        with mf.record_collectives() as package:
            for _ in range(steps):
                elapsed, loss = self._one_step()
                times.append(elapsed)
                losses.append(loss.item())
            self.trainer.drain()
        self.counter.enabled = False
        rss_after = current_rss()
        dist.barrier()
        return {
            "step_times": times,
            "losses": losses,
            "comm": self.counter.snapshot(),
            "package_bytes": dict(package.bytes),
            "memory": self.trainer.memory(),
            "rss_before": rss_before,
            "rss_after": rss_after,
            "peak_rss": peak_rss(),
        }

    def describe(self) -> dict:
        t = self.trainer
        return {
            "counts": dataclasses.asdict(t.counts),
            "sizes": dataclasses.asdict(t.sizes),
            "comm_elem": t.comm_elem,
            "patch_sites": list(self.counter.patch_sites),
            "rss_after_build": current_rss(),
        }


def worker_main(rank: int, world: int, port: int, spec: ImplSpec, cfg: BenchConfig, commands, results) -> None:
    """Process entry point (must be importable: the forkserver pickles it by name)."""
    logging.basicConfig(level=logging.WARNING, format=f"[{spec.name} r{rank}] %(levelname)s %(message)s")
    try:
        init_local_gloo(rank, world, port, cfg.collective_timeout_s)
        counter = CollectiveCounter()
        trainer = build_trainer(spec, cfg.gpt_config, dtype=cfg.dtype, seed=cfg.seed, lr=cfg.lr, counter=counter,
                                double_buffer=cfg.fsdp_double_buffer)
        # After every import: module-level aliases of the collectives exist by now.
        counter.install()
        session = WorkerSession(rank, world, trainer, counter, make_batches(cfg, rank, world))
        results.put((rank, True, session.describe()))
        while True:
            command: tuple[Any, ...] = commands.get()
            if command[0] == "stop":
                break
            handler = getattr(session, command[0])
            results.put((rank, True, handler(*command[1:])))
    except BaseException:  # report everything to the coordinator, which fails the run
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
