#!/usr/bin/env python3
"""The upstream A/B (scripts/upstream_ab.py) at world size N > 1 and for the user
patterns upstream documents; ``upstream_ab.py --world N --patterns ...`` runs it.

Each side is a torchrun-style group of N processes ("ranks") on gloo, one FileStore
per side; the two sides run one after the other, each in its own process tree
(both packages are named ``megatron_fsdp``, and 2N processes at once would only
slow a small machine). Every rank trains on its slice of each global batch of 16
rows, as a DDP user does (rank r: rows r*16/N to (r+1)*16/N), and the comparison
references are the one-process loops of upstream_ab.py on the global batch.

Patterns (``--patterns``, comma separated), each over the requested strategies:

* ``plain``: ``fully_shard(module, optimizer, ...)``, one forward/backward per step,
  every requested precision (the world-1 script of upstream_ab.py, data split).
* ``accum``: gradient accumulation over 2 microbatches, the DDP idiom the README
  points to: the first backward inside ``model.no_sync()``, the second outside;
  each microbatch loss halved, so the sum is the global-batch mean. With
  ``fully_shard``'s default ``sync_model_each_microbatch=True``.
* ``accum_deferred``: the same with ``sync_model_each_microbatch=False``: the
  optimizer's ``step()`` finishes the deferred gradient sync.
* ``separate``: ``fully_shard_model(module, ...)``, then ``AdamW(model.parameters())``
  and ``fully_shard_optimizer(optimizer)`` (the README's quick start).
* ``hsdp``: world 4 only: a (2, 2, 1) mesh ``("outer", "fsdp", "tp")`` with
  ``dp_outer_dim="outer"``, ``hybrid_fsdp_group`` the group of all four ranks (the
  flattened outer x shard mesh), ``outer_dp_sharding_strategy=0`` (replicate) for
  every strategy, and ``outer_dp_sharding_strategy=1`` (HFSDP) with strategy 3.

Per case the ranks record the global loss per step (the mean of the ranks' local
losses, an all-reduce a DDP user logs) and save ``{"model": model.state_dict(),
"optimizer": optimizer.state_dict()}`` with DCP (the README's recipe, shown bit-equal
across sides at world 1); rank 0 reads it back whole (``dcp_to_torch_save``), so
uneven shards on either side are gathered the same way. Rows pass as in
upstream_ab.py (fp32 within 1e-6, bf16 within one bf16 rounding step, or exactly
upstream's priming step); each row also says whether ours equals the one-process
reference on its own (``ours_exact``), whatever upstream does. A row that fails says
whose number is wrong by that reference, and is listed in ``findings`` with the
distances of upstream to each reference loop (the primed one, and the primed one
with gradients summed over the ranks, which upstream's HFSDP was seen to equal).
Rank 0's optimizer.state_dict() differs in which parameters it lists (upstream leaves
out a parameter whose rank-0 shard is empty, and the two packages cut the buffers at
different offsets); the state_dict rows accept exactly that and nothing else.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream_ab as ab  # noqa: E402  (this folder is not a package)

PATTERNS = ("plain", "accum", "accum_deferred", "separate", "hsdp")
GLOBAL_ROWS = 16  # rows of each global batch (upstream_ab.UserScript.data)
MICROBATCHES = 2
COLLECTIVE_TIMEOUT_S = 120  # a rank stuck in a collective fails the case instead of hanging the run


class RankScript(ab.UserScript):
    """The user script as one of N ranks: its slice of each batch, its own mesh."""

    def __init__(self, mf, device, rank: int, world: int) -> None:
        super().__init__(mf, device)
        self.rank, self.world = rank, world

    def mesh_kwargs(self, pattern: str, outer: int) -> dict:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if pattern != "hsdp":
            mesh = init_device_mesh("cpu", (self.world, 1), mesh_dim_names=("fsdp", "tp"))
            return dict(device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp")
        mesh = init_device_mesh("cpu", (2, self.world // 2, 1), mesh_dim_names=("outer", "fsdp", "tp"))
        return dict(device_mesh=mesh, dp_shard_dim="fsdp", dp_outer_dim="outer", tp_dim="tp",
                    hybrid_fsdp_group=dist.group.WORLD, outer_dp_sharding_strategy=outer)

    def wrap_pattern(self, pattern: str, strategy: str, precision: str, outer: int = 0):
        module = self.build(precision)
        kwargs = dict(fsdp_unit_modules=[self.Block], zero_dp_strategy=ab.STRATEGIES.index(strategy),
                      device=self.device, **self.policy_kwargs(precision), **self.mesh_kwargs(pattern, outer))
        if pattern == "accum_deferred":
            kwargs["sync_model_each_microbatch"] = False
        if pattern == "separate":
            model = self.mf.fully_shard_model(module, **kwargs)
            return model, self.mf.fully_shard_optimizer(self.optimizer(model.parameters()))
        return self.mf.fully_shard(module, self.optimizer(module.parameters()), **kwargs)

    def local(self, tensor):
        rows = GLOBAL_ROWS // self.world
        return tensor[self.rank * rows:(self.rank + 1) * rows].to(self.device)

    def train_pattern(self, model, optimizer, pattern: str, dtype) -> list[float]:
        """Per step the global-batch loss (the mean of the ranks' local losses)."""
        import contextlib

        import torch
        import torch.distributed as dist

        losses = []
        for x, y in self.data:
            x, y = self.local(x), self.local(y)
            optimizer.zero_grad()
            if pattern.startswith("accum"):
                local = 0.0
                for i, (xm, ym) in enumerate(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))):
                    last = i == MICROBATCHES - 1
                    with contextlib.nullcontext() if last else model.no_sync():
                        loss = torch.nn.functional.mse_loss(model(xm.to(dtype)).float(), ym) / MICROBATCHES
                        loss.backward()
                    local += loss.item()
            else:
                loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
                loss.backward()
                local = loss.item()
            optimizer.step()
            total = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(total.item() / self.world)
        return losses


