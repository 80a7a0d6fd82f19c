"""The records of the events file (one kind per ``event`` name, :data:`RECORD_KINDS`): each line's schema,
checked field by field when read (:meth:`Record.from_json`) and written as :meth:`Record.to_json` gives it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from ascend_eplb.control.values import is_int
from ascend_eplb.integration.model_facts import MAX_REDUNDANT_EXPERTS

__all__ = [
    "RECORD_KINDS",
    "CommitRecord",
    "InitialPlacementRecord",
    "RearrangementRealisedRecord",
    "RearrangementRecord",
    "Record",
    "RunStartRecord",
    "VerifierViolationRecord",
    "WindowRecord",
    "WorkerFailureRecord",
]


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
            published (or its move) to the acknowledgement of the staging buffer (control's
            ``PublishTimes``, carried by the ``acknowledge`` commit event); None when not seen.
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
