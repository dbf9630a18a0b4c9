#!/usr/bin/env python3
"""Pretrain a GPT with megatron_fsdp, launched like Megatron-LM's pretrain_gpt.py:

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --config configs/gpt_tiny_cpu.yaml

The driver is ``megatron_fsdp.training.pretrain_gpt`` (installed as the
``megatron-fsdp-pretrain-gpt`` command); this path is kept because Megatron-LM's scripts
and recipes type it.
"""

import os
import sys

# This checkout's package first, installed or not (as Megatron-LM's scripts run from its root).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_fsdp.training.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
