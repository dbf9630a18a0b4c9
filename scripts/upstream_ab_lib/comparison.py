"""Both sides' records of the upstream A/B compared into its sections of rows.

The fp32, bf16, state_dict and checkpoint sections, each row with its max abs
difference and a pass flag."""

from __future__ import annotations

from .packages import SIDES

FP32_TOL = 1e-6
BF16_REL = 2.0 ** -7  # bf16 keeps 8 significant bits: one rounding step is <= 2^-7 |w|


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
                worst = max(worst, not_nan((x.double() - y.double()).abs().max().item()))
        else:  # scalars: a step count may be a tensor on one side and a number on the other
            x, y = _scalar(x), _scalar(y)
            if x != y:
                worst = max(worst, not_nan(abs(x - y)) if _numeric(x, y) else float("inf"))
    return worst, sorted(a.keys() ^ b.keys())


def not_nan(diff: float) -> float:
    """A NaN difference as infinity: ``max`` would drop a NaN and pass the row."""
    return float("inf") if diff != diff else diff


def _scalar(value):
    import torch

    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _numeric(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def passes(diff, only_one, tol: float) -> bool:
    """A difference measured, within ``tol``, with no key on one side only."""
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
        l_diff = max(not_nan(abs(a - b)) for a, b in zip(u["losses"], o["losses"]))
        row.update(max_abs_diff_weights=w_diff, max_abs_diff_optim_state=s_diff, max_abs_diff_losses=l_diff,
                   tolerance=tol, keys_on_one_side=(w_only + s_only)[:20])
        # For triage: which reference loop each side matches (computed on ours' side).
        refs = {"bare": ours.get("bare", {}) if precision == "fp32" else {},
                "master": ours.get(f"master/{precision}", {}), "primed": ours.get(f"primed/{precision}", {})}
        for ref, result in refs.items():
            if "model" in result:
                row[f"vs_{ref}_adamw"] = {s: max_abs_diff(r["model"], result["model"])[0]
                                          for s, r in (("upstream", u), ("ours", o))}
                row[f"vs_{ref}_losses"] = {s: max(not_nan(abs(a - b)) for a, b in zip(r["losses"], result["losses"]))
                                           for s, r in (("upstream", u), ("ours", o))}
        row["passed"] = passes(w_diff, w_only, tol) and passes(s_diff, s_only, tol) and l_diff <= tol
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
                    passed = passes(diff, only, FP32_TOL) and passes(s_diff, s_only, FP32_TOL)
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
