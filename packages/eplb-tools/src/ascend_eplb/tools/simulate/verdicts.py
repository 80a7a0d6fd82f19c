"""The verdict of each check and of the run, from what every rank's checks saw.

A check passes only on what it compared, and says what that was (:func:`check_verdicts`); the run's
verdict (:func:`run_verdict`) is :data:`PASSED`, :data:`FAILED` (a check failed) or :data:`NOT_JUDGED`
(none failed, one could not be judged).
"""

from __future__ import annotations

import itertools
from typing import Any

from ascend_eplb.tools.simulate.checks import CHECKS
from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.simulate.stats import RankStats

__all__ = ["FAILED", "JUDGED", "NOT_JUDGED", "PASSED", "check_verdicts", "run_verdict"]

#: A run's verdicts: every check passed; a check failed; none failed but one could not be judged.
PASSED, FAILED, NOT_JUDGED = "passed", "failed", "not judged"

JUDGED = {"pass": True, "fail": False, "not judged": None}


def run_verdict(verdicts: dict[str, tuple[str, str]]) -> str:
    outcomes = {outcome for outcome, _ in verdicts.values()}
    return FAILED if "fail" in outcomes else NOT_JUDGED if "not judged" in outcomes else PASSED


def _cycles(results: list[RankStats], num_moe_layers: int) -> list[list[int]]:
    """Each completed rearrangement's progress steps (rank 0's step indices): the step it started in,
    then the step of each layer's commit (upstream commits layers in order, one per step at most; the
    n-th layer 0 commit belongs to the n-th rearrangement started)."""
    r0 = results[0]
    counts = [0, *r0.rearrangements_per_step]
    starts = [i for i in range(len(counts) - 1) if counts[i + 1] > counts[i]]
    cycles, current = [], None
    for step, layers in enumerate(r0.commits_per_step):
        for layer in layers:
            if layer == 0:
                current = [starts[len(cycles)]]
            if current is not None:
                current.append(step)
                if layer == num_moe_layers - 1:
                    cycles.append(current)
                    current = None
    return cycles


def check_verdicts(
    config: SimulateConfig,
    routing: Any,
    results: list[RankStats],
    violations: list[tuple[str, str]],
    *,
    experts_moved: int | None = None,
    gate_skipped: int = 0,
) -> dict[str, tuple[str, str]]:
    """``check -> (outcome, what it saw)``, outcome ``pass``, ``fail`` or ``not judged``: a check passes
    only on what it compared, and says what that was. ``experts_moved``: what every rearrangement and
    start-up install moved, from the events file (None: not known); 0 leaves ``fingerprints`` (each moved
    expert's weights) with nothing to check, though layers committed unchanged (a gate that skips every
    window). ``gate_skipped``: the target's windows the gain gate skipped, whose unchanged layers upstream
    committed all the same (``worker`` counts them apart from the rearrangements that completed)."""

    r0, n = results[0], len(results)
    steps = r0.steps_run
    failed = {}
    for check, message in violations:
        failed.setdefault(check, message.split(": ", 1)[-1].splitlines()[0])
    out: dict[str, tuple[str, str]] = {}
    what, reference = (
        ("every layer's outputs for the real tokens", "model")
        if config.replays
        else ("every request's greedy tokens and their top candidates' logprobs on vLLM's engine", "engine")
    )
    worst = max(res.max_output_error for res in results)
    tolerance = r0.output_tolerance  # what the world's outputs check compared with
    rtol, atol = tolerance.rtol, tolerance.atol
    draft = r0.draft
    drafted = ""
    if draft is not None:
        # The draft proposes; greedy speculative decoding keeps the target's tokens whatever it proposes,
        # so the draft's own experts are judged by the fingerprints and load checks.
        drafted = (
            f", with the MTP draft proposing {_count(draft.forwards_per_step, 'token')} per step (its moved "
            "experts: the fingerprints check; its load: the load check)"
        )
    out["outputs"] = (
        "pass",
        f"{steps} steps on {n} ranks: {what} equal the EPLB-off {reference}'s (max error {worst:.3g}, "
        f"tolerance {atol:g} + {rtol:g} x max|reference|){drafted}",
    )
    recorded = max(res.load_steps_recorded for res in results)
    # A real model's ranks check the world's load (all-reduced); replay ranks each check their own rows.
    selections = sum(res.load_selections for res in results) if config.replays else r0.load_selections
    if recorded:
        rest = (
            "; the other steps recorded nothing, as the window and the phase said" if recorded < steps else ""
        )
        drafted = (
            ""
            if draft is None
            else f"; the draft ({draft.model}) recorded {draft.load_selections} real selections of its "
            "forwards, each counted once"
        )
        out["load"] = (
            "pass",
            f"{recorded} of {steps} steps recorded load: {selections} real selections, each counted once, "
            f"padding never{rest}{drafted}",
        )
    else:
        out["load"] = (
            "not judged",
            (
                f"no step of {steps} recorded load (window {config.window_size}, phase "
                f"{config.load_collection_phase}): nothing was compared"
            ),
        )
    commits = min(res.verifier_commits_checked for res in results)
    boundaries = min(res.verifier_steps for res in results)
    p = r0.slots_per_rank
    if commits and experts_moved == 0:
        checked = _count(commits, "layer commit")
        out["fingerprints"] = (
            "not judged",
            f"no expert moved: nothing to check ({checked}, each of an unchanged placement; the slots held "
            "their logical experts after each)",
        )
        out["lookups"] = (
            "pass",
            f"{checked}: each lookup equals the committed maps, in its own storage; the committed placement "
            f"was equal on the {n} ranks at {boundaries} step boundaries",
        )
    elif commits:
        checked = _count(commits, "layer commit")
        moved = (
            f"{checked} on each of {n} ranks: after each, all {p} local slots hold their logical expert's "
            f"weights ({commits * p * n} slots compared)"
        )
        if r0.install is not None:
            installed = routing.num_moe_layers + (0 if draft is None else draft.num_moe_layers)
            moved += (
                f"; the first {installed} were the start-up install of the initial placement, "
                "checked before the first step"
            )
        if draft is not None:
            moved += f" (both models': the target's and its draft's, {draft.model})"
        tables = (
            f"{checked}: each lookup equals the committed maps, in its own storage; the committed placement "
            f"was equal on the {n} ranks at {boundaries} step boundaries"
        )
        out["fingerprints"], out["lookups"] = ("pass", moved), ("pass", tables)
    else:
        out["fingerprints"] = "not judged", "no layer committed, so no moved weights were compared"
        out["lookups"] = (
            "not judged",
            (
                f"no layer committed: only the initial placement was compared across the {n} ranks "
                f"({boundaries} step boundaries)"
            ),
        )
    out["worker"] = _worker_verdict(config, routing, results, violations, gate_skipped)
    for check, message in failed.items():
        out[check] = ("fail", message)
    assert set(out) == set(CHECKS)
    return {name: out[name] for name in CHECKS}


