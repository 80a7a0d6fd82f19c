"""The serving guardrails' rules without ranks: watchdog settings and decisions, the events file's reader
and writer. (Their multi-rank behaviour runs in ``ascend-eplb simulate``'s tests, with real ranks.)"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest
import torch

from ascend_eplb.integration.events import EventsWriter, events_path, read_windows
from ascend_eplb.integration.watchdog import WorkerWatchdog, watchdog_settings


def test_watchdog_settings_defaults_and_every_bad_value():
    assert watchdog_settings({}) == (600.0, "stop")
    assert watchdog_settings(
        {"ASCEND_EPLB_WORKER_TIMEOUT_S": "2.5", "ASCEND_EPLB_ON_WORKER_FAILURE": "RAISE"}
    ) == (
        2.5,
        "raise",
    )
    for raw in ("0", "-1", "inf", "nan", "ten"):
        with pytest.raises(ValueError, match="ASCEND_EPLB_WORKER_TIMEOUT_S=") as info:
            watchdog_settings({"ASCEND_EPLB_WORKER_TIMEOUT_S": raw})
        assert (
            str(info.value) == f"ASCEND_EPLB_WORKER_TIMEOUT_S={raw!r}: must be a finite number of seconds > 0"
        )
    with pytest.raises(
        ValueError, match=r"ASCEND_EPLB_ON_WORKER_FAILURE='ignore': must be one of stop, raise"
    ):
        watchdog_settings({"ASCEND_EPLB_ON_WORKER_FAILURE": "ignore"})


def _state(*names):
    return SimpleNamespace(model_states={n: SimpleNamespace(model_name=n) for n in names})


def test_watchdog_decides_from_the_gathered_rows_alone():
    dog = WorkerWatchdog(timeout_s=5.0)
    state = _state("m")
    # Rows: [alive, in_cycle, has_pending, ms_without_progress, layer_in_flight] per rank.
    assert dog._decide(state, [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]) is None  # idle
    assert dog._decide(state, [[1, 1, 1, 4000, 3], [1, 1, 0, 4000, 3]]) is None  # within the timeout
    died = dog._decide(state, [[1, 1, 1, 100, 3], [0, 1, 0, 100, 3]])
    assert (died.kind, died.ranks, died.model, died.layer) == ("died", (1,), "m", 3)
    stalled = dog._decide(state, [[1, 1, 1, 5001, 3], [1, 1, 0, 5001, 3]])
    assert (stalled.kind, stalled.ranks, stalled.model, stalled.layer) == ("stalled", (1,), "m", 3)
    assert stalled.cause == (
        "the rearrangement cycle made no progress for 5.0 s (> 5 s, ASCEND_EPLB_WORKER_TIMEOUT_S): "
        "layer 3 was not published by rank(s) 1"
    )
    # A worker dead between cycles is named too, with no cycle in flight.
    idle_dead = dog._decide(state, [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    assert (idle_dead.ranks, idle_dead.model, idle_dead.layer) == ((0,), None, None)
    assert "no cycle in flight" in idle_dead.message()
    with pytest.raises(ValueError, match="on_failure='ignore'"):
        WorkerWatchdog(on_failure="ignore")


def _write(path, *records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


WINDOW = {"event": "window", "model": "m", "load": [[1, 2], [3, 4]]}


def test_read_windows_sums_nothing_and_keeps_order(tmp_path):
    path = tmp_path / "events.jsonl"
    other = {"event": "window", "model": "draft", "load": [[9]]}
    _write(path, {"event": "commit", "layer": 0}, WINDOW, other, {**WINDOW, "load": [[5, 6], [7, 8]]})
    windows = read_windows(path)
    assert [w.tolist() for w in windows] == [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    assert all(w.dtype == torch.int64 for w in windows)
    assert [w.tolist() for w in read_windows(path, model="draft")] == [[[9]]]


def test_read_windows_skips_a_truncated_last_line_with_a_warning(tmp_path):
    path = tmp_path / "events.jsonl"
    _write(path, WINDOW, tail='{"event": "window", "model": "m", "lo')
    with pytest.warns(UserWarning, match=r"events\.jsonl:2: truncated last line skipped"):
        assert len(read_windows(path)) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"event": "window"\n' + json.dumps(WINDOW) + "\n", ":1: not a JSON object"),
        ("[1, 2]\n", ":1: not an events record (an object with an 'event' name)"),
        (json.dumps({**WINDOW, "load": [[1, 2], [3]]}) + "\n", ":1: a window's 'load' must be a non-empty"),
        (json.dumps({**WINDOW, "load": [[1, -2]]}) + "\n", ":1: a window's 'load' must be a non-empty"),
        (json.dumps({**WINDOW, "load": [[1.5]]}) + "\n", ":1: a window's 'load' must be a non-empty"),
        (json.dumps({**WINDOW, "load": [[True]]}) + "\n", ":1: a window's 'load' must be a non-empty"),
        (json.dumps({**WINDOW, "load": [[2**63]]}) + "\n", ":1: a window's 'load' must be a non-empty"),
        (
            json.dumps(WINDOW) + "\n" + json.dumps({**WINDOW, "load": [[1]]}) + "\n",
            ":2: window load shape (1, 1)",
        ),
    ],
)
def test_read_windows_names_the_file_and_line_of_a_malformed_record(tmp_path, content, message):
    path = tmp_path / "events.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"events\.jsonl:") as info:
        read_windows(path)
    assert str(info.value).startswith(str(path) + message)


def test_read_windows_refuses_unreadable_and_non_utf8_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read the events file"):
        read_windows(tmp_path / "missing.jsonl")
    path = tmp_path / "binary.jsonl"
    path.write_bytes(b'{"event": "window"}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"binary\.jsonl: not UTF-8 text \(byte 20\); not an events file"):
        read_windows(path)


def test_events_writer_appends_flushed_lines_and_names_an_unwritable_path(tmp_path):
    path = tmp_path / "sub" / "events.jsonl"
    writer = EventsWriter(path)
    writer.write({"event": "window", "model": "m", "load": [[1]]})
    assert path.read_text() == '{"event":"window","model":"m","load":[[1]]}\n'  # flushed, not closed
    writer.close()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(
        ValueError, match=rf"ASCEND_EPLB_EVENTS={blocker / 'events.jsonl'}: cannot append there"
    ):
        EventsWriter(blocker / "events.jsonl")
    assert events_path({"ASCEND_EPLB_EVENTS": " "}) is None
    assert events_path({"ASCEND_EPLB_EVENTS": "/x/e.jsonl"}) == "/x/e.jsonl"


def test_a_bad_verify_or_events_switch_is_refused_not_ignored(tmp_path):
    from ascend_eplb.integration.verify import verify_requested

    assert verify_requested({}) is False
    assert verify_requested({"ASCEND_EPLB_VERIFY": "On"}) is True
    assert verify_requested({"ASCEND_EPLB_VERIFY": "0"}) is False
    with pytest.raises(ValueError, match=r"ASCEND_EPLB_VERIFY='ture': must be one of 1, true, yes, on, 0"):
        verify_requested({"ASCEND_EPLB_VERIFY": "ture"})
    with pytest.raises(ValueError, match=r"is a folder; name the events file"):
        events_path({"ASCEND_EPLB_EVENTS": str(tmp_path)})
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"is not a writable folder"):
        events_path({"ASCEND_EPLB_EVENTS": str(blocker / "sub" / "events.jsonl")})
    assert events_path({"ASCEND_EPLB_EVENTS": str(tmp_path / "new" / "e.jsonl")}) == str(
        tmp_path / "new" / "e.jsonl"
    )
