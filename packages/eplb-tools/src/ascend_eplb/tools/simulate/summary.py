"""The summary a run prints: what it served, balancedness, latency, costs, each check and the verdict."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ascend_eplb.control.policy_config import PolicySettings
from ascend_eplb.tools import quiet
from ascend_eplb.tools.costs import format_bytes
from ascend_eplb.tools.simulate.checks import CHECK_DESCRIPTIONS
from ascend_eplb.tools.simulate.report import InstallReport, SimulateReport
from ascend_eplb.tools.simulate.verdicts import FAILED, NOT_JUDGED, PASSED

__all__ = ["summary_text"]


def _install_note(report: SimulateReport) -> str:
    """How the top line's totals count the start-up install (nothing without one)."""
    install = report.initial_placement
    if install is None:
        return ""
    return (
        f" (every total counts the start-up install of {install.layers_committed} layers as a rearrangement)"
    )


def _gate_skips(skipped: dict[str, int]) -> str:
    """``", N skipped"``: the windows the gain gate skipped (a window without load is none), or ``""``."""
    n = sum(v for k, v in skipped.items() if k != "no_load")
    return f", {n} skipped" if n else ""


#: Rearrangements the summary lists one per line (report.json has all of them).
SHOWN_REARRANGEMENTS = 12
#: Why a rearrangement can serve the next windows worse than the placement it replaced served its own,
#: by what the policy planned on (SIMULATE.md, "Realised below before", has the measured case).
REALISED_BELOW_BEFORE = {
    "window": (
        "the policy fit its placement to one window's load, a small and bursty sample; the next window's "
        "load differs, and the placement it replaced{initial} can serve it better; the gain gate skips a "
        "window whose planned gain is below that drift (--min-balancedness-gain; `ascend-eplb plan "
        "events.jsonl --policies default` measures the drift and recommends values)"
    ),
    "pooled": (
        "the policy planned on the load estimate (every window since the load's last shift), and the next "
        "windows are small, bursty samples of that load, or a shift the estimate follows only once it is "
        "seen; the placement it replaced{initial} can serve such a sample better; the gain gate skips a "
        "window whose planned gain on the estimate is below that drift (--min-balancedness-gain; "
        "`ascend-eplb plan events.jsonl --load-estimates window,pooled` measures the drift and recommends "
        "values)"
    ),
}


def _rearrangement_lines(report: SimulateReport, f) -> list[str]:
    """The policy and the gain gate of the run, what the rearrangements (and the start-up install) moved
    and skipped, and one line per rearrangement: its balancedness before, planned and realised beside the
    experts and bytes it moved, or the gate's reason."""

    settings = PolicySettings(
        report.policy, report.min_balancedness_gain, report.target_balancedness, report.load_estimate
    ).describe()
    records = report.rearrangement_records
    done = [r for r in records if r.skipped is None]
    skipped = ", ".join(f"{k} {v}" for k, v in report.rearrangements_skipped.items() if v) or "none"
    install = report.initial_placement
    counted = install is not None and install.experts_moved is not None
    lines = [
        f"  {settings}: {len(done)} rearrangements{' and the start-up install' if counted else ''} moved "
        f"{report.experts_moved} experts ({format_bytes(report.bytes_moved)}); skipped: {skipped}"
    ]
    if counted:
        lines.append(
            f"    start-up install (before step 0): {install.experts_moved} experts, "
            f"{format_bytes(install.bytes_moved)} moved, {install.layers_changed} of "
            f"{install.layers_committed} layers changed"
        )
    for r in records[:SHOWN_REARRANGEMENTS]:
        name = "window without load" if r.rearrangement is None else f"rearrangement {r.rearrangement}"
        # The record's step: a done one's last layer commit (it started when its window closed, one layer
        # committed per step after), a skipped one's decision.
        when = "committed at" if r.skipped is None else "skipped at"
        head = f"    {name} ({when} step {r.step}): balancedness {f(r.balancedness_before)}"
        estimate = ""
        if r.estimate_balancedness_before is not None:  # planned on the load estimate: its figures too
            planned = r.estimate_balancedness_planned
            estimate = f" (on the {r.load_estimate} load estimate {f(r.estimate_balancedness_before)}" + (
                ")" if planned is None else f" -> {f(planned)})"
            )
        if r.skipped is None:
            over = f" over the {r.windows_realised} windows it served" if r.windows_realised > 1 else ""
            lines.append(
                f"{head} -> planned {f(r.balancedness_planned)}{estimate}, realised "
                f"{f(r.balancedness_realised)}{over}; {r.experts_moved} experts, "
                f"{format_bytes(r.bytes_moved)} moved"
            )
        else:
            planned = "" if r.balancedness_planned is None else f", planned {f(r.balancedness_planned)}"
            kept = (
                ""
                if r.balancedness_realised is None
                else f"; the placement kept realised {f(r.balancedness_realised)} on the next window"
            )
            lines.append(f"{head}{planned}{estimate}; skipped ({r.skipped}), nothing moved{kept}")
    if len(records) > SHOWN_REARRANGEMENTS:
        lines.append(f"    ... {len(records) - SHOWN_REARRANGEMENTS} more in report.json")
    worse = [
        str(r.rearrangement)
        for r in done
        if r.balancedness_realised is not None and r.balancedness_realised < r.balancedness_before
    ]
    if worse:
        # The placement each replaced: the --initial-placement's, fit to a whole recording, only for the
        # first one of a run that started from one.
        initial = (
            f" (for rearrangement {worse[0]}: the --initial-placement from `plan`, fit to a whole "
            "recording's summed windows)"
            if install is not None and worse[0] == str(done[0].rearrangement)
            else ""
        )
        cause = REALISED_BELOW_BEFORE[report.load_estimate].format(initial=initial)
        lines.append(f"    realised below before ({'rearrangement' if len(worse) == 1 else 'rearrangements'} "
                     f"{', '.join(worse)}): {cause}")  # fmt: skip
    return lines


