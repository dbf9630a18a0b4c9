"""Megatron's GPT sample construction over an indexed dataset, in our own code.

[Note: GPT sample construction] (megatron-core's GPTDataset, followed step by step)
1. The split: ``--split 969,30,1`` is normalised to book-ends [0, .969), [.969, .999),
   [.999, 1]; split ``s`` owns sequences ``round(lo*S) .. round(hi*S)`` of the S sequences.
2. Epochs: enough passes over the split's tokens for ``num_samples * seq_length + 1``
   tokens (one epoch when num_samples is None).
3. Document index: the split's sequence ids repeated once per epoch, shuffled by
   ``numpy.random.RandomState(seed)``; when the last epoch contributes fewer than 80% of
   an epoch's samples it is shuffled on its own, after the others (``separate_final_epoch``),
   so the short tail does not bias toward any document.
4. Sample index: the shuffled documents are laid end to end; sample ``i`` starts at token
   ``i * seq_length`` of that stream and takes ``seq_length + 1`` tokens (inputs and
   shifted labels), stored as (position in the document index, offset in that document).
   Samples cross document boundaries; the partial sample at the end is dropped.
5. Shuffle index: a permutation of the samples by the same RandomState (the final-epoch
   samples permuted among themselves when separated).
Sample ``k`` is sample-index row ``shuffle[k]``. With the same seed these arrays equal
megatron-core's (``tests/test_data_gpt.py`` checks against its C++ helpers).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from megatron_fsdp.training.data.index_cache import IndexCache
from megatron_fsdp.training.data.indexed import IndexedDataset

logger = logging.getLogger(__name__)

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """``'969, 30, 1'`` -> normalised weights [0.969, 0.03, 0.001] (missing ones are 0)."""
    import re

    numbers = re.findall(r"[.0-9]+", split)
    try:
        weights = [float(x) for x in numbers]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} must be one to three non-negative weights (train,valid,test) with a "
                         "positive sum, e.g. '969,30,1' or '99,1,0'")
    weights += [0.0] * (3 - len(weights))
    total = float(np.sum(np.array(weights, dtype=np.float64)))
    return (np.array(weights, dtype=np.float64) / total).tolist()


def split_matrix(weights: Sequence[float]) -> list[tuple[float, float] | None]:
    """Book-ends of each split in [0, 1], None for an empty split."""
    bounds = [0.0]
    for w in weights:
        bounds.append(bounds[-1] + w)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:])]


def split_indices(bookends: tuple[float, float], num_elements: int) -> np.ndarray:
    lo = int(round(bookends[0] * float(num_elements)))
    hi = int(round(bookends[1] * float(num_elements)))
    return np.arange(lo, hi, dtype=np.int32)


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens; choose other --split weights or more data")
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Step 3 of [Note: GPT sample construction]."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int, drop_last_partial_sequence: bool = True) -> np.ndarray:
    """Step 4 of [Note: GPT sample construction]: (num_samples + 1, 2) int rows of
    (position in ``document_index``, token offset in that document)."""
    total = num_epochs * tokens_per_epoch
    if drop_last_partial_sequence:
        num_samples = (total - 1) // seq_length
    else:
        num_samples = int(np.ceil((total - 1) / seq_length))
    lengths = np.asarray(sizes)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    rows = np.zeros((num_samples + 1, 2), dtype=np.int64)
    inside = starts < total
    pos = np.searchsorted(ends, starts[inside], side="right")
    rows[inside, 0] = pos
    rows[inside, 1] = starts[inside] - (ends[pos] - lengths[pos])
    # Only a kept partial sample can end past the stream: it ends at the last document's last token.
    rows[~inside, 0] = len(document_index) - 1
    rows[~inside, 1] = lengths[-1] - 1
    rows[0] = (0, 0)
    dtype = np.int32 if max(len(document_index), int(np.max(sizes))) <= np.iinfo(np.int32).max else np.int64
    return rows.astype(dtype)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Step 5 of [Note: GPT sample construction]."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class MockLowLevelDataset:
    """megatron-core's mock documents: 100000 documents of 1..4095 tokens (lengths from
    ``numpy.random.default_rng(0)``), document ``i`` = ``1, 2, ..., n-1 (mod vocab), eod``."""

    size = 100_000
    max_sequence_length = 4096

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod = vocab_size, eod
        rng = np.random.default_rng(seed=0)
        self.sequence_lengths = rng.integers(1, self.max_sequence_length, size=self.size, dtype=np.int32)
        self.path_prefix = None

    def __len__(self) -> int:
        return self.size

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = int(self.sequence_lengths[idx])
        doc = np.concatenate([(np.arange(n - 1) + 1) % self.vocab_size, [self.eod]]).astype(np.int64)
        if length is None:
            length = n - offset
        return doc[offset: offset + length]


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens from one split of one indexed dataset.

    ``ds[k]`` is a dict like megatron-core's GPTDataset item (``tokens``, ``labels``,
    ``loss_mask``, ``position_ids``; no attention mask); ``ds.text(k)`` the raw tokens.
    """

    def __init__(self, low_level: IndexedDataset | MockLowLevelDataset, indices: np.ndarray,
                 num_samples: int | None, split_name: str, *, seed: int, seq_length: int,
                 cache_dir: str | None, description: OrderedDict) -> None:
        self.dataset = low_level
        self.indices = indices
        self.num_samples = num_samples
        self.split_name = split_name
        self.seed = seed
        self.seq_length = seq_length
        description = OrderedDict(description, num_samples=num_samples, index_split=split_name,
                                  num_sequences=len(indices))
        cache = IndexCache(cache_dir, "GPTDataset", split_name, description,
                           ("document_index", "sample_index", "shuffle_index"))
        self.unique_description, self.unique_description_hash = cache.description, cache.description_hash
        self.document_index, self.sample_index, self.shuffle_index = cache.load_or_build(self._build)

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sizes = self.dataset.sequence_lengths
        tokens_per_epoch = int(np.sum(sizes[self.indices]))
        num_epochs = num_epochs_for(tokens_per_epoch, self.num_samples, self.seq_length)
        separate_final_epoch = False
        if num_epochs > 1:
            samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // self.seq_length
            samples_from_final = self.num_samples - samples_before_final
            samples_per_epoch = (tokens_per_epoch - 1) // self.seq_length
            separate_final_epoch = samples_from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.indices, num_epochs, rng, separate_final_epoch)
        sample_index = build_sample_index(sizes, document_index, self.seq_length, num_epochs, tokens_per_epoch)
        num_rows = sample_index.shape[0] - 1
        first = samples_before_final if separate_final_epoch else num_rows
        shuffle_index = build_shuffle_index(first, num_rows, rng)
        logger.info("> built %s %s indices: %d samples, %d epochs", type(self).__name__, self.split_name,
                    num_rows, num_epochs)
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def text(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``idx`` (int64)."""
        row = int(self.shuffle_index[idx])
        (doc_beg, off_beg), (doc_end, off_end) = self.sample_index[row], self.sample_index[row + 1]
        doc_beg, off_beg, doc_end, off_end = int(doc_beg), int(off_beg), int(doc_end), int(off_end)
        if doc_beg == doc_end:
            parts = [self.dataset.get(int(self.document_index[doc_beg]), offset=off_beg,
                                      length=off_end - off_beg + 1)]
        else:
            parts = []
            for i in range(doc_beg, doc_end + 1):
                offset = off_beg if i == doc_beg else 0
                length = off_end + 1 if i == doc_end else None
                parts.append(self.dataset.get(int(self.document_index[i]), offset=offset, length=length))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self.text(idx))
        return {"tokens": text[:-1].contiguous(), "labels": text[1:].contiguous(),
                "loss_mask": torch.ones(self.seq_length, dtype=torch.float),
                "position_ids": torch.arange(self.seq_length, dtype=torch.long)}

