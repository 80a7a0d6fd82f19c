"""What ``simulate`` shows an operator (issue 31, figures that read as something else): the summary's
balancedness comparison, the progress of start-up beside the steps, the plot's axis labels."""

from __future__ import annotations

import io
from dataclasses import replace

from ascend_eplb.tools.simulate.report import InstallReport, RearrangementOutcome, SimulateReport
from ascend_eplb.tools.simulate.stats import OutputTolerance


def _report(**changes) -> SimulateReport:
    """A report of a 4-rank replay run, every figure 1.0 (or empty) but ``changes``."""
    fields = dict(
        ranks=4, data_parallel_size=1, tensor_parallel_size=4, moe_rows="split", compilation=None,
        model="replay", format="w8a8_dynamic", trace="t", layers=2, num_logical_experts=8,
        num_redundant_experts=0, top_k=2,
        batch_size=4, padded_size=4, window_size=2, step_interval=4, load_collection_phase="all", steps=3,
        rearrangements=1, rearrangements_completed=1, layers_committed=2, balancedness_before=1.0,
        balancedness_after=1.0, balancedness_off_after=1.0, balancedness_off_mean=1.0,
        balancedness_per_step=(0.7, 0.8, 0.9), balancedness_off_per_step=(0.7, 0.7, 0.7),
        rank_load_share_per_step=((0.4, 0.2, 0.2, 0.2),) * 3, commit_completed_steps=(1,),
        initial_placement=None, bytes_received=0, bytes_received_per_rank=(0, 0, 0, 0), policy="default",
        min_balancedness_gain=0.0, target_balancedness=None, load_estimate="window", rearrangement_records=(),
        rearrangements_skipped={}, experts_moved=0, bytes_moved=0, busiest_rank_experts_received=0,
        costs=None, out_dir="/o", commit_seconds=(), step_seconds_p50=1.0, step_seconds_p99=1.0,
        step_seconds_p50_in_flight=1.0, step_seconds_p50_idle=1.0, world_cpu_seconds_per_step_p50=1.0,
        verifier_seconds_per_step_p50=1.0, verifier_seconds_per_step_mean=1.0,
        step_seconds_p50_without_verifier=1.0, max_output_error=1.0,
        output_tolerance=OutputTolerance(1e-5, 1e-6), checks={}, check_evidence={}, first_violation=None,
        worker_failure=None, in_flight_at_end=(), verdict="passed", passed=True, wall_seconds=1.0, config={},
    )  # fmt: skip
    return SimulateReport(**{**fields, **changes})


def test_the_summary_sets_eplb_on_beside_eplb_off_on_the_same_steps():
    """ "before -> after; without EPLB over the same steps" read as a comparison with "before"."""
    from ascend_eplb.tools.simulate.summary import summary_text
    from ascend_eplb.tools.simulate.verdicts import PASSED

    report = _report(
        verdict=PASSED, balancedness_before=0.7047, balancedness_after=0.8742, balancedness_off_after=0.7386,
        balancedness_off_mean=0.7367,
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

    fig = balancedness_figure(_report(format="float32"))
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
        return RearrangementOutcome(
            model="m", rearrangement=index, step=step, policy="default", skipped=skipped,
            balancedness_before=before, balancedness_planned=None if skipped else 0.9987,
            load_estimate="window", estimate_balancedness_before=None, estimate_balancedness_planned=None,
            balancedness_realised=realised, windows_realised=0 if realised is None else 1,
            experts_moved=0 if skipped else 189, bytes_moved=0 if skipped else 4644864,
            layers_changed=0 if skipped else 4,
        )  # fmt: skip

    report = _report(
        verdict=PASSED, min_balancedness_gain=0.0, target_balancedness=0.95, experts_moved=378,
        bytes_moved=2 * 4644864, rearrangements_skipped={"balanced": 1, "min_gain": 0, "no_load": 0},
        rearrangement_records=(record(1, 7, 0.9274, 0.9114), record(2, 23, 0.9114, 0.9338),
                               record(3, 39, 0.9612, None, skipped="balanced")),
    )  # fmt: skip
    lines = summary_text(report).splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("  policy=default")))
    assert lines[start + 1 : start + 5] == [
        "    rearrangement 1 (committed at step 7): balancedness 0.9274 -> planned 0.9987, realised 0.9114; "
        "189 experts, 4.43 MiB moved",
        "    rearrangement 2 (committed at step 23): balancedness 0.9114 -> planned 0.9987, realised 0.9338; "
        "189 experts, 4.43 MiB moved",
        "    rearrangement 3 (skipped at step 39): balancedness 0.9612; skipped (balanced), nothing moved",
        f"    realised below before (rearrangement 1): {REALISED_BELOW_BEFORE['window'].format(initial='')}",
    ]
    report = replace(report, rearrangement_records=(record(1, 7, 0.9, 0.95),))
    assert not any("realised below before" in ln for ln in summary_text(report).splitlines())


