"""Datasets and the tokenizer from the launcher's parsed flags: ``data_args_problems`` (every
problem of the data and tokenizer flags, for validation before any process group),
``build_tokenizer_from_args`` and ``build_datasets`` (the (train, valid) sources)."""

from __future__ import annotations

import logging

import torch.distributed as dist

from megatron_fsdp.parallel_dims import ParallelDims
from .batching import SampleSource
from .builder import build_train_valid_test_datasets, data_path_problems, train_valid_test_num_samples
from .byte_corpus import TextDataset, load_corpus_tokens, split_windows

logger = logging.getLogger(__name__)


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
                                   vocab_size=getattr(args, "vocab_size", None),
                                   tiktoken_pattern=getattr(args, "tiktoken_pattern", None))
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
                           vocab_extra_ids=getattr(args, "vocab_extra_ids", None) or 0,
                           tiktoken_pattern=getattr(args, "tiktoken_pattern", None),
                           tiktoken_num_special_tokens=getattr(args, "tiktoken_num_special_tokens", None) or 1000,
                           special_tokens=getattr(args, "special_tokens", None))


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

            rank = 0
            if dist.is_initialized():  # the TP ranks of a data-parallel rank read its samples
                rank = ParallelDims.from_args(args, dist.get_world_size()).data_parallel_rank(dist.get_rank())
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
