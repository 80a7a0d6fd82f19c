"""The placement file: one versioned format, read back exactly, and every refusal with its field and
values, through start-up validation's rule ``initial-placement`` (the one ``ascend-eplb check`` runs).

The serving side (a world that starts on a file and serves from it) is
the repository's ``tests/test_engine_initial_placement.py`` (through vLLM's own engine)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from ascend_eplb.integration import placement_file as pf
from ascend_eplb.integration.events.recorder import EventsWriter
from ascend_eplb.integration.events.records import RECORD_KINDS
from ascend_eplb.integration.model_names import DRAFT_SUFFIX
from ascend_eplb.integration.rules import Violation, check_settings
from ascend_eplb.integration.settings import ASCEND_V2_KEYS, EplbSettings

#: 2 MoE layers, 4 logical experts, 6 slots on 2 ranks (3 per rank).
ROWS = [[3, 1, 0, 2, 3, 3], [0, 1, 2, 3, 1, 0]]
#: Settings whose model and layout the placement above was made for.
GOOD = EplbSettings(
    enable_eplb=True,
    enable_expert_parallel=True,
    tensor_parallel_size=2,
    window_size=10,
    step_interval=30,
    num_redundant_experts=2,
    num_logical_experts=4,
    quantization="bf16",
    num_moe_layers=2,
)


def _file(tmp_path: Path, doc: dict | None = None, name: str = "placement.json") -> Path:
    path = tmp_path / name
    if doc is None:
        pf.write_placement(path, pf.placement_from_map(ROWS, num_logical_experts=4, num_ranks=2))
    else:
        path.write_text(json.dumps(doc))
    return path


def _doc(tmp_path: Path) -> dict:
    return json.loads(_file(tmp_path).read_text())


def _judge(path: Path, **changes) -> list[Violation]:
    settings = replace(GOOD, ascend_eplb_config={"initial_placement": str(path)}, **changes)
    return list(check_settings(settings))


def test_a_written_file_reads_back_as_its_placement_and_as_vllm_ascends_expert_map(tmp_path):
    path = tmp_path / "placement.json"
    placement = pf.placement_from_map(ROWS, num_logical_experts=4, num_ranks=2, source="plan")
    pf.write_placement(path, placement, {"tool": "test"})
    read = pf.read_placement(path)
    assert read.physical_to_logical_map == ((3, 1, 0, 2, 3, 3), (0, 1, 2, 3, 1, 0))
    assert read.facts() == {
        "num_moe_layers": 2,
        "num_logical_experts": 4,
        "num_physical_experts": 6,
        "num_ranks": 2,
    }
    assert (read.num_redundant_experts, read.num_local_physical_experts, read.source) == (2, 3, str(path))
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["source"]) == ("ascend-eplb-placement", 1, {"tool": "test"})
    # vLLM Ascend's reader (eplb_utils.expert_file_to_tensor): moe_layer_count, then per layer the devices'
    # device_expert lists, in order; nothing else.
    assert doc["moe_layer_count"] == 2
    for layer, row in enumerate(ROWS):
        devices = doc["layer_list"][layer]["device_list"]
        assert doc["layer_list"][layer]["device_count"] == 2
        assert [d["device_expert"] for d in devices] == [row[:3], row[3:]]
    # each device_expert list on one line
    assert '"device_expert": [3, 1, 0]' in path.read_text()
    assert _judge(path) == []


def test_a_file_for_another_model_or_layout_names_each_fact_with_both_values(tmp_path):
    path = _file(tmp_path)
    start = (
        f"eplb_config.initial_placement={path}: made for 2 MoE layers x 4 logical experts, 6 slots on 2 EP "
        "ranks"
    )
    cases = {
        "layers": ({"num_moe_layers": 3}, ["num_moe_layers: the file's 2, the model's 3"]),
        "experts": (
            {"num_logical_experts": 8, "num_redundant_experts": 4},
            [
                "num_logical_experts: the file's 4, the model's 8",
                "num_physical_experts: the file's 6 (num_redundant_experts 2), the model's 12 "
                "(num_redundant_experts 4)",
            ],
        ),
        "ranks": ({"tensor_parallel_size": 3}, ["num_ranks: the file's 2, the model's 3"]),
        "redundant": (
            {"num_redundant_experts": 4},
            [
                "num_physical_experts: the file's 6 (num_redundant_experts 2), the model's 8 "
                "(num_redundant_experts 4)"
            ],
        ),
    }
    for name, (changes, differ) in cases.items():
        violations = _judge(path, **changes)
        assert [v.rule for v in violations] == ["initial-placement"], name
        assert violations[0].message == (
            f"{start}, not this model and layout: {'; '.join(differ)}; fix: export a placement for this "
            "model and layout (ascend-eplb plan --export-expert-map) or remove initial_placement"
        ), name
    # Every differing fact at once.
    both = _judge(path, num_moe_layers=3, tensor_parallel_size=3)
    assert (
        "num_moe_layers: the file's 2, the model's 3; num_ranks: the file's 2, the model's 3"
        in both[0].message
    )


def _refusal(path: Path) -> str:
    violations = _judge(path)
    assert [v.rule for v in violations] == ["initial-placement"]
    message = violations[0].message
    prefix = f"eplb_config.initial_placement={path}: "
    suffix = (
        "; fix: name a placement file of ascend-eplb plan --export-expert-map (or an events file with a "
        "committed placement)"
    )
    assert message.startswith(prefix), message
    assert message.endswith(suffix), message
    return message[len(prefix) : -len(suffix)]


def test_a_dropped_expert_an_id_out_of_range_and_a_broken_layer_list_are_each_named(tmp_path):
    doc = _doc(tmp_path)
    doc["layer_list"][0]["device_list"][1]["device_expert"] = [3, 3, 3]  # layer 0 drops logical expert 2
    doc["layer_list"][1]["device_list"][1]["device_expert"][1] = 4  # E = 4: ids are in [0, 4)
    assert _refusal(_file(tmp_path, doc)) == (
        "layer_list[1].device_list[1].device_expert[1]=4: a logical expert id must be an integer in [0, 4) "
        "(num_logical_experts=4); layer 0: logical expert(s) [2] hold no slot (1 of 4); every logical expert "
        "needs at least one"
    )
    doc = _doc(tmp_path)
    doc["layer_list"][1]["device_list"][1]["device_expert"][0] = -1
    doc["layer_list"][1]["device_list"][1]["device_expert"][1] = True
    assert _refusal(_file(tmp_path, doc)).startswith(
        "layer_list[1].device_list[1].device_expert[0]=-1: a logical expert id must be an integer in [0, 4) "
        "(num_logical_experts=4); layer_list[1].device_list[1].device_expert[1]=True: a logical expert id"
    )
    doc = _doc(tmp_path)
    doc["layer_list"][0]["device_count"] = 4
    doc["layer_list"][1]["device_list"][0]["device_expert"] = [0, 1]
    doc["moe_layer_count"] = 3
    assert _refusal(_file(tmp_path, doc)) == (
        "moe_layer_count=3: must equal num_moe_layers=2; layer_list[0].device_count=4: must equal "
        "num_ranks=2; layer_list[1].device_list[0].device_expert has 2 slots: must be num_physical_experts / "
        "num_ranks = 3"
    )
    doc = _doc(tmp_path)
    doc.update(num_physical_experts=7, num_ranks=0)
    assert _refusal(_file(tmp_path, doc)) == "num_ranks=0: must be an integer >= 1"
    doc.update(num_ranks=2)
    assert _refusal(_file(tmp_path, doc)) == (
        "num_physical_experts=7: must be divisible by num_ranks=2 (P / N slots per rank)"
    )


def test_truncated_non_json_and_other_files_are_refused_naming_the_file(tmp_path):
    good = _file(tmp_path).read_text()
    truncated = tmp_path / "truncated.json"
    truncated.write_text(good[: len(good) // 2])
    assert _refusal(truncated).startswith("not JSON: ")
    assert _refusal(truncated).endswith("(the file ends early: truncated?)")
    text = tmp_path / "notes.txt"
    text.write_text("layer 0: 3 1 0\n")
    assert _refusal(text) == "not JSON: Expecting value at line 1 column 1"
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    assert _refusal(binary) == "not UTF-8 text (byte 0); not a placement file"
    empty = tmp_path / "empty.json"
    empty.write_text("  \n")
    assert _refusal(empty) == "empty file, not a placement file"
    assert _refusal(tmp_path / "absent.json") == "cannot read the placement file: no such file"
    doc = _doc(tmp_path)
    plain = {k: doc[k] for k in ("moe_layer_count", "layer_list")}  # vLLM Ascend's expert_map_path alone
    assert _refusal(_file(tmp_path, plain)) == (
        "a vLLM Ascend expert_map_path JSON without the model facts (format, version, num_moe_layers, "
        "num_logical_experts, num_physical_experts, num_ranks); write it with ascend-eplb plan "
        "--export-expert-map"
    )
    assert (
        _refusal(_file(tmp_path, {**doc, "version": 3}))
        == "version=3: this ascend-eplb reads versions 1 and 2"
    )
    assert _refusal(_file(tmp_path, {**doc, "version": 2})) == (
        "models=None: version 2 holds a non-empty list of models"
    )
    assert _refusal(_file(tmp_path, {**doc, "format": "sglang"})) == (
        "format='sglang': must be 'ascend-eplb-placement'"
    )
    assert _refusal(_file(tmp_path, [1, 2])) == "a placement file is a JSON object, got list"
    # Not a path at all.
    bad = list(check_settings(replace(GOOD, ascend_eplb_config={"initial_placement": 3})))
    assert bad == [
        Violation(
            "initial-placement",
            "eplb_config.initial_placement=3 must be a path (a non-empty string) to a placement file or an "
            "events file; fix: name the file ascend-eplb plan --export-expert-map wrote, or remove "
            "initial_placement",
        )
    ]


#: The fields of each kind these tests leave out (what the placement reader does not read).
FILLED = {
    "window": {"rearrangement": 1, "balancedness": 1.0, "balancedness_eplb_off": 1.0},
    "commit": {"rearrangement": 1, "publish_to_acknowledge_s": None, "bytes_received": 0},
    "initial_placement": {"layers_changed": 0, "experts_moved": 0, "bytes_moved": 0, "bytes_received": 0},
    "worker_failure": {},
    "run_start": {"model": None, "run_id": "0" * 32, "pid": 1},
}


def _events(tmp_path: Path, records: list[dict], name: str = "events.jsonl") -> Path:
    """An events file of ``records``, each written by its record class (``time``, ``step`` and the
    fields of :data:`FILLED` completed)."""
    path = tmp_path / name
    writer = EventsWriter(path)
    for record in records:
        full = {"time": 0.0, "step": 0, **FILLED[record["event"]], **record}
        writer.write(RECORD_KINDS[full.pop("event")].from_json(full))
    writer.close()
    return path


WINDOW = {"event": "window", "model": "m", "rearrangement": 1, "load": [[5, 1, 1, 1], [1, 1, 1, 5]],
          "num_ranks": 2, "num_physical_experts": 6}  # fmt: skip


def test_an_events_file_gives_its_last_committed_placement(tmp_path):
    first = [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
    records = [
        {"event": "initial_placement", "model": "m", "source": "p.json", "num_logical_experts": 4,
         "num_ranks": 2, "placement": first},
        WINDOW,
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 0, "placement": ROWS[0]},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 1, "placement": [3, 2, 1, 0, 3, 0]},
        {**WINDOW, "rearrangement": 2},
        {"event": "commit", "model": "m", "rearrangement": 2, "layer": 1, "placement": ROWS[1]},
        {"event": "worker_failure", "kind": "died", "ranks": [1], "model": "m", "layer": 0, "cause": "x"},
    ]  # fmt: skip
    path = _events(tmp_path, records)
    placement = pf.read_placement(path)
    # Layer 0 from rearrangement 1, layer 1 from rearrangement 2 (its last commit; the worker then died).
    assert placement.physical_to_logical_map == tuple(tuple(r) for r in ROWS)
    assert (placement.num_logical_experts, placement.num_ranks) == (4, 2)
    assert (
        placement.source
        == f"{path} (the last committed placement of model m: rearrangement 2 layer 1, line 6)"
    )
    assert _judge(path) == []
    # Without the start-up record, layers never committed have no placement to give.
    partial = _events(tmp_path, [WINDOW, records[2]], "partial.jsonl")
    assert _refusal(partial) == (
        "MoE layer(s) [1] of 2 have no committed placement in the file (no rearrangement completed while it "
        "was recorded, and the run did not start from a placement file)"
    )
    old = _events(
        tmp_path,
        [{k: v for k, v in WINDOW.items() if k not in ("num_ranks", "num_physical_experts")}],
        "old.jsonl",
    )
    assert _refusal(old) == (
        "the events file does not record num_physical_experts, num_ranks (its window records carry no "
        "num_ranks and num_physical_experts: recorded by an earlier ascend-eplb-integration)"
    )
    unplaced = _events(tmp_path, [WINDOW, {"event": "commit", "model": "m", "layer": 0}], "unplaced.jsonl")
    assert _refusal(unplaced).startswith(
        "MoE layer(s) [0, 1] of 2 have no committed placement in the file (1 commit record(s) carry no "
        "placement (recorded by an earlier ascend-eplb-integration))"
    )
    dropped = _events(
        tmp_path,
        [WINDOW, {**records[2], "placement": [0, 0, 0, 1, 1, 1]}, {**records[3], "placement": ROWS[1]}],
        "dropped.jsonl",
    )
    assert _refusal(dropped) == (
        "layer 0: logical expert(s) [2, 3] hold no slot (2 of 4); every logical expert needs at least one"
    )


def test_a_placement_is_refused_without_eplb_and_its_key_is_an_ascend_v2_key(tmp_path):
    path = _file(tmp_path)
    off = list(
        check_settings(replace(GOOD, enable_eplb=False, ascend_eplb_config={"initial_placement": "p"}))
    )
    assert off == [
        Violation(
            "placement-without-eplb",
            "eplb_config.initial_placement='p' needs Model Runner V2 EPLB, but enable_eplb=False; fix: pass "
            "--enable-eplb or remove initial_placement (vLLM Ascend's static placement without EPLB reads "
            "expert_map_path, a part of the same file)",
        )
    ]
    judged = check_settings(
        replace(GOOD, ascend_eplb_config={"initial_placement": str(path), "expert_map_path": "m"})
    )
    assert [v.rule for v in judged] == ["v1-controls"]
    assert judged[0].message.endswith(
        f"the Ascend V2 keys are {', '.join(ASCEND_V2_KEYS)}; a static placement (expert_map_path) is "
        "eplb_config.initial_placement under V2, a file of ascend-eplb plan --export-expert-map"
    )
    assert "initial_placement" in ASCEND_V2_KEYS
    # The layers are not known before the model is built: not compared, and not a reason to refuse.
    assert (
        list(
            check_settings(
                replace(GOOD, num_moe_layers=None, ascend_eplb_config={"initial_placement": str(path)})
            )
        )
        == []
    )
    unknown = check_settings(
        replace(GOOD, num_logical_experts=None, unknown_facts={"num_logical_experts": "E is unknown"},
                ascend_eplb_config={"initial_placement": str(path)})
    )  # fmt: skip
    assert Violation.unjudged("initial-placement", "E is unknown") in unknown.unjudged


def test_placement_from_map_refuses_what_it_cannot_serve(tmp_path):
    with pytest.raises(pf.PlacementFileError) as info:
        pf.placement_from_map([[0, 1, 2, 2], [0, 1, 2]], num_logical_experts=4, num_ranks=2, source="plan")
    assert str(info.value) == (
        "plan: 2 problems:\n"
        "  - layer 1: 3 slots, must be num_physical_experts=4\n"
        "  - layer 0: logical expert(s) [3] hold no slot (1 of 4); every logical expert needs at least one"
    )


def test_a_placement_file_is_written_whole_or_not_at_all(tmp_path):
    placement = pf.placement_from_map(ROWS, num_logical_experts=4, num_ranks=2)
    good = tmp_path / "placement.json"
    pf.write_placement(good, placement)
    before = good.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement.json"]  # no temporary left beside it
    # A write that fails (here: the target is a folder) leaves what was there and no temporary file.
    folder = tmp_path / "taken"
    folder.mkdir()
    (folder / "x").write_text("kept")
    with pytest.raises(ValueError, match=rf"^{folder}: cannot write the placement file: is a folder"):
        pf.write_placement(folder, placement)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement.json", "taken"]
    assert (folder / "x").read_text() == "kept"
    # Rewriting a file replaces it whole.
    pf.write_placement(good, pf.placement_from_map([ROWS[1], ROWS[0]], num_logical_experts=4, num_ranks=2))
    assert good.read_bytes() != before
    assert pf.read_placement(good).physical_to_logical_map == (tuple(ROWS[1]), tuple(ROWS[0]))


def test_an_events_file_appended_by_two_runs_gives_the_last_runs_placement_only(tmp_path):
    # The writer appends: run 2 (its steps start again at 0) committed layer 0 only; run 1's commit of
    # layer 1 is not a placement run 2 ever served, so layer 1 has none (it was taken from run 1).
    run_1 = [
        {**WINDOW, "step": 3},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 0, "placement": ROWS[0], "step": 4},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 1, "placement": ROWS[1], "step": 5},
    ]
    run_2 = [
        {**WINDOW, "step": 3},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 0, "placement": ROWS[1], "step": 4},
    ]
    assert pf.read_placement(_events(tmp_path, run_1, "one.jsonl")).physical_to_logical_map == tuple(
        tuple(r) for r in ROWS
    )
    two = _events(tmp_path, run_1 + run_2, "two.jsonl")
    assert _refusal(two) == (
        "MoE layer(s) [1] of 2 have no committed placement in the file (no rearrangement completed while it "
        f"was recorded, and the run did not start from a placement file); {two} holds 2 runs (a run starts "
        "where the step or the rearrangement counter starts again); run 2, lines 4-5, is read"
    )
    both = _events(
        tmp_path, [*run_1, *run_2, {**run_2[1], "layer": 1, "placement": ROWS[0], "step": 5}], "b.jsonl"
    )
    assert pf.read_placement(both).physical_to_logical_map == (tuple(ROWS[1]), tuple(ROWS[0]))


def test_two_servers_records_are_never_joined_into_one_placement(tmp_path):
    """Issue 43 case 4: server A served statically (its only record the start-up install, step 0), server B
    appended after it and its steps did not start again below A's: read as one run, A's layer 1 joined B's
    layer 0, a placement nobody served. Each server's run_start record ends the join."""
    first = [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
    a = [
        {"event": "run_start", "run_id": "a" * 32},
        {"event": "initial_placement", "model": "m", "source": "p.json", "num_logical_experts": 4,
         "num_ranks": 2, "placement": first},
    ]  # fmt: skip
    b = [
        {"event": "run_start", "run_id": "b" * 32},
        {**WINDOW, "step": 12},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 0, "placement": ROWS[1], "step": 13},
    ]
    two = _events(tmp_path, a + b)
    assert _refusal(two) == (
        "MoE layer(s) [1] of 2 have no committed placement in the file (no rearrangement completed while it "
        f"was recorded, and the run did not start from a placement file); {two} holds 2 runs (each starts at "
        "a server's run_start record); run 2, lines 3-5, is read"
    )
    # B's placement once it committed every layer; A's alone when B recorded nothing to serve from.
    done = _events(tmp_path, [*a, *b, {**b[2], "layer": 1, "placement": ROWS[0], "step": 14}], "done.jsonl")
    assert pf.read_placement(done).physical_to_logical_map == (tuple(ROWS[1]), tuple(ROWS[0]))
    idle = _events(tmp_path, [*a, b[0]], "idle.jsonl")
    assert pf.read_placement(idle).physical_to_logical_map == tuple(map(tuple, first))


