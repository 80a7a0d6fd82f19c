"""What both worlds of a simulator rank do at each step's end and at the run's end, and record.

:func:`end_of_run` freezes what a rank accumulated while it ran (``stats.StepLog``) into its
``stats.RankStats`` (what the driver's report reads); :func:`timed_hooks` times the serving verifier's
subscribers; :class:`CommitWatch` hears every layer commit on the controller's bus; :func:`close_step` is
the end of one step (:class:`StepSeen`) the same in both worlds, each of which gives its rank's parts once
(:class:`RankLoop`) (runner point 9, the watchdog and the verifier, the commits,
balancedness and rank shares, the progress message, whether every rank stops). Shape letters (DESIGN.md
section 2): L MoE layers, E logical experts, P physical experts, N EP ranks.
"""

from __future__ import annotations

from ascend_eplb.tools.simulate import cpu_platform as _cpu_platform  # noqa: F401  (before vLLM)

# isort: split

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from vllm.distributed.parallel_state import get_ep_group

from ascend_eplb.control import measures
from ascend_eplb.control.bus import CommitEvent
from ascend_eplb.integration import metrics
from ascend_eplb.integration.runner import Mrv2EplbWiring
from ascend_eplb.integration.serving import guardrails_of
from ascend_eplb.integration.verify import EplbVerificationError, EplbVerifier
from ascend_eplb.integration.watchdog import EplbWorkerFailureError, WorkerWatchdog
from ascend_eplb.launch import RankContext
from ascend_eplb.tools.simulate.lifecycle import record_rank_resources
from ascend_eplb.tools.simulate.stats import InstallSeen, RankConfig, RankStats, StepLog, frozen

__all__ = [
    "CheckViolationError",
    "CommitWatch",
    "RankLoop",
    "StepSeen",
    "VerifierClock",
    "close_step",
    "end_of_run",
    "end_of_step",
    "record_resources",
    "timed_hooks",
]


class CheckViolationError(Exception):
    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check


def record_resources(ctx: RankContext, cfg: RankConfig) -> None:
    if cfg.record_resources:
        record_rank_resources(ctx.tmp_dir, ctx.rank)  # the launcher removes what a killed rank left


@dataclass
class VerifierClock:
    """The serving verifier's seconds in the current step (the world sets ``seconds`` to 0 per step)."""

    seconds: float = 0.0


def timed_hooks(controller: Any) -> tuple[WorkerWatchdog, EplbVerifier, VerifierClock]:
    """Wrap the serving verifier's step and commit subscribers to time them (its cost per step);
    returns the controller's watchdog and verifier (its serving guardrails) and the clock each step's
    verifier seconds accumulate on."""
    guardrails = guardrails_of(controller)
    watchdog, verifier = guardrails.watchdog, guardrails.verifier
    assert verifier is not None  # ASCEND_EPLB_VERIFY=1 here
    clock = VerifierClock()

    def timed(hook):
        def run(*args):
            t = time.perf_counter()
            try:
                hook(*args)
            finally:
                clock.seconds += time.perf_counter() - t

        return run

    controller.bus.wrap(verifier.on_step, timed)
    controller.bus.wrap(verifier.on_commit, timed)
    return watchdog, verifier, clock


class CommitWatch:
    """The MoE layers of one model whose placement committed, heard on the controller's bus: each
    ``"commit"`` :class:`~ascend_eplb.control.bus.CommitEvent` (upstream's commit of one layer returned)
    of ``model_name`` (upstream's name; None: every model's), kept until the step's end drains them. Every
    commit is heard, however many the run has (the state's log of recent commit events keeps only the
    last ``COMMIT_LOG_MAXLEN``)."""

    def __init__(self, bus: Any, model_name: str | None = None) -> None:
        self._layers: set[int] = set()
        self._model_name = model_name
        bus.subscribe(CommitEvent, self._on_commit)

    def _on_commit(self, event: CommitEvent) -> None:
        if event.kind == "commit" and self._model_name in (None, event.model_name):
            self._layers.add(event.layer)

    def drain(self) -> list[int]:
        """The layers committed since the last drain, ascending (each once)."""
        layers, self._layers = sorted(self._layers), set()
        return layers


