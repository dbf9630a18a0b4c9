"""The decoder layers of a Hugging Face ``transformers`` model: the natural FSDP units when
such a model is wrapped directly (``fully_shard_model(model, fsdp_unit_modules=...)``, or
``experimental.fully_shard`` per layer then the root).

[Note: decoder layers from _no_split_modules] Every ``transformers`` model class declares
``_no_split_modules``, the names of the module classes its device-map placement must keep
whole: for a causal language model these are its decoder layers (``LlamaDecoderLayer``,
``MixtralDecoderLayer``, ``GPT2Block``). They are found by that declaration rather than by a
table of families, so a family this package has never seen works the same way, and nothing
here imports ``transformers``.
"""

from __future__ import annotations

import torch.nn as nn


def _declared_names(model: nn.Module) -> frozenset[str]:
    declared = getattr(model, "_no_split_modules", None)
    if not declared:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules (the transformers attribute naming its "
            "decoder-layer classes); pass fsdp_unit_modules=[<its decoder-layer class>] yourself")
    return frozenset(declared)


def hf_decoder_layer_classes(model: nn.Module) -> list[type]:
    """The decoder-layer classes of ``model`` (a ``transformers`` ``PreTrainedModel``), in
    module order, for ``fsdp_unit_modules``. Call it before wrapping: ``experimental.fully_shard``
    renames the class of each module it shards."""
    names = _declared_names(model)
    found: dict[type, None] = {}
    for module in model.modules():
        if type(module).__name__ in names:
            found.setdefault(type(module))
    if not found:
        raise ValueError(
            f"{type(model).__name__} declares decoder layers {sorted(names)} but holds none of them (already wrapped, "
            "or an empty model?); call hf_decoder_layer_classes on the unwrapped model")
    return list(found)


def hf_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder-layer modules of ``model``, in module order: the modules to shard one by one
    before the root with ``experimental.fully_shard``."""
    classes = tuple(hf_decoder_layer_classes(model))
    return [module for module in model.modules() if isinstance(module, classes)]
