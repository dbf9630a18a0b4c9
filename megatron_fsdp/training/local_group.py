"""One host, several CPU processes: the gloo process group the benchmark and the
tests start in each rank (``torchrun`` users get theirs from
``scripts/pretrain_gpt.py`` instead)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def init_local_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join a gloo group rendezvousing on ``127.0.0.1:port``, with one intra-op
    thread: the ranks share the machine's cores, and more threads per rank would
    only make them contend."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