def test_every_total_counts_the_start_up_install_as_a_rearrangement_and_says_so():
    """Issue 38 defect 6: the install's bytes were in the top byte total only (``layers committed 12,
    bytes moved 11599872`` beside ``3 rearrangements moved 351 experts (8.23 MiB)``)."""
    from ascend_eplb.tools.simulate.summary import summary_text

    install = InstallReport(
        source="p.json", layers_committed=2, layers_changed=2, experts_moved=5, bytes_moved=5 * 1024,
        first_step_balancedness=0.9, first_step_planned=0.9, first_step_off=0.5,
        plan_predicted_on_its_load=None, slots_hold_their_experts=True, slot_mismatches=(),
    )  # fmt: skip
    done = RearrangementOutcome(
        model="m", rearrangement=1, step=7, policy="default", skipped=None, balancedness_before=0.5,
        balancedness_planned=0.9, load_estimate="window", estimate_balancedness_before=None,
        estimate_balancedness_planned=None, balancedness_realised=0.8, windows_realised=1, experts_moved=3,
        bytes_moved=3 * 1024, layers_changed=2,
    )  # fmt: skip
    lines = summary_text(
        _report(
            initial_placement=install, rearrangement_records=(done,), rearrangements_skipped={"balanced": 0},
            layers_committed=4, experts_moved=8, bytes_moved=8 * 1024, bytes_received=8 * 1024,
        )
    ).splitlines()  # fmt: skip
    assert lines[1:5] == [
        "  steps 3, rearrangements 1 (1 completed), layers committed 4, bytes received 8.00 KiB (every total "
        "counts the start-up install of 2 layers as a rearrangement)",
        "  policy=default, gate off: 1 rearrangements and the start-up install moved 8 experts (8.00 KiB); "
        "skipped: none",
        "    start-up install (before step 0): 5 experts, 5.00 KiB moved, 2 of 2 layers changed",
        "    rearrangement 1 (committed at step 7): balancedness 0.5000 -> planned 0.9000, realised 0.8000; "
        "3 experts, 3.00 KiB moved",
    ]
    # Without an install the totals are the rearrangements' and nothing is said of one.
    plain = summary_text(_report(rearrangement_records=(done,), layers_committed=2, experts_moved=3,
                                 bytes_moved=3 * 1024, bytes_received=3 * 1024)).splitlines()  # fmt: skip
    assert plain[1:3] == [
        "  steps 3, rearrangements 1 (1 completed), layers committed 2, bytes received 3.00 KiB",
        "  policy=default, gate off: 1 rearrangements moved 3 experts (3.00 KiB); skipped: none",
    ]


