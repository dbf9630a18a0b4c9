"""Per-rank memory and bytes per step of a sharded GPT, checked by simulation.

    python scripts/plan.py --model 8b --world 1024 --strategy optim_grads_params --check

A thin wrapper of ``python -m megatron_fsdp.tools.plan_cli`` (see megatron_fsdp/tools/plan.py).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_fsdp.tools.plan_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
