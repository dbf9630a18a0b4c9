"""From per-rank, per-round measurements to the JSON record: step-time statistics
and paired ratios, bytes per collective against the minimum, memory against the
ZeRO formula. Pure Python over plain dicts."""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections import defaultdict
from typing import Optional

from .config import BenchConfig, Family, ImplSpec
from .counting import KINDS
from .runner import Cell
from .theory import ElementSizes, ParamCounts, expected_memory, min_comm_bytes, textbook_comm_bytes, zero_formula

logger = logging.getLogger(__name__)

MEMORY_KEYS = ("weights", "main_weights", "grads", "optimizer_state")
FSDP2_NAMES = ("fsdp2_reshard", "fsdp2_no_reshard")


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list."""
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def time_stats(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "median": statistics.median(ordered),
        "p25": _quantile(ordered, 0.25),
        "p75": _quantile(ordered, 0.75),
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
        "samples": samples,
    }


def step_times(cell: Cell) -> list[float]:
    """A step takes as long as its slowest rank."""
    return [max(per_rank) for per_rank in zip(*(r["step_times"] for r in cell.ranks))]


def paired_ratio(round_medians: dict[str, list[float]], impl: str, reference: Optional[str]) -> Optional[float]:
    """Median over rounds of (impl / reference) within a round: both ran back to back,
    so drift between rounds cancels."""
    if reference is None or reference not in round_medians:
        return None
    ratios = [a / b for a, b in zip(round_medians[impl], round_medians[reference]) if b > 0]
    return statistics.median(ratios) if ratios else None


def comm_record(cells: list[Cell], spec: ImplSpec, counts: ParamCounts, elem: int, steps: int) -> dict:
    """Bytes and calls per step per collective kind (rank 0; every rank must agree)."""
    minimum = min_comm_bytes(spec, counts, elem)
    textbook = textbook_comm_bytes(spec, counts, elem)
    per_kind = {}

    for kind in KINDS:
        per_round = [c.ranks[0]["comm"]["bytes"][kind] / steps for c in cells]
        calls = [c.ranks[0]["comm"]["counts"][kind] / steps for c in cells]
        disagree = [c.round for c in cells if len({r["comm"]["bytes"][kind] for r in c.ranks}) > 1]
        if disagree:
            logger.warning("%s: ranks moved different %s bytes in rounds %s", spec.name, kind, disagree)
        measured = max(per_round)
        want = minimum.get(kind, 0)
        per_kind[kind] = {
            "bytes_per_step": measured,
            "calls_per_step": max(calls),
            "minimum": want,
            "textbook": textbook.get(kind, 0),
            "excess_pct": (100.0 * (measured - want) / want) if want else None,
            "unexpected": measured > 0 and not want,
            "rounds_differ": len(set(per_round)) > 1,
        }
    package = {k: v / steps for k, v in cells[-1].ranks[0]["package_bytes"].items()}
    bucket_numel = cells[-1].ranks[0]["comm"]["ddp_bucket_numel"] / steps
    return {
        "per_kind": per_kind,
        "total_bytes_per_step": sum(v["bytes_per_step"] for v in per_kind.values()),
        "total_minimum": sum(minimum.values()),
        # megatron_fsdp's flag all-reduces (gradient presence, weight edits): the
        # counter keeps them apart from the data collectives, as the package does.
        "control_bytes_per_step": max(c.ranks[0]["comm"]["control_bytes"] for c in cells) / steps,
        "package_recorder_bytes_per_step": package,
        "ddp_bucket_numel_per_step": bucket_numel,
        "cross_check": _cross_check(spec, per_kind, package, bucket_numel, elem),
    }


def _cross_check(spec: ImplSpec, per_kind: dict, package: dict, bucket_numel: float, elem: int) -> Optional[bool]:
    """Does the bench's wrapper agree with an independent count (megatron_fsdp's own
    recorder; the DDP hook's bucket sizes)? ``None`` where there is none."""
    counted = {k: v["bytes_per_step"] for k, v in per_kind.items() if v["bytes_per_step"]}
    if spec.family in (Family.MEGATRON_FSDP, Family.EXPERIMENTAL):
        agree = counted == {k: v for k, v in package.items() if v}
    elif spec.family is Family.DDP:
        agree = counted == {"all_reduce": bucket_numel * elem}
    else:
        return None
    if not agree:
        logger.warning("%s: the bench counter saw %s but the cross-check saw %s", spec.name, counted,
                       package if spec.family is not Family.DDP else bucket_numel * elem)
    return agree