def test_the_events_file_gives_each_ranks_received_experts_install_and_rearrangements_apart(tmp_path):
    """``report.busiest_rank_experts_received`` counted experts by dividing measured bytes back by one
    expert's; now each rank's experts are replayed from the committed placements of the events file."""
    from ascend_eplb.integration.events.recorder import EventsWriter
    from ascend_eplb.integration.events.records import (
        CommitRecord,
        InitialPlacementRecord,
        RearrangementRecord,
        WindowRecord,
    )
    from ascend_eplb.tools.simulate.report import events_outcomes

    path = tmp_path / "events.jsonl"
    writer = EventsWriter(path)
    # E = 4, P = 6 on 2 ranks: upstream's initial rows are [0, 1, 2, 3, 0, 1] (rank 0 holds {0, 1, 2}).
    writer.write(InitialPlacementRecord(
        time=0.0, step=0, model="m", source="p.json", num_logical_experts=4, num_ranks=2,
        placement=((3, 1, 0, 2, 3, 3), (0, 1, 2, 3, 1, 0)), layers_changed=2, experts_moved=2, bytes_moved=2,
        bytes_received=1,
    ))  # fmt: skip
    writer.write(WindowRecord(
        time=0.0, step=3, model="m", rearrangement=1, load=((1, 1, 1, 1), (1, 1, 1, 1)), balancedness=1.0,
        balancedness_eplb_off=1.0, num_ranks=2, num_physical_experts=6,
    ))  # fmt: skip
    for layer, row in enumerate(((0, 1, 2, 3, 0, 1), (3, 2, 1, 0, 3, 0))):
        writer.write(CommitRecord(
            time=0.0, step=4 + layer, model="m", rearrangement=1, layer=layer, publish_to_acknowledge_s=None,
            bytes_received=0, placement=row,
        ))  # fmt: skip
    writer.write(RearrangementRecord(
        time=0.0, step=5, model="m", rearrangement=1, policy="default", skipped=None, balancedness_before=1.0,
        balancedness_planned=1.0, experts_moved=4, bytes_moved=4, layers_changed=2,
    ))  # fmt: skip
    writer.close()
    out = events_outcomes(path, 2)
    # Install, layer 0: rank 0 gains 3, rank 1 gains 2; layer 1 nothing new. Rearrangement, layer 0: rank
    # 0 gains 2, rank 1 gains 0 and 1; layer 1: rank 0 gains 3.
    assert (out.install_received, out.rearrangements_received, out.rearrangement_layer_commits) == (
        (1, 1), (1 + 1, 2 + 0), 2,
    )  # fmt: skip
    assert out.install.experts_moved == 2
    assert [(r.model, r.rearrangement, r.step, r.experts_moved) for r in out.records] == [("m", 1, 5, 4)]
    assert events_outcomes(tmp_path / "absent.jsonl", 2).records == ()


