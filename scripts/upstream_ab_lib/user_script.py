"""The user's training script both sides of the upstream A/B run, and what a run records.

It runs inside a worker (or rank), against that side's ``megatron_fsdp``; the reference
loops (plain AdamW, the fp32-main-weights loop, upstream's primed one) run beside it."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
PRECISIONS = ("fp32", "bf16", "bf16_fp32_grads")
STEPS, SAVE_AT = 5, 3


def _model_classes():
    """Net and Block, built on first use so the driver never imports torch for them."""
    import torch
    from torch import nn

    class Block(nn.Module):
        """Residual MLP block (tests/models.py's shape: 2d+1 divides by nothing)."""

        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 2 * d + 1)
            self.fc2 = nn.Linear(2 * d + 1, d)

        def forward(self, x):
            return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, d: int = 32, depth: int = 3) -> None:
            super().__init__()
            self.inp = nn.Linear(5, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
            self.norm = nn.LayerNorm(d)
            self.out = nn.Linear(d, 3)

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.out(self.norm(h))

    return Net, Block


class UserScript:
    """The training a user writes, against whichever ``megatron_fsdp`` was imported."""

    def __init__(self, mf, device) -> None:
        import torch

        self.mf, self.torch, self.device = mf, torch, device
        self.Net, self.Block = _model_classes()
        g = torch.Generator().manual_seed(1234)
        self.data = [(torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)) for _ in range(STEPS)]

    def policy_kwargs(self, precision: str) -> dict:
        torch = self.torch
        if precision == "fp32":
            return {}
        grads = {"main_grads_dtype": torch.float32} if precision == "bf16_fp32_grads" else {}
        return {"mixed_precision_policy": self.mf.MixedPrecisionPolicy(main_params_dtype=torch.float32, **grads)}

    def build(self, precision: str, seed: int = 0):
        torch = self.torch
        torch.manual_seed(seed)
        module = self.Net().to(self.device)
        return module.to(torch.bfloat16) if precision != "fp32" else module

    def optimizer(self, params):
        return self.torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.1)

    def wrap(self, strategy: str, precision: str, seed: int = 0):
        module = self.build(precision, seed)
        kwargs = dict(fsdp_unit_modules=[self.Block], zero_dp_strategy=STRATEGIES.index(strategy))
        kwargs.update(self.policy_kwargs(precision))
        if self.device.type == "cpu":  # upstream's default mesh is a "cuda" mesh
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("fsdp", "tp"))
            kwargs.update(device=self.device, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp")
        return self.mf.fully_shard(module, self.optimizer(module.parameters()), **kwargs)

    def train(self, model, optimizer, steps: range, dtype) -> list[float]:
        torch = self.torch
        losses = []
        for i in steps:
            x, y = (t.to(self.device) for t in self.data[i])
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    def checkpoint_dict(self, model, optimizer) -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def save(self, model, optimizer, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.checkpoint_dict(model, optimizer), checkpoint_id=str(path))

    def load(self, model, optimizer, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        ckpt = self.checkpoint_dict(model, optimizer)
        dcp.load(state_dict=ckpt, checkpoint_id=str(path))
        model.load_state_dict(ckpt["model"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])


# -- what a worker records -----------------------------------------------------------------
def _full(value):
    """A state-dict value as a full CPU tensor (world size 1: the local shard is whole)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        try:
            value = value.full_tensor()
        except Exception:  # an uneven-DTensor wrapper that cannot redistribute: read the shard
            local = value.to_local()
            value = local.reshape(value.shape) if local.numel() == value.numel() else local
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def meta_of(value) -> dict:
    """What the state_dict rows compare of a value: type, shape, dtype, DTensor placements."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return dict(type="DTensor", shape=list(value.shape), dtype=str(value.dtype),
                    placements=[str(p) for p in value.placements], mesh=list(value.device_mesh.shape))
    if isinstance(value, torch.Tensor):
        return dict(type=type(value).__name__, shape=list(value.shape), dtype=str(value.dtype))
    return dict(type=type(value).__name__, value=repr(value)[:80])


def flatten(state: dict, prefix: str = "") -> dict:
    """A state dict as ``a.b.c`` keys (param groups without their ``params`` lists)."""
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, list) and name.endswith("param_groups"):
            for i, group in enumerate(value):
                out.update(flatten({k: v for k, v in group.items() if k != "params"}, f"{name}.{i}."))
        else:
            out[name] = value
    return out


def snapshot(model, optimizer) -> dict:
    """Both state dicts, their values whole on the CPU and described by ``meta_of``."""
    model_sd = model.state_dict()
    optim_sd = flatten(optimizer.state_dict())
    return dict(model={k: _full(v) for k, v in model_sd.items()},
                model_meta={k: meta_of(v) for k, v in model_sd.items()},
                optim={k: _full(v) for k, v in optim_sd.items()},
                optim_meta={k: meta_of(v) for k, v in optim_sd.items()})


def guarded(fn) -> dict:
    """Run one case; a failure is recorded (with its traceback) and the others go on."""
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        result = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def bare_run(script: UserScript) -> dict:
    """The fp32 user script without ``fully_shard``: plain AdamW on the module."""
    torch = script.torch
    module = script.build("fp32")
    losses = script.train(module, script.optimizer(module.parameters()), range(STEPS), torch.float32)
    return dict(losses=losses, model={k: v.detach().cpu().clone() for k, v in module.state_dict().items()})


def master_run(script: UserScript, precision: str, primed: bool) -> dict:
    """Plain AdamW over a separate fp32 copy of the weights (the main weights): per step,
    the module's gradients (in its own dtype) onto the copy, ``step()``, copy back (rounded
    to the module's dtype). With ``primed``, one ``step()`` on zero gradients first (step
    count 1, one weight decay of the copy, which the first forward does not see): observed
    to reproduce upstream 0.6.1 exactly on CPU (its ``fully_shard_optimizer`` steps once to
    create the optimizer state); without it, what ours is meant to equal."""
    torch = script.torch
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    module = script.build(precision)
    main = [p.detach().float().clone().requires_grad_(True) for p in module.parameters()]
    optimizer = script.optimizer(main)
    if primed:
        for p in main:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
    losses = []
    for x, y in script.data:
        module.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x.to(script.device).to(dtype)).float(), y.to(script.device))
        loss.backward()
        losses.append(loss.item())
        for m, p in zip(main, module.parameters()):
            m.grad = p.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for m, p in zip(main, module.parameters()):
                p.copy_(m)
    return dict(losses=losses, model={k: v.detach().cpu().clone() for k, v in module.state_dict().items()})


def train_case(script: UserScript, strategy: str, precision: str, ckpt: Path | None) -> dict:
    torch = script.torch
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model, optimizer = script.wrap(strategy, precision)
    losses = script.train(model, optimizer, range(SAVE_AT), dtype)
    if ckpt is not None:
        script.save(model, optimizer, ckpt)
    losses += script.train(model, optimizer, range(SAVE_AT, STEPS), dtype)
    return dict(losses=losses, **snapshot(model, optimizer))


def resume_case(script: UserScript, strategy: str, ckpt: Path) -> dict:
    model, optimizer = script.wrap(strategy, "fp32", seed=7)  # other weights: the load must replace them all
    script.load(model, optimizer, ckpt)
    losses = script.train(model, optimizer, range(SAVE_AT, STEPS), script.torch.float32)
    return dict(losses=losses, **snapshot(model, optimizer))
