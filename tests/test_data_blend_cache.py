"""The native blended dataset's index under ``--data-cache-path``: written once as megatron-core
names its files, read back (memory-mapped) at the next start without building again, and
keyed by the blend's description (other weights build and cache their own)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron_fsdp.training.data import IndexedDatasetWriter, build_train_valid_test_datasets, blending
from megatron_fsdp.training.data.tokenizers import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = build_tokenizer("GPT2BPETokenizer", vocab_file=str(REPO / "data/bpe/vocab.json"),
                            merge_file=str(REPO / "data/bpe/merges.txt"))


def _corpus(path: Path, name: str, first_token: int) -> str:
    writer = IndexedDatasetWriter(str(path / name), dtype=np.int32)
    for d in range(12):
        writer.add_document(first_token + d * 10 + np.arange(3 + d % 5))
    writer.finalize()
    return str(path / name)


def _blend(tmp_path: Path, weights: tuple[str, str]):
    a, b = _corpus(tmp_path, "a", 1000), _corpus(tmp_path, "b", 5000)
    datasets = build_train_valid_test_datasets(
        data_path=[weights[0], a, weights[1], b], split="1,0,0", seq_length=4, seed=3, tokenizer=TOKENIZER,
        num_samples=(40, None, None), cache_path=str(tmp_path / "cache"), backend="native")
    return datasets.train.dataset


def test_the_blend_index_is_cached_and_read_back(tmp_path, monkeypatch):
    built = _blend(tmp_path, ("0.3", "0.7"))
    files = sorted(p.name for p in (tmp_path / "cache").glob("*-BlendedDataset-train-*"))
    assert [f.split("-", 1)[1] for f in files] == [
        "BlendedDataset-train-dataset_index.npy", "BlendedDataset-train-dataset_sample_index.npy",
        "BlendedDataset-train-description.txt"]

    def refuse(*_args, **_kwargs):
        raise AssertionError("the blend was built again although its index is cached")

    monkeypatch.setattr(blending, "build_blending_indices", refuse)
    loaded = _blend(tmp_path, ("0.3", "0.7"))
    assert isinstance(loaded.dataset_index, np.memmap)
    assert np.array_equal(loaded.dataset_index, built.dataset_index)
    assert np.array_equal(loaded.dataset_sample_index, built.dataset_sample_index)
    assert [loaded.text(k).tolist() for k in range(len(loaded))] == [built.text(k).tolist() for k in range(len(built))]
    with pytest.raises(AssertionError, match="built again"):  # other weights: another description, built
        _blend(tmp_path, ("0.5", "0.5"))
