"""The placement file: the placement a server starts from, read, validated and written in one format.

A placement is upstream's ``physical_to_logical_map``, int ``(L, P)``. Format ``ascend-eplb-placement``
(README "Serving from a placement file"; ``ascend-eplb plan --export-expert-map`` writes it)::

    {"format": "ascend-eplb-placement", "version": 1, "num_moe_layers": L, "num_logical_experts": E,
     "num_physical_experts": P, "num_ranks": N, "source": {...}, "moe_layer_count": L, "layer_list":
     [{"layer_id": l, "device_count": N, "device_list": [{"device_id": r, "device_expert": [ids]}]}]}

``device_expert``: a rank's logical ids in slot order; version 2 holds ``"models": [{"model": NAME, <the
rest of version 1>}]`` beside ``source``. ``moe_layer_count`` and ``layer_list`` are vLLM Ascend's
``expert_map_path`` JSON (its ``expert_file_to_tensor``), so one file serves both. A serving events file
is read as each model's last committed placement. Every refusal is one :class:`PlacementFileError`
(``ValueError``) naming the file and every problem; standard library only at import.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ascend_eplb.control.values import is_int
from ascend_eplb.integration import json_text
from ascend_eplb.integration.events.records import CommitRecord, InitialPlacementRecord, WindowRecord
from ascend_eplb.integration.model_names import is_draft
from ascend_eplb.integration.placement_checks import (
    fact_problems,
    layer_list_entry,
    layer_list_rows,
    map_problems,
    short,
    unknown_keys,
)
from ascend_eplb.integration.regular_files import (
    EVENTS_FILE,
    FileKind,
    RegularFileError,
    read_regular_file,
    write_regular_file,
)

__all__ = [
    "CONFIG_KEY",
    "FACTS",
    "FORMAT",
    "VERSION",
    "VERSION_MODELS",
    "Placement",
    "PlacementFileError",
    "assign_placements",
    "describe_mismatch",
    "dumps",
    "placement_from_map",
    "read_placement",
    "read_placements",
    "write_placement",
    "write_placements",
]

#: The ``additional_config.eplb_config`` key naming a placement file.
CONFIG_KEY = "initial_placement"
#: The ``format`` value of a placement file.
FORMAT = "ascend-eplb-placement"
#: The version of a file of one model's placement (no model named).
VERSION = 1
#: The version of a file of several models' placements, each named (``models``).
VERSION_MODELS = 2
#: The model facts a placement file states, in the order problems are reported.
FACTS = ("num_moe_layers", "num_logical_experts", "num_physical_experts", "num_ranks")
#: What :func:`read_placements` reads, up to an events file's cap (either may be named).
_PLACEMENT_OR_EVENTS = FileKind("a placement or events file", EVENTS_FILE.max_mib)


class PlacementFileError(ValueError):
    """A placement file (or events file) that cannot be served from.

    Attributes:
        path: the file.
        problems: every problem found, each naming its field, the file's value and the rule.
    """

    def __init__(self, path: str | os.PathLike[str], problems: Sequence[str]) -> None:
        self.path = str(path)
        self.problems = list(problems)
        if len(self.problems) == 1:
            super().__init__(f"{self.path}: {self.problems[0]}")
        else:
            lines = [f"{self.path}: {len(self.problems)} problems:"] + [f"  - {p}" for p in self.problems]
            super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Placement:
    """A validated placement and the model facts it was made for.

    Attributes:
        physical_to_logical_map: ``(L, P)`` logical expert id of each physical slot, per MoE layer;
            every id in ``[0, E)``, every logical expert in every layer at least once.
        num_logical_experts: E.
        num_ranks: N (P divisible by N).
        source: where it was read from (a path; for an events file, which commit it ends with).
        model: the model it is for, as upstream's ``EplbModelState.model_name`` names it (a version-2
            file's or an events file's); None: a version-1 file's, for the one model served.
    """

    physical_to_logical_map: tuple[tuple[int, ...], ...]
    num_logical_experts: int
    num_ranks: int
    source: str = ""
    model: str | None = None

    @property
    def num_moe_layers(self) -> int:
        """L."""
        return len(self.physical_to_logical_map)

    @property
    def num_physical_experts(self) -> int:
        """P."""
        return len(self.physical_to_logical_map[0])

    @property
    def num_redundant_experts(self) -> int:
        """P - E."""
        return self.num_physical_experts - self.num_logical_experts

    @property
    def num_local_physical_experts(self) -> int:
        """p = P / N."""
        return self.num_physical_experts // self.num_ranks

    def facts(self) -> dict[str, int]:
        """The four model facts, by :data:`FACTS` name."""
        return {name: getattr(self, name) for name in FACTS}

    def mismatches(
        self,
        *,
        num_moe_layers: int | None = None,
        num_logical_experts: int | None = None,
        num_physical_experts: int | None = None,
        num_ranks: int | None = None,
    ) -> list[str]:
        """Where this placement's facts differ from a model's (a fact given as None is not compared).

        Returns:
            one line per differing fact: ``"<fact>: the file's <value>, the model's <value>"`` (physical
            experts also say both redundant counts); empty when every given fact agrees.
        """
        theirs = {
            "num_moe_layers": num_moe_layers,
            "num_logical_experts": num_logical_experts,
            "num_physical_experts": num_physical_experts,
            "num_ranks": num_ranks,
        }
        out = []
        for name in FACTS:
            want, have = theirs[name], getattr(self, name)
            if want is None or want == have:
                continue
            if name == "num_physical_experts":
                e_model = num_logical_experts if num_logical_experts is not None else self.num_logical_experts
                out.append(
                    f"num_physical_experts: the file's {have} (num_redundant_experts "
                    f"{self.num_redundant_experts}), the model's {want} (num_redundant_experts "
                    f"{want - e_model})"
                )
            else:
                out.append(f"{name}: the file's {have}, the model's {want}")
        return out

    def to_json(self, provenance: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The version-1 document of this placement (the module docstring); ``provenance`` becomes
        ``source`` (omitted when None)."""
        doc: dict[str, Any] = {"format": FORMAT, "version": VERSION, **self.facts()}
        if provenance is not None:
            doc["source"] = dict(provenance)
        return {**doc, **self._layers_json()}

    def model_json(self) -> dict[str, Any]:
        """This placement as an entry of a version-2 file's ``models``: ``model``, the four facts,
        ``moe_layer_count`` and ``layer_list``."""
        return {"model": self.model, **self.facts(), **self._layers_json()}

    def _layers_json(self) -> dict[str, Any]:
        p = self.num_local_physical_experts
        doc: dict[str, Any] = {"moe_layer_count": self.num_moe_layers}
        doc["layer_list"] = [
            {
                "layer_id": layer,
                "device_count": self.num_ranks,
                "device_list": [
                    {"device_id": r, "device_expert": list(row[r * p : (r + 1) * p])}
                    for r in range(self.num_ranks)
                ],
            }
            for layer, row in enumerate(self.physical_to_logical_map)
        ]
        return doc


