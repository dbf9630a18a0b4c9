"""The package's floors, checked: no import circles, no import that runs up a floor, the
engine never imports the launcher, the launcher uses only the engine's public surface.

Every import counts, wherever it is written: at module level, inside a function, under
``if TYPE_CHECKING:``. A circle or an upward import cannot be hidden in a function body;
it is broken by turning a dependency around (a protocol, a callback, a module of its own).
The floors, top to bottom, are the package docstring's (``megatron_fsdp/__init__.py``):
each may import its own floor (without circles) and the floors below it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "megatron_fsdp"

VOCABULARY = ("config", "enums", "mixed_precision", "param_marks", "package_info")
"""Root modules every floor may read: the package's vocabulary."""

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("launcher", ("training", "convert")),
    ("tools", ("tools", "interop")),
    ("beside the engine", ("models", "experimental")),
    ("public face", ("",)),  # the package root's other modules
    ("state", ("state",)),
    ("runtime", ("runtime",)),
    ("buffers and compat", ("buffers", "compat")),
    ("comm", ("comm",)),
    ("vocabulary", VOCABULARY),
]
"""Floor name -> the subpackages (or root modules) on it, top floor first."""

INDEPENDENT = [("models", "experimental"), ("buffers", "compat")]
"""Pairs on one floor that must not import each other at all."""

LAUNCHER_MAY_IMPORT = (
    "", "fully_shard", "megatron_fsdp", "mcore_fsdp_adapter", "optimizer", "utils", "uneven_dtensor",
    "param_and_grad_buffer", "distributed_data_parallel_config", "parallel_dims", *VOCABULARY,
    "state", "comm.device", "models", "interop", "experimental", "mixed_precision",
)
"""The engine's public surface as the launcher sees it (module paths under the package):
the root package and its public modules, ``state``'s declared surface (the package, not
its modules), the device queries, the embedded models and the checkpoint formats of other
projects (``interop``), with their submodules."""

LAUNCHER = ("training", "convert")
"""The launcher's packages: the training loop and the checkpoint converter built on it."""


# -- the import graph -------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = list((REPO / PACKAGE).rglob("*.py")) + list((REPO / "scripts").rglob("*.py"))
    return {_module_name(p): p for p in files if "__pycache__" not in p.parts}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _targets(name: str, path: Path, node: ast.AST, modules: dict) -> Iterator[str]:
    """The modules of ours one import statement reads (a ``from X import m`` of a submodule
    ``m`` reads ``X.m``, not ``X``'s ``__init__``)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:
        base = name.split(".") if _is_package(path) else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    for alias in node.names:
        yield f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source


def _own(target: str, modules: dict) -> Optional[str]:
    """``target`` (a dotted path) as one of our modules, or None for a foreign one."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, every import statement anywhere counted.
    Scripts import their sibling scripts by bare name (the folder is put on the path)."""
    modules = _sources()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, path, node, modules):
                if name.startswith("scripts.") and not target.startswith((PACKAGE, "scripts")):
                    target = f"scripts.{target}"
                own = _own(target, modules)
                if own is not None and own != name:
                    graph[name].add(own)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


# -- floors -----------------------------------------------------------------------------
def _relative(module: str) -> Optional[str]:
    """``module`` without the package prefix ("" for the root package), None outside it."""
    if module == PACKAGE:
        return ""
    return module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else None


def _under(relative: str, prefix: str) -> bool:
    return relative == prefix or relative.startswith(prefix + ".")


def floor_of(module: str) -> Optional[int]:
    """The floor (0 = top) of one of the package's modules."""
    relative = _relative(module)
    if relative is None:
        return None
    for level, (_, prefixes) in enumerate(FLOORS):
        if any(p and _under(relative, p) for p in prefixes):
            return level
    if relative in VOCABULARY:
        return len(FLOORS) - 1
    return next(level for level, (_, prefixes) in enumerate(FLOORS) if prefixes == ("",))


