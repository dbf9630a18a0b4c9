"""Training data for the launcher: Megatron indexed datasets, mock data and the byte corpus.

Modules, one concern each:

- ``batching.py``: ``SampleSource`` (what the training loop reads), ``BatchLayout`` and
  ``get_microbatch`` (Megatron's pretraining sampler layout).
- ``indexed.py``: our reader/writer of Megatron's ``prefix.bin``/``prefix.idx`` files.
- ``gpt_dataset.py``: Megatron's GPT sample construction (split, document/sample/shuffle
  indices, cache files) over an indexed dataset, and its mock documents.
- ``blending.py``: weighted blends ``--data-path 0.3 a 0.7 b``.
- ``index_cache.py``: index arrays cached under ``--data-cache-path`` with megatron-core's file names.
- ``builder.py``: ``build_train_valid_test_datasets`` (megatron-core's builder when it runs
  here, else ours, identical samples), ``train_valid_test_num_samples``,
  ``data_path_problems``.
- ``sentences.py``: sentence splitting for ``preprocess_data.py --split-sentences`` (NLTK
  punkt when installed, else a documented rule-based splitter).
- ``fim.py``: ``--fim-data``'s fill-in-the-middle samples (Megatron-LM's ``GPTFIMDataset``) over
  the GPT samples, in Megatron-LM's reading order.
- ``byte_corpus.py``: the launcher's byte-level corpus (and ``MockDataset``, generated
  sequences for tests and the benchmark).
- ``tokenizers.py``: tokenizers that work offline with the user's own files, with Megatron-LM's
  names (GPT-2 BPE, Null, Byte, Hugging Face); ``sentencepiece_tokenizers.py`` the
  SentencePiece ones (``--tokenizer-model``); ``tiktoken_tokenizer.py`` the TikTokenizer (a tiktoken JSON
  vocabulary after Megatron-LM's special ids).
- ``from_args.py``: ``data_args_problems``, ``build_tokenizer_from_args`` and ``build_datasets``:
  the above from the launcher's parsed flags.
- ``sources.py``: the launcher's call: the vocabulary size from the tokenizer, then the sources.
- ``preprocess_data.py``: Megatron-LM's ``tools/preprocess_data.py``: text or JSON lines into an
  indexed dataset (``scripts/preprocess_data.py``, the ``megatron-fsdp-preprocess-data`` command).

``build_datasets(args)`` builds the sources: with ``--data-path`` it builds
Megatron's GPT datasets through the tokenizer flags (see ``build_train_valid_test_datasets``),
with ``--mock-data`` Megatron's mock documents the same way (megatron-core's
``MockGPTDataset``: the same seed gives the same samples as Megatron-LM); with no data
flag it reads the byte-level corpus in ``data/``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchLayout": "batching", "SampleSource": "batching", "get_microbatch": "batching",
    "parse_data_path": "blending",
    "Backend": "builder", "MegatronSampleSource": "builder", "TrainValidTestDatasets": "builder",
    "build_train_valid_test_datasets": "builder", "data_path_problems": "builder",
    "megatron_core_unavailable_reason": "builder", "train_valid_test_num_samples": "builder",
    "DEFAULT_CORPUS": "byte_corpus", "MockDataset": "byte_corpus", "TextDataset": "byte_corpus",
    "load_corpus_tokens": "byte_corpus", "split_windows": "byte_corpus",
    "DataPathError": "indexed", "IndexedDataset": "indexed", "IndexedDatasetWriter": "indexed",
    "build_datasets": "from_args", "build_tokenizer_from_args": "from_args", "data_args_problems": "from_args",
}
"""Name -> the module of this folder that defines it. [Note: lazy package root] (in
``megatron_fsdp/__init__.py``): the preprocessing workers import ``indexed.py`` and the
tokenizers alone, without torch, so this ``__init__`` loads nothing until a name is used."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
