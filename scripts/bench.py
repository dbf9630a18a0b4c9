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
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

# bench_lib sits next to this script; the forkserver inherits this sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lib.config import MEGATRON_STRATEGIES, MODEL_PRESETS, BenchConfig, all_impls, parse_csv  # noqa: E402

logger = logging.getLogger("bench")


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
        "--impls", default=None, help="subset, comma-separated, of " + ",".join(s.name for s in all_impls())
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
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="results/bench", help="folder for the JSON record and the PNG chart")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="re-print the tables and redraw the chart of an earlier record; runs nothing")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    cfg = BenchConfig(
        world=args.world,
        model=args.model,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        micro_batch_size=args.micro_batch_size,
        strategies=parse_csv(args.strategies),
        impls=parse_csv(args.impls) if args.impls else None,
        dtype=args.dtype,
        isolation=args.isolation,
        fsdp_double_buffer=args.fsdp_double_buffer,
        seed=args.seed,
        out=args.out,
    )
    return cfg, args


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
        json_path, png_path = args.replot, write_chart(record, os.path.dirname(args.replot) or ".")
    else:
        os.makedirs(cfg.out, exist_ok=True)
        cells, descriptions, isolation = run_bench(cfg)
        record = build_record(cfg, cells, descriptions, isolation)
        json_path = write_json(record, cfg.out)
        png_path = write_chart(record, cfg.out)
    print(summary(record))
    print(f"\nwrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
