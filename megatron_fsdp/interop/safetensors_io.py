"""``safetensors`` checkpoints, one file or a sharded directory, read lazily and written shard
by shard.

``SafetensorsReader`` opens the files memory-mapped (``safe_open``) and hands out row ranges
(dim 0) or column ranges (dim 1) through ``get_slice``: only the bytes of the requested
slice are read, never a whole tensor unless asked for. It counts what it returned
(``stats``), so a test can tell that a rank read only its own slices.

``SafetensorsWriter`` takes tensors one at a time and starts a new shard when the next tensor
would push the current one past ``max_shard_size`` (a tensor larger than the limit gets a
shard of its own); ``close`` names the shards as ``transformers`` does
(``model-00001-of-00003.safetensors``, or ``model.safetensors`` when there is only one) and
writes ``model.safetensors.index.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def _safetensors():
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:
        raise ImportError("reading and writing Hugging Face checkpoints needs the safetensors package: "
                          "pip install --no-deps safetensors") from exc
    return safetensors


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or ``transformers``' spelling ("5GB" = 5 * 10^9, "500MiB")."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
        if match is None:
            raise ValueError(f"max_shard_size={size!r} is not a size; pass bytes or a string like '5GB' or '500MiB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive")
    return value


@dataclasses.dataclass
class ReadStats:
    """What a reader handed out: for the tests that check each rank reads only its slices."""

    tensors: int = 0
    """Slices returned."""
    rows: int = 0
    """Rows (dim 0 of the slice as returned) over all slices."""
    bytes: int = 0
    """Bytes of the slices returned."""


class SafetensorsReader:
    """Lazy, memory-mapped access to a ``safetensors`` file or a directory of them (with
    ``model.safetensors.index.json``, or a single ``model.safetensors``). Use as a context
    manager, or call ``close``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._safetensors = _safetensors()
        path = os.fspath(path)
        self.weight_map = _weight_map(path)
        """Tensor name -> the file holding it."""
        self._handles: dict[str, object] = {}
        self.stats = ReadStats()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap when dropped

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"{name!r} is not in the checkpoint")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._safetensors.safe_open(file, framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(name).get_dtype()
        if code not in _DTYPES:
            raise ValueError(f"{name!r} is stored as {code}, which this reader does not convert")
        return _DTYPES[code]

    def read(self, name: str, rows: Optional[tuple[int, int]] = None, *,
             columns: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Rows ``[start, end)`` of ``name`` (all when ``None``) and, for a 2-D tensor,
        columns ``[start, end)`` (all when ``None``): only those bytes are read."""
        view = self._slice(name)
        shape = view.get_shape()
        if not shape:  # a 0-d tensor: nothing to slice
            out = self._handles[self.weight_map[name]].get_tensor(name)
        else:
            row_slice = slice(*rows) if rows is not None else slice(None)
            if columns is not None:
                if len(shape) < 2:
                    raise ValueError(f"{name!r} has shape {tuple(shape)}: no columns to slice")
                out = view[row_slice, slice(*columns)]
            else:
                out = view[row_slice]
        self.stats.tensors += 1
        self.stats.rows += out.shape[0] if out.dim() else 1
        self.stats.bytes += out.numel() * out.element_size()
        return out


def _weight_map(path: str) -> dict[str, str]:
    """Tensor name -> file, for a file or a directory (index, or a single file)."""
    if os.path.isfile(path):
        files = [path]
    else:
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as handle:
                mapping = json.load(handle)["weight_map"]
            return {name: os.path.join(path, file) for name, file in mapping.items()}
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")) \
            if os.path.isdir(path) else []
        if not files:
            raise FileNotFoundError(f"no {INDEX_FILE} and no *.safetensors file in {path!r}; pass a Hugging Face "
                                    "model directory saved with safe_serialization=True")
    safetensors = _safetensors()
    out: dict[str, str] = {}
    for file in files:
        with safetensors.safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                out[name] = file
    return out


class SafetensorsWriter:
    """Writes tensors one at a time into shards of at most ``max_shard_size`` bytes (a
    larger tensor alone in its shard), then names them and writes the index in ``close``."""

    def __init__(self, out_dir: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> None:
        self._safetensors = _safetensors()
        self.out_dir = os.fspath(out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        self.max_shard_size = parse_size(max_shard_size)
        self._current: dict[str, torch.Tensor] = {}
        self._current_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (temporary file, its tensor names)
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (copied to a private contiguous host tensor) under ``name``."""
        size = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + size > self.max_shard_size:
            self._flush()
        if name in self._current or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        self._current[name] = tensor.detach().to("cpu").contiguous().clone()
        self._current_bytes += size
        self.total_size += size

    def _flush(self) -> None:
        if not self._current:
            return
        temp = os.path.join(self.out_dir, f".shard-{len(self._shards):05d}.safetensors.partial")
        self._safetensors.torch.save_file(self._current, temp, metadata={"format": "pt"})
        self._shards.append((temp, list(self._current)))
        self._current, self._current_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, name the shards and write the index; the files written."""
        self._flush()
        count = len(self._shards)
        if count == 0:
            return []
        if count == 1:
            final = os.path.join(self.out_dir, SINGLE_FILE)
            os.replace(self._shards[0][0], final)
            return [final]
        weight_map, files = {}, []
        for number, (temp, names) in enumerate(self._shards, start=1):
            file = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(temp, os.path.join(self.out_dir, file))
            weight_map.update({name: file for name in names})
            files.append(os.path.join(self.out_dir, file))
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.out_dir, INDEX_FILE), "w", encoding="utf-8") as handle:
            json.dump(index, handle, indent=2)
        return files