def test_values_of_the_wrong_json_type_unknown_keys_and_a_key_given_twice_are_refused(tmp_path):
    # layer_id false == 0 and 1.0 == 1 in Python: the file was accepted as if they were the integers.
    for change, message in [
        (lambda d: d["layer_list"][0].update(layer_id=False), "layer_list[0].layer_id=False: must be 0"),
        (lambda d: d["layer_list"][1].update(layer_id=1.0), "layer_list[1].layer_id=1.0: must be 1"),
        (lambda d: d["layer_list"][0]["device_list"][0].update(device_id=0.0),
         "layer_list[0].device_list[0].device_id=0.0: must be 0"),
        (lambda d: d["layer_list"][0].update(device_count=2.0), "layer_list[0].device_count=2.0: must equal"),
        (lambda d: d.update(moe_layer_count=True), "moe_layer_count=True: must equal num_moe_layers=2"),
        (lambda d: d.update(num_ranks=2.0), "num_ranks=2.0: must be an integer >= 1"),
        (lambda d: d.update(comment="x"),
         "unknown key(s) 'comment': the keys are format, version, num_moe_layers, num_logical_experts, "
         "num_physical_experts, num_ranks, source, moe_layer_count, layer_list"),
        (lambda d: d["layer_list"][1].update(experts=[]),
         "layer_list[1]: unknown key(s) 'experts': the keys are layer_id, device_count, device_list"),
        (lambda d: d["layer_list"][0]["device_list"][1].update(rank=1),
         "layer_list[0].device_list[1]: unknown key(s) 'rank': the keys are device_id, device_expert"),
    ]:  # fmt: skip
        doc = _doc(tmp_path)
        change(doc)
        assert _refusal(_file(tmp_path, doc)).startswith(message), message
    doc = _doc(tmp_path)
    text = json.dumps(doc).replace('"num_ranks": 2,', '"num_ranks": 2, "num_ranks": 4,', 1)
    twice = tmp_path / "twice.json"
    twice.write_text(text)
    assert _refusal(twice) == "the key 'num_ranks' is given twice in one JSON object"


