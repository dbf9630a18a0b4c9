"""Every module path of upstream Megatron-FSDP that Megatron-LM and megatron-core import
from, importable here with the names they import.

The paths are the files of upstream's package (megatron-core 0.16.1 vendors it as
``megatron.core.distributed.fsdp.src.megatron_fsdp``: nine modules) and the experimental
modules Megatron-LM's training code reads; the names are what megatron-core 0.16.1 and
Megatron-LM's training code import from each (collected from their sources).
"""

from __future__ import annotations

import importlib

import pytest

IMPORTED = {
    "megatron_fsdp": ["FSDPDistributedIndex", "MegatronFSDP", "MixedPrecisionPolicy", "DistributedDataParallelConfig",
                      "fully_shard", "fully_shard_model", "fully_shard_optimizer", "__version__"],
    "megatron_fsdp.distributed_data_parallel_config": ["DistributedDataParallelConfig"],
    "megatron_fsdp.fully_shard": ["MixedPrecisionPolicy", "fully_shard", "fully_shard_model", "fully_shard_optimizer"],
    "megatron_fsdp.megatron_fsdp": ["MegatronFSDP"],
    "megatron_fsdp.mixed_precision": ["MixedPrecisionPolicy"],
    "megatron_fsdp.package_info": ["__version__", "__shortversion__", "__package_name__", "__description__",
                                   "__contact_names__", "__contact_emails__", "__homepage__", "__keywords__",
                                   "__repository_url__", "__download_url__", "__license__"],
    "megatron_fsdp.param_and_grad_buffer": ["make_fsdp_dtensor"],
    "megatron_fsdp.uneven_dtensor": ["gather_uneven_dtensor_to_full_tensor", "preprocess_state_dict_for_uneven_dtensor",
                                     "redistribute_uneven_dtensor_to_replicated", "split_dtensor",
                                     "uneven_dtensor_to_full_tensor"],
    "megatron_fsdp.utils": ["FSDPDistributedIndex", "find_megatron_fsdp", "get_mcore_tensor_parallel_partition_dim",
                            "is_mcore_tensor_model_parallel", "is_mcore_tensor_parallel_duplicated", "safe_get_rank",
                            "using_tensor_parallel"],
    "megatron_fsdp.experimental": ["Placements", "fully_shard", "fully_shard_context", "fully_shard_optimizer",
                                   "load_checkpoint", "microbatch", "save_checkpoint"],
    "megatron_fsdp.experimental.dbuffer": ["DBuffer", "Flat"],
    "megatron_fsdp.experimental.module": ["FsdpModule"],
    "megatron_fsdp.experimental.parameter_group": ["sync_model_weights_from_main_weights"],
    "megatron_fsdp.experimental.placement": ["Flat"],
}
"""Module path -> the names imported from it."""

NOT_PROVIDED = {
    ("megatron_fsdp.param_and_grad_buffer", "FixedPoolAllocator"):
        "upstream's fixed pool for NCCL user buffers; temporary buckets here come from buffers/allocator.py",
    ("megatron_fsdp.utils", "get_global_memory_buffer"):
        "upstream's process-wide scratch buffer; nothing here shares one",
    ("megatron_fsdp.mixed_precision", "HAVE_TE_MXFP8TENSOR"):
        "TransformerEngine MXFP8 parameters, which this package refuses (FP8 is not supported)",
}
"""Names newer Megatron-LM code imports that this package does not define, and why: an
import of one fails with ImportError naming it, never with a stand-in."""


@pytest.mark.parametrize("path", sorted(IMPORTED))
def test_upstream_module_path_imports_with_its_names(path):
    module = importlib.import_module(path)
    assert module.__name__ == path
    missing = [name for name in IMPORTED[path] if not hasattr(module, name)]
    assert not missing, f"{path} lacks {missing}"


@pytest.mark.parametrize("path,name", sorted(NOT_PROVIDED))
def test_names_not_provided_are_really_absent(path, name):
    """When one of these is added, move it to IMPORTED (this test then says so)."""
    assert not hasattr(importlib.import_module(path), name), f"{path}.{name} exists now: list it in IMPORTED"


def test_fully_shard_stays_the_function_after_its_module_loads():
    """[Note: fully_shard, the module and the function] (megatron_fsdp/__init__.py)."""
    import subprocess
    import sys

    code = ("import megatron_fsdp as mf, megatron_fsdp.fully_shard, megatron_fsdp.tools.simulate, sys\n"
            "assert callable(mf.fully_shard) and mf.fully_shard.__name__ == 'fully_shard', mf.fully_shard\n"
            "from megatron_fsdp import fully_shard\n"
            "assert fully_shard is sys.modules['megatron_fsdp.fully_shard'].fully_shard\n")
    subprocess.run([sys.executable, "-c", code], check=True)