def _flatten_any(state, prefix: str = "") -> dict:
    """A nested dict/list as ``a.b.0.c`` keys (DCP's whole-checkpoint form of both sides)."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    out = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)) and not name.endswith(".params"):
            out.update(_flatten_any(value, name + "."))
        elif not name.endswith(".params"):
            out[name] = value
    return out


def gathered_snapshot(script: RankScript, model, optimizer, folder: Path) -> dict:
    """The whole model and optimizer state, via DCP (collective; rank 0 returns it)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.tensor import DTensor

    model_sd, optim_sd = model.state_dict(), optimizer.state_dict()
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(folder))
    dist.barrier()
    if script.rank != 0:
        return {}
    dcp_to_torch_save(str(folder), str(folder) + ".pt")
    whole = torch.load(str(folder) + ".pt", weights_only=False)
    optim = _flatten_any(whole["optimizer"])
    return dict(model=dict(whole["model"]), optim=optim,
                model_meta={k: ab._meta(v) for k, v in model_sd.items()},
                optim_meta={k: ab._meta(v) for k, v in ab._flatten(optim_sd).items()},
                # Rank 0's shard sizes, per parameter in state_dict order (= optimizer index order).
                param_local_numel=[v.to_local().numel() if isinstance(v, DTensor) else v.numel()
                                   for v in model_sd.values()])


def primed_summed_run(script, world: int) -> dict:
    """upstream_ab's primed fp32 loop with each gradient multiplied by ``world``: the
    gradients summed over the ranks instead of averaged. Observed to reproduce upstream
    0.6.1's HFSDP (``outer_dp_sharding_strategy=1``); AdamW hides most of a gradient
    scale, all but the part its ``eps`` sees."""
    import torch

    module = script.build("fp32")
    main = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    optimizer = script.optimizer(main)
    for p in main:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # upstream's priming step
    losses = []
    for x, y in script.data:
        module.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        losses.append(loss.item())
        for m, p in zip(main, module.parameters()):
            m.grad = p.grad * world
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(main, module.parameters()):
                p.copy_(m)
    return dict(losses=losses, model={k: v.detach().clone() for k, v in module.state_dict().items()})


