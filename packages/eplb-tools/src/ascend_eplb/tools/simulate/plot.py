"""``balancedness.png``: balancedness per step (EPLB on beside off) and each rank's share of the load."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["balancedness_figure", "plot_balancedness"]


def plot_balancedness(report: dict, path: Path) -> None:
    """Write :func:`balancedness_figure` of ``report`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = balancedness_figure(report)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def balancedness_figure(report: dict):
    """The figure of ``balancedness.png``: balancedness per step above, each rank's load share below.

    The y-axis labels are two short lines each, aligned: one line each ran past its panel's height, so
    the two labels overlapped between the panels.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    steps = np.arange(len(report["balancedness_per_step"]))
    ax1.plot(steps, report["balancedness_per_step"], lw=1.2, label="EPLB on")
    ax1.plot(steps, report["balancedness_off_per_step"], lw=1, ls="--", color="gray",
             label="EPLB off (initial placement, same tokens)")  # fmt: skip
    ax1.set_ylabel("balancedness\n(mean / max rank load)")
    ax1.set_ylim(0, 1.05)
    for i, step in enumerate(report["commit_completed_steps"]):
        for ax in (ax1, ax2):
            ax.axvline(
                step,
                color="tab:red",
                lw=0.8,
                alpha=0.6,
                label="rearrangement committed" if i == 0 and ax is ax1 else None,
            )
    ax1.legend(loc="lower right", fontsize=7)
    shares = np.array(report["rank_load_share_per_step"])
    for r in range(shares.shape[1]):
        ax2.plot(steps, shares[:, r], lw=0.8, label=f"rank {r}")
    ax2.axhline(1.0 / report["ranks"], color="black", lw=0.8, ls=":", label="even share 1/N")
    ax2.set_ylabel("rank's share\nof a layer's load")
    ax2.set_xlabel("step")
    ax2.legend(loc="upper right", fontsize=7, ncol=2)
    fig.suptitle(f"ascend-eplb simulate: {report['ranks']} ranks, {report['format']}, {report['trace']}")
    fig.align_ylabels((ax1, ax2))
    fig.tight_layout()
    return fig
