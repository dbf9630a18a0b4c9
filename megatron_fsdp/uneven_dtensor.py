"""Upstream's module path ``megatron_fsdp.uneven_dtensor``: helpers for DTensors whose shards
are uneven. They live in ``state/uneven_dtensor.py``, beside the state dicts that use them."""

from .state.uneven_dtensor import (  # noqa: F401  upstream's names
    filter_unflattened_state_dict,
    gather_and_compute_chunk_metadata,
    gather_uneven_dtensor_to_full_tensor,
    get_unflattened_state_dict,
    preprocess_state_dict_for_uneven_dtensor,
    redistribute_uneven_dtensor_to_replicated,
    split_dtensor,
    uneven_dtensor_to_full_tensor,
    update_uneven_dtensor_chunk_metadata,
    validate_uneven_dtensor,
)
