"""Index arrays cached under ``--data-cache-path`` as megatron-core caches them:
``<cache>/<md5 of the description>-<class>-<split>-<name>.npy`` beside the description text.

[Note: cache files] Every rank that finds no complete set builds the arrays (they are a pure
function of the description), and the writer rank (rank 0, or the only process) saves them
under temporary names renamed into place, so a reader never sees half a file; the next start
memory-maps them instead of building again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)


class IndexCache:
    """The cache files of one dataset split, named by its description's hash."""

    def __init__(self, cache_dir: str | None, kind: str, split_name: str, description: OrderedDict,
                 names: Sequence[str]) -> None:
        self.cache_dir, self.kind, self.split_name, self.names = cache_dir, kind, split_name, tuple(names)
        self.description = json.dumps(description, indent=4)
        self.description_hash = hashlib.md5(self.description.encode("utf-8")).hexdigest()

    def _files(self) -> dict[str, str]:
        base = os.path.join(self.cache_dir, f"{self.description_hash}-{self.kind}-{self.split_name}")
        return {name: f"{base}-{name}.npy" for name in self.names} | {"description": f"{base}-description.txt"}

    def load_or_build(self, build: Callable[[], tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
        """The cached arrays (memory-mapped) when all are there, else ``build()``'s, saved."""
        files = self._files() if self.cache_dir else None
        if files and all(os.path.isfile(p) for p in files.values()):
            logger.info("> loading %s %s indices from %s", self.kind, self.split_name, self.cache_dir)
            return tuple(np.load(files[name], mmap_mode="r") for name in self.names)
        arrays = build()
        if files and _is_writer_rank():
            self._save(files, arrays)
        return arrays

    def _save(self, files: dict[str, str], arrays: tuple[np.ndarray, ...]) -> None:
        os.makedirs(self.cache_dir, exist_ok=True)
        for name, array in zip(self.names, arrays):
            tmp = files[name] + f".tmp{os.getpid()}.npy"
            np.save(tmp, array, allow_pickle=False)
            os.replace(tmp, files[name])
        tmp = files["description"] + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.description)
        os.replace(tmp, files["description"])


def _is_writer_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
