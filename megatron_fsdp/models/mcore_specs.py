"""Helpers the megatron-core GPT builder (``mcore.py``) shares with its MLA and MTP parts
(``mcore_mla.py``, ``mcore_mtp.py``): editing a layer spec, and what the installed
megatron-core does with per-token MTP losses. None of them imports megatron-core at the
top, so validation may ask before anything is built."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Optional


def megatron_core_rescales_per_token_mtp() -> bool:
    """Whether the installed megatron-core weighs per-token MTP losses by their rolled token
    count as the pinned Megatron-LM does (newer than 0.16.1). Read from its source without
    importing it, so validation can ask before anything is built."""
    spec = importlib.util.find_spec("megatron.core.transformer.multi_token_prediction")
    if spec is None or spec.origin is None:
        return False
    with open(spec.origin) as f:
        return "original_num_tokens" in f.read()


def per_token_rolled_count_problem(mtp_num_layers: Optional[int], per_token: bool) -> Optional[str]:
    """Why megatron-core cannot give Megatron-LM's per-token MTP gradient here, or None."""
    if not per_token or not mtp_num_layers or mtp_num_layers == 1 or megatron_core_rescales_per_token_mtp():
        return None
    return (f"--use-mcore-models with --calculate-per-token-loss and --mtp-num-layers {mtp_num_layers}: the installed "
            "megatron-core (0.16.1) weighs each MTP depth's per-token loss differently from Megatron-LM (no rescaling "
            "by the depth's token count), which no single factor corrects beyond one depth; use --mtp-num-layers 1, "
            "drop --calculate-per-token-loss, or drop --use-mcore-models (the embedded GPT computes Megatron-LM's)")


def swap_in_spec(spec, swap):
    """``spec`` (a megatron-core ModuleSpec / submodules dataclass tree) with every leaf
    for which ``swap(leaf)`` returns a class replaced by that class; copies, never
    edits, megatron-core's spec objects."""
    replacement = swap(spec)
    if replacement is not None:
        return replacement
    if isinstance(spec, list):
        return [swap_in_spec(s, swap) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: swap_in_spec(getattr(spec, f.name), swap)
                                            for f in dataclasses.fields(spec) if f.init})
    return spec
