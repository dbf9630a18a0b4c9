#!/usr/bin/env python3
"""A/B check against upstream Megatron-FSDP: the same user script, run once with
upstream's package and once with ours, must give the same numbers.

    python scripts/upstream_ab.py --upstream-wheel megatron_fsdp-0.6.1-py3-none-any.whl --out DIR [--device cuda|cpu]
    python scripts/upstream_ab.py --self-check --device cpu --out DIR   # ours on both sides (CI)
    python scripts/upstream_ab.py --upstream-wheel W --out DIR --device cpu --world 4 --patterns plain,accum,hsdp

``--world N`` (N > 1) or ``--patterns`` runs scripts/upstream_ab_patterns.py instead:
each side a group of N gloo ranks on its slice of every batch, and the user patterns
upstream documents (gradient accumulation, ``fully_shard_model`` +
``fully_shard_optimizer``, HSDP); its docstring says what is run. What follows is
the world-1 run (the default).

Both packages are called ``megatron_fsdp``, so each side is its own subprocess
("worker") with its own ``sys.path``: upstream's side puts the unpacked wheel first,
ours the repository root, and each checks where ``megatron_fsdp`` was imported from.
Upstream's side blocks ``megatron`` imports (``sys.modules["megatron"] = None``):
with megatron-core importable, upstream would take megatron.core's
``DistributedDataParallelConfig``, which lacks fields it passes. Ours blocks it too,
so both sides see the same environment.

Each worker, at world size 1 on a real process group (NCCL on cuda, gloo on cpu, a
FileStore so the two workers never race for a port), runs the user script below:

    torch.manual_seed(0); module = Net() on the device (bf16 rows: .to(torch.bfloat16))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[Block],
                                                 zero_dp_strategy=<0..3>, [mixed_precision_policy=...])
    5 x (optimizer.zero_grad(); mse_loss(model(x), y).backward(); optimizer.step())

The upstream calls made, and nothing else of upstream's (no internals):

* ``megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[Block],
  zero_dp_strategy=s)`` with upstream's defaults for every other argument; the bf16
  rows add ``mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=
  torch.float32)`` (the README's form) or ``MixedPrecisionPolicy(main_params_dtype=
  torch.float32, main_grads_dtype=torch.float32)``. Only with ``--device cpu`` (where
  upstream's default mesh, built on "cuda", cannot exist) the call also passes
  ``device=cpu, device_mesh=init_device_mesh("cpu", (1, 1), ("fsdp", "tp")),
  dp_shard_dim="fsdp", tp_dim="tp"``: upstream's default names for its default mesh.
* ``model(x)``, ``optimizer.zero_grad()``, ``optimizer.step()`` (the methods that
  ``fully_shard`` installs), ``model.state_dict()``, ``optimizer.state_dict()``.
* The README's checkpoint recipe: ``torch.distributed.checkpoint.save({"model":
  model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)``;
  to load, the same dict of a freshly wrapped model, ``torch.distributed.checkpoint.
  load(state_dict=ckpt, checkpoint_id=path)``, ``model.load_state_dict(ckpt["model"],
  strict=False)``, ``optimizer.load_state_dict(ckpt["optimizer"])``.

What is compared (``DIR/upstream_ab.json``, one row per comparison, each with its max
abs difference and a pass flag; a comparison that could not run says why):

* ``fp32``: weights (``model.state_dict()``, DTensors gathered), optimizer state and
  losses after 5 AdamW steps, zero_dp_strategy 0..3; goal 0.0, pass within 1e-6.
  Each row also records each side's distance to a plain PyTorch AdamW loop, for triage.
* ``bf16``: the same for both bf16 policies; pass within one bf16 rounding step of
  the largest weight (2^-7 * max |w|).
* ``state_dict``: keys, shapes, dtypes, tensor types and DTensor placements of
  ``model.state_dict()`` and ``optimizer.state_dict()``, per strategy and precision.
* ``checkpoint``: the fp32 run saves at step 3 (DCP) and goes on to step 5. Each side
  then loads the other's checkpoint (and, as a control, its own) into a fresh model
  built from another seed, trains steps 4-5 and must match both sides' uninterrupted
  runs within 1e-6.

The two workers run at once; each trains and saves, then waits for the other's
checkpoints (a marker file) before resuming from them.

Upstream needs CUDA. With ``--device cpu`` and a wheel, its side runs under
``cpu_shim()``: the ``torch.cuda`` names it calls (current_device, Stream, Event,
stream, current_stream, synchronize, empty_cache, ``Tensor.cuda``) become no-ops or
device 0, and NCCL's pre-multiplied sum, which gloo lacks, becomes scale-then-SUM (a
reduce-scatter's input scaled as a copy: NCCL leaves it as it was).
Upstream's files are not modified; the JSON lists what was patched. Only the GPU run
is shim-free. Upstream imports ``packaging``; a copy in ``deps/`` beside the wheel is
put last on its ``sys.path`` for machines without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = ("upstream", "ours")
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
PRECISIONS = ("fp32", "bf16", "bf16_fp32_grads")
STEPS, SAVE_AT = 5, 3
FP32_TOL = 1e-6
BF16_REL = 2.0 ** -7  # bf16 keeps 8 significant bits: one rounding step is <= 2^-7 |w|
WAIT_FOR_PEER_S = 240.0  # within the device tool's 10-minute command limit


# -- the user script (runs inside a worker, with one side's megatron_fsdp) -------------------
def _model_classes():
    """Net and Block, built on first use so the driver never imports torch for them."""
    import torch
    from torch import nn

    class Block(nn.Module):
        """Residual MLP block (tests/models.py's shape: 2d+1 divides by nothing)."""

        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 2 * d + 1)
            self.fc2 = nn.Linear(2 * d + 1, d)

        def forward(self, x):
            return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, d: int = 32, depth: int = 3) -> None:
            super().__init__()
            self.inp = nn.Linear(5, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
            self.norm = nn.LayerNorm(d)
            self.out = nn.Linear(d, 3)

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.out(self.norm(h))

    return Net, Block


class UserScript:
    """The training a user writes, against whichever ``megatron_fsdp`` was imported."""

    def __init__(self, mf, device) -> None:
        import torch

        self.mf, self.torch, self.device = mf, torch, device
        self.Net, self.Block = _model_classes()
        g = torch.Generator().manual_seed(1234)
        self.data = [(torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)) for _ in range(STEPS)]

    def policy_kwargs(self, precision: str) -> dict:
        torch = self.torch
        if precision == "fp32":
            return {}
        grads = {"main_grads_dtype": torch.float32} if precision == "bf16_fp32_grads" else {}
        return {"mixed_precision_policy": self.mf.MixedPrecisionPolicy(main_params_dtype=torch.float32, **grads)}

    def build(self, precision: str, seed: int = 0):
        torch = self.torch
        torch.manual_seed(seed)
        module = self.Net().to(self.device)
        return module.to(torch.bfloat16) if precision != "fp32" else module

    def optimizer(self, params):
        return self.torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.1)

    def wrap(self, strategy: str, precision: str, seed: int = 0):
        module = self.build(precision, seed)
        kwargs = dict(fsdp_unit_modules=[self.Block], zero_dp_strategy=STRATEGIES.index(strategy))
        kwargs.update(self.policy_kwargs(precision))
        if self.device.type == "cpu":  # upstream's default mesh is a "cuda" mesh
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("fsdp", "tp"))
            kwargs.update(device=self.device, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp")
        return self.mf.fully_shard(module, self.optimizer(module.parameters()), **kwargs)

    def train(self, model, optimizer, steps: range, dtype) -> list[float]:
        torch = self.torch
        losses = []
        for i in steps:
            x, y = (t.to(self.device) for t in self.data[i])
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    def checkpoint_dict(self, model, optimizer) -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def save(self, model, optimizer, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.checkpoint_dict(model, optimizer), checkpoint_id=str(path))

    def load(self, model, optimizer, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        ckpt = self.checkpoint_dict(model, optimizer)
        dcp.load(state_dict=ckpt, checkpoint_id=str(path))
        model.load_state_dict(ckpt["model"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])


# -- what a worker records -----------------------------------------------------------------
def _full(value):
    """A state-dict value as a full CPU tensor (world size 1: the local shard is whole)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        try:
            value = value.full_tensor()
        except Exception:  # an uneven-DTensor wrapper that cannot redistribute: read the shard
            local = value.to_local()
            value = local.reshape(value.shape) if local.numel() == value.numel() else local
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _meta(value) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return dict(type="DTensor", shape=list(value.shape), dtype=str(value.dtype),
                    placements=[str(p) for p in value.placements], mesh=list(value.device_mesh.shape))
    if isinstance(value, torch.Tensor):
        return dict(type=type(value).__name__, shape=list(value.shape), dtype=str(value.dtype))
    return dict(type=type(value).__name__, value=repr(value)[:80])


def _flatten(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        elif isinstance(value, list) and name.endswith("param_groups"):
            for i, group in enumerate(value):
                out.update(_flatten({k: v for k, v in group.items() if k != "params"}, f"{name}.{i}."))
        else:
            out[name] = value
    return out


def snapshot(model, optimizer) -> dict:
    model_sd = model.state_dict()
    optim_sd = _flatten(optimizer.state_dict())
    return dict(model={k: _full(v) for k, v in model_sd.items()}, model_meta={k: _meta(v) for k, v in model_sd.items()},
                optim={k: _full(v) for k, v in optim_sd.items()}, optim_meta={k: _meta(v) for k, v in optim_sd.items()})


def _guarded(fn) -> dict:
    """Run one case; a failure is recorded (with its traceback) and the others go on."""
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        result = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def bare_run(script: UserScript) -> dict:
    """The fp32 user script without ``fully_shard``: plain AdamW on the module."""
    torch = script.torch
    module = script.build("fp32")
    losses = script.train(module, script.optimizer(module.parameters()), range(STEPS), torch.float32)
    return dict(losses=losses, model={k: v.detach().cpu().clone() for k, v in module.state_dict().items()})


def master_run(script: UserScript, precision: str, primed: bool) -> dict:
    """Plain AdamW over a separate fp32 copy of the weights (the main weights): per step,
    the module's gradients (in its own dtype) onto the copy, ``step()``, copy back (rounded
    to the module's dtype). With ``primed``, one ``step()`` on zero gradients first (step
    count 1, one weight decay of the copy, which the first forward does not see): observed
    to reproduce upstream 0.6.1 exactly on CPU (its ``fully_shard_optimizer`` steps once to
    create the optimizer state); without it, what ours is meant to equal."""
    torch = script.torch
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    module = script.build(precision)
    main = [p.detach().float().clone().requires_grad_(True) for p in module.parameters()]
    optimizer = script.optimizer(main)
    if primed:
        for p in main:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
    losses = []
    for x, y in script.data:
        module.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x.to(script.device).to(dtype)).float(), y.to(script.device))
        loss.backward()
        losses.append(loss.item())
        for m, p in zip(main, module.parameters()):
            m.grad = p.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for m, p in zip(main, module.parameters()):
                p.copy_(m)
    return dict(losses=losses, model={k: v.detach().cpu().clone() for k, v in module.state_dict().items()})


def train_case(script: UserScript, strategy: str, precision: str, ckpt: Path | None) -> dict:
    torch = script.torch
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model, optimizer = script.wrap(strategy, precision)
    losses = script.train(model, optimizer, range(SAVE_AT), dtype)
    if ckpt is not None:
        script.save(model, optimizer, ckpt)
    losses += script.train(model, optimizer, range(SAVE_AT, STEPS), dtype)
    return dict(losses=losses, **snapshot(model, optimizer))


def resume_case(script: UserScript, strategy: str, ckpt: Path) -> dict:
    model, optimizer = script.wrap(strategy, "fp32", seed=7)  # other weights: the load must replace them all
    script.load(model, optimizer, ckpt)
    losses = script.train(model, optimizer, range(SAVE_AT, STEPS), script.torch.float32)
    return dict(losses=losses, **snapshot(model, optimizer))


# -- worker ---------------------------------------------------------------------------------
class _NoStream:
    """Stands in for a CUDA stream or event on a CPU-only torch: work is already in order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):  # wait_stream, record_event, wait, synchronize, ...
        return lambda *args, **kwargs: _NoStream()

    def query(self) -> bool:
        return True


