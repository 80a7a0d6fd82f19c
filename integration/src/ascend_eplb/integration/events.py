"""The events file of a serving worker: what EPLB saw, decided, moved and what each commit cost.

``ASCEND_EPLB_EVENTS=/path/events.jsonl`` makes EP rank 0 append one JSON object per line, each
written and flushed at once (a crash loses at most the line being written). Every object has ``event``,
``time`` (Unix seconds) and ``step``: the 0-based index of the serving step during which the record was
made (upstream ``EplbState.step`` calls since the model was registered, dummy steps included, the profile
step not: the first step after start-up is 0, as in ``ascend-eplb simulate``'s ``report.json``):

- ``initial_placement``: the placement serving started on was installed from a file
  (``additional_config.eplb_config.initial_placement``, :mod:`ascend_eplb.integration.placement_file`):
  ``model``, ``source`` (the file), ``num_logical_experts``, ``num_ranks``, ``placement`` (``[L][P]``, the
  committed ``physical_to_logical_map``), ``layers_changed`` and ``experts_crossing_ranks`` (from
  upstream's initial placement), ``bytes_received`` (by EP rank 0);
- ``window``: a load window closed and upstream's policy receives it: ``model``, ``rearrangement``
  (1-based index), ``load`` (``[L][E]`` integers: the window's global load per MoE layer in logical
  expert space, exactly upstream's ``last_expert_load``), ``balancedness`` (of that load under the
  placement in force when the window closed) and ``balancedness_eplb_off`` (under upstream's initial
  placement, what EPLB off would have served; both :mod:`ascend_eplb.integration.metrics`),
  ``num_ranks`` and ``num_physical_experts`` (the configuration served: N, P), ``num_expert_groups``
  and ``num_nodes`` (what upstream passed its policy for this window, upstream ``EplbStats.num_groups``
  and ``num_nodes``: the first model's ``num_expert_groups``, e.g. DeepSeek-V3's ``n_group``, and the
  node count, 1 where the nodes do not divide the ranks; None if upstream kept no ``eplb_stats``). A
  file recorded before these fields has none of them: readers take them as not recorded;
- ``rearrangement``: what became of a closed window, one record per model: when every layer of a
  rearrangement committed, or when it was skipped (as soon as the runner thread learns it: at its first
  commit, or at once for a window without load). ``model``, ``rearrangement`` (the 1-based index of
  its ``window``; None for ``"no_load"``: no rearrangement started), ``policy`` (``default`` or
  ``migration_aware``), ``skipped`` (None, or the gain gate's reason: ``"balanced"``,
  ``"min_gain"``, ``"no_load"``; ``ascend_eplb.control.gate``), ``balancedness_before`` (of the
  window's load under the placement committed when it closed), ``balancedness_planned`` (under the
  policy's placement, on the same window: what the policy aimed at, not what serving reached; None
  when the policy did not run: ``"balanced"``, ``"no_load"``), ``experts_moved`` (experts that crossed
  ranks, :func:`ascend_eplb.control.policy.moved_experts` summed over layers), ``bytes_moved`` (those
  experts x the bytes of one expert's weights in their layer, from the model's ``expert_weights``:
  what the ranks received together), ``layers_changed``; a skipped one moved nothing (0, 0, 0);
- ``rearrangement_realised``: the next window with load closed, for the last ``rearrangement`` with an
  index: ``model``, ``rearrangement`` (that index), ``skipped``, ``balancedness_before`` and
  ``balancedness_planned`` (copied from it) beside ``balancedness_realised`` (the new window's load
  under the placement committed when it closed: the balance that placement really served);
- ``commit``: one layer committed: ``model``, ``rearrangement``, ``layer``, ``publish_to_acknowledge_s``
  (from the step boundary at which the runner thread first saw the layer published, or its move, to the
  acknowledgement of the staging buffer), ``bytes_received`` (by EP rank 0 for this layer),
  ``placement`` (``[P]``: the layer's committed ``physical_to_logical_map`` row);
- ``worker_failure``: the watchdog's decision (``kind``, ``ranks``, ``model``, ``layer``, ``cause``);
- ``verifier_violation``: a serving verifier check failed (``check``, ``model``, ``layer``, ``rank``
  that found it, ``slot``, ``message``), written just before the verifier raises.

A one-line INFO log per rearrangement, done or skipped by the gate (EP rank 0), says the same for
people reading logs (``AscendEplbState`` logs the first of a run of windows without load).
:func:`read_windows` reads the windows back (``ascend-eplb plan events.jsonl``,
``ascend-eplb simulate --trace events.jsonl``); :func:`read_records` every record (the placement file
reader takes the last committed placement from the ``initial_placement`` and ``commit`` records);
:func:`model_records` keeps one model's records of some kinds, the one filter every reader uses.

The same records, computed once, are published on the controller's event bus as :class:`EventsRecord`
on every EP rank (each with that rank's own ``bytes_received`` and ``publish_to_acknowledge_s``): the
Prometheus metrics (:mod:`ascend_eplb.integration.prometheus`) subscribe to them, so the file and the
scrape hold the same values.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ascend_eplb.control.bus import (
    CommitEvent,
    DecisionEvent,
    Event,
    EventBus,
    RearrangementEvent,
    RegistrationEvent,
    StepEvent,
)
from ascend_eplb.control.values import is_int

__all__ = [
    "ENV_EVENTS",
    "EventsRecord",
    "EventsRecorder",
    "EventsWriter",
    "events_path",
    "model_records",
    "read_records",
    "read_windows",
]

ENV_EVENTS = "ASCEND_EPLB_EVENTS"


def events_path(environ: Mapping[str, str] | None = None) -> str | None:
    """The path ``ASCEND_EPLB_EVENTS`` names (a leading ``~`` expanded), or None (unset or empty).

    Checked on every rank at start-up, though only EP rank 0 writes: a path that is a folder, or whose
    folder cannot be created or written, is refused everywhere alike.

    Raises:
        ValueError: the path is a folder or cannot be written (the message names it and why).
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_EVENTS, "").strip()
    if not raw:
        return None
    # `~` is a shell's: a value set where no shell expands it (a container's environment, a unit file)
    # made a folder called `~` wherever vLLM ran. Expanded here, as vLLM expands its own paths.
    raw = os.path.expanduser(raw)
    path = Path(raw)
    if path.is_dir() or raw.endswith(("/", os.sep)):  # Path("out/") is "out": a file where a folder was meant
        raise ValueError(f"{ENV_EVENTS}={raw}: is a folder; name the events file (e.g. events.jsonl)")
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        kind = "" if folder.is_dir() else " (it is a file)"
        raise ValueError(f"{ENV_EVENTS}={raw}: {folder} is not a writable folder{kind}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{ENV_EVENTS}={raw}: the file is not writable")
    return raw


