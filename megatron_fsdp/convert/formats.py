"""Which checkpoint format a directory holds, and where its data lies.

Four formats, told apart by their files (what was looked for is named when none matches):

- ``hf``: a Hugging Face model directory: ``config.json`` and ``*.safetensors`` (or the
  ``model.safetensors.index.json`` of a sharded one).
- ``torch_dist``: megatron-core's distributed checkpoint (``metadata.json`` with the
  ``torch_dist`` backend), in an ``iter_*`` directory of a Megatron-LM root or given itself.
- ``fsdp_dtensor``: this project's DCP layout as the launcher writes it (``.metadata`` and
  ``extra_state_rank0.pt``), likewise.
- ``torch``: Megatron-LM's legacy ``iter_*/mp_rank_00/model_optim_rng.pt``.

A Megatron-LM root is a folder with the tracker ``latest_checkpointed_iteration.txt``; the
iteration is the tracker's unless asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Optional

from megatron_fsdp.interop.hf_checkpoint import is_hf_directory
from megatron_fsdp.interop.torch_dist_io import is_torch_dist_checkpoint
from megatron_fsdp.state import EXTRA_STATE_FILE
from megatron_fsdp.training.checkpoint.dcp_checkpoint import TRACKER_FILENAME, checkpoint_dir, read_tracker
from megatron_fsdp.training.checkpoint.torch_checkpoint import model_file

__all__ = ["CheckpointFormat", "Located", "UnknownFormatError", "locate"]


class CheckpointFormat(enum.Enum):
    """A checkpoint format the converter reads and writes (``--output-format`` values)."""

    HF = "hf"
    """A ``transformers`` model directory (sharded safetensors, ``config.json``)."""
    TORCH_DIST = "torch_dist"
    """megatron-core's ``dist_checkpointing`` format, what Megatron-LM saves by default."""
    FSDP_DTENSOR = "fsdp_dtensor"
    """This project's DCP layout (the launcher's ``--ckpt-format fsdp_dtensor``)."""
    TORCH = "torch"
    """Megatron-LM's legacy one-file format (``mp_rank_00/model_optim_rng.pt``)."""


class UnknownFormatError(ValueError):
    """A directory holds none of the formats (or not the one named)."""


@dataclasses.dataclass(frozen=True)
class Located:
    """Where a checkpoint's data lies."""

    format: CheckpointFormat
    data_dir: str
    """The Hugging Face directory, or the ``iter_*`` directory of a Megatron-LM root."""
    root: Optional[str]
    """The Megatron-LM root holding the tracker (None for ``hf`` and a bare directory)."""
    iteration: int
    """The checkpoint's iteration (0 for ``hf``)."""


def _iteration_format(data_dir: str, root: str, iteration: int) -> Optional[CheckpointFormat]:
    if is_torch_dist_checkpoint(data_dir):
        return CheckpointFormat.TORCH_DIST
    if os.path.isfile(os.path.join(data_dir, ".metadata")) and \
            os.path.isfile(os.path.join(data_dir, EXTRA_STATE_FILE.format(rank=0))):
        return CheckpointFormat.FSDP_DTENSOR
    if os.path.isfile(model_file(root, iteration)):
        return CheckpointFormat.TORCH
    return None


def _megatron_place(path: str, iteration: Optional[int]) -> Optional[tuple[str, str, int]]:
    """(root, iteration directory, iteration) of a Megatron-LM root or of one of its ``iter_*``."""
    name = os.path.basename(os.path.normpath(path))
    if name.startswith("iter_") and name[5:].isdigit():
        root = os.path.dirname(os.path.normpath(path))
        return root, path, int(name[5:])
    tracked = read_tracker(path) if iteration is None else iteration
    if tracked is None:
        return None
    return path, checkpoint_dir(path, tracked), tracked


def locate(path: str, *, iteration: Optional[int] = None, expected: Optional[CheckpointFormat] = None) -> Located:
    """The format and data of the checkpoint at ``path`` (``expected``: the one the caller
    names, checked rather than guessed)."""
    if not os.path.isdir(path):
        raise UnknownFormatError(f"--input {path}: no such directory")
    found: Optional[Located] = None
    if is_hf_directory(path):
        found = Located(CheckpointFormat.HF, path, None, 0)
    else:
        place = _megatron_place(path, iteration)
        if place is not None and os.path.isdir(place[1]):
            fmt = _iteration_format(place[1], place[0], place[2])
            found = Located(fmt, place[1], place[0], place[2]) if fmt is not None else None
        elif place is None and is_torch_dist_checkpoint(path):
            found = Located(CheckpointFormat.TORCH_DIST, path, None, 0)
    if found is None:
        raise UnknownFormatError(
            f"--input {path} holds no checkpoint this converter reads. It looked for: config.json with *.safetensors "
            f"(hf); {TRACKER_FILENAME} naming an iter_* directory (or an iter_* directory itself) holding "
            "metadata.json of the torch_dist backend (torch_dist), .metadata with extra_state_rank0.pt "
            "(fsdp_dtensor) or mp_rank_00/model_optim_rng.pt (torch); a bare torch_dist directory. Point --input at "
            "one of these (and --iteration at a saved iteration)")
    if expected is not None and found.format is not expected:
        raise UnknownFormatError(f"--input {path} holds a {found.format.value} checkpoint, not the "
                                 f"--input-format {expected.value} asked for; drop --input-format or fix the path")
    return found
