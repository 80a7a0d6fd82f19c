"""The text ``ascend-eplb plan`` prints: the level sweep's table (:func:`format_plan`), the policies
compared (:func:`format_comparison`) and the batch split (:func:`format_batch_split`), each from its
result (:mod:`ascend_eplb.tools.plan`, :mod:`ascend_eplb.tools.plan_compare`,
:mod:`ascend_eplb.tools.plan_batch_split`); ``--json`` prints the results themselves.
"""

from __future__ import annotations

import json

from ascend_eplb.tools.costs import format_bytes
from ascend_eplb.tools.plan import PlanResult
from ascend_eplb.tools.plan_batch_split import BatchSplitReport
from ascend_eplb.tools.plan_compare import GATE_DECIMALS, PolicyComparison, PolicyRun

__all__ = ["format_batch_split", "format_comparison", "format_plan"]


def format_plan(result: PlanResult) -> str:
    """Human-readable table of a :class:`PlanResult`: one row per level and policy, invalid levels with
    their reason, the recommendation and, with costs, each level's memory and rearrangement cost."""

    lines = [
        f"upstream DefaultEplbPolicy: {result.num_moe_layers} layers x {result.num_logical_experts} "
        f"logical experts, ranks={result.num_ranks} nodes={result.num_nodes} "
        f"expert groups={result.num_expert_groups} (policy upstream runs: {result.policy})",
        "balancedness = mean rank load / max rank load per layer, averaged over layers (1.0 = even); before: "
        "upstream's initial placement, after: the policy's; each expert's load split evenly over its "
        "replicas (replica_split=equal; --batch-split: what the batch split executes per batch)",
        "experts moved = experts a rank receives that it did not hold, summed over ranks and layers (a slot "
        "refilled with an expert its rank already holds is a copy on the rank: not moved)",
    ]
    if result.layers_excluded:
        lines.append(f"excluded (no load): layers {result.layers_excluded}")
    costs = result.costs or {}
    cost_head = f" {'memory/rank':>12} {'busiest rx':>11} {'time':>8}" if costs else ""
    lines.append(
        f"{'redundant':>9} {'physical':>8} {'policy':>12} {'balancedness':>21} {'hottest rank share':>21} "
        f"{'experts moved':>13}{cost_head}"
    )
    lines.append(f"{'':>9} {'':>8} {'':>12} {'before':>10} {'after':>10} {'before':>10} {'after':>10}")
    rows = [(lv.num_redundant_experts, 0, lv) for lv in result.levels]
    rows += [(d["num_redundant_experts"], 1, d) for d in result.invalid_levels]
    for r, kind, item in sorted(rows, key=lambda x: (x[0], x[1])):
        if kind == 1:
            lines.append(f"{r:>9}  invalid: {item['error']}")
            continue
        lv = item
        extra = ""
        c = costs.get(str(r), {}).get(lv.policy)
        if c:
            t = "n/a" if c["transfer_seconds"] is None else f"{c['transfer_seconds']:.1f} s"
            extra = (
                f" {format_bytes(c['redundant_nbytes_per_rank']):>12} "
                f"{format_bytes(c['busiest_rank_nbytes_received']):>11} {t:>8}"
            )
        lines.append(
            f"{lv.num_redundant_experts:>9} {lv.num_physical_experts:>8} {lv.policy:>12} "
            f"{lv.balancedness_before:>10.4f} {lv.balancedness_after:>10.4f} "
            f"{lv.hottest_rank_share_before:>10.4f} {lv.hottest_rank_share_after:>10.4f} "
            f"{lv.experts_moved:>13}{extra}"
        )
    worse = sorted({lv.num_redundant_experts for lv in result.levels
                    if round(lv.balancedness_after, 4) < round(lv.balancedness_before, 4)})  # fmt: skip
    if worse:
        lines.append(
            f"after < before at num_redundant_experts={','.join(map(str, worse))}: upstream's policy plans "
            "from the load alone (replicas to the hottest experts, then packing), not from the placement in "
            "force, so it can balance a load less than upstream's initial placement did (which, with "
            "num_redundant_experts = E on 2 ranks, gives each rank one replica of every expert: an even "
            "split of any load); a server at that level would rearrange into the worse placement"
        )
    if result.recommended is not None:
        lv = result.level(result.recommended)
        best = max(x.balancedness_after for x in result.levels if x.policy == result.policy)
        c = costs.get(str(lv.num_redundant_experts), {}).get(lv.policy)
        mem = (
            f", {format_bytes(c['redundant_nbytes_per_rank'])} of device memory per rank for its "
            f"{c['redundant_slots_per_rank_per_layer']} extra slot(s) per layer"
            if c
            else f", {lv.num_redundant_experts // result.num_ranks} extra expert slot(s) per rank per MoE "
            "layer (pass --model-config for bytes)"
        )
        lines.append(
            f"recommended: num_redundant_experts={lv.num_redundant_experts} ({result.policy} policy): the "
            f"smallest level within {result.margin} of the best balancedness after ({best:.4f}), reaching "
            f"{lv.balancedness_after:.4f}{mem}"
        )
    if costs:
        c0 = next(iter(next(iter(costs.values())).values()))
        lines.append(
            f"costs: one expert {format_bytes(c0['expert_nbytes'])} in {c0['quant_format']}; memory/rank = "
            "redundant slots beyond EPLB-off over the model's MoE layers; busiest rx = what the rank "
            f"receiving most gets moving from the initial placement; time at {c0['link_gbps']:g} Gbit/s"
        )
    return "\n".join(lines)


