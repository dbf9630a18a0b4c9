#!/usr/bin/env python3
"""Regenerate ``megatron_fsdp/training/args/flag_data/megatron_lm_flags.csv`` from a
Megatron-LM checkout: every option of Megatron-LM's argument parser (name, aliases,
destination, action, type, nargs, default, choices, argument group) plus, per flag,
which of Megatron-LM's GPT / Llama / MoE Megatron-FSDP launch scripts, functional
test recipes and docs use it.

    python scripts/extract_megatron_flags.py --megatron-git-dir /work/.mirror/NVIDIA+Megatron-LM/repo

Megatron-LM builds most of its flags from dataclasses at import time, so reading
``arguments.py`` as text misses them; this script builds the real parser. It
exports ``megatron/`` of the chosen commit to a temporary directory and imports
``megatron.training.arguments`` with the GPU-only packages it imports (Triton,
TransformerEngine, ...) replaced by inert stand-ins: only the parser is built,
nothing runs. A developer tool: the launcher and its tests read the CSV only.
"""

from __future__ import annotations

import argparse
import csv
import importlib.abc
import importlib.machinery
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(REPO, "megatron_fsdp", "training", "flag_data", "megatron_lm_flags.csv")

# Where a GPT / Llama / MoE pretraining run with Megatron-FSDP takes its flags from.
FAMILY_SOURCES = {
    "llama3_8b_fsdp": "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
    "deepseek_v3_fsdp": "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh",
    "gpt3_175b": "examples/gpt3/train_gpt3_175b_distributed.sh",
    "llama3_8b": "examples/llama/train_llama3_8b_h100_fp8.sh",
    "docs_megatron_fsdp": "docs/user-guide/features/megatron_fsdp.md",
    "docs_parallelism": "docs/user-guide/parallelism-guide.md",
    "recipe_gpt3_fsdp_dtensor": "tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor/"
                                "model_config.yaml",
    "recipe_gpt3_fsdp_dtensor_1node": "tests/functional_tests/test_cases/gpt/"
                                      "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor_1node/model_config.yaml",
    "recipe_deepseek_proxy_fsdp": "tests/functional_tests/test_cases/moe/deepseek_proxy_fsdp_ep2_fsdp2/"
                                  "model_config.yaml",
    "recipe_deepseek_proxy_fsdp_1node": "tests/functional_tests/test_cases/moe/deepseek_proxy_fsdp_ep2_fsdp2_1node/"
                                        "model_config.yaml",
    "recipe_deepseek_proxy_fsdp_ep_overlap": "tests/functional_tests/test_cases/moe/"
                                             "deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap/model_config.yaml",
    "recipe_moe_8experts_top2": "tests/functional_tests/test_cases/moe/"
                                "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router/"
                                "model_config.yaml",
}
COLUMNS = ("flag", "aliases", "dest", "action", "type", "nargs", "default", "choices", "group", "used_by")
_GPU_ONLY = ("triton", "transformer_engine", "apex", "flash_attn", "einops", "nvidia_resiliency_ext", "tensorstore",
             "zarr", "modelopt", "flashinfer", "mamba_ssm", "causal_conv1d", "wandb", "one_logger", "nv_one_logger",
             "multistorageclient", "sentencepiece", "tiktoken", "nltk", "transformers", "emerging_optimizers",
             "deep_ep", "hybrid_ep")


def git(git_dir: str, *args: str) -> bytes:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True).stdout


# -- inert stand-ins for GPU-only imports ------------------------------------------
class _Anything(type):
    """A class whose attributes, items and calls are more such classes: enough for
    module-level ``class X(te.pytorch.Linear)`` and decorators to import."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Anything("result", (), {})

    def __getitem__(cls, key):
        return _Anything("item", (), {})

    def __or__(cls, other):
        return _Anything("union", (), {})

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        frame = sys._getframe(1)
        while frame and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back
        if frame and frame.f_globals.get("__name__", "").startswith("torch"):
            return None  # torch probes for Triton itself; let it see the truth
        if name.split(".")[0] in _GPU_ONLY:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__, module.__spec__, module.__version__ = [], spec, "99.0"
        return module

    def exec_module(self, module):
        pass


def build_megatron_parser(source_root: str) -> argparse.ArgumentParser:
    import typing

    import torch  # noqa: F401  (imported before the stand-ins so torch never sees them)
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401
    import typing_extensions

    if not hasattr(typing, "override"):  # Megatron-LM targets Python >= 3.12
        typing.override = typing_extensions.override
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, source_root)
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]  # an installed megatron-core must not shadow the checkout
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


# -- rows ----------------------------------------------------------------------------
def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return " ".join(_cell(v) for v in value)
    if hasattr(value, "name") and hasattr(value, "value"):  # an enum member
        return str(value.name)
    return str(value)


def flag_rows(parser: argparse.ArgumentParser, used_by: dict[str, list[str]]) -> list[dict]:
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    rows = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag, *aliases = action.option_strings
        type_name = getattr(action.type, "__name__", None)
        rows.append({
            "flag": flag,
            "aliases": " ".join(aliases),
            "dest": action.dest,
            "action": type(action).__name__.strip("_").replace("Action", "").lower(),
            "type": type_name if type_name in ("int", "float", "str") else ("" if action.type is None else "custom"),
            "nargs": "" if action.nargs in (None, 0) else str(action.nargs),
            "default": "" if isinstance(action.default, bool) or action.nargs == 0 else _cell(action.default),
            "choices": "" if action.choices is None else " ".join(_cell(c) for c in action.choices),
            "group": group_of.get(id(action), ""),
            "used_by": " ".join(sorted({tag for opt in action.option_strings for tag in used_by.get(opt, ())})),
        })
    return sorted(rows, key=lambda r: r["flag"])


def family_usage(git_dir: str, commit: str) -> dict[str, list[str]]:
    usage: dict[str, list[str]] = {}
    for tag, path in FAMILY_SOURCES.items():
        text = git(git_dir, "show", f"{commit}:{path}").decode()
        for flag in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])", text))):
            usage.setdefault(flag, []).append(tag)
    return usage


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-git-dir", default="/work/.mirror/NVIDIA+Megatron-LM/repo")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args()
    commit = git(args.megatron_git_dir, "rev-parse", args.commit).decode().strip()
    with tempfile.TemporaryDirectory() as tmp:
        archive = git(args.megatron_git_dir, "archive", commit, "megatron")
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        megatron_parser = build_megatron_parser(tmp)
    rows = flag_rows(megatron_parser, family_usage(args.megatron_git_dir, commit))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", newline="") as f:
        f.write(f"# Every option of Megatron-LM's argument parser (megatron/training/arguments.py, which builds\n"
                f"# many of them from dataclasses), extracted by scripts/extract_megatron_flags.py.\n"
                f"# megatron_lm_commit: {commit}\n"
                f"# used_by: the launch scripts / functional-test recipes / docs that pass the flag:\n"
                + "".join(f"#   {tag}: {path}\n" for tag, path in FAMILY_SOURCES.items()))
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    used = sum(1 for r in rows if r["used_by"])
    print(json.dumps({"commit": commit, "flags": len(rows), "used_by_families": used, "output": args.output}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
