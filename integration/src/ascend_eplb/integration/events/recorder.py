"""The events recorder: the records of one controller's models, made from what control publishes on the
controller's bus (its figures, :mod:`ascend_eplb.control.outcome`), written by EP rank 0
(:class:`EventsWriter`, to the file :func:`~ascend_eplb.integration.guardrail_facts.events_path` names)
and published as :class:`EventsRecord`."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.parallel_state import get_ep_group
from vllm.logger import init_logger

from ascend_eplb.control.bus import CommitEvent, Event, EventBus, RegistrationEvent
from ascend_eplb.control.initial_placement import InitialPlacementEvent
from ascend_eplb.control.outcome import RearrangementOutcome, WindowClosed
from ascend_eplb.integration import metrics
from ascend_eplb.integration.events.records import (
    CommitRecord,
    InitialPlacementRecord,
    RearrangementRealisedRecord,
    RearrangementRecord,
    Record,
    RunStartRecord,
    VerifierViolationRecord,
    WindowRecord,
    WorkerFailureRecord,
)
from ascend_eplb.integration.guardrail_facts import ENV_EVENTS
from ascend_eplb.integration.regular_files import RegularFileError, open_for_append
from ascend_eplb.integration.verify import VerifierViolation
from ascend_eplb.integration.watchdog import WorkerFailure

__all__ = ["EventsRecord", "EventsRecorder", "EventsWriter"]

#: The fields a ``rearrangement_realised`` record copies from its rearrangement's outcome.
_REALISED_COPIES = (
    "skipped",
    "balancedness_before",
    "balancedness_planned",
    "load_estimate",
    "estimate_balancedness_before",
    "estimate_balancedness_planned",
)


class EventsWriter:
    """Appends records to ``path`` as JSON lines, each flushed at once.

    Raises:
        ValueError: ``path`` cannot be appended to: a folder, a FIFO or another non-regular file, or not
            writable (the message names it and why); checked before it is opened, which never blocks.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._file = open_for_append(self.path)
        except RegularFileError as e:
            raise ValueError(f"{ENV_EVENTS}={self.path}: {e.reason}") from None

    def write(self, record: Record) -> None:
        self._file.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class EventsRecord(Event):
    """One record of the events file, published on the controller's event bus on every rank, on the
    runner thread, as it is made (EP rank 0 also writes it)."""

    record: Record


