"""``balancedness.png``: balancedness per step (EPLB on beside off; the batch split's beside the equal
split's) with each rearrangement's planned and realised balancedness (the MTP draft's beside the
target's), the bytes each rearrangement (and each model's start-up install) moved (skipped ones marked
with the gate's reason) and each rank's share of the load."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ascend_eplb.integration.regular_files import write_regular_file
from ascend_eplb.tools.simulate.report import RearrangementOutcome, SimulateReport

__all__ = ["balancedness_figure", "plot_balancedness"]


def plot_balancedness(report: SimulateReport, path: Path) -> None:
    """Write :func:`balancedness_figure` of ``report`` to ``path`` (PNG) by the one writer
    (:func:`ascend_eplb.integration.regular_files.write_regular_file`: whole, beside it then renamed;
    only a regular file replaced)."""
    png = io.BytesIO()
    balancedness_figure(report).savefig(png, format="png", dpi=100)
    write_regular_file(path, png.getvalue())


def balancedness_figure(report: SimulateReport) -> Figure:
    """The figure of ``balancedness.png``: balancedness per step on top (with ``--replica-split`` batch or
    batch_local, the executed one beside the equal split's on the same counts), with each rearrangement's
    planned and realised balancedness (with ``--speculative-tokens``, the MTP draft's too); below it,
    the bytes each rearrangement moved (``report.rearrangement_records``, at the step its record was
    made; a skipped one is a marker at 0 with its reason); each rank's load share at the bottom.

    The y-axis labels are two short lines each, aligned: one line each ran past its panel's height, so
    the two labels overlapped between the panels.
    """
    fig = Figure(figsize=(9, 8.5))
    FigureCanvasAgg(fig)  # drawn headless, no pyplot state (matplotlib's way for a server or a tool)
    ax1, ax_bytes, ax2 = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.6, 3]})
    steps = np.arange(len(report.balancedness_per_step))
    splitting = report.replica_split != "equal"
    on = f"EPLB on, replica split {report.replica_split} executed" if splitting else "EPLB on"
    ax1.plot(steps, report.balancedness_per_step, lw=1.2, label=on)
    if splitting:
        ax1.plot(steps, report.balancedness_equal_split_per_step, lw=1, ls="-.", color="tab:cyan",
                 label="EPLB on, equal split (same counts and placement)")  # fmt: skip
    ax1.plot(steps, report.balancedness_off_per_step, lw=1, ls="--", color="gray",
             label="EPLB off (initial placement, same tokens)")  # fmt: skip
    draft = report.draft
    if draft is not None:
        ax1.plot(steps, draft.balancedness_per_step, lw=1.2, color="tab:olive",
                 label=f"MTP draft, EPLB on ({draft.forwards_per_step} forward(s) per step)")  # fmt: skip
        ax1.plot(steps, draft.balancedness_off_per_step, lw=1, ls=":", color="tab:olive",
                 label="MTP draft, EPLB off")  # fmt: skip
    ax1.set_ylabel("balancedness\n(mean / max rank load)")
    ax1.set_ylim(0, 1.05)
    for i, step in enumerate(report.commit_completed_steps):
        for ax in (ax1, ax_bytes, ax2):
            ax.axvline(
                step,
                color="tab:red",
                lw=0.8,
                alpha=0.6,
                label="rearrangement committed" if i == 0 and ax is ax1 else None,
            )
    _planned_and_realised(ax1, report.rearrangement_records)
    if draft is not None:
        _planned_and_realised(ax1, draft.rearrangement_records, draft=True)
    _bytes_panel(ax_bytes, report, ax1)
    ax1.legend(loc="lower right", fontsize=7)
    # None: a step without recorded load; no step at all: a run a guardrail ended before its first step
    shares = np.array(report.rank_load_share_per_step, dtype=float).reshape(len(steps), report.ranks)
    for r in range(shares.shape[1]):
        ax2.plot(steps, shares[:, r], lw=0.8, label=f"rank {r}")
    ax2.axhline(1.0 / report.ranks, color="black", lw=0.8, ls=":", label="even share 1/N")
    ax2.set_ylabel("rank's share\nof a layer's load")
    ax2.set_xlabel("step")
    ax2.legend(loc="upper right", fontsize=7, ncol=2)
    estimate = "" if report.load_estimate == "window" else f" on the {report.load_estimate} load estimate"
    fig.suptitle(
        f"ascend-eplb simulate: {report.ranks} ranks, {report.format}, {report.trace}, policy "
        f"{report.policy}{estimate}"
    )
    fig.align_ylabels((ax1, ax_bytes, ax2))
    fig.tight_layout()
    return fig


def _planned_and_realised(ax, records: tuple[RearrangementOutcome, ...], *, draft: bool = False) -> None:
    """Each of a model's rearrangements that moved experts, at the step its record was made: the
    balancedness it planned on its window, on the load estimate (when it planned on one), and the one it
    realised over the windows its placement served (``draft``: the MTP draft's, hollow markers)."""
    done = [r for r in records if r.skipped is None]
    marks = (
        ("balancedness_planned", "^", "tab:green", "planned (its window)"),
        ("estimate_balancedness_planned", "D", "tab:brown", "planned (the load estimate)"),
        ("balancedness_realised", "o", "tab:purple", "realised (the windows it served)"),
    )
    for name, marker, color, label in marks:
        shown = [(r.step, getattr(r, name)) for r in done if getattr(r, name) is not None]
        if shown:
            ax.plot(
                *zip(*shown, strict=True), marker=marker, color=color, ls="none", ms=5,
                mfc="none" if draft else color, label=f"MTP draft {label}" if draft else label,
            )  # fmt: skip


def _bytes_panel(ax, report: SimulateReport, ax_balance) -> None:
    """Bytes moved per rearrangement (bars, in the largest binary unit that keeps them >= 1); a skipped
    rearrangement: a marker at 0 on this panel and a dotted line on the balancedness panel, labelled with
    the gate's reason."""
    records = report.rearrangement_records
    done = [r for r in records if r.skipped is None]
    draft = report.draft
    drafted = [] if draft is None else [r for r in draft.rearrangement_records if r.skipped is None]
    installed = _install_bytes(report.initial_placement)
    # The draft's own start-up install (--speculative-tokens with --initial-placement), as the summary and
    # report.json list it.
    draft_installed = None if draft is None else _install_bytes(draft.initial_placement)
    installs = [b for b in (installed, draft_installed) if b is not None]
    peak = max([r.bytes_moved for r in (*done, *drafted)] + installs, default=0)
    units = ("B", "KiB", "MiB", "GiB")
    power = max((k for k in range(len(units)) if peak >= 1024**k), default=0)
    unit, scale = units[power], 1024.0**power
    if installed is not None:  # before step 0: its bar at step 0, beside nothing (no record is made then)
        ax.bar([0], [installed / scale], width=0.8, color="tab:green", label="start-up install (all ranks)")
    if draft_installed is not None:  # on top of the target's: both installed before step 0
        ax.bar([0], [draft_installed / scale], width=0.8, bottom=[(installed or 0) / scale],
               color="yellowgreen", label="MTP draft's start-up install (all ranks)")  # fmt: skip
    if done:
        ax.bar([r.step for r in done], [r.bytes_moved / scale for r in done], width=0.8,
               color="tab:blue", label="bytes moved (all ranks)")  # fmt: skip
    if drafted:
        ax.bar([r.step for r in drafted], [r.bytes_moved / scale for r in drafted], width=0.8,
               color="tab:olive", label="MTP draft's bytes moved (all ranks)")  # fmt: skip
    for i, r in enumerate(r for r in records if r.skipped is not None):
        ax.plot([r.step], [0], marker="x", color="tab:orange", ls="none",
                label="skipped (reason)" if i == 0 else None)  # fmt: skip
        ax.annotate(r.skipped, (r.step, 0), xytext=(2, 6), textcoords="offset points", fontsize=6,
                    rotation=90, color="tab:orange")  # fmt: skip
        ax_balance.axvline(r.step, color="tab:orange", lw=0.8, ls=":",
                           label="rearrangement skipped" if i == 0 else None)  # fmt: skip
    ax.set_ylabel(f"moved per\nrearrangement ({unit})")
    ax.set_ylim(bottom=0)
    if records or installs:
        ax.legend(loc="upper right", fontsize=7)


def _install_bytes(install) -> int | None:
    """The bytes a start-up install moved (None: no install, or not recorded)."""
    return None if install is None or install.bytes_moved is None else install.bytes_moved