@dataclass(frozen=True)
class RankLoop:
    """What the end of each step and of the run read of one rank's world, the same for the whole run.

    Attributes:
        ctx: the rank's launcher context (its progress messages, the world size N).
        stats: what the rank accumulates while it runs.
        wiring: the rank's ``Mrv2EplbWiring``; ``state``, ``model_state``: its ``AscendEplbState`` and
            the served (target) model's upstream ``EplbModelState`` (a draft's: ``draft.DraftRun``).
        after_sampling: runner point 9 of the world (upstream's step, then the watchdog and verifier).
        watchdog, verifier: the controller's serving guardrails; ``verifier_seconds``: the
            :class:`VerifierClock` :func:`timed_hooks` adds each step's verifier seconds to.
        commits: the layers of ``model_state``'s model committed, heard on the bus.
        initial_p2l: int64 ``(L, P)``, upstream's initial placement (EPLB off).
        slots_per_rank: p.
    """

    ctx: RankContext
    stats: StepLog
    wiring: Mrv2EplbWiring
    state: Any
    model_state: Any
    after_sampling: Callable[[], Any]
    watchdog: WorkerWatchdog
    verifier: EplbVerifier
    verifier_seconds: VerifierClock
    commits: CommitWatch
    initial_p2l: torch.Tensor
    slots_per_rank: int


@dataclass(frozen=True)
class StepSeen:
    """What one step saw before its end: its index, ``started`` (``time.perf_counter()`` and
    ``time.process_time()`` at its start), ``rank_load`` float ``(L, N)`` (the ranks' routed selections),
    ``logical_load`` int ``(L, E)`` (the routed logical selections) and ``placement`` int64 ``(L, P)``
    (the placement the forward routed with)."""

    step: int
    started: tuple[float, float]
    rank_load: torch.Tensor
    logical_load: torch.Tensor
    placement: torch.Tensor


def close_step(loop: RankLoop, seen: StepSeen, violation: Any) -> tuple[Any, bool]:
    """The end of one step, the same in both worlds: runner point 9 (``loop.after_sampling``: upstream's
    step, then the watchdog and the verifier, which may raise the same error on every rank), the step's
    timings, a worker failure the watchdog decided, the commits, balancedness and rank shares
    (:func:`end_of_step`), the progress message, and whether every rank stops now (one flag all-reduced
    over the EP group).

    Returns:
        ``(violation, stop)``: the first violation so far, and whether the ranks leave the loop.
    """
    stats, state, watchdog = loop.stats, loop.state, loop.watchdog
    in_flight = bool(loop.model_state.rebalanced)
    verified = None
    try:
        loop.after_sampling()
    except EplbVerificationError as e:
        verified = CheckViolationError(e.check, str(e))
    except EplbWorkerFailureError as e:  # ASCEND_EPLB_ON_WORKER_FAILURE=raise, on every rank
        verified = CheckViolationError("worker", str(e))
    stats.step_seconds.append(time.perf_counter() - seen.started[0])
    stats.step_cpu_seconds.append(time.process_time() - seen.started[1])  # this process, all its threads
    stats.verifier_seconds.append(loop.verifier_seconds.seconds)
    stats.step_in_flight.append(in_flight)
    if watchdog.failure is not None and stats.worker_failure is None:
        # EPLB stopped on every rank at this step; serving (and every other check) goes on.
        stats.worker_failure = (watchdog.failure.message(), seen.step)
        violation = violation or CheckViolationError("worker", watchdog.failure.message())
    end_of_step(
        stats, state, loop.commits.drain(), seen.rank_load, seen.logical_load, loop.initial_p2l,
        loop.ctx.world_size, split_placement=seen.placement if state.split_scope != "off" else None,
    )  # fmt: skip
    loop.ctx.send(("step", seen.step, state.num_rearrangements, stats.balancedness_per_step[-1]))
    if verified is not None:
        # Raised on every rank at this same step boundary: all ranks stop here together.
        return violation or verified, True
    stop = violation is not None and violation.check != "worker"
    flag = torch.tensor([int(stop)], dtype=torch.int32)
    dist.all_reduce(flag, group=get_ep_group().cpu_group)
    return violation, int(flag) > 0


