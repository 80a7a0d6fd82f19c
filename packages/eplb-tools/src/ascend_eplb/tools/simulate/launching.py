"""Start the simulator's ranks and collect what each returns.

On one host the ranks are started by the repository's one launcher, :func:`ascend_eplb.launch.run_ranks`
(forkserver: the fork server imports the rank module, and with it vLLM, once; rendezvous a ``file://``
URL in a scratch folder; a deadline over the whole run; a rank that fails is reported with its
traceback and the others get a grace period): :func:`launch_ranks`. Under ``torchrun`` (one process per
rank, one or more hosts) every process runs its rank directly, with rank and world from torchrun's
environment: :func:`run_torchrun_rank`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ascend_eplb.launch import (
    LauncherInterruptedError,
    RankContext,
    RankFailureError,
    run_ranks,
    stop_fork_server,
)
from ascend_eplb.tools.simulate.checks import OUTPUT_ATOL
from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.simulate.entry import simulate_rank  # imports vLLM only when a rank calls it
from ascend_eplb.tools.simulate.lifecycle import (
    SCRATCH_PREFIX,
    DeadlineExceededError,
    RunPhase,
    read_refusals,
    release_world_resources,
)
from ascend_eplb.tools.simulate.progress import Progress
from ascend_eplb.tools.simulate.stats import OutputTolerance, RankConfig, RankStats

__all__ = ["SimulationError", "StartupRefusedError", "launch_ranks", "run_torchrun_rank", "write_scrape"]

_GRACE_S = 15.0

_RANK_MODULE = "ascend_eplb.tools.simulate.rank"


class SimulationError(RuntimeError):
    """A rank raised, exited without a result or missed the deadline (the message has every rank's)."""


#: Where a refusal on the ranks comes from, and where the same rules are judged before a start.
_WHERE = (
    "the serving path's own checks, some of which read vLLM's model class: only the ranks import vLLM; "
    "`ascend-eplb check` judges the same rules without starting anything"
)


class StartupRefusedError(ValueError):
    """The serving path's start-up on the ranks refused the run: its validation (the rules ``ascend-eplb
    check`` runs) or its placement file's reader, on a fact only the ranks have (vLLM's model class,
    which the launcher does not import). A ``ValueError``: the command prints it as a refusal (exit 2),
    once, not as each rank's traceback.

    Attributes:
        refusals: rank -> its refusal's message (the ranks that refused).
    """

    def __init__(self, refusals: dict[int, str], num_ranks: int) -> None:
        self.refusals = refusals
        messages = set(refusals.values())
        if len(messages) == 1:
            who = "every rank" if len(refusals) == num_ranks else f"rank(s) {', '.join(map(str, refusals))}"
            text = f"refused at start-up on {who} ({_WHERE}):\n{messages.pop()}"
        else:
            text = f"refused at start-up ({_WHERE}):\n" + "\n".join(
                f"--- rank {rank}: {message}" for rank, message in refusals.items()
            )
        super().__init__(text)


def _rank_args(
    config: SimulateConfig, routing: Any, *, record_resources: bool = False
) -> tuple[RankConfig, dict]:
    cfg = RankConfig(
        options=config,
        padded_size=config.effective_padded_size,
        trace_name=routing.name,
        events_file=str(Path(config.out_dir).resolve() / "events.jsonl"),
        output_tolerance=OutputTolerance(config.outputs_rtol, OUTPUT_ATOL),
        model_folder=None if config.replays else str(routing.folder),
        record_resources=record_resources,
        compilation=config.compilation,
    )
    if not config.replays:
        return cfg, {}
    arrays = {
        "topk_ids": routing.topk_ids,
        "topk_weights": routing.topk_weights,
        "seq_offsets": routing.seq_offsets,
        "num_logical_experts": routing.num_logical_experts,
    }
    return cfg, arrays


def launch_ranks(config: SimulateConfig, routing: Any, deadline: float, phase: RunPhase) -> list[RankStats]:
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
        cfg, arrays = _rank_args(config, routing, record_resources=True)
        if config.progress:
            bar = Progress(config.steps)  # start-up its own phase, then the steps

        def on_message(rank: int, message: Any) -> None:
            phase.what = "running the ranks"
            _, step, rearrangements, bal = message
            if bar is not None and rank == 0:
                bar.step(step, rearrangements, bal)

        phase.what = "starting the ranks (the fork server imports vLLM)"
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
            write_scrape(world / "prometheus", Path(config.out_dir) / "metrics.prom")
        return results
    except RankFailureError as e:
        if refusals := read_refusals(world):
            raise StartupRefusedError(refusals, config.num_ranks) from None
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


def write_scrape(folder: Path, path: Path) -> None:
    """What vLLM's API server's ``/metrics`` serves from ``folder`` (prometheus_client's
    ``MultiProcessCollector``), in the Prometheus text format."""
    # local: prometheus_client fixes its value class from PROMETHEUS_MULTIPROC_DIR when first imported
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    path.write_bytes(generate_latest(registry))


def run_torchrun_rank(config: SimulateConfig, routing: Any) -> tuple[list[RankStats], bool]:
    """This process's rank under torchrun: every rank's statistics, and whether this is rank 0."""
    ctx = RankContext.from_torchrun(Path(config.out_dir), config.timeout_s)
    if ctx.world_size != config.num_ranks:
        raise ValueError(
            f"invalid simulate options:\n  - ranks={config.num_ranks}: torchrun started "
            f"{ctx.world_size} processes (WORLD_SIZE); pass --ranks {ctx.world_size}"
        )
    cfg, arrays = _rank_args(config, routing)
    return simulate_rank(ctx, cfg, arrays, gather=True), ctx.rank == 0
