"""The loss-curve PNG written at the end of a run (matplotlib, headless Agg backend)."""

from __future__ import annotations

import logging
import os
from typing import Sequence

logger = logging.getLogger(__name__)


def plot_loss_curve(path: str, iterations: Sequence[int], losses: Sequence[float],
                    validation: Sequence[tuple[int, float]] = (), title: str = "") -> bool:
    """Write the curve to ``path``; returns False (with a warning) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on training nodes
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no loss curve written (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(iterations), list(losses), label="train lm loss", linewidth=1.2)
    if validation:
        its, vals = zip(*validation)
        ax.plot(its, vals, "o-", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
