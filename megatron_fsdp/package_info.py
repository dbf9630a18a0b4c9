"""Upstream's module path ``megatron_fsdp.package_info``: the package's name and version."""

MAJOR, MINOR, PATCH, PRE_RELEASE = 0, 1, 0, ""
VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)

__shortversion__ = f"{MAJOR}.{MINOR}.{PATCH}"
__version__ = __shortversion__ + PRE_RELEASE
__package_name__ = "megatron_fsdp"
__description__ = "Fully sharded data parallelism in the Megatron style, on CPU (gloo) and CUDA (NCCL)"
__contact_names__ = "the megatron_fsdp developers"
__contact_emails__ = ""
__homepage__ = ""
__repository_url__ = ""
__download_url__ = ""
__license__ = "Apache-2.0"
__keywords__ = "deep learning, distributed training, fsdp, zero, megatron, pytorch"

DISTRIBUTION = "mfsdp"
"""This project's distribution (``pip install mfsdp``); the import name is ``megatron_fsdp``."""
UPSTREAM_DISTRIBUTION = "megatron-fsdp"
"""NVIDIA's distribution of upstream Megatron-FSDP, which installs the same import name."""