def _draft_lines(report: SimulateReport, f) -> list[str]:
    """With ``--speculative-tokens``: the MTP draft's own lines (balanced beside the target in the one EPLB
    state): what it served, its rearrangements (as the target's) and its balancedness."""

    d = report.draft
    if d is None:
        return []
    received = "n/a" if d.bytes_received is None else format_bytes(d.bytes_received)
    # Its rearrangements' lines as the target's, from its own records and its own start-up install.
    own = replace(
        report,
        rearrangement_records=d.rearrangement_records,
        rearrangements_skipped=d.rearrangements_skipped,
        experts_moved=d.experts_moved,
        bytes_moved=d.bytes_moved,
        initial_placement=d.initial_placement,
    )
    return [
        f"  draft {d.model} (vLLM's {d.architecture}, {d.layers} MoE layer, {d.forwards_per_step} "
        f"forward(s) per step after the target): rearrangements {d.rearrangements_completed} completed"
        f"{_gate_skips(d.rearrangements_skipped)}, "
        f"layers committed {d.layers_committed}, bytes received {received}",
        *("  " + line for line in _rearrangement_lines(own, f)),
        f"    draft balancedness before the first rearrangement {f(d.balancedness_before)}; after its "
        f"first completed, EPLB on {f(d.balancedness_after)} beside EPLB off "
        f"{f(d.balancedness_off_after)}; EPLB off over the whole run {f(d.balancedness_off_mean)}",
    ]


def _install_line(start: InstallReport, f, head: str) -> str:
    """A model's start-up install of ``--initial-placement``: its first step measured beside plan's
    computation for the placement, and whether every slot held its expert."""
    said = start.plan_predicted_on_its_load
    held = {
        True: "; every slot held its logical expert from step 0",
        False: "; SLOTS DID NOT HOLD THEIR EXPERTS",
    }
    return (
        f"{head} {start.source}: first step balancedness {f(start.first_step_balancedness)} measured (each "
        f"token's selection served by one replica of its expert), {f(start.first_step_planned)} on plan's "
        "measure of that step's load (each expert's load split evenly over its replicas: the two differ by "
        f"how the replicas shared the step's tokens), EPLB off {f(start.first_step_off)}"
        + ("" if said is None else f"; plan predicted {f(said)} on the load it was made from")
        + held.get(start.slots_hold_their_experts, "")
    )


#: What each scope of the batch split covers (``ascend_eplb.control.split_config.SplitScope``).
SPLIT_SCOPES = {
    "rows": "each rank splits the rows it routes by their own counts, no communication",
    "global": "the global batch's counts, one all-gather per MoE layer",
    "local": "each rank splits its own rows, no communication",
}


def _split_lines(report: SimulateReport, f) -> list[str]:
    """With ``--replica-split`` batch or batch_local: the balancedness the split executed beside the equal
    split's on the same steps' counts (nothing with the split off)."""
    if report.replica_split == "equal":
        return []
    scope = report.split_scope
    return [
        f"  replica split {report.replica_split} (scope {scope}: {SPLIT_SCOPES.get(scope, 'not read')}): "
        f"balancedness executed {f(report.balancedness_split_mean)} beside the equal split's "
        f"{f(report.balancedness_equal_split_mean)} on the same steps' counts and placements (each replica "
        f"an equal share), mean over the {report.split_steps} steps that have both"
    ]


def _engine_lines(report: SimulateReport) -> list[str]:
    """vLLM's engine EPLB on beside off (a real model): throughput, TPOT and TTFT, and where the time went."""
    on, off = report.engine_on, report.engine_off
    if on is None or off is None:
        return []

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000.0:.1f} ms"

    ratio = f"{on.throughput / off.throughput:.2f}x" if off.throughput else "n/a"
    return [
        f"  vLLM's engine, EPLB on beside off (EPLB's overhead on this host, whose kernels are torch "
        f"stand-ins: not a speed figure): throughput {on.throughput:.1f} beside {off.throughput:.1f} "
        f"tokens/s ({ratio}), TPOT p50 {ms(on.tpot_s)} beside {ms(off.tpot_s)}, TTFT p50 {ms(on.ttft_s)} "
        f"beside {ms(off.ttft_s)}",
        f"  where the time went: EPLB-off engine start-up {off.start_s:.1f} s, workload "
        f"{off.generate_s:.1f} s; EPLB-on engine start-up {on.start_s:.1f} s, workload {on.generate_s:.1f} s "
        f"({on.tokens} tokens each)",
    ]


