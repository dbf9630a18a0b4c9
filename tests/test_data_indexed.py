"""Megatron's indexed dataset files and scripts/preprocess_data.py.

* Our writer's files are read by megatron-core's IndexedDataset and ours; files written by
  megatron-core's IndexedDatasetBuilder are read by ours (uint16 and int32, sentences).
* The .idx bytes follow the documented header.
* preprocess_data.py turns text and JSON lines into the tokenizer's ids (+ eod), the same
  with several workers or partitions; the shipped data/corpus_text_document is its output.
* Anything that is not a prefix of a .bin/.idx pair is a clear error naming the pair.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_fsdp.training.data import DataPathError, IndexedDataset, IndexedDatasetWriter, data_path_problems
from megatron_fsdp.training.data.indexed import check_prefix
from megatron_fsdp.training.data.tokenizers import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
BPE = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(REPO / "data/bpe/vocab.json"),
       "--merge-file", str(REPO / "data/bpe/merges.txt")]
SHIPPED = REPO / "data" / "corpus_text_document"


def _mcore_indexed():
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _documents(seed: int, n: int, high: int) -> list[list[list[int]]]:
    """n documents, each 1-3 sentences of 1-20 ids below ``high``."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, high, rng.integers(1, 20)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(n)]


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65000), (np.int32, 200_000)])
def test_megatron_core_reads_our_files(tmp_path, dtype, high):
    mc = _mcore_indexed()
    docs = _documents(0, 30, high)
    writer = IndexedDatasetWriter(str(tmp_path / "ours"), dtype=dtype)
    for doc in docs:
        writer.add_document(sum(doc, []), [len(s) for s in doc])
    writer.finalize()
    theirs, ours = mc.IndexedDataset(str(tmp_path / "ours")), IndexedDataset(str(tmp_path / "ours"))
    sentences = [s for doc in docs for s in doc]
    assert len(theirs) == len(ours) == len(sentences)
    assert np.array_equal(theirs.document_indices, ours.document_indices)
    assert np.array_equal(theirs.document_indices, np.cumsum([0] + [len(d) for d in docs]))
    for i, sentence in enumerate(sentences):
        assert theirs[i].tolist() == ours[i].tolist() == sentence
        assert theirs[i].dtype == ours[i].dtype == dtype
    assert theirs.get(5, offset=1, length=2).tolist() == ours.get(5, offset=1, length=2).tolist()


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65000), (np.int32, 200_000)])
def test_we_read_megatron_core_files(tmp_path, dtype, high):
    mc = _mcore_indexed()
    docs = _documents(1, 25, high)
    builder = mc.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for doc in docs:
        builder.add_document(torch.tensor(sum(doc, [])), [len(s) for s in doc])
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours = IndexedDataset(str(tmp_path / "theirs"))
    assert [ours[i].tolist() for i in range(len(ours))] == [s for doc in docs for s in doc]
    assert ours.num_documents == len(docs) and ours.dtype == dtype
    # and our writer produces byte-identical files from the same documents
    writer = IndexedDatasetWriter(str(tmp_path / "ours"), dtype=dtype)
    for doc in docs:
        writer.add_document(sum(doc, []), [len(s) for s in doc])
    writer.finalize()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()


def test_index_header_is_the_documented_layout(tmp_path):
    writer = IndexedDatasetWriter(str(tmp_path / "d"), dtype=np.uint16)
    writer.add_document([1, 2, 3])
    writer.add_document([4, 5], [1, 1])
    writer.finalize()
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 3, 3)  # version 1, uint16, 3 sequences, 3 doc entries
    assert np.frombuffer(raw, np.int32, 3, 34).tolist() == [3, 1, 1]  # lengths
    assert np.frombuffer(raw, np.int64, 3, 46).tolist() == [0, 6, 8]  # byte pointers
    assert np.frombuffer(raw, np.int64, 3, 70).tolist() == [0, 1, 3]  # document starts
    assert len(raw) == 94 and (tmp_path / "d.bin").read_bytes() == np.arange(1, 6, dtype=np.uint16).tobytes()


