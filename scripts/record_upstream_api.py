"""Record the public API of upstream megatron-fsdp (a PyPI release) into a JSON file.

The sources are read with ``ast``, never imported (upstream may need CUDA-only
packages), so this runs on any machine with ``pip``:

    python3 scripts/record_upstream_api.py --version 0.6.1 --out tests/data/upstream_api_0.6.1.json

or, with the wheel (or an unpacked source tree) already at hand:

    python3 scripts/record_upstream_api.py --source /tmp/megatron_fsdp-0.6.1-py3-none-any.whl

and its experimental per-module API with ``--experimental`` (into
``tests/data/upstream_experimental_api_0.6.1.json``).

``tests/test_upstream_api.py`` compares our API with the recorded file: every
upstream parameter, field and method must exist here.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

PACKAGE = "megatron_fsdp"
FUNCTIONS = {"fully_shard.py": ("fully_shard_model", "fully_shard_optimizer", "fully_shard")}
INIT_OF = {"megatron_fsdp.py": "MegatronFSDP", "utils.py": "FSDPDistributedIndex"}
DATACLASSES = {"mixed_precision.py": "MixedPrecisionPolicy", "distributed_data_parallel_config.py": "DistributedDataParallelConfig"}
METHODS_OF = {"utils.py": "FSDPDistributedIndex", "megatron_fsdp.py": "MegatronFSDP"}
# Public helpers that Megatron-LM's own code imports from these modules.
HELPER_MODULES = ("utils.py", "uneven_dtensor.py")
# The experimental per-module API (``--experimental``), which changed between releases.
EXPERIMENTAL_FUNCTIONS = {"fully_shard.py": ("fully_shard", "microbatch"), "optimizer.py": ("fully_shard_optimizer",)}
EXPERIMENTAL_INITS = {"dbuffer.py": "DBuffer"}
EXPERIMENTAL_DATACLASSES = {"placement.py": ("Placements", "Replicate", "Partial", "Flat")}


def _parameters(fn: ast.FunctionDef) -> list[dict]:
    """Each parameter with its default as source text (``None`` when it has none)."""
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults: list[Optional[ast.expr]] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [{"name": a.arg, "default": None if d is None else ast.unparse(d), "kind": "positional_or_keyword"}
           for a, d in zip(positional, defaults)]
    out += [{"name": a.arg, "default": None if d is None else ast.unparse(d), "kind": "keyword_only"}
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return [p for p in out if p["name"] != "self"]


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    return {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def _fields(cls: ast.ClassDef) -> list[dict]:
    """Annotated class attributes (dataclass fields) with their defaults."""
    return [
        {"name": node.target.id, "default": None if node.value is None else ast.unparse(node.value)}
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    ]


def _methods(cls: ast.ClassDef) -> dict[str, list[dict]]:
    return {
        node.name: _parameters(node)
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }


def record(package_dir: Path, version: str) -> dict:
    trees = {path.name: ast.parse(path.read_text()) for path in package_dir.glob("*.py")}
    api: dict = {"package": PACKAGE, "version": version, "functions": {}, "inits": {}, "dataclasses": {},
                 "methods": {}, "helpers": {}}
    for file, names in FUNCTIONS.items():
        nodes = _top_level(trees[file])
        for name in names:
            api["functions"][name] = _parameters(nodes[name])
    for file, cls in INIT_OF.items():
        init = next(n for n in _top_level(trees[file])[cls].body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        api["inits"][cls] = _parameters(init)
    for file, cls in DATACLASSES.items():
        api["dataclasses"][cls] = _fields(_top_level(trees[file])[cls])
    for file, cls in METHODS_OF.items():
        api["methods"][cls] = _methods(_top_level(trees[file])[cls])
    for file in HELPER_MODULES:
        api["helpers"][file.removesuffix(".py")] = sorted(
            name for name, node in _top_level(trees[file]).items()
            if isinstance(node, ast.FunctionDef) and not name.startswith("_")
        )
    return api


def record_experimental(package_dir: Path, version: str) -> dict:
    """``megatron_fsdp.experimental``'s exports, entry points, ``DBuffer`` and placement classes."""
    folder = package_dir / "experimental"
    trees = {path.name: ast.parse(path.read_text()) for path in folder.glob("*.py")}
    exports = next(node.value for node in trees["__init__.py"].body
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__")
    api: dict = {"package": f"{PACKAGE}.experimental", "version": version, "exports": ast.literal_eval(exports),
                 "functions": {}, "inits": {}, "dataclasses": {}}
    for file, names in EXPERIMENTAL_FUNCTIONS.items():
        nodes = _top_level(trees[file])
        api["functions"].update({name: _parameters(nodes[name]) for name in names})
    for file, cls in EXPERIMENTAL_INITS.items():
        init = next(n for n in _top_level(trees[file])[cls].body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        api["inits"][cls] = _parameters(init)
    for file, classes in EXPERIMENTAL_DATACLASSES.items():
        nodes = _top_level(trees[file])
        api["dataclasses"].update({cls: _fields(nodes[cls]) for cls in classes})
    return api


def _package_dir(source: Optional[str], version: str, workdir: Path) -> Path:
    if source is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", f"megatron-fsdp=={version}", "-d", str(workdir)],
            check=True,
        )
        source = str(next(workdir.glob("megatron_fsdp-*.whl")))
    path = Path(source)
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            wheel.extractall(workdir / "unpacked")
        path = workdir / "unpacked"
    return path / PACKAGE if (path / PACKAGE).is_dir() else path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default="0.6.1", help="megatron-fsdp release on PyPI")
    parser.add_argument("--source", help="a downloaded wheel or source directory (skips pip download)")
    parser.add_argument("--experimental", action="store_true",
                        help="record megatron_fsdp.experimental instead (upstream_experimental_api_<version>.json)")
    parser.add_argument("--out", help="output JSON (default tests/data/upstream_api_<version>.json)")
    args = parser.parse_args()
    stem = "upstream_experimental_api" if args.experimental else "upstream_api"
    out = Path(args.out or Path(__file__).resolve().parent.parent / "tests" / "data" / f"{stem}_{args.version}.json")
    with tempfile.TemporaryDirectory() as tmp:
        package_dir = _package_dir(args.source, args.version, Path(tmp))
        api = (record_experimental if args.experimental else record)(package_dir, args.version)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(api, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