class EventsRecorder:
    """The records of one controller's models: written to ``path`` by EP rank 0, and published on the
    controller's event bus as :class:`EventsRecord` on every rank. A rank with neither a file to write
    nor a subscriber of :class:`EventsRecord` (at model registration) records nothing (and subscribes to
    control's outcomes only once it records, so that an idle rank has none figured).

    Use :meth:`attach` (``create_eplb_controller`` does when
    :func:`~ascend_eplb.integration.guardrail_facts.events_path` is set or the Prometheus metrics are on).
    A one-line INFO log per rearrangement, done or skipped by the gate (EP rank 0), says the same for
    people reading logs.

    Args:
        path: the events file, or None (no file; bus subscribers only).
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else Path(path)
        self._controller: Any = None  # the bus's controller (its ``steps_run`` stamps each record)
        self._bus: EventBus | None = None
        self._writer: EventsWriter | None = None
        self._active = False
        self._bytes_seen: dict[str, int] = {}
        self._rank: int | None = None

    def attach(self, bus: EventBus) -> None:
        """Subscribe to a controller's event bus (control's ``AscendEPLBController.bus``, once, when the
        controller is built): its models' registration, steps, commits and start-up installs, and the
        ``worker_failure`` and ``verifier_violation`` events of the watchdog and the verifier; control's
        closed windows and rearrangement outcomes once it records (:meth:`_on_registered`)."""
        self._bus = bus
        bus.subscribe(RegistrationEvent, self._on_registered)
        bus.subscribe(CommitEvent, self._on_commit_event)
        bus.subscribe(InitialPlacementEvent, self._on_initial_placement)
        bus.subscribe(WorkerFailure, self._on_worker_failure)
        bus.subscribe(VerifierViolation, self._on_violation)

    # ------------------------------------------------------------------ subscribers
    def _on_registered(self, event: RegistrationEvent) -> None:
        self._controller = event.controller
        self._rank = get_ep_group().rank_in_group
        if self._rank == 0 and self.path is not None and self._writer is None:
            self._writer = EventsWriter(self.path)
        if self._writer is None and not (self._bus is not None and self._bus.subscribers(EventsRecord)):
            return
        if not self._active and self._rank == 0:
            # This server's first record, in its file and to the records' subscribers alike: every reader
            # starts its run here.
            self._emit(RunStartRecord(**self._stamp(), model=None, run_id=uuid.uuid4().hex, pid=os.getpid()))
        if not self._active and self._bus is not None:
            self._bus.subscribe(WindowClosed, self._on_window)
            self._bus.subscribe(RearrangementOutcome, self._on_outcome)
        self._active = True

    def _stamp(self) -> dict[str, Any]:
        return {"time": time.time(), "step": 0 if self._controller is None else self._controller.steps_run}

    def _emit(self, record: Record) -> None:
        if self._writer is not None:
            self._writer.write(record)
        if self._bus is not None:
            self._bus.publish(EventsRecord(record))

    def _on_window(self, w: WindowClosed) -> None:
        """Control's closed window: the ``rearrangement_realised`` record of the rearrangement it realises
        (when there is one; its figures copied from that outcome), then its ``window`` record."""
        name, realised = w.model_name, w.realised
        if realised is not None:
            done = realised.outcome
            self._emit(RearrangementRealisedRecord(
                **self._stamp(), model=name, rearrangement=done.rearrangement,
                **{f: getattr(done, f) for f in _REALISED_COPIES},
                balancedness_realised=realised.balancedness, placed_by=realised.placed_by,
                windows_realised=realised.windows, balancedness_realised_mean=realised.mean,
            ))  # fmt: skip
        self._bytes_seen[name] = _bytes_received(w.model_state)
        selections = w.new_selections
        self._emit(WindowRecord(
            **self._stamp(), model=name, rearrangement=w.rearrangement,
            load=tuple(map(tuple, w.load.to(torch.int64).tolist())),
            balancedness=w.balancedness, balancedness_eplb_off=w.balancedness_eplb_off, num_ranks=w.num_ranks,
            num_physical_experts=int(w.placement.shape[1]), num_expert_groups=w.num_expert_groups,
            num_nodes=w.num_nodes,
            new_selections=None if selections is None else tuple(map(tuple, selections.tolist())),
        ))  # fmt: skip

    def _on_commit_event(self, event: CommitEvent) -> None:
        if not self._active:
            return
        model_state = event.model_state
        if event.kind != "acknowledge":  # EPLB is asynchronous only: every layer is acknowledged
            return
        name = event.model_name
        received = _bytes_received(model_state)
        delta = received - self._bytes_seen.get(name, received)
        self._bytes_seen[name] = received
        self._emit(CommitRecord(
            **self._stamp(), model=name, rearrangement=event.rearrangement, layer=event.layer,
            publish_to_acknowledge_s=event.publish_to_acknowledge_s,
            bytes_received=delta,
            placement=tuple(model_state.physical_to_logical_map[event.layer].detach().cpu().tolist()),
        ))  # fmt: skip

    def _on_outcome(self, o: RearrangementOutcome) -> None:
        """Control's outcome of a window (skipped at its decision, done at its last layer's acknowledgement):
        its ``rearrangement`` record, and the INFO line (EP rank 0)."""
        nbytes = 0 if o.moved is None else metrics.expert_bytes(o.model_state.model.expert_weights)
        r = RearrangementRecord(
            **self._stamp(), model=o.model_name, rearrangement=o.rearrangement, policy=o.policy,
            skipped=o.skipped, balancedness_before=o.balancedness_before,
            balancedness_planned=o.balancedness_planned, load_estimate=o.load_estimate,
            estimate_balancedness_before=o.estimate_balancedness_before,
            estimate_balancedness_planned=o.estimate_balancedness_planned, experts_moved=o.experts_moved,
            bytes_moved=0 if o.moved is None else metrics.bytes_moved(o.moved, nbytes),
            layers_changed=o.layers_changed,
        )  # fmt: skip
        self._emit(r)
        if self._rank != 0 or r.skipped == "no_load":  # the state logs a run of windows without load
            return
        log = init_logger(__name__)
        estimate = ""
        if r.estimate_balancedness_before is not None:
            planned = r.estimate_balancedness_planned
            estimate = f" (on the {r.load_estimate} load estimate {r.estimate_balancedness_before:.4f}" + (
                ")" if planned is None else f" -> {planned:.4f})"
            )
        if r.skipped is None:
            log.info(
                "EPLB rearrangement %d of %s committed (policy %s): balancedness of its window %.4f -> "
                "planned %.4f%s, %d experts moved (%d bytes), %d layers changed",
                r.rearrangement, r.model, r.policy, r.balancedness_before, r.balancedness_planned, estimate,
                r.experts_moved, r.bytes_moved, r.layers_changed,
            )  # fmt: skip
        else:
            planned = r.balancedness_planned
            log.info(
                "EPLB rearrangement %d of %s skipped (%s, policy %s): balancedness of its window %.4f%s%s; "
                "no expert moved",
                r.rearrangement, r.model, r.skipped, r.policy, r.balancedness_before,
                "" if planned is None else f", the policy's placement {planned:.4f}", estimate,
            )  # fmt: skip

    def _on_initial_placement(self, event: Any) -> None:
        """The start-up install's record (its commit is synchronous: no acknowledge, no ``commit``
        record)."""
        model_state = event.model_state
        name = event.model_name
        if not self._active:
            return
        new, moved = event.placement, event.moved
        received = _bytes_received(model_state)
        self._bytes_seen[name] = received
        nbytes = metrics.expert_bytes(model_state.model.expert_weights)
        self._emit(InitialPlacementRecord(
            **self._stamp(), model=name, source=event.source,
            num_logical_experts=int(model_state.logical_to_physical_map.shape[1]), num_ranks=event.num_ranks,
            placement=tuple(map(tuple, new.tolist())),
            layers_changed=int((event.previous != new).any(dim=1).sum()), experts_moved=int(moved.sum()),
            bytes_moved=metrics.bytes_moved(moved, nbytes), bytes_received=received,
        ))  # fmt: skip

    def _on_worker_failure(self, failure: Any) -> None:
        if self._active:
            self._emit(WorkerFailureRecord(
                **self._stamp(), model=failure.model, kind=failure.kind, ranks=tuple(failure.ranks),
                layer=failure.layer, cause=failure.cause,
            ))  # fmt: skip

    def _on_violation(self, violation: Any) -> None:
        if self._active:
            self._emit(VerifierViolationRecord(
                **self._stamp(), model=violation.model, check=violation.check, layer=violation.layer,
                rank=violation.rank, slot=violation.slot, message=violation.message(),
            ))  # fmt: skip


def _bytes_received(model_state: Any) -> int:
    """metrics.bytes_received, 0 when the communicator keeps no statistics (the records' deltas are 0)."""
    received = metrics.bytes_received(model_state)
    return 0 if received is None else received