def test_a_fifo_is_refused_before_it_is_opened(tmp_path):
    fifo = tmp_path / "placement.json"
    os.mkfifo(fifo)  # opening it to read would block until a writer came: check and simulate hung
    assert _refusal(fifo) == (
        "cannot read the placement file: is a FIFO, not a regular file (reading it would block or never end)"
    )
    assert _refusal(tmp_path) == "cannot read the placement file: is a folder, not a file to read"


def test_a_malformed_events_file_is_refused_naming_the_events_file_and_its_line(tmp_path):
    first = [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
    start = {"event": "initial_placement", "model": "m", "source": "p.json", "num_logical_experts": 4,
             "num_ranks": 2, "placement": first}  # fmt: skip
    deep = _events(tmp_path, [start, WINDOW], "deep.jsonl")
    with deep.open("a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")  # was a RecursionError traceback
    assert _refusal(deep) == "line 3: not an events record (JSON nested too deeply)"
    row = tmp_path / "row.jsonl"  # a row that is not a list: was a TypeError, blamed on the config file
    row.write_text(json.dumps({"time": 0.0, "step": 0, **FILLED["initial_placement"], **start,
                               "placement": [first[0], 7]}) + "\n")  # fmt: skip
    assert _refusal(row) == (
        "line 1: an initial_placement's 'placement' must be a non-empty [L][P] list of integer lists, every "
        "row of one length"
    )


def test_the_placement_of_the_last_run_even_when_its_step_counter_did_not_start_again(tmp_path):
    run_1 = [
        {**WINDOW, "step": 3},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 0, "placement": ROWS[0], "step": 4},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 1, "placement": ROWS[1], "step": 5},
    ]
    # Run 2 starts at step 9 (its recorder's steps are above run 1's), but its rearrangement counter starts
    # again: layers 0-1 of run 1 and 0 of run 2 were never served together.
    run_2 = [
        {**WINDOW, "step": 9},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 0, "placement": ROWS[1], "step": 10},
    ]
    path = _events(tmp_path, run_1 + run_2, "appended.jsonl")
    assert _refusal(path).startswith("MoE layer(s) [1] of 2 have no committed placement in the file")
    assert _refusal(path).endswith("run 2, lines 4-5, is read")


