"""Conformance with upstream megatron-fsdp 0.6.1's public API, as recorded by
``scripts/record_upstream_api.py`` in ``tests/data/upstream_api_0.6.1.json``: every
upstream parameter, config field, method and the helpers Megatron-LM imports must
exist here; defaults must match except where listed (with the reason); upstream
options this engine does not implement raise NotImplementedError naming them."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch

import megatron_fsdp as mf
import megatron_fsdp.uneven_dtensor
import megatron_fsdp.utils
from megatron_fsdp.config import UNIMPLEMENTED_OPTIONS

API = json.loads((Path(__file__).parent / "data" / "upstream_api_0.6.1.json").read_text())

OURS = {
    "fully_shard_model": mf.fully_shard_model,
    "fully_shard_optimizer": mf.fully_shard_optimizer,
    "fully_shard": mf.fully_shard,
    "MegatronFSDP": mf.MegatronFSDP.__init__,
    "FSDPDistributedIndex": mf.FSDPDistributedIndex.__init__,
}
# Defaults that differ on purpose: (callable or class, name) -> why.
KNOWN_DEFAULT_DIFFERENCES = {
    ("MegatronFSDP", "dist_index"): "ours builds a default (world, 1) mesh when omitted; upstream requires it",
    ("FSDPDistributedIndex", "dp_shard_dim"): "required here (upstream raises later without an FSDP group)",
}
# Helpers Megatron-LM's own code imports from upstream's modules.
MEGATRON_LM_IMPORTS = {
    "utils": ["find_megatron_fsdp", "get_mcore_tensor_parallel_partition_dim", "is_mcore_tensor_model_parallel"],
    "uneven_dtensor": ["preprocess_state_dict_for_uneven_dtensor", "split_dtensor", "uneven_dtensor_to_full_tensor"],
}


def _default(source):
    """An upstream default (recorded as source text) as a value."""
    return eval(source, {"torch": torch, "MixedPrecisionPolicy": mf.MixedPrecisionPolicy})  # noqa: S307 (our own data file)


def _check_callable(label, recorded):
    ours = inspect.signature(OURS[label]).parameters
    missing = [p["name"] for p in recorded if p["name"] not in ours]
    assert not missing, f"{label} lacks upstream parameters {missing}"
    # Upstream's positional order is a prefix of ours, so positional calls bind alike.
    ours_order = [n for n in ours if n != "self"][: len(recorded)]
    assert ours_order == [p["name"] for p in recorded], f"{label}: parameter order differs from upstream's"
    for p in recorded:
        if p["default"] is None or (label, p["name"]) in KNOWN_DEFAULT_DIFFERENCES:
            continue
        assert ours[p["name"]].default == _default(p["default"]), f"{label}({p['name']}=...) default differs"


@pytest.mark.parametrize("name", sorted(API["functions"]))
def test_fully_shard_signatures(name):
    _check_callable(name, API["functions"][name])


@pytest.mark.parametrize("cls", sorted(API["inits"]))
def test_constructor_signatures(cls):
    _check_callable(cls, API["inits"][cls])


def test_mixed_precision_policy_fields():
    ours = {f.name: f.default for f in dataclasses.fields(mf.MixedPrecisionPolicy)}
    for field in API["dataclasses"]["MixedPrecisionPolicy"]:
        assert field["name"] in ours
        assert ours[field["name"]] == _default(field["default"])


def test_every_ddp_config_field_with_upstream_default():
    ours = {f.name: f for f in dataclasses.fields(mf.DistributedDataParallelConfig)}
    missing = [f["name"] for f in API["dataclasses"]["DistributedDataParallelConfig"] if f["name"] not in ours]
    assert not missing, f"DistributedDataParallelConfig lacks upstream fields {missing}"
    cfg = mf.DistributedDataParallelConfig()
    for field in API["dataclasses"]["DistributedDataParallelConfig"]:
        assert getattr(cfg, field["name"]) == _default(field["default"]), field["name"]


def test_dist_index_methods():
    for method, params in API["methods"]["FSDPDistributedIndex"].items():
        ours = getattr(mf.FSDPDistributedIndex, method, None)
        assert callable(ours), f"FSDPDistributedIndex.{method} is missing"
        names = list(inspect.signature(ours).parameters)
        assert [p["name"] for p in params] == [n for n in names if n != "self"], method


@pytest.mark.parametrize("cls", ["MixedPrecisionPolicy", "DistributedDataParallelConfig"])
def test_dataclass_fields_take_upstreams_positions(cls):
    """Upstream's dataclasses accept positional arguments: ours start with upstream's
    fields in upstream's order (they were keyword-only here, in another order)."""
    upstream = [f["name"] for f in API["dataclasses"][cls]]
    ours = [f.name for f in dataclasses.fields(getattr(mf, cls)) if f.init]
    assert ours[: len(upstream)] == upstream


def test_positional_dataclass_arguments():
    policy = mf.MixedPrecisionPolicy(torch.float32, torch.bfloat16, torch.bfloat16)
    assert (policy.main_params_dtype, policy.main_grads_dtype, policy.grad_comm_dtype) == (
        torch.float32, torch.bfloat16, torch.bfloat16)
    cfg = mf.DistributedDataParallelConfig(True, True)
    assert cfg.overlap_grad_reduce and cfg.overlap_param_gather


def test_megatron_fsdp_methods():
    """Every public method of upstream's MegatronFSDP, with its parameter names (Megatron-LM's
    schedules and finalize_model_grads call synchronize_param_gather, synchronize_gradient_reduce
    and finish_grad_sync(force_all_reduce=...))."""
    for method, params in API["methods"]["MegatronFSDP"].items():
        ours = getattr(mf.MegatronFSDP, method, None)
        assert callable(ours), f"MegatronFSDP.{method} is missing"
        names = [n for n, p in inspect.signature(ours).parameters.items()
                 if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert [p["name"] for p in params] == names, method


@pytest.mark.parametrize("module", sorted(MEGATRON_LM_IMPORTS))
def test_helpers_megatron_lm_imports(module):
    ours = getattr(mf, module)
    for name in MEGATRON_LM_IMPORTS[module]:
        assert name in API["helpers"][module], f"{module}.{name} is not upstream's"  # keep the list honest
        assert callable(getattr(ours, name, None)), f"megatron_fsdp.{module}.{name} is missing"


def test_uneven_dtensor_module_has_all_of_upstreams_helpers():
    missing = [n for n in API["helpers"]["uneven_dtensor"] if not hasattr(mf.uneven_dtensor, n)]
    assert not missing


# -- upstream options we do not implement ---------------------------------------------
@pytest.mark.parametrize("name", sorted(UNIMPLEMENTED_OPTIONS))
def test_unimplemented_config_options_raise_naming_themselves(name):
    accepted = UNIMPLEMENTED_OPTIONS[name][0]
    mf.DistributedDataParallelConfig(**{name: accepted})  # upstream's default: fine
    with pytest.raises(NotImplementedError, match=name):
        mf.DistributedDataParallelConfig(**{name: not accepted})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, "fp64"])
def test_any_floating_main_params_dtype(dtype):
    policy = mf.MixedPrecisionPolicy(main_params_dtype=dtype)
    assert policy.main_params_dtype.is_floating_point


def test_fully_shard_rejects_unknown_keywords_as_python_does():
    with pytest.raises(TypeError, match="not_an_option"):
        mf.fully_shard(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), not_an_option=1)
