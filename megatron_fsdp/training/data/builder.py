"""Train/valid/test datasets for ``--data-path``/``--split``/``--data-cache-path``/``--mock-data``.

The launcher calls::

    tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=..., merge_file=..., ...)
    datasets = build_train_valid_test_datasets(
        data_path=args.data_path, split=args.split, seq_length=args.seq_length, seed=args.seed,
        tokenizer=tokenizer, num_samples=train_valid_test_num_samples(...),
        cache_path=args.data_cache_path, mock=args.mock_data)
    datasets.train.sample(i)   # int64 tensor of seq_length + 1 tokens (a SampleSource)

on every rank (with torch.distributed initialised or not). The datasets are built by
megatron-core's ``BlendedMegatronDatasetBuilder`` when megatron-core and its C++ helpers
import here (``Backend.MEGATRON_CORE``), else by this package's own implementation of the
same algorithm (``Backend.NATIVE``); both give identical samples (tests/test_data_gpt.py).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from collections import OrderedDict
from typing import Sequence

import torch

from megatron_fsdp.training.data import blending, gpt_dataset, indexed
from megatron_fsdp.training.data.blending import BlendedDataset, parse_data_path

logger = logging.getLogger(__name__)


class Backend(enum.Enum):
    """Who builds the GPT datasets."""

    AUTO = "auto"
    """megatron-core when it can run here, else native."""
    MEGATRON_CORE = "megatron-core"
    """megatron-core's BlendedMegatronDatasetBuilder / GPTDataset / BlendedDataset."""
    NATIVE = "native"
    """This package's gpt_dataset.py and blending.py."""


@functools.lru_cache(maxsize=1)
def megatron_core_unavailable_reason() -> str | None:
    """None when megatron-core's dataset classes and C++ helpers import, else why not."""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers  # noqa: F401  (the compiled helpers_cpp)
            from megatron.core.datasets import blended_megatron_dataset_builder  # noqa: F401
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: F401
    except Exception as exc:  # ImportError, or the helpers' build step failing
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_backend(backend: Backend | str) -> Backend:
    backend = Backend(backend)
    if backend is Backend.AUTO:
        return Backend.NATIVE if megatron_core_unavailable_reason() else Backend.MEGATRON_CORE
    if backend is Backend.MEGATRON_CORE and megatron_core_unavailable_reason():
        raise RuntimeError(f"megatron-core's datasets cannot run here ({megatron_core_unavailable_reason()}); "
                           "install it with scripts/setup_megatron_core.sh or use backend='native'")
    return backend


