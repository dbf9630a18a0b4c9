"""The default suite's share of a parametrised grid. Every value stays listed (the long run
and ``pytest --collect-only`` see the whole grid); the values outside ``default`` repeat a
code path that a default case already takes and skip unless the grid's environment
variable is set (README, "Tests": ``MFSDP_GRID_LONG=1`` or the feature's own variable)."""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import pytest

STRATEGY_ENDS = ("no_shard", "optim_grads_params")
"""The two ends of the sharding strategies: nothing sharded, everything sharded."""


def grid(values: Iterable, default: Sequence, variable: str = "MFSDP_GRID_LONG") -> list:
    """``values`` as pytest parameters: those in ``default`` always run, the others only
    when ``variable`` is set (to anything but empty)."""
    on = bool(os.environ.get(variable))
    skip = pytest.mark.skipif(not on, reason=f"repeats a default case's code path; {variable}=1 runs it")
    return [value if value in default or on else
            pytest.param(*(value if isinstance(value, tuple) else (value,)), marks=skip)  # a tuple: several argnames
            for value in values]