def _preprocess(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "preprocess_data.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)
    return proc


def test_shipped_corpus_dataset_is_the_preprocess_output(tmp_path):
    proc = _preprocess("--input", str(REPO / "data/corpus.txt"), "--output-prefix", str(tmp_path / "corpus"),
                       *BPE, "--append-eod", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"corpus_text_document{suffix}").read_bytes() == SHIPPED.with_suffix(suffix).read_bytes()
    ds = IndexedDataset(str(SHIPPED))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=BPE[3], merge_file=BPE[5])
    paragraphs = [p for p in (REPO / "data/corpus.txt").read_text(encoding="utf-8").split("\n\n") if p.strip()]
    assert len(ds) == ds.num_documents == len(paragraphs) == 85
    for i in (0, 1, 42, 84):
        assert ds[i].tolist() == tok.tokenize(paragraphs[i].strip("\n")) + [tok.eod]


def test_preprocess_jsonl_keys_workers_and_partitions(tmp_path):
    lines = [{"text": f"Document {i}: " + "word " * (i % 7) + "end.", "title": f"T{i}", "id": i} for i in range(40)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    outputs = {}
    for name, extra in (("one", ["--workers", "1"]), ("two", ["--workers", "2"]),
                        ("parts", ["--workers", "2", "--partitions", "2", "--keep-sequential-samples"])):
        proc = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / name), *BPE,
                           "--json-keys", "text", "title", "--append-eod", *extra)
        assert proc.returncode == 0, proc.stderr
        outputs[name] = {k: (tmp_path / f"{name}_{k}_document.bin").read_bytes() + (
            tmp_path / f"{name}_{k}_document.idx").read_bytes() for k in ("text", "title")}
    assert outputs["one"] == outputs["two"] == outputs["parts"]
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=BPE[3], merge_file=BPE[5])
    titles = IndexedDataset(str(tmp_path / "one_title_document"))
    assert [titles[i].tolist() for i in range(len(titles))] == [tok.tokenize(x["title"]) + [tok.eod] for x in lines]
    assert not list(tmp_path.glob("parts_0*")), "partition files are merged and removed"


