"""Run the simulator's ranks, show progress, and write ``report.json`` and ``balancedness.png``.

On one host the ranks are started by the repository's one launcher, :func:`ascend_eplb.launch.run_ranks`
(forkserver: the fork server imports the rank module, and with it vLLM, once; rendezvous a ``file://``
URL in a scratch folder; a deadline over the whole run; a rank that fails is reported with its
traceback and the others get a grace period). Under ``torchrun`` (one process per rank, one or more
hosts) every process runs its rank directly, with rank and world from torchrun's environment, and EP
rank 0 writes the report.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.trace import load_routing_source

__all__ = ["SimulationError", "run_simulation", "under_torchrun"]

_GRACE_S = 15.0
_RANK_MODULE = "ascend_eplb.tools.simulate.rank"


class SimulationError(RuntimeError):
    """A rank raised, exited without a result or missed the deadline (the message has every rank's)."""


def under_torchrun(environ: dict[str, str] | None = None) -> bool:
    """Whether this process was started by ``torchrun`` (its ``TORCHELASTIC_RUN_ID`` is set)."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env


def _prepare(config: SimulateConfig) -> tuple[SimulateConfig, Any]:
    """Resolve the model (a preset is written into the cache the first time) and validate every option
    against it; or, for ``--model replay``, read the routing and validate every option, before anything
    is sampled or started: load to sample from is read, the options (the memory of the sampling and of
    the run included) checked, and only then is the routing sampled from it."""
    from ascend_eplb.tools.simulate.models import resolve_model

    if not config.replays:
        try:
            source = resolve_model(config.model, config.quant_format)
        except ValueError as e:
            raise ValueError(f"invalid simulate options:\n  - {e}") from None
        config = dataclasses.replace(config, quant_format=source.format)
        config.validate_model(source)
        return config, source
    routing = load_routing_source(
        config.trace,
        num_tokens=config.sample_tokens,
        top_k=config.sample_top_k,
        seed=config.seed,
        check=config.validate,
    )
    if config.num_moe_layers is not None:
        routing = routing.prefix(config.num_moe_layers)
    return config, routing


def _rank_args(config: SimulateConfig, routing: Any) -> tuple[dict, dict]:
    cfg = config.to_json() | {
        "padded_size": config.effective_padded_size,
        "trace_name": routing.name,
        # The serving events file (ASCEND_EPLB_EVENTS), written by EP rank 0.
        "events_file": str(Path(config.out_dir).resolve() / "events.jsonl"),
    }
    if not config.replays:
        return cfg | {"model_folder": str(routing.folder)}, {}
    arrays = {
        "topk_ids": routing.topk_ids,
        "topk_weights": routing.topk_weights,
        "seq_offsets": routing.seq_offsets,
        "num_logical_experts": routing.num_logical_experts,
    }
    return cfg, arrays


def _launch(config: SimulateConfig, routing: Any, deadline: float, phase: list[str]) -> list[dict]:
    from ascend_eplb.launch import LauncherInterruptedError, RankFailureError, run_ranks, stop_fork_server
    from ascend_eplb.tools.simulate.lifecycle import (
        SCRATCH_PREFIX,
        DeadlineExceededError,
        release_world_resources,
    )

    # Scratch of this world (rendezvous file, per-rank results and resource records): removed after the
    # run, whatever ends it, with whatever a killed rank left.
    world = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    bar = None
    multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if config.metrics:
        # prometheus_client picks its multiprocess mode when the fork server imports vLLM: that server
        # starts with the folder in its environment (and a later one of this process as before).
        stop_fork_server()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(world / "prometheus")
        (world / "prometheus").mkdir()
    try:
        phase[0] = "importing vLLM in the launcher"
        from ascend_eplb.tools.simulate.rank import simulate_rank

        cfg, arrays = _rank_args(config, routing)
        cfg["record_resources"] = True
        if config.progress:
            from tqdm import tqdm

            bar = tqdm(total=config.steps, desc="simulate", unit="step", file=sys.stderr)

        def on_message(rank: int, message: Any) -> None:
            phase[0] = "running the ranks"
            _, step, rearrangements, bal = message
            if bar is not None and rank == 0:
                bar.n = step + 1
                bar.set_postfix(rearrangements=rearrangements, balancedness=f"{bal:.3f}", refresh=False)
                bar.refresh()

        phase[0] = "starting the ranks (the fork server imports vLLM)"
        results = run_ranks(
            simulate_rank,
            world_size=config.num_ranks,
            tmp_path=world,
            args=(cfg, arrays),
            timeout_s=max(deadline - time.monotonic(), 0.001),
            grace_s=_GRACE_S,
            preload=[_RANK_MODULE],
            on_message=on_message,
        )
        if config.metrics:
            _write_scrape(world / "prometheus", Path(config.out_dir) / "metrics.prom")
        return results
    except RankFailureError as e:
        lines = ["simulation failed:"]
        for rank in sorted(e.reports):
            code, detail = e.reports[rank]
            if code == 0:
                continue
            if code is None:
                lines.append(
                    f"--- rank {rank}: still running at the deadline ({config.timeout_s:.0f} s); killed"
                )
            elif detail.startswith("exited with code"):
                lines.append(f"--- rank {rank}: {detail}")
            else:
                lines.append(f"--- rank {rank}: raised\n{detail.rstrip()}")
        raise SimulationError("\n".join(lines)) from None
    except (DeadlineExceededError, LauncherInterruptedError, KeyboardInterrupt) as e:
        # The fork server may still be importing vLLM, with rank starts queued: end it and every rank.
        stop_fork_server(kill=True)
        if isinstance(e, DeadlineExceededError):
            raise SimulationError(str(e)) from None
        raise
    finally:
        if bar is not None:
            bar.close()
        if config.metrics:
            stop_fork_server()
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            if multiproc_dir is not None:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
        release_world_resources(world)
        shutil.rmtree(world, ignore_errors=True)


def _write_scrape(folder: Path, path: Path) -> None:
    """What vLLM's API server's ``/metrics`` serves from ``folder`` (prometheus_client's
    ``MultiProcessCollector``), in the Prometheus text format."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    path.write_bytes(generate_latest(registry))


def _run_torchrun(config: SimulateConfig, routing: Any) -> tuple[list[dict], bool]:
    """This process's rank under torchrun: every rank's statistics, and whether this is rank 0."""
    from ascend_eplb.launch import RankContext
    from ascend_eplb.tools.simulate.rank import simulate_rank

    ctx = RankContext.from_torchrun(Path(config.out_dir), config.timeout_s)
    if ctx.world_size != config.num_ranks:
        raise ValueError(
            f"invalid simulate options:\n  - ranks={config.num_ranks}: torchrun started "
            f"{ctx.world_size} processes (WORLD_SIZE); pass --ranks {ctx.world_size}"
        )
    cfg, arrays = _rank_args(config, routing)
    return simulate_rank(ctx, cfg, arrays, gather=True), ctx.rank == 0


def _report(config: SimulateConfig, routing: Any, results: list[dict], wall_s: float) -> dict:
    from ascend_eplb.tools.simulate.config import CHECKS, OUTPUT_ATOL

    r0 = results[0]
    bal = r0["balancedness_per_step"]
    commit_steps = [i for i, c in enumerate(r0["commits_per_step"]) if c]
    rearr = r0["rearrangements_per_step"]
    first_rearr = next((i for i, n in enumerate(rearr) if n > 0), None)
    # A rearrangement is complete when its last MoE layer commits (upstream commits layers in order).
    completed = [i for i, c in enumerate(r0["commits_per_step"]) if routing.num_moe_layers - 1 in c]
    bal_off = r0["balancedness_off_per_step"]
    before = bal[: first_rearr + 1] if first_rearr is not None else bal
    # From the first completed rearrangement on, routing runs on placements EPLB chose.
    after = bal[completed[0] + 1 :] if completed else []
    off_after = bal_off[completed[0] + 1 :] if completed else []
    received = [int(res["bytes_moved"]) for res in results]  # per rank, toy sizes
    busiest_experts = max(received) // r0["expert_nbytes"] if r0["expert_nbytes"] else 0
    violations = [res["violation"] for res in results if res["violation"] is not None]
    verdicts = _verdicts(config, routing, results, violations)
    verdict = _run_verdict(verdicts)
    secs = np.array(r0["step_seconds"])
    in_flight = np.array(r0["step_in_flight"], dtype=bool)
    layers_committed = sum(len(c) for c in r0["commits_per_step"])
    return {
        "ranks": config.num_ranks,
        "model": routing.architecture if not config.replays else "replay",
        "format": config.quant_format,
        "trace": routing.name,
        "layers": routing.num_moe_layers,
        "num_logical_experts": routing.num_logical_experts,
        "num_redundant_experts": config.num_redundant_experts,
        "top_k": routing.top_k,
        "batch_size": config.batch_size,
        "padded_size": config.effective_padded_size,
        "window_size": config.window_size,
        "step_interval": config.step_interval,
        "load_collection_phase": config.load_collection_phase,
        "steps": r0["steps_run"],
        "rearrangements": r0["num_rearrangements"],
        "rearrangements_completed": len(completed),
        "layers_committed": layers_committed,
        "balancedness_before": float(np.mean(before)) if before else None,
        "balancedness_after": float(np.mean(after)) if after else None,
        "balancedness_off_after": float(np.mean(off_after)) if off_after else None,
        "balancedness_off_mean": float(np.mean(bal_off)) if bal_off else None,
        "balancedness_per_step": bal,
        "balancedness_off_per_step": bal_off,
        "rank_load_share_per_step": r0["rank_load_share_per_step"],
        "commit_completed_steps": completed,
        "bytes_moved": int(sum(received)),
        "bytes_received_per_rank": received,
        "busiest_rank_experts_received": int(busiest_experts),
        "costs": _costs(config, routing, int(busiest_experts), len(completed) or r0["num_rearrangements"]),
        "out_dir": str(Path(config.out_dir).resolve()),
        "commit_seconds": [float(secs[i]) for i in commit_steps],
        "step_seconds_p50": float(np.percentile(secs, 50)),
        "step_seconds_p99": float(np.percentile(secs, 99)),
        "step_seconds_p50_in_flight": float(np.percentile(secs[in_flight], 50)) if in_flight.any() else None,
        "step_seconds_p50_idle": float(np.percentile(secs[~in_flight], 50)) if (~in_flight).any() else None,
        # CPU seconds one step costs the whole world (sum over ranks of each rank's median): what the
        # step needs from the machine whatever else runs on it; wall / this = cores the world got.
        "world_cpu_seconds_per_step_p50": float(
            sum(np.percentile(res["step_cpu_seconds"], 50) for res in results)
        ),
        # The serving verifier's own time per step (its checks at each commit and its collective at the
        # step boundary after one), measured inside the same steps: the cost of ASCEND_EPLB_VERIFY=1.
        "verifier_seconds_per_step_p50": float(np.percentile(r0["verifier_seconds"], 50)),
        "verifier_seconds_per_step_mean": float(np.mean(r0["verifier_seconds"])),
        "step_seconds_p50_without_verifier": float(
            np.percentile(secs - np.array(r0["verifier_seconds"]), 50)
        ),
        "max_output_error": max(res["max_output_error"] for res in results),
        "output_tolerance": {"rtol": config.outputs_rtol, "atol": OUTPUT_ATOL},
        # True passed, False failed, None not judged; ``check_evidence``: what each check saw, or why not.
        "checks": {name: _JUDGED[verdicts[name][0]] for name in CHECKS},
        "check_evidence": {name: verdicts[name][1] for name in CHECKS},
        "first_violation": violations[0][1] if violations else None,
        "worker_failure": r0["worker_failure"],
        "in_flight_at_end": [cycle for res in results for cycle in res["in_flight_at_end"]],
        "verdict": verdict,
        "passed": verdict == PASSED,
        "wall_seconds": wall_s,
        "config": config.to_json(),
    }


#: A run's verdicts: every check passed; a check failed; none failed but one could not be judged.
PASSED, FAILED, NOT_JUDGED = "passed", "failed", "not judged"
_JUDGED = {"pass": True, "fail": False, "not judged": None}


def _run_verdict(verdicts: dict[str, tuple[str, str]]) -> str:
    outcomes = {outcome for outcome, _ in verdicts.values()}
    return FAILED if "fail" in outcomes else NOT_JUDGED if "not judged" in outcomes else PASSED


def _cycles(results: list[dict], num_moe_layers: int) -> list[list[int]]:
    """Each completed rearrangement's progress steps (rank 0's step indices): the step it started in,
    then the step of each layer's commit (upstream commits layers in order, one per step at most; the
    n-th layer 0 commit belongs to the n-th rearrangement started)."""
    r0 = results[0]
    counts = [0, *r0["rearrangements_per_step"]]
    starts = [i for i in range(len(counts) - 1) if counts[i + 1] > counts[i]]
    cycles, current = [], None
    for step, layers in enumerate(r0["commits_per_step"]):
        for layer in layers:
            if layer == 0:
                current = [starts[len(cycles)]]
            if current is not None:
                current.append(step)
                if layer == num_moe_layers - 1:
                    cycles.append(current)
                    current = None
    return cycles


def _verdicts(
    config: SimulateConfig, routing: Any, results: list[dict], violations: list[tuple[str, str]]
) -> dict[str, tuple[str, str]]:
    """``check -> (outcome, what it saw)``, outcome ``pass``, ``fail`` or ``not judged``: a check passes
    only on what it compared, and says what that was."""
    from ascend_eplb.tools.simulate.config import CHECKS, OUTPUT_ATOL

    r0, n = results[0], len(results)
    steps = r0["steps_run"]
    failed = {}
    for check, message in violations:
        failed.setdefault(check, message.split(": ", 1)[-1].splitlines()[0])
    out: dict[str, tuple[str, str]] = {}
    what = "the real rows' logits" if not config.replays else "every layer's outputs for the real tokens"
    worst, rtol = max(res["max_output_error"] for res in results), config.outputs_rtol
    out["outputs"] = (
        "pass",
        f"{steps} steps on {n} ranks: {what} equal the EPLB-off model's (max error {worst:.3g}, "
        f"tolerance {OUTPUT_ATOL:g} + {rtol:g} x max|reference|)",
    )
    recorded = max(res["load_steps_recorded"] for res in results)
    # A real model's ranks check the world's load (all-reduced); replay ranks each check their own rows.
    selections = sum(res["load_selections"] for res in results) if config.replays else r0["load_selections"]
    if recorded:
        rest = (
            "; the other steps recorded nothing, as the window and the phase said" if recorded < steps else ""
        )
        out["load"] = (
            "pass",
            f"{recorded} of {steps} steps recorded load: {selections} real selections, each counted once, "
            f"padding never{rest}",
        )
    else:
        out["load"] = (
            "not judged",
            (
                f"no step of {steps} recorded load (window {config.window_size}, phase "
                f"{config.load_collection_phase}): nothing was compared"
            ),
        )
    commits = min(res["verifier_commits_checked"] for res in results)
    boundaries = min(res["verifier_steps"] for res in results)
    p = r0["slots_per_rank"]
    if commits:
        checked = _count(commits, "layer commit")
        moved = (
            f"{checked} on each of {n} ranks: after each, all {p} local slots hold their logical expert's "
            f"weights ({commits * p * n} slots compared)"
        )
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
    out["worker"] = _worker_verdict(config, routing, results, violations)
    for check, message in failed.items():
        out[check] = ("fail", message)
    assert set(out) == set(CHECKS)
    return {name: out[name] for name in CHECKS}


def _worker_verdict(
    config: SimulateConfig, routing: Any, results: list[dict], violations: list[tuple[str, str]]
) -> tuple[str, str]:
    """The ``worker`` check: the watchdog's decision, then whether EPLB rearranged as the options allow
    and a cycle in flight at the end kept making progress (its last progress, a layer published or
    committed or its start, at most as many steps before the end as a layer took at most in this run's
    completed rearrangements, one when none completed: upstream's fastest pace)."""
    r0, n = results[0], len(results)
    steps, layers = r0["steps_run"], routing.num_moe_layers
    if r0["worker_failure"] is not None:
        return "fail", r0["worker_failure"][0].splitlines()[0]
    if violations and steps < config.steps:
        check, _ = violations[0]
        return "not judged", f"the run stopped after step {steps} of {config.steps} on the {check} violation"
    cycles = _cycles(results, layers)
    gaps = [b - a for cycle in cycles for a, b in itertools.pairwise(cycle)]
    normal = max(gaps, default=1)
    pace = (
        f"a layer took at most {_count(normal, 'step')} in the {len(cycles)} completed"
        if cycles
        else "upstream commits at most one layer per step"
    )
    in_flight = [c for res in results for c in res["in_flight_at_end"]]
    # The cycle progresses as fast as its slowest rank: the most steps any rank went without progress.
    slow = max(in_flight, key=lambda c: c["steps_without_progress"], default=None)
    if slow is not None and slow["steps_without_progress"] > normal:
        idle, idle_s, timeout = (
            slow["steps_without_progress"],
            slow["seconds_without_progress"],
            config.worker_timeout_s,
        )
        judged = (
            f"below --worker-timeout {timeout:g} s: the watchdog could not judge it"
            if idle_s <= timeout
            else f"reaching --worker-timeout {timeout:g} s only after the last step boundary"
        )
        return "not judged", (
            f"rearrangement {slow['rearrangement']} in flight at the end: no layer committed in its last "
            f"{_count(idle, 'step')} ({idle_s:.1f} s; layer {slow['layer']} next, rank {slow['rank']} "
            f"without progress), more than a layer takes ({pace}), {judged}"
        )
    if not cycles:
        if not r0["rearrangements_per_step"] or r0["rearrangements_per_step"][-1] == 0:
            skipped = r0["num_skipped_rearrangements"]
            if skipped:
                return "not judged", (
                    f"no rearrangement started in {steps} steps: {skipped} skipped on a load window with no "
                    f"load (phase {config.load_collection_phase}); run more steps"
                )
        return "fail", (
            f"no rearrangement completed in {steps} steps; the options complete the first by step "
            f"{config.min_steps(layers)} at upstream's fastest pace"
        )
    if slow is not None:
        idle = slow["steps_without_progress"]
        progressed = "in the last step" if idle == 0 else f"{_count(idle, 'step')} before the end"
        tail = f"rearrangement {slow['rearrangement']} in flight at the end progressed {progressed}"
    else:
        tail = "none in flight at the end"
    done = _count(len(cycles), "rearrangement")
    return "pass", f"alive on {n} ranks for {steps} steps; {done} completed ({pace}); {tail}"


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _costs(config: SimulateConfig, routing: Any, busiest_experts: int, rearrangements: int) -> dict | None:
    """With ``--model-config``: the costs at the model's size (:mod:`ascend_eplb.tools.costs`); the
    busiest rank's experts received per rearrangement are the simulated ones per simulated layer,
    scaled to the model's MoE layers."""
    if config.model_config is None:
        return None
    from ascend_eplb.tools.costs import estimate_costs, read_model_size

    model = read_model_size(config.model_config)
    per_layer = busiest_experts / max(rearrangements, 1) / routing.num_moe_layers if busiest_experts else None
    c = estimate_costs(
        model,
        config.quant_format,
        num_ranks=config.num_ranks,
        num_redundant_experts=config.num_redundant_experts,
        link_gbps=config.link_gbps,
        busiest_rank_experts_per_layer=per_layer,
    )
    return {"model": model.source, "num_moe_layers": model.num_moe_layers, **c.to_json()}


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    steps = np.arange(len(report["balancedness_per_step"]))
    ax1.plot(steps, report["balancedness_per_step"], lw=1.2, label="EPLB on")
    ax1.plot(steps, report["balancedness_off_per_step"], lw=1, ls="--", color="gray",
             label="EPLB off (initial placement, same tokens)")  # fmt: skip
    ax1.set_ylabel("balancedness (mean/max per layer, layer mean)")
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
    ax2.set_ylabel("rank's share of a layer's load (layer mean)")
    ax2.set_xlabel("step")
    ax2.legend(loc="upper right", fontsize=7, ncol=2)
    fig.suptitle(f"ascend-eplb simulate: {report['ranks']} ranks, {report['format']}, {report['trace']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _summary(report: dict) -> str:
    from ascend_eplb.tools.costs import format_bytes
    from ascend_eplb.tools.simulate.config import CHECK_DESCRIPTIONS

    def f(x: float | None, spec: str = ".4f") -> str:
        return "n/a" if x is None else format(x, spec)

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000.0:.1f}"

    commit_mean = float(np.mean(report["commit_seconds"])) if report["commit_seconds"] else None
    bal_before, bal_after = f(report["balancedness_before"]), f(report["balancedness_after"])
    served = (
        f"trace {report['trace']}"
        if report["model"] == "replay"
        else f"{report['model']} ({report['trace']}, vLLM's model class, TP={report['ranks']} x "
        f"EP={report['ranks']})"
    )
    lines = [
        f"ascend-eplb simulate: {report['ranks']} ranks, {report['format']}, {report['layers']} layers x "
        f"{report['num_logical_experts']} experts (+{report['num_redundant_experts']} redundant), top-"
        f"{report['top_k']}, {served}",
        f"  steps {report['steps']}, rearrangements {report['rearrangements']} "
        f"({report['rearrangements_completed']} completed), layers committed "
        f"{report['layers_committed']}, bytes moved {report['bytes_moved']}",
        "  balancedness = mean rank load / max rank load of a layer, averaged over layers (1.0 = even)",
        f"  balancedness before the first rearrangement {bal_before} -> after the first completed "
        f"{bal_after}; without EPLB over the same steps {f(report['balancedness_off_after'])} "
        f"(whole run {f(report['balancedness_off_mean'])})",
        f"  step latency p50 {ms(report['step_seconds_p50'])} ms, p99 {ms(report['step_seconds_p99'])} ms "
        f"(p50 with a commit in flight {ms(report['step_seconds_p50_in_flight'])} ms, "
        f"without {ms(report['step_seconds_p50_idle'])} ms)",
        f"  CPU per step, all ranks, p50 {ms(report['world_cpu_seconds_per_step_p50'])} ms",
        f"  serving verifier (ASCEND_EPLB_VERIFY=1) per step p50 "
        f"{ms(report['verifier_seconds_per_step_p50'])} ms, mean "
        f"{ms(report['verifier_seconds_per_step_mean'])} ms (step p50 without it "
        f"{ms(report['step_seconds_p50_without_verifier'])} ms)",
        f"  time per commit step mean {ms(commit_mean)} ms; "
        f"max output error {report['max_output_error']:.3g}",
    ]
    c = report.get("costs")
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
    for name, ok in report["checks"].items():
        lines.append(f"  {label[ok]}  {name:<12} {CHECK_DESCRIPTIONS[name]}")
        lines.append(f"        {'':<12} saw: {report['check_evidence'][name]}")
    scrape = ", metrics.prom" if report["config"].get("metrics") else ""
    lines.append(f"  report.json, balancedness.png, events.jsonl{scrape} in {report['out_dir']}")
    from ascend_eplb.tools import quiet

    if quiet.install():
        lines.append(f"  {quiet.NOTE}")
    verdict = {PASSED: "PASSED", FAILED: "FAILED", NOT_JUDGED: "NOT FULLY JUDGED"}[report["verdict"]]
    unjudged = [name for name, ok in report["checks"].items() if ok is None]
    why = f" ({', '.join(unjudged)} not judged)" if unjudged else ""
    lines.append(f"  {verdict} in {report['wall_seconds']:.1f} s{why}")
    return "\n".join(lines)


def run_simulation(config: SimulateConfig, *, stream=None) -> dict:
    """Validate ``config``, run the world, write ``report.json`` and ``balancedness.png`` to
    ``config.out_dir``, print the summary to ``stream`` (default stdout) and return the report.

    Under ``torchrun`` every process calls this and returns the report; rank 0 alone writes and prints
    it.

    Raises ``ValueError`` listing every bad option (before any process starts or anything in the
    output folder changes) and :class:`SimulationError` when a rank crashed or the deadline passed
    (``timeout_s`` counts from this call: reading the routing, importing vLLM and starting ranks
    included). A failed check is not an exception: the report has ``passed == False`` and names the
    first violation. Once the options are valid, an earlier ``report.json``, ``balancedness.png`` and
    ``events.jsonl`` in the output folder are removed before the run starts, so a run that ends without
    a report leaves none behind.
    """
    t0 = time.perf_counter()
    deadline = time.monotonic() + config.timeout_s
    if under_torchrun():
        return _run_under_torchrun(config, t0, stream)
    from ascend_eplb.tools.simulate.lifecycle import DeadlineExceededError, deadline_alarm

    phase = ["reading the routing"]
    try:
        with deadline_alarm(deadline, config.timeout_s, phase):
            config, routing = _prepare(config)
            out = _output_folder(config)
            # A run that ends without a report leaves no earlier run's report, plot or events behind.
            _remove_outputs(out)
            try:
                results = _launch(config, routing, deadline, phase)
            except SimulationError:
                # A run without a report leaves no partial events either (a crashed rank's run may
                # have recorded some windows before it ended): the output folder is as before the run.
                _remove_outputs(out)
                raise
    except DeadlineExceededError as e:  # before the launch (reading or sampling the routing)
        raise SimulationError(str(e)) from None
    return _write(config, routing, results, t0, out, stream)


#: What a run writes into its output folder (and removes, from an earlier run, before it starts).
_OUTPUTS = ("report.json", "balancedness.png", "events.jsonl", "metrics.prom")


def _remove_outputs(out: Path) -> None:
    for name in _OUTPUTS:
        (out / name).unlink(missing_ok=True)


def _output_folder(config: SimulateConfig) -> Path:
    out = Path(config.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"invalid simulate options:\n  - out={config.out_dir}: cannot write there ({e})"
        ) from e
    for name in _OUTPUTS:
        if (out / name).exists() and not (out / name).is_file():
            raise ValueError(
                f"invalid simulate options:\n  - out={config.out_dir}: {out / name} is not a file; the "
                "run writes a file there"
            )
    return out


def _run_under_torchrun(config: SimulateConfig, t0: float, stream: Any) -> dict:
    if config.metrics:
        raise ValueError(
            "invalid simulate options:\n  - metrics: not under torchrun (set ASCEND_EPLB_METRICS=1 and "
            "PROMETHEUS_MULTIPROC_DIR in torchrun's environment instead)"
        )
    config, routing = _prepare(config)
    out = _output_folder(config)
    if int(os.environ.get("RANK", "0")) == 0:
        _remove_outputs(out)  # rank 0 writes them; the others start after torchrun's rendezvous
    results, writer = _run_torchrun(config, routing)
    if not writer:
        return _report(config, routing, results, time.perf_counter() - t0)
    return _write(config, routing, results, t0, out, stream)


def _write(
    config: SimulateConfig, routing: Any, results: list[dict], t0: float, out: Path, stream: Any
) -> dict:
    report = _report(config, routing, results, time.perf_counter() - t0)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(report, out / "balancedness.png")
    print(_summary(report), file=stream or sys.stdout)
    return report