def placement_from_map(
    physical_to_logical_map: Sequence[Sequence[int]],
    *,
    num_logical_experts: int,
    num_ranks: int,
    source: str = "",
    model: str | None = None,
) -> Placement:
    """A :class:`Placement` of an ``(L, P)`` map (lists, tuples or anything with ``tolist()``), for
    ``model`` (upstream's name; None: the one model served).

    Raises:
        PlacementFileError: every problem of the map (shape, ids, dropped experts) and the facts, under
            ``source``.
    """
    rows = (
        physical_to_logical_map.tolist()
        if hasattr(physical_to_logical_map, "tolist")
        else physical_to_logical_map
    )
    rows = [list(r.tolist() if hasattr(r, "tolist") else r) for r in rows]
    facts = {
        "num_moe_layers": len(rows),
        "num_logical_experts": num_logical_experts,
        "num_physical_experts": len(rows[0]) if rows else 0,
        "num_ranks": num_ranks,
    }
    problems = fact_problems(facts) or map_problems(
        rows, facts, lambda layer, slot: f"layer {layer} slot {slot}"
    )
    if problems:
        where = f"the placement of model {model}" if model is not None else "placement"
        raise PlacementFileError(source or where, problems)
    return Placement(
        tuple(tuple(int(v) for v in r) for r in rows), num_logical_experts, num_ranks, source, model
    )


# ---------------------------------------------------------------------------------------------------- reading


