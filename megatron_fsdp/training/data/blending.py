"""Weighted blends of datasets (``--data-path 0.3 a 0.7 b``), as megatron-core builds them.

[Note: blending] With weights ``w`` (normalised) and a split that needs ``N`` samples,
dataset ``d`` is asked for ``ceil(ceil(N * w_d) * 1.005)`` samples (a 0.5% surplus), the
blend has ``sum_d ceil(N * w_d)`` samples, and blend sample ``k`` comes from the dataset
whose share is furthest behind its weight: ``argmax_d (w_d * max(k, 1) - taken_d)``,
first on ties, taking that dataset's next sample. Without weights every dataset gives one
epoch and shares follow the dataset sizes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import numpy as np

from megatron_fsdp.training.data.index_cache import IndexCache

MID_LEVEL_DATASET_SURPLUS = 0.005


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """``['0.3', 'a', '0.7', 'b']`` (or ``['0.3 a 0.7 b']``) -> (['a', 'b'], [0.3, 0.7]);
    prefixes without weights -> (prefixes, None)."""
    items = [token for entry in data_path for token in str(entry).split()]
    if not items:
        raise ValueError("--data-path is empty; pass PREFIX (of PREFIX.bin/PREFIX.idx) or weighted pairs "
                         "'0.3 PREFIX_A 0.7 PREFIX_B'")
    if len(items) % 2 == 1:
        return items, None
    heads = [_float_or_none(x) for x in items[0::2]]
    if all(h is None for h in heads):
        return items, None
    if any(h is None for h in heads):
        raise ValueError(f"--data-path {' '.join(items)!r} mixes weights and prefixes; write weight-prefix pairs "
                         "('0.3 a 0.7 b') or only prefixes ('a b')")
    if any(h <= 0 for h in heads):
        raise ValueError(f"--data-path weights must be positive, got {heads}")
    return items[1::2], heads


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def normalize(weights: Sequence[float]) -> list[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def sizes_per_dataset(weights: Sequence[float], target: int | None, surplus: float = 0.0) -> int | None:
    """Samples to request from each dataset for a split of ``target`` samples (see [Note: blending])."""
    if target is None:
        return None
    return [int(math.ceil(math.ceil(target * w) * (1 + surplus))) for w in weights]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of a blend of ``size`` samples.

    [Note: the blend loop] Each choice depends on every earlier one (no closed form reproduces
    the greedy's picks, ties included), so this is a loop; it runs on Python floats, which are
    the C++ helper's doubles (the same products and differences, the same picks), about five
    times faster than numpy calls on a few elements per step. Blends are cached under
    ``--data-cache-path`` (``BlendedDataset``), so a run builds each one once."""
    w = [float(x) for x in np.asarray(weights, dtype=np.float64)]
    taken = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    for k in range(size):
        d = _furthest_behind(w, taken, float(k) if k > 1 else 1.0)
        dataset_index[k], sample_index[k] = d, taken[d]
        taken[d] += 1
    return dataset_index, sample_index


def _furthest_behind(w: list[float], taken: list[int], k: float, limit: list[int] | None = None) -> int:
    """argmax_d (w_d * k - taken_d), the first of equal errors; with ``limit``, only datasets
    with taken_d < limit_d (the exhaustive blend's)."""
    best, best_error = -1, -math.inf
    for d, (weight, count) in enumerate(zip(w, taken)):
        error = weight * k - count if limit is None or count < limit[d] else -math.inf
        if error > best_error or best < 0:
            best, best_error = d, error
    return best


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Blend of exactly ``sizes[d]`` samples of each dataset, interleaved by their shares."""
    limit = [int(n) for n in sizes]
    total = sum(limit)
    w = [float(x) for x in np.asarray(limit, dtype=np.int64) / float(total)]
    taken = [0] * len(limit)
    dataset_index = np.empty(total, dtype=np.int16)
    sample_index = np.empty(total, dtype=np.int64)
    for k in range(total):
        d = _furthest_behind(w, taken, float(k) if k > 1 else 1.0, limit)
        dataset_index[k], sample_index[k] = d, taken[d]
        taken[d] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Samples drawn from several datasets by [Note: blending]; ``ds[k]`` adds ``dataset_id``.

    With ``cache_dir`` (``--data-cache-path``, as megatron-core) the two index arrays are
    cached (index_cache.py [Note: cache files]), keyed by the members' own descriptions."""

    def __init__(self, datasets: list, weights: Sequence[float] | None, size: int | None, *,
                 split_name: str = "train", cache_dir: str | None = None) -> None:
        self.datasets = datasets
        members = [getattr(d, "unique_description_hash", None) for d in datasets]
        description = OrderedDict(cls="BlendedDataset", datasets=members, weights=None if weights is None
                                  else list(weights), size=size, split=split_name)
        cache = IndexCache(cache_dir if None not in members else None, "BlendedDataset", split_name, description,
                           ("dataset_index", "dataset_sample_index"))
        self.dataset_index, self.dataset_sample_index = cache.load_or_build(lambda: self._build(weights, size))
        for d, count in zip(*np.unique(self.dataset_index, return_counts=True)):
            if count > len(datasets[d]):
                raise IndexError(f"the blend needs {count} samples from dataset {d} ({len(datasets[d])} built); "
                                 "this is a bug in the sample arithmetic")

    def _build(self, weights: Sequence[float] | None, size: int | None) -> tuple[np.ndarray, np.ndarray]:
        if weights is not None and size is not None:
            return build_blending_indices(normalize(weights), size)
        return build_exhaustive_blending_indices([len(d) for d in self.datasets])
    def __len__(self) -> int:
        return len(self.dataset_index)

    def text(self, idx: int) -> np.ndarray:
        return self.datasets[self.dataset_index[idx]].text(int(self.dataset_sample_index[idx]))

    def __getitem__(self, idx: int) -> dict:
        d = int(self.dataset_index[idx])
        return {"dataset_id": d, **self.datasets[d][int(self.dataset_sample_index[idx])]}
