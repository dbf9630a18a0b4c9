"""Megatron's indexed dataset files (``prefix.bin`` + ``prefix.idx``), read and written by our own code.

[Note: indexed dataset format] ``prefix.bin`` is every token of every sequence, back
to back, in one dtype, with no header. ``prefix.idx`` describes it, little-endian:

    offset  size        field
    0       9           magic b"MMIDIDX\\x00\\x00"
    9       8  (u64)    version, always 1
    17      1  (u8)     dtype code of the .bin tokens (below)
    18      8  (u64)    S, the number of sequences
    26      8  (u64)    D, the number of entries of the document index
    34      4*S (i32)   sequence lengths, in tokens
    ..      8*S (i64)   sequence pointers, byte offsets into .bin
    ..      8*D (i64)   document index: sequence numbers where documents start, [0, ..., S]
    ..      S   (i8)    sequence modes (multimodal datasets only)

dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.
Megatron-LM's preprocess writes uint16 when the vocabulary has fewer than 65500 tokens,
else int32. A "sequence" is a sentence when preprocess split sentences, else a whole
document; GPT datasets split and sample by sequence.

``IndexedDataset`` reads the same files megatron-core's ``IndexedDataset`` reads and
``IndexedDatasetWriter`` writes what its ``IndexedDatasetBuilder`` writes
(``tests/test_data_indexed.py`` checks both directions).
"""

from __future__ import annotations

import enum
import os
import shutil
import struct
from typing import Iterable, Sequence

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34 bytes


class DataPathError(ValueError):
    """A ``--data-path`` entry that is not a readable indexed dataset."""


class DType(enum.IntEnum):
    """Token dtype codes of the ``.idx`` header (see [Note: indexed dataset format])."""

    UINT8 = 1
    INT8 = 2
    INT16 = 3
    INT32 = 4
    INT64 = 5
    FLOAT64 = 6
    FLOAT32 = 7
    UINT16 = 8

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(self.name.lower())

    @classmethod
    def from_numpy(cls, dtype) -> "DType":
        name = np.dtype(dtype).name.upper()
        if name not in cls.__members__:
            raise ValueError(f"dtype {np.dtype(dtype)} has no indexed-dataset code; use one of "
                             f"{', '.join(m.name.lower() for m in cls)}")
        return cls[name]


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron-LM's token dtype for a vocabulary: uint16 below 65500 tokens, else int32."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def check_prefix(path: str) -> None:
    """Raise DataPathError, naming the files expected, unless ``path`` is the prefix of a ``.bin``/``.idx`` pair."""
    if exists(path):
        return
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix) and exists(path[: -len(suffix)]):
            raise DataPathError(
                f"--data-path {path!r} names one file of an indexed dataset; pass the prefix without the "
                f"extension: {path[: -len(suffix)]!r} (Megatron reads {path[: -len(suffix)]}.bin and "
                f"{path[: -len(suffix)]}.idx)")
    missing = [p for p in (bin_path(path), idx_path(path)) if not os.path.isfile(p)]
    hint = ""
    if os.path.isfile(path):
        hint = (f" {path!r} itself is a file, not a prefix: raw text, JSON lines or a bare .bin are not read as "
                f"training data; convert text with `python3 scripts/preprocess_data.py --input {path} "
                "--output-prefix PREFIX --tokenizer-type ... --append-eod --workers 1` and pass "
                "PREFIX_text_document")
    raise DataPathError(
        f"--data-path {path!r} is not a Megatron indexed dataset: expected the pair {bin_path(path)!r} and "
        f"{idx_path(path)!r}, missing {' and '.join(repr(m) for m in missing)}.{hint}")


