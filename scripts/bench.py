"""Speed, communication and memory of megatron_fsdp next to PyTorch DDP and FSDP2.

    python scripts/bench.py --world 2 --model gpt-tiny

launches ``--world`` gloo ranks on this machine per implementation and trains the
same GPT on the same tokens with the same seed and precision through DDP, FSDP2
(``reshard_after_forward`` True and False) and each megatron_fsdp strategy. Rounds
alternate the implementations (A B C ... A B C ...) so that a drifting machine hits
them alike. Per implementation it reports step time (median, IQR, min-max; ratios
to DDP and to the better FSDP2 setting, paired per round), bytes per step per
collective next to the theoretical minimum, and per-rank memory next to the ZeRO
formula; it writes a JSON record and a PNG chart under ``--out`` and prints the
tables. Helpers live in ``scripts/bench_lib/`` (one concern per module).

The DP x TP row (``--tp 2``, the default; ``--tp 1`` leaves it out, ``--impls tp``
runs it alone) launches ``--world x --tp`` ranks once more and trains the same GPT
under the embedded models' tensor-parallel plan (``megatron_fsdp.models.
tensor_parallel.apply_tensor_parallel``, no sequence parallelism) through
megatron_fsdp ZeRO-3 (``device_mesh`` with ``dp_shard_dim="dp", tp_dim="tp"``) and
through FSDP2 2-D (``fully_shard(block, mesh=mesh["dp"])`` per block, then the
root), both in the same processes, alternating per round. Data-parallel rank d trains on what rank d of the plain rows does. It
reports the step time, the paired ratio to FSDP2 2-D, and the largest difference
between the two runs' losses over every step they took.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
import warnings

# bench_lib sits next to this script; the forkserver inherits this sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lib.config import MEGATRON_STRATEGIES, MODEL_PRESETS, BenchConfig, all_impls, parse_csv  # noqa: E402

logger = logging.getLogger("bench")

TP_ROW = "tp"
"""``--impls`` name of the DP x TP row."""
TP_IMPLS = ("mfsdp_zero3_2d", "fsdp2_2d")
"""The DP x TP row's implementations: megatron_fsdp ZeRO-3 over (dp, tp), and FSDP2
per block over mesh["dp"] (the reference of its ratio)."""


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo processes) per implementation")
    parser.add_argument("--model", default="gpt-tiny", choices=list(MODEL_PRESETS))
    parser.add_argument("--steps", type=int, default=5, help="measured steps per implementation per round")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps before measuring")
    parser.add_argument("--rounds", type=int, default=3, help="rounds alternating every implementation")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per rank per step")
    parser.add_argument(
        "--strategies", default=",".join(MEGATRON_STRATEGIES), help="megatron_fsdp strategies, comma-separated"
    )
    parser.add_argument(
        "--impls", default=None,
        help="subset, comma-separated, of " + ",".join(s.name for s in all_impls()) + f",{TP_ROW} (the DP x TP row)"
    )
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument(
        "--isolation",
        default="auto",
        choices=["auto", "persistent", "fresh"],
        help="persistent: one live worker group per implementation; fresh: new workers every round "
        "(bounds memory to one group; re-warms each round); auto: persistent when all fit in memory",
    )
    parser.add_argument("--fsdp-double-buffer", action="store_true",
                        help="megatron_fsdp with pooled temporary buckets (fsdp_double_buffer=True)")
    parser.add_argument("--tp", type=int, default=2,
                        help="tensor-parallel size of the DP x TP row (--world x --tp ranks, megatron_fsdp ZeRO-3 "
                             "against FSDP2 2-D); 1: no such row")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="results/bench", help="folder for the JSON record and the PNG chart")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="re-print the tables and redraw the chart of an earlier record; runs nothing")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    impls = parse_csv(args.impls) if args.impls else None
    plain_impls = tuple(name for name in impls if name != TP_ROW) if impls else None
    args.tp_row = args.tp > 1 and (impls is None or TP_ROW in impls)
    args.plain_rows = impls is None or bool(plain_impls)
    if args.tp_row:
        _check_tp(parser, args)
    cfg = BenchConfig(
        world=args.world,
        model=args.model,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        micro_batch_size=args.micro_batch_size,
        strategies=parse_csv(args.strategies),
        impls=plain_impls or None,
        dtype=args.dtype,
        isolation=args.isolation,
        fsdp_double_buffer=args.fsdp_double_buffer,
        seed=args.seed,
        out=args.out,
    )
    return cfg, args


def _check_tp(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a DP x TP row the model cannot split, before any rank starts."""
    from megatron_fsdp.models import GPTConfig
    from megatron_fsdp.models.tensor_parallel import tensor_parallel_problems

    if args.tp < 1:
        parser.error(f"--tp {args.tp} must be >= 1 (1: no DP x TP row)")
    problems = tensor_parallel_problems(GPTConfig(**MODEL_PRESETS[args.model]), args.tp, sequence_parallel=False)
    if problems:
        parser.error(f"--tp {args.tp} with --model {args.model}: {'; '.join(problems)}; or pass --tp 1 "
                     "(no DP x TP row)")


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    # Imported here: the forkserver re-imports this file as __mp_main__ and must
    # not pay for matplotlib or the runner's imports twice.
    from bench_lib.aggregate import build_record
    from bench_lib.report import summary, write_chart, write_json
    from bench_lib.runner import run_bench

    if args.replot:
        with open(args.replot) as f:
            record = json.load(f)
        json_path = args.replot
        png_path = write_chart(record, os.path.dirname(args.replot) or ".") if "impls" in record else None
    else:
        os.makedirs(cfg.out, exist_ok=True)
        record = {"config": dataclasses.asdict(cfg)}
        if args.plain_rows:
            cells, descriptions, isolation = run_bench(cfg)
            record = build_record(cfg, cells, descriptions, isolation)
        if args.tp_row:
            record["tp_row"] = run_tp_row(cfg, args.tp)
        json_path = write_json(record, cfg.out)
        png_path = write_chart(record, cfg.out) if args.plain_rows else None
    if "impls" in record:
        print(summary(record))
    if "tp_row" in record:
        print("\n" + tp_table(record["tp_row"]))
    print(f"\nwrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return 0


# -- the DP x TP row ---------------------------------------------------------------
def run_tp_row(cfg, tp: int) -> dict:
    """Launch ``cfg.world * tp`` ranks (DP ``cfg.world`` x TP ``tp``), run both
    implementations in them, and aggregate their step times and losses."""
    from bench_lib.aggregate import paired_ratio, time_stats

    world = cfg.world * tp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron_fsdp", "bench_lib.worker"])
    results = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=tp_worker, args=(rank, world, port, cfg, tp, results), daemon=True,
                         name=f"bench-tp-r{rank}") for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        ranks = _collect_tp(procs, results, cfg.collective_timeout_s + 60 * (cfg.rounds + 1))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    impls, round_medians = {}, {}
    for name in TP_IMPLS:
        # A step takes as long as its slowest rank.
        rounds = [[max(per_rank) for per_rank in zip(*(r["times"][name][i] for r in ranks))]
                  for i in range(cfg.rounds)]
        round_medians[name] = [statistics.median(t) for t in rounds]
        impls[name] = {"step_time_s": time_stats([t for r in rounds for t in r]),
                       "round_median_s": round_medians[name], "memory_rank0": ranks[0]["memory"][name],
                       "losses_rank0": ranks[0]["losses"][name]}
    losses = [ranks[0]["losses"][name] for name in TP_IMPLS]
    return {"dp": cfg.world, "tp": tp, "world": world, "impls": impls,
            "ratio_to_fsdp2_2d": paired_ratio(round_medians, TP_IMPLS[0], TP_IMPLS[1]),
            "steps_compared": len(losses[0]),
            "max_loss_diff": max(abs(a - b) for a, b in zip(*losses))}