def cpu_shim() -> list[str]:
    """Let upstream run on a CPU-only torch: the ``torch.cuda`` calls it makes at wrap
    time and per step become no-ops or report device 0. Upstream's own code is not
    touched; these are the names patched, recorded in the JSON."""
    import contextlib

    import torch

    patches = dict(current_device=lambda: 0, Stream=_NoStream, Event=_NoStream,
                   current_stream=lambda *a, **k: _NoStream(), stream=lambda *a, **k: contextlib.nullcontext(),
                   synchronize=lambda *a, **k: None, empty_cache=lambda: None)
    for name, value in patches.items():
        setattr(torch.cuda, name, value)
    torch.Tensor.cuda = lambda self, *a, **k: self  # a boundary check moves a small tensor to "cuda"
    return sorted(f"torch.cuda.{name}" for name in patches) + ["torch.Tensor.cuda"] + _premul_sum_on_gloo()


class _PremulSum:
    """What ``_make_nccl_premul_sum(factor)`` returns under the shim: the factor, to
    be applied before a SUM (gloo has no PREMUL_SUM)."""

    def __init__(self, factor) -> None:
        self.factor = factor


def _premul_sum_on_gloo() -> list[str]:
    """NCCL's pre-multiplied sum as SUM of scaled data, leaving what NCCL leaves: an
    all-reduce's tensor is its output too (scaled in place); a reduce-scatter's input
    is not, so a scaled copy is sent. Upstream's 'optim' strategy reduce-scatters a
    whole gradient buffer into its own shard and keeps the rest of the buffer, and
    scaling that rest in place would change what a later microbatch adds to."""
    import torch.distributed as dist

    def unfused(collective, tensor_arg: str, position: int, in_place: bool):
        def call(*args, **kwargs):
            op = kwargs.get("op")
            if isinstance(op, _PremulSum):
                tensor = kwargs[tensor_arg] if tensor_arg in kwargs else args[position]
                if in_place:
                    tensor.mul_(op.factor)
                elif tensor_arg in kwargs:
                    kwargs[tensor_arg] = tensor * op.factor
                else:
                    args = (*args[:position], tensor * op.factor, *args[position + 1:])
                kwargs["op"] = dist.ReduceOp.SUM
            return collective(*args, **kwargs)

        return call

    dist._make_nccl_premul_sum = _PremulSum
    dist.all_reduce = unfused(dist.all_reduce, "tensor", 0, in_place=True)
    dist.reduce_scatter_tensor = unfused(dist.reduce_scatter_tensor, "input", 1, in_place=False)
    return ["torch.distributed._make_nccl_premul_sum", "torch.distributed.all_reduce",
            "torch.distributed.reduce_scatter_tensor"]


