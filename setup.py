from setuptools import find_packages, setup

setup(
    name="megatron_fsdp",
    version="0.1.0",
    description="Fully sharded data parallelism in the Megatron style, on CPU (gloo) and CUDA (NCCL)",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_fsdp", "megatron_fsdp.*"]),
    # The launcher's argument table (Megatron-LM's flags and what the launcher does with them).
    package_data={"megatron_fsdp.training.args": ["flag_data/*.csv", "flag_data/*.table"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.6"],
    extras_require={
        "test": ["pytest>=7", "pyyaml", "matplotlib"],
        "scripts": ["pyyaml", "matplotlib"],
        # Dashboards of scripts/pretrain_gpt.py: --tensorboard-dir (and --wandb-project).
        "dashboards": ["tensorboard"],
        "wandb": ["wandb"],
        # Megatron-core is optional: FullyShardedDataParallel accepts its configs and
        # GPT model. Install it without dependencies on CPU machines (see README).
        "megatron": ["megatron-core>=0.16"],
        # TransformerEngine FP8 parameters (CUDA only).
        "te": ["transformer-engine"],
        # Hugging Face checkpoints in and out (megatron_fsdp.interop, python -m megatron_fsdp.convert);
        # transformers itself reloads an exported directory and is needed only for that and the tests.
        "hf": ["safetensors>=0.4", "transformers>=5.0,<6"],
    },
)
