"""The events file's one record filter, ``events.model_records``, on exact records: what ``read_windows``,
the placement file's events reader and ``ascend-eplb plan`` keep of a file holding several models."""

from __future__ import annotations

import json

from ascend_eplb.integration.events import model_records, read_records

RECORDS = [
    {"event": "initial_placement", "step": 0, "model": "main", "placement": [[0, 1]]},
    {"event": "window", "step": 3, "model": "main", "rearrangement": 1},
    {"event": "window", "step": 3, "model": "draft", "rearrangement": 1},
    {"event": "rearrangement", "step": 3, "model": "main", "rearrangement": 1},
    {"event": "commit", "step": 4, "model": "draft", "layer": 0},
    {"event": "commit", "step": 5, "model": "main", "layer": 0},
    {"event": "worker_failure", "step": 6, "model": None, "kind": "dead"},
    {"event": "window", "step": 7, "model": "main", "rearrangement": 2},
]
NUMBERED = list(enumerate(RECORDS, start=1))


def test_model_records_keeps_one_models_records_of_the_kinds_asked_in_file_order(tmp_path):
    def lines(*args, **kwargs):
        return [number for number, _ in model_records(NUMBERED, *args, **kwargs)]

    # Default model: the one the first record of the kinds asked names.
    assert lines("window") == [2, 8]
    assert lines(("window", "commit", "initial_placement")) == [1, 2, 6, 8]
    assert lines(("commit",)) == [5]  # the first commit is the draft model's
    assert lines("window", model="draft") == [3]
    assert lines({"commit", "window"}, model="draft") == [3, 5]
    assert lines("worker_failure") == [7]  # named None: kept under the default
    assert lines("window", model="other") == []
    assert lines("verifier_violation") == []
    # The records themselves, not copies, with the line numbers given.
    kept = list(model_records(NUMBERED, "commit", model="main"))
    assert kept == [(6, RECORDS[5])]
    assert kept[0][1] is RECORDS[5]
    # A record of those kinds without a model before any named one is kept; the next names the model.
    unnamed = [(1, {"event": "window", "step": 0}), *NUMBERED[1:3]]
    assert [n for n, _ in model_records(unnamed, "window")] == [1, 2]
    # From a file, read_records' pairs: blank lines keep their numbers.
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS[:3]).replace("\n", "\n\n", 1) + "\n")
    assert [(n, r["model"]) for n, r in model_records(read_records(path), "window")] == [(3, "main")]
