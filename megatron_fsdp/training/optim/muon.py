"""Muon's math, as Megatron-LM's ``--optimizer muon`` computes it: the orthogonalised
update of one weight matrix. Pure tensor functions and the config; no process group
(the optimizer and its sharded exchange are in muon_optimizer.py).

Megatron-LM delegates Muon to NVIDIA's ``emerging_optimizers`` package (its
``TensorParallelMuon`` subclasses that package's ``OrthogonalizedOptimizer``), which is
not installed here; this module computes the same formulas. Per 2-D weight W with
gradient G, learning rate lr and weight decay wd (Megatron-LM's param group values)::

    W <- W - lr * wd * W                           decoupled weight decay, first
    M <- M + (1 - beta) * (G - M)                  EMA momentum (lerp), beta = --muon-momentum
    U  = G + beta * (M - G)   (--muon-nesterov)    else U = M
    W <- W - lr * NS(U) * scale(rows, cols) * --muon-extra-scale-factor

NS is the Newton-Schulz iteration of [Note: Newton-Schulz]; ``scale`` is
``--muon-scale-mode`` (``update_scale``). With ``--muon-split-qkv`` (the default) the
fused QKV weight's query, key and value rows (and the output gate's) are
orthogonalised as separate matrices, each scaled by its own shape (``FusedRows``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F


class ScaleMode(enum.Enum):
    """``--muon-scale-mode``: the factor on an orthogonalised (rows x cols) update."""

    SPECTRAL = "spectral"
    """sqrt(max(rows, cols)) (Megatron-LM's default)."""
    SHAPE_SCALING = "shape_scaling"
    """sqrt(max(1, rows / cols))."""
    UNIT_RMS_NORM = "unit_rms_norm"
    """sqrt(rows / cols)."""


class CoefficientType(enum.Enum):
    """``--muon-coefficient-type``: the (a, b, c) of each Newton-Schulz step."""

    SIMPLE = "simple"
    QUINTIC = "quintic"
    POLAR_EXPRESS = "polar_express"
    AOL = "aol"


class MatmulPrecision(enum.Enum):
    """``--muon-fp32-matmul-prec``: torch's float32 matmul precision around the iteration.

    [Note: Newton-Schulz precision] Upstream sets ``torch.set_float32_matmul_precision``
    to this value while it orthogonalises, and the iteration itself runs in bf16
    whenever the precision then reads ``medium`` (the default): the normalised matrix
    is cast to bf16, every step's products are bf16, and the result is cast back to
    fp32. ``high`` keeps fp32 tensors (TF32 products on CUDA, plain fp32 on CPU).
    ``low`` is not a torch precision: torch ignores it with a warning, so the process's
    own setting stays (``highest`` unless a user changed it) -- reproduced here by
    leaving the setting alone."""

    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


# (a, b, c) per step, as emerging_optimizers lists them (modded-nanogpt's quintic set,
# the Polar Express paper's, flash-newton-schulz's AOL set). Each step maps
# X -> a X + b (X X^T) X + c (X X^T)^2 X.
COEFFICIENTS: dict[CoefficientType, tuple[tuple[float, float, float], ...]] = {
    CoefficientType.SIMPLE: ((3.4445, -4.7750, 2.0315),),
    CoefficientType.QUINTIC: (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    CoefficientType.POLAR_EXPRESS: (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    CoefficientType.AOL: (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
}
NORMALIZE_EPS = 1e-7
"""The Frobenius-norm floor of the first normalisation (upstream's default)."""


def coefficient_schedule(kind: CoefficientType, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of ``steps`` iterations: a set shorter than ``steps``
    starts over (cycles), except Polar Express, whose last entry repeats (it is the
    converged fixed point of that schedule)."""
    sets = COEFFICIENTS[kind]
    if kind is CoefficientType.POLAR_EXPRESS:
        stream: Iterator = itertools.chain(sets, itertools.repeat(sets[-1]))
    else:
        stream = itertools.cycle(sets)
    return list(itertools.islice(stream, steps))


def newton_schulz(x: torch.Tensor, steps: int, kind: CoefficientType) -> torch.Tensor:
    """[Note: Newton-Schulz] The approximate orthogonal factor U V^T of x = U S V^T
    (singular values pushed towards 1, not exactly 1: the coefficients trade exactness
    for speed), in fp32, shaped like x (rows, cols).

    The iteration works on the wide orientation (x^T when rows > cols, so the Gram
    matrix X X^T is the smaller one), starts from x / max(||x||_F, 1e-7) (spectral norm
    <= 1), and runs in bf16 when torch's float32 matmul precision reads ``medium``
    ([Note: Newton-Schulz precision])."""
    if x.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalises matrices; got a tensor of shape {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"Newton-Schulz takes an fp32 matrix (upstream's rule), got {x.dtype}; cast it first")
    if steps < 1:
        raise ValueError(f"Newton-Schulz needs at least one step, got steps={steps}")
    transpose = x.size(0) > x.size(1)
    if transpose:
        x = x.mT
    X = F.normalize(x, p=2, dim=(-2, -1), eps=NORMALIZE_EPS)  # (r, c), r <= c
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)
    for a, b, c in coefficient_schedule(kind, steps):
        gram = X @ X.mT  # (r, r)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        X = torch.addmm(X, poly, X, beta=a, alpha=1.0)  # a X + (b G + c G^2) X
    X = X.to(torch.float32)
    return X.mT if transpose else X


def update_scale(rows: int, cols: int, mode: ScaleMode) -> float:
    """``--muon-scale-mode``'s factor for an orthogonalised (rows = out, cols = in)
    update: spectral makes Muon's learning rate transfer from AdamW's; the other two
    are Keller Jordan's shape scaling and Scion's unit-RMS scaling."""
    match mode:
        case ScaleMode.SPECTRAL:
            return max(rows, cols) ** 0.5
        case ScaleMode.SHAPE_SCALING:
            return max(1, rows / cols) ** 0.5
        case ScaleMode.UNIT_RMS_NORM:
            return (rows / cols) ** 0.5
    raise ValueError(f"scale mode {mode!r} is not one of {[m.value for m in ScaleMode]}")


@contextlib.contextmanager
def matmul_precision(precision: MatmulPrecision) -> Iterator[None]:
    """torch's float32 matmul precision set to ``precision`` inside (``low``: left as
    it is; [Note: Newton-Schulz precision]), restored after."""
    if precision is MatmulPrecision.LOW:
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision.value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedRows:
    """A weight whose rows stack separate projections, orthogonalised apart (upstream's
    QKV split): the rows form ``blocks`` equal blocks, and each block holds the
    projections' rows in ``pieces`` order. Projection i is the matrix of rows
    ``pieces[i]`` of every block, in block order.

    megatron-core's fused QKV is ``blocks`` = key/value groups with pieces
    (queries per group x kv_channels, [gate alike,] kv_channels, kv_channels); the
    embedded GPT's is one block [q | k | v | gate] (models/transformer.py). Both give
    the same query, key, value and gate matrices (rows in query-head order)."""

    blocks: int
    pieces: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.blocks < 1 or not self.pieces or any(p < 1 for p in self.pieces):
            raise ValueError(f"FusedRows(blocks={self.blocks}, pieces={self.pieces}): need >= 1 block and "
                             "positive piece sizes")

    @property
    def rows(self) -> int:
        return self.blocks * sum(self.pieces)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], matrix: torch.Tensor) -> torch.Tensor:
        """``fn`` applied to each projection's (rows_i, cols) matrix, reassembled."""
        if matrix.shape[0] != self.rows:
            raise ValueError(f"a fused weight of {matrix.shape[0]} rows does not split as {self.blocks} blocks of "
                             f"{self.pieces} rows")
        cols = matrix.shape[1]
        split = matrix.view(self.blocks, sum(self.pieces), cols).split(list(self.pieces), dim=1)
        out = [fn(part.reshape(-1, cols)).view(self.blocks, -1, cols) for part in split]
        return torch.cat(out, dim=1).view(matrix.shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonConfig:
    """Megatron-LM's Muon flags (defaults: its parser's)."""

    momentum: float = 0.9
    """``--muon-momentum``: beta of the EMA momentum."""
    nesterov: bool = False
    """``--muon-nesterov``: orthogonalise G + beta (M - G) instead of M."""
    split_qkv: bool = True
    """Off with ``--muon-no-split-qkv``: the fused QKV weight is then one matrix."""
    scale_mode: ScaleMode = ScaleMode.SPECTRAL
    extra_scale_factor: float = 1.0
    """``--muon-extra-scale-factor``: multiplies every update after the scale."""
    coefficient_type: CoefficientType = CoefficientType.QUINTIC
    num_ns_steps: int = 5
    """``--muon-num-ns-steps``."""
    matmul_precision: MatmulPrecision = MatmulPrecision.MEDIUM
    """``--muon-fp32-matmul-prec``."""

    def __post_init__(self) -> None:
        if self.num_ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps={self.num_ns_steps} must be at least 1 (upstream's rule)")
        for name, enum_type in (("scale_mode", ScaleMode), ("coefficient_type", CoefficientType),
                                ("matmul_precision", MatmulPrecision)):
            if not isinstance(getattr(self, name), enum_type):
                raise TypeError(f"MuonConfig.{name}={getattr(self, name)!r} must be a {enum_type.__name__}; "
                                f"parse strings with {enum_type.__name__}(value)")

    @classmethod
    def from_args(cls, args) -> "MuonConfig":
        return cls(momentum=args.muon_momentum, nesterov=args.muon_nesterov, split_qkv=args.muon_split_qkv,
                   scale_mode=ScaleMode(args.muon_scale_mode), extra_scale_factor=args.muon_extra_scale_factor,
                   coefficient_type=CoefficientType(args.muon_coefficient_type), num_ns_steps=args.muon_num_ns_steps,
                   matmul_precision=MatmulPrecision(args.muon_fp32_matmul_prec))

    def orthogonalize(self, update: torch.Tensor, fused: Optional[FusedRows] = None) -> torch.Tensor:
        """The scaled orthogonalised ``update`` (rows, cols) of one weight, in fp32:
        NS(U) * scale(rows, cols) * extra, per projection for a fused weight."""

        def one(matrix: torch.Tensor) -> torch.Tensor:
            orth = newton_schulz(matrix, self.num_ns_steps, self.coefficient_type)
            # Two products in this order, as upstream rounds them.
            return orth * update_scale(matrix.shape[0], matrix.shape[1], self.scale_mode) * self.extra_scale_factor

        update = update.float()
        with matmul_precision(self.matmul_precision):
            if fused is not None and self.split_qkv:
                return fused.map(one, update)
            return one(update)
