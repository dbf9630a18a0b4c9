"""Megatron-LM's timers for ``--timing-log-level``: named wall-clock timers with a
log level, reported across ranks as ``(min, max) time across ranks (ms):`` after
each iteration line (``--timing-log-option`` max / minmax / all).

Level 0 timers are always kept (``interval-time``); level 1 adds
``forward-backward`` and ``optimizer``; level 2 adds ``batch-generator``,
``forward-compute`` and ``backward-compute``. A timer above the chosen level is a
no-op. Reporting is collective (every rank passes its times to rank 0).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_fsdp.comm import device as device_mod

LEVEL_1 = ("forward-backward", "optimizer")
LEVEL_2 = ("batch-generator", "forward-compute", "backward-compute")


class Timers:
    def __init__(self, log_level: int, log_option: str = "minmax", device: Optional[torch.device] = None) -> None:
        self.log_level = log_level
        self.log_option = log_option
        self.device = device or torch.device("cpu")
        self._elapsed: dict[str, float] = {}
        self._levels = {name: 1 for name in LEVEL_1} | {name: 2 for name in LEVEL_2} | {"interval-time": 0}

    def enabled(self, name: str) -> bool:
        return self._levels.get(name, 0) <= self.log_level

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        if not self.enabled(name):
            yield
            return
        device_mod.synchronize(self.device)  # GPU work queued before the timer is not its time
        start = time.perf_counter()
        try:
            yield
        finally:
            device_mod.synchronize(self.device)
            self._elapsed[name] = self._elapsed.get(name, 0.0) + time.perf_counter() - start

    def names_to_log(self) -> list[str]:
        names = list(LEVEL_1) if self.log_level >= 1 else []
        return names + (list(LEVEL_2) if self.log_level >= 2 else [])

    def elapsed_ms(self, names: list[str], normalizer: float, reset: bool = True) -> dict[str, float]:
        out = {name: 1000.0 * self._elapsed.get(name, 0.0) / normalizer for name in names}
        if reset:
            for name in names:
                self._elapsed.pop(name, None)
        return out

    def log_string(self, names: list[str], normalizer: float, reset: bool = True) -> Optional[str]:
        """The report across ranks (collective); None when no timer is logged."""
        if not names:
            return None
        local = self.elapsed_ms(names, normalizer, reset)
        gathered = [local]
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        if self.log_option == "all":
            text = "times across ranks (ms):"
            for name in names:
                text += f"\n  {name}:"
                for rank, times in enumerate(gathered):
                    text += f"\n     rank {rank:2d}: {times[name]:.2f}"
            return text
        text = "max time across ranks (ms):" if self.log_option == "max" else "(min, max) time across ranks (ms):"
        for name in names:
            values = [times[name] for times in gathered]
            label = (name + " ").ljust(48, ".")
            if self.log_option == "max":
                text += f"\n    {label}: {max(values):.2f}"
            else:
                text += f"\n    {label}: ({min(values):.2f}, {max(values):.2f})"
        return text
