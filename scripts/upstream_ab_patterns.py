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
Checkpoints (``checkpoint=True``, the default; ``--no-checkpoint`` skips them): in
the fp32 ``plain`` and ``hsdp`` cases each side also saves at step 3 with the README's
DCP recipe. A second group of N ranks per side (the "resume" phase) then loads each
side's checkpoint, its own as the control, into a model wrapped from another seed
(``model.load_state_dict(strict=False)``, ``optimizer.load_state_dict``), trains steps
4-5 and must equal the saver's uninterrupted run: weights, every optimizer-state entry
(step count and moments) and losses, fp32 within 1e-6. ``--resume-from DIR`` also
loads the checkpoints of an earlier run at another world size (DCP reshards by global
offsets). A row that differs is compared with the checkpoint read whole and continued
by a plain AdamW loop (gradients averaged, and in HFSDP also summed): equal to it, the
load took everything and only the continuing package's arithmetic differs.
Rank 0's optimizer.state_dict() differs in which parameters it lists (upstream leaves
out a parameter whose rank-0 shard is empty, and the two packages cut the buffers at
different offsets); the state_dict rows accept exactly that and nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream_ab_lib.cli import build_parser, check_args, report  # noqa: E402  (this folder is not a package)
from upstream_ab_lib.comparison import FP32_TOL, compare, max_abs_diff, not_nan, passes  # noqa: E402
from upstream_ab_lib.packages import REPO, SIDES, cpu_shim, import_side, unpack_wheel  # noqa: E402
from upstream_ab_lib.user_script import (  # noqa: E402
    PRECISIONS, SAVE_AT, STEPS, STRATEGIES, UserScript, bare_run, flatten, guarded, master_run, meta_of)

PATTERNS = ("plain", "accum", "accum_deferred", "separate", "hsdp")
GLOBAL_ROWS = 16  # rows of each global batch (UserScript.data)
MICROBATCHES = 2
COLLECTIVE_TIMEOUT_S = 120  # a rank stuck in a collective fails the case instead of hanging the run


class RankScript(UserScript):
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

    def wrap_pattern(self, pattern: str, strategy: str, precision: str, outer: int = 0, seed: int = 0):
        module = self.build(precision, seed)
        kwargs = dict(fsdp_unit_modules=[self.Block], zero_dp_strategy=STRATEGIES.index(strategy),
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

    def train_pattern(self, model, optimizer, pattern: str, dtype, steps: range = range(STEPS)) -> list[float]:
        """Per step the global-batch loss (the mean of the ranks' local losses)."""
        import contextlib

        import torch
        import torch.distributed as dist

        losses = []
        for x, y in (self.data[i] for i in steps):
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
                model_meta={k: meta_of(v) for k, v in model_sd.items()},
                optim_meta={k: meta_of(v) for k, v in flatten(optim_sd).items()},
                # Rank 0's shard sizes, per parameter in state_dict order (= optimizer index order).
                param_local_numel=[v.to_local().numel() if isinstance(v, DTensor) else v.numel()
                                   for v in model_sd.values()])


def primed_summed_run(script, world: int) -> dict:
    """The primed fp32 loop (master_run) with each gradient multiplied by ``world``: the
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
    ``precision/strategy`` (plain) or ``precision/pattern:strategy`` (compare's form)."""
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


def checkpointed(pattern: str, precision: str) -> bool:
    """The cases whose step-SAVE_AT checkpoint the other side resumes: fp32, plain and HSDP."""
    return precision == "fp32" and pattern in ("plain", "hsdp")


def ckpt_dirname(case: str) -> str:
    return case.replace("/", "_").replace(":", "_")


def resume_phase(script: RankScript, todo: list, sources: list, side: str, here: Path, record: dict) -> None:
    """Per checkpointed case and per source (saver side, checkpoint folder, tag, the
    cases the saver ran): a model
    wrapped from another seed (the load must replace every weight), the README's load
    recipe, steps SAVE_AT+1..STEPS, and the gathered final state."""
    import torch.distributed as dist

    j = 0
    for name, pattern, strategy, precision, outer in todo:
        if not checkpointed(pattern, precision):
            continue
        for saver, root, tag, saved_cases in sources:
            if name not in saved_cases:  # another world size's run: HSDP exists at world 4 only
                continue
            folder = Path(root) / ckpt_dirname(name)
            j += 1

            def run(folder=folder, j=j):
                if not (folder / ".metadata").exists():  # the same answer on every rank: no collective is left open
                    return dict(error=f"no checkpoint at {folder} (the saver's run of this case failed)")
                model, optimizer = script.wrap_pattern(pattern, strategy, precision, outer, seed=7)
                script.load(model, optimizer, folder)
                losses = script.train_pattern(model, optimizer, pattern, script.torch.float32,
                                              range(SAVE_AT, STEPS))
                return dict(losses=losses, checkpoint=str(folder),
                            **gathered_snapshot(script, model, optimizer, here / f"resume{j}"))

            record["resume"][f"{side}<-{saver}{tag}/{name}"] = guarded(run)
            dist.barrier()


