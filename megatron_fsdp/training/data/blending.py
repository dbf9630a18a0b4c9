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
from typing import Sequence

import numpy as np

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
    """(dataset_index int16, dataset_sample_index int64) of a blend of ``size`` samples."""
    w = np.asarray(weights, dtype=np.float64)
    taken = np.zeros(len(w), dtype=np.int64)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    for k in range(size):
        d = int(np.argmax(w * max(float(k), 1.0) - taken))  # argmax keeps the first of equal errors
        dataset_index[k] = d
        sample_index[k] = taken[d]
        taken[d] += 1
    return dataset_index, sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Blend of exactly ``sizes[d]`` samples of each dataset, interleaved by their shares."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    w = sizes / float(total)
    taken = np.zeros(len(sizes), dtype=np.int64)
    dataset_index = np.zeros(total, dtype=np.int16)
    sample_index = np.zeros(total, dtype=np.int64)
    for k in range(total):
        error = np.where(taken < sizes, w * max(float(k), 1.0) - taken, -np.inf)
        d = int(np.argmax(error))
        dataset_index[k] = d
        sample_index[k] = taken[d]
        taken[d] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Samples drawn from several datasets by [Note: blending]; ``ds[k]`` adds ``dataset_id``."""

    def __init__(self, datasets: list, weights: Sequence[float] | None, size: int | None) -> None:
        if weights is not None and size is not None:
            self.dataset_index, self.dataset_sample_index = build_blending_indices(normalize(weights), size)
        else:
            lengths = [len(d) for d in datasets]
            self.dataset_index, self.dataset_sample_index = build_exhaustive_blending_indices(lengths)
        self.datasets = datasets
        for d, count in zip(*np.unique(self.dataset_index, return_counts=True)):
            if count > len(datasets[d]):
                raise IndexError(f"the blend needs {count} samples from dataset {d} ({len(datasets[d])} built); "
                                 "this is a bug in the sample arithmetic")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def text(self, idx: int) -> np.ndarray:
        return self.datasets[self.dataset_index[idx]].text(int(self.dataset_sample_index[idx]))

    def __getitem__(self, idx: int) -> dict:
        d = int(self.dataset_index[idx])
        return {"dataset_id": d, **self.datasets[d][int(self.dataset_sample_index[idx])]}
