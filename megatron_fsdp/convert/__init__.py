"""The checkpoint converter, ``python -m megatron_fsdp.convert`` (the ``megatron-fsdp-convert``
command): a checkpoint in one of four formats to another, Hugging Face ``transformers``
directories, megatron-core ``torch_dist``, this project's ``fsdp_dtensor`` and Megatron-LM's
legacy ``torch``, in one process or under ``torchrun``. It sits on the launcher's floor and reads
and writes through the same calls the launcher and the library make (``megatron_fsdp.interop``,
``training/checkpoint/``).

Modules, one concern each:

- ``formats.py``: which format a directory holds (``locate``), and where its data lies.
- ``architecture.py``: the model the checkpoint holds (``read_source``: ``config.json``, the
  configuration in ``common.pt``, or the launcher's saved flags).
- ``model_io.py``: the model in between: built, read from the input, written to the output.
- ``cli.py``: the command line (``main``); ``__main__.py`` runs it for ``python -m``.
"""
