"""The one reader of an events file (:func:`read_events`): every record through its kind's schema, split
into the runs of the servers that appended them (:class:`Run`), and one model's windows as a
:class:`RecordedLoad` (``plan``, ``simulate --trace``, the placement reader)."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ascend_eplb.integration.events.records import (
    RECORD_KINDS,
    InitialPlacementRecord,
    Record,
    RunStartRecord,
    WindowRecord,
)
from ascend_eplb.integration.model_names import DRAFT_SUFFIX, is_draft
from ascend_eplb.integration.regular_files import EVENTS_FILE, RegularFileError, read_regular_file

__all__ = ["EventsFile", "RecordedLoad", "Run", "read_events"]


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