def rank_main(args) -> None:
    side, rank, world, out = args.side, args.rank, args.world, Path(args.out)
    here = out / side
    shimmed = cpu_shim() if args.cpu_shim else []
    mf = import_side(side, Path(args.pkg_root), args.fallback_path)
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{here / ('pg_store_' + args.phase)}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    script = RankScript(mf, torch.device("cpu"), rank, world)
    record = dict(side=side, package=str(Path(mf.__file__).parent), version=getattr(mf, "__version__", None),
                  torch=torch.__version__, runs={}, resume={}, timings={}, cpu_shim=shimmed)
    start = time.perf_counter()
    todo = cases(args.patterns.split(","), args.strategies.split(","), args.precisions.split(","), world)
    if args.phase == "resume":
        resume_phase(script, todo, json.loads(args.sources), side, here, record)
        record["timings"]["resume"] = round(time.perf_counter() - start, 2)
        if rank == 0:
            torch.save(record, here / "resume.pt")
        dist.destroy_process_group()
        return
    for i, (name, pattern, strategy, precision, outer) in enumerate(todo):
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        ckpt = here / "ckpt" / ckpt_dirname(name) if args.checkpoint and checkpointed(pattern, precision) else None

        def run():
            model, optimizer = script.wrap_pattern(pattern, strategy, precision, outer)
            if ckpt is None:
                losses = script.train_pattern(model, optimizer, pattern, dtype)
            else:  # the README's DCP recipe at step SAVE_AT, then on to the end, uninterrupted
                losses = script.train_pattern(model, optimizer, pattern, dtype, range(SAVE_AT))
                script.save(model, optimizer, ckpt)
                losses += script.train_pattern(model, optimizer, pattern, dtype, range(SAVE_AT, STEPS))
            return dict(losses=losses, **gathered_snapshot(script, model, optimizer, here / f"case{i}"))

        record["runs"][name] = guarded(run)
        dist.barrier()  # line the ranks up after a case some failed (the rest left its collectives at the timeout)
    record["timings"]["train"] = round(time.perf_counter() - start, 2)
    if rank == 0 and side == "ours":  # the one-process references, on the global batch
        plain = UserScript(mf, torch.device("cpu"))
        record["bare"] = guarded(lambda: bare_run(plain))
        record["primed_summed"] = guarded(lambda: primed_summed_run(plain, world))
        for precision in {c[3] for c in todo}:
            for ref, primed in (("master", False), ("primed", True)):
                record[f"{ref}/{precision}"] = guarded(lambda: master_run(plain, precision, primed))
    if rank == 0:
        torch.save(record, here / "result.pt")
    dist.destroy_process_group()


def start_side(side: str, root: Path, out: Path, world: int, opts: list[str], shim: bool, fallback,
               phase: str = "train") -> list:
    """One side's N ranks, started together: [(process, log file)]."""
    here = out / side
    here.mkdir(parents=True, exist_ok=True)
    for stale in [f"pg_store_{phase}", "result.pt" if phase == "train" else "resume.pt"]:
        (here / stale).unlink(missing_ok=True)
    if phase == "train":
        shutil.rmtree(here / "ckpt", ignore_errors=True)  # a stale checkpoint would stand in for a failed save
    procs = []
    for rank in range(world):
        log = open(here / f"log_{phase}_rank{rank}.txt", "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--rank", str(rank), "--world",
               str(world), "--pkg-root", str(root), "--out", str(out), "--phase", phase, *opts,
               *(["--cpu-shim"] if shim else []),
               *(["--fallback-path", str(fallback)] if fallback else [])]
        env = dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1")  # N ranks share a few cores
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(out)), log))
    return procs