def cases(patterns: list[str], strategies: list[str], precisions: list[str], world: int) -> list[tuple]:
    """(case name, pattern, strategy, precision, outer) for every run; a case name is
    ``precision/strategy`` (plain) or ``precision/pattern:strategy`` (upstream_ab.compare's form)."""
    out = []
    for pattern in patterns:
        for strategy in strategies:
            for precision in precisions if pattern == "plain" else ["fp32"]:
                name = f"{precision}/{strategy}" if pattern == "plain" else f"{precision}/{pattern}:{strategy}"
                if pattern != "hsdp":
                    out.append((name, pattern, strategy, precision, 0))
                elif world == 4:
                    out.append((name.replace("hsdp:", "hsdp_outer0:"), pattern, strategy, precision, 0))
                    if strategy == "optim_grads_params":  # HFSDP needs inner full sharding (both packages)
                        out.append((name.replace("hsdp:", "hsdp_outer1:"), pattern, strategy, precision, 1))
    return out


def rank_main(args) -> None:
    side, rank, world, out = args.side, args.rank, args.world, Path(args.out)
    here = out / side
    shimmed = ab.cpu_shim() if args.cpu_shim else []
    mf = ab.import_side(side, Path(args.pkg_root), args.fallback_path)
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{here / 'pg_store'}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    script = RankScript(mf, torch.device("cpu"), rank, world)
    record = dict(side=side, package=str(Path(mf.__file__).parent), version=getattr(mf, "__version__", None),
                  torch=torch.__version__, runs={}, resume={}, timings={}, cpu_shim=shimmed)
    start = time.perf_counter()
    todo = cases(args.patterns.split(","), args.strategies.split(","), args.precisions.split(","), world)
    for i, (name, pattern, strategy, precision, outer) in enumerate(todo):
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16

        def run():
            model, optimizer = script.wrap_pattern(pattern, strategy, precision, outer)
            losses = script.train_pattern(model, optimizer, pattern, dtype)
            return dict(losses=losses, **gathered_snapshot(script, model, optimizer, here / f"case{i}"))

        record["runs"][name] = ab._guarded(run)
        dist.barrier()  # line the ranks up after a case some failed (the rest left its collectives at the timeout)
    record["timings"]["train"] = round(time.perf_counter() - start, 2)
    if rank == 0 and side == "ours":  # the one-process references, on the global batch
        plain = ab.UserScript(mf, torch.device("cpu"))
        record["bare"] = ab._guarded(lambda: ab.bare_run(plain))
        record["primed_summed"] = ab._guarded(lambda: primed_summed_run(plain, world))
        for precision in {c[3] for c in todo}:
            for ref, primed in (("master", False), ("primed", True)):
                record[f"{ref}/{precision}"] = ab._guarded(lambda: ab.master_run(plain, precision, primed))
    if rank == 0:
        torch.save(record, here / "result.pt")
    dist.destroy_process_group()


def start_side(side: str, root: Path, out: Path, world: int, opts: list[str], shim: bool, fallback) -> list:
    """One side's N ranks, started together: [(process, log file)]."""
    here = out / side
    here.mkdir(parents=True, exist_ok=True)
    for stale in ["pg_store", "result.pt"]:
        (here / stale).unlink(missing_ok=True)
    procs = []
    for rank in range(world):
        log = open(here / f"log_rank{rank}.txt", "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--rank", str(rank), "--world",
               str(world), "--pkg-root", str(root), "--out", str(out), *opts, *(["--cpu-shim"] if shim else []),
               *(["--fallback-path", str(fallback)] if fallback else [])]
        env = dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1")  # N ranks share a few cores
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(out)), log))
    return procs


def wait_side(side: str, procs: list, out: Path, deadline: float) -> tuple:
    """(returncode, log tail of the first failed rank); a rank past the deadline is killed."""
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
    bad = [r for r, c in enumerate(codes) if c != 0]
    return (0, "") if not bad else (codes[bad[0]], (out / side / f"log_rank{bad[0]}.txt").read_text()[-3000:])


