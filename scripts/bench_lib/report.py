"""Presentation of the record: the plain-text tables, the PNG chart and the JSON file."""

from __future__ import annotations

import json
import os
from typing import Optional

from .aggregate import MEMORY_KEYS
from .counting import KINDS

MIB = 2**20


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / MIB:.2f}"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def speed_table(record: dict) -> str:
    header = (
        f"{'implementation':<26}{'step ms':>9}{'IQR ms':>17}{'min-max ms':>17}{'xDDP':>7}{'xFSDP2':>8}"
        + "".join(f"{k + ' MiB/step':>24}" for k in KINDS)
        + f"{'over min':>10}"
    )
    lines = [header, "-" * len(header)]
    for name, impl in record["impls"].items():
        t = impl["step_time_s"]
        comm = impl["comm"]["per_kind"]
        cells = []
        for kind in KINDS:
            entry = comm[kind]
            if entry["bytes_per_step"] == 0 and entry["minimum"] == 0:
                cells.append(f"{'-':>24}")
            else:
                cells.append(f"{_mib(entry['bytes_per_step']) + ' (min ' + _mib(entry['minimum']) + ')':>24}")
        excess = [e["excess_pct"] for e in comm.values() if e["excess_pct"] is not None]
        unexpected = any(e["unexpected"] for e in comm.values())
        over = "extra!" if unexpected else (f"{max(excess):+.1f}%" if excess else "-")
        iqr = f"{t['p25'] * 1e3:.1f}-{t['p75'] * 1e3:.1f}"
        spread = f"{t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}"
        lines.append(
            f"{name:<26}{t['median'] * 1e3:>9.1f}{iqr:>17}{spread:>17}"
            f"{_ratio(impl['ratio_to_ddp']):>7}{_ratio(impl['ratio_to_fsdp2']):>8}"
            + "".join(cells)
            + f"{over:>10}"
        )
    return "\n".join(lines)


def memory_table(record: dict) -> str:
    header = (
        f"{'implementation':<26}"
        + "".join(f"{k:>16}" for k in ("weights", "main_weights", "grads", "optim_state"))
        + f"{'total':>10}{'formula':>10}{'temp peak':>11}{'peak RSS':>10}{'RSS growth':>12}"
    )
    lines = [header, "-" * len(header)]
    for name, impl in record["impls"].items():
        mem = impl["memory"]
        worst = mem["max_over_ranks"]
        cells = "".join(f"{_mib(worst[k]) + ' [' + _mib(mem['expected'][k]) + ']':>16}" for k in MEMORY_KEYS)
        lines.append(
            f"{name:<26}{cells}{_mib(worst['persistent_total']):>10}{_mib(mem['expected_total']):>10}"
            f"{_mib(worst['peak_temporary']):>11}{_mib(worst['peak_rss']):>10}{_mib(mem['max_rss_growth']):>12}"
        )
    return "\n".join(lines)


def summary(record: dict) -> str:
    cfg = record["config"]
    counts = record["param_counts"]
    steps = cfg["steps"] * cfg["rounds"]
    return "\n".join(
        [
            f"model {cfg['model']} ({counts['total']:,} params, {counts['root']:,} outside blocks), "
            f"world {cfg['world']}, {cfg['dtype']}, micro-batch {cfg['micro_batch_size']}, "
            f"{cfg['rounds']} rounds x {cfg['steps']} steps ({steps} measured per impl) after {cfg['warmup']} warm-up, "
            f"isolation {record['isolation']}"
            + (", megatron_fsdp with fsdp_double_buffer" if cfg.get("fsdp_double_buffer") else ""),
            "",
            "Step time (slowest rank per step; ratios are paired per round, FSDP2 = "
            f"{record['fsdp2_reference']}) and bytes per step per collective (unsharded payload, rank 0):",
            speed_table(record),
            "minimum: DDP/no_shard one all-reduce of the grads; ZeRO-1/2 and FSDP2(reshard=False) params gathered "
            "once + grads reduce-scattered once; ZeRO-3 and FSDP2(reshard=True) gather block params twice and the "
            f"{counts['root']:,} params outside blocks once (both libraries keep them gathered from forward to "
            "backward; the textbook 2 x P is in the JSON as 'textbook').",
            "",
            "Memory per rank, MiB (max over ranks; [formula]); temp peak = megatron_fsdp's most "
            "unsharded bucket bytes alive at once; RSS growth = largest growth over one measured block:",
            memory_table(record),
        ]
    )