def read_placements(
    path: str | os.PathLike[str], served: Sequence[str] | None = None
) -> tuple[Placement, ...]:
    """Every model's placement a placement file (version 1: the one, unnamed; version 2: each named) or a
    serving events file (each model's last committed placement, named) carries, in the file's order;
    which kind of file is told by content (an events file's first line is an object with ``event``).

    Args:
        served: the names of the models the server balances, when known (:func:`assign_placements`). An
            events file then gives the placements the served models take; records of any other model
            are a stray's (or another server's): not read, never a reason to refuse. A served model the
            file leaves without a placement is refused, with the problems of the incomplete records of
            its name or role when it has some (why they give none).

    Raises:
        PlacementFileError: the file is missing, unreadable, empty, not UTF-8, not JSON (truncated), of
            another format or version, or a model's facts, ``layer_list`` or ids break a rule (every
            problem listed, each naming its model in a version-2 file; an events file: no committed
            placement for some layers, or no recorded configuration).
    """
    source = Path(path)
    try:
        raw = read_regular_file(source, _PLACEMENT_OR_EVENTS)
    except RegularFileError as e:
        # The problem alone: every caller names its own fix (the rule's, simulate's option).
        raise PlacementFileError(source, [f"cannot read the placement file: {e.problem}"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlacementFileError(source, [f"not UTF-8 text (byte {e.start}); not a placement file"]) from None
    if not text.strip():
        raise PlacementFileError(source, ["empty file, not a placement file"])
    if _is_events_file(text):
        return _from_events(source, text, served)
    try:
        data = json_text.loads(text)
    except json_text.DuplicateKeyError as e:
        raise PlacementFileError(source, [f"the key {e.key!r} is given twice in one JSON object"]) from None
    except json.JSONDecodeError as e:
        # The decoder stopped at the end of the text, or in a string that runs to it: the file ends early.
        truncated = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
        ending = " (the file ends early: truncated?)" if truncated else ""
        raise PlacementFileError(
            source, [f"not JSON: {e.msg} at line {e.lineno} column {e.colno}{ending}"]
        ) from None
    except RecursionError:
        raise PlacementFileError(source, ["not a placement file (JSON nested too deeply)"]) from None
    return _from_document(data, source)


#: The keys of a version-1 document, of a version-2 document and of its ``models`` entry.
_DOCUMENT_KEYS = ("format", "version", *FACTS, "source", "moe_layer_count", "layer_list")
_MODELS_DOCUMENT_KEYS = ("format", "version", "source", "models")
_MODEL_KEYS = ("model", *FACTS, "moe_layer_count", "layer_list")


def read_placement(path: str | os.PathLike[str]) -> Placement:
    """The placement of a file that carries one model's (:func:`read_placements`).

    Raises:
        PlacementFileError: as :func:`read_placements`, or the file carries several models' placements
            (naming them).
    """
    placements = read_placements(path)
    if len(placements) != 1:
        names = [p.model for p in placements]
        raise PlacementFileError(
            path,
            [f"carries the placements of {len(placements)} models {names}: read them all (read_placements)"],
        )
    return placements[0]


def _is_events_file(text: str) -> bool:
    first = text.lstrip().split("\n", 1)[0]
    try:
        record = json.loads(first)
    except (json.JSONDecodeError, RecursionError):
        return False
    return isinstance(record, dict) and isinstance(record.get("event"), str)


def _from_document(data: Any, source: Path) -> tuple[Placement, ...]:
    if not isinstance(data, dict):
        raise PlacementFileError(source, [f"a placement file is a JSON object, got {type(data).__name__}"])
    if "format" not in data:
        why = (
            "a vLLM Ascend expert_map_path JSON without the model facts (format, version, num_moe_layers, "
            "num_logical_experts, num_physical_experts, num_ranks); write it with ascend-eplb plan "
            "--export-expert-map"
            if "layer_list" in data
            else f"no 'format' key: not a placement file (format {FORMAT!r})"
        )
        raise PlacementFileError(source, [why])
    if data["format"] != FORMAT:
        raise PlacementFileError(source, [f"format={data['format']!r}: must be {FORMAT!r}"])
    version = data.get("version")
    if not is_int(version) or version not in (VERSION, VERSION_MODELS):
        raise PlacementFileError(
            source, [f"version={version!r}: this ascend-eplb reads versions {VERSION} and {VERSION_MODELS}"]
        )
    if version == VERSION:
        placement, problems = _model_placement(data, source, None)
        if problems:
            raise PlacementFileError(source, problems)
        return (placement,)
    models = data.get("models")
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise PlacementFileError(
            source, [f"models={short(models)}: version {VERSION_MODELS} holds a non-empty list of models"]
        )
    unknown = unknown_keys("", data, _MODELS_DOCUMENT_KEYS)
    if unknown:
        raise PlacementFileError(source, unknown)
    names = [m.get("model") for m in models]
    problems = [
        f"models[{i}].model={short(name)}: must be the model's name (a non-empty string)"
        for i, name in enumerate(names)
        if not isinstance(name, str) or not name
    ]
    repeated = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
    if repeated:
        problems.append(f"models names {repeated} more than once: one placement per model")
    if problems:
        raise PlacementFileError(source, problems)
    placements = []
    for entry in models:
        placement, found = _model_placement(entry, source, entry["model"])
        problems += [f"model {entry['model']}: {p}" for p in found]
        placements.append(placement)
    if problems:
        raise PlacementFileError(source, problems)
    return tuple(placements)


def _model_placement(data: Mapping[str, Any], source: Path, model: str | None) -> tuple[Any, list[str]]:
    """One model's placement of a document (version 1's top level, or an entry of version 2's ``models``)
    and its problems (the placement is None when there are some)."""
    facts = {name: data.get(name) for name in FACTS}
    problems = unknown_keys("", data, _DOCUMENT_KEYS if model is None else _MODEL_KEYS) + fact_problems(facts)
    if problems:
        return None, problems
    rows, problems = layer_list_rows(data, facts)
    if not problems:
        problems = map_problems(rows, facts, lambda layer, slot: layer_list_entry(layer, slot, facts))
    if problems:
        return None, problems
    placement = Placement(
        tuple(tuple(r) for r in rows), facts["num_logical_experts"], facts["num_ranks"], str(source), model
    )
    return placement, []


def _from_events(source: Path, text: str, served: Sequence[str] | None) -> tuple[Placement, ...]:
    """Each model's last committed placement of a serving events file (the module docstring), in the
    order the last run first names them (``served``: :func:`read_placements`)."""
    # local: the events reader imports torch; `ascend-eplb check` and start-up's rules read placement
    # files without it
    from ascend_eplb.integration.events.reader import read_events

    try:
        log = read_events(source, stacklevel=4, text=text)
    except ValueError as e:
        problem = str(e).removeprefix(str(source)).lstrip(":").strip()
        line, colon, rest = problem.partition(": ")
        raise PlacementFileError(
            source, [f"line {line}: {rest}" if colon and line.isdigit() else problem]
        ) from None
    kinds = (WindowRecord, CommitRecord, InitialPlacementRecord)
    run = log.last_run(kinds)
    if run is None:
        raise PlacementFileError(
            source, ["the events file records no placement (no window, commit or initial_placement record)"]
        )
    # Only the last run's placements are served; each model's is built alike, and every model with a
    # complete placement is given (a stray record of a model without one does not make it served).
    found = {model: _committed(run, model, source) for model in run.models(kinds)}
    complete = [got for got in found.values() if isinstance(got, Placement)]
    incomplete = {model: got for model, got in found.items() if not isinstance(got, Placement)}
    if served is not None:
        complete = _served_from_events(source, served, complete, incomplete)
    if complete:
        if len(log.runs) == 1:
            return tuple(complete)
        which = f"run {run.number} of {len(log.runs)} ({run.lines})"
        return tuple(
            replace(
                got, source=got.source.replace(f"of model {got.model}", f"of model {got.model}, {which}", 1)
            )
            for got in complete
        )
    model = run.main_model(kinds)
    problems = incomplete[model]
    note = log.where(run, model, kinds)
    raise PlacementFileError(source, [*problems[:-1], f"{problems[-1]}; {note}" if note else problems[-1]])


def _served_from_events(
    source: Path, served: Sequence[str], complete: list[Placement], incomplete: dict[str | None, list[str]]
) -> list[Placement]:
    """The complete placements of an events file's last run that the ``served`` models take
    (:func:`assign_placements`), in file order. Records of a model no served model takes are a stray's
    or another server's: not read, never a reason to refuse. A served model left without a placement is
    refused: with the problems of the incomplete records of its name or role (why they give none), else
    naming it and what the run records instead."""
    assignment, missing, _ = _assign(complete, served)
    left = [name for name in served if name not in assignment]
    blamed = [
        model
        for model in incomplete
        if any(model == name or is_draft(model) == is_draft(name) for name in left)
    ]
    if blamed:
        raise PlacementFileError(
            source, [f"model {model}: {problem}" for model in blamed for problem in incomplete[model]]
        )
    taken = [p for p in complete if any(p is q for q in assignment.values())]
    if missing:
        ignored = [p.model for p in complete if p not in taken] + list(incomplete)
        note = (
            f" (the run records {', '.join(map(str, ignored))}, which this server does not serve: not read)"
            if ignored
            else ""
        )
        raise PlacementFileError(source, [f"{line}{note}" for line in missing])
    return taken


def _committed(run: Any, model: str | None, source: Path) -> Placement | list[str]:
    """``model``'s last committed placement in ``run``, or the problems that leave it without one."""
    try:
        run.layout(model, source)
    except ValueError as e:
        line, _, rest = str(e).removeprefix(f"{source}:").partition(": ")
        return [f"line {line}: {rest}"]
    facts: dict[str, Any] = dict.fromkeys(FACTS)
    rows: dict[int, tuple[int, ...]] = {}
    last = "no commit"
    unplaced_commits = 0
    for number, record in run.of((WindowRecord, CommitRecord, InitialPlacementRecord), model):
        if isinstance(record, WindowRecord):
            facts.update(num_moe_layers=len(record.load), num_logical_experts=len(record.load[0]))
            if record.num_ranks is not None:
                facts["num_ranks"] = record.num_ranks
            if record.num_physical_experts is not None:
                facts["num_physical_experts"] = record.num_physical_experts
        elif isinstance(record, InitialPlacementRecord):
            rows = dict(enumerate(record.placement))
            facts.update(
                num_moe_layers=len(record.placement), num_logical_experts=record.num_logical_experts,
                num_ranks=record.num_ranks, num_physical_experts=len(record.placement[0]),
            )  # fmt: skip
            last = f"the start-up placement of line {number}"
        elif record.placement is None:
            unplaced_commits += 1
        else:
            rows[record.layer] = record.placement
            last = f"rearrangement {record.rearrangement} layer {record.layer}, line {number}"
    missing = [name for name in FACTS if facts[name] is None]
    if missing:
        return [
            f"the events file does not record {', '.join(missing)} (its window records carry no "
            "num_ranks and num_physical_experts: recorded by an earlier ascend-eplb-integration)"
        ]
    problems = fact_problems(facts)
    if problems:
        return problems
    absent = [layer for layer in range(facts["num_moe_layers"]) if layer not in rows]
    if absent:
        why = (
            f"{unplaced_commits} commit record(s) carry no placement (recorded by an earlier "
            "ascend-eplb-integration)"
            if unplaced_commits
            else "no rearrangement completed while it was recorded, and the run did not start from a "
            "placement file"
        )
        shown = absent if len(absent) <= 8 else [*absent[:8], "..."]
        return [
            f"MoE layer(s) {shown} of {facts['num_moe_layers']} have no committed placement in the file "
            f"({why})"
        ]
    ordered = [rows[layer] for layer in range(facts["num_moe_layers"])]
    extra = sorted(layer for layer in rows if not 0 <= layer < facts["num_moe_layers"])
    problems = (
        [f"commit record of layer {extra[0]}: outside the {facts['num_moe_layers']} MoE layers"]
        if extra
        else []
    )
    problems += map_problems(ordered, facts, lambda layer, slot: f"layer {layer} slot {slot}")
    if problems:
        return problems
    return Placement(
        tuple(ordered), facts["num_logical_experts"], facts["num_ranks"],
        f"{source} (the last committed placement of model {model}: {last})", model,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- writing


def dumps(placements: Placement | Sequence[Placement], provenance: Mapping[str, Any] | None = None) -> str:
    """The text of ``placements``: version 1 of one placement without a model name, version 2 of several
    (or of a named one), each named; indented, each ``device_expert`` list on one line.

    Raises:
        ValueError: a placement of several is unnamed, or two name the same model.
    """
    placements = [placements] if isinstance(placements, Placement) else list(placements)
    if len(placements) == 1 and placements[0].model is None:
        doc = placements[0].to_json(provenance)
    else:
        names = [p.model for p in placements]
        if not placements or None in names or len(set(names)) != len(names):
            raise ValueError(
                f"a placement file of several models names each once (version {VERSION_MODELS}), got {names}"
            )
        doc = {"format": FORMAT, "version": VERSION_MODELS}
        if provenance is not None:
            doc["source"] = dict(provenance)
        doc["models"] = [p.model_json() for p in placements]
    text = json.dumps(doc, indent=1)
    return re.sub(r"\[\s+([-0-9,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def write_placement(
    path: str | os.PathLike[str], placement: Placement, provenance: Mapping[str, Any] | None = None
) -> None:
    """:func:`write_placements` of one placement."""
    write_placements(path, [placement], provenance)


def write_placements(
    path: str | os.PathLike[str],
    placements: Sequence[Placement],
    provenance: Mapping[str, Any] | None = None,
    inputs: Sequence[tuple[str, str | os.PathLike[str] | None]] = (),
) -> None:
    """Write ``placements`` as a placement file (:func:`dumps`) at ``path`` by the one writer
    (:func:`ascend_eplb.integration.regular_files.write_regular_file`): whole or not at all, beside it then
    renamed; only a regular file (or a link to one) is replaced, never ``inputs`` (``(option, path)`` of
    the files the run read).

    Raises:
        ValueError: the file cannot be written (naming it, why and the fix; ``path`` is unchanged then),
            or the placements are not one unnamed or several named ones (:func:`dumps`).
    """
    text = dumps(placements, provenance)
    try:
        write_regular_file(path, text, inputs)
    except RegularFileError as e:
        raise ValueError(f"{path}: cannot write the placement file: {e.reason}") from None


def assign_placements(
    placements: Sequence[Placement], served: Sequence[str]
) -> tuple[dict[str, Placement], list[str]]:
    """Which placement each model of a server starts on, and what does not fit.

    Each served model (``served``: upstream's names, ``EplbModelState.model_name``) takes the placement
    named as it is; else the one placement of its role, target or draft (``model_names.is_draft``; an
    unnamed placement, a version-1 file's, is a target's): a run recorded under one path serves the same
    model under another, or a quantized copy of it (the facts are judged apart).

    Returns:
        ``(assignment, problems)``: ``{served name: placement}``, and one line per served model without a
        placement (none of its name, none or several of its role) and per placement no served model
        takes (it names a model this server does not serve: a placement file's; an events file read
        with ``served`` gives none such, :func:`read_placements`).
    """
    assignment, missing, unserved = _assign(placements, served)
    return assignment, missing + unserved


def _assign(
    placements: Sequence[Placement], served: Sequence[str]
) -> tuple[dict[str, Placement], list[str], list[str]]:
    """:func:`assign_placements`, its problems apart: ``(assignment, missing, unserved)``."""
    assignment: dict[str, Placement] = {}
    taken: set[int] = set()
    for name in served:
        for index, placement in enumerate(placements):
            if index not in taken and placement.model == name:
                assignment[name] = placement
                taken.add(index)
                break
    missing = []
    for name in served:
        if name in assignment:
            continue
        same_role = [
            i for i, p in enumerate(placements) if i not in taken and is_draft(p.model) == is_draft(name)
        ]
        if len(same_role) == 1:
            assignment[name] = placements[same_role[0]]
            taken.add(same_role[0])
        else:
            role = "a draft's" if is_draft(name) else "a target's"
            several = f" ({len(same_role)} of {role} placement: which one is ambiguous)" if same_role else ""
            missing.append(f"has no placement for model {name}{several}")
    unserved = []
    for index, placement in enumerate(placements):
        if index not in taken:
            named = "an unnamed model" if placement.model is None else f"model {placement.model}"
            unserved.append(f"names {named}, which this server does not serve")
    return assignment, missing, unserved


def describe_mismatch(placement: Placement, differ: Sequence[str]) -> str:
    """The ``initial-placement`` rule's message for a placement whose facts differ from the model's."""
    made = (
        f"{placement.num_moe_layers} MoE layers x {placement.num_logical_experts} logical experts, "
        f"{placement.num_physical_experts} slots on {placement.num_ranks} EP ranks"
    )
    model = (
        f" (model {placement.model})"
        if placement.model is not None and placement.model not in placement.source
        else ""
    )
    return (
        f"eplb_config.{CONFIG_KEY}={placement.source}{model}: made for {made}, not this model and layout: "
        + "; ".join(differ)
        + "; fix: export a placement for this model and layout (ascend-eplb plan --export-expert-map) or "
        f"remove {CONFIG_KEY}"
    )