def wait_side(side: str, procs: list, out: Path, deadline: float, phase: str = "train") -> tuple:
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
    return (0, "") if not bad else (codes[bad[0]], (out / side / f"log_{phase}_rank{bad[0]}.txt").read_text()[-3000:])


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
        sides = {s: results[s]["runs"][row["case"]] for s in SIDES}
        left, omitted = [], {s: set() for s in SIDES}
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
        row["rank0_shard_layout"] = {s: results[s]["runs"][row["case"]].get("param_local_numel") for s in SIDES}
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
            tol = row.get("tolerance", FP32_TOL)
            ref = ours_refs.get("bare" if section == "fp32" else f"master/{row['precision']}", {})
            run = ours_refs["runs"].get(row["case"], {})
            ours = max_abs_diff(run["model"], ref["model"])[0] if "model" in run and "model" in ref else None
            row["ours_vs_reference"] = ours
            row["ours_exact"] = ours is not None and ours <= tol
            if row["passed"]:
                continue
            upstream = results["upstream"]["runs"].get(row["case"], {})
            if "model" in upstream and "model" in summed:
                row["vs_primed_summed_adamw"] = {"upstream": max_abs_diff(upstream["model"], summed["model"])[0]}
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


def continuation(script, folder: Path, scale: float) -> dict:
    """The checkpoint at ``folder`` read whole and continued by a plain one-process AdamW
    loop for steps SAVE_AT+1..STEPS on the global batch, each gradient times ``scale``
    (``world``: summed over the ranks, upstream's HFSDP arithmetic). A loader equal to it
    read every weight and moment and the step count; only its arithmetic is left."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole_path = folder.parent / f"{folder.name}.whole.pt"
    dcp_to_torch_save(str(folder), str(whole_path))
    whole = torch.load(whole_path, weights_only=False)
    module = script.build("fp32")
    module.load_state_dict({k.removeprefix("module."): v for k, v in whole["model"].items()})  # strict: all of them
    optimizer = script.optimizer(module.parameters())
    state = optimizer.state_dict()
    # Optimizer index i is the i-th parameter of the module (it holds no buffers), on both sides.
    state["state"] = {int(i): dict(st) for i, st in whole["optimizer"]["state"].items()}
    optimizer.load_state_dict(state)
    losses = []
    for x, y in script.data[SAVE_AT:STEPS]:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        for p in module.parameters():
            p.grad.mul_(scale)
        optimizer.step()
        losses.append(loss.item())
    return dict(losses=losses, model={k: v.detach().clone() for k, v in module.state_dict().items()},
                optim=_state_only(_flatten_any(optimizer.state_dict())))


def _state_only(optim: dict) -> dict:
    return {k: v for k, v in optim.items() if k.startswith("state.")}


def _distances(resumed: dict, target: dict) -> dict:
    """Weights, optimizer state (all of it, or its per-parameter part against a
    continuation) and the losses of steps SAVE_AT+1..STEPS."""
    w, w_only = max_abs_diff(resumed["model"], target["model"])
    optim = resumed["optim"] if any(not k.startswith("state.") for k in target["optim"]) else _state_only(resumed["optim"])
    o, o_only = max_abs_diff(optim, target["optim"], strip=False)
    losses = target["losses"][-len(resumed["losses"]):]
    l_diff = max(not_nan(abs(a - b)) for a, b in zip(resumed["losses"], losses))
    # Two empty dicts differ by 0.0: count what was compared, and require some of each.
    counts = dict(weights=len(resumed["model"]), optim_state=len(_state_only(optim)), losses=len(resumed["losses"]))
    ok = (passes(w, w_only, FP32_TOL) and passes(o, o_only, FP32_TOL) and l_diff <= FP32_TOL
          and min(counts.values()) > 0)
    return dict(weights=w, optim_state=o, losses=l_diff, keys_on_one_side=(w_only + o_only)[:20], compared=counts,
                equal=ok)


def checkpoint_section(resumes: dict, savers: dict, world: int) -> dict:
    """One row per (loader, saver, case): the loader's steps SAVE_AT+1..STEPS from the
    saver's step-SAVE_AT checkpoint must equal the saver's uninterrupted run (fp32 within
    1e-6: weights, every optimizer-state entry, losses). ``savers[tag]`` holds, per side,
    the saving run's record and its world size; tag "" is this run."""
    import torch

    script = UserScript(None, torch.device("cpu"))  # build/optimizer/data only: no package is used
    rows = []
    for loader in SIDES:
        for key, resumed in sorted(resumes[loader]["resume"].items()):
            saver_tag, case = key.split("<-")[1].split("/", 1)
            saver, tag = saver_tag.split("@")[0], saver_tag[len(saver_tag.split("@")[0]):]
            saved, saved_world = savers[tag][saver]
            row = dict(case=key, loader=loader, saver=saver, saved_at_world=saved_world, loaded_at_world=world,
                       tolerance=FP32_TOL, criterion="equal to the saver's uninterrupted run")
            straight = saved["runs"].get(case, {})
            own = resumes[loader].get("own_runs", {}).get(case, {})
            if "model" not in straight:
                row.update(passed=False, error=resumed.get("error"), saver_error=straight.get("error"),
                           verdict=f"no checkpoint: {saver}'s own run of this case failed before saving")
            elif "model" not in resumed:
                first_line = (resumed.get("error") or "").splitlines()[:1]
                same = "model" not in own and (own.get("error") or "").splitlines()[:1] == first_line
                row.update(passed=False, error=resumed.get("error"), traceback=resumed.get("traceback"),
                           verdict=f"{loader} cannot run this case at all (its own run failed with the same error)"
                           if same else f"{loader} failed to resume {saver}'s checkpoint")
            if "model" not in straight or "model" not in resumed:
                rows.append(row)
                continue
            row["vs_saver_uninterrupted"] = _distances(resumed, straight)
            if "model" in own and (tag or loader != saver):
                row["vs_loader_uninterrupted"] = _distances(resumed, own)
            row["passed"] = row["vs_saver_uninterrupted"]["equal"]
            row["verdict"] = "continues the saver's run" if row["passed"] else "differs from the saver's run"
            if not row["passed"]:  # triage: did the load take everything, and whose arithmetic is left?
                scales = {"averaged": 1.0, **({"summed": float(world)} if "outer1" in case else {})}
                for name, scale in scales.items():
                    try:
                        ref = continuation(script, Path(resumed["checkpoint"]), scale)
                        row[f"vs_continuation_{name}"] = _distances(resumed, ref)
                        row[f"saver_run_vs_continuation_{name}"] = _distances(
                            dict(straight, losses=straight["losses"][SAVE_AT:]), ref)
                    except Exception as exc:
                        row[f"vs_continuation_{name}"] = dict(error=f"{type(exc).__name__}: {exc}")
                exact = [n for n in scales if row.get(f"vs_continuation_{n}", {}).get("equal")]
                saver_way = [n for n in scales if row.get(f"saver_run_vs_continuation_{n}", {}).get("equal")]
                if exact:
                    row["verdict"] = (f"the load is exact: {loader} equals the checkpoint continued by a plain AdamW "
                                      f"loop with {exact[0]} gradients, the saver's own run "
                                      + (f"the same loop with {saver_way[0]} gradients" if saver_way else
                                         "neither loop"))
            rows.append(row)
    return dict(rows=rows, passed=bool(rows) and all(r["passed"] for r in rows)) if rows else \
        dict(rows=[], passed=None, skipped="no fp32 plain or hsdp case requested")