def test_a_stray_record_of_another_model_does_not_make_a_complete_run_that_models(tmp_path):
    records = [
        {"event": "window", "model": "other", "rearrangement": 1, "load": [[1]], "num_ranks": 1,
         "num_physical_experts": 1},
        WINDOW,
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 0, "placement": ROWS[0]},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 1, "placement": ROWS[1]},
    ]  # fmt: skip
    path = _events(tmp_path, records)
    placement = pf.read_placement(path)
    assert placement.physical_to_logical_map == tuple(tuple(r) for r in ROWS)
    assert (
        placement.source
        == f"{path} (the last committed placement of model m: rearrangement 1 layer 1, line 4)"
    )
    assert _judge(path) == []


#: The MTP draft's placement (1 MoE layer) beside the target's (:data:`ROWS`).
DRAFT_ROWS = [[0, 1, 2, 3, 2, 2]]


def test_a_file_of_the_target_and_its_draft_names_each_and_start_up_serves_each_or_refuses(tmp_path):
    # Version 2: one entry per model EPLB balances, named as upstream names it; each entry is a version-1
    # document's model part (vLLM Ascend's expert_map_path JSON of that model).
    target = pf.placement_from_map(ROWS, num_logical_experts=4, num_ranks=2, model="m")
    draft = pf.placement_from_map(DRAFT_ROWS, num_logical_experts=4, num_ranks=2, model="m (draft)")
    path = tmp_path / "both.json"
    pf.write_placements(path, [draft, target], {"tool": "test"})
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["source"]) == ("ascend-eplb-placement", 2, {"tool": "test"})
    assert [m["model"] for m in doc["models"]] == ["m (draft)", "m"]
    assert (
        doc["models"][1]["layer_list"]
        == pf.placement_from_map(ROWS, num_logical_experts=4, num_ranks=2).to_json()["layer_list"]
    )
    read = pf.read_placements(path)
    assert [(p.model, p.physical_to_logical_map) for p in read] == [
        ("m (draft)", tuple(map(tuple, DRAFT_ROWS))),
        ("m", tuple(map(tuple, ROWS))),
    ]
    with pytest.raises(
        pf.PlacementFileError, match=r"carries the placements of 2 models \['m \(draft\)', 'm'\]"
    ):
        pf.read_placement(path)
    # A server balancing both accepts it; the target's layers are judged, the draft's at its registration.
    served = ("m (draft)", "m")
    assert _judge(path, served_models=served) == []
    # Each served model takes the placement named as it is, else the one of its role (a draft's name ends
    # as upstream's eplb_draft_model_name ends it): the same model served from another path starts on it.
    assert pf.assign_placements(read, ("/other/m (draft)", "/other/m")) == (
        {"/other/m (draft)": read[0], "/other/m": read[1]},
        [],
    )
    assert _judge(path, served_models=("/other/m (draft)", "/other/m")) == []
    fix = (
        "; fix: export a placement of every model the server balances (ascend-eplb plan --export-expert-map "
        "on an events file that recorded them) or remove initial_placement"
    )
    assert _judge(path, served_models=("m",)) == [
        Violation(
            "initial-placement",
            f"eplb_config.initial_placement={path}: names model m (draft), which this server does not serve "
            f"(the server balances ['m']){fix}",
        )
    ]
    only_target = tmp_path / "target.json"
    pf.write_placements(only_target, [target])
    assert _judge(only_target, served_models=served) == [
        Violation(
            "initial-placement",
            f"eplb_config.initial_placement={only_target}: has no placement for model m (draft) (the server "
            f"balances ['m (draft)', 'm']){fix}",
        )
    ]
    unnamed = _file(tmp_path)  # version 1: a target's, the one served model's
    assert _judge(unnamed, served_models=("m",)) == []
    assert _judge(unnamed, served_models=served) == [
        Violation(
            "initial-placement",
            f"eplb_config.initial_placement={unnamed}: has no placement for model m (draft) (the server "
            f"balances ['m (draft)', 'm']){fix}",
        )
    ]
    two_targets = tmp_path / "two.json"
    pf.write_placements(two_targets, [target, replace(target, model="n")])
    assert pf.assign_placements(pf.read_placements(two_targets), ("x",))[1] == [
        "has no placement for model x (2 of a target's placement: which one is ambiguous)",
        "names model m, which this server does not serve",
        "names model n, which this server does not serve",
    ]
    # Each entry is judged as a version-1 document, its model named; names are unique and present.
    twice = {**doc, "models": [doc["models"][0], {**doc["models"][1], "model": "m (draft)"}]}
    assert _refusal(_file(tmp_path, twice, "twice.json")) == (
        "models names ['m (draft)'] more than once: one placement per model"
    )
    broken = {**doc, "models": [{**doc["models"][0], "num_ranks": 4}, {**doc["models"][1], "model": ""}]}
    assert _refusal(_file(tmp_path, broken, "broken.json")) == (
        "models[1].model='': must be the model's name (a non-empty string)"
    )
    uneven = {**doc, "models": [{**doc["models"][0], "num_ranks": 4}, doc["models"][1]]}
    assert _refusal(_file(tmp_path, uneven, "uneven.json")) == (
        "model m (draft): num_physical_experts=6: must be divisible by num_ranks=4 (P / N slots per rank)"
    )
    with pytest.raises(ValueError, match=r"names each once"):
        pf.dumps([target, target])


