"""Upstream's module path ``megatron_fsdp.distributed_data_parallel_config``, where upstream
defines ``DistributedDataParallelConfig``. It lives in ``config.py``, the vocabulary every
floor reads."""

from .config import DistributedDataParallelConfig

__all__ = ["DistributedDataParallelConfig"]