def test_planned_on_the_estimate_and_realised_over_the_windows_a_placement_served(tmp_path):
    """Issue 37: a rearrangement planned on the load estimate shows both plans; one followed by a skipped
    one realises over every window its placement served (the events file's realised records), the
    skipped one over the next window under the placement it kept; the summary, report and plot say so."""
    from ascend_eplb.integration.events.recorder import EventsWriter
    from ascend_eplb.integration.events.records import (
        RearrangementRealisedRecord,
        RearrangementRecord,
        WindowRecord,
    )
    from ascend_eplb.tools.simulate.plot import balancedness_figure
    from ascend_eplb.tools.simulate.report import events_outcomes
    from ascend_eplb.tools.simulate.summary import REALISED_BELOW_BEFORE, summary_text
    from ascend_eplb.tools.simulate.verdicts import PASSED

    path = tmp_path / "events.jsonl"
    writer = EventsWriter(path)
    load = ((1, 1, 1, 1),)
    plans = {"load_estimate": "pooled", "estimate_balancedness_before": 0.75}

    def window(step, index, balancedness):
        writer.write(WindowRecord(
            time=0.0, step=step, model="m", rearrangement=index, load=load, balancedness=balancedness,
            balancedness_eplb_off=0.5, new_selections=load,
        ))  # fmt: skip

    def realised(step, index, skipped, balancedness, placed_by, served):
        copied = {"balancedness_before": 0.875, "balancedness_planned": 0.9375,
                  "estimate_balancedness_planned": 0.96875 if index == 1 else 0.8125, **plans}  # fmt: skip
        writer.write(RearrangementRealisedRecord(
            time=0.0, step=step, model="m", rearrangement=index, skipped=skipped, **copied,
            balancedness_realised=balancedness, placed_by=placed_by, windows_realised=len(served),
            balancedness_realised_mean=sum(served) / len(served),
        ))  # fmt: skip

    window(3, 1, 0.875)
    writer.write(RearrangementRecord(
        time=0.0, step=5, model="m", rearrangement=1, policy="migration_aware", skipped=None,
        balancedness_before=0.875, balancedness_planned=0.9375, estimate_balancedness_planned=0.96875,
        **plans, experts_moved=3, bytes_moved=3 * 1024, layers_changed=1,
    ))  # fmt: skip
    realised(7, 1, None, 0.875, 1, [0.875])
    window(7, 2, 0.875)
    writer.write(RearrangementRecord(
        time=0.0, step=8, model="m", rearrangement=2, policy="migration_aware", skipped="min_gain",
        balancedness_before=0.875, balancedness_planned=0.9375, estimate_balancedness_planned=0.8125, **plans,
        experts_moved=0, bytes_moved=0, layers_changed=0,
    ))  # fmt: skip
    realised(11, 2, "min_gain", 0.625, 1, [0.875, 0.625])
    window(11, 3, 0.625)
    writer.close()
    records = events_outcomes(path, 2).records
    # Rearrangement 1's placement served windows 2 and 3 (2 skipped): their mean; 2's own: window 3.
    assert [(r.balancedness_realised, r.windows_realised) for r in records] == [(0.75, 2), (0.625, 1)]
    assert [(r.estimate_balancedness_before, r.estimate_balancedness_planned) for r in records] == [
        (0.75, 0.96875), (0.75, 0.8125),
    ]  # fmt: skip
    report = _report(
        verdict=PASSED, policy="migration_aware", min_balancedness_gain=0.125, load_estimate="pooled",
        rearrangement_records=records, rearrangements_skipped={"balanced": 0, "min_gain": 1, "no_load": 0},
        experts_moved=3, bytes_moved=3 * 1024,
    )  # fmt: skip
    lines = summary_text(report).splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("  policy=migration_aware")))
    assert lines[start : start + 4] == [
        "  policy=migration_aware, gate min_balancedness_gain=0.125 target_balancedness=off, "
        "load_estimate=pooled: 1 rearrangements moved 3 experts (3.00 KiB); skipped: min_gain 1",
        "    rearrangement 1 (committed at step 5): balancedness 0.8750 -> planned 0.9375 (on the pooled "
        "load estimate 0.7500 -> 0.9688), realised 0.7500 over the 2 windows it served; 3 experts, 3.00 KiB "
        "moved",
        "    rearrangement 2 (skipped at step 8): balancedness 0.8750, planned 0.9375 (on the pooled load "
        "estimate 0.7500 -> 0.8125); skipped (min_gain), nothing moved; the placement kept realised 0.6250 "
        "on the next window",
        "    realised below before (rearrangement 1): " + REALISED_BELOW_BEFORE["pooled"].format(initial=""),
    ]
    figure = balancedness_figure(report)
    labels = figure.axes[0].get_legend_handles_labels()[1]
    assert [x for x in labels if x.startswith(("planned", "realised"))] == [
        "planned (its window)", "planned (the load estimate)", "realised (the windows it served)",
    ]  # fmt: skip
    assert figure._suptitle.get_text().endswith("policy migration_aware on the pooled load estimate")


def _outcome(index, skipped=None, *, before=0.9, realised=0.95, moved=4) -> RearrangementOutcome:
    return RearrangementOutcome(
        model="m", rearrangement=index, step=4 * index, policy="default", skipped=skipped,
        balancedness_before=before, balancedness_planned=None if skipped else 0.99, load_estimate="window",
        estimate_balancedness_before=None, estimate_balancedness_planned=None, balancedness_realised=realised,
        windows_realised=1, experts_moved=0 if skipped else moved, bytes_moved=0 if skipped else 1024,
        layers_changed=0 if skipped else 2,
    )  # fmt: skip


