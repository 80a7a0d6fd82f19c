"""The events file's schema (its record classes), its one reader (``read_events``: runs, the model read)
and its writer, on exact records; hostile files refused with one message naming the file."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace

import pytest
import torch

from ascend_eplb.integration.events.reader import read_events
from ascend_eplb.integration.events.recorder import EventsWriter
from ascend_eplb.integration.events.records import (
    RECORD_KINDS,
    CommitRecord,
    InitialPlacementRecord,
    RearrangementRealisedRecord,
    RearrangementRecord,
    RunStartRecord,
    VerifierViolationRecord,
    WindowRecord,
    WorkerFailureRecord,
)
from ascend_eplb.integration.guardrail_facts import events_path

ROW = (0, 1, 2, 3, 0, 1)


def _window(
    step: int, rearrangement: int, model: str | None = "m", load=((5, 1, 1, 1), (1, 1, 1, 5))
) -> WindowRecord:
    return WindowRecord(
        time=1.5, step=step, model=model, rearrangement=rearrangement, load=load, balancedness=0.5,
        balancedness_eplb_off=0.25, num_ranks=2, num_physical_experts=6, num_expert_groups=1, num_nodes=1,
        new_selections=load,
    )  # fmt: skip


def _commit(step: int, rearrangement: int, layer: int, model: str | None = "m", row=ROW) -> CommitRecord:
    return CommitRecord(
        time=2.0, step=step, model=model, rearrangement=rearrangement, layer=layer,
        publish_to_acknowledge_s=0.125, bytes_received=4096, placement=row,
    )  # fmt: skip


#: A server's first record.
RUN_START = RunStartRecord(time=0.5, step=0, model=None, run_id="0" * 32, pid=4242)
#: One record of every other kind, as the recorder makes them.
EVERY_KIND = [
    InitialPlacementRecord(
        time=1.0, step=0, model="m", source="p.json", num_logical_experts=4, num_ranks=2,
        placement=(ROW, ROW), layers_changed=1, experts_moved=3, bytes_moved=3 * 4096, bytes_received=4096,
    ),
    _window(3, 1),
    _commit(4, 1, 0),
    RearrangementRecord(
        time=3.0, step=5, model="m", rearrangement=1, policy="default", skipped=None, balancedness_before=0.5,
        balancedness_planned=0.9, load_estimate="pooled", estimate_balancedness_before=0.625,
        estimate_balancedness_planned=0.96875, experts_moved=4, bytes_moved=4 * 4096, layers_changed=2,
    ),
    RearrangementRealisedRecord(
        time=4.0, step=7, model="m", rearrangement=1, skipped=None, balancedness_before=0.5,
        balancedness_planned=0.9, load_estimate="pooled", estimate_balancedness_before=0.625,
        estimate_balancedness_planned=0.96875, balancedness_realised=0.875, placed_by=1, windows_realised=1,
        balancedness_realised_mean=0.875,
    ),
    WorkerFailureRecord(time=5.0, step=8, model=None, kind="died", ranks=(1,), layer=None, cause="boom"),
    VerifierViolationRecord(
        time=6.0, step=9, model="m", check="lookups", layer=1, rank=0, slot=None, message="differs"
    ),
]  # fmt: skip


def _write(path, records, tail: str = "") -> None:
    writer = EventsWriter(path)
    for record in records:
        writer.write(record)
    writer.close()
    if tail:
        with open(path, "a") as f:
            f.write(tail)


def test_every_record_kind_is_written_and_read_back_equal(tmp_path):
    every = [RUN_START, *EVERY_KIND]
    assert {type(r) for r in every} == set(RECORD_KINDS.values())  # the test covers the schema
    path = tmp_path / "events.jsonl"
    _write(path, every)
    lines = path.read_text().splitlines()
    # Each line is the record's JSON form: its event name first, then every field, tuples as lists.
    assert json.loads(lines[3]) == {
        "event": "commit", "time": 2.0, "step": 4, "model": "m", "rearrangement": 1, "layer": 0,
        "publish_to_acknowledge_s": 0.125, "bytes_received": 4096, "placement": [0, 1, 2, 3, 0, 1],
    }  # fmt: skip
    assert lines[3].startswith('{"event":"commit","time":2.0,"step":4,"model":"m",')
    assert json.loads(lines[0]) == {
        "event": "run_start", "time": 0.5, "step": 0, "model": None, "run_id": "0" * 32, "pid": 4242,
    }  # fmt: skip
    read = read_events(path)
    assert [record for _, record in read.runs[0].records] == every
    assert [number for number, _ in read.runs[0].records] == list(range(1, 9))
    assert (len(read.runs), read.truncated_line) == (1, None)
    for record in every:
        assert type(record).from_json(record.to_json()) == record


def test_a_record_breaking_its_schema_is_refused_naming_the_file_the_line_and_the_field(tmp_path):
    path = tmp_path / "events.jsonl"
    good = EVERY_KIND[0].to_json()
    cases = [
        ({**good, "placement": [[0, 1, 2, 3, 0, 1], 5]},
         ":2: an initial_placement's 'placement' must be a non-empty [L][P] list of integer lists, every row "
         "of one length"),
        ({**good, "num_ranks": True}, ":2: an initial_placement's 'num_ranks' must be an integer"),
        ({k: v for k, v in good.items() if k != "source"},
         ":2: an initial_placement record without 'source'"),
        ({**_window(1, 1).to_json(), "load": [[1, 2], [3]]},
         ":2: a window's 'load' must be a non-empty [L][E] list of integers >= 0 (rows of different "
         "lengths)"),
        ({**_window(1, 1).to_json(), "load": [[1.5]]}, ":2: a window's 'load' must be a non-empty [L][E]"),
        ({**_window(1, 1).to_json(), "load": [[2**63]]}, ":2: a window's 'load' must be a non-empty [L][E]"),
        ({**_window(1, 1).to_json(), "balancedness": float("nan")},
         ":2: a window's 'balancedness' must be a finite number"),
        ({**_commit(1, 1, 0).to_json(), "placement": "x"},
         ":2: a commit's 'placement' must be a non-empty [P] list of integer expert ids"),
    ]  # fmt: skip
    for record, message in cases:
        path.write_text(json.dumps(EVERY_KIND[1].to_json()) + "\n" + json.dumps(record) + "\n")
        refused = _refusal(lambda: read_events(path))
        assert refused.startswith(f"{path}{message}"), (refused, message)
    # A line nested deeper than the JSON parser recurses (was a RecursionError traceback).
    path.write_text(json.dumps(EVERY_KIND[1].to_json()) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    refused = _refusal(lambda: read_events(path))
    assert refused == f"{path}:2: not an events record (JSON nested too deeply)"
    for content, message in [
        ('{"event": "window"\n', ":1: not a JSON object"),
        ("[1, 2]\n", ":1: not an events record (an object with an 'event' name)"),
    ]:
        path.write_text(content + json.dumps(EVERY_KIND[1].to_json()) + "\n")
        refused = _refusal(lambda: read_events(path))
        assert refused.startswith(f"{path}{message}")
    # A file recorded before the install counted its bytes, its experts under another name: still read.
    legacy = {k: v for k, v in good.items() if k not in ("experts_moved", "bytes_moved")}
    path.write_text(json.dumps({**legacy, "experts_crossing_ranks": 3}) + "\n")
    ((_, read),) = read_events(path).runs[0].records
    assert (read.experts_moved, read.bytes_moved) == (3, None)
    # A file recorded before planned and realised were complete: the window's figures, the estimate off.
    added = ("load_estimate", "estimate_balancedness_before", "estimate_balancedness_planned", "placed_by",
             "windows_realised", "balancedness_realised_mean", "new_selections")  # fmt: skip
    path.write_text("".join(
        json.dumps({k: v for k, v in r.to_json().items() if k not in added}) + "\n" for r in EVERY_KIND[1:5]
    ))  # fmt: skip
    window, _, done, realised = (r for _, r in read_events(path).runs[0].records)
    assert window.new_selections is None
    assert (done.load_estimate, done.estimate_balancedness_before, done.estimate_balancedness_planned) == (
        "window", None, None,
    )  # fmt: skip
    assert (realised.load_estimate, realised.placed_by, realised.windows_realised) == ("window", None, None)
    assert realised.balancedness_realised_mean is None
    # New selections of another shape than the window's load: refused where the load is read.
    bad = {**_window(1, 1).to_json(), "new_selections": [[1, 2, 3, 4]]}
    path.write_text(json.dumps(bad) + "\n")
    refused = _refusal(lambda: read_events(path).recorded_load())
    assert refused == f"{path}:1: window new_selections shape (1, 4) differs from its load's (2, 4)"
    # A kind this reader does not know (a later writer's) is skipped.
    path.write_text(
        json.dumps({"event": "future", "x": 1}) + "\n" + json.dumps(EVERY_KIND[1].to_json()) + "\n"
    )
    assert [n for n, _ in read_events(path).runs[0].records] == [2]


def test_a_truncated_last_line_is_skipped_with_one_warning(tmp_path):
    path = tmp_path / "events.jsonl"
    _write(path, [_window(1, 1)], tail='{"event": "window", "model": "m", "lo')
    with pytest.warns(UserWarning, match="truncated last line skipped") as caught:
        read = read_events(path)
    assert [str(w.message) for w in caught] == [
        f"{path}:2: truncated last line skipped (Unterminated string starting at)"
    ]
    assert read.truncated_line == 2
    assert len(read.recorded_load().windows) == 1


def test_unreadable_non_utf8_and_non_regular_files_are_refused_before_reading(tmp_path):
    refused = _refusal(lambda: read_events(tmp_path / "missing.jsonl"))
    assert refused == f"{tmp_path / 'missing.jsonl'}: cannot read the events file: no such file"
    path = tmp_path / "binary.jsonl"
    path.write_bytes(b'{"event": "window"}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"binary\.jsonl: not UTF-8 text \(byte 20\); not an events file"):
        read_events(path)
    # A FIFO blocks whoever opens it for reading until a writer comes: refused before it is opened.
    fifo = tmp_path / "events.jsonl.fifo"
    os.mkfifo(fifo)
    refused = _refusal(lambda: read_events(fifo))
    assert refused == (
        f"{fifo}: cannot read the events file: is a FIFO, not a regular file (reading it would block or "
        "never end); fix: name a regular file; copy what it holds into one first"
    )
    refused = _refusal(lambda: read_events(tmp_path))
    assert refused == (
        f"{tmp_path}: cannot read the events file: is a folder, not a file to read; fix: name the file, not "
        "its folder"
    )


def test_the_writer_appends_flushed_lines_and_refuses_what_it_cannot_append_to(tmp_path):
    path = tmp_path / "sub" / "events.jsonl"
    writer = EventsWriter(path)
    writer.write(_window(1, 1))
    assert path.read_text() == json.dumps(_window(1, 1).to_json(), separators=(",", ":")) + "\n"  # flushed
    writer.close()
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert _refusal(lambda: EventsWriter(blocker / "events.jsonl")) == (
        f"ASCEND_EPLB_EVENTS={blocker / 'events.jsonl'}: {blocker} is a file, not a folder: nothing can be "
        "created under it"
    )
    # A FIFO: serving's recorder on EP rank 0 would block opening it (no reader); refused, in no time.
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    done = []
    opener = threading.Thread(target=lambda: done.append(_refusal(lambda: EventsWriter(fifo))), daemon=True)
    opener.start()
    opener.join(10)
    assert done == [
        f"ASCEND_EPLB_EVENTS={fifo}: is a FIFO, not a regular file (appending to it would block or never "
        "end); fix: name a regular file"
    ]
    assert events_path({"ASCEND_EPLB_EVENTS": " "}) is None
    assert events_path({"ASCEND_EPLB_EVENTS": "/x/e.jsonl"}) == "/x/e.jsonl"


def _refusal(call) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_run_starts_where_the_step_or_the_rearrangement_counter_starts_again(tmp_path):
    path = tmp_path / "events.jsonl"
    run_1 = [_window(3, 1), _commit(4, 1, 0), _commit(5, 1, 1), _window(11, 2), _commit(12, 2, 0)]
    # Run 2's step counter did not start again (its first record at step 20 > 12), its rearrangement
    # counter did (window 1 after window 2): a new run, not the first one's rearrangement.
    run_2 = [_window(20, 1), _commit(21, 1, 0, row=(3, 2, 1, 0, 3, 0))]
    # Run 3 starts from a placement file: its initial_placement record after run 2's records.
    run_3 = [EVERY_KIND[0], _window(3, 1)]
    # Run 4: the step counter starts again (a window of index 2 at step 1 after step 3).
    run_4 = [_window(1, 2)]
    _write(path, [*run_1, *run_2, *run_3, *run_4])
    read = read_events(path)
    assert [[n for n, _ in run.records] for run in read.runs] == [[1, 2, 3, 4, 5], [6, 7], [8, 9], [10]]
    assert [run.lines for run in read.runs] == ["lines 1-5", "lines 6-7", "lines 8-9", "lines 10-10"]
    # Two models in one run: each model's counter is its own, so the draft's window 1 starts no run.
    _write(tmp_path / "two.jsonl", [_window(3, 1), _window(3, 1, model="draft"), _window(11, 2)])
    assert len(read_events(tmp_path / "two.jsonl").runs) == 1


def test_the_load_read_is_one_model_in_the_last_run_and_says_what_else_the_file_holds(tmp_path):
    path = tmp_path / "events.jsonl"
    stray = _window(2, 1, model="other", load=((9,),))
    later = ((7, 1, 1, 1), (1, 1, 1, 7))
    _write(path, [_window(3, 1), _window(11, 2), _window(1, 1, load=later), stray, _window(9, 2)])
    loaded = read_events(path).recorded_load()
    # The last run (its step counter started again), its model the one with the most windows: the stray
    # window of another model neither makes the run that model's nor is merged into it.
    assert loaded.model == "m"
    assert [w.tolist() for w in loaded.windows] == [[list(r) for r in later], [[5, 1, 1, 1], [1, 1, 1, 5]]]
    assert all(w.dtype == torch.int64 for w in loaded.windows)
    assert (loaded.num_physical_experts, loaded.num_ranks, loaded.num_expert_groups, loaded.num_nodes) == (
        6, 2, 1, 1,
    )  # fmt: skip
    assert loaded.note == (
        f"{path} holds 2 runs (a run starts where the step or the rearrangement counter starts again); "
        "run 2, lines 3-5, is read; only model m's records are read; the run also records other (1)"
    )
    other = read_events(path).recorded_load(model="other")
    assert [w.tolist() for w in other.windows] == [[[9]]]
    # A server balancing an MoE draft beside the target records both, window for window, the draft first
    # (upstream registers it first): the load read is the target's, and the models one server balanced
    # are the target and its draft; another model's records are named as not read.
    draft = ((1, 1, 1, 1),)
    _write(
        tmp_path / "mtp.jsonl",
        [
            _window(3, 1, model="m (draft)", load=draft), _window(3, 1), replace(stray, step=5),
            _window(11, 2, model="m (draft)", load=draft), _window(11, 2),
        ],
    )  # fmt: skip
    mtp = read_events(tmp_path / "mtp.jsonl")
    assert mtp.recorded_load().model == "m"
    both = mtp.recorded_loads()
    assert [(r.model, len(r.windows), tuple(r.windows[0].shape)) for r in both] == [
        ("m (draft)", 2, (1, 4)),
        ("m", 2, (2, 4)),
    ]
    assert {r.note for r in both} == {
        "only models m (draft), m' records are read; the run also records other (1)"
    }
    assert [r.model for r in read_events(path).recorded_loads()] == ["m"]  # no draft: the one model
    # Windows of one model of different shapes in one run: refused, naming the line.
    _write(tmp_path / "shapes.jsonl", [_window(1, 1), _window(2, 2, load=((1,),))])
    assert _refusal(lambda: read_events(tmp_path / "shapes.jsonl").recorded_load()) == (
        f"{tmp_path / 'shapes.jsonl'}:2: window load shape (1, 1) differs from the earlier (2, 4)"
    )
    _write(tmp_path / "none.jsonl", [_commit(1, 1, 0)])
    refused = _refusal(lambda: read_events(tmp_path / "none.jsonl").recorded_load())
    assert refused == (
        f"{tmp_path / 'none.jsonl'}: the events file holds no complete 'window' record (no load was recorded)"
    )


def test_records_whose_facts_cannot_be_true_are_refused_naming_the_line(tmp_path):
    """Issue 43 case 12: ``num_ranks`` 0 or -2, ``num_physical_experts`` 0 or 10**9, a negative step were
    read (plan warned about the ranks, then exported; 10**9 was blamed on redundancy nobody asked for)."""
    path = tmp_path / "events.jsonl"
    window = _window(1, 1).to_json()  # E = 4
    start = EVERY_KIND[0].to_json()  # E = 4, P = 6, N = 2
    cases = [
        ({**window, "num_ranks": 0}, "a window's 'num_ranks' must be an integer >= 1, got 0"),
        ({**window, "num_ranks": -2}, "a window's 'num_ranks' must be an integer >= 1, got -2"),
        ({**window, "num_physical_experts": 0},
         "a window's 'num_physical_experts' must be an integer >= 1, got 0"),
        ({**window, "num_physical_experts": 3},
         "a window's num_physical_experts=3: below its 4 logical experts (every logical expert has a slot)"),
        ({**window, "num_physical_experts": 10**9},
         "a window's num_physical_experts=1000000000: more than its 4 logical experts + 1023 (upstream's "
         "EplbState takes at most that many redundant experts)"),
        ({**window, "num_physical_experts": 7},
         "a window's num_physical_experts=7: not divisible by num_ranks=2 (P / N slots per rank)"),
        ({**window, "step": -3}, "a window's 'step' must be an integer >= 0, got -3"),
        ({**window, "rearrangement": 0}, "a window's 'rearrangement' must be an integer >= 1, got 0"),
        ({**start, "num_ranks": 4},
         "an initial_placement's num_physical_experts=6: not divisible by num_ranks=4 (P / N slots per "
         "rank)"),
        ({**_commit(1, 1, 0).to_json(), "layer": -1}, "a commit's 'layer' must be an integer >= 0, got -1"),
    ]  # fmt: skip
    for record, message in cases:
        path.write_text(json.dumps(window) + "\n" + json.dumps(record) + "\n")
        assert _refusal(lambda: read_events(path)) == f"{path}:2: {message}"


def test_windows_of_one_run_stating_two_layouts_are_refused_not_the_last_taken(tmp_path):
    """Issue 43 case 14: one run's windows with different ``num_physical_experts`` were read, the last
    winning; one server serves one layout."""
    path = tmp_path / "events.jsonl"
    other = WindowRecord(**{**_window(5, 2).__dict__, "num_physical_experts": 8})
    _write(path, [RUN_START, _window(1, 1), other])
    assert _refusal(lambda: read_events(path).recorded_load()) == (
        f"{path}:3: model m's window record states num_physical_experts=8 on num_ranks=2, line 2 of its run "
        "num_physical_experts=6 on num_ranks=2: one server serves one layout (records of two servers "
        "without a run_start between them?)"
    )
    # Each server's own run: read apart, the last one's layout.
    apart = tmp_path / "apart.jsonl"
    _write(apart, [RUN_START, _window(1, 1), RUN_START, other])
    loaded = read_events(apart).recorded_load()
    assert (loaded.num_physical_experts, len(loaded.windows)) == (8, 1)