def memory_record(cells: list[Cell], spec: ImplSpec, counts: ParamCounts, world: int, sizes: ElementSizes) -> dict:
    per_rank = []
    for rank in range(world):
        seen = [c.ranks[rank] for c in cells]
        last = seen[-1]["memory"]
        temps = [s["memory"]["peak_temporary"] for s in seen if s["memory"]["peak_temporary"] is not None]
        per_rank.append(
            {
                **{k: last[k] for k in MEMORY_KEYS},
                "peak_temporary": max(temps) if temps else None,
                "persistent_total": sum(last[k] for k in MEMORY_KEYS),
                "peak_rss": max(s["peak_rss"] for s in seen),
                "rss_growth_per_round": [s["rss_after"] - s["rss_before"] for s in seen],
                # With persistent workers, a steady rise here across rounds is a leak;
                # one-off growth in the first block is allocator warm-up.
                "rss_after_per_round": [s["rss_after"] for s in seen],
                "rss_growth_first_to_last": seen[-1]["rss_after"] - seen[0]["rss_before"],
            }
        )
    expected = expected_memory(spec, counts, world, sizes)
    return {
        "per_rank": per_rank,
        "expected": expected,
        "expected_total": sum(expected.values()),
        "zero_formula": zero_formula(spec.zero_level, counts, world, sizes),
        "max_over_ranks": {
            key: max((r[key] for r in per_rank if r[key] is not None), default=None)
            for key in (*MEMORY_KEYS, "peak_temporary", "persistent_total", "peak_rss")
        },
        "max_rss_growth": max(g for r in per_rank for g in r["rss_growth_per_round"]),
    }


def build_record(cfg: BenchConfig, cells: list[Cell], descriptions: dict[str, dict], isolation: str) -> dict:
    specs = [s for s in cfg.selected_impls() if s.name in descriptions]
    by_impl: dict[str, list[Cell]] = defaultdict(list)
    for cell in cells:
        by_impl[cell.impl].append(cell)
    round_medians = {name: [statistics.median(step_times(c)) for c in cs] for name, cs in by_impl.items()}
    overall = {name: statistics.median([t for c in cs for t in step_times(c)]) for name, cs in by_impl.items()}
    fsdp2_present = [n for n in FSDP2_NAMES if n in overall]
    best_fsdp2 = min(fsdp2_present, key=overall.__getitem__) if fsdp2_present else None
    reference_losses = _losses(by_impl["ddp"]) if "ddp" in by_impl else None

    impls = {}
    for spec in specs:
        desc = descriptions[spec.name]
        counts = ParamCounts(**desc["counts"])
        sizes = ElementSizes(**desc["sizes"])
        losses = _losses(by_impl[spec.name])
        impls[spec.name] = {
            "spec": {**dataclasses.asdict(spec), "family": spec.family.value},
            "step_time_s": time_stats([t for c in by_impl[spec.name] for t in step_times(c)]),
            "round_median_s": round_medians[spec.name],
            "ratio_to_ddp": paired_ratio(round_medians, spec.name, "ddp" if "ddp" in overall else None),
            "ratio_to_fsdp2": paired_ratio(round_medians, spec.name, best_fsdp2),
            "comm": comm_record(by_impl[spec.name], spec, counts, desc["comm_elem"], cfg.steps),
            "memory": memory_record(by_impl[spec.name], spec, counts, cfg.world, sizes),
            "losses_rank0": losses,
            "max_loss_diff_vs_ddp": (
                max(abs(a - b) for a, b in zip(losses, reference_losses)) if reference_losses else None
            ),
            "counter_patch_sites": desc["patch_sites"],
        }
    any_desc = next(iter(descriptions.values()))
    return {
        "config": {**dataclasses.asdict(cfg), "gpt_config": dataclasses.asdict(cfg.gpt_config)},
        "isolation": isolation,
        "param_counts": any_desc["counts"],
        "fsdp2_reference": best_fsdp2,
        "ratio_method": "median over rounds of (impl round median / reference round median)",
        "impls": impls,
    }


def _losses(cells: list[Cell]) -> list[float]:
    return [loss for c in cells for loss in c.ranks[0]["losses"]]