def test_a_gate_that_skips_every_window_reads_as_none_completed_and_nothing_to_check():
    """Issue 43 confusion: a gate that skipped every window reported "2 completed" (upstream commits the
    unchanged layers) and a fingerprints PASS "for each moved expert" when none moved."""
    from ascend_eplb.tools.simulate.report import _completed
    from ascend_eplb.tools.simulate.summary import summary_text

    skipped = (_outcome(1, "min_gain"), _outcome(2, "min_gain"))
    assert _completed(skipped, cycles=2) == 0  # the two commit cycles were the skipped windows'
    assert _completed((_outcome(1), *skipped), cycles=3) == 1
    assert _completed((), cycles=2) == 2  # no records here (another host wrote them): the cycles
    lines = summary_text(
        _report(rearrangements=2, rearrangements_completed=0, rearrangement_records=skipped,
                rearrangements_skipped={"balanced": 0, "min_gain": 2, "no_load": 0})
    ).splitlines()  # fmt: skip
    assert (
        lines[1]
        == "  steps 3, rearrangements 2 (0 completed, 2 skipped), layers committed 2, bytes received 0 B"
    )


def test_realised_below_before_names_the_initial_placement_only_in_a_run_that_started_from_one():
    """Issue 43 confusion: "realised below before" cited an ``--initial-placement`` in runs without one."""
    from ascend_eplb.tools.simulate.summary import summary_text

    worse = (_outcome(1, before=0.93, realised=0.91), _outcome(2, before=0.91, realised=0.90))

    def cause(report) -> str:
        (line,) = [ln for ln in summary_text(report).splitlines() if "realised below before" in ln]
        return line

    plain = cause(_report(rearrangement_records=worse))
    assert plain.startswith("    realised below before (rearrangements 1, 2): the policy fit its placement")
    assert "initial-placement" not in plain
    assert "the placement it replaced can serve it better" in plain
    install = InstallReport(
        source="p.json", layers_committed=2, layers_changed=2, experts_moved=5, bytes_moved=5 * 1024,
        first_step_balancedness=0.9490, first_step_planned=0.9538, first_step_off=0.5,
        plan_predicted_on_its_load=0.9897, slots_hold_their_experts=True, slot_mismatches=(),
    )  # fmt: skip
    started = cause(_report(rearrangement_records=worse, initial_placement=install))
    assert (
        "the placement it replaced (for rearrangement 1: the --initial-placement from `plan`, fit to a whole "
        "recording's summed windows) can serve it better"
    ) in started
    # The install's line: both first-step figures, and why they differ; plan's prediction of another load.
    (line,) = [ln for ln in summary_text(_report(initial_placement=install)).splitlines()
               if ln.startswith("  initial placement")]  # fmt: skip
    assert line == (
        "  initial placement p.json: first step balancedness 0.9490 measured (each token's selection served "
        "by one replica of its expert), 0.9538 on plan's measure of that step's load (each expert's load "
        "split evenly over its replicas: the two differ by how the replicas shared the step's tokens), EPLB "
        "off 0.5000; plan predicted 0.9897 on the load it was made from; every slot held its logical expert "
        "from step 0"
    )


def test_the_plot_draws_the_mtp_drafts_start_up_install_the_summary_lists(tmp_path):
    """Issue 43 case 13: the plot left out the MTP draft's start-up install that the summary and
    ``report.json`` list."""
    from ascend_eplb.tools.simulate.plot import balancedness_figure
    from ascend_eplb.tools.simulate.report import DraftReport

    def install(nbytes):
        return InstallReport(
            source="p.json", layers_committed=1, layers_changed=1, experts_moved=1, bytes_moved=nbytes,
            first_step_balancedness=0.9, first_step_planned=0.9, first_step_off=0.5,
            plan_predicted_on_its_load=None, slots_hold_their_experts=True, slot_mismatches=(),
        )  # fmt: skip

    draft = DraftReport(
        model="m (draft)", architecture="DeepSeekMTP", forwards_per_step=1, layers=1,
        rearrangements_completed=0, layers_committed=1, balancedness_before=None, balancedness_after=None,
        balancedness_off_after=None, balancedness_off_mean=None, balancedness_per_step=(0.7, 0.8, 0.9),
        balancedness_off_per_step=(0.7, 0.7, 0.7), commit_completed_steps=(),
        initial_placement=install(3 * 1024),
        bytes_received=None, bytes_received_per_rank=(None,) * 4, rearrangement_records=(),
        rearrangements_skipped={}, experts_moved=1, bytes_moved=3 * 1024, busiest_rank_experts_received=0,
        max_output_error=0.0, load_steps_recorded=0, load_selections=0,
    )  # fmt: skip
    fig = balancedness_figure(_report(format="float32", initial_placement=install(5 * 1024), draft=draft))
    ax_bytes = fig.axes[1]
    bars = {b.get_label(): (b.patches[0].get_y(), b.patches[0].get_height()) for b in ax_bytes.containers}
    assert bars == {
        "start-up install (all ranks)": (0.0, 5.0),  # KiB: the panel's unit
        "MTP draft's start-up install (all ranks)": (5.0, 3.0),  # stacked on the target's
    }
    assert ax_bytes.get_ylabel() == "moved per\nrearrangement (KiB)"


