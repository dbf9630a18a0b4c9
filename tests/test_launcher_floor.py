"""The launcher on its floor: its data leaves load without torch (the preprocessing
workers import them alone), and moving its modules changed no dataset cache key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_fsdp.training.data import sentencepiece_tokenizers as sp
from megatron_fsdp.training.data import tokenizers as tk
from megatron_fsdp.training.data.builder import build_train_valid_test_datasets

REPO = Path(__file__).resolve().parent.parent


def test_data_leaves_import_without_torch():
    code = ("import sys\n"
            "import megatron_fsdp.training.data.indexed, megatron_fsdp.training.data.tokenizers\n"
            "import megatron_fsdp.training.data.sentences, megatron_fsdp.training.data.sentencepiece_tokenizers\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_preprocess_data_loads_no_module_by_path():
    source = (REPO / "megatron_fsdp" / "training" / "data" / "preprocess_data.py").read_text() + (
        REPO / "megatron_fsdp" / "training" / "data" / "tokenizers.py").read_text()
    assert "spec_from_file_location" not in source and "sys.modules[" not in source


# [Note: pinned dataset cache keys] (training/data/tokenizers.py): the identifiers and the
# cache file names below are what the code gave before the tokenizers moved to training/data/.
OLD_IDENTIFIERS = {
    "GPT2BPETokenizer": "megatron_fsdp.training.tokenizers.GPT2BPETokenizer",
    "NullTokenizer": "megatron_fsdp.training.tokenizers.NullTokenizer",
    "ByteTokenizer": "megatron_fsdp.training.tokenizers.ByteTokenizer",
}


def test_tokenizer_identifiers_keep_their_module_path():
    vocab, merges = str(REPO / "data" / "bpe" / "vocab.json"), str(REPO / "data" / "bpe" / "merges.txt")
    made = {"GPT2BPETokenizer": tk.build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
            "NullTokenizer": tk.build_tokenizer("NullTokenizer", vocab_size=1000),
            "ByteTokenizer": tk.build_tokenizer("ByteTokenizer")}
    assert {name: tok.unique_identifiers["cls"] for name, tok in made.items()} == OLD_IDENTIFIERS
    assert dict(made["NullTokenizer"].unique_identifiers) == {
        "cls": OLD_IDENTIFIERS["NullTokenizer"], "eod_id": 999, "vocab_size": 1000}
    piece = object.__new__(sp.GPTSentencePieceTokenizer)
    piece._identity = {}
    assert piece.unique_identifiers["cls"] == "megatron_fsdp.training.sentencepiece_tokenizers.GPTSentencePieceTokenizer"


def test_a_subclass_elsewhere_is_keyed_by_its_own_module():
    class Mine(tk.ByteTokenizer):
        pass

    assert Mine().unique_identifiers["cls"] == f"{__name__}.test_a_subclass_elsewhere_is_keyed_by_its_own_module.<locals>.Mine"


def test_dataset_cache_files_keep_their_names(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    # A tokenizer with no file paths in its identifiers (GPT2BPETokenizer's hold the files'
    # absolute paths), so the names do not depend on where the repository is.
    tok = tk.build_tokenizer("NullTokenizer", vocab_size=50304)
    build_train_valid_test_datasets(data_path=["data/corpus_text_document"], mock=False, split="949,50,1",
                                    seq_length=64, seed=1234, tokenizer=tok, num_samples=[64, 16, None],
                                    cache_path=str(tmp_path))
    names = sorted(f for f in os.listdir(tmp_path) if f.endswith("description.txt"))
    assert names == ["09858497418474746f2d4855b72b4d05-GPTDataset-train-description.txt",
                     "d08a13944eafaa3b7cf7b5762d87a6f7-GPTDataset-valid-description.txt"]
