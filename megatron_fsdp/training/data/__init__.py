"""Training data for the launcher: Megatron indexed datasets, mock data and the byte corpus.

Modules, one concern each:

- ``batching.py``: ``SampleSource`` (what the training loop reads), ``BatchLayout`` and
  ``get_microbatch`` (Megatron's pretraining sampler layout).
- ``indexed.py``: our reader/writer of Megatron's ``prefix.bin``/``prefix.idx`` files.
- ``gpt_dataset.py``: Megatron's GPT sample construction (split, document/sample/shuffle
  indices, cache files) over an indexed dataset, and its mock documents.
- ``blending.py``: weighted blends ``--data-path 0.3 a 0.7 b``.
- ``builder.py``: ``build_train_valid_test_datasets`` (megatron-core's builder when it runs
  here, else ours, identical samples), ``train_valid_test_num_samples``,
  ``data_path_problems``.
- ``sentences.py``: sentence splitting for ``preprocess_data.py --split-sentences`` (NLTK
  punkt when installed, else a documented rule-based splitter).
- ``fim.py``: ``--fim-data``'s fill-in-the-middle samples (Megatron-LM's ``GPTFIMDataset``) over
  the GPT samples, in Megatron-LM's reading order.
- ``byte_corpus.py``: the launcher's byte-level corpus (and ``MockDataset``, the generated
  sequences the launcher's ``--mock-data`` gave before it followed Megatron-LM).

``build_datasets(args)`` is the launcher's one call: with ``--data-path`` it builds
Megatron's GPT datasets through the tokenizer flags (see ``build_train_valid_test_datasets``),
with ``--mock-data`` Megatron's mock documents the same way (megatron-core's
``MockGPTDataset``: the same seed gives the same samples as Megatron-LM); with no data
flag it reads the byte-level corpus in ``data/``.
"""

from __future__ import annotations

import logging

from megatron_fsdp.training.data.batching import BatchLayout, SampleSource, get_microbatch
from megatron_fsdp.training.data.blending import parse_data_path
from megatron_fsdp.training.data.builder import (
    Backend,
    MegatronSampleSource,
    TrainValidTestDatasets,
    build_train_valid_test_datasets,
    data_path_problems,
    megatron_core_unavailable_reason,
    train_valid_test_num_samples,
)
from megatron_fsdp.training.data.byte_corpus import (
    DEFAULT_CORPUS,
    MockDataset,
    TextDataset,
    load_corpus_tokens,
    split_windows,
)
from megatron_fsdp.training.data.indexed import DataPathError, IndexedDataset, IndexedDatasetWriter

logger = logging.getLogger(__name__)

__all__ = [
    "Backend", "BatchLayout", "DEFAULT_CORPUS", "DataPathError", "IndexedDataset", "IndexedDatasetWriter",
    "MegatronSampleSource", "MockDataset", "SampleSource", "TextDataset", "TrainValidTestDatasets",
    "build_datasets", "build_tokenizer_from_args", "build_train_valid_test_datasets", "data_args_problems",
    "data_path_problems",
    "get_microbatch", "load_corpus_tokens", "megatron_core_unavailable_reason", "parse_data_path",
    "split_windows", "train_valid_test_num_samples",
]


def data_args_problems(args) -> list[str]:
    """Every problem of the data and tokenizer flags (empty if none), for validation before
    any process group: --data-path entries that are not indexed datasets, a malformed --split
    (or one without train weight), tokenizer flags without their files, and --mock-data with
    --data-path. The launcher's validation calls this one function."""
    from megatron_fsdp.training.data.gpt_dataset import parse_split
    from megatron_fsdp.training.data.tokenizers import tokenizer_problems

    problems = []
    if getattr(args, "mock_data", False) and args.data_path:
        problems.append("--mock-data and --data-path are exclusive; pick one data source")
    problems += data_path_problems(args.data_path)
    try:
        if parse_split(args.split)[0] == 0:
            problems.append(f"--split {args.split!r} gives the train split no weight; put it first, e.g. '969,30,1'")
    except ValueError as exc:
        problems.append(str(exc))
    kind = getattr(args, "tokenizer_type", None)
    problems += tokenizer_problems(getattr(kind, "value", kind), vocab_file=getattr(args, "vocab_file", None),
                                   merge_file=getattr(args, "merge_file", None),
                                   tokenizer_model=getattr(args, "tokenizer_model", None),
                                   vocab_size=getattr(args, "vocab_size", None))
    return problems


def build_tokenizer_from_args(args):
    """The tokenizer of the launcher's parsed flags (``--tokenizer-type`` and its file flags)."""
    from megatron_fsdp.training.data.tokenizers import build_tokenizer

    kind = getattr(args, "tokenizer_type", None) or "ByteTokenizer"
    kind = getattr(kind, "value", kind)
    return build_tokenizer(kind, vocab_file=getattr(args, "vocab_file", None),
                           merge_file=getattr(args, "merge_file", None),
                           tokenizer_model=getattr(args, "tokenizer_model", None),
                           vocab_size=getattr(args, "vocab_size", None),
                           vocab_extra_ids=getattr(args, "vocab_extra_ids", None) or 0)


def build_datasets(args) -> tuple[SampleSource, SampleSource | None]:
    """(train, valid) sources for the parsed flags; valid is None when the split has none."""
    mock = bool(getattr(args, "mock_data", False))
    if mock or args.data_path:
        # --mock-data: megatron-core's mock documents (MockGPTDataset), so a seed gives the
        # samples Megatron-LM gives; the split is its fixed 1,1,1 then.
        num_samples = train_valid_test_num_samples(
            train_iters=args.train_iters, global_batch_size=args.global_batch_size,
            eval_interval=args.eval_interval, eval_iters=args.eval_iters,
            train_samples=getattr(args, "train_samples", None),
            eval_global_batch_size=getattr(args, "eval_global_batch_size", None))
        tokenizer = build_tokenizer_from_args(args)
        datasets = build_train_valid_test_datasets(
            data_path=None if mock else args.data_path, mock=mock, split=args.split, seq_length=args.seq_length,
            seed=args.seed, tokenizer=tokenizer, num_samples=num_samples,
            cache_path=getattr(args, "data_cache_path", None))
        valid = datasets.valid if args.eval_iters > 0 else None
        if datasets.valid is None and args.eval_iters > 0:
            logger.warning("the validation split of --split %s is empty; evaluation is skipped", args.split)
        if getattr(args, "fim_data", False):  # Megatron-LM's GPTFIMDataset over the same samples (fim.py)
            from megatron_fsdp.training.data.fim import wrap_fim_sources

            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            return wrap_fim_sources(args, tokenizer, datasets.train, valid, dp_rank=rank)
        return datasets.train, valid
    tokens = load_corpus_tokens(None)
    from megatron_fsdp.training.data.gpt_dataset import parse_split

    train_w, valid_w, _ = split_windows(tokens.numel(), args.seq_length, parse_split(args.split))
    train = TextDataset(tokens, train_w, args.seq_length, args.seed)
    valid = TextDataset(tokens, valid_w, args.seq_length, args.seed + 1) if len(valid_w) else None
    if valid is None and args.eval_iters > 0:
        logger.warning("the validation split of --split %s is empty; evaluation is skipped", args.split)
    return train, valid