def test_preprocess_null_and_byte_tokenizers(tmp_path):
    (tmp_path / "ids.txt").write_text("1 2 3\n\n4 5\n", encoding="utf-8")
    assert _preprocess("--input", str(tmp_path / "ids.txt"), "--output-prefix", str(tmp_path / "null"),
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod").returncode == 0
    null = IndexedDataset(str(tmp_path / "null_text_document"))
    assert [null[i].tolist() for i in range(2)] == [[1, 2, 3, 99], [4, 5, 99]]
    assert _preprocess("--input", str(tmp_path / "ids.txt"), "--output-prefix", str(tmp_path / "b"),
                       "--tokenizer-type", "ByteTokenizer", "--text-documents", "file").returncode == 0
    byte = IndexedDataset(str(tmp_path / "b_text_document"))
    assert byte.dtype == np.uint16 and bytes(byte[0].tolist()) == b"1 2 3\n\n4 5\n"  # Megatron: uint16 below 65500


def test_preprocess_bad_input_is_a_clear_error(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"body": "hi"}\n', encoding="utf-8")
    proc = _preprocess("--input", str(tmp_path / "x.jsonl"), "--output-prefix", str(tmp_path / "o"), *BPE)
    assert proc.returncode != 0 and "has no key 'text'" in proc.stderr and "--json-keys" in proc.stderr
    proc = _preprocess("--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "o"), *BPE)
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_non_indexed_paths_are_clear_errors(tmp_path):
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"\x00" * 64)
    text = tmp_path / "notes.txt"
    text.write_text("hello", encoding="utf-8")
    cases = {
        str(raw): [f"{tmp_path}/raw.bin.bin", f"{tmp_path}/raw.bin.idx", "is not a Megatron indexed dataset",
                   "raw text, JSON lines or a bare .bin"],
        str(text): ["notes.txt.idx", "scripts/preprocess_data.py --input"],
        str(tmp_path / "nothing"): ["missing", "nothing.bin", "nothing.idx"],
        str(SHIPPED) + ".bin": ["pass the prefix without the extension", repr(str(SHIPPED))],
    }
    for path, fragments in cases.items():
        with pytest.raises(DataPathError) as info:
            check_prefix(path)
        for fragment in fragments:
            assert fragment in str(info.value), (path, str(info.value))
        assert data_path_problems([path]) == [str(info.value)]
    (tmp_path / "bad.bin").write_bytes(b"")
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" + b"\x00" * 40)
    with pytest.raises(DataPathError, match="is not a Megatron index file"):
        IndexedDataset(str(tmp_path / "bad"))
    assert data_path_problems([str(SHIPPED)]) == [] and data_path_problems(["0.3", str(SHIPPED)]) == []
    assert "mixes weights and prefixes" in data_path_problems(["0.3", str(SHIPPED), str(SHIPPED), "x"])[0]


# -- --split-sentences ---------------------------------------------------------------------
def test_rule_sentence_splitter():
    from megatron_fsdp.training.data.sentences import RuleSentenceSplitter

    text = 'Mr. Smith went to Washington. He met Dr. J. Doe, e.g. at 3.14 p.m. today! Did he? "Yes." The end'
    assert RuleSentenceSplitter().tokenize(text) == [
        "Mr. Smith went to Washington.", "He met Dr. J. Doe, e.g. at 3.14 p.m. today!", "Did he?", '"Yes."',
        "The end"]
    # --keep-newlines: the whitespace after a sentence stays with it, so newlines survive.
    assert RuleSentenceSplitter(keep_newlines=True).tokenize("One.\nTwo! three stays. Four.\n\n") == [
        "One.\n", "Two! three stays. ", "Four.\n\n"]
    assert RuleSentenceSplitter().tokenize("  ") == [] and RuleSentenceSplitter().tokenize("no end") == ["no end"]


def test_preprocess_split_sentences_writes_one_entry_per_sentence(tmp_path):
    docs = ["Hello there. How are you? Fine, thanks.", "One sentence only"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    proc = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "s"), *BPE, "--split-sentences",
                       "--sentence-splitter", "rule", "--append-eod", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert "rule-based splitter" in proc.stderr
    ds = IndexedDataset(str(tmp_path / "s_text_sentence"))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=BPE[3], merge_file=BPE[5])
    sentences = [["Hello there.", "How are you?", "Fine, thanks."], ["One sentence only"]]
    assert ds.document_indices.tolist() == [0, 3, 4]
    expected = [tok.tokenize(s) + ([tok.eod] if i == len(doc) - 1 else []) for doc in sentences
                for i, s in enumerate(doc)]
    assert [ds[i].tolist() for i in range(len(ds))] == expected


def test_preprocess_split_sentences_without_punkt(tmp_path):
    import importlib.util

    (tmp_path / "t.txt").write_text("A first one. A second one.\n", encoding="utf-8")
    common = ("--input", str(tmp_path / "t.txt"), "--output-prefix", str(tmp_path / "o"), *BPE, "--split-sentences")
    if importlib.util.find_spec("nltk") is None:
        proc = _preprocess(*common, "--sentence-splitter", "punkt")
        assert proc.returncode == 2 and "needs the nltk package" in proc.stderr and "--sentence-splitter rule" \
            in proc.stderr
    proc = _preprocess(*common)  # auto: punkt when installed with its data, else the rule splitter (said so)
    assert proc.returncode == 0, proc.stderr
    assert "NLTK punkt" in proc.stderr
    assert IndexedDataset(str(tmp_path / "o_text_sentence")).sequence_lengths.size == 2