def _run_phase(phase: str, roots: dict, out: Path, world: int, opts: list[str], self_check: bool, fallback,
               deadline: float) -> dict:
    """Both sides' ranks for one phase; {side: (returncode, log tail)}."""
    status, running = {}, {}
    for side in SIDES:
        running[side] = start_side(side, roots[side], out, world, opts, side == "upstream" and not self_check,
                                   fallback if side == "upstream" else None, phase)
        if world > 2:  # 2N ranks at once would crowd a small machine; at N <= 2 both sides overlap
            status[side] = wait_side(side, running.pop(side), out, deadline, phase)
    status.update({side: wait_side(side, procs, out, deadline, phase) for side, procs in running.items()})
    return status


def run_multi(upstream_wheel, out: Path, *, world: int, patterns: str, self_check: bool = False,
              strategies: str = ",".join(STRATEGIES), precisions: str = ",".join(PRECISIONS),
              checkpoint: bool = True, resume_from: Path | None = None, timeout: float = 600.0) -> dict:
    """Both sides at world ``world`` for ``patterns``; the record (``out/upstream_ab.json``).
    With ``checkpoint`` each side then resumes both sides' step-SAVE_AT checkpoints, and
    with ``resume_from`` (another run's ``--out``, any world size) those of that run too."""
    start = time.perf_counter()
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(patterns.split(",")) - set(PATTERNS)
    if unknown:
        raise ValueError(f"--patterns {sorted(unknown)} not among {', '.join(PATTERNS)}")
    if self_check:
        roots, fallback = {"upstream": REPO, "ours": REPO}, None
    else:
        wheel = Path(upstream_wheel).resolve()
        roots = {"upstream": unpack_wheel(wheel, out), "ours": REPO}
        deps = wheel.parent / "deps"
        fallback = deps if deps.is_dir() else None
    opts = ["--patterns", patterns, "--strategies", strategies, "--precisions", precisions]
    opts += ["--checkpoint"] if checkpoint else []
    deadline = time.monotonic() + timeout
    status = _run_phase("train", roots, out, world, opts, self_check, fallback, deadline)
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

        results = {s: torch.load(out / s / "result.pt", weights_only=False) for s in SIDES}
        for s in SIDES:
            record["workers"][s].update(version=results[s]["version"], imported_from=results[s]["package"],
                                        seconds=results[s]["timings"], cpu_shim=results[s]["cpu_shim"])
        record["sections"] = compare(results)
        explain_empty_shard_state(results, record)
        classify(record, results)
        todo = cases(patterns.split(","), strategies.split(","), precisions.split(","), world)
        if checkpoint and any(checkpointed(c[1], c[3]) for c in todo):
            record["sections"]["checkpoint"] = resume_all(roots, out, world, opts, self_check, fallback, deadline,
                                                          results, resume_from)
        verdicts = [sec["passed"] for sec in record["sections"].values() if sec["passed"] is not None]
        record["passed"] = bool(verdicts) and all(verdicts)
    record["seconds"] = round(time.perf_counter() - start, 1)
    (out / "upstream_ab.json").write_text(json.dumps(record, indent=1, default=str))
    return record