def explain_empty_shard_state(results: dict, record: dict) -> None:
    """A state_dict row whose only mismatches are optimizer-state entries that one side
    lists on rank 0 and the other omits, each for a parameter whose rank-0 shard is
    empty on the omitting side: explained. The two packages cut the flat buffers at
    different places, so rank 0 holds different slices (the global shapes and
    placements still agree; the whole, gathered state is compared in the fp32/bf16
    rows). Optimizer index i is the i-th model parameter: the model holds no buffers."""
    for row in record["sections"]["state_dict"]["rows"]:
        if row.get("passed", True) or "errors" in row:
            continue
        sides = {s: results[s]["runs"][row["case"]] for s in ab.SIDES}
        left, omitted = [], {s: set() for s in ab.SIDES}
        a, b = sides["upstream"]["model_meta"], sides["ours"]["model_meta"]
        left += sorted(a.keys() ^ b.keys()) + [k for k in a.keys() & b.keys() if a[k] != b[k]]
        a, b = sides["upstream"]["optim_meta"], sides["ours"]["optim_meta"]
        left += [k for k in a.keys() & b.keys() if a[k] != b[k]]
        for key in sorted(a.keys() ^ b.keys()):
            omits = "upstream" if key in b else "ours"
            parts = key.split(".")
            sizes = sides[omits].get("param_local_numel", [])
            if parts[0] == "state" and parts[1].isdigit() and int(parts[1]) < len(sizes) and sizes[int(parts[1])] == 0:
                omitted[omits].add(int(parts[1]))
            else:
                left.append(key)
        row["rank0_shard_layout"] = {s: results[s]["runs"][row["case"]].get("param_local_numel") for s in ab.SIDES}
        placements = sorted({f"upstream {a[k]['placements']} vs ours {b[k]['placements']}"
                             for a, b in [(sides["upstream"]["model_meta"], sides["ours"]["model_meta"])]
                             for k in a.keys() & b.keys() if a[k].get("placements") != b[k].get("placements")})
        if placements:
            row["verdict"] = "model.state_dict() DTensor placements differ: " + "; ".join(placements)
        if not left:
            who = " and ".join(f"{s} omits {len(v)} parameters" for s, v in omitted.items() if v)
            row.update(passed=True, verdict=(
                f"rank-local layout only: {who} from rank 0's optimizer.state_dict(), each with an empty rank-0 "
                "shard on that side (the packages shard the flat buffers at different offsets; global shapes and "
                "placements agree, and the gathered state is compared in the fp32/bf16 rows)"))
    section = record["sections"]["state_dict"]
    section["passed"] = bool(section["rows"]) and all(r["passed"] for r in section["rows"])


def classify(record: dict, results: dict) -> None:
    """Per row: does ours equal the one-process reference on its own (``ours_exact``),
    and, where the row fails, whose number is wrong by that reference. Rows where
    ours is exact and upstream is not are listed in ``record["findings"]``."""
    ours_refs = results["ours"]
    summed = ours_refs.get("primed_summed", {})
    findings = []
    for section in ("fp32", "bf16"):
        for row in record["sections"][section]["rows"]:
            tol = row.get("tolerance", ab.FP32_TOL)
            ref = ours_refs.get("bare" if section == "fp32" else f"master/{row['precision']}", {})
            run = ours_refs["runs"].get(row["case"], {})
            ours = ab.max_abs_diff(run["model"], ref["model"])[0] if "model" in run and "model" in ref else None
            row["ours_vs_reference"] = ours
            row["ours_exact"] = ours is not None and ours <= tol
            if row["passed"]:
                continue
            upstream = results["upstream"]["runs"].get(row["case"], {})
            if "model" in upstream and "model" in summed:
                row["vs_primed_summed_adamw"] = {"upstream": ab.max_abs_diff(upstream["model"], summed["model"])[0]}
            if row.get("errors") and set(row["errors"]) == {"upstream"}:
                row["verdict"] = "upstream failed (see errors); ours " + ("equals" if row["ours_exact"] else
                                                                          "differs from") + " the reference"
            elif row["ours_exact"] and row.get("vs_primed_summed_adamw", {}).get("upstream", 1.0) <= tol:
                row["verdict"] = ("upstream's number is wrong: it equals the primed loop with gradients summed over "
                                  "the ranks (not averaged); ours equals the one-process reference")
            elif row["ours_exact"]:
                row["verdict"] = ("upstream's number is wrong: it differs from the one-process reference (and the "
                                  "primed one) beyond tolerance; ours equals the reference")
            else:
                row["verdict"] = "ours differs from the one-process reference"
            findings.append(dict(case=row["case"], verdict=row["verdict"], upstream_error=row.get("errors"),
                                 ours_vs_reference=ours, upstream_vs=dict(
                                     reference=row.get("vs_bare_adamw", row.get("vs_master_adamw", {})).get("upstream"),
                                     primed=row.get("vs_primed_adamw", {}).get("upstream"),
                                     primed_summed=row.get("vs_primed_summed_adamw", {}).get("upstream"))))
    record["findings"] = findings
    record["ours_exact_everywhere"] = all(r["ours_exact"] for sec in ("fp32", "bf16")
                                          for r in record["sections"][sec]["rows"])


