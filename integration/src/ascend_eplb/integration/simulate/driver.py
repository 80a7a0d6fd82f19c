"""Launch the simulator's rank processes, show progress, and write ``report.json`` and ``balancedness.png``.

Ranks start with ``multiprocessing``'s ``forkserver`` method; the fork server imports the rank module
(and with it vLLM, about 12 s) once, so the ranks themselves start in well under a second. Rendezvous is
a ``file://`` URL in the output folder (never a fixed port). The whole world has a deadline
(``SimulateConfig.timeout_s``); a rank that raises is reported with its traceback and the others get a
grace period before they are killed.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue as queue_mod
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ascend_eplb.integration.simulate.config import SimulateConfig
from ascend_eplb.integration.trace import load_routing_source

__all__ = ["RANK_ENV", "SimulationError", "run_simulation"]

RANK_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
}
_GRACE_S = 15.0


class SimulationError(RuntimeError):
    """A rank raised, exited without a result or missed the deadline (the message has every rank's)."""


def _prepare(config: SimulateConfig) -> tuple[SimulateConfig, Any]:
    routing = load_routing_source(
        config.trace, num_tokens=config.sample_tokens, top_k=config.sample_top_k, seed=config.seed
    )
    config.validate(
        num_trace_layers=routing.num_layers,
        num_logical_experts=routing.num_logical_experts,
        top_k=routing.top_k,
    )
    if config.num_layers is not None:
        routing = routing.prefix(config.num_layers)
    return config, routing


def _launch(config: SimulateConfig, routing: Any) -> list[dict]:
    # Scratch of this world (trace copy, rendezvous file, per-rank results): removed after the run, so
    # only report.json and the plot are left in the output folder.
    world = Path(tempfile.mkdtemp(prefix="ascend-eplb-simulate-"))
    try:
        return _launch_in(config, routing, world)
    finally:
        shutil.rmtree(world, ignore_errors=True)


def _launch_in(config: SimulateConfig, routing: Any, world: Path) -> list[dict]:
    trace_file = world / "trace.npz"
    np.savez(
        trace_file,
        topk_ids=routing.topk_ids,
        topk_weights=routing.topk_weights,
        seq_offsets=routing.seq_offsets,
        num_logical_experts=np.array(routing.num_logical_experts),
    )
    cfg = config.to_json() | {"padded_size": config.effective_padded_size, "trace_name": routing.name}
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)
    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(["ascend_eplb.integration.simulate.rank"])
    progress_queue = mp.Queue()
    procs = [
        mp.Process(
            target=_rank_entry,
            args=(
                r,
                config.num_ranks,
                f"file://{world / 'rendezvous'}",
                cfg,
                str(trace_file),
                str(world),
                progress_queue if r == 0 else None,
            ),
            name=f"eplb-sim-rank{r}",
            daemon=True,
        )
        for r in range(config.num_ranks)
    ]
    for p in procs:
        p.start()
    bar = None
    if config.progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, desc="simulate", unit="step", file=sys.stderr)
    deadline = time.monotonic() + config.timeout_s
    failed_at: float | None = None
    try:
        while any(p.exitcode is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            limit = deadline if failed_at is None else min(deadline, failed_at + _GRACE_S)
            if now >= limit:
                break
            try:
                _, step, rearr, bal = progress_queue.get(timeout=0.2)
                if bar is not None:
                    bar.n = step + 1
                    bar.set_postfix(rearrangements=rearr, balancedness=f"{bal:.3f}", refresh=False)
                    bar.refresh()
            except queue_mod.Empty:
                pass
    finally:
        if bar is not None:
            bar.close()
    results, errors = [], []
    for r, p in enumerate(procs):
        if p.exitcode is None:
            p.kill()
            p.join(5)
            errors.append(f"--- rank {r}: still running at the deadline ({config.timeout_s:.0f} s); killed")
            continue
        p.join()
        path = world / f"rank{r}.pkl"
        if not path.exists():
            errors.append(f"--- rank {r}: exited with code {p.exitcode} without a result")
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            errors.append(f"--- rank {r}: raised\n{value.rstrip()}")
        else:
            results.append(value)
    if errors:
        raise SimulationError("simulation failed:\n" + "\n".join(errors))
    return results


def _rank_entry(*args: Any) -> None:
    """Rank process target. Importing the rank module (and vLLM) happens in the fork server, which
    preloads it, never in the launching process."""
    from ascend_eplb.integration.simulate.rank import rank_main

    rank_main(*args)


def _report(config: SimulateConfig, routing: Any, results: list[dict], wall_s: float) -> dict:
    from ascend_eplb.integration.simulate.config import CHECKS, OUTPUT_ATOL, OUTPUT_RTOL

    r0 = results[0]
    bal = r0["balancedness_per_step"]
    commit_steps = [i for i, c in enumerate(r0["commits_per_step"]) if c]
    rearr = r0["rearrangements_per_step"]
    first_rearr = next((i for i, n in enumerate(rearr) if n > 0), None)
    # A rearrangement is complete when its last MoE layer commits (upstream commits layers in order).
    completed = [i for i, c in enumerate(r0["commits_per_step"]) if routing.num_layers - 1 in c]
    before = bal[: first_rearr + 1] if first_rearr is not None else bal
    after = bal[completed[-1] + 1 :] if completed else []
    violations = [res["violation"] for res in results if res["violation"] is not None]
    failed = {v[0] for v in violations}
    secs = np.array(r0["step_seconds"])
    in_flight = np.array(r0["step_in_flight"], dtype=bool)
    layers_committed = sum(len(c) for c in r0["commits_per_step"])
    return {
        "ranks": config.num_ranks,
        "format": config.quant_format,
        "trace": routing.name,
        "layers": routing.num_layers,
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
        "balancedness_per_step": bal,
        "rank_load_per_step": r0["rank_load_per_step"],
        "bytes_moved": int(sum(res["bytes_moved"] for res in results)),
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
        "max_output_error": max(res["max_output_error"] for res in results),
        "output_tolerance": {"rtol": OUTPUT_RTOL, "atol": OUTPUT_ATOL},
        "checks": {name: name not in failed for name in CHECKS},
        "first_violation": violations[0][1] if violations else None,
        "passed": not violations,
        "wall_seconds": wall_s,
        "config": config.to_json(),
    }


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    steps = np.arange(len(report["balancedness_per_step"]))
    ax1.plot(steps, report["balancedness_per_step"], lw=1)
    ax1.set_ylabel("balancedness (mean/max)")
    ax1.set_ylim(0, 1.05)
    loads = np.array(report["rank_load_per_step"])
    for r in range(loads.shape[1]):
        ax2.plot(steps, loads[:, r], lw=0.8, label=f"rank {r}")
    ax2.set_ylabel("selections per rank")
    ax2.set_xlabel("step")
    ax2.legend(loc="upper right", fontsize=7)
    fig.suptitle(f"ascend-eplb simulate: {report['ranks']} ranks, {report['format']}, {report['trace']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _summary(report: dict) -> str:
    def f(x: float | None, spec: str = ".4f") -> str:
        return "n/a" if x is None else format(x, spec)

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000.0:.1f}"

    commit_mean = float(np.mean(report["commit_seconds"])) if report["commit_seconds"] else None
    bal_before, bal_after = f(report["balancedness_before"]), f(report["balancedness_after"])
    lines = [
        f"ascend-eplb simulate: {report['ranks']} ranks, {report['format']}, {report['layers']} layers x "
        f"{report['num_logical_experts']} experts (+{report['num_redundant_experts']} redundant), top-"
        f"{report['top_k']}, trace {report['trace']}",
        f"  steps {report['steps']}, rearrangements {report['rearrangements']} "
        f"({report['rearrangements_completed']} completed), layers committed "
        f"{report['layers_committed']}, bytes moved {report['bytes_moved']}",
        f"  balancedness before the first rearrangement {bal_before} -> after the last completed {bal_after}",
        f"  step latency p50 {ms(report['step_seconds_p50'])} ms, p99 {ms(report['step_seconds_p99'])} ms "
        f"(p50 with a commit in flight {ms(report['step_seconds_p50_in_flight'])} ms, "
        f"without {ms(report['step_seconds_p50_idle'])} ms)",
        f"  CPU per step, all ranks, p50 {ms(report['world_cpu_seconds_per_step_p50'])} ms",
        f"  time per commit step mean {ms(commit_mean)} ms; "
        f"max output error {report['max_output_error']:.3g}",
    ]
    lines += [f"  {'PASS' if ok else 'FAIL'}  {name}" for name, ok in report["checks"].items()]
    if report["first_violation"]:
        lines.append(f"  first violation: {report['first_violation']}")
    lines.append(f"  {'PASSED' if report['passed'] else 'FAILED'} in {report['wall_seconds']:.1f} s")
    return "\n".join(lines)


def run_simulation(config: SimulateConfig, *, stream=None) -> dict:
    """Validate ``config``, run the world, write ``report.json`` and ``balancedness.png`` to
    ``config.out_dir``, print the summary to ``stream`` (default stdout) and return the report.

    Raises ``ValueError`` listing every bad option (before any process starts) and
    :class:`SimulationError` when a rank crashed or missed the deadline. A failed check is not an
    exception: the report has ``passed == False`` and names the first violation.
    """
    t0 = time.perf_counter()
    config, routing = _prepare(config)
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
    results = _launch(config, routing)
    report = _report(config, routing, results, time.perf_counter() - t0)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(report, out / "balancedness.png")
    print(_summary(report), file=stream or sys.stdout)
    return report
