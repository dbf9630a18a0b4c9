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
the world-1 run (the default). What both share (the user script, each side's package,
the comparison, the command line) is in scripts/upstream_ab_lib/.

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

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream_ab_patterns  # noqa: E402  (this folder is not a package)
from upstream_ab_lib.cli import build_parser, check_args, report  # noqa: E402
from upstream_ab_lib.comparison import compare  # noqa: E402
from upstream_ab_lib.packages import REPO, SIDES, cpu_shim, import_side, unpack_wheel  # noqa: E402
from upstream_ab_lib.user_script import (  # noqa: E402
    PRECISIONS, STRATEGIES, UserScript, bare_run, guarded, master_run, resume_case, train_case)

WAIT_FOR_PEER_S = 240.0  # within the device tool's 10-minute command limit


# -- worker ---------------------------------------------------------------------------------
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
    record["bare"] = guarded(lambda: bare_run(script))
    for precision in args.precisions.split(","):  # the reference loops of each precision
        for name, primed in (("master", False), ("primed", True)):
            record[f"{name}/{precision}"] = guarded(lambda: master_run(script, precision, primed))
    for precision in args.precisions.split(","):
        for strategy in strategies:
            ckpt = here / f"ckpt_{strategy}" if precision == "fp32" and args.checkpoint else None
            record["runs"][f"{precision}/{strategy}"] = guarded(lambda: train_case(script, strategy, precision, ckpt))
    (here / "train.done").touch()
    lap("train")
    if args.checkpoint:
        peer_ready = wait_for_peer(peer_dir)
        lap("wait_for_peer")
        for strategy in strategies:
            record["resume"][f"{side}<-{side}/{strategy}"] = guarded(
                lambda: resume_case(script, strategy, here / f"ckpt_{strategy}"))
            key = f"{side}<-{peer_dir.name}/{strategy}"
            record["resume"][key] = (guarded(lambda: resume_case(script, strategy, peer_dir / f"ckpt_{strategy}"))
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


def main() -> None:
    parser = build_parser(__doc__.splitlines()[0])
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
        record = upstream_ab_patterns.run_from_args(args)
    else:
        record = run_ab(args.upstream_wheel, Path(args.out), args.device, self_check=args.self_check,
                        strategies=args.strategies, precisions=args.precisions, checkpoint=args.checkpoint)
    report(record, Path(args.out))


if __name__ == "__main__":
    main()
