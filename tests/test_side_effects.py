"""Importing megatron_fsdp changes nothing process-wide, and what wrapping registers
costs other optimizers nothing (optimizer.py [Note: step checks]; collectives.py
[Note: gloo works are freed before exit]). Each test runs a fresh interpreter: the
test process and the worker pools have imported and wrapped long before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

IMPORTS = r'''
import atexit
import json

ours = []
_register = atexit.register


def spy(fn, *args, **kwargs):
    if (getattr(fn, "__module__", None) or "").startswith("megatron_fsdp"):
        ours.append(f"{fn.__module__}.{fn.__qualname__}")
    return _register(fn, *args, **kwargs)


atexit.register = spy
import torch
import torch._dynamo.config
import torch.optim.optimizer as torch_optimizer

guards = torch._dynamo.config.skip_nnmodule_hook_guards
callbacks = atexit._ncallbacks()

import megatron_fsdp
import megatron_fsdp.optimizer
import megatron_fsdp.comm.collectives
import megatron_fsdp.mcore_fsdp_adapter
from megatron_fsdp import MegatronFSDP, fully_shard

print(json.dumps({
    "pre_hooks": len(torch_optimizer._global_optimizer_pre_hooks),
    "post_hooks": len(torch_optimizer._global_optimizer_post_hooks),
    "atexit_ours": ours,
    "atexit_added": atexit._ncallbacks() - callbacks,
    "guards_before": guards,
    "guards_after": torch._dynamo.config.skip_nnmodule_hook_guards,
}))
'''

WRAPPED = r'''
import gc
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim.optimizer as torch_optimizer

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
import megatron_fsdp as mf
import megatron_fsdp.optimizer as mo

lookups = [0]


def counted(lookup):
    def count(param):
        lookups[0] += 1
        return lookup(param)
    return count


mo.owner_of, mo.compute_owner_of = counted(mo.owner_of), counted(mo.compute_owner_of)
out = {}


def net():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def steps(optimizer, n=1):
    lookups[0] = 0
    for _ in range(n):
        optimizer.step()
    return lookups[0]


def refusal(optimizer):
    try:
        optimizer.step()
    except ValueError as exc:
        return str(exc)
    return "stepped"


plain = nn.Sequential(*[nn.Linear(2, 2) for _ in range(100)])  # 200 parameters, never wrapped
for p in plain.parameters():
    p.grad = torch.zeros_like(p)
plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
out["before_wrap"] = (steps(plain_opt, 3), len(torch_optimizer._global_optimizer_pre_hooks))
early_module = net()
early_originals = list(early_module.parameters())
early_opt = torch.optim.SGD(early_module.parameters(), lr=0.1)  # built before its module is wrapped
early_opt.step()

module = net()
originals = list(module.parameters())  # the compute parameters, once wrapped
model = mf.MegatronFSDP(module)
out["hooks_after_wrap"] = len(torch_optimizer._global_optimizer_pre_hooks)
out["plain_first"], out["plain_next"] = steps(plain_opt), steps(plain_opt, 5)
plain_opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
out["plain_after_add"], out["plain_after_add_next"] = steps(plain_opt), steps(plain_opt, 3)

bound = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward()
bound.step()
out["plain_bound_at_first_step"] = getattr(bound, "megatron_fsdp_binding", None) is not None
out["mixed"] = refusal(torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1))
out["compute"] = refusal(torch.optim.SGD(originals, lr=0.1))

early_model = mf.MegatronFSDP(early_module)  # early_opt passed its last check: a new generation
out["plain_after_second_wrap"], out["plain_after_second_wrap_next"] = steps(plain_opt), steps(plain_opt)
out["early"] = refusal(early_opt)
passed = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
passed.step()
passed.add_param_group({"params": early_originals})  # compute parameters, after a pass
out["added_compute"] = refusal(passed)

del module, originals, model, early_module, early_originals, early_model, bound, passed, early_opt
gc.collect()
fresh = torch.optim.SGD(plain.parameters(), lr=0.1)
out["no_model_alive"] = steps(fresh, 3)
print(json.dumps(out))
'''


def _run(script: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True,
                            text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_changes_nothing_process_wide():
    out = _run(IMPORTS)
    assert (out["pre_hooks"], out["post_hooks"]) == (0, 0), out
    assert out["atexit_ours"] == [] and out["atexit_added"] == 0, out
    assert out["guards_after"] == out["guards_before"], out


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory) -> dict:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs gloo")
    return _run(WRAPPED, str(tmp_path_factory.mktemp("side_effects") / "init"))


def test_other_optimizers_step_without_ownership_lookups(wrapped):
    out = wrapped
    assert out["before_wrap"] == [0, 0], out  # nothing registered before a model is wrapped
    assert out["hooks_after_wrap"] == 1, out
    # once per optimizer and change (its param groups, a new wrapped model), then free
    assert out["plain_first"] > 0 and out["plain_next"] == 0, out
    assert out["plain_after_add"] > 0 and out["plain_after_add_next"] == 0, out
    assert out["plain_after_second_wrap"] > 0 and out["plain_after_second_wrap_next"] == 0, out
    assert out["no_model_alive"] == 0, out


def test_step_refusals_and_binding_still_happen(wrapped):
    out = wrapped
    assert out["plain_bound_at_first_step"], out
    assert "belongs to no MegatronFSDP model" in out["mixed"] and "another for the rest" in out["mixed"], out
    for case in ("compute", "early", "added_compute"):
        assert "compute parameter" in out[case] and "model.parameters()" in out[case], (case, out[case])
