"""The upstream A/B's command line, shared by upstream_ab.py and upstream_ab_patterns.py.

upstream_ab.py runs ``--world > 1`` / ``--patterns`` through upstream_ab_patterns.py,
which also takes the whole command line itself."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .packages import SIDES
from .user_script import PRECISIONS, STRATEGIES


def build_parser(description: str) -> argparse.ArgumentParser:
    """The command line of both scripts (``--world > 1`` / ``--patterns``: the patterns run);
    ``--worker`` and the options after it are the world-1 worker's, which upstream_ab.py
    starts of itself."""
    parser = argparse.ArgumentParser(description=description)
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
    """Reject a run without a package to compare, or ranks asked for on the GPU."""
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
