"""The planner's command line: ``python -m megatron_fsdp.tools.plan_cli`` (and ``scripts/plan.py``).

Prints ``plan.py``'s per-rank memory and per-step collectives of a preset GPT (``--tp N``:
tensor parallelism; ``--cp N``: context parallelism; ``--ep N``: expert parallelism of a
mixture-of-experts preset; dense parameters shard over ``--world / tp``, experts over
``--world / ep``), the activation collectives of TP, EP and CP per microbatch, and with
``--check`` compares them with a build on torch's fake process group (``simulate.py``).
``--peak`` adds the predicted peak of one step (``peak.py``: persistent state, traced
activations of one microbatch, gathered units, reduce buckets, optimizer temporaries, and
the phase where it falls); ``--recompute`` traces with every block recomputed.
Its own module because it is the one place that needs both: the simulation builds
through the plan's requests, so the plan cannot import it back.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import torch

from ..comm import device as device_mod
from ..enums import ShardingStrategy
from .peak import PeakOptions, estimate_peak, format_peak
from .plan import PlanRequest, format_plan, make_plan, model_names
from .simulate import compare, simulate


# -- command line --------------------------------------------------------------------
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": None}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_fsdp.tools.plan_cli", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="8b", help=f"preset: {', '.join(model_names())}")
    parser.add_argument("--world", type=int, default=8,
                        help="ranks in all: data-parallel x context-parallel x tensor-parallel")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks (dividing --world, the heads, query groups and ffn); "
                             "the data-parallel size is world / tp")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel ranks sharing each sequence (dividing --world / --tp; the sequence "
                             "length a multiple of 2 x cp); dense parameters stay sharded over world / tp")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks sharing each MoE layer's experts (MoE presets; dividing the "
                             "experts and --world); experts shard over world / ep")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocabulary to a multiple of this times --tp (Megatron-LM's rule)")
    parser.add_argument("--micro-batch-size", type=int, default=1,
                        help="sequences per microbatch (sizes the activation collectives and --check's steps)")
    parser.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--strategy", default="optim_grads_params", help="0-3, a strategy name, or 'all'")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="compute dtype")
    parser.add_argument("--main-params-dtype", default="fp32", choices=list(_DTYPES))
    parser.add_argument("--main-grads-dtype", default="fp32", choices=list(_DTYPES))
    parser.add_argument("--grad-comm-dtype", default="auto", choices=list(_DTYPES))
    parser.add_argument("--check", action="store_true", help="build on the fake process group and compare")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="--check: where the shards and the steps' tensors live (cuda runs the real kernels)")
    parser.add_argument("--steps", type=int, default=None,
                        help="fake-group training steps to record (default: 3 up to 200M parameters, else 0: "
                             "collectives are then counted from the engine's built groups)")
    parser.add_argument("--peak", action="store_true",
                        help="also predict the step's peak bytes per rank (activations traced on fake tensors)")
    parser.add_argument("--recompute", action="store_true", help="with --peak: recompute every block in backward")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="with --peak: ZeRO-3 holds one gathered unit in the blocks, not two")
    parser.add_argument("--json", action="store_true", help="print one JSON record per strategy instead of text")
    return parser.parse_args(argv)


def requests_from(args: argparse.Namespace) -> list[PlanRequest]:
    strategies = list(ShardingStrategy) if args.strategy == "all" else [ShardingStrategy.parse(args.strategy, arg_name="--strategy")]
    return [
        PlanRequest(
            model=args.model,
            world=args.world,
            strategy=s,
            dtype=_DTYPES[args.dtype],
            main_params_dtype=_DTYPES[args.main_params_dtype],
            main_grads_dtype=_DTYPES[args.main_grads_dtype],
            grad_comm_dtype=_DTYPES[args.grad_comm_dtype],
            tp=args.tp,
            cp=args.cp,
            ep=args.ep,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
        )
        for s in strategies
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        requests = requests_from(args)
    except ValueError as error:  # a size that does not split, a strategy that does not exist
        print(f"plan: {error}", file=sys.stderr)
        return 2
    failed = False
    for request in requests:
        plan = make_plan(request)
        record = plan.as_dict()
        estimate = None
        if args.peak:
            estimate = estimate_peak(plan, PeakOptions(recompute=args.recompute, prefetch=not args.no_prefetch))
            record["peak"] = estimate.as_dict()
        if args.check:
            steps = args.steps if args.steps is not None else (3 if plan.params <= 200_000_000 else 0)
            measured = simulate(request, steps=steps, device=_check_device(args.device))
            record["measured"] = measured
            record["mismatches"] = compare(plan, measured)
            failed = failed or bool(record["mismatches"])
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(format_plan(plan))
            if estimate is not None:
                print(format_peak(estimate))
            if args.check:
                _print_check(record)
    return 1 if failed else 0


def _check_device(name: str) -> torch.device:
    if name == "cuda":
        device = torch.device("cuda", 0)
        device_mod.set_device(device)
        return device
    return torch.device("cpu")


def _print_check(record: dict) -> None:
    m = record["measured"]
    print(f"fake-group build: wrap {m['wrap_s']:.2f}s ({m['wrap_cpu_s']:.2f}s CPU), peak host RSS growth {m['wrap_rss_growth'] / 2**30:.2f} GiB, "
          f"collectives from {m['step_source']}")
    if record["mismatches"]:
        print("MISMATCH:\n  " + "\n  ".join(record["mismatches"]))
    else:
        print("check: memory and collectives equal the plan")


if __name__ == "__main__":
    sys.exit(main())