def record_initial_placement(stats: StepLog, cfg: RankConfig, slot_mismatches: list[str] | None) -> None:
    """With ``--initial-placement``: what this rank held right after start-up (:class:`InstallSeen`)."""
    if cfg.options.initial_placement:
        stats.install = InstallSeen(slot_mismatches)


def record_first_step_plan(
    stats: StepLog, step: int, logical_load: torch.Tensor, placement: torch.Tensor, num_ranks: int
) -> None:
    """At step 0 with ``--initial-placement``: the mean balancedness ``plan`` predicts for the installed
    ``placement`` ``(L, P)`` on the step's routed ``logical_load`` ``(L, E)`` (each expert's load split
    evenly over its replicas: plan's own measure), to print beside the one measured."""
    if step == 0 and stats.install is not None:
        planned = measures.mean_balancedness(measures.rank_loads(logical_load, placement, num_ranks))
        stats.install.first_step_planned = planned


def end_of_step(
    stats: StepLog, state: Any, committed_layers: list[int], rank_load: torch.Tensor,
    logical_load: torch.Tensor, initial_p2l: torch.Tensor, num_ranks: int, *,
    split_placement: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Record the step's commits (``committed_layers``, from the bus), rearrangements, mean balancedness
    with EPLB (of ``rank_load`` ``(L, N)``: the ranks' routed selections) and without (``logical_load``
    ``(L, E)`` on upstream's initial placement ``initial_p2l``, each expert's load split over its replicas)
    and rank shares; with the batch split on, ``split_placement`` ``(L, P)`` (the placement the step routed
    with): the equal split's balancedness of the same ``logical_load`` on it, beside the executed one. All
    are :func:`ascend_eplb.control.measures.mean_balancedness`: a layer without load counts 1.0."""
    stats.commits_per_step.append(list(committed_layers))
    stats.rearrangements_per_step.append(state.num_rearrangements)
    loads = rank_load.numpy()
    stats.balancedness_per_step.append(measures.mean_balancedness(rank_load))
    # Per-rank share of each layer's selections, averaged over layers (1/N everywhere = balanced).
    stats.rank_load_share_per_step.append(
        (loads / np.maximum(loads.sum(axis=1, keepdims=True), 1)).mean(axis=0).tolist()
    )
    stats.balancedness_off_per_step.append(
        measures.mean_balancedness(measures.rank_loads(logical_load, initial_p2l, num_ranks))
    )
    if split_placement is not None:
        stats.balancedness_equal_split_per_step.append(
            measures.mean_balancedness(measures.rank_loads(logical_load, split_placement, num_ranks))
        )


def end_of_run(loop: RankLoop, violation: Any, *, compilation: str | None = None) -> RankStats:
    """The end of a run, the same in both worlds: the runner's shutdown point (the watchdog logs a cycle
    in flight, :meth:`WorkerWatchdog.at_shutdown`), then this rank's :class:`RankStats` (``compilation``:
    how vLLM ran the model, :attr:`RankStats.compilation`)."""
    loop.wiring.shutdown()
    layout = getattr(loop.wiring.controller, "last_row_layout", None)
    state, model_state = loop.state, loop.model_state
    return RankStats(
        **{f.name: frozen(getattr(loop.stats, f.name)) for f in fields(StepLog)},
        moe_rows=None if layout is None else layout.rows,
        compilation=compilation,
        violation=None if violation is None else (violation.check, str(violation)),
        num_rearrangements=state.num_rearrangements,
        num_skipped_rearrangements=state.num_skipped_rearrangements,  # all-zero windows
        bytes_received=metrics.bytes_received(model_state),  # our communicator: counted
        # One expert's bytes as the transaction moves them (the first MoE layer's weight views, scales
        # included): integration.metrics' count, the one the events file and the metrics use.
        expert_nbytes=metrics.expert_bytes(model_state.model.expert_weights)[0],
        verifier_commits_checked=loop.verifier.commits_checked,
        verifier_steps=loop.verifier.steps,
        slots_per_rank=loop.slots_per_rank,
        in_flight_at_end=tuple(loop.watchdog.in_flight_at_shutdown),
        split_scope=state.split_scope,
    )
