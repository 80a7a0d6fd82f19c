"""The events file of a serving worker: what EPLB saw, decided, moved and what each commit cost.

``ASCEND_EPLB_EVENTS=/path/events.jsonl`` makes EP rank 0 append one JSON object per line, flushed at
once (a crash loses at most the line being written): a :class:`Record` kind's :meth:`~Record.to_json`
(the schema: :data:`RECORD_KINDS`), each naming its ``event``, ``time`` (Unix seconds), ``step`` (0-based
serving step, as in ``simulate``'s ``report.json``) and ``model`` (``EplbModelState.model_name``). The
same records go on the controller's bus as :class:`EventsRecord` on every EP rank (with that rank's
``bytes_received`` and ``publish_to_acknowledge_s``) for the Prometheus metrics. :func:`read_events` is
the one reader (``plan``, ``simulate --trace``, the placement reader). Several servers may append to one
file: each server's first record is a ``run_start`` (:class:`RunStartRecord`), and every reader splits the
file's runs (:class:`Run`) there, so that no reader joins two servers' records. A file recorded before
(no ``run_start``) is split where the step counter or a model's rearrangement counter starts again, or a
start-up install is recorded again.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from ascend_eplb.control import measures
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
from ascend_eplb.integration import metrics
from ascend_eplb.integration.model_facts import MAX_REDUNDANT_EXPERTS
from ascend_eplb.integration.model_names import DRAFT_SUFFIX, is_draft
from ascend_eplb.integration.regular_files import (
    EVENTS_FILE,
    RegularFileError,
    open_for_append,
    read_regular_file,
    regular_file_problem,
)
from ascend_eplb.integration.verify import VerifierViolation
from ascend_eplb.integration.watchdog import WorkerFailure

# vLLM is imported where used: ``plan`` and ``simulate --trace`` read events files without it.

__all__ = [
    "ENV_EVENTS",
    "RECORD_KINDS",
    "CommitRecord",
    "EventsFile",
    "EventsRecord",
    "EventsRecorder",
    "EventsWriter",
    "InitialPlacementRecord",
    "RearrangementRealisedRecord",
    "RearrangementRecord",
    "Record",
    "RecordedLoad",
    "Run",
    "RunStartRecord",
    "VerifierViolationRecord",
    "WindowRecord",
    "WorkerFailureRecord",
    "events_path",
    "read_events",
]

ENV_EVENTS = "ASCEND_EPLB_EVENTS"


def events_path(environ: Mapping[str, str] | None = None) -> str | None:
    """The path ``ASCEND_EPLB_EVENTS`` names (a leading ``~`` expanded), or None (unset or empty).

    Checked on every rank at start-up, though only EP rank 0 writes: a path that is a folder, a FIFO or
    another non-regular file, or where no file can be created or appended to, is refused everywhere
    alike. Whether it can be is judged by doing it (:func:`_creatable`): permission bits say nothing of
    ``/proc`` or ``/sys``, where root may "write" but nothing can be created.

    Raises:
        ValueError: the path cannot be appended to (the message names it and why).
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
    problem = regular_file_problem(path, missing_ok=True, verb="append to")
    if problem is not None:
        raise ValueError(f"{ENV_EVENTS}={raw}: {problem.problem}; name an events file (e.g. events.jsonl)")
    if (why := _creatable(path)) is not None:
        raise ValueError(f"{ENV_EVENTS}={raw}: {why}; name an events file in a writable folder")
    return raw


def _creatable(path: Path) -> str | None:
    """Why the events file ``path`` cannot be appended to, or None. An existing file is opened for
    appending (nothing written); a missing one is judged by creating and removing a file beside it (a
    folder, in the nearest folder that exists, when its own is still to be made)."""
    if path.exists():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY))
        except OSError as e:
            return f"the file cannot be appended to ({e.strerror or e})"
        return None
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        if folder == path.parent:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".probe")
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(dir=folder, prefix=".ascend-eplb-probe-"))
    except OSError as e:
        return f"nothing can be created in {folder} ({e.strerror or e})"
    return None


# ---------------------------------------------------------------------------------------------------- records


class _FieldError(ValueError):
    """A field value breaking its rule (the rule's text)."""


def _count(value: Any) -> int:
    """An integer >= 0 (a step, a layer, a rank, bytes, experts)."""
    if not is_int(value) or value < 0:
        raise _FieldError(f"must be an integer >= 0, got {_shown(value)}")
    return int(value)