def import_side(side: str, pkg_root: Path, fallback: str | None = None):
    """Import ``megatron_fsdp`` from ``pkg_root`` only, with ``megatron`` blocked;
    ``fallback`` (last on ``sys.path``) supplies upstream's pure-Python dependency
    ``packaging`` where the machine lacks it."""
    sys.modules["megatron"] = None  # see the module docstring
    sys.path.insert(0, str(pkg_root))
    if fallback:
        sys.path.append(fallback)
    import megatron_fsdp

    where = Path(megatron_fsdp.__file__).resolve()
    if pkg_root.resolve() not in where.parents:
        raise RuntimeError(f"{side}: megatron_fsdp came from {where}, not from {pkg_root}")
    return megatron_fsdp


def worker_main(args) -> None:
    side, out = args.worker, Path(args.out)
    here, peer_dir = out / side, out / ("ours" if args.worker == "upstream" else "upstream")
    here.mkdir(parents=True, exist_ok=True)
    clock, timings = time.perf_counter(), {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 2)
        clock = now

    shimmed = cpu_shim() if args.cpu_shim else []
    mf = import_side(side, Path(args.pkg_root), args.fallback_path)
    import torch
    import torch.distributed as dist

    lap("import")

    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)  # a user script's line; upstream reads the current device
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    store = here / "pg_store"
    store.unlink(missing_ok=True)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    lap("init_process_group")
    script = UserScript(mf, device)
    strategies = args.strategies.split(",")
    record = dict(side=side, package=str(Path(mf.__file__).parent), version=getattr(mf, "__version__", None),
                  torch=torch.__version__, runs={}, resume={}, timings=timings, cpu_shim=shimmed)
    record["bare"] = _guarded(lambda: bare_run(script))
    for precision in args.precisions.split(","):  # the reference loops of each precision
        for name, primed in (("master", False), ("primed", True)):
            record[f"{name}/{precision}"] = _guarded(lambda: master_run(script, precision, primed))
    for precision in args.precisions.split(","):
        for strategy in strategies:
            ckpt = here / f"ckpt_{strategy}" if precision == "fp32" and args.checkpoint else None
            record["runs"][f"{precision}/{strategy}"] = _guarded(lambda: train_case(script, strategy, precision, ckpt))
    (here / "train.done").touch()
    lap("train")
    if args.checkpoint:
        peer_ready = wait_for_peer(peer_dir)
        lap("wait_for_peer")
        for strategy in strategies:
            record["resume"][f"{side}<-{side}/{strategy}"] = _guarded(
                lambda: resume_case(script, strategy, here / f"ckpt_{strategy}"))
            key = f"{side}<-{peer_dir.name}/{strategy}"
            record["resume"][key] = (_guarded(lambda: resume_case(script, strategy, peer_dir / f"ckpt_{strategy}"))
                                     if peer_ready is True else dict(error=peer_ready))
    lap("resume")
    torch.save(record, here / "result.pt")
    dist.destroy_process_group()