class EventsWriter:
    """Appends JSON lines to ``path``, each flushed at once.

    Raises:
        ValueError: ``path`` cannot be opened for appending (the message names it and why).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)
        except OSError as e:
            raise ValueError(f"{ENV_EVENTS}={self.path}: cannot append there ({e})") from e

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class EventsRecord(Event):
    """One record of the events file (the dict of the module docstring), published on the controller's
    event bus on every rank, on the runner thread, as it is written.

    Attributes:
        record: ``event``, ``time``, ``step`` and the event's fields.
    """

    record: dict[str, Any]


class EventsRecorder:
    """The event records of one controller's models: written to ``path`` by EP rank 0, and published on
    the controller's event bus as :class:`EventsRecord` on every rank. A rank with neither a file to
    write nor a subscriber of :class:`EventsRecord` (at model registration) records nothing.

    Use :meth:`attach` (``create_eplb_controller`` does when :func:`events_path` is set or the
    Prometheus metrics are on).

    Args:
        path: the events file, or None (no file; bus subscribers only).
        clock: monotonic seconds (tests).
    """

    def __init__(self, path: str | os.PathLike[str] | None, clock=time.monotonic) -> None:
        self.path = None if path is None else Path(path)
        self.clock = clock
        self.steps = 0
        self._bus: EventBus | None = None
        self._writer: EventsWriter | None = None
        self._active = False
        self._cycles: dict[str, dict[str, Any]] = {}
        self._published: dict[tuple[str, int], float] = {}
        self._bytes_seen: dict[str, int] = {}
        # Per model: the figures of the last rearrangement with an index, until the next window realises them.
        self._unrealised: dict[str, dict[str, Any]] = {}
        self._rank: int | None = None

    def attach(self, bus: EventBus) -> None:
        """Subscribe to a controller's event bus (control's ``AscendEPLBController.bus``, once, when the
        controller is built): its models' registration, steps, rearrangements and commits, and the
        ``worker_failure`` and ``verifier_violation`` events of the watchdog and the verifier."""
        from ascend_eplb.control.initial_placement import InitialPlacementEvent
        from ascend_eplb.integration.verify import VerifierViolation
        from ascend_eplb.integration.watchdog import WorkerFailure

        self._bus = bus
        bus.subscribe(RegistrationEvent, self._on_registered)
        bus.subscribe(StepEvent, self._on_step)
        bus.subscribe(RearrangementEvent, self._on_rearrangement)
        bus.subscribe(DecisionEvent, self._on_decision)
        bus.subscribe(CommitEvent, self._on_commit_event)
        bus.subscribe(InitialPlacementEvent, self._on_initial_placement)
        bus.subscribe(WorkerFailure, self._on_worker_failure)
        bus.subscribe(VerifierViolation, self._on_violation)

    # ------------------------------------------------------------------ subscribers
    def _on_registered(self, event: RegistrationEvent) -> None:
        from vllm.distributed.parallel_state import get_ep_group

        self._rank = get_ep_group().rank_in_group
        if self._rank == 0 and self.path is not None and self._writer is None:
            self._writer = EventsWriter(self.path)
        if self._writer is None and not (self._bus is not None and self._bus.subscribers(EventsRecord)):
            return
        self._active = True

    def _write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": time.time(), "step": self.steps, **fields}
        if self._writer is not None:
            self._writer.write(record)
        if self._bus is not None:
            self._bus.publish(EventsRecord(record))

    def _on_step(self, event: StepEvent) -> None:
        if not event.is_profile:
            self.steps += 1
        if not self._active:
            return
        state = event.controller.state
        now = self.clock()
        for ms in state.model_states.values():
            pending = ms.pending_result
            if pending is not None:
                self._published.setdefault((ms.model_name, pending.layer_idx), now)

    def _on_rearrangement(self, event: RearrangementEvent) -> None:
        if not self._active:
            return
        from vllm.distributed.eplb.eplb_state import EplbState
        from vllm.distributed.parallel_state import get_ep_group

        from ascend_eplb.integration.metrics import balancedness, rank_loads

        state = event.state
        num_ranks = get_ep_group().world_size
        for ms in state.model_states.values():
            load = ms.last_expert_load
            if load is None:
                continue
            window = load.detach().cpu().to(torch.float64)
            old = ms.physical_to_logical_map.detach().cpu().clone()
            num_logical = int(window.shape[1])
            num_redundant = int(old.shape[1]) - num_logical
            # EPLB off: upstream's initial placement (its redundant slots replicate experts 0..R-1).
            initial = torch.tensor(
                EplbState.build_initial_global_physical_to_logical_map(num_logical, num_redundant),
                dtype=torch.int64,
            ).expand(old.shape[0], -1)
            realised = self._unrealised.pop(ms.model_name, None)
            if realised is not None:
                self._write(
                    "rearrangement_realised",
                    **realised,
                    balancedness_realised=balancedness(rank_loads(window, old, num_ranks)),
                )
            self._cycles[ms.model_name] = {
                "index": state.num_rearrangements,
                "load": window,
                "old": old,
                "num_ranks": num_ranks,
                "policy": state.policy_settings.policy,
                "decision": None,
            }
            self._bytes_seen[ms.model_name] = _bytes_received(ms)
            stats = ms.eplb_stats  # what upstream's rearrange handed its policy for this window
            groups, nodes = (None, None) if stats is None else (stats.num_groups, stats.num_nodes)
            self._write(
                "window",
                model=ms.model_name,
                rearrangement=state.num_rearrangements,
                load=load.detach().cpu().to(torch.int64).tolist(),
                balancedness=balancedness(rank_loads(window, old, num_ranks)),
                balancedness_eplb_off=balancedness(rank_loads(window, initial, num_ranks)),
                num_ranks=num_ranks,
                num_physical_experts=int(old.shape[1]),
                num_expert_groups=int(groups) if is_int(groups) else None,
                num_nodes=int(nodes) if is_int(nodes) else None,
            )

    def _on_commit_event(self, event: CommitEvent) -> None:
        if not self._active:
            return
        model_state = event.model_state
        if event.kind == "move":
            self._published.setdefault((event.model_name, event.layer), self.clock())
            return
        if event.kind != "acknowledge":  # EPLB is asynchronous only: every layer is acknowledged
            return
        name = event.model_name
        published = self._published.pop((name, event.layer), None)
        received = _bytes_received(model_state)
        delta = received - self._bytes_seen.get(name, received)
        self._bytes_seen[name] = received
        self._write(
            "commit",
            model=name,
            rearrangement=event.rearrangement,
            layer=event.layer,
            publish_to_acknowledge_s=None if published is None else self.clock() - published,
            bytes_received=delta,
            placement=model_state.physical_to_logical_map[event.layer].detach().cpu().tolist(),
        )
        if event.layer == model_state.physical_to_logical_map.shape[0] - 1:
            self._finish_cycle(model_state)

    def _on_decision(self, event: DecisionEvent) -> None:
        """The policy's and the gain gate's decision (control's ``DecisionEvent``): a skipped window's
        ``rearrangement`` record at once; a planned one waits for its last commit (:meth:`_finish_cycle`)."""
        if not self._active:
            return
        from ascend_eplb.integration.metrics import balancedness, rank_loads

        name, decision = event.model_name, event.decision
        cycle = self._cycles.get(name) if event.rearrangement is not None else None
        if decision.skipped is None:
            if cycle is not None:
                cycle["decision"] = decision
            return
        if event.rearrangement is not None:
            self._cycles.pop(name, None)  # upstream still commits the unchanged layers: no record then
        before = planned = None
        if cycle is not None:
            before = balancedness(rank_loads(cycle["load"], cycle["old"], cycle["num_ranks"]))
            planned = decision.balancedness_planned
        self._record_rearrangement(
            name, event.rearrangement, decision.policy, decision.skipped, before, planned, 0, 0, 0
        )

    def _finish_cycle(self, model_state: Any) -> None:
        from ascend_eplb.control.policy import moved_experts
        from ascend_eplb.integration.metrics import balancedness, expert_bytes, rank_loads

        cycle = self._cycles.pop(model_state.model_name, None)
        if cycle is None:
            return
        new = model_state.physical_to_logical_map.detach().cpu()
        old, load, num_ranks = cycle["old"], cycle["load"], cycle["num_ranks"]
        before = balancedness(rank_loads(load, old, num_ranks))
        planned = balancedness(rank_loads(load, new, num_ranks))
        changed = int((old != new).any(dim=1).sum())
        moved = moved_experts(old, new, num_ranks)
        nbytes = torch.tensor(expert_bytes(model_state.model.expert_weights), dtype=torch.int64)
        self._record_rearrangement(
            model_state.model_name, cycle["index"], cycle["policy"], None, before, planned,
            int(moved.sum()), int((moved * nbytes).sum()), changed,
        )  # fmt: skip

    def _record_rearrangement(
        self,
        name: str,
        index: int | None,
        policy: str,
        skipped: str | None,
        before: float | None,
        planned: float | None,
        moved: int,
        moved_bytes: int,
        changed: int,
    ) -> None:
        self._write(
            "rearrangement",
            model=name,
            rearrangement=index,
            policy=policy,
            skipped=skipped,
            balancedness_before=before,
            balancedness_planned=planned,
            experts_moved=moved,
            bytes_moved=moved_bytes,
            layers_changed=changed,
        )
        if index is not None:
            self._unrealised[name] = {
                "model": name,
                "rearrangement": index,
                "skipped": skipped,
                "balancedness_before": before,
                "balancedness_planned": planned,
            }
        if self._rank != 0 or skipped == "no_load":  # the state logs a run of windows without load
            return
        from vllm.logger import init_logger

        log = init_logger(__name__)
        if skipped is None:
            log.info(
                "EPLB rearrangement %d of %s committed (policy %s): balancedness of its window %.4f -> "
                "planned %.4f, %d experts moved (%d bytes), %d layers changed",
                index, name, policy, before, planned, moved, moved_bytes, changed,
            )  # fmt: skip
        else:
            log.info(
                "EPLB rearrangement %d of %s skipped (%s, policy %s): balancedness of its window %.4f%s; "
                "no expert moved",
                index, name, skipped, policy, before,
                "" if planned is None else f", the policy's placement {planned:.4f}",
            )  # fmt: skip

    def _on_initial_placement(self, event: Any) -> None:
        """The start-up install's record (its commit is synchronous: no acknowledge, no ``commit``
        record; the layers' ``move`` marks are dropped so that the first rearrangement's commits time
        from their own publication)."""
        model_state = event.model_state
        name = event.model_name
        for layer in range(int(model_state.physical_to_logical_map.shape[0])):
            self._published.pop((name, layer), None)
        if not self._active:
            return
        from ascend_eplb.integration.metrics import experts_crossing_ranks

        new = model_state.physical_to_logical_map.detach().cpu()
        received = _bytes_received(model_state)
        self._bytes_seen[name] = received
        self._write(
            "initial_placement",
            model=name,
            source=event.source,
            num_logical_experts=int(model_state.logical_to_physical_map.shape[1]),
            num_ranks=event.num_ranks,
            placement=new.tolist(),
            layers_changed=int((event.previous != new).any(dim=1).sum()),
            experts_crossing_ranks=experts_crossing_ranks(event.previous, new, event.num_ranks),
            bytes_received=received,
        )

    def _on_worker_failure(self, failure: Any) -> None:
        if not self._active:
            return
        self._write(
            "worker_failure",
            kind=failure.kind,
            ranks=list(failure.ranks),
            model=failure.model,
            layer=failure.layer,
            cause=failure.cause,
        )

    def _on_violation(self, violation: Any) -> None:
        if not self._active:
            return
        self._write(
            "verifier_violation",
            check=violation.check,
            model=violation.model,
            layer=violation.layer,
            rank=violation.rank,
            slot=violation.slot,
            message=violation.message(),
        )


def _bytes_received(model_state: Any) -> int:
    """metrics.bytes_received, 0 when the communicator keeps no statistics (the records' deltas are 0)."""
    from ascend_eplb.integration.metrics import bytes_received

    received = bytes_received(model_state)
    return 0 if received is None else received


def read_windows(path: str | os.PathLike[str], *, model: str | None = None) -> list[torch.Tensor]:
    """The ``window`` loads of an events file, oldest first, each int64 ``(L, E)``.

    Args:
        path: the events file.
        model: only this model's windows (default: the first model named in the file).

    Raises:
        ValueError: the file is missing or unreadable, a line other than a truncated last one is not a
            JSON object, a window's load is not a rectangular ``[L][E]`` list of integers >= 0, or the
            windows' shapes differ (the message names the file and the line). A truncated last line
            (a crash while writing) is skipped with a ``UserWarning``.
    """
    source = Path(path)
    windows: list[torch.Tensor] = []
    shape: tuple[int, int] | None = None
    for number, record in model_records(read_records(source, stacklevel=3), "window", model=model):
        load = _load_of(record.get("load"), source, number)
        if shape is not None and tuple(load.shape) != shape:
            raise ValueError(
                f"{source}:{number}: window load shape {tuple(load.shape)} differs from the earlier {shape}"
            )
        shape = tuple(load.shape)
        windows.append(load)
    return windows


def model_records(
    records: Iterable[tuple[int, dict[str, Any]]],
    events: str | Collection[str],
    *,
    model: str | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The records of one model among ``records``, of the kinds ``events``, in their order, as
    ``(line number, record)``.

    Args:
        records: ``(line number, record)`` pairs, as :func:`read_records` returns them.
        events: the ``event`` names kept (one name, or several).
        model: only this model's records (a record's ``model`` field); default: the model the first
            record of those kinds names (records of those kinds without ``model`` before it are kept).
    """
    kinds = {events} if isinstance(events, str) else set(events)
    for number, record in records:
        if record["event"] not in kinds:
            continue
        name = record.get("model")
        if model is None:
            model = name
        if name != model:
            continue
        yield number, record


def read_records(path: str | os.PathLike[str], *, stacklevel: int = 2) -> list[tuple[int, dict[str, Any]]]:
    """Every record of an events file, oldest first, as ``(line number, record)``.

    Raises:
        ValueError: the file is missing or unreadable, not UTF-8, or a line other than a truncated last
            one is not a JSON object with an ``event`` name (the message names the file and the line). A
            truncated last line (a crash while writing) is skipped with a ``UserWarning``.
    """
    source = Path(path)
    try:
        raw = source.read_bytes()
    except OSError as e:
        raise ValueError(f"{source}: cannot read the events file ({e.strerror or e})") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{source}: not UTF-8 text (byte {e.start}); not an events file") from e
    lines = text.split("\n")
    complete_end = text.endswith("\n")
    records: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = number == len(lines) and not complete_end
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if last:
                warnings.warn(
                    f"{source}:{number}: truncated last line skipped ({e.msg})", stacklevel=stacklevel
                )
                continue
            raise ValueError(f"{source}:{number}: not a JSON object ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            raise ValueError(f"{source}:{number}: not an events record (an object with an 'event' name)")
        records.append((number, record))
    return records


def _load_of(value: Any, source: Path, number: int) -> torch.Tensor:
    rule = "a window's 'load' must be a non-empty [L][E] list of integers >= 0"
    if not isinstance(value, list) or not value or not all(isinstance(row, list) and row for row in value):
        raise ValueError(f"{source}:{number}: {rule}")
    width = len(value[0])
    if any(len(row) != width for row in value):
        raise ValueError(f"{source}:{number}: {rule} (rows of different lengths)")
    if not all(is_int(v) and 0 <= v < 2**62 for row in value for v in row):
        raise ValueError(f"{source}:{number}: {rule}")
    return torch.tensor(value, dtype=torch.int64)
