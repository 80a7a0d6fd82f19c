"""``ascend-eplb simulate``'s entry point: validate, run the ranks, write ``report.json`` and
``balancedness.png``, print the summary.

:func:`run_simulation` resolves the model (or reads the routing) and validates every option before
anything starts, then runs the world (:mod:`~ascend_eplb.tools.simulate.launching`: the launcher on one
host, or this process's rank under ``torchrun``), builds the report
(:mod:`~ascend_eplb.tools.simulate.report`, with the checks' verdicts of
:mod:`~ascend_eplb.tools.simulate.verdicts`), plots it (:mod:`~ascend_eplb.tools.simulate.plot`) and
prints its summary (:mod:`~ascend_eplb.tools.simulate.summary`). Under ``torchrun`` EP rank 0 writes
the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ascend_eplb.integration.regular_files import write_regular_file
from ascend_eplb.tools.simulate.config import RUN_OUTPUTS, SimulateConfig
from ascend_eplb.tools.simulate.engine_run import EngineRun, run_engines
from ascend_eplb.tools.simulate.launching import SimulationError, launch_ranks, run_torchrun_rank
from ascend_eplb.tools.simulate.lifecycle import (
    DeadlineExceededError,
    RunPhase,
    deadline_alarm,
    own_output_folder,
)
from ascend_eplb.tools.simulate.models import resolve_model
from ascend_eplb.tools.simulate.plot import plot_balancedness
from ascend_eplb.tools.simulate.report import SimulateReport, build_report
from ascend_eplb.tools.simulate.stats import RankStats
from ascend_eplb.tools.simulate.summary import summary_text
from ascend_eplb.tools.trace import load_routing_source
from ascend_eplb.world.engine.host import EngineError

__all__ = ["SimulationError", "run_simulation", "under_torchrun"]


def under_torchrun(environ: dict[str, str] | None = None) -> bool:
    """Whether this process was started by ``torchrun`` (its ``TORCHELASTIC_RUN_ID`` is set)."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env


def _prepare(config: SimulateConfig) -> tuple[SimulateConfig, Any]:
    """Resolve the model (a preset is written into the cache the first time) and validate every option
    against it; or, for ``--model replay``, read the routing and validate every option, before anything
    is sampled or started: load to sample from is read, the options (the memory of the sampling and of
    the run included) checked, and only then is the routing sampled from it."""

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


def run_simulation(config: SimulateConfig, *, stream=None) -> SimulateReport:
    """Validate ``config``, run the world, write ``report.json`` (the report's ``to_json()``) and
    ``balancedness.png`` to ``config.out_dir``, print the summary to ``stream`` (default stdout) and return
    the report. Under ``torchrun`` every process returns it; rank 0 alone writes and prints it.

    The run owns the output folder (:func:`~ascend_eplb.tools.simulate.lifecycle.own_output_folder`) from
    validation to the report: an earlier run's files there are removed before the ranks start, and a run
    that ends without its report removes what it wrote, so the folder holds one run's files or none.

    Raises:
        ValueError: every bad option (before any process starts or the folder changes), the live run
            owning the folder, or the serving path's refusal on the ranks
            (:class:`~ascend_eplb.tools.simulate.launching.StartupRefusedError`).
        SimulationError: a rank crashed or the deadline passed (``timeout_s`` counts from this call).

    A failed check is not an exception: the report has ``passed == False`` and names the first violation.
    """
    t0 = time.perf_counter()
    deadline = time.monotonic() + config.timeout_s
    if under_torchrun():
        return _run_under_torchrun(config, t0, stream)

    phase = RunPhase("reading the routing")
    with contextlib.ExitStack() as owned:
        try:
            with deadline_alarm(deadline, config.timeout_s, phase):
                config, routing = _prepare(config)
                out = _output_folder(config)
                owned.enter_context(own_output_folder(out))
                with _one_runs_outputs(out):
                    if config.replays:
                        results, engines = launch_ranks(config, routing, deadline, phase), None
                    else:
                        run = _run_engines(config, routing, deadline, phase)
                        results, engines = run.results, run
        except DeadlineExceededError as e:  # before the launch (reading or sampling the routing)
            raise SimulationError(str(e)) from None
        with _one_runs_outputs(out, remove_earlier=False):
            report = _write(config, routing, results, t0, out, engines)
    print(summary_text(report), file=stream or sys.stdout)
    return report


def _remove_outputs(out: Path) -> None:
    for name in RUN_OUTPUTS:
        (out / name).unlink(missing_ok=True)


@contextlib.contextmanager
def _one_runs_outputs(out: Path, *, remove_earlier: bool = True) -> Iterator[None]:
    """Inside, the run writes its outputs into ``out`` (which it owns): an earlier run's are removed
    first (``remove_earlier``), and if the run ends inside without its report (any error or signal),
    what it wrote is removed too (a crashed rank's run may have recorded some windows)."""
    if remove_earlier:
        _remove_outputs(out)
    try:
        yield
    except BaseException:
        _remove_outputs(out)
        raise


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
    for name in RUN_OUTPUTS:
        if (out / name).exists() and not (out / name).is_file():
            raise ValueError(
                f"invalid simulate options:\n  - out={config.out_dir}: {out / name} is not a file; the "
                "run writes a file there"
            )
    return out


def _run_under_torchrun(config: SimulateConfig, t0: float, stream: Any) -> SimulateReport:
    if not config.replays:
        raise ValueError(
            "invalid simulate options:\n  - model: a real model runs on vLLM's engine, which starts its own "
            "worker processes: run simulate without torchrun (torchrun runs --model replay)"
        )
    if config.metrics:
        raise ValueError(
            "invalid simulate options:\n  - metrics: not under torchrun (set ASCEND_EPLB_METRICS=1 and "
            "PROMETHEUS_MULTIPROC_DIR in torchrun's environment instead)"
        )

    config, routing = _prepare(config)
    out = _output_folder(config)
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 owns the folder and writes it
        results, _ = run_torchrun_rank(config, routing)
        return build_report(config, routing, results, time.perf_counter() - t0)
    with own_output_folder(out), _one_runs_outputs(out):
        results, _ = run_torchrun_rank(config, routing)
        report = _write(config, routing, results, t0, out)
    print(summary_text(report), file=stream or sys.stdout)
    return report


def _run_engines(config: SimulateConfig, source: Any, deadline: float, phase: RunPhase) -> EngineRun:
    """The real model on vLLM's engine (:mod:`~ascend_eplb.tools.simulate.engine_run`); an engine's failure
    is the run's (:class:`SimulationError`, naming the cause)."""
    try:
        return run_engines(config, source.folder, source.vocab_size, deadline, phase)
    except EngineError as e:
        raise SimulationError(f"simulation failed: {e}") from None


def _write(
    config: SimulateConfig,
    routing: Any,
    results: list[RankStats],
    t0: float,
    out: Path,
    engines: EngineRun | None = None,
) -> SimulateReport:
    report = build_report(config, routing, results, time.perf_counter() - t0, engines)
    write_regular_file(out / "report.json", json.dumps(report.to_json(), indent=1).encode())
    plot_balancedness(report, out / "balancedness.png")
    return report