def _collect_tp(procs, results, timeout_s: float) -> list[dict]:
    """Every rank's result; a rank's traceback, death or silence fails the run."""
    out: list = [None] * len(procs)
    deadline = time.monotonic() + timeout_s
    while any(r is None for r in out):
        try:
            rank, ok, payload = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.name for rank, p in enumerate(procs) if not p.is_alive() and out[rank] is None]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"DP x TP row: {', '.join(dead) or 'no answer in time'}; rerun with "
                                   "--impls tp -v to isolate it") from None
            continue
        if not ok:
            for p in procs:
                p.kill()
            raise RuntimeError(f"DP x TP row failed on rank {rank}:\n{payload}")
        out[rank] = payload
    return out


def tp_worker(rank: int, world: int, port: int, cfg, tp: int, results) -> None:
    """One rank of the DP x TP row (module level: the forkserver pickles it by name)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from bench_lib.worker import make_batches
    from megatron_fsdp.training.local_group import init_local_gloo

    # The output layer's gathered logits are a view; the loss reads them out of place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    try:
        init_local_gloo(rank, world, port, cfg.collective_timeout_s)
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        trainers = [_tp_trainer(name, cfg, mesh) for name in TP_IMPLS]
        # Data-parallel rank d trains on what rank d of the plain rows does; its TP ranks alike.
        data = make_batches(cfg, mesh["dp"].get_local_rank(), mesh["dp"].size())
        results.put((rank, True, _tp_rounds(trainers, data, cfg)))
    except BaseException:  # the coordinator fails the run with this traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _tp_trainer(name: str, cfg, mesh):
    """The GPT under the TP plan, from the same seed for both, wrapped by ``name``."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import megatron_fsdp as mf
    from bench_lib.config import Family, ImplSpec
    from bench_lib.impls import DTYPE_OF, Trainer, param_counts
    from bench_lib.theory import ElementSizes
    from megatron_fsdp.models import GPT, TransformerBlock
    from megatron_fsdp.models.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(cfg.seed)
    module = GPT(cfg.gpt_config)
    counts = param_counts(module)
    apply_tensor_parallel(module, mesh["tp"], sequence_parallel=False)
    compute = DTYPE_OF[cfg.dtype]
    elem = torch.empty((), dtype=compute).element_size()
    if name == "mfsdp_zero3_2d":
        model, optimizer = mf.fully_shard(
            module.to(compute), lambda params: torch.optim.AdamW(params, lr=cfg.lr), device_mesh=mesh,
            dp_shard_dim="dp", tp_dim="tp", zero_dp_strategy="optim_grads_params",
            fsdp_unit_modules=[TransformerBlock], device=torch.device("cpu"),
            fsdp_double_buffer=cfg.fsdp_double_buffer)
        spec = ImplSpec(name=name, family=Family.MEGATRON_FSDP, zero_level=3, strategy="optim_grads_params")
        return Trainer(spec=spec, model=model, optimizer=optimizer, counts=counts,
                       sizes=ElementSizes(weights=elem, grads=elem), comm_elem=elem, drain=model.finish_param_sync)
    policy = MixedPrecisionPolicy()
    if compute != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=compute)
    for block in module.blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(module, mesh=mesh["dp"], mp_policy=policy)
    spec = ImplSpec(name=name, family=Family.FSDP2, zero_level=3, reshard_after_forward=True)
    return Trainer(spec=spec, model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=cfg.lr),
                   counts=counts, sizes=ElementSizes(weights=4), comm_elem=elem)


