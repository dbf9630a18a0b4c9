"""Megatron-LM's early exits, each taken after saving a checkpoint:
``--exit-interval`` (an iteration multiple), ``--exit-duration-in-mins`` (wall
clock since the start) and ``--exit-signal-handler`` (``--exit-signal``, SIGTERM by
default, as a cluster scheduler sends before killing a job).

The duration and the signal are observed per rank, so the decision is all-reduced
(max) at the end of every iteration: every rank stops at the same iteration and
the checkpoint is complete.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist


class ExitConditions:
    """Asked once per iteration, on every rank: why to stop now, or None."""

    def __init__(self, args, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.start = time.time()
        self.signal_received = False
        self._previous_handler = None
        if args.exit_signal_handler:
            self._previous_handler = signal.signal(signal.Signals[args.exit_signal], self._on_signal)

    def close(self) -> None:
        """Give the signal back to the handler that had it."""
        if self._previous_handler is not None:
            signal.signal(signal.Signals[self.args.exit_signal], self._previous_handler)
            self._previous_handler = None

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = True

    def reason(self, iteration: int) -> Optional[str]:
        args = self.args
        if args.exit_interval and iteration % args.exit_interval == 0:
            return f"--exit-interval {args.exit_interval}"
        if args.exit_duration_in_mins is None and not args.exit_signal_handler:
            return None  # nothing to agree on: no tensor, no collective, no host sync
        local = [0, 0]
        if args.exit_duration_in_mins is not None:
            local[0] = int((time.time() - self.start) / 60.0 > args.exit_duration_in_mins)
        if args.exit_signal_handler:
            local[1] = int(self.signal_received)
        flags = torch.tensor(local, dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0]:
            return f"--exit-duration-in-mins {args.exit_duration_in_mins}"
        if flags[1]:
            return f"signal {args.exit_signal} (--exit-signal-handler)"
        return None