def wait_for_peer(peer_dir: Path):
    """True once the other side's checkpoints are written, else why not."""
    deadline = time.monotonic() + WAIT_FOR_PEER_S
    while time.monotonic() < deadline:
        if (peer_dir / "train.done").exists():
            return True
        if (peer_dir / "failed").exists():
            return f"the {peer_dir.name} worker failed before saving: see its log"
        time.sleep(0.05)
    return f"the {peer_dir.name} worker wrote no checkpoint within {WAIT_FOR_PEER_S:.0f} s"


# -- driver ---------------------------------------------------------------------------------
def unpack_wheel(wheel: Path, dest: Path) -> Path:
    """The pure-Python wheel unpacked under ``dest``; the directory holding ``megatron_fsdp``."""
    root = dest / "upstream_pkg"
    shutil.rmtree(root, ignore_errors=True)  # never a copy from another wheel
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(root)
    return root


def run_workers(roots: dict, out: Path, device: str, opts: list[str], timeout: float, cpu_shim: tuple = (),
                fallbacks: dict | None = None) -> dict:
    """Start both sides at once, wait for both; {side: (returncode, log tail)}."""
    procs, fallbacks = {}, fallbacks or {}
    for side in SIDES:  # markers of an earlier run in this folder would release a waiting peer too early
        (out / side).mkdir(parents=True, exist_ok=True)
        for stale in ("train.done", "failed", "result.pt"):
            (out / side / stale).unlink(missing_ok=True)
    for side in SIDES:
        log = open(out / side / "log.txt", "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--pkg-root", str(roots[side]),
               "--out", str(out), "--device", device, *opts, *(["--cpu-shim"] if side in cpu_shim else []),
               *(["--fallback-path", str(fallbacks[side])] if side in fallbacks else [])]
        env = dict(os.environ, PYTHONPATH="")  # each side's sys.path is set by import_side alone
        procs[side] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(out)), log)
    deadline, status = time.monotonic() + timeout, {}
    while len(status) < len(procs):
        for side, (proc, log) in procs.items():
            if side in status:
                continue
            rc = proc.poll()
            if rc is None and time.monotonic() > deadline:
                proc.kill()
                rc = proc.wait()
            if rc is not None:
                log.close()
                if rc != 0:
                    (out / side / "failed").touch()  # the peer stops waiting for this side
                status[side] = (rc, (out / side / "log.txt").read_text()[-3000:])
        time.sleep(0.05)
    return status