def _tp_rounds(trainers, data, cfg) -> dict:
    """Warm-up steps, then per round each implementation (order alternating) one
    untimed step and ``cfg.steps`` timed ones; every step's loss is kept."""
    import torch.distributed as dist

    losses = {t.spec.name: [] for t in trainers}
    times = {t.spec.name: [] for t in trainers}

    def step(trainer) -> float:
        inputs, targets = data[len(losses[trainer.spec.name]) % len(data)]
        start = time.perf_counter()
        loss = trainer.step(inputs, targets)
        elapsed = time.perf_counter() - start
        losses[trainer.spec.name].append(loss.item())
        return elapsed

    for trainer in trainers:
        for _ in range(cfg.warmup):
            step(trainer)
        trainer.drain()
    for round_index in range(cfg.rounds):
        shift = round_index % len(trainers)
        for trainer in trainers[shift:] + trainers[:shift]:
            step(trainer)  # back from sleep: cold caches
            trainer.drain()
            dist.barrier()
            times[trainer.spec.name].append([step(trainer) for _ in range(cfg.steps)])
            trainer.drain()
    return {"losses": losses, "times": times, "memory": {t.spec.name: t.memory() for t in trainers}}


def tp_table(row: dict) -> str:
    """The DP x TP row as a plain-text table."""
    lines = [
        f"DP {row['dp']} x TP {row['tp']} (world {row['world']}): one tensor-parallel GPT, megatron_fsdp ZeRO-3 "
        "against FSDP2 2-D (slowest rank per step; ratio paired per round; state = rank 0's persistent MiB):",
    ]
    header = f"{'implementation':<26}{'step ms':>9}{'IQR ms':>17}{'min-max ms':>17}{'xFSDP2-2D':>11}{'state':>9}"
    lines += [header, "-" * len(header)]
    for name, impl in row["impls"].items():
        t = impl["step_time_s"]
        ratio = row["ratio_to_fsdp2_2d"] if name == TP_IMPLS[0] else 1.0
        state = sum(v for k, v in impl["memory_rank0"].items() if k != "peak_temporary" and v) / 2**20
        iqr = f"{t['p25'] * 1e3:.1f}-{t['p75'] * 1e3:.1f}"
        spread = f"{t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}"
        lines.append(f"{name:<26}{t['median'] * 1e3:>9.1f}{iqr:>17}{spread:>17}{ratio:>11.2f}{state:>9.2f}")
    lines.append(f"losses of the {row['steps_compared']} steps each ran: max |difference| {row['max_loss_diff']:.3g}")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
