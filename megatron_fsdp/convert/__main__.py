"""``python -m megatron_fsdp.convert``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
