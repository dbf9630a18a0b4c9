"""Dashboards: TensorBoard events (``--tensorboard-dir``) and Weights & Biases
(``--wandb-project``), written by rank 0 with Megatron-LM's scalar names
(``lm loss``, ``learning-rate``, ``grad-norm``, ``throughput``, ``iteration-time``,
``mem-*``, ``lm loss validation ppl``, ``<timer>-time``, MoE's ``load_balancing_loss``, MTP's
``mtp_1 loss``, ...).

Both packages are optional: TensorBoard events go through
``torch.utils.tensorboard`` when the ``tensorboard`` package is installed
(``scripts/setup_env.sh`` installs it; it does not pull torch), W&B through
``wandb`` (offline unless ``WANDB_API_KEY`` or ``WANDB_MODE`` says otherwise). A
missing package was already reported by validation; here it only means no writer.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)


class Dashboards:
    """Fan-out of scalars to the writers that are configured (none on ranks > 0)."""

    def __init__(self, tensorboard=None, wandb_run=None) -> None:
        self.tensorboard = tensorboard
        self.wandb_run = wandb_run

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb_run is not None

    def add_scalar(self, name: str, value: float, step: int) -> None:
        if value is None:
            return
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(name, value, step)
        if self.wandb_run is not None and " vs samples" not in name:
            self.wandb_run.log({name: value}, step=step)

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _tensorboard_writer(args):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None  # validation warned already
    os.makedirs(args.tensorboard_dir, exist_ok=True)
    writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
    logger.info("> TensorBoard events written to %s", args.tensorboard_dir)
    return writer


def _wandb_run(args):
    try:
        import wandb
    except ImportError:
        return None  # validation warned already
    if "WANDB_API_KEY" not in os.environ and "WANDB_MODE" not in os.environ:
        os.environ["WANDB_MODE"] = "offline"  # no account needed; `wandb sync` uploads later
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else "wandb")
    os.makedirs(save_dir, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if isinstance(v, (bool, int, float, str)) or v is None}
    run = wandb.init(dir=save_dir, name=args.wandb_exp_name or None, project=args.wandb_project,
                     entity=args.wandb_entity or None, config=config)
    logger.info("> W&B run %s (mode %s) in %s", args.wandb_project, os.environ.get("WANDB_MODE", "online"), save_dir)
    return run


def build_dashboards(args, rank: int) -> Dashboards:
    if rank != 0:
        return Dashboards()
    tensorboard = _tensorboard_writer(args) if args.tensorboard_dir else None
    wandb_run = _wandb_run(args) if args.wandb_project else None
    return Dashboards(tensorboard, wandb_run)


def write_training_scalars(dash: Dashboards, args, *, iteration: int, consumed_samples: int, lm_loss: Optional[float],
                           learning_rate: float, loss_scale: float, grad_norm: Optional[float],
                           num_zeros: Optional[int], params_norm: Optional[float], batch_size: Optional[int] = None,
                           skipped_samples: int = 0) -> None:
    """Megatron-LM's per-iteration scalars (every ``--tensorboard-log-interval`` iterations);
    ``batch_size``: the iteration's global batch (``--global-batch-size`` unless ramped up)."""
    if skipped_samples > 0:  # --decrease-batch-size-if-needed; no "vs samples" twin in Megatron-LM
        dash.add_scalar("skipped-train-samples", skipped_samples, iteration)
    batch_size = args.global_batch_size if batch_size is None else batch_size
    pairs = [("learning-rate", learning_rate), ("batch-size", batch_size), ("lm loss", lm_loss)]
    if args.log_loss_scale_to_tensorboard:
        pairs.append(("loss-scale", loss_scale))
    if args.log_world_size_to_tensorboard:
        pairs.append(("world-size", args.world_size))
    pairs += [("grad-norm", grad_norm), ("num-zeros", num_zeros), ("params-norm", params_norm)]
    for name, value in pairs:
        dash.add_scalar(name, value, iteration)
        dash.add_scalar(name + " vs samples", value, consumed_samples)


def write_moe_scalars(dash: Dashboards, load_balancing_loss: Optional[float], iteration: int,
                      name: str = "load_balancing_loss") -> None:
    """MoE models: Megatron-core's ``load_balancing_loss`` scalar, every iteration as its
    ``training_log`` writes it (no "vs samples" twin)."""
    dash.add_scalar(name, load_balancing_loss, iteration)


def write_mtp_scalars(dash: Dashboards, mtp_losses: Optional[tuple[float, ...]], iteration: int) -> None:
    """``--mtp-num-layers``: megatron-core's ``mtp_1 loss``, ``mtp_2 loss`` ... scalars, every
    iteration as its ``training_log`` writes them (no "vs samples" twin)."""
    for depth, loss in enumerate(mtp_losses or (), start=1):
        dash.add_scalar(f"mtp_{depth} loss", loss, iteration)


def write_memory_scalars(dash: Dashboards, snapshot: dict, iteration: int) -> None:
    dash.add_scalar("mem-allocated-bytes", snapshot["allocated"], iteration)
    dash.add_scalar("mem-max-allocated-bytes", snapshot["max_allocated"], iteration)
    dash.add_scalar("mem-rss-bytes", snapshot["rss"], iteration)
    dash.add_scalar("mem-max-rss-bytes", snapshot["max_rss"], iteration)


def write_validation_scalars(dash: Dashboards, args, loss: float, ppl: float, iteration: int,
                             consumed_samples: int) -> None:
    dash.add_scalar("lm loss validation", loss, iteration)
    dash.add_scalar("lm loss validation vs samples", loss, consumed_samples)
    if args.log_validation_ppl_to_tensorboard:
        dash.add_scalar("lm loss validation ppl", ppl, iteration)
        dash.add_scalar("lm loss validation ppl vs samples", ppl, consumed_samples)