def write_json(record: dict, out_dir: str) -> str:
    path = os.path.join(out_dir, f"bench_{record['config']['model']}_w{record['config']['world']}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=str)  # GPTConfig holds enums (Normalization, ...)
    return path


def _stacked_against(ax, x, series: dict[str, list[float]], reference: list[float], *, reference_label: str,
                     title: str, **bar_kwargs) -> None:
    """Stacked bars per implementation with a reference mark (formula, minimum) on each."""
    bottom = [0.0] * len(x)
    for label, values in series.items():
        ax.bar(x, values, bottom=bottom, label=label, **bar_kwargs.get(label, {}))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(x, reference, marker="_", s=500, color="k", label=reference_label, zorder=3)
    ax.set_ylim(top=1.15 * max(bottom + reference))
    ax.set_title(title)
    ax.set_ylabel("MiB")
    ax.legend(fontsize=7)


def _time_panel(ax, x, impls: list[dict]) -> None:
    medians = [i["step_time_s"]["median"] * 1e3 for i in impls]
    low = [m - i["step_time_s"]["p25"] * 1e3 for m, i in zip(medians, impls)]
    high = [i["step_time_s"]["p75"] * 1e3 - m for m, i in zip(medians, impls)]
    ax.bar(x, medians, yerr=[low, high], capsize=4, color="tab:blue")
    ax.set_title("step time (median, IQR)")
    ax.set_ylabel("ms")


def _memory_panel(ax, x, impls: list[dict]) -> None:
    series = {key: [i["memory"]["max_over_ranks"][key] / MIB for i in impls] for key in MEMORY_KEYS}
    series["temporary peak"] = [(i["memory"]["max_over_ranks"]["peak_temporary"] or 0) / MIB for i in impls]
    formula = [i["memory"]["expected_total"] / MIB for i in impls]
    _stacked_against(ax, x, series, formula, reference_label="formula (persistent)",
                     title="per-rank state (max over ranks)",
                     **{"temporary peak": {"hatch": "//", "color": "none", "edgecolor": "gray"}})


def _rss_panel(ax, x, impls: list[dict]) -> None:
    ax.bar(x, [i["memory"]["max_over_ranks"]["peak_rss"] / MIB for i in impls], color="tab:red", label="peak RSS")
    ax.bar(x, [max(i["memory"]["max_rss_growth"], 0) / MIB for i in impls], color="k", width=0.4,
           label="largest RSS growth in a measured block")
    ax.set_title("process RSS per rank (max over ranks)")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=7)


def _comm_panel(ax, x, impls: list[dict]) -> None:
    series = {kind: [i["comm"]["per_kind"][kind]["bytes_per_step"] / MIB for i in impls] for kind in KINDS}
    minimum = [i["comm"]["total_minimum"] / MIB for i in impls]
    _stacked_against(ax, x, series, minimum, reference_label="minimum", title="bytes per step by collective")


def write_chart(record: dict, out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(record["impls"])
    impls = [record["impls"][n] for n in names]
    x = list(range(len(names)))
    fig, axes = plt.subplots(1, 4, figsize=(22, 6))
    for panel, ax in zip((_time_panel, _memory_panel, _rss_panel, _comm_panel), axes):
        panel(ax, x, impls)
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    cfg = record["config"]
    fig.suptitle(f"{cfg['model']}, world {cfg['world']}, {cfg['dtype']} (CPU, gloo)")
    fig.tight_layout()
    path = os.path.join(out_dir, f"bench_{cfg['model']}_w{cfg['world']}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