def _gate_text(min_gain: float, target: float | None) -> str:
    target_text = "off" if target is None else f"{target:g}"
    return f"min_balancedness_gain={min_gain:g} target_balancedness={target_text}"


def format_comparison(result: PolicyComparison) -> str:
    """Human-readable :class:`PolicyComparison`: per load estimate, per window the runs side by side (the
    gate-off runs and the gated ones: the given gate, else the recommended one), the totals of every run,
    the recommended gate values with their rule and their effect, and the run to choose."""

    with_bytes = result.expert_nbytes is not None
    several = len(result.load_estimates) > 1
    compared = f"policies and load estimates ({', '.join(result.load_estimates)})" if several else "policies"
    on = "" if result.load_estimates == ["window"] else f" on the load estimate {result.load_estimates[0]}"
    lines = [
        f"{compared} compared{'' if several else on} on {result.num_windows} window(s) of {result.source} "
        f"(a window: {result.window}): "
        f"{result.num_moe_layers} layers x {result.num_logical_experts} logical experts, ranks="
        f"{result.num_ranks} nodes={result.num_nodes} expert groups={result.num_expert_groups}, "
        f"num_redundant_experts={result.num_redundant_experts}; every run starts from upstream's initial "
        "placement, each window decided by serving's gate (ascend_eplb.control.gate.decide)",
    ]
    if result.load_estimates != ["window"]:
        lines.append(
            "load estimate: window = the closed window (upstream's); pooled = serving's "
            f"ascend_eplb.control.estimate.LoadEstimate, taking in {result.evidence}"
        )
    lines += [
        "balancedness = mean rank load / max rank load per layer, averaged over layers (1.0 = even); after: "
        "the window under the placement in force after its rearrangement; realised: the next window under "
        "it (what serving sees); each expert's load split evenly over its replicas (replica_split=equal)",
        "moved = experts a rank receives that it did not hold, summed over ranks and layers; "
        + (f"bytes = moved x {result.bytes_note}" if with_bytes else f"bytes: {result.bytes_note}"),
    ]
    gated = "given" if any(r.gate == "given" for r in result.runs) else "recommended"
    for estimate in result.load_estimates:
        shown = [r for r in result.runs if r.gate in ("off", gated) and r.load_estimate == estimate]
        if several:
            lines.append(f"load estimate {estimate}:")
        lines += _window_table(result, shown, with_bytes)
    lines.append("totals:")
    label_w = max(len(r.label) for r in result.runs)
    lines.append(
        f"  {'run':<{label_w}} {'rearranged':>10} {'skipped (balanced/min_gain/no_load)':>36} "
        f"{'experts moved':>13} {'bytes moved':>11} {'mean after':>10} {'mean realised':>13}"
    )
    for r in result.runs:
        skipped = "/".join(str(r.skipped[k]) for k in ("balanced", "min_gain", "no_load"))
        realised = "n/a" if r.mean_balancedness_realised is None else f"{r.mean_balancedness_realised:.4f}"
        lines.append(
            f"  {r.label:<{label_w}} {r.rearranged:>10} {skipped:>36} {r.experts_moved:>13} "
            f"{format_bytes(r.bytes_moved):>11} {r.mean_balancedness_after:>10.4f} {realised:>13}"
        )
    for r in result.runs:
        if r.gate == "given":
            lines.append(f"  {r.label}: {_gate_text(r.min_balancedness_gain, r.target_balancedness)}")
    if not result.recommended_gates:
        lines.append(f"recommended gate: none ({result.recommendation_note})")
    for rec in result.recommended_gates:
        off = result.run(rec.policy, load_estimate=rec.load_estimate)
        lines.append(
            f"recommended gate for {off.label}: "
            f"{_gate_text(rec.min_balancedness_gain, rec.target_balancedness)}"
        )
        if rec.load_estimate == "window":
            kept = "its gate-off placements realise on the next window"
            drop = "its window to the next"
        else:
            kept = "of the load estimate under its gate-off run's placement in force at each next window"
            drop = "the estimate it was planned on to the next window's estimate"
        lines.append(
            f"  rule: target_balancedness = the mean balancedness {kept} ({rec.mean_in_force:.4f}): a window "
            "the placement in force already serves that well has nothing to gain on average; "
            f"min_balancedness_gain = the mean drop of a fresh placement from {drop} ({rec.mean_drift:.4f}): "
            "a planned gain below it does not survive into the window it serves (both rounded to "
            f"{GATE_DECIMALS} decimals)"
        )
        gated_run = next(
            (
                r
                for r in result.runs
                if (r.policy, r.load_estimate, r.gate) == (rec.policy, rec.load_estimate, "recommended")
            ),
            None,
        )
        if gated_run is None:
            lines.append("  with it: the gate is off (both values 0 / unset)")
            continue
        skips = ", ".join(f"{k} {v}" for k, v in gated_run.skipped.items() if v) or "none"
        saved = ""
        if with_bytes:
            saved = (
                f", bytes {format_bytes(gated_run.bytes_moved)} (gate off: {format_bytes(off.bytes_moved)})"
            )
        realised = (
            ""
            if gated_run.mean_balancedness_realised is None
            else f"; mean realised {gated_run.mean_balancedness_realised:.4f} (gate off: "
            f"{off.mean_balancedness_realised:.4f})"
        )
        lines.append(
            f"  with it: {result.num_windows - gated_run.rearranged} of {result.num_windows} windows skipped "
            f"({skips}); experts moved {gated_run.experts_moved} (gate off: {off.experts_moved}){saved}"
            f"{realised}"
        )
    lines += _choice_lines(result)
    return "\n".join(lines)


