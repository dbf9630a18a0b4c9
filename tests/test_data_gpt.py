"""Megatron's GPT datasets: our sample construction against megatron-core's and against the
documented algorithm.

* Our sample index and blending indices equal megatron-core's C++ helpers on random cases.
* On a tiny hand-made dataset, every sample is ``stream[s*seq : s*seq + seq + 1]`` of the
  documents laid end to end in their seeded shuffle order, ``s`` the seeded sample shuffle.
* build_train_valid_test_datasets gives identical samples through megatron-core's builder
  and ours: one prefix, several splits, multi-epoch with a separate final epoch, weighted
  and unweighted blends, mock data, with and without a cache, and on 2 gloo ranks.
* Empty splits, the launcher's build_datasets(args), and Megatron's sample counts.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from megatron_fsdp.training.data import (
    Backend,
    DataPathError,
    IndexedDatasetWriter,
    build_datasets,
    build_train_valid_test_datasets,
    data_args_problems,
    megatron_core_unavailable_reason,
    train_valid_test_num_samples,
)
from megatron_fsdp.training.data import blending, gpt_dataset
from megatron_fsdp.training.data.builder import MegatronSampleSource
from megatron_fsdp.training.data.tokenizers import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHIPPED = str(REPO / "data" / "corpus_text_document")
TOKENIZER = build_tokenizer("GPT2BPETokenizer", vocab_file=str(REPO / "data/bpe/vocab.json"),
                            merge_file=str(REPO / "data/bpe/merges.txt"))
needs_mcore = pytest.mark.skipif(megatron_core_unavailable_reason() is not None,
                                 reason=f"megatron-core datasets unavailable: {megatron_core_unavailable_reason()}")


def _helpers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers
    return helpers


@needs_mcore
@pytest.mark.parametrize("case", range(12))
def test_sample_index_equals_megatron_core_helper(case):
    rng = np.random.default_rng(case)
    sizes = rng.integers(1, [3, 50, 400][case % 3], size=rng.integers(1, 60)).astype(np.int32)
    epochs = int(rng.integers(1, 4))
    document_index = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
    rng.shuffle(document_index)
    seq = int(rng.integers(2, 40))
    tokens_per_epoch = int(sizes.sum())
    if epochs * tokens_per_epoch <= seq + 1:
        return
    drop_last = case % 2 == 0
    theirs = _helpers().build_sample_idx(sizes, document_index, seq, epochs, tokens_per_epoch, drop_last, True)
    ours = gpt_dataset.build_sample_index(sizes, document_index, seq, epochs, tokens_per_epoch, drop_last)
    assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


@needs_mcore
@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4, 1e-3]])
def test_blending_indices_equal_megatron_core_helpers(weights):
    w = np.array(blending.normalize(weights), dtype=np.float64)
    size = 2000
    theirs = np.zeros(size, np.int16), np.zeros(size, np.int64)
    _helpers().build_blending_indices(theirs[0], theirs[1], w, len(w), size, False)
    ours = blending.build_blending_indices(w, size)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    sizes = np.array([int(x * 300) + 1 for x in weights], dtype=np.int64)
    theirs = np.zeros(sizes.sum(), np.int16), np.zeros(sizes.sum(), np.int64)
    _helpers().build_exhaustive_blending_indices(theirs[0], theirs[1], sizes, len(sizes))
    ours = blending.build_exhaustive_blending_indices(sizes)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))


def _tiny_dataset(path: Path, num_docs: int = 10) -> tuple[str, list[np.ndarray]]:
    """Documents whose tokens name them: document d is d*100 + [0, len)."""
    rng = np.random.default_rng(7)
    docs = [d * 100 + np.arange(rng.integers(1, 12)) for d in range(num_docs)]
    writer = IndexedDatasetWriter(str(path / "tiny"), dtype=np.int32)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    return str(path / "tiny"), docs


@pytest.mark.parametrize("num_samples, seq", [(None, 4), (20, 3), (37, 5)])
def test_samples_follow_the_documented_algorithm(tmp_path, num_samples, seq):
    """Megatron's GPT sample construction, written out directly, on a tiny dataset (no megatron-core)."""
    prefix, docs = _tiny_dataset(tmp_path)
    seed = 99
    datasets = build_train_valid_test_datasets(data_path=[prefix], split="8,2,0", seq_length=seq, seed=seed,
                                               tokenizer=TOKENIZER, num_samples=(num_samples, 2, 0),
                                               cache_path=str(tmp_path / "cache"), backend="native")
    train = datasets.train.dataset
    assert datasets.test is None
    train_docs = list(range(8))  # round(0.8 * 10) documents
    tokens = sum(len(docs[d]) for d in train_docs)
    epochs = 1 if num_samples is None else -(-(num_samples * seq + 1) // tokens)
    rng = np.random.RandomState(seed)
    per_epoch = (tokens - 1) // seq
    separate = epochs > 1 and num_samples - ((epochs - 1) * tokens - 1) // seq < int(0.8 * per_epoch)
    order = np.tile(np.array(train_docs, dtype=np.int32), epochs - 1 if separate else epochs)
    rng.shuffle(order)
    if separate:
        last = np.array(train_docs, dtype=np.int32)
        rng.shuffle(last)
        order = np.concatenate([order, last])
    stream = np.concatenate([docs[d] for d in order])
    count = (len(stream) - 1) // seq
    before_final = (((epochs - 1) * tokens - 1) // seq) if separate else count
    shuffle = np.arange(before_final, dtype=np.uint32)
    rng.shuffle(shuffle)
    if separate:
        tail = np.arange(before_final, count, dtype=np.uint32)
        rng.shuffle(tail)
        shuffle = np.concatenate([shuffle, tail])
    assert len(train) == count and (num_samples is None or count >= num_samples)
    for k in range(count):
        s = int(shuffle[k])
        assert datasets.train.sample(k).tolist() == stream[s * seq: s * seq + seq + 1].tolist(), k
    valid_tokens = {int(t) for k in range(len(datasets.valid)) for t in datasets.valid.sample(k)}
    assert valid_tokens <= set(np.concatenate(docs[8:]).tolist())  # valid holds documents 8 and 9 only
    with pytest.raises(IndexError, match="past the"):
        datasets.train.sample(count)


def _all_samples(datasets, limit: int | None = None) -> list[np.ndarray | None]:
    """Every sample of each split (the first ``limit`` of each; the mock splits hold a million)."""
    return [None if s is None else np.stack([s.sample(i).numpy() for i in range(min(len(s), limit or len(s)))])
            for s in (datasets.train, datasets.valid, datasets.test)]


CASES = {
    "single": dict(data_path=[SHIPPED], split="969,30,1", seq_length=32, num_samples=(400, 64, 8)),
    "99,1,0 quoted": dict(data_path=[SHIPPED], split="'99,1,0'", seq_length=17, num_samples=(100, 10, 0)),
    "multi-epoch": dict(data_path=[SHIPPED], split="90,10,0", seq_length=64, num_samples=(360, 50, 0)),
    "separate final epoch": dict(data_path=[SHIPPED], split="90,10,0", seq_length=64, num_samples=(180, 10, 0)),
    "one epoch": dict(data_path=[SHIPPED], split="90,10,0", seq_length=64, num_samples=(None, None, None)),
    "weighted blend": dict(data_path=["0.3", SHIPPED, "0.7", SHIPPED + "_b"], split="80,20,0", seq_length=32,
                           num_samples=(700, 90, 0)),
    "weighted blend, one string": dict(data_path=[f"0.6 {SHIPPED} 0.4 {SHIPPED}_b"], split="80,20,0",
                                       seq_length=16, num_samples=(300, 40, 0)),
    "unweighted blend": dict(data_path=[SHIPPED, SHIPPED + "_b"], split="80,20,0", seq_length=32,
                             num_samples=(400, 90, 0)),
    "mock": dict(data_path=None, mock=True, split="969,30,1", seq_length=64, num_samples=(64, 16, 16)),
}


@pytest.fixture(scope="module")
def second_prefix(tmp_path_factory):
    """A second dataset next to the shipped one (its first 60 documents), for blends."""
    from megatron_fsdp.training.data import IndexedDataset

    src = IndexedDataset(SHIPPED)
    out = tmp_path_factory.mktemp("b") / "corpus_b"
    writer = IndexedDatasetWriter(str(out), dtype=src.dtype)
    for i in range(60):
        writer.add_document(src[i])
    writer.finalize()
    return str(out)


def _resolve(case: dict, second: str) -> dict:
    case = dict(case)
    if case.get("data_path"):
        case["data_path"] = [p.replace(SHIPPED + "_b", second) for p in case["data_path"]]
    return case


@needs_mcore
@pytest.mark.parametrize("name", list(CASES))
def test_native_samples_equal_megatron_core(name, second_prefix, tmp_path):
    case = _resolve(CASES[name], second_prefix)
    out = {}
    blend = case.get("data_path") and len(blending.parse_data_path(case["data_path"])[0]) > 1
    for backend in (Backend.MEGATRON_CORE, Backend.NATIVE):
        # megatron-core caches a blend only under torch.distributed (test_two_ranks_... does that)
        cache = None if blend and backend is Backend.MEGATRON_CORE else tmp_path / backend.value
        datasets = build_train_valid_test_datasets(seed=1234, tokenizer=TOKENIZER, backend=backend,
                                                   cache_path=cache and str(cache), **case)
        assert datasets.backend is backend
        out[backend] = _all_samples(datasets, limit=300 if case.get("mock") else None)
        assert cache is None or list(cache.iterdir()), "index files are cached under --data-cache-path"
    for split, (a, b) in enumerate(zip(out[Backend.MEGATRON_CORE], out[Backend.NATIVE])):
        assert (a is None) == (b is None), split
        if a is not None:
            assert a.shape == b.shape and np.array_equal(a, b), (name, split)
    train = out[Backend.NATIVE][0]
    assert train.shape[1] == case["seq_length"] + 1 and len(train) >= (case["num_samples"][0] or 1)


def test_cache_is_reused(tmp_path, monkeypatch):
    kwargs = dict(data_path=[SHIPPED], split="90,10,0", seq_length=32, seed=5, tokenizer=TOKENIZER,
                  num_samples=(300, 20, 0), cache_path=str(tmp_path), backend="native")
    first = _all_samples(build_train_valid_test_datasets(**kwargs))
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 8 and sum(f.endswith("-description.txt") for f in files) == 2

    def no_build(self):
        raise AssertionError("indices rebuilt despite the cache")

    monkeypatch.setattr(gpt_dataset.GPTDataset, "_build", no_build)
    second = _all_samples(build_train_valid_test_datasets(**kwargs))
    assert all(a is None and b is None or np.array_equal(a, b) for a, b in zip(first, second))
    with pytest.raises(AssertionError, match="rebuilt"):  # another seed is another cache entry
        build_train_valid_test_datasets(**dict(kwargs, seed=6))


def test_empty_splits(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        datasets = build_train_valid_test_datasets(data_path=[SHIPPED], split="969,30,1", seq_length=32, seed=1,
                                                   tokenizer=TOKENIZER, num_samples=(10, 10, 10),
                                                   cache_path=str(tmp_path), backend="native")
    assert datasets.test is None and datasets.valid is not None
    assert "the test split of --split '969,30,1' holds none of the 85 documents" in caplog.text
    with pytest.raises(ValueError, match="train split"):
        build_train_valid_test_datasets(data_path=[SHIPPED], split="0.001,1,0", seq_length=32, seed=1,
                                        tokenizer=TOKENIZER, num_samples=(10, 10, 0), cache_path=str(tmp_path))
    with pytest.raises(ValueError, match="an unweighted --data-path blend gives one epoch"):
        build_train_valid_test_datasets(data_path=[SHIPPED, SHIPPED], split="80,20,0", seq_length=32, seed=1,
                                        tokenizer=TOKENIZER, num_samples=(1000, 10, 0), cache_path=str(tmp_path))
    with pytest.raises(ValueError, match="--split"):
        build_train_valid_test_datasets(data_path=[SHIPPED], split="a,b", seq_length=32, seed=1,
                                        tokenizer=TOKENIZER, num_samples=(10, 10, 0))
    with pytest.raises(DataPathError, match="corpus.txt.bin"):
        build_train_valid_test_datasets(data_path=[str(REPO / "data/corpus.txt")], split="1", seq_length=32,
                                        seed=1, tokenizer=TOKENIZER, num_samples=(10, 0, 0))


def test_megatron_sample_counts():
    # Megatron-LM's get_train_valid_test_num_samples
    assert train_valid_test_num_samples(train_iters=100, global_batch_size=8, eval_interval=10,
                                        eval_iters=2) == (800, 11 * 2 * 8, 16)
    assert train_valid_test_num_samples(train_iters=None, global_batch_size=4, eval_interval=5, eval_iters=1,
                                        train_samples=40) == (40, 3 * 4, 4)


def _launcher_args(**overrides) -> argparse.Namespace:
    args = dict(mock_data=False, data_path=[SHIPPED], split="90,10,0", seq_length=32, seed=1234, train_iters=20,
                global_batch_size=8, eval_interval=10, eval_iters=2, train_samples=None, data_cache_path=None,
                tokenizer_type="GPT2BPETokenizer", vocab_file=str(REPO / "data/bpe/vocab.json"),
                merge_file=str(REPO / "data/bpe/merges.txt"), tokenizer_model=None, vocab_size=None)
    args.update(overrides)
    return argparse.Namespace(**args)


def test_launcher_build_datasets(tmp_path):
    train, valid = build_datasets(_launcher_args(data_cache_path=str(tmp_path)))
    assert isinstance(train, MegatronSampleSource) and len(train) >= 160 and len(valid) >= 3 * 2 * 8
    assert train.sample(0).shape == (33,) and int(train.sample(0).max()) < TOKENIZER.vocab_size
    with pytest.raises(DataPathError, match="is not a Megatron indexed dataset"):
        build_datasets(_launcher_args(data_path=[str(REPO / "data/corpus.txt")]))
    train, valid = build_datasets(_launcher_args(data_path=None, tokenizer_type=None))  # the byte corpus
    assert train.sample(0).shape == (33,) and int(train.sample(0).max()) < 256


def _build_on_rank(rank, world, *, cache: str, backend: str, second: str):
    datasets = build_train_valid_test_datasets(
        data_path=["0.5", SHIPPED, "0.5", second], split="90,10,0", seq_length=32, seed=3, tokenizer=TOKENIZER,
        num_samples=(200, 30, 0), cache_path=cache, backend=backend)
    digest = hashlib.sha256()
    for source in (datasets.train, datasets.valid):
        for i in range(len(source)):
            digest.update(source.sample(i).numpy().tobytes())
    return datasets.backend.value, digest.hexdigest()


def test_two_ranks_build_identical_datasets(pool2, tmp_path, second_prefix):
    backends = ["native"] + ([] if megatron_core_unavailable_reason() else ["megatron-core"])
    digests = set()
    for backend in backends:
        results = pool2.run(_build_on_rank, cache=str(tmp_path / backend), backend=backend, second=second_prefix)
        assert [r[0] for r in results] == [backend, backend]
        digests |= {r[1] for r in results}
        assert os.listdir(tmp_path / backend)
    assert len(digests) == 1, "every rank and backend builds the same samples"


def test_data_args_problems_for_validation():
    assert data_args_problems(_launcher_args()) == []
    problems = data_args_problems(_launcher_args(data_path=["data/corpus.txt"], split="x", mock_data=True,
                                                 merge_file=None))
    assert len(problems) == 4
    for fragment in ("--mock-data and --data-path are exclusive", "is not a Megatron indexed dataset",
                     "--split 'x' must be", "needs --merge-file"):
        assert any(fragment in p for p in problems), fragment


# -- --mock-data: Megatron-LM's mock documents ---------------------------------------------
def _mock_args(**overrides) -> argparse.Namespace:
    return _launcher_args(**dict(dict(mock_data=True, data_path=None, tokenizer_type="NullTokenizer", vocab_size=100,
                                      vocab_file=None, merge_file=None, train_iters=5, global_batch_size=4,
                                      eval_interval=5, eval_iters=1), **overrides))


def _mock_documents_follow_the_rule(sample: np.ndarray, vocab_size: int, eod: int) -> bool:
    """megatron-core's rule: document i is 1, 2, ..., n-1 (mod vocab) then eod, so each token is the
    previous + 1 (mod vocab), or eod, or 1 (a new document) after eod."""
    for a, b in zip(sample[:-1], sample[1:]):
        if not (b == (a + 1) % vocab_size or b == eod or (a == eod and b == 1)):
            return False
    return True


def test_mock_data_gives_megatron_mock_documents():
    low = gpt_dataset.MockLowLevelDataset(100, 99)
    # numpy.random.default_rng(0).integers(1, 4096, 100000, int32) starts 3484, 2609, 2094.
    assert low.sequence_lengths[:3].tolist() == [3484, 2609, 2094]
    assert low.get(0).tolist() == [t % 100 for t in range(1, 3484)] + [99]
    assert low.get(1, offset=98, length=4).tolist() == [99, 0, 1, 2]  # (98 + 1) % 100, ...
    train, valid = build_datasets(_mock_args())
    assert isinstance(train, MegatronSampleSource) and len(train) >= 20 and len(valid) >= 4
    for source in (train, valid):
        for i in range(20 if source is train else 4):
            sample = source.sample(i).numpy()
            assert sample.shape == (33,) and _mock_documents_follow_the_rule(sample, 100, 99), (source.name, i)
    # The same seed gives the same samples; another seed another order.
    again, _ = build_datasets(_mock_args())
    other, _ = build_datasets(_mock_args(seed=99))
    assert all(np.array_equal(train.sample(i), again.sample(i)) for i in range(20))
    assert not all(np.array_equal(train.sample(i), other.sample(i)) for i in range(20))


@needs_mcore
def test_mock_data_equals_megatron_core_mock_gpt_dataset():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    args = _mock_args()
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=args.vocab_size)
    num_samples = train_valid_test_num_samples(train_iters=5, global_batch_size=4, eval_interval=5, eval_iters=1)
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=None, split=None,
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False)
    theirs = BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()
    ours_launcher = build_datasets(args)
    ours_native = build_train_valid_test_datasets(data_path=None, mock=True, split=args.split, seq_length=32,
                                                  seed=args.seed, tokenizer=tokenizer, num_samples=num_samples,
                                                  backend=Backend.NATIVE)
    for split, (core, launcher, native) in enumerate(zip(theirs, ours_launcher, (ours_native.train, ours_native.valid))):
        for i in range(16):
            item = core[i]
            expected = np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])
            assert np.array_equal(launcher.sample(i).numpy(), expected), (split, i)
            assert np.array_equal(native.sample(i).numpy(), expected), (split, i)