def _worker_verdict(
    config: SimulateConfig,
    routing: Any,
    results: list[RankStats],
    violations: list[tuple[str, str]],
    gate_skipped: int = 0,
) -> tuple[str, str]:
    """The ``worker`` check: the watchdog's decision, then whether EPLB rearranged as the options allow
    and a cycle in flight at the end kept making progress (its last progress, a layer published or
    committed or its start, at most as many steps before the end as a layer took at most in this run's
    completed rearrangements, one when none completed: upstream's fastest pace)."""
    r0, n = results[0], len(results)
    steps, layers = r0.steps_run, routing.num_moe_layers
    if r0.worker_failure is not None:
        return "fail", r0.worker_failure[0].splitlines()[0]
    if violations and steps < config.steps:
        check, _ = violations[0]
        return "not judged", f"the run stopped after step {steps} of {config.steps} on the {check} violation"
    cycles = _cycles(results, layers)
    gaps = [b - a for cycle in cycles for a, b in itertools.pairwise(cycle)]
    normal = max(gaps, default=1)
    # A window the gate skipped still commits its layers (unchanged): a cycle, not a rearrangement.
    cycled = "commit cycles" if gate_skipped else "completed"
    pace = (
        f"a layer took at most {_count(normal, 'step')} in the {len(cycles)} {cycled}"
        if cycles
        else "upstream commits at most one layer per step"
    )
    in_flight = [c for res in results for c in res.in_flight_at_end]
    # The cycle progresses as fast as its slowest rank: the most steps any rank went without progress.
    slow = max(in_flight, key=lambda c: c.steps_without_progress, default=None)
    if slow is not None and slow.steps_without_progress > normal:
        idle, idle_s, timeout = (
            slow.steps_without_progress,
            slow.seconds_without_progress,
            config.worker_timeout_s,
        )
        judged = (
            f"below --worker-timeout {timeout:g} s: the watchdog could not judge it"
            if idle_s <= timeout
            else f"reaching --worker-timeout {timeout:g} s only after the last step boundary"
        )
        return "not judged", (
            f"rearrangement {slow.rearrangement} in flight at the end: no layer committed in its last "
            f"{_count(idle, 'step')} ({idle_s:.1f} s; layer {slow.layer} next, rank {slow.rank} "
            f"without progress), more than a layer takes ({pace}), {judged}"
        )
    if not cycles:
        if not r0.rearrangements_per_step or r0.rearrangements_per_step[-1] == 0:
            skipped = r0.num_skipped_rearrangements
            if skipped:
                return "not judged", (
                    f"no rearrangement started in {steps} steps: {skipped} skipped on a load window with no "
                    f"load (phase {config.load_collection_phase}); run more steps"
                )
        moved = layers + (0 if r0.draft is None else r0.draft.num_moe_layers)  # one cycle moves both
        return "fail", (
            f"no rearrangement completed in {steps} steps; the options complete the first by step "
            f"{config.min_steps(moved)} at upstream's fastest pace"
        )
    if slow is not None:
        idle = slow.steps_without_progress
        progressed = "in the last step" if idle == 0 else f"{_count(idle, 'step')} before the end"
        tail = f"rearrangement {slow.rearrangement} in flight at the end progressed {progressed}"
    else:
        tail = "none in flight at the end"
    skipped = min(gate_skipped, len(cycles))
    done = _count(len(cycles) - skipped, "rearrangement")
    also = f" and {skipped} skipped by the gate (their unchanged layers committed)" if skipped else ""
    return "pass", f"alive on {n} ranks for {steps} steps; {done} completed{also} ({pace}); {tail}"


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
