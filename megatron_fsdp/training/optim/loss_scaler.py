"""Loss scaling for ``--fp16``: a constant scale (``--loss-scale``) or Megatron-LM's
dynamic scaler (start at ``--initial-loss-scale``, halve after ``--hysteresis``
overflowing steps, double after ``--loss-scale-window`` clean ones).

fp16 gradients of a small loss underflow; scaling the loss up before backward and
the gradients down before the optimizer keeps them representable. An overflow
(Inf/NaN in any rank's gradient shard) skips that step instead of corrupting the
weights; the flag is all-reduced so every rank skips together.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
import torch.distributed as dist


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # Sharded (DTensor) gradients: each rank checks and rescales only its shard.
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclasses.dataclass(kw_only=True)
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    _growth_tracker: int = 0
    _hysteresis_tracker: int = 2

    @classmethod
    def from_args(cls, args) -> Optional["LossScaler"]:
        """None unless ``--fp16`` (bf16 and fp32 need no scaling)."""
        if not args.fp16:
            return None
        if args.loss_scale is not None:
            return cls(scale=args.loss_scale)
        return cls(scale=args.initial_loss_scale, dynamic=True, min_scale=args.min_loss_scale,
                   growth_interval=args.loss_scale_window, hysteresis=args.hysteresis,
                   _hysteresis_tracker=args.hysteresis)

    @torch.no_grad()
    def unscale_and_check(self, params: Iterable[torch.Tensor], group: Optional[dist.ProcessGroup] = None) -> bool:
        """Divide gradients by the scale; True when any rank found Inf/NaN."""
        params = list(params)
        found = torch.zeros(1)
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is None:
                continue
            local = _local(p.grad)
            local.mul_(inv)
            if not bool(torch.isfinite(local).all()):
                found.fill_(1.0)
        if dist.is_initialized():
            found = found.to(_device_of(params))
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def _device_of(params: Iterable[torch.Tensor]) -> torch.device:
    for p in params:
        return _local(p).device
    return torch.device("cpu")