def run_multi(upstream_wheel, out: Path, *, world: int, patterns: str, self_check: bool = False,
              strategies: str = ",".join(ab.STRATEGIES), precisions: str = ",".join(ab.PRECISIONS),
              timeout: float = 600.0) -> dict:
    """Both sides at world ``world`` for ``patterns``; the record (``out/upstream_ab.json``)."""
    import json

    start = time.perf_counter()
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(patterns.split(",")) - set(PATTERNS)
    if unknown:
        raise ValueError(f"--patterns {sorted(unknown)} not among {', '.join(PATTERNS)}")
    if self_check:
        roots, fallback = {"upstream": ab.REPO, "ours": ab.REPO}, None
    else:
        wheel = Path(upstream_wheel).resolve()
        roots = {"upstream": ab.unpack_wheel(wheel, out), "ours": ab.REPO}
        deps = wheel.parent / "deps"
        fallback = deps if deps.is_dir() else None
    opts = ["--patterns", patterns, "--strategies", strategies, "--precisions", precisions]
    deadline, status, running = time.monotonic() + timeout, {}, {}
    for side in ab.SIDES:
        running[side] = start_side(side, roots[side], out, world, opts, side == "upstream" and not self_check,
                                   fallback if side == "upstream" else None)
        if world > 2:  # 2N ranks at once would crowd a small machine; at N <= 2 both sides overlap
            status[side] = wait_side(side, running.pop(side), out, deadline)
    status.update({side: wait_side(side, procs, out, deadline) for side, procs in running.items()})
    record = dict(self_check=self_check, device="cpu", world=world, patterns=patterns.split(","),
                  upstream_wheel=str(upstream_wheel) if upstream_wheel else None,
                  workers={s: dict(returncode=rc, package=str(roots[s])) for s, (rc, _) in status.items()})
    if world != 4 and "hsdp" in patterns.split(","):
        record["hsdp_skipped"] = "hsdp runs at world 4 only (a 2 x 2 mesh)"
    failed = {s: tail for s, (rc, tail) in status.items() if rc != 0}
    if failed:
        record.update(passed=False, error="a rank failed", logs=failed)
    else:
        import torch

        results = {s: torch.load(out / s / "result.pt", weights_only=False) for s in ab.SIDES}
        for s in ab.SIDES:
            record["workers"][s].update(version=results[s]["version"], imported_from=results[s]["package"],
                                        seconds=results[s]["timings"], cpu_shim=results[s]["cpu_shim"])
        record["sections"] = ab.compare(results)
        explain_empty_shard_state(results, record)
        classify(record, results)
        verdicts = [sec["passed"] for sec in record["sections"].values() if sec["passed"] is not None]
        record["passed"] = bool(verdicts) and all(verdicts)
    record["seconds"] = round(time.perf_counter() - start, 1)
    (out / "upstream_ab.json").write_text(json.dumps(record, indent=1, default=str))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank of one side (started by run_multi)")
    parser.add_argument("--side", choices=ab.SIDES, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--pkg-root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--patterns", required=True)
    parser.add_argument("--strategies", required=True)
    parser.add_argument("--precisions", required=True)
    parser.add_argument("--cpu-shim", action="store_true")
    parser.add_argument("--fallback-path")
    rank_main(parser.parse_args())


if __name__ == "__main__":
    main()
