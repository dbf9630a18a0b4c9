"""The launcher's driver (``megatron_fsdp/training/pretrain_gpt.py``, which
scripts/pretrain_gpt.py runs) inside a test process or a pooled gloo rank: the driver
loaded as a module, its ``run`` called on flags parsed as the launcher parses them (no
torchrun start-up: a second or two per run on a warm pool), and the log lines it wrote
captured.

``pretrain_script()`` is one module per process, for tests that only call it; a test
that patches the script's functions loads its own with ``load_pretrain_script()``, so
the patch cannot reach the next test in the same pooled worker.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import shlex
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "megatron_fsdp" / "training" / "pretrain_gpt.py"


def load_pretrain_script(name: str = "pretrain_gpt_under_test") -> ModuleType:
    """A fresh module of scripts/pretrain_gpt.py."""
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def pretrain_script() -> ModuleType:
    """scripts/pretrain_gpt.py, loaded once per process (never patch it)."""
    return load_pretrain_script("pretrain_gpt_shared")


class LogLines(logging.Handler):
    """Keeps the message of every record at INFO or above."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_launcher(flags: str, world: int, *, script: Optional[ModuleType] = None,
                 device: torch.device = torch.device("cpu")) -> list[str]:
    """Parse ``flags`` for ``world`` ranks and run the launcher on this rank; returns the
    log lines it wrote (INFO and above, as rank 0 prints them under torchrun)."""
    from megatron_fsdp.training.args.arguments import parse_args

    args = parse_args(shlex.split(flags), world_size=world)
    root, handler = logging.getLogger(), LogLines()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        (script or pretrain_script()).run(args, device)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return handler.lines


def launch_task(rank: int, world: int, *, flags: str) -> list[str]:
    """A pool task: the launcher on this rank (``run_launcher``); rank 0's lines are what
    a torchrun run prints."""
    return run_launcher(flags, world)
