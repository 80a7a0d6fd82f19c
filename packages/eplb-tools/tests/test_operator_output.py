"""What ``simulate`` shows an operator (issue 31, figures that read as something else): the summary's
balancedness comparison, the progress of start-up beside the steps, the plot's axis labels."""

from __future__ import annotations

import io
from collections import defaultdict


def test_the_summary_sets_eplb_on_beside_eplb_off_on_the_same_steps():
    """ "before -> after; without EPLB over the same steps" read as a comparison with "before"."""
    from ascend_eplb.tools.simulate.summary import summary_text
    from ascend_eplb.tools.simulate.verdicts import PASSED

    report = defaultdict(lambda: 1.0)
    report.update(
        model="replay", trace="t", format="w8a8_dynamic", checks={}, check_evidence={}, config={},
        commit_seconds=[], costs=None, verdict=PASSED, out_dir="/o", balancedness_before=0.7047,
        balancedness_after=0.8742, balancedness_off_after=0.7386, balancedness_off_mean=0.7367,
        policy="default", min_balancedness_gain=0.0, target_balancedness=None, rearrangement_records=[],
        rearrangements_skipped={}, experts_moved=0,
    )  # fmt: skip
    (line,) = [ln for ln in summary_text(report).splitlines() if ln.startswith("  balancedness before")]
    assert line == (
        "  balancedness before the first rearrangement 0.7047; after the first completed, EPLB on 0.8742 "
        "beside EPLB off 0.7386 (the same steps and tokens on upstream's initial placement); EPLB off over "
        "the whole run 0.7367"
    )


def test_start_up_is_its_own_phase_and_the_steps_bar_counts_from_the_first_step():
    """The bar counted the ~48 s start-up as the first step: ``1/24 [00:48<18:34]`` for a 63 s run."""
    from ascend_eplb.tools.simulate.progress import START_UP, Progress

    out = io.StringIO()
    progress = Progress(4, file=out)
    assert out.getvalue().strip("\r\n") == f"{START_UP}: 00:00"
    progress.step(0, 0, 0.5)
    progress.step(1, 1, 0.75)
    progress.close()
    frames = [f.strip() for f in out.getvalue().replace("\n", "\r").split("\r") if f.strip()]
    assert frames[0] == frames[1] == f"{START_UP}: 00:00"  # drawn, then closed at the first step
    assert frames[2].startswith("steps:   0%|")  # the steps' bar opens at 0 of 4, not 1
    assert frames[-1].startswith("steps:  50%|")
    assert "| 2/4 [00:00<00:00" in frames[-1]
    assert frames[-1].endswith("balancedness=0.750, rearrangements=1]")


def test_the_plots_y_axis_labels_do_not_overlap():
    from ascend_eplb.tools.simulate.plot import balancedness_figure

    report = {
        "balancedness_per_step": [0.7, 0.8, 0.9], "balancedness_off_per_step": [0.7, 0.7, 0.7],
        "commit_completed_steps": [1], "rank_load_share_per_step": [[0.4, 0.2, 0.2, 0.2]] * 3, "ranks": 4,
        "format": "float32", "trace": "t",
    }  # fmt: skip
    fig = balancedness_figure(report)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    top, bottom = (ax.yaxis.label.get_window_extent(renderer) for ax in fig.axes[:2])
    assert not top.overlaps(bottom)  # each label one line ran past its panel into the other's
    for ax, label in zip(fig.axes[:2], (top, bottom), strict=True):
        panel = ax.get_window_extent(renderer)
        assert panel.y0 <= label.y0  # within its own panel's height
        assert label.y1 <= panel.y1


def test_a_rearrangement_names_the_step_it_committed_at_and_a_worse_realised_says_why():
    """Issue 38: ``rearrangement 1 (step 7)`` was the step its last layer committed, while SIMULATE.md says
    the first starts at step 4; and from an exported placement the first rearrangement served the next
    window worse (0.9274 -> realised 0.9114) with no word why."""
    from ascend_eplb.tools.simulate.summary import REALISED_BELOW_BEFORE, summary_text
    from ascend_eplb.tools.simulate.verdicts import PASSED

    def record(index, step, before, realised, skipped=None):
        return {
            "rearrangement": index, "step": step, "policy": "default", "skipped": skipped,
            "balancedness_before": before, "balancedness_planned": None if skipped else 0.9987,
            "balancedness_realised": realised, "experts_moved": 0 if skipped else 189,
            "bytes_moved": 0 if skipped else 4644864, "layers_changed": 0 if skipped else 4,
        }  # fmt: skip

    report = defaultdict(lambda: 1.0)
    report.update(
        model="replay", trace="t", format="w8a8_dynamic", checks={}, check_evidence={}, config={},
        commit_seconds=[], costs=None, verdict=PASSED, out_dir="/o", policy="default",
        min_balancedness_gain=0.0, target_balancedness=0.95, experts_moved=378,
        rearrangements_skipped={"balanced": 1, "min_gain": 0, "no_load": 0},
        rearrangement_records=[record(1, 7, 0.9274, 0.9114), record(2, 23, 0.9114, 0.9338),
                               record(3, 39, 0.9612, None, skipped="balanced")],
    )  # fmt: skip
    lines = summary_text(report).splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("  policy=default")))
    assert lines[start + 1 : start + 5] == [
        "    rearrangement 1 (committed at step 7): balancedness 0.9274 -> planned 0.9987, realised 0.9114; "
        "189 experts, 4.43 MiB moved",
        "    rearrangement 2 (committed at step 23): balancedness 0.9114 -> planned 0.9987, realised 0.9338; "
        "189 experts, 4.43 MiB moved",
        "    rearrangement 3 (skipped at step 39): balancedness 0.9612; skipped (balanced), nothing moved",
        f"    realised below before (rearrangement 1): {REALISED_BELOW_BEFORE}",
    ]
    report["rearrangement_records"] = [record(1, 7, 0.9, 0.95)]
    assert not any("realised below before" in ln for ln in summary_text(report).splitlines())