class IndexedDataset:
    """Read-only view of ``prefix.bin``/``prefix.idx`` (memory-mapped; see [Note: indexed dataset format]).

    ``ds[i]`` is sequence ``i`` as a numpy array of the file's dtype; ``ds.get(i, offset, length)``
    a slice of it. Same interface as megatron-core's IndexedDataset for what GPT datasets use.
    """

    def __init__(self, path_prefix: str, *, multimodal: bool = False) -> None:
        check_prefix(path_prefix)
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self._read_index(idx_path(path_prefix))
        self._bin = np.memmap(bin_path(path_prefix), mode="r", dtype=np.uint8) \
            if os.path.getsize(bin_path(path_prefix)) else np.zeros(0, dtype=np.uint8)
        needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize \
            if len(self.sequence_lengths) else 0
        if self._bin.size < needed:
            raise DataPathError(f"{bin_path(path_prefix)!r} has {self._bin.size} bytes but its index describes "
                                f"{needed}; the .bin and .idx do not belong together (rerun preprocess_data.py)")

    def _read_index(self, path: str) -> None:
        with open(path, "rb") as f:
            header = f.read(_HEADER_SIZE)
        if len(header) < _HEADER_SIZE or header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise DataPathError(f"{path!r} is not a Megatron index file: it must start with {INDEX_MAGIC!r} "
                                "(write it with scripts/preprocess_data.py or megatron-core's IndexedDatasetBuilder)")
        version, code, num_sequences, num_doc_entries = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
        if version != INDEX_VERSION:
            raise DataPathError(f"{path!r} has index version {version}; only version {INDEX_VERSION} exists")
        try:
            self.dtype_code = DType(code)
        except ValueError:
            raise DataPathError(f"{path!r} has token dtype code {code}; known codes are 1-8") from None
        self.dtype = self.dtype_code.numpy
        buf = np.memmap(path, mode="r", dtype=np.uint8)
        offset = _HEADER_SIZE
        need = offset + 12 * num_sequences + 8 * num_doc_entries + (num_sequences if self.multimodal else 0)
        if buf.size < need:
            raise DataPathError(f"{path!r} is truncated: {buf.size} bytes, its header promises {need}")
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=num_sequences, offset=offset)
        offset += 4 * num_sequences
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=num_sequences, offset=offset)
        offset += 8 * num_sequences
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=num_doc_entries, offset=offset)
        offset += 8 * num_doc_entries
        self.sequence_modes = (np.frombuffer(buf, dtype=np.int8, count=num_sequences, offset=offset)
                               if self.multimodal else None)
        if num_doc_entries == 0 or self.document_indices[-1] != num_sequences:
            raise DataPathError(f"{path!r}: the document index must end at the sequence count {num_sequences}, "
                                f"ends at {self.document_indices[-1] if num_doc_entries else 'nothing'}")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"IndexedDataset index must be an int, got {type(idx).__name__}")
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=int(length), offset=start)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1


class IndexedDatasetWriter:
    """Writes ``prefix.bin`` as documents arrive and ``prefix.idx`` at ``finalize()``."""

    def __init__(self, path_prefix: str, dtype=np.int32) -> None:
        self.path_prefix = path_prefix
        self.dtype = np.dtype(dtype)
        self.dtype_code = DType.from_numpy(self.dtype)
        self._bin = open(bin_path(path_prefix), "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """One document; ``lengths`` splits it into sequences (sentences), default one sequence."""
        array = np.asarray(tokens, dtype=self.dtype)
        lengths = [array.size] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != array.size:
            raise ValueError(f"sequence lengths {lengths} add up to {sum(lengths)}, the document has {array.size} "
                             "tokens")
        self._bin.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, other_prefix: str) -> None:
        """Append a whole indexed dataset (used to merge preprocess partitions)."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{other_prefix!r} holds {other.dtype} tokens, this dataset {self.dtype}")
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(int(d) + base for d in other.document_indices[1:])
        with open(bin_path(other_prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin)

    def finalize(self) -> None:
        self._bin.close()
        write_index(idx_path(self.path_prefix), self.dtype, self.sequence_lengths, self.document_indices)


def write_index(path: str, dtype, sequence_lengths: Sequence[int], document_indices: Iterable[int]) -> None:
    """Write an ``.idx`` file (see [Note: indexed dataset format]); pointers follow from the lengths."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths):
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    docs = np.asarray(list(document_indices), dtype=np.int64)
    with open(path, "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(struct.pack("<QBQQ", INDEX_VERSION, DType.from_numpy(dtype), len(lengths), len(docs)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(docs.tobytes(order="C"))
