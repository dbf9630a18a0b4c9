"""Python function calls per training step, per implementation (world 1, gloo).

Wall-clock times on a shared machine are noisy; the number of Python function calls
cProfile sees in one step is not, and it is where host overhead above DDP comes from.

    python -m scripts.bench_lib.profile_step --model gpt-mini --impls ddp mfsdp_no_shard
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats

import torch.distributed as dist

from .config import MODEL_PRESETS, BenchConfig
from .counting import CollectiveCounter
from .impls import build_trainer
from .worker import make_batches


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """One implementation's measured step."""

    name: str
    calls: int
    """Python function calls in one step (after warm-up)."""
    top: list
    """``(calls, "file:line(function)")`` of the most-called functions, most first."""


def profile_impl(spec, cfg: BenchConfig, *, warmup: int = 2, top: int = 20) -> StepProfile:
    """Calls per step of ``spec`` (the process group must exist)."""
    trainer = build_trainer(spec, cfg.gpt_config, dtype=cfg.dtype, seed=cfg.seed, lr=cfg.lr,
                            counter=CollectiveCounter())
    batches = make_batches(cfg, dist.get_rank(), dist.get_world_size())
    for i in range(warmup):
        trainer.step(*batches[i % len(batches)])
    trainer.drain()
    profiler = cProfile.Profile()
    profiler.enable()
    trainer.step(*batches[warmup % len(batches)])
    trainer.drain()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(((nc, f"{os.path.basename(f)}:{line}({fn})") for (f, line, fn), (_, nc, *_rest) in stats.items()),
                  reverse=True)
    return StepProfile(spec.name, sum(nc for nc, _ in rows), rows[:top])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-mini", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--impls", nargs="*", default=None)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    cfg = BenchConfig(world=1, model=args.model, impls=tuple(args.impls) if args.impls else None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for spec in cfg.selected_impls():
            profile = profile_impl(spec, cfg, top=args.top)
            print(f"== {profile.name}: {profile.calls} Python calls per step")
            for calls, where in profile.top:
                print(f"  {calls:7d}  {where}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
