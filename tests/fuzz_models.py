"""The models the configuration fuzzer draws (tests/test_fuzz.py), each built in its
final dtypes by ``build(kind, compute_dtype, seed, meta)``:

- ``skipnet``: models.SkipNet (blocks a step may skip, a head no forward uses).
- ``oddnet``: odd parameters: an empty one, a one-element gate, prime sizes, a
  non-contiguous (transposed) weight, a channels_last convolution weight, a unit
  with no parameters, a unit whose parameters are all frozen, a weight shared by
  two units and one read by two modules, and integer buffers (one read by the
  forward, one it counts in).
- ``mixed_dtype``: SkipNet whose middle block is bf16 in an fp32 model (it casts
  its input and output).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models import IN, OUT, Block, SkipNet


class CastBlock(Block):
    """A block in its own dtype: casts the input to it and the output back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.fc1.weight.dtype)).to(x.dtype)


class NoParamBlock(Block):
    """A unit (a Block, for ``fsdp_unit_modules=[Block]``) without parameters."""

    def __init__(self) -> None:
        nn.Module.__init__(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


class MatMul(nn.Module):
    """``x @ weight`` with a weight another module registers too. (Reading another
    module's weight directly, ``x @ self.prime.weight`` from the parent, would read
    storage ZeRO-3 released after that module's forward when it is a unit.)"""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class OddNet(nn.Module):
    PRIME = 13

    def __init__(self, d: int = 7) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.blocks[1].fc1.weight = self.blocks[0].fc1.weight  # one weight in two units
        self.prime = nn.Linear(d, self.PRIME)
        self.reuse = MatMul(self.prime.weight)  # the same weight in a second module
        self.gate = nn.Parameter(torch.empty(1))
        self.empty = nn.Parameter(torch.empty(0))
        self.turn = nn.Parameter(torch.empty(d, d).t())  # non-contiguous: a transposed view
        self.conv = nn.Conv2d(d, d, 2)
        self.conv.weight = nn.Parameter(self.conv.weight.detach().contiguous(memory_format=torch.channels_last))
        self.frozen = Block(d)
        self.frozen.requires_grad_(False)
        self.shell = NoParamBlock()
        self.out = nn.Linear(d, OUT)
        self.register_buffer("order", torch.arange(d - 1, -1, -1))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))
        self.skip: set[int] = set()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The root's own parameters (meta-device init runs it first, then the children's)."""
        with torch.no_grad():
            self.gate.fill_(0.5)
            self.turn.copy_(torch.randn(self.turn.shape) * 0.3)
            self.order.copy_(torch.arange(len(self.order) - 1, -1, -1))
            self.forwards.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if 0 not in self.skip:
            h = self.blocks[0](h)
        h = h + self.reuse(torch.tanh(self.prime(h))) * self.gate
        h = h @ self.turn + self.empty.sum()
        grid = torch.stack([h, h.flip(1), -h, h * 0.5], -1).view(*h.shape, 2, 2)
        h = self.conv(grid.contiguous(memory_format=torch.channels_last))[:, :, 0, 0]
        h = self.shell(self.frozen(h))
        if 1 not in self.skip:
            h = self.blocks[1](h[:, self.order])
        self.forwards += 1
        return self.out(h)


def _mixed(d: int = 7) -> SkipNet:
    net = SkipNet(d)
    net.blocks[1] = CastBlock(d).to(torch.bfloat16)
    return net


BUILDERS = {"skipnet": SkipNet, "oddnet": OddNet, "mixed_dtype": _mixed}


def build(kind: str, compute_dtype: torch.dtype, seed: int, meta: bool = False) -> nn.Module:
    """The model in its final dtypes: the compute dtype, except mixed_dtype's bf16 block."""
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            net = BUILDERS[kind]()
    else:
        net = BUILDERS[kind]()
    if kind != "mixed_dtype":
        net = net.to(compute_dtype)
    return net


def _ties(net: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """Every registration of a parameter registered earlier, with the first one."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in net.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in first:
                ties.append((module, name) + first[id(p)])
            elif p is not None:
                first[id(p)] = (module, name)
    return ties


def initialised_like_meta(kind: str, compute_dtype: torch.dtype, seed: int) -> nn.Module:
    """The model as meta-device init makes it: each module's ``reset_parameters()``
    in ``modules()`` order on weights already in their dtypes. torch's random kernels
    may draw bf16 weights other than fp32 ones cast, so a reference initialised in
    fp32 and then cast starts elsewhere."""
    net = build(kind, compute_dtype, seed, meta=True)
    ties = _ties(net)
    net = net.to_empty(device="cpu")  # which gives each registration its own tensor
    for module, name, owner, owner_name in ties:
        setattr(module, name, owner._parameters[owner_name])
    torch.manual_seed(seed)
    seen: set[int] = set()
    for module in net.modules():
        own = list(module.parameters(recurse=False))
        if callable(getattr(module, "reset_parameters", None)):
            # A weight tied to an earlier module keeps its first value (an eager build's).
            kept = [(p, p.detach().clone()) for p in own if id(p) in seen]
            module.reset_parameters()
            with torch.no_grad():
                for p, value in kept:
                    p.copy_(value)
        seen.update(id(p) for p in own)
    return net
