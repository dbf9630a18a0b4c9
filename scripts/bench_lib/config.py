"""What the benchmark runs: model presets, the implementations compared, and the
validated run configuration. Pure data; no process group, no tensors."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from megatron_fsdp.models import GPTConfig

MODEL_PRESETS: dict[str, dict] = {
    # ~0.12M params: only for the end-to-end test (seconds on 2 cores).
    "gpt-mini": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32),
    # ~3.3M params.
    "gpt-tiny": dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128),
    # ~57M params: large enough for the ZeRO memory differences to dominate RSS.
    "gpt-large": dict(num_layers=8, hidden_size=768, num_attention_heads=12, seq_length=256),
}
DEFAULT_MICRO_BATCH = {"gpt-mini": 2, "gpt-tiny": 4, "gpt-large": 2}

MEGATRON_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DTYPES = ("fp32", "bf16")


class Family(enum.Enum):
    DDP = "ddp"
    FSDP2 = "fsdp2"
    MEGATRON_FSDP = "megatron_fsdp"
    EXPERIMENTAL = "megatron_fsdp.experimental"
    """Per-module fully_shard on DBuffers (upstream's v2 API), ZeRO-3 placements."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImplSpec:
    """One implementation under test."""

    name: str
    """Key in the JSON record and row label in the table."""
    family: Family
    zero_level: int
    """Which training state is sharded (ZeRO 0-3); drives the memory formula."""
    strategy: Optional[str] = None
    """megatron_fsdp's ``zero_dp_strategy``."""
    reshard_after_forward: Optional[bool] = None
    """FSDP2's setting for the transformer blocks (the root keeps FSDP2's default)."""

    @property
    def gathers_params_twice(self) -> bool:
        """Unit weights are all-gathered for forward and again for backward."""
        if self.family is Family.FSDP2:
            return bool(self.reshard_after_forward)
        return self.zero_level == 3


def all_impls(strategies: tuple[str, ...] = MEGATRON_STRATEGIES) -> list[ImplSpec]:
    impls = [
        ImplSpec(name="ddp", family=Family.DDP, zero_level=0),
        ImplSpec(name="fsdp2_reshard", family=Family.FSDP2, zero_level=3, reshard_after_forward=True),
        ImplSpec(name="fsdp2_no_reshard", family=Family.FSDP2, zero_level=3, reshard_after_forward=False),
    ]
    for level, strategy in enumerate(MEGATRON_STRATEGIES):
        if strategy in strategies:
            impls.append(
                ImplSpec(name=f"mfsdp_{strategy}", family=Family.MEGATRON_FSDP, zero_level=level, strategy=strategy)
            )
    impls.append(ImplSpec(name="mfsdp_experimental", family=Family.EXPERIMENTAL, zero_level=3))
    return impls


def parse_csv(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


@dataclasses.dataclass(kw_only=True)
class BenchConfig:
    """One benchmark run (validated in ``__post_init__``)."""

    world: int = 2
    """Ranks launched, one gloo process each (CPU)."""
    model: str = "gpt-tiny"
    """A key of ``MODEL_PRESETS``."""
    steps: int = 5
    """Measured steps per implementation per round."""
    warmup: int = 3
    """Unmeasured steps before an implementation's first measured step (every round with fresh workers)."""
    rounds: int = 3
    """Rounds; each round runs every implementation once (A B C A B C ...)."""
    micro_batch_size: Optional[int] = None
    """Sequences per rank per step; ``None``: the preset's default."""
    strategies: tuple[str, ...] = MEGATRON_STRATEGIES
    """megatron_fsdp strategies to run."""
    impls: Optional[tuple[str, ...]] = None
    """Subset of implementation names (``ddp``, ``fsdp2_reshard``, ``mfsdp_optim``, ...); ``None``: all."""
    dtype: str = "fp32"
    """fp32, or bf16 compute/communication with fp32 optimizer state (see impls.py)."""
    isolation: str = "auto"
    """persistent: one live worker group per implementation for the whole run; fresh: new
    workers per (round, implementation), bounding memory to one group; auto: persistent
    when every group fits in memory at once."""
    fsdp_double_buffer: bool = False
    """megatron_fsdp with pooled temporary buckets (allocated once, reused every step)."""
    seed: int = 1234
    lr: float = 1e-4
    out: str = "results/bench"
    collective_timeout_s: float = 300.0
    """A collective blocked this long fails the run instead of hanging it."""

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"--model {self.model!r} is not one of {', '.join(MODEL_PRESETS)}")
        if self.world < 1:
            raise ValueError(f"--world {self.world} must be >= 1")
        for name in ("steps", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)} must be >= 1")
        if self.warmup < 1:
            # The first step pays lazy initialisation (FSDP2, DDP bucket rebuild).
            raise ValueError(f"--warmup {self.warmup} must be >= 1: the first step includes lazy initialisation")
        if self.micro_batch_size is None:
            self.micro_batch_size = DEFAULT_MICRO_BATCH[self.model]
        if self.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} must be >= 1")
        bad = [s for s in self.strategies if s not in MEGATRON_STRATEGIES]
        if bad:
            raise ValueError(f"--strategies {','.join(bad)} not among {','.join(MEGATRON_STRATEGIES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.isolation not in ("auto", "persistent", "fresh"):
            raise ValueError(f"--isolation {self.isolation!r} is not one of auto, persistent, fresh")
        known = [spec.name for spec in all_impls()]
        if self.impls is not None:
            unknown = [name for name in self.impls if name not in known]
            if unknown:
                raise ValueError(f"--impls {','.join(unknown)} not among {','.join(known)}")

    @property
    def gpt_config(self) -> GPTConfig:
        return GPTConfig(**MODEL_PRESETS[self.model])

    def selected_impls(self) -> list[ImplSpec]:
        specs = all_impls(self.strategies)
        if self.impls is not None:
            specs = [s for s in specs if s.name in self.impls]
        if not specs:
            raise ValueError("no implementation selected; check --impls and --strategies")
        return specs