def test_a_compilation_config_of_mode_0_is_titled_by_its_mode():
    """Issue 43 confusion: ``--compilation-config '{"mode": 0}'`` was titled "eager (enforce_eager)"."""
    from ascend_eplb.tools.simulate.config import SimulateConfig
    from ascend_eplb.tools.simulate.report import _compilation_title

    eager = "eager (enforce_eager)"
    assert _compilation_title(SimulateConfig(compilation_config='{"mode": 0}'), eager) == (
        "NONE (compilation_config mode 0: eager execution)"
    )
    assert _compilation_title(SimulateConfig(), eager) == eager  # no option: vLLM's enforce_eager
    compiled = "DYNAMO_TRACE_ONCE, eager backend"
    assert _compilation_title(SimulateConfig(compile="eager"), compiled) == compiled
    assert _compilation_title(SimulateConfig(model="replay"), None) is None


def test_the_plot_is_written_by_the_one_writer(tmp_path):
    """``balancedness.png`` replaces only a regular file (issue 43: one writer for every file written)."""
    import os

    import pytest

    from ascend_eplb.integration.regular_files import RegularFileError
    from ascend_eplb.tools.simulate.plot import plot_balancedness

    png = tmp_path / "balancedness.png"
    plot_balancedness(_report(format="float32"), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    with pytest.raises(RegularFileError, match="is a FIFO, not a regular file"):
        plot_balancedness(_report(format="float32"), fifo)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["balancedness.png", "fifo.png"]


def test_the_batch_split_is_one_summary_line_and_one_plot_line_and_nothing_with_it_off():
    """Issue 44: with ``--replica-split`` on, the summary adds one line (the executed balancedness beside
    the equal split's on the same counts, and the scope) and the plot one line; off, neither changes."""
    from ascend_eplb.tools.simulate.plot import balancedness_figure
    from ascend_eplb.tools.simulate.summary import summary_text
    from ascend_eplb.tools.simulate.verdicts import PASSED

    off = _report(verdict=PASSED)
    on = replace(
        off, replica_split="batch", split_scope="global", balancedness_equal_split_per_step=(0.6, 0.65, 0.7),
        split_steps=3, balancedness_split_mean=0.8, balancedness_equal_split_mean=0.65,
    )  # fmt: skip
    off_lines, on_lines = summary_text(off).splitlines(), summary_text(on).splitlines()
    assert [line for line in on_lines if line not in off_lines] == [
        "  replica split batch (scope global: the global batch's counts, one all-gather per MoE layer): "
        "balancedness executed 0.8000 beside the equal split's 0.6500 on the same steps' counts and "
        "placements (each replica an equal share), mean over the 3 steps that have both"
    ]
    assert [line for line in off_lines if line not in on_lines] == []
    labels = {}
    for name, report in (("off", off), ("on", on)):
        balance = balancedness_figure(report).axes[0]
        labels[name] = {line.get_label(): tuple(line.get_ydata()) for line in balance.get_lines()}
    assert labels["off"]["EPLB on"] == (0.7, 0.8, 0.9)
    assert not any("split" in label for label in labels["off"])
    assert labels["on"]["EPLB on, replica split batch executed"] == (0.7, 0.8, 0.9)
    assert labels["on"]["EPLB on, equal split (same counts and placement)"] == (0.6, 0.65, 0.7)