def summary_text(report: SimulateReport) -> str:
    def f(x: float | None, spec: str = ".4f") -> str:
        return "n/a" if x is None else format(x, spec)

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000.0:.1f}"

    commit_mean = float(np.mean(report.commit_seconds)) if report.commit_seconds else None
    bal_before, bal_after = f(report.balancedness_before), f(report.balancedness_after)
    served = (
        f"trace {report.trace}"
        if report.model == "replay"
        else f"{report.model} ({report.trace}, vLLM's model class, DP={report.data_parallel_size} x "
        f"TP={report.tensor_parallel_size}, EP={report.ranks}, {report.moe_rows} MoE rows, "
        f"{report.compilation})"
    )
    lines = [
        f"ascend-eplb simulate: {report.ranks} ranks, {report.format}, {report.layers} layers x "
        f"{report.num_logical_experts} experts (+{report.num_redundant_experts} redundant), top-"
        f"{report.top_k}, {served}",
        f"  steps {report.steps}, rearrangements {report.rearrangements} "
        f"({report.rearrangements_completed} completed{_gate_skips(report.rearrangements_skipped)}), layers "
        f"committed {report.layers_committed}, bytes received {format_bytes(report.bytes_received)}"
        f"{_install_note(report)}",
        *_rearrangement_lines(report, f),
        *_draft_lines(report, f),
        "  balancedness = mean rank load / max rank load of a layer, averaged over layers (1.0 = even)",
        # EPLB on beside EPLB off on the same steps after the first completed rearrangement (the
        # comparison), not "before -> after; without EPLB": that read as a comparison with "before".
        f"  balancedness before the first rearrangement {bal_before}; after the first completed, EPLB on "
        f"{bal_after} beside EPLB off {f(report.balancedness_off_after)} (the same steps and tokens on "
        f"upstream's initial placement); EPLB off over the whole run {f(report.balancedness_off_mean)}",
        *_split_lines(report, f),
        f"  step latency p50 {ms(report.step_seconds_p50)} ms, p99 {ms(report.step_seconds_p99)} ms "
        f"(p50 with a commit in flight {ms(report.step_seconds_p50_in_flight)} ms, "
        f"without {ms(report.step_seconds_p50_idle)} ms)",
        f"  CPU per step, all ranks, p50 {ms(report.world_cpu_seconds_per_step_p50)} ms",
        f"  serving verifier (ASCEND_EPLB_VERIFY=1) per step p50 "
        f"{ms(report.verifier_seconds_per_step_p50)} ms, mean "
        f"{ms(report.verifier_seconds_per_step_mean)} ms (step p50 without it "
        f"{ms(report.step_seconds_p50_without_verifier)} ms)",
        f"  time per commit step mean {ms(commit_mean)} ms; max output error {report.max_output_error:.3g}",
        *_engine_lines(report),
    ]
    if report.initial_placement:
        lines.append(_install_line(report.initial_placement, f, "  initial placement"))
    if report.draft is not None and report.draft.initial_placement is not None:
        lines.append(_install_line(report.draft.initial_placement, f, "  the draft's initial placement"))
    c = report.costs
    if c:
        t = "n/a" if c["transfer_seconds"] is None else f"{c['transfer_seconds']:.1f} s"
        lines.append(
            f"  at the size of {c['model']} ({c['num_moe_layers']} MoE layers, {c['quant_format']}): one "
            f"expert {format_bytes(c['expert_nbytes'])}; {c['num_redundant_experts']} redundant experts "
            f"cost {format_bytes(c['redundant_nbytes_per_rank'])} of device memory per rank; per "
            f"rearrangement the busiest rank receives {format_bytes(c['busiest_rank_nbytes_received'])} "
            f"({t} at {c['link_gbps']:g} Gbit/s)"
        )
    label = {True: "PASS", False: "FAIL", None: "NOT JUDGED"}
    for name, ok in report.checks.items():
        lines.append(f"  {label[ok]}  {name:<12} {CHECK_DESCRIPTIONS[name]}")
        lines.append(f"        {'':<12} saw: {report.check_evidence[name]}")
    scrape = ", metrics.prom" if report.config.get("metrics") else ""
    lines.append(f"  report.json, balancedness.png, events.jsonl{scrape} in {report.out_dir}")

    if quiet.install():
        lines.append(f"  {quiet.NOTE}")
    verdict = {PASSED: "PASSED", FAILED: "FAILED", NOT_JUDGED: "NOT FULLY JUDGED"}[report.verdict]
    unjudged = [name for name, ok in report.checks.items() if ok is None]
    why = f" ({', '.join(unjudged)} not judged)" if unjudged else ""
    lines.append(f"  {verdict} in {report.wall_seconds:.1f} s{why}")
    return "\n".join(lines)