def max_abs_diff(a: dict, b: dict, strip: bool = True):
    """Largest elementwise difference over the tensors both dicts hold, and the keys
    only one holds (``module.`` prefixes aside when ``strip``)."""
    import torch

    def norm(d):
        return {(k[len("module."):] if strip and k.startswith("module.") else k): v for k, v in d.items()}

    a, b = norm(a), norm(b)
    worst = 0.0
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape:
                return None, [f"{key}: shape {list(x.shape)} vs {list(y.shape)}"]
            if x.numel():
                worst = max(worst, _not_nan((x.double() - y.double()).abs().max().item()))
        else:  # scalars: a step count may be a tensor on one side and a number on the other
            x, y = _scalar(x), _scalar(y)
            if x != y:
                worst = max(worst, _not_nan(abs(x - y)) if _numeric(x, y) else float("inf"))
    return worst, sorted(a.keys() ^ b.keys())


def _not_nan(diff: float) -> float:
    """A NaN difference as infinity: ``max`` would drop a NaN and pass the row."""
    return float("inf") if diff != diff else diff


def _scalar(value):
    import torch

    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _numeric(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _ok(diff, only_one, tol: float) -> bool:
    return diff is not None and not only_one and diff <= tol


def _explained_by_priming(row: dict, tol: float) -> bool:
    """Whether ours equals the fp32-main-weights AdamW loop and upstream the primed one, in
    the final weights and in every step's loss."""
    diffs = [row.get("vs_master_adamw", {}).get("ours"), row.get("vs_primed_adamw", {}).get("upstream"),
             row.get("vs_master_losses", {}).get("ours"), row.get("vs_primed_losses", {}).get("upstream")]
    return all(d is not None and d <= tol for d in diffs)


def compare(results: dict) -> dict:
    """The four sections of the A/B record from both sides' results."""
    up, ours = results["upstream"], results["ours"]
    sections = {"fp32": [], "bf16": [], "state_dict": [], "checkpoint": []}
    for case in sorted(up["runs"].keys() | ours["runs"].keys()):
        precision, strategy = case.split("/")
        u, o = up["runs"].get(case, {}), ours["runs"].get(case, {})
        row = dict(case=case, precision=precision, strategy=strategy)
        errors = {s: r.get("error", "not run") for s, r in (("upstream", u), ("ours", o)) if "model" not in r}
        if errors:
            row.update(passed=False, errors=errors)
            sections["fp32" if precision == "fp32" else "bf16"].append(row)
            sections["state_dict"].append(dict(row))
            continue
        if precision == "fp32":
            tol = FP32_TOL
        else:
            tol = BF16_REL * max(v.abs().max().item() for v in u["model"].values() if v.is_floating_point() and v.numel())
        w_diff, w_only = max_abs_diff(u["model"], o["model"])
        s_diff, s_only = max_abs_diff(u["optim"], o["optim"], strip=False)
        l_diff = max(_not_nan(abs(a - b)) for a, b in zip(u["losses"], o["losses"]))
        row.update(max_abs_diff_weights=w_diff, max_abs_diff_optim_state=s_diff, max_abs_diff_losses=l_diff,
                   tolerance=tol, keys_on_one_side=(w_only + s_only)[:20])
        # For triage: which reference loop each side matches (computed on ours' side).
        refs = {"bare": ours.get("bare", {}) if precision == "fp32" else {},
                "master": ours.get(f"master/{precision}", {}), "primed": ours.get(f"primed/{precision}", {})}
        for ref, result in refs.items():
            if "model" in result:
                row[f"vs_{ref}_adamw"] = {s: max_abs_diff(r["model"], result["model"])[0]
                                          for s, r in (("upstream", u), ("ours", o))}
                row[f"vs_{ref}_losses"] = {s: max(_not_nan(abs(a - b)) for a, b in zip(r["losses"], result["losses"]))
                                           for s, r in (("upstream", u), ("ours", o))}
        row["passed"] = _ok(w_diff, w_only, tol) and _ok(s_diff, s_only, tol) and l_diff <= tol
        row["verdict"] = "equal" if row["passed"] else "differs"
        if not row["passed"] and _explained_by_priming(row, tol):
            # A known difference, kept on purpose: upstream's fully_shard_optimizer steps once
            # on zero gradients (step count one ahead, one weight decay of the main weights);
            # ours equals plain AdamW. The row passes only if each side matches its own
            # reference loop exactly, so any other difference still fails it.
            row.update(passed=True, verdict="upstream's priming step (a known difference): ours matches the AdamW "
                                           "reference loop, upstream the primed one, each within the row's tolerance")
        sections["fp32" if precision == "fp32" else "bf16"].append(row)
        sections["state_dict"].append(dict(case=case, **compare_meta(u, o)))
    for key in sorted(up["resume"].keys() | ours["resume"].keys()):
        loader, rest = key.split("<-")
        saver, strategy = rest.split("/")
        resumed = results[loader]["resume"][key]
        row = dict(case=key, loader=loader, saver=saver, strategy=strategy)
        if "model" not in resumed:
            row.update(passed=False, error=resumed.get("error"), traceback=resumed.get("traceback"))
        else:
            # Pass: the loader goes on exactly as the saver's own run did. Against the
            # loader's own run it also differs by whatever the fp32 rows show.
            passed = False
            for side in SIDES:
                straight = results[side]["runs"].get(f"fp32/{strategy}", {})
                if "model" not in straight:
                    row[f"vs_{side}_uninterrupted"] = "the uninterrupted run failed"
                    continue
                diff, only = max_abs_diff(resumed["model"], straight["model"])
                s_diff, s_only = max_abs_diff(resumed["optim"], straight["optim"], strip=False)
                row[f"vs_{side}_uninterrupted"] = dict(weights=diff, optim_state=s_diff, keys_on_one_side=(only + s_only)[:20])
                if side == saver:
                    passed = _ok(diff, only, FP32_TOL) and _ok(s_diff, s_only, FP32_TOL)
            row.update(tolerance=FP32_TOL, passed=passed, criterion="equal to the saver's uninterrupted run")
        sections["checkpoint"].append(row)
    return {name: dict(rows=rows, passed=bool(rows) and all(r["passed"] for r in rows)) if rows
            else dict(rows=[], passed=None, skipped="not requested") for name, rows in sections.items()}


def compare_meta(u: dict, o: dict) -> dict:
    mismatches = []
    for part in ("model_meta", "optim_meta"):
        strip = part == "model_meta"
        a = {k[len("module."):] if strip and k.startswith("module.") else k: v for k, v in u[part].items()}
        b = {k[len("module."):] if strip and k.startswith("module.") else k: v for k, v in o[part].items()}
        mismatches += [f"{part}: {k} only in {'upstream' if k in a else 'ours'}" for k in sorted(a.keys() ^ b.keys())]
        mismatches += [f"{part}: {k}: upstream {a[k]} vs ours {b[k]}" for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    # Keys with their "module." prefix as each side spells them: a checkpoint's key names.
    prefix_same = sorted(u["model_meta"]) == sorted(o["model_meta"])
    if not prefix_same:
        mismatches.insert(0, "model state_dict keys differ in their 'module.' prefix")
    return dict(passed=not mismatches, mismatches=mismatches[:40], mismatch_count=len(mismatches),
                model_keys=len(u["model_meta"]), optim_keys=len(u["optim_meta"]))


def run_ab(upstream_wheel: Path | None, out: Path, device: str, *, self_check: bool = False,
           strategies: str = ",".join(STRATEGIES), precisions: str = ",".join(PRECISIONS),
           checkpoint: bool = True, timeout: float = 300.0) -> dict:
    """Run both workers and compare; the record (also written to ``out/upstream_ab.json``)."""
    start = time.perf_counter()
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if self_check:
        roots = {"upstream": REPO, "ours": REPO}
    elif upstream_wheel is None:
        return dict(passed=None, skipped="no --upstream-wheel given (or --self-check for ours against ours)")
    else:
        roots = {"upstream": unpack_wheel(Path(upstream_wheel).resolve(), out), "ours": REPO}
    # Upstream needs `packaging`; a copy may sit beside the wheel, for machines without it.
    deps = Path(upstream_wheel).resolve().parent / "deps" if upstream_wheel and not self_check else None
    fallbacks = {"upstream": deps} if deps is not None and deps.is_dir() else {}
    opts = ["--strategies", strategies, "--precisions", precisions] + ([] if checkpoint else ["--no-checkpoint"])
    # Upstream needs CUDA; on a CPU-only machine its side runs under cpu_shim().
    shim = ("upstream",) if device == "cpu" and not self_check else ()
    status = run_workers(roots, out, device, opts, timeout, shim, fallbacks)
    record = dict(self_check=self_check, device=device, upstream_wheel=str(upstream_wheel) if upstream_wheel else None,
                  workers={s: dict(returncode=rc, package=str(roots[s]), fallback_path=str(fallbacks.get(s)))
                           for s, (rc, _) in status.items()})
    failed = {s: tail for s, (rc, tail) in status.items() if rc != 0}
    if failed:
        record.update(passed=False, error="a worker failed", logs=failed)
    else:
        import torch

        results = {s: torch.load(out / s / "result.pt", weights_only=False) for s in SIDES}
        for s in SIDES:
            record["workers"][s].update(version=results[s]["version"], torch=results[s]["torch"],
                                        imported_from=results[s]["package"], seconds=results[s]["timings"],
                                        cpu_shim=results[s]["cpu_shim"])
        record["sections"] = compare(results)
        verdicts = [sec["passed"] for sec in record["sections"].values() if sec["passed"] is not None]
        record["passed"] = bool(verdicts) and all(verdicts)
    record["seconds"] = round(time.perf_counter() - start, 1)
    (out / "upstream_ab.json").write_text(json.dumps(record, indent=1, default=str))
    return record


def build_parser() -> argparse.ArgumentParser:
    """The command line, shared with ``upstream_ab_patterns.py`` (which ``--world > 1`` runs)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream-wheel", type=Path, help="upstream megatron_fsdp wheel (pure Python)")
    parser.add_argument("--out", default="results/upstream_ab")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--self-check", action="store_true", help="ours on both sides: checks this script")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--no-checkpoint", dest="checkpoint", action="store_false", help="skip the DCP section")
    parser.add_argument("--world", type=int, default=1, help="ranks per side (> 1: upstream_ab_patterns.py, cpu)")
    parser.add_argument("--patterns", help="comma-separated user patterns (upstream_ab_patterns.PATTERNS)")
    parser.add_argument("--resume-from", type=Path, help="--world > 1: also resume the checkpoints of this earlier "
                        "run's --out (another world size: DCP reshards)")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--pkg-root", help=argparse.SUPPRESS)
    parser.add_argument("--cpu-shim", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fallback-path", help=argparse.SUPPRESS)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.upstream_wheel is None and not args.self_check:
        parser.error("--upstream-wheel PATH is required (or --self-check)")
    if (args.world > 1 or args.patterns) and args.device != "cpu":
        parser.error("--world > 1 / --patterns run on --device cpu only")  # one GPU cannot host N NCCL ranks


def report(record: dict, out: Path) -> None:
    """Print each section's verdict and exit 0 when every section passed."""
    for name, section in record.get("sections", {}).items():
        worst = [r.get("max_abs_diff_weights") for r in section["rows"] if r.get("max_abs_diff_weights") is not None]
        print(f"[upstream_ab] {name}: passed={section['passed']} rows={len(section['rows'])}"
              + (f" worst weight diff={max(worst):.3g}" if worst else ""))
    print(f"[upstream_ab] passed={record['passed']} ({record['seconds']} s); wrote {out / 'upstream_ab.json'}")
    sys.exit(0 if record["passed"] else 1)


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.worker:
        try:
            return worker_main(args)
        except BaseException:
            (Path(args.out) / args.worker).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / args.worker / "failed").touch()
            raise
    check_args(parser, args)
    if args.world > 1 or args.patterns:
        # The multi-rank patterns are their own script, which builds on this one's
        # library; it takes the same command line.
        patterns = Path(__file__).resolve().with_name("upstream_ab_patterns.py")
        sys.exit(subprocess.call([sys.executable, str(patterns), *sys.argv[1:]]))
    record = run_ab(args.upstream_wheel, Path(args.out), args.device, self_check=args.self_check,
                    strategies=args.strategies, precisions=args.precisions, checkpoint=args.checkpoint)
    report(record, Path(args.out))


if __name__ == "__main__":
    main()