def _describe(level: int) -> str:
    return FLOORS[level][0]


GRAPH = import_graph()


def test_the_graph_sees_every_kind_of_import():
    """The walker counts function-level and TYPE_CHECKING imports (the ways circles hide)."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import b\n"
                     "def f():\n    from ..c import d\n")
    levels = [n.level for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert levels == [0, 1, 2]
    assert "megatron_fsdp.runtime.hooks" in GRAPH["megatron_fsdp.megatron_fsdp"]
    assert len(GRAPH) > 150


def test_no_import_circles():
    circles = _circles(GRAPH)
    assert not circles, "import circles (break each by turning a dependency around):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_no_import_runs_up_a_floor():
    upward = []
    for module, targets in GRAPH.items():
        here = floor_of(module)
        if here is None:
            continue
        for target in targets:
            there = floor_of(target)
            if there is not None and there < here:
                upward.append(f"{module} ({_describe(here)}) imports {target} ({_describe(there)})")
    assert not upward, "imports that run up a floor:\n" + "\n".join(sorted(upward))


def test_independent_neighbours_do_not_import_each_other():
    crossings = []
    for first, second in INDEPENDENT:
        for a, b in ((first, second), (second, first)):
            for module, targets in GRAPH.items():
                relative = _relative(module)
                if relative is None or not _under(relative, a):
                    continue
                crossings += [f"{module} imports {t}" for t in targets
                              if _relative(t) is not None and _under(_relative(t), b)]
    assert not crossings, "\n".join(sorted(crossings))


def test_the_engine_never_imports_the_launcher():
    offenders = [f"{m} imports {t}" for m, targets in GRAPH.items() for t in targets
                 if _relative(m) is not None and not _in_launcher(_relative(m))
                 and _relative(t) is not None and _in_launcher(_relative(t))]
    assert not offenders, "\n".join(sorted(offenders))


def _in_launcher(relative: str) -> bool:
    return any(_under(relative, package) for package in LAUNCHER)


def _launcher_may_import(relative: str) -> bool:
    if _in_launcher(relative):
        return True
    return any(relative == allowed or (allowed in ("models", "interop") and _under(relative, allowed))
               for allowed in LAUNCHER_MAY_IMPORT)


def test_the_launcher_uses_only_the_public_surface():
    launcher = [m for m in GRAPH if _relative(m) is not None and _in_launcher(_relative(m))]
    launcher.append("scripts.pretrain_gpt")
    offenders = [f"{m} imports {t}" for m in launcher for t in GRAPH[m]
                 if _relative(t) is not None and not _launcher_may_import(_relative(t))]
    assert not offenders, ("the launcher reaches past the engine's public surface (export what it needs "
                           "from a public module or state/__init__.py):\n" + "\n".join(sorted(offenders)))


def test_importing_the_package_loads_no_launcher_and_no_engine():
    """``import megatron_fsdp`` is cheap and never brings the launcher ([Note: lazy package root])."""
    code = ("import sys, megatron_fsdp\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('megatron_fsdp.'))\n"
            "assert loaded == ['megatron_fsdp.package_info'], loaded\n"
            "assert 'torch' not in sys.modules\n"
            "megatron_fsdp.fully_shard\n"
            "assert not any(m.startswith('megatron_fsdp.training') for m in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("floor", [name for name, prefixes in FLOORS if prefixes not in (("",), VOCABULARY)])
def test_every_floor_has_a_map(floor):
    """Each subpackage's ``__init__`` docstring names every module in it."""
    for prefix in dict(FLOORS)[floor]:
        for init in sorted((REPO / PACKAGE / prefix).rglob("__init__.py")):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            missing = [p.name for p in init.parent.glob("*.py")
                       if p.name != "__init__.py" and p.name not in doc]
            missing += [d.name + "/" for d in init.parent.iterdir()
                        if (d / "__init__.py").exists() and d.name + "/" not in doc]
            assert not missing, f"{init.relative_to(REPO)}: the map does not mention {missing}"