class MegatronSampleSource:
    """A Megatron-style dataset seen as a SampleSource: ``sample(i)`` is the int64 tensor of
    ``seq_length + 1`` tokens of sample ``i`` (``tokens`` followed by the last label)."""

    def __init__(self, dataset, name: str) -> None:
        self.dataset = dataset
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def sample(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self.dataset):
            raise IndexError(f"{self.name} sample {index} is past the {len(self.dataset)} samples this dataset was "
                             "built for; build it with num_samples covering every iteration "
                             "(train_valid_test_num_samples)")
        item = self.dataset[index]
        return torch.cat([item["tokens"], item["labels"][-1:]]).to(torch.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainValidTestDatasets:
    train: MegatronSampleSource | None
    """Training samples; None only when the train split is empty."""
    valid: MegatronSampleSource | None
    """Validation samples; None when the split gives it no weight."""
    test: MegatronSampleSource | None
    """Test samples; None when the split gives it no weight."""
    backend: Backend
    """Who built them."""


def train_valid_test_num_samples(*, train_iters: int | None, global_batch_size: int, eval_interval: int,
                                 eval_iters: int, train_samples: int | None = None,
                                 eval_global_batch_size: int | None = None) -> tuple[int, int, int]:
    """Megatron-LM's sample counts: train iterations x batch, (train_iters // eval_interval + 1)
    evaluations x eval_iters x evaluation batch, and eval_iters x evaluation batch for test; the
    evaluation batch is ``--eval-global-batch-size`` (default: the training batch)."""
    eval_batch = eval_global_batch_size or global_batch_size
    train = train_samples if train_samples else train_iters * global_batch_size
    iters_for_eval = train_iters if train_iters is not None else train // global_batch_size
    valid = (iters_for_eval // eval_interval + 1) * eval_iters * eval_batch if eval_interval > 0 else 0
    return train, valid, eval_iters * eval_batch


def data_path_problems(data_path: Sequence[str] | None) -> list[str]:
    """What is wrong with ``--data-path`` (empty if nothing): for validation, before any process group."""
    if not data_path:
        return []
    try:
        prefixes, _ = parse_data_path(data_path)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    for prefix in prefixes:
        try:
            indexed.check_prefix(prefix)
        except indexed.DataPathError as exc:
            problems.append(str(exc))
    return problems


def build_train_valid_test_datasets(*, data_path: Sequence[str] | None, split: str, seq_length: int, seed: int,
                                    tokenizer, num_samples: Sequence[int | None], cache_path: str | None = None,
                                    mock: bool = False, backend: Backend | str = Backend.AUTO,
                                    ) -> TrainValidTestDatasets:
    """Megatron-LM's GPT datasets (see the module docstring); call on every rank.

    ``data_path``: Megatron's ``--data-path`` list (prefixes, or weight-prefix pairs);
    ``split``: ``'969,30,1'``; ``num_samples``: (train, valid, test) sample counts (None =
    one epoch); ``cache_path``: ``--data-cache-path`` for the index files (default: megatron-
    core's ``<prefix>/cache/GPTDataset_indices``); ``mock``: Megatron's mock documents
    (``data_path`` must then be empty). Missing or non-indexed paths raise DataPathError.
    """
    if mock and data_path:
        raise ValueError("--mock-data and --data-path are exclusive; pick one data source")
    if not mock and not data_path:
        raise ValueError("no data: pass --data-path PREFIX (a preprocess_data.py output) or --mock-data")
    problems = [] if mock else data_path_problems(data_path)
    if problems:
        raise indexed.DataPathError("; ".join(problems))
    data_path = None if mock else list(data_path)
    matrix = _split_matrix(data_path, split)
    num_samples = [0 if bookends is None else n for bookends, n in zip(matrix, num_samples)]
    if data_path and parse_data_path(data_path)[1] is not None and None in num_samples:
        raise ValueError("a weighted --data-path blend needs a sample count for every split it uses, got "
                         f"num_samples={num_samples}")
    chosen = resolve_backend(backend)
    if (chosen is Backend.MEGATRON_CORE and cache_path and data_path and _is_blend(data_path)
            and not torch.distributed.is_initialized()):
        # megatron-core 0.16's BlendedDataset asks torch.distributed for the rank when it
        # writes a cache, and fails without a process group; ours builds the same samples.
        if Backend(backend) is not Backend.AUTO:
            raise RuntimeError("megatron-core's BlendedDataset writes its --data-cache-path only under "
                               "torch.distributed; initialise a process group, drop the cache path, or use "
                               "backend='native' (identical samples)")
        chosen = Backend.NATIVE
    build = _build_megatron_core if chosen is Backend.MEGATRON_CORE else _build_native
    splits = build(data_path=data_path, split=split, matrix=matrix, seq_length=seq_length, seed=seed,
                   tokenizer=tokenizer, num_samples=num_samples, cache_path=cache_path)
    sources = [MegatronSampleSource(d, name) if d is not None else None
               for d, name in zip(splits, gpt_dataset.SPLIT_NAMES)]
    for source, wanted in zip(sources, num_samples):
        # Only an unweighted blend can come out short: megatron-core caps it at one epoch of each member.
        if source is not None and wanted and len(source) < wanted:
            message = (f"the {source.name} data holds {len(source)} samples, fewer than the {wanted} requested: an "
                       "unweighted --data-path blend gives one epoch of each dataset; weight it ('0.5 A 0.5 B') "
                       "to draw as many samples as the run needs")
            if source.name == "train":
                raise ValueError(message)
            logger.warning(message)
    logger.info("> datasets built by %s: %s", chosen.value,
                ", ".join(f"{n} {len(s) if s else 0}" for n, s in zip(gpt_dataset.SPLIT_NAMES, sources)))
    return TrainValidTestDatasets(train=sources[0], valid=sources[1], test=sources[2], backend=chosen)


def _is_blend(data_path: list[str]) -> bool:
    prefixes, weights = parse_data_path(data_path)
    return len(prefixes) > 1 or weights is not None


def _split_matrix(data_path: list[str] | None, split: str) -> list[tuple[float, float] | None]:
    """Megatron's split book-ends, less the splits that hold no document of some dataset.

    [Note: empty splits] megatron-core loops forever on a split with weight but no
    documents (it adds epochs of zero tokens until it has enough); a small corpus under
    the default '969,30,1' has such a test split. That split is dropped (None) with a
    warning; the book-ends of the others stay as given, so their samples do not change.
    """
    matrix = gpt_dataset.split_matrix(gpt_dataset.parse_split("1,1,1" if data_path is None else split))
    if matrix[0] is None:
        raise ValueError(f"--split {split!r} gives the train split no weight; put it first, e.g. '969,30,1'")
    if data_path is None:
        return matrix
    for prefix in parse_data_path(data_path)[0]:
        num_sequences = len(indexed.IndexedDataset(prefix))
        for s, name in enumerate(gpt_dataset.SPLIT_NAMES):
            if matrix[s] is not None and len(gpt_dataset.split_indices(matrix[s], num_sequences)) == 0:
                if s == 0:
                    raise ValueError(f"the train split of --split {split!r} holds none of the {num_sequences} "
                                     f"documents of {prefix!r}; give it more weight or use more documents")
                logger.warning("the %s split of --split %r holds none of the %d documents of %s; it is left empty",
                               name, split, num_sequences, prefix)
                matrix[s] = None
    return matrix


# ---------------------------------------------------------------------------------
# megatron-core


def _build_megatron_core(*, data_path, split, matrix, seq_length, seed, tokenizer, num_samples, cache_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
        from megatron.core.datasets.utils import get_blend_from_list

    blend = get_blend_from_list([t for entry in data_path for t in str(entry).split()]) if data_path else None
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, split=split, path_to_cache=cache_path,
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)
    config.split_matrix = matrix  # see [Note: empty splits]
    cls = MockGPTDataset if data_path is None else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, num_samples, lambda: True, config).build()


# ---------------------------------------------------------------------------------
# native (the same steps; see gpt_dataset.py and blending.py)


def _build_native(*, data_path, split, matrix, seq_length, seed, tokenizer, num_samples, cache_path):
    common = dict(split=matrix, seq_length=seq_length, seed=seed, cache_path=cache_path,
                  identity=OrderedDict(seed=seed, seq_length=seq_length, split=split,
                                       tokenizer=dict(tokenizer.unique_identifiers)))
    if data_path is None:
        low = gpt_dataset.MockLowLevelDataset(tokenizer.vocab_size, tokenizer.eod)
        return _native_splits(low, None, num_samples, **common)
    prefixes, weights = parse_data_path(data_path)
    if len(prefixes) == 1 and weights is None:
        return _native_splits(indexed.IndexedDataset(prefixes[0]), prefixes[0], num_samples, **common)
    if weights is not None:
        weights = blending.normalize(weights)
        targets = [blending.sizes_per_dataset(weights, n) for n in num_samples]
        buffers = [blending.sizes_per_dataset(weights, n, blending.MID_LEVEL_DATASET_SURPLUS) for n in num_samples]
        per_dataset = [[b[d] if b is not None else None for b in buffers] for d in range(len(prefixes))]
    else:
        targets, per_dataset = [None] * 3, [[None] * 3 for _ in prefixes]
    mids = [_native_splits(indexed.IndexedDataset(p), p, per_dataset[d], **common) for d, p in enumerate(prefixes)]
    blended = []
    for s, name in enumerate(gpt_dataset.SPLIT_NAMES):
        if matrix[s] is None:
            blended.append(None)
            continue
        members = [mids[d][s] for d in range(len(prefixes))]
        cached = dict(split_name=name, cache_dir=cache_path)  # megatron-core caches blends only under the flag
        if weights is not None:
            blended.append(BlendedDataset(members, weights, sum(targets[s]), **cached))
        elif num_samples[s] is not None:
            lengths = [len(m) for m in members]
            blended.append(BlendedDataset(members, lengths, min(num_samples[s], sum(lengths)), **cached))
        else:
            blended.append(BlendedDataset(members, None, None, **cached))
    return blended


def _native_splits(low, prefix, num_samples, *, split, seq_length, seed, cache_path, identity):
    if cache_path is None and prefix is not None:
        cache_path = f"{prefix}/cache/GPTDataset_indices"  # megatron-core's default place
    datasets = []
    for s, name in enumerate(gpt_dataset.SPLIT_NAMES):
        if split[s] is None:
            datasets.append(None)
            continue
        indices = gpt_dataset.split_indices(split[s], len(low.sequence_lengths))
        description = OrderedDict(cls="GPTDataset", dataset_path=prefix, **identity)
        datasets.append(gpt_dataset.GPTDataset(low, indices, num_samples[s], name, seed=seed, seq_length=seq_length,
                                               cache_dir=cache_path, description=description))
    return datasets
