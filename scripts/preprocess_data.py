#!/usr/bin/env python3
"""Tokenize text or JSON lines into a Megatron indexed dataset, with Megatron-LM's
``tools/preprocess_data.py`` flags:

    python3 scripts/preprocess_data.py --input data/corpus.txt --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file data/bpe/vocab.json \\
        --merge-file data/bpe/merges.txt --append-eod --workers 1

The program is ``megatron_fsdp.training.data.preprocess_data`` (installed as the
``megatron-fsdp-preprocess-data`` command); this path is kept for Megatron-LM's habits.
"""

import os
import sys

# This checkout's package first, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_fsdp.training.data.preprocess_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