def test_an_events_file_of_the_target_and_its_draft_gives_each_models_last_placement(tmp_path):
    draft_window = {**WINDOW, "model": "m (draft)", "load": [[1, 2, 3, 4]]}
    records = [
        WINDOW,
        draft_window,
        {"event": "commit", "model": "m (draft)", "rearrangement": 1, "layer": 0, "placement": DRAFT_ROWS[0]},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 0, "placement": ROWS[0]},
        {"event": "commit", "model": "m", "rearrangement": 1, "layer": 1, "placement": ROWS[1]},
    ]
    path = _events(tmp_path, records)
    read = pf.read_placements(path)
    assert [(p.model, p.num_moe_layers, p.physical_to_logical_map) for p in read] == [
        ("m", 2, tuple(map(tuple, ROWS))),
        ("m (draft)", 1, tuple(map(tuple, DRAFT_ROWS))),
    ]
    assert (
        read[1].source
        == f"{path} (the last committed placement of model m (draft): rearrangement 1 layer 0, line 3)"
    )
    assert _judge(path, served_models=("m (draft)", "m")) == []
    # A served model whose layers never committed is named in the refusal, with why it has no placement.
    partial = _events(tmp_path, records[:2] + records[3:], "partial.jsonl")
    violations = _judge(partial, served_models=("m (draft)", "m"))
    assert [v.rule for v in violations] == ["initial-placement"]
    assert (
        f"initial_placement={partial}: model m (draft): MoE layer(s) [0] of 1 have no committed placement in "
        "the file (no rearrangement completed while it was recorded, and the run did not start from a "
        "placement file); fix:"
    ) in violations[0].message
    # A server of the target alone reads the target's (the draft's records are a stray's to it).
    assert _judge(partial, served_models=("m",)) == []
    assert [p.model for p in pf.read_placements(partial)] == ["m"]
    # In an events file, records of a model the server does not serve are not read, never a reason to
    # refuse: the draft's complete placement too (a placement file naming it is refused, above).
    assert _judge(path, served_models=("m",)) == []
    assert [p.model for p in pf.read_placements(path, ("m",))] == ["m"]
    assert _judge(path, served_models=("/other/m",)) == []  # the same model served from another path
    # A served model the file leaves without a placement is refused naming it, and the records the file
    # holds instead are said to be of a model not served.
    other = _events(
        tmp_path, [{**r, "model": "n"} if r["model"] == "m (draft)" else r for r in records], "n.jsonl"
    )
    assert _judge(other, served_models=("m",)) == []
    violations = _judge(other, served_models=("m (draft)", "m"))
    assert [v.message for v in violations] == [
        f"eplb_config.initial_placement={other}: has no placement for model m (draft) (the run records n, "
        "which this server does not serve: not read); fix: name a placement file of ascend-eplb plan "
        "--export-expert-map (or an events file with a committed placement)"
    ]
    # One stray record of another model beside a complete run: not read (issue 38), whatever is served.
    stray = _events(
        tmp_path,
        [{"event": "window", "model": "x (draft)", "rearrangement": 1, "load": [[1]], "num_ranks": 1,
          "num_physical_experts": 1}, *records],
        "stray.jsonl",
    )  # fmt: skip
    assert _judge(stray, served_models=("m (draft)", "m")) == []
    assert _judge(stray, served_models=("m",)) == []


def test_the_draft_suffix_is_upstreams():
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.eplb_utils import eplb_draft_model_name

    assert eplb_draft_model_name(SimpleNamespace(model="m")) == "m" + DRAFT_SUFFIX