def resume_all(roots, out: Path, world: int, opts: list[str], self_check: bool, fallback, deadline: float,
               results: dict, resume_from: Path | None) -> dict:
    """The resume phase (each side loads each checkpoint) and its checkpoint section."""
    import torch

    savers = {"": {s: (results[s], world) for s in SIDES}}
    sources = [[s, str(out / s / "ckpt"), "", sorted(results[s]["runs"])] for s in SIDES]
    if resume_from is not None:
        other = Path(resume_from).resolve()
        other_world = json.loads((other / "upstream_ab.json").read_text())["world"]
        tag = f"@w{other_world}"
        savers[tag] = {s: (torch.load(other / s / "result.pt", weights_only=False), other_world) for s in SIDES}
        sources += [[s, str(other / s / "ckpt"), tag, sorted(savers[tag][s][0]["runs"])] for s in SIDES]
    status = _run_phase("resume", roots, out, world, opts + ["--sources", json.dumps(sources)], self_check,
                        fallback, deadline)
    failed = {s: tail for s, (rc, tail) in status.items() if rc != 0}
    if failed:
        return dict(rows=[], passed=False, error="a rank failed in the resume phase", logs=failed)
    resumes = {s: torch.load(out / s / "resume.pt", weights_only=False) for s in SIDES}
    for s in SIDES:
        resumes[s]["own_runs"] = results[s]["runs"]
    section = checkpoint_section(resumes, savers, world)
    section["seconds"] = {s: resumes[s]["timings"] for s in SIDES}
    return section


def rank_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one rank of one side (started by run_multi)")
    parser.add_argument("--side", choices=SIDES, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--pkg-root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--patterns", required=True)
    parser.add_argument("--strategies", required=True)
    parser.add_argument("--precisions", required=True)
    parser.add_argument("--cpu-shim", action="store_true")
    parser.add_argument("--fallback-path")
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--phase", choices=("train", "resume"), default="train")
    parser.add_argument("--sources", help="resume phase: JSON [[saver side, checkpoint root, tag], ...]")
    return parser


def run_from_args(args) -> dict:
    """``run_multi`` for the command line of upstream_ab_lib.cli (``--patterns`` default: plain)."""
    return run_multi(args.upstream_wheel, Path(args.out), world=args.world, patterns=args.patterns or "plain",
                     self_check=args.self_check, strategies=args.strategies, precisions=args.precisions,
                     checkpoint=args.checkpoint, resume_from=args.resume_from)


def main() -> None:
    """One rank of one side (``--side``, started by ``run_multi``), or the whole run with
    ``upstream_ab.py``'s command line (which runs ``--world > 1`` / ``--patterns`` here)."""
    if "--side" in sys.argv[1:]:
        return rank_main(rank_parser().parse_args())
    parser = build_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    check_args(parser, args)
    report(run_from_args(args), Path(args.out))


if __name__ == "__main__":
    main()