def _positive(value: Any) -> int:
    """An integer >= 1 (ranks, experts, a 1-based rearrangement index)."""
    if not is_int(value) or value < 1:
        raise _FieldError(f"must be an integer >= 1, got {_shown(value)}")
    return int(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _FieldError("must be a finite number")
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise _FieldError("must be a string")
    return value


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise _FieldError("must be a list of integers")
    return tuple(int(v) for v in value)


def _row(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(is_int(v) for v in value):
        raise _FieldError("must be a non-empty [P] list of integer expert ids")
    return tuple(int(v) for v in value)


def _placement(value: Any) -> tuple[tuple[int, ...], ...]:
    rule = "must be a non-empty [L][P] list of integer lists, every row of one length"
    if not isinstance(value, list) or not value or not all(isinstance(row, list) and row for row in value):
        raise _FieldError(rule)
    if any(len(row) != len(value[0]) for row in value) or not all(is_int(v) for row in value for v in row):
        raise _FieldError(rule)
    return tuple(tuple(int(v) for v in row) for row in value)


def _load(value: Any) -> tuple[tuple[int, ...], ...]:
    rule = "must be a non-empty [L][E] list of integers >= 0"
    if not isinstance(value, list) or not value or not all(isinstance(row, list) and row for row in value):
        raise _FieldError(rule)
    if any(len(row) != len(value[0]) for row in value):
        raise _FieldError(f"{rule} (rows of different lengths)")
    if not all(is_int(v) and 0 <= v < 2**62 for row in value for v in row):
        raise _FieldError(rule)
    return tuple(tuple(int(v) for v in row) for row in value)


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def optional(value: Any) -> Any:
        return None if value is None else check(value)

    return optional


def _f(check: Callable[[Any], Any], default: Any = MISSING) -> Any:
    """A record field read by ``check`` (the value, or :class:`_FieldError`); a field with a ``default``
    may be absent from a line (recorded before the field existed)."""
    return field(default=default, metadata={"check": check})


R = TypeVar("R", bound="Record")


@dataclass(frozen=True, kw_only=True)
class Record:
    """One line of the events file. Every kind has these fields and its own (a subclass per kind).

    Attributes:
        time: Unix seconds when it was made.
        step: 0-based index of the serving step during which it was made (upstream ``EplbState.step``
            calls since the model was registered, dummy steps included, the profile step not).
        model: upstream ``EplbModelState.model_name`` of the model it is about (None: about none, e.g. a
            worker failure with no cycle in flight).
    """

    event: ClassVar[str] = ""
    #: Fields a file recorded before took under an earlier name (old name -> field).
    renamed: ClassVar[dict[str, str]] = {}
    time: float = _f(_number)
    step: int = _f(_count)
    model: str | None = _f(_optional(_str))

    def to_json(self) -> dict[str, Any]:
        """The line's object: ``event`` first, then every field (tuples as lists)."""
        out: dict[str, Any] = {"event": self.event}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = _plain(value)
        return out

    @classmethod
    def from_json(cls: type[R], data: Mapping[str, Any]) -> R:
        """The record of a line's object (its ``event`` is this kind's; keys of no field are ignored: a
        later writer's additions).

        Raises:
            ValueError: a field is missing (one without a default) or breaks its rule; the message names
                the kind, the field and the rule, not the file (the reader adds it).
        """
        values: dict[str, Any] = {}
        data = {**{new: data[old] for old, new in cls.renamed.items() if old in data}, **data}
        article = "an" if cls.event[0] in "aeiou" else "a"
        for f in fields(cls):
            if f.name not in data:
                if f.default is MISSING:
                    raise ValueError(f"{article} {cls.event} record without '{f.name}'")
                continue
            try:
                values[f.name] = f.metadata["check"](data[f.name])
            except _FieldError as e:
                raise ValueError(f"{article} {cls.event}'s '{f.name}' {e}") from None
        record = cls(**values)
        if (problem := record.facts_problem()) is not None:
            raise ValueError(f"{article} {cls.event}'s {problem}")
        return record

    def facts_problem(self) -> str | None:
        """Why the record's fields cannot be true together (one server's facts), or None."""
        return None


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _layout_problem(num_logical: int, num_physical: int | None, num_ranks: int | None) -> str | None:
    """Why ``P`` physical experts of ``E`` logical ones on ``N`` ranks cannot be a server's layout, or
    None: P >= E, P <= E + upstream's ``MAX_EXPERT_REDUNDANCY``, N divides P (each None: not judged)."""
    p, e, n = num_physical, num_logical, num_ranks
    if p is not None and p < e:
        return f"num_physical_experts={p}: below its {e} logical experts (every logical expert has a slot)"
    if p is not None and p > e + MAX_REDUNDANT_EXPERTS:
        return (
            f"num_physical_experts={p}: more than its {e} logical experts + {MAX_REDUNDANT_EXPERTS} "
            "(upstream's EplbState takes at most that many redundant experts)"
        )
    if p is not None and n is not None and p % n:
        return f"num_physical_experts={p}: not divisible by num_ranks={n} (P / N slots per rank)"
    return None


@dataclass(frozen=True, kw_only=True)
class RunStartRecord(Record):
    """A server started recording: the first record of each server (``step`` 0, ``model`` None), before
    any other of its own. Every reader starts a run (:class:`Run`) here, so no reader joins the records of
    two servers appended to one file.

    Attributes:
        run_id: the server's run, a random 32-hex-digit id (``uuid4``).
        pid: the recording process (EP rank 0's).
    """

    event: ClassVar[str] = "run_start"
    run_id: str = _f(_str)
    pid: int = _f(_count)


@dataclass(frozen=True, kw_only=True)
class InitialPlacementRecord(Record):
    """Serving started on a placement installed from a file (``eplb_config.initial_placement``), made
    once per model before the first step: what the start-up install moved, counted as a rearrangement's.

    Attributes:
        source: the file.
        num_logical_experts: E; ``num_ranks``: N.
        placement: ``(L, P)``, the committed ``physical_to_logical_map``.
        layers_changed: layers whose placement differs from upstream's initial one.
        experts_moved: experts that crossed ranks (:func:`ascend_eplb.control.measures.moved_experts`;
            ``experts_crossing_ranks`` in a file recorded before).
        bytes_moved: ``experts_moved`` x one expert's bytes per layer (estimated; None in a file recorded
            before it was).
        bytes_received: what EP rank 0's communicator measured receiving.
    """

    event: ClassVar[str] = "initial_placement"
    renamed: ClassVar[dict[str, str]] = {"experts_crossing_ranks": "experts_moved"}
    source: str = _f(_str)
    num_logical_experts: int = _f(_positive)
    num_ranks: int = _f(_positive)
    placement: tuple[tuple[int, ...], ...] = _f(_placement)
    layers_changed: int = _f(_count)
    experts_moved: int = _f(_count)
    bytes_moved: int | None = _f(_optional(_count), None)
    bytes_received: int = _f(_count)

    def facts_problem(self) -> str | None:
        return _layout_problem(self.num_logical_experts, len(self.placement[0]), self.num_ranks)


@dataclass(frozen=True, kw_only=True)
class WindowRecord(Record):
    """A load window closed and upstream's policy receives it. A model without load in it (a draft that
    ran no forward while the target did) has none: its ``rearrangement`` record says ``"no_load"``.

    Attributes:
        rearrangement: the 1-based index of the rearrangement it starts (upstream state's counter).
        load: ``(L, E)`` integers, the window's global load per MoE layer in logical expert space
            (upstream's ``last_expert_load``).
        balancedness: mean balancedness (:func:`ascend_eplb.control.measures.mean_balancedness`) of the
            load under the placement in force when it closed.
        balancedness_eplb_off: the same under upstream's initial placement (what EPLB off served).
        num_ranks, num_physical_experts: N and P served; ``num_expert_groups``, ``num_nodes``: what
            upstream passed its policy (``EplbStats``; None when upstream kept none). The four are None
            in a file recorded before they were.
        new_selections: ``(L, E)`` integers, the global selections recorded since the previous
            rearrangement: what the load estimate took in for this window (upstream's windows overlap
            when ``window_size`` exceeds ``step_interval``); None when the estimate is off
            (``load_estimate="window"``) or in a file recorded before it was.
    """

    event: ClassVar[str] = "window"
    rearrangement: int = _f(_positive)
    load: tuple[tuple[int, ...], ...] = _f(_load)
    balancedness: float = _f(_number)
    balancedness_eplb_off: float = _f(_number)
    num_ranks: int | None = _f(_optional(_positive), None)
    num_physical_experts: int | None = _f(_optional(_positive), None)
    num_expert_groups: int | None = _f(_optional(_positive), None)
    num_nodes: int | None = _f(_optional(_positive), None)
    new_selections: tuple[tuple[int, ...], ...] | None = _f(_optional(_load), None)

    def facts_problem(self) -> str | None:
        return _layout_problem(len(self.load[0]), self.num_physical_experts, self.num_ranks)


@dataclass(frozen=True, kw_only=True)
class RearrangementRecord(Record):
    """What became of a closed window: made when its last layer committed, or when the gate skipped it.

    Attributes:
        rearrangement: the index of its ``window`` (None for ``"no_load"``: no rearrangement started).
        policy: ``default`` or ``migration_aware``.
        skipped: None, or the gain gate's reason (``balanced``, ``min_gain``, ``no_load``).
        balancedness_before: mean balancedness of the window under the placement committed when it
            closed; ``balancedness_planned``: under the policy's placement (None when the policy did not
            run).
        load_estimate: what the policy planned on and the gate judged (``window`` or ``pooled``;
            ``window`` in a file recorded before it was).
        estimate_balancedness_before, estimate_balancedness_planned: the same two on the load estimate
            (None on the window, where the policy did not run, or in a file recorded before).
        experts_moved: experts that crossed ranks, over the layers; ``bytes_moved``: those experts x one
            expert's bytes in their layer (estimated: what the ranks received together);
            ``layers_changed``. A skipped one moved nothing.
    """

    event: ClassVar[str] = "rearrangement"
    rearrangement: int | None = _f(_optional(_positive))
    policy: str = _f(_str)
    skipped: str | None = _f(_optional(_str))
    balancedness_before: float | None = _f(_optional(_number))
    balancedness_planned: float | None = _f(_optional(_number))
    load_estimate: str = _f(_str, "window")
    estimate_balancedness_before: float | None = _f(_optional(_number), None)
    estimate_balancedness_planned: float | None = _f(_optional(_number), None)
    experts_moved: int = _f(_count)
    bytes_moved: int = _f(_count)
    layers_changed: int = _f(_count)


@dataclass(frozen=True, kw_only=True)
class RearrangementRealisedRecord(Record):
    """A window with load closed: the balance the placement in force really served, for the last
    ``rearrangement`` with an index (done or skipped), beside that record's figures (copied).

    Attributes:
        balancedness_realised: the new window's load under the placement in force (the one the
            ``rearrangement`` left: its own, or the one it kept).
        placed_by: the rearrangement that made that placement (None: serving's start placement);
            ``windows_realised``: the windows with load closed under it, this one included;
            ``balancedness_realised_mean``: their mean balancedness under it (the realised balance over the
            windows it served so far). The three are None in a file recorded before they were.
    """

    event: ClassVar[str] = "rearrangement_realised"
    rearrangement: int = _f(_positive)
    skipped: str | None = _f(_optional(_str))
    balancedness_before: float | None = _f(_optional(_number))
    balancedness_planned: float | None = _f(_optional(_number))
    load_estimate: str = _f(_str, "window")
    estimate_balancedness_before: float | None = _f(_optional(_number), None)
    estimate_balancedness_planned: float | None = _f(_optional(_number), None)
    balancedness_realised: float = _f(_number)
    placed_by: int | None = _f(_optional(_positive), None)
    windows_realised: int | None = _f(_optional(_positive), None)
    balancedness_realised_mean: float | None = _f(_optional(_number), None)


@dataclass(frozen=True, kw_only=True)
class CommitRecord(Record):
    """One layer of a rearrangement committed (the start-up install's layers have none: its
    ``initial_placement`` record).

    Attributes:
        rearrangement, layer: which.
        publish_to_acknowledge_s: from the step boundary at which the runner thread first saw the layer
            published (or its move) to the acknowledgement of the staging buffer; None when not seen.
        bytes_received: what this rank's communicator measured receiving for the layer.
        placement: ``(P,)``, the layer's committed ``physical_to_logical_map`` row (None in a file
            recorded before it was).
    """

    event: ClassVar[str] = "commit"
    rearrangement: int = _f(_positive)
    layer: int = _f(_count)
    publish_to_acknowledge_s: float | None = _f(_optional(_number))
    bytes_received: int = _f(_count)
    placement: tuple[int, ...] | None = _f(_optional(_row), None)


@dataclass(frozen=True, kw_only=True)
class WorkerFailureRecord(Record):
    """The watchdog's decision (``ascend_eplb.integration.watchdog``): ``kind`` (died, stalled), the
    ``ranks``, the ``layer`` in flight and the ``cause``."""

    event: ClassVar[str] = "worker_failure"
    kind: str = _f(_str)
    ranks: tuple[int, ...] = _f(_ints)
    layer: int | None = _f(_optional(_count))
    cause: str = _f(_str)


@dataclass(frozen=True, kw_only=True)
class VerifierViolationRecord(Record):
    """A serving verifier check failed (written just before the verifier raises): the ``check``, the
    ``layer``, the ``rank`` that found it, the ``slot`` and the ``message``."""

    event: ClassVar[str] = "verifier_violation"
    check: str = _f(_str)
    layer: int | None = _f(_optional(_count))
    rank: int = _f(_count)
    slot: int | None = _f(_optional(_count))
    message: str = _f(_str)


#: The fields a ``rearrangement_realised`` record copies from its ``rearrangement`` record.
_REALISED_COPIES = (
    "skipped",
    "balancedness_before",
    "balancedness_planned",
    "load_estimate",
    "estimate_balancedness_before",
    "estimate_balancedness_planned",
)

#: Every record kind by its ``event`` name: the schema of the file.
RECORD_KINDS: dict[str, type[Record]] = {
    kind.event: kind
    for kind in (
        RunStartRecord,
        InitialPlacementRecord,
        WindowRecord,
        RearrangementRecord,
        RearrangementRealisedRecord,
        CommitRecord,
        WorkerFailureRecord,
        VerifierViolationRecord,
    )
}


# ---------------------------------------------------------------------------------------------------- writing


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


@dataclass
class _Cycle:
    """A rearrangement in flight for one model: its window and the placement it started from."""

    index: int
    load: torch.Tensor  # float64 (L, E)
    old: torch.Tensor  # int64 (L, P)
    num_ranks: int
    policy: str
    load_estimate: str
    decision: Any = None

    def balancedness_of(self, placement: torch.Tensor) -> float:
        return measures.mean_balancedness(measures.rank_loads(self.load, placement, self.num_ranks))


class EventsRecorder:
    """The records of one controller's models: written to ``path`` by EP rank 0, and published on the
    controller's event bus as :class:`EventsRecord` on every rank. A rank with neither a file to write
    nor a subscriber of :class:`EventsRecord` (at model registration) records nothing.

    Use :meth:`attach` (``create_eplb_controller`` does when :func:`events_path` is set or the Prometheus
    metrics are on). A one-line INFO log per rearrangement, done or skipped by the gate (EP rank 0), says
    the same for people reading logs.

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
        self._cycles: dict[str, _Cycle] = {}
        self._published: dict[tuple[str, int], float] = {}
        self._bytes_seen: dict[str, int] = {}
        # Per model: the last rearrangement with an index, until the next window realises it.
        self._unrealised: dict[str, RearrangementRecord] = {}
        # Per model: the rearrangement whose placement is in force (None: the start placement) and the
        # balancedness of each window with load closed under it.
        self._in_force: dict[str, tuple[int | None, list[float]]] = {}
        self._rank: int | None = None

    def attach(self, bus: EventBus) -> None:
        """Subscribe to a controller's event bus (control's ``AscendEPLBController.bus``, once, when the
        controller is built): its models' registration, steps, rearrangements and commits, and the
        ``worker_failure`` and ``verifier_violation`` events of the watchdog and the verifier."""
        from ascend_eplb.control.initial_placement import InitialPlacementEvent  # imports vLLM

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
        if not self._active and self._rank == 0:
            # This server's first record, in its file and to the records' subscribers alike: every reader
            # starts its run here.
            self._emit(RunStartRecord(**self._stamp(), model=None, run_id=uuid.uuid4().hex, pid=os.getpid()))
        self._active = True

    def _stamp(self) -> dict[str, Any]:
        return {"time": time.time(), "step": self.steps}

    def _emit(self, record: Record) -> None:
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
        from vllm.distributed.parallel_state import get_ep_group

        state = event.state
        num_ranks = get_ep_group().world_size
        for key, ms in state.model_states.items():
            load = ms.last_expert_load
            if load is None or not bool((load > 0).any()):
                # A model without load in the window kept its placement: its rearrangement record
                # (skipped, "no_load") was written when the state decided it; it has no window.
                continue
            name, old = ms.model_name, ms.physical_to_logical_map.detach().cpu().clone()
            window = load.detach().cpu()
            settings = state.policy_settings
            cycle = _Cycle(
                state.num_rearrangements,
                window.to(torch.float64),
                old,
                num_ranks,
                settings.policy,
                settings.load_estimate,
            )
            realised = cycle.balancedness_of(old)
            placed_by, served = self._in_force.setdefault(name, (None, []))
            served.append(realised)
            done = self._unrealised.pop(name, None)
            if done is not None:
                self._emit(RearrangementRealisedRecord(
                    **self._stamp(), model=name, rearrangement=done.rearrangement,
                    **{f: getattr(done, f) for f in _REALISED_COPIES}, balancedness_realised=realised,
                    placed_by=placed_by, windows_realised=len(served),
                    balancedness_realised_mean=math.fsum(served) / len(served),
                ))  # fmt: skip
            self._cycles[name] = cycle
            self._bytes_seen[name] = _bytes_received(ms)
            stats = ms.eplb_stats  # what upstream's rearrange handed its policy for this window
            groups, nodes = (None, None) if stats is None else (stats.num_groups, stats.num_nodes)
            num_logical, (num_layers, num_physical) = int(window.shape[1]), (int(d) for d in old.shape)
            # EPLB off: upstream's initial placement (its redundant slots replicate experts 0..R-1).
            initial = measures.upstream_initial_placement(num_logical, num_physical - num_logical, num_layers)
            selections = event.new_selections.get(key)  # the load estimate's evidence (None: it is off)
            self._emit(WindowRecord(
                **self._stamp(), model=name, rearrangement=state.num_rearrangements,
                load=tuple(map(tuple, window.to(torch.int64).tolist())),
                balancedness=cycle.balancedness_of(old), balancedness_eplb_off=cycle.balancedness_of(initial),
                num_ranks=num_ranks,
                num_physical_experts=num_physical, num_expert_groups=int(groups) if is_int(groups) else None,
                num_nodes=int(nodes) if is_int(nodes) else None,
                new_selections=None if selections is None else tuple(map(tuple, selections.tolist())),
            ))  # fmt: skip

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
        self._emit(CommitRecord(
            **self._stamp(), model=name, rearrangement=event.rearrangement, layer=event.layer,
            publish_to_acknowledge_s=None if published is None else self.clock() - published,
            bytes_received=delta,
            placement=tuple(model_state.physical_to_logical_map[event.layer].detach().cpu().tolist()),
        ))  # fmt: skip
        if event.layer == model_state.physical_to_logical_map.shape[0] - 1:
            self._finish_cycle(model_state)

    def _on_decision(self, event: DecisionEvent) -> None:
        """The policy's and the gain gate's decision (control's ``DecisionEvent``): a skipped window's
        ``rearrangement`` record at once; a planned one waits for its last commit (:meth:`_finish_cycle`)."""
        if not self._active:
            return
        name, decision = event.model_name, event.decision
        cycle = self._cycles.get(name) if event.rearrangement is not None else None
        if decision.skipped is None:
            if cycle is not None:
                cycle.decision = decision
            return
        if event.rearrangement is not None:
            self._cycles.pop(name, None)  # upstream still commits the unchanged layers: no record then
        self._record_rearrangement(RearrangementRecord(
            **self._stamp(), model=name, rearrangement=event.rearrangement, policy=decision.policy,
            skipped=decision.skipped,
            balancedness_before=None if cycle is None else cycle.balancedness_of(cycle.old),
            balancedness_planned=None if cycle is None else decision.window_balancedness_planned,
            **_on_estimate(decision if cycle is not None else None), load_estimate=decision.load_estimate,
            experts_moved=0, bytes_moved=0, layers_changed=0,
        ))  # fmt: skip

    def _finish_cycle(self, model_state: Any) -> None:
        cycle = self._cycles.pop(model_state.model_name, None)
        if cycle is None:
            return
        new = model_state.physical_to_logical_map.detach().cpu()
        moved = measures.moved_experts(cycle.old, new, cycle.num_ranks)
        nbytes = metrics.expert_bytes(model_state.model.expert_weights)
        self._record_rearrangement(RearrangementRecord(
            **self._stamp(), model=model_state.model_name, rearrangement=cycle.index, policy=cycle.policy,
            skipped=None, balancedness_before=cycle.balancedness_of(cycle.old),
            balancedness_planned=cycle.balancedness_of(new), load_estimate=cycle.load_estimate,
            **_on_estimate(cycle.decision), experts_moved=int(moved.sum()),
            bytes_moved=metrics.bytes_moved(moved, nbytes),
            layers_changed=int((cycle.old != new).any(dim=1).sum()),
        ))  # fmt: skip

    def _record_rearrangement(self, r: RearrangementRecord) -> None:
        self._emit(r)
        if r.rearrangement is not None:
            self._unrealised[r.model] = r
        if r.rearrangement is not None and r.skipped is None:
            self._in_force[r.model] = (r.rearrangement, [])
        if self._rank != 0 or r.skipped == "no_load":  # the state logs a run of windows without load
            return
        from vllm.logger import init_logger

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
        record; the layers' ``move`` marks are dropped so that the first rearrangement's commits time
        from their own publication)."""
        model_state = event.model_state
        name = event.model_name
        for layer in range(int(model_state.physical_to_logical_map.shape[0])):
            self._published.pop((name, layer), None)
        if not self._active:
            return
        new = model_state.physical_to_logical_map.detach().cpu()
        received = _bytes_received(model_state)
        self._bytes_seen[name] = received
        moved = measures.moved_experts(event.previous, new, event.num_ranks)
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


def _on_estimate(decision: Any) -> dict[str, float | None]:
    """A record's figures on the load estimate from the policy's ``PlacementDecision`` (its own figures
    are on the load it planned on): None where it planned on the window, or made no decision (upstream's
    policy unwrapped)."""
    if decision is None or decision.load_estimate == "window":
        return {"estimate_balancedness_before": None, "estimate_balancedness_planned": None}
    return {
        "estimate_balancedness_before": decision.balancedness_before,
        "estimate_balancedness_planned": decision.balancedness_planned,
    }


def _bytes_received(model_state: Any) -> int:
    """metrics.bytes_received, 0 when the communicator keeps no statistics (the records' deltas are 0)."""
    received = metrics.bytes_received(model_state)
    return 0 if received is None else received


# ---------------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Run:
    """The records one server appended, in file order, as ``(line number, record)``.

    Attributes:
        number: 1-based, in file order.
        records: its records (every kind).
    """

    number: int
    records: tuple[tuple[int, Record], ...]

    @property
    def lines(self) -> str:
        """``"lines A-B"``: where it is in the file."""
        return f"lines {self.records[0][0]}-{self.records[-1][0]}"

    def of(self, kinds: type[Record] | tuple[type[Record], ...], model: str | None) -> list[tuple[int, Any]]:
        """Its records of ``kinds`` about ``model``, in order."""
        return [(n, r) for n, r in self.records if isinstance(r, kinds) and r.model == model]

    def models(self, kinds: type[Record] | tuple[type[Record], ...]) -> dict[str | None, int]:
        """How many records of ``kinds`` each model has, the models in order of their first record."""
        counts: dict[str | None, int] = {}
        for _, record in self.records:
            if isinstance(record, kinds):
                counts[record.model] = counts.get(record.model, 0) + 1
        return counts

    def main_model(
        self, kinds: type[Record] | tuple[type[Record], ...], among: list[str | None] | None = None
    ) -> str | None:
        """The model with the most records of ``kinds`` (on a tie a target before a draft, a draft's name
        ending in ``model_names.DRAFT_SUFFIX`` as upstream names it, then the first; only models
        ``among`` when given): the one model a reader of this run takes unless told another (a stray
        record of another model does not make it that model's; nor does an MoE draft, recorded window
        for window beside its target, first in the file because upstream registers it first)."""
        counts = {m: n for m, n in self.models(kinds).items() if among is None or m in among}
        return max(counts, key=lambda m: (counts[m], not is_draft(m))) if counts else None

    def layout(self, model: str | None, path: Path) -> tuple[int | None, int | None]:
        """``(num_physical_experts, num_ranks)`` ``model`` was served with in this run, as its ``window``
        and ``initial_placement`` records state them (None: none states it).

        Raises:
            ValueError: two records state different ones (one server serves one layout), naming the file,
                both lines and both values.
        """
        first: tuple[int, int | None, int | None] | None = None
        for number, record in self.of((WindowRecord, InitialPlacementRecord), model):
            if isinstance(record, WindowRecord):
                stated = (record.num_physical_experts, record.num_ranks)
            else:
                stated = (len(record.placement[0]), record.num_ranks)
            if None in stated:
                continue
            if first is None:
                first = (number, *stated)
            elif stated != first[1:]:
                raise ValueError(
                    f"{path}:{number}: model {model}'s {record.event} record states num_physical_experts="
                    f"{stated[0]} on num_ranks={stated[1]}, line {first[0]} of its run num_physical_experts="
                    f"{first[1]} on num_ranks={first[2]}: one server serves one layout (records of two "
                    "servers without a run_start between them?)"
                )
        return (None, None) if first is None else first[1:]

    def served_models(self, kinds: type[Record] | tuple[type[Record], ...]) -> list[str | None]:
        """The models one server balanced in this run, as far as its records of ``kinds`` tell: the
        :meth:`main_model` and, when the run records one, its MoE draft (``"<main> (draft)"``,
        registered by upstream beside it), in the order of their first record. Any other model's records
        are a stray's."""
        main = self.main_model(kinds)
        return [m for m in self.models(kinds) if m == main or (main is not None and m == main + DRAFT_SUFFIX)]


@dataclass(frozen=True)
class EventsFile:
    """An events file read whole (:func:`read_events`).

    Attributes:
        path: the file.
        runs: its runs, oldest first (none for a file without records).
        truncated_line: the number of a truncated last line that was skipped, or None.
    """

    path: Path
    runs: tuple[Run, ...]
    truncated_line: int | None = None

    def last_run(self, kinds: type[Record] | tuple[type[Record], ...]) -> Run | None:
        """The last run holding a record of ``kinds`` (None: none does)."""
        return next((run for run in reversed(self.runs) if run.models(kinds)), None)

    def where(
        self,
        run: Run,
        model: str | None,
        kinds: type[Record] | tuple[type[Record], ...],
        *,
        beside: tuple[str | None, ...] = (),
    ) -> str:
        """What a reader of ``model``'s records (and of the models ``beside`` it) in ``run`` read, when
        the file holds more: the run among the file's runs, the models among the run's models (``""``
        when there is nothing else)."""
        parts = []
        if len(self.runs) > 1:
            explicit = [isinstance(r.records[0][1], RunStartRecord) for r in self.runs]
            how = (
                "each starts at a server's run_start record"
                if all(explicit)
                else "a run starts where the step or the rearrangement counter starts again"
                if not any(explicit)
                else "a run starts at a server's run_start record; in records without one (an earlier "
                "ascend-eplb-integration's), where the step or the rearrangement counter starts again"
            )
            parts.append(
                f"{self.path} holds {len(self.runs)} runs ({how}); run {run.number}, {run.lines}, is read"
            )
        read = (model, *beside)
        others = [f"{m} ({n})" for m, n in run.models(kinds).items() if m not in read]
        if others:
            whose = f"model {model}'s" if not beside else f"models {', '.join(map(str, read))}'"
            parts.append(f"only {whose} records are read; the run also records {', '.join(others)}")
        return "; ".join(parts)

    def recorded_loads(self) -> tuple[RecordedLoad, ...]:
        """The ``window`` records of each model one server balanced in the last run that has any
        (:meth:`Run.served_models`: the main model and its MoE draft), each as :meth:`recorded_load`
        gives it, in the order of their first record; each ``note`` says what else the file holds.

        Raises:
            ValueError: as :meth:`recorded_load`.
        """
        run = self.last_run(WindowRecord)
        if run is None:
            return (self.recorded_load(),)  # refused: its reason says why there is no window
        served = tuple(run.served_models(WindowRecord))
        note = self.where(run, served[0], WindowRecord, beside=served[1:])
        return tuple(replace(self.recorded_load(model), note=note) for model in served)

    def recorded_load(self, model: str | None = None) -> RecordedLoad:
        """The ``window`` records of one model in the last run that has any (:meth:`Run.main_model`, or
        ``model``): its windows and the configuration they record.

        Raises:
            ValueError: no window record (the message says why when a truncated line was skipped), or
                two windows of different shapes (naming the file and the line).
        """
        run = self.last_run(WindowRecord)
        if run is None:
            why = (
                f"its last line was truncated and skipped: {self.path}:{self.truncated_line}"
                if self.truncated_line is not None
                else "no load was recorded"
            )
            raise ValueError(f"{self.path}: the events file holds no complete 'window' record ({why})")
        model = run.main_model(WindowRecord) if model is None else model
        windows = run.of(WindowRecord, model)
        if not windows:
            raise ValueError(f"{self.path}: run {run.number} holds no 'window' record of model {model}")
        shape = (len(windows[0][1].load), len(windows[0][1].load[0]))
        for number, record in windows:
            got = (len(record.load), len(record.load[0]))
            if got != shape:
                raise ValueError(
                    f"{self.path}:{number}: window load shape {got} differs from the earlier {shape}"
                )
            new = record.new_selections
            if new is not None and (len(new), len(new[0])) != shape:
                raise ValueError(
                    f"{self.path}:{number}: window new_selections shape {(len(new), len(new[0]))} differs "
                    f"from its load's {shape}"
                )
        num_physical, num_ranks = run.layout(model, self.path)
        groups = [r.num_expert_groups for _, r in windows if r.num_expert_groups is not None]
        nodes = [r.num_nodes for _, r in windows if r.num_nodes is not None]
        evidence = [r.new_selections for _, r in windows]
        return RecordedLoad(
            source=str(self.path),
            model=model,
            windows=tuple(torch.tensor(r.load, dtype=torch.int64) for _, r in windows),
            num_physical_experts=num_physical,
            num_ranks=num_ranks,
            num_expert_groups=groups[-1] if groups else None,
            num_nodes=nodes[-1] if nodes else None,
            new_selections=None
            if None in evidence
            else tuple(torch.tensor(e, dtype=torch.int64) for e in evidence),
            note=self.where(run, model, WindowRecord),
        )


@dataclass(frozen=True)
class RecordedLoad:
    """The windows of one model in one run of an events file (:meth:`EventsFile.recorded_load`).

    Attributes:
        source: the file.
        model: whose windows.
        windows: int64 ``(L, E)`` each, oldest first (at least one).
        num_physical_experts, num_ranks: P and N of the last window stating both (None: recorded before
            they were).
        num_expert_groups, num_nodes: of the last window stating each (None: not recorded).
        new_selections: int64 ``(L, E)`` per window, the load estimate's evidence (the selections since
            the previous rearrangement), when every window records it (None otherwise).
        note: what else the file holds that was not read (other runs, other models), or ``""``.
    """

    source: str
    model: str | None
    windows: tuple[torch.Tensor, ...]
    num_physical_experts: int | None
    num_ranks: int | None
    num_expert_groups: int | None
    num_nodes: int | None
    new_selections: tuple[torch.Tensor, ...] | None = None
    note: str = ""


def read_events(
    path: str | os.PathLike[str], *, stacklevel: int = 2, text: str | bytes | None = None
) -> EventsFile:
    """Every record of an events file, each through its :data:`RECORD_KINDS` class, split into runs.

    A run starts at each ``run_start`` record (:class:`RunStartRecord`: a server's first). The records
    before the first one (a file recorded by an earlier ascend-eplb-integration) are split as they were:
    at the first record, at a record whose ``step`` is below the one before, at a ``window`` whose
    ``rearrangement`` is not above the model's previous window's in the run, and at an
    ``initial_placement`` record after any other record of its model. Lines of an unknown ``event``
    (a later writer's kinds) are skipped.

    Args:
        text: the file's text or bytes when read already (the placement reader's, the tools'); else it is
            read (:func:`~ascend_eplb.integration.regular_files.read_regular_file`, up to an events file's
            cap).

    Raises:
        ValueError: naming the file (and the line): missing, not a regular file (a FIFO is refused
            before it is opened), unreadable, larger than the cap, not UTF-8, or a line other than a
            truncated last one that is not a JSON object with an ``event`` name, nests too deeply, or is a
            record breaking its kind's schema or whose facts cannot be true together (``num_ranks`` 0, more
            physical experts than upstream takes). A truncated last line (a crash while writing) is
            skipped with one ``UserWarning``.
    """
    source = Path(path)
    if text is None:
        try:
            text = read_regular_file(source, EVENTS_FILE)
        except RegularFileError as e:
            raise ValueError(f"{source}: cannot read the events file: {e.reason}") from None
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}: not UTF-8 text (byte {e.start}); not an events file") from None
    lines = text.split("\n")
    complete_end = text.endswith("\n")
    records: list[tuple[int, Record]] = []
    truncated = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not complete_end:
                warnings.warn(
                    f"{source}:{number}: truncated last line skipped ({e.msg})", stacklevel=stacklevel
                )
                truncated = number
                continue
            raise ValueError(f"{source}:{number}: not a JSON object ({e.msg})") from None
        except RecursionError:
            raise ValueError(f"{source}:{number}: not an events record (JSON nested too deeply)") from None
        if not isinstance(data, dict) or not isinstance(data.get("event"), str):
            raise ValueError(f"{source}:{number}: not an events record (an object with an 'event' name)")
        kind = RECORD_KINDS.get(data["event"])
        if kind is None:
            continue
        try:
            records.append((number, kind.from_json(data)))
        except ValueError as e:
            raise ValueError(f"{source}:{number}: {e}") from None
    return EventsFile(source, _runs(records), truncated)


def _runs(records: list[tuple[int, Record]]) -> tuple[Run, ...]:
    """``records`` split where a run starts (:func:`read_events`): at each ``run_start``; before the first
    one, where the counters start again."""
    groups: list[list[tuple[int, Record]]] = []
    step = -1
    windows: dict[str | None, int] = {}  # per model, the last window's rearrangement in the current run
    kinds: set[tuple[str | None, str]] = set()  # (model, event) seen in the current run
    explicit = False  # the current run started at a run_start record: only the next one ends it
    for number, record in records:
        if isinstance(record, RunStartRecord):
            explicit = True
            restart = True
        elif explicit:
            restart = False
        else:
            restart = not groups or record.step < step
            if isinstance(record, WindowRecord):
                restart = restart or record.rearrangement <= windows.get(record.model, 0)
            if isinstance(record, InitialPlacementRecord):
                restart = restart or any(model == record.model for model, _ in kinds)
        if restart:
            groups.append([])
            windows.clear()
            kinds.clear()
        groups[-1].append((number, record))
        step = record.step
        kinds.add((record.model, record.event))
        if isinstance(record, WindowRecord):
            windows[record.model] = record.rearrangement
    return tuple(Run(i, tuple(group)) for i, group in enumerate(groups, start=1))
