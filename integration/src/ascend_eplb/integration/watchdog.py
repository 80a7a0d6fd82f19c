"""Worker watchdog of a serving worker: a dead or stalled asynchronous EPLB worker is caught and named.

Upstream's async worker thread logs an exception and ends; the ranks then wait forever for the next layer
and EPLB never rearranges again. A cycle can also stall (a transfer never completes; ``EplbState.step``
then returns early and ``expert_rearrangement_step`` runs past its interval, vllm-project/vllm#57883).
At every EPLB step boundary (check ``worker``: each rank's worker alive, a started cycle progressing, a
layer published or committed, within ``ASCEND_EPLB_WORKER_TIMEOUT_S``, default 600 s) one ``all_gather``
of a small int64 vector on the EP CPU group gives every rank the same verdict at the same step. On a
failure EP rank 0 logs the model, layer in flight, failed rank(s) and cause (the worker's traceback,
recorded by the :data:`PATCHES` wrapper of its loop); every rank calls ``stop_eplb`` (each layer wholly
old or new), publishes the :class:`WorkerFailure` and serves on (``ASCEND_EPLB_ON_WORKER_FAILURE=raise``:
raises :class:`EplbWorkerFailureError`). At shutdown a cycle in flight is logged with its time without
progress.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.parallel_state import get_ep_group
from vllm.logger import init_logger

from ascend_eplb.control.bus import CommitEvent, Event, EventBus, ShutdownEvent, StepEvent
from ascend_eplb.control.patching import Patch, patches_of
from ascend_eplb.integration import upstream
from ascend_eplb.integration.guardrail_facts import (
    DEFAULT_WORKER_TIMEOUT_S,
    ENV_WORKER_TIMEOUT,
    ON_FAILURE_POLICIES,
    InFlightAtShutdown,
)

__all__ = [
    "PATCHES",
    "EplbWorkerFailureError",
    "WorkerFailure",
    "WorkerWatchdog",
]

#: Attribute of upstream's ``EplbState`` holding the worker's exception and traceback, once it died (a
#: row of the upstream surface's ``ATTRIBUTES``).
_ERROR_ATTR = upstream.WORKER_ERROR_ATTR


@upstream.SURFACE.replaces(
    "vllm.distributed.eplb.async_worker.transfer_run_periodically",
    f"upstream's loop; its exception and traceback recorded on the state (`{_ERROR_ATTR}`) before the "
    "thread ends",
)
def _wrap_worker_loop(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def transfer_run_periodically(state: Any, stream: Any, is_profile: bool = False) -> None:
        try:
            original(state, stream, is_profile)
        except BaseException as exc:
            setattr(state, _ERROR_ATTR, (repr(exc), traceback.format_exc()))
            raise

    return transfer_run_periodically


#: Records the async worker's exception on its ``EplbState`` (upstream only logs it).
PATCHES: tuple[Patch, ...] = patches_of(_wrap_worker_loop)


@dataclass(frozen=True)
class WorkerFailure(Event):
    """What the watchdog decided, identical on every rank; published on the controller's event bus
    (every rank, once).

    Attributes:
        kind: ``"died"`` or ``"stalled"``.
        ranks: the EP ranks whose worker failed (died, or did not publish its layer).
        model: the model whose cycle was in flight (None if no cycle was).
        layer: the MoE layer in flight (the next to commit), or None.
        step: the watchdog's step count at the decision.
        cause: the dead worker's exception and traceback (as that rank recorded it), or why it stalled.
    """

    kind: str
    ranks: tuple[int, ...]
    model: str | None
    layer: int | None
    step: int
    cause: str

    def message(self) -> str:
        where = f"model {self.model}, layer {self.layer}" if self.model is not None else "no cycle in flight"
        ranks = ", ".join(str(r) for r in self.ranks)
        return (
            f"EPLB worker watchdog: the async EPLB worker of rank(s) {ranks} {self.kind} ({where}, step "
            f"{self.step}): {self.cause}"
        )


class EplbWorkerFailureError(RuntimeError):
    """Raised on every rank with ``ASCEND_EPLB_ON_WORKER_FAILURE=raise``; ``.failure`` says what."""

    def __init__(self, failure: WorkerFailure) -> None:
        super().__init__(failure.message())
        self.failure = failure


class WorkerWatchdog:
    """The per-step decision of the module docstring for one controller.

    Args:
        timeout_s: seconds without progress of a started cycle before it is declared stalled.
        on_failure: ``"stop"`` (stop rearranging, keep serving) or ``"raise"``.
        clock: the time source in seconds (tests).

    Attributes:
        steps: EPLB steps seen.
        failure: the failure decided, once (None while healthy).
        in_flight_at_shutdown: what :meth:`at_shutdown` found (empty before it ran).
    """

    def __init__(
        self, timeout_s: float = DEFAULT_WORKER_TIMEOUT_S, on_failure: str = "stop", clock=time.monotonic
    ) -> None:
        if on_failure not in ON_FAILURE_POLICIES:
            raise ValueError(f"on_failure={on_failure!r}: must be one of {ON_FAILURE_POLICIES}")
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        self.clock = clock
        self.steps = 0
        self.failure: WorkerFailure | None = None
        # Per model index: (progress key, clock at its last change, self.steps at its last change).
        self._progress: dict[int, tuple[tuple[bool, int, bool], float, int]] = {}
        self._rank: int | None = None
        self.in_flight_at_shutdown: list[InFlightAtShutdown] = []
        # Per model name: (rearrangement, layer) of its latest acknowledged layer commit.
        self._acknowledged: dict[str, tuple[int, int]] = {}

    def attach(self, bus: EventBus) -> None:
        """Subscribe to a controller's event bus (control's ``AscendEPLBController.bus``, once, when the
        controller is built): :meth:`on_commit` at every commit event, :meth:`on_step` at every step
        boundary, :meth:`at_shutdown` at its shutdown."""
        bus.subscribe(CommitEvent, self.on_commit)
        bus.subscribe(StepEvent, self.on_step)
        bus.subscribe(ShutdownEvent, self.at_shutdown)

    def on_commit(self, event: CommitEvent) -> None:
        """Keep each model's latest acknowledged layer (the bus is the only source of commit facts)."""
        if event.kind == "acknowledge":
            self._acknowledged[event.model_name] = (event.rearrangement, event.layer)

    def _next_layer(self, state: Any, model_state: Any) -> int:
        """The MoE layer the cycle in flight commits next: one past this model's latest acknowledged layer
        of the current rearrangement (layers commit in order), 0 when none yet or no cycle is in flight."""
        if not model_state.rebalanced:
            return 0
        seen = self._acknowledged.get(model_state.model_name)
        if seen is None or seen[0] != getattr(state, "num_rearrangements", 0):
            return 0
        return seen[1] + 1

    def _local_status(self, state: Any) -> list[int]:
        """``[alive, then per model: in_cycle, has_pending, ms_without_progress, layer_in_flight]``.

        A model is in its cycle when upstream's worker is moving it: upstream sets every registered
        model's ``rebalanced`` when a rearrangement starts, then moves them one after the other in
        registration order (an MoE draft first, then the target), so a model whose predecessors are still
        in their cycle waits, and its clock starts when it is its turn (not at the rearrangement's start:
        the draft's transfer is not the target's stall)."""
        worker = getattr(state, "async_worker", None)
        alive = worker is None or worker.is_alive()
        now = self.clock()
        out = [int(alive)]
        ahead = False  # a model before this one is still in its cycle
        for index, ms in enumerate(state.model_states.values()):
            in_cycle = bool(ms.rebalanced) and not ahead
            ahead = ahead or bool(ms.rebalanced)
            pending = ms.pending_result
            layer = pending.layer_idx if pending is not None else self._next_layer(state, ms)
            key = (in_cycle, layer, pending is not None)
            seen = self._progress.get(index)
            if seen is None or seen[0] != key:
                self._progress[index] = (key, now, self.steps)
                idle_ms = 0
            else:
                idle_ms = int((now - seen[1]) * 1000) if in_cycle else 0
            out += [int(in_cycle), int(pending is not None), idle_ms, layer]
        return out

    def at_shutdown(self, event: ShutdownEvent) -> list[InFlightAtShutdown]:
        """The runner's end of life on this rank (no collective): each cycle still in flight, logged with
        how long it went without progress (:meth:`InFlightAtShutdown.message`; INFO when it progressed in
        the last step or the one before, WARNING otherwise).

        Returns:
            the cycles in flight (empty when none was, or after a failure stopped EPLB).
        """
        state = event.controller.state
        if state is None or self.failure is not None:
            return []
        self._local_status(state)  # a layer published or committed since the last step is progress
        now = self.clock()
        found = []
        for index, ms in enumerate(state.model_states.values()):
            seen = self._progress.get(index)
            if not ms.rebalanced or seen is None or not seen[0][0]:
                continue  # no cycle, or its turn has not come (a model before it is still moved)
            (_, layer, published), since, step = seen
            found.append(
                InFlightAtShutdown(
                    ms.model_name,
                    int(getattr(state, "num_rearrangements", 0)),
                    layer,
                    published,
                    now - since,
                    self.steps - step,
                    self.timeout_s,
                    self._rank,
                )
            )
        if found:
            log = init_logger(__name__)
            for cycle in found:
                # At most one step without progress is a cycle progressing as it ends; more is worth a look.
                (log.info if cycle.steps_without_progress <= 1 else log.warning)("%s", cycle.message())
        self.in_flight_at_shutdown = found
        return found

    def on_step(self, event: StepEvent) -> None:
        """The step-boundary decision (every rank, same order); on a failure, EPLB is stopped
        (``controller.stop_eplb``) and the :class:`WorkerFailure` published on the controller's bus.

        Raises:
            EplbWorkerFailureError: a worker failed and the policy is ``raise``.
        """
        self.steps += 1
        if self.failure is not None:
            return
        controller = event.controller
        state = controller.state
        group = get_ep_group()
        self._rank = group.rank_in_group
        mine = torch.tensor(self._local_status(state), dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(group.world_size)]
        dist.all_gather(gathered, mine, group=group.cpu_group)
        failure = self._decide(state, [t.tolist() for t in gathered])
        if failure is None:
            return
        if failure.kind == "died":
            # Only the dead rank holds its worker's exception: gather it (every rank is here).
            causes: list[Any] = [None] * group.world_size
            dist.all_gather_object(causes, getattr(state, _ERROR_ATTR, None), group=group.cpu_group)
            text = [f"rank {r}: {causes[r][0]}\n{causes[r][1]}" for r in failure.ranks if causes[r]]
            failure = WorkerFailure(
                failure.kind, failure.ranks, failure.model, failure.layer, failure.step,
                "\n".join(text) or "the worker thread ended without an exception",
            )  # fmt: skip
        if failure.kind == "stalled":
            failure = self._name_stalled(state, group, failure)
        self.failure = failure
        controller.stop_eplb(failure.message())
        if group.rank_in_group == 0:
            init_logger(__name__).error("%s; EPLB rearrangement is stopped on every rank", failure.message())
        controller.bus.publish(failure)
        if self.on_failure == "raise":
            raise EplbWorkerFailureError(failure)

    @staticmethod
    def _name_stalled(state: Any, group: Any, failure: WorkerFailure) -> WorkerFailure:
        """Name the rank(s) a stalled cycle waits for: ranks whose worker others wait on (movement's
        communicator tells the peer it is blocked on) while waiting on nobody themselves."""

        waiting = None
        for ms in state.model_states.values():
            peer = getattr(ms.communicator, "waiting_on", None)
            if peer is not None:
                waiting = group.ranks.index(peer) if peer in group.ranks else None
                break
        everyone: list[Any] = [None] * group.world_size
        dist.all_gather_object(everyone, waiting, group=group.cpu_group)
        waited_on = {w for w in everyone if w is not None}
        culprits = tuple(sorted(r for r in waited_on if everyone[r] is None))
        if not culprits:
            return failure
        waits = "; ".join(
            f"rank {r}'s transfer waits on rank {w}" for r, w in enumerate(everyone) if w is not None
        )
        return WorkerFailure(
            failure.kind, culprits, failure.model, failure.layer, failure.step,
            f"{failure.cause}; {waits}, which waits on no peer",
        )  # fmt: skip

    def _decide(self, state: Any, gathered: list[list[int]]) -> WorkerFailure | None:
        names = [ms.model_name for ms in state.model_states.values()]
        dead = tuple(r for r, row in enumerate(gathered) if not row[0])
        in_flight = None
        for index, name in enumerate(names):
            rows = [row[1 + 4 * index : 5 + 4 * index] for row in gathered]
            if any(r[0] for r in rows):
                in_flight = (index, name, max(r[3] for r in rows), rows)
                break
        model = in_flight[1] if in_flight else None
        layer = in_flight[2] if in_flight else None
        if dead:
            # (A dead worker is seen at the next step boundary, before the counter can overrun.)
            return WorkerFailure("died", dead, model, layer, self.steps, "")
        if in_flight is None:
            return None
        rows = in_flight[3]
        idle_s = max(r[2] for r in rows) / 1000.0
        if idle_s <= self.timeout_s:
            return None
        silent = tuple(r for r, row in enumerate(rows) if not row[1]) or tuple(range(len(rows)))
        published = tuple(r for r, row in enumerate(rows) if row[1])
        waiting = (
            f" (rank(s) {', '.join(map(str, published))} published it: their workers wait for it to be "
            "consumed)"
            if published and silent != tuple(range(len(rows)))
            else ""
        )
        return WorkerFailure(
            "stalled", silent, model, layer, self.steps,
            f"the rearrangement cycle made no progress for {idle_s:.1f} s (> {self.timeout_s:g} s, "
            f"{ENV_WORKER_TIMEOUT}): layer {layer} was not published by rank(s) {', '.join(map(str, silent))}"
            f"{waiting}{_overrun(_steps_until_next_rearrangement(state))}",
        )  # fmt: skip


def _steps_until_next_rearrangement(state: Any) -> int:
    """Upstream's "steps until the next rearrangement" (``EplbState.step``'s log line):
    ``expert_rearrangement_step_interval - expert_rearrangement_step``, the same on every rank (each
    steps upstream's counter alike); negative once a cycle in flight kept ``step`` from resetting the
    counter (vllm-project/vllm#57883)."""
    interval = int(getattr(state, "expert_rearrangement_step_interval", 0))
    return interval - int(getattr(state, "expert_rearrangement_step", 0))


def _overrun(steps_until: int) -> str:
    """The cause's words for upstream's step counter past its interval (a cycle is in flight)."""
    if steps_until >= 0:
        return ""
    return (
        f"; upstream's silent stop (vllm-project/vllm#57883): EplbState.expert_rearrangement_step ran "
        f"{-steps_until} steps past expert_rearrangement_step_interval ('steps until the next "
        f"rearrangement: {steps_until}'), because EplbState.step returns before resetting it while a cycle "
        "is in flight, so upstream alone would never rearrange again"
    )