def _window_table(result: PolicyComparison, shown: list[PolicyRun], with_bytes: bool) -> list[str]:
    """Per window, each run of ``shown`` side by side: balancedness after, then experts moved (and
    bytes), or the skip reason in their place."""

    rest_w = 18 if with_bytes else 13  # "skip min_gain"; "  moved      bytes"
    sub = f"{'after':>6} " + (f"{'moved':>7} {'bytes':>10}" if with_bytes else f"{'moved':>{rest_w}}")
    widths = [max(len(sub), len(r.label)) for r in shown]
    lines = [
        f"{'window':>6} "
        + " ".join(f"| {r.label:<{w}}" for r, w in zip(shown, widths, strict=True)).rstrip(),
        (f"{'':>6} " + " ".join(f"| {sub:<{w}}" for w in widths)).rstrip(),
    ]
    for i in range(result.num_windows):
        cells = []
        for r, width in zip(shown, widths, strict=True):
            o = r.windows[i]
            if o.skipped is not None:
                rest = f"skip {o.skipped}"
            elif with_bytes:
                rest = f"{o.experts_moved:>7} {format_bytes(o.bytes_moved):>10}"
            else:
                rest = str(o.experts_moved)
            cells.append(f"| {f'{o.balancedness_after:>6.4f} {rest:>{rest_w}}':<{width}}")
        lines.append((f"{i + 1:>6} " + " ".join(cells)).rstrip())
    return lines


def _choice_lines(result: PolicyComparison) -> list[str]:
    """The run to choose, its keys, beside upstream's default on the window with the gate off (when it
    ran), and the rule."""
    choice = result.choice
    if choice is None:
        return ["choose: nothing to judge (one window: no placement was seen serving a next one)"]
    keys = json.dumps(choice.ascend_keys) if choice.ascend_keys else "{} (upstream's defaults)"
    upstream = next(
        (r for r in result.runs if (r.policy, r.load_estimate, r.gate) == ("default", "window", "off")), None
    )
    beside = ""
    if upstream is not None and upstream.label != choice.label:
        beside = (
            f" (upstream's default on the window, gate off: {upstream.mean_balancedness_realised:.4f}, "
            f"{upstream.experts_moved} experts moved)"
        )
    return [
        f"choose: {choice.label}: additional_config.eplb_config {keys}; mean realised "
        f"{choice.mean_balancedness_realised:.4f}, {choice.experts_moved} experts moved{beside}",
        "  rule: the highest mean realised balancedness (the next window under each placement: what serving "
        f"sees); of the runs within {choice.margin:g} of it (the migration-aware policy's tolerance of "
        "upstream's balance), the one that moves the fewest experts",
    ]


def format_batch_split(report: BatchSplitReport) -> str:
    """The report's table: a line per batch, then the means."""
    lines = [
        f"batch split on {report.source}: {report.num_ranks} ranks, {report.num_redundant_experts} "
        "redundant experts (upstream's default policy planned on the whole trace), batches of "
        f"{report.window_sequences} sequences, the split's solve {report.steps} steps",
        "balancedness per batch (mean over MoE layers): equal = each replica count/replicas; today = today's "
        "rule executed; split = the batch split executed (replica_split=batch); bound = the most any split "
        "reaches",
        f"{'batch':>5} {'sequences':>10} {'tokens':>7} {'equal':>7} {'today':>7} {'split':>7} {'bound':>7}",
    ]
    for r in report.rows:
        seqs = f"{r.first_sequence}-{r.last_sequence}"
        lines.append(
            f"{r.batch:>5} {seqs:>10} {r.tokens:>7} {r.equal:>7.4f} {r.today:>7.4f} {r.split:>7.4f} "
            f"{r.bound:>7.4f}"
        )
    m = report.means()
    means = " ".join(f"{m[k]:>7.4f}" for k in ("equal", "today", "split", "bound"))
    lines.append(f"{'mean':>5} {'':>10} {'':>7} {means}")
    return "\n".join(lines)
