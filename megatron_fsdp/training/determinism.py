"""``--deterministic-mode``: Megatron-LM's reproducible-run settings.

Megatron-LM (megatron/training/determinism.py at the pinned commit) refuses the
options whose kernels it cannot make reproducible, checks the environment
variables that pick collective and GEMM algorithms, fills in the reproducible
values where they are unset, and turns on ``torch.use_deterministic_algorithms``.
The launcher does the same, so a run that Megatron-LM refuses is refused here too
and a run it accepts gets the same torch setting (an op without a deterministic
kernel then raises instead of silently varying between runs).

The environment must be set before the process group (NCCL reads ``NCCL_ALGO``
when a communicator is made) and before the first GEMM (cuBLAS reads its
workspace setting once).
"""

from __future__ import annotations

import argparse
import os
from typing import MutableMapping

import torch

REQUIRED_OFF = {"cross_entropy_loss_fusion": "--cross-entropy-loss-fusion", "tp_comm_overlap": "--tp-comm-overlap"}
"""Options Megatron-LM's deterministic mode requires to be off (their kernels reduce
in a varying order)."""

ENV_DEFAULTS = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
NCCL_ALGOS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
ACCEPTED_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": frozenset({"0"}),
                "CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"})}
ONE_ONLY = ("MAMBA_DETERMINISTIC", "CAUSAL_CONV1D_DETERMINISTIC")


def option_problems(args: argparse.Namespace) -> list[str]:
    """Validation messages for options that ``--deterministic-mode`` excludes."""
    on = [flag for dest, flag in REQUIRED_OFF.items() if getattr(args, dest, False)]
    if not on:
        return []
    return [f"--deterministic-mode cannot be combined with {', '.join(on)} (as in Megatron-LM: those kernels "
            "are not reproducible); drop one of them"]


def environment_problems(env: MutableMapping[str, str]) -> list[str]:
    """Messages for environment variables set to values that break reproducibility."""
    problems = []
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGOS for t in tokens):
            problems.append(f"NCCL_ALGO={algo!r}: under --deterministic-mode each entry must be one of "
                            f"{sorted(NCCL_ALGOS)}; unset it to get Ring")
    for name, accepted in ACCEPTED_ENV.items():
        if env.get(name) is not None and env[name] not in accepted:
            problems.append(f"{name}={env[name]!r} is not reproducible: use one of {sorted(accepted)} or unset it")
    for name in ONE_ONLY:
        if env.get(name) and not env[name].startswith("1"):
            problems.append(f"{name}={env[name]!r} turns reproducibility off under --deterministic-mode: "
                            "unset it or set it to 1")
    return problems


def apply(env: MutableMapping[str, str] = os.environ) -> None:
    """Fill in the reproducible environment defaults (values already set win) and turn
    on torch's deterministic algorithms. Call after ``environment_problems`` is empty."""
    for name, value in ENV_DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)


__all__ = ["apply", "environment_problems", "option_problems"]
