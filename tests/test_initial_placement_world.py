"""Serving from a recorded placement, on vLLM's real Qwen3-MoE class (TP=2 x EP=2 over Gloo, verifier on).

The operators' loop of the README, end to end: a serving run records its events file
(``ASCEND_EPLB_EVENTS``); ``ascend-eplb plan EVENTS --ranks 2 --export-expert-map F`` exports a placement
for the recorded configuration; a server started with ``eplb_config.initial_placement: F`` holds it in
upstream's state from the first step (maps, lookups, every slot's weights), serves the same logits as
the EPLB-off model, records its first window balanced as ``plan`` predicted, and rearranges on from it.
A file for other MoE layers is refused when the model registers; a W8A8 server started on the first
server's events file (its last committed placement) with ``step_interval`` beyond the run keeps it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ascend_eplb import world as rm
from ascend_eplb.control.measures import mean_balancedness, rank_loads
from ascend_eplb.integration import placement_file as pf
from ascend_eplb.testing import load_module, run_ranks
from ascend_eplb.tools import cli

# Cross-package: the serving runs are integration's real-model rank functions, the plan the tools'.
ranks = load_module(Path(__file__).resolve().parents[1] / "integration/tests/ranks_real_models.py")

PRELOAD = ("vllm", "vllm.model_executor.model_loader", "ascend_eplb.world.serving")
#: Interval 4 (its counter starts at 3): rearrangements start at the ends of steps 0 and 4, and with each
#: layer awaited, their 2 layers commit at steps 1-2 and 5-6. The recording run stops after its first
#: (one window); the served run after its second (nothing in flight when the next server starts).
RECORD_STEPS, STEPS = 3, 7


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_record_plan_and_serve_from_the_placement(tmp_path, capsys):
    folder = rm.write_checkpoint("qwen3-moe", tmp_path / "ckpt", seed=0)
    quantized = rm.write_checkpoint("qwen3-moe", tmp_path / "ckpt-w8a8", seed=0, fmt="w8a8_dynamic")
    info = rm.checkpoint_info(folder)
    e, layers = info.num_logical_experts, info.num_moe_layers
    recorded = tmp_path / "recorded.jsonl"

    # 1. Record: upstream's initial placement, the events file on.
    spec = rm.RealModelSpec(
        arch="qwen3-moe", folder=str(folder), num_redundant_experts=2, steps=RECORD_STEPS, window_size=2,
        step_interval=4, run_eplb_off=False, environ={"ASCEND_EPLB_EVENTS": str(recorded)},
    )  # fmt: skip
    run_ranks(
        ranks.quantized_world, world_size=2, tmp_path=tmp_path, args=(spec,), timeout_s=150, preload=PRELOAD
    )
    windows = [r for r in _records(recorded) if r["event"] == "window"]
    assert [(w["num_ranks"], w["num_physical_experts"]) for w in windows] == [(2, e + 2)]

    # 2. Plan on the recorded load, export for the recorded configuration (no more options).
    placement_path = tmp_path / "placement.json"
    assert cli.main(["plan", str(recorded), "--ranks", "2", "--export-expert-map", str(placement_path)]) == 0
    out = capsys.readouterr().out
    placement = pf.read_placement(placement_path)
    assert placement.facts() == {
        "num_moe_layers": layers, "num_logical_experts": e, "num_physical_experts": e + 2, "num_ranks": 2,
    }  # fmt: skip
    load = torch.tensor(windows[0]["load"], dtype=torch.float64)
    chosen = torch.tensor(placement.physical_to_logical_map)
    predicted = mean_balancedness(rank_loads(load, chosen, 2))
    # The recorded configuration's level (the sweep may recommend another: the message then says why).
    assert "num_redundant_experts=2 (the recorded configuration" in out
    assert f"global policy), {layers} MoE layers x 2 devices" in out
    assert f"balancedness on its load {predicted:.4f} (upstream's initial placement: " in out
    assert json.loads(placement_path.read_text())["source"]["load"] == str(recorded)

    # A placement for other MoE layers (the right experts, slots and ranks).
    wrong = tmp_path / "three-layers.json"
    pf.write_placement(
        wrong,
        pf.placement_from_map([*placement.physical_to_logical_map] * 2, num_logical_experts=e, num_ranks=2),
    )
    served, static_events = tmp_path / "served.jsonl", tmp_path / "static.jsonl"
    args = (
        str(folder),
        str(placement_path),
        str(served),
        str(wrong),
        str(quantized),
        str(static_events),
        STEPS,
    )
    reports = run_ranks(
        ranks.serve_from_placement_worlds, world_size=2, tmp_path=tmp_path, args=args, timeout_s=300,
        preload=PRELOAD,
    )  # fmt: skip

    # 3. Serve from it: upstream's state holds the file's placement from the first step, on every rank.
    for r in reports:
        s = r["served"]
        assert torch.equal(s["map"], chosen)
        assert s["slot_mismatches"] == []  # every local slot holds its logical expert's weights
        assert s["lookups_equal"] == [True] * layers
        # The serving verifier checked each layer's commit of the install (fingerprints and lookups).
        assert s["verifier_commits_checked"] == layers
        # One synchronous commit of every layer, before any rearrangement: the transaction moved every layer,
        # then upstream's commit, each layer's lookup refreshed after it (no acknowledge: no staging).
        moves = [("move", layer, 0) for layer in range(layers)]
        assert s["commit_log"] == moves + [
            (k, layer, 0) for layer in range(layers) for k in ("commit", "refresh")
        ]
        assert max(s["max_rel_err"]) <= 1e-5, s["max_rel_err"]
        assert all(mismatches == [] for _, mismatches in s["slot_checks"]), s["slot_checks"]
        assert s["num_rearrangements"] == 2
        # The map after step 0 is the file's still (the first rearrangement commits from step 1 on).
        assert torch.equal(s["maps"][0], chosen)
        assert any(not torch.equal(m, chosen) for m in s["maps"][1:])  # and it rearranged on from it
    assert all(
        torch.equal(a, b)
        for a, b in zip(reports[0]["served"]["maps"], reports[1]["served"]["maps"], strict=True)
    )
    assert reports[0]["served"]["bytes_received"] > 0

    records = _records(served)
    (start,) = [r for r in records if r["event"] == "initial_placement"]
    assert start["placement"] == [list(row) for row in placement.physical_to_logical_map]
    assert (start["source"], start["num_ranks"], start["num_logical_experts"]) == (str(placement_path), 2, e)
    assert start["layers_changed"] == layers
    assert start["experts_moved"] > 0
    assert start["bytes_received"] == reports[0]["served"]["bytes_received"] > 0
    assert records.index(start) < min(i for i, r in enumerate(records) if r["event"] == "window")
    served_windows = [r for r in records if r["event"] == "window"]
    # The same prompts route the same tokens: the first window's load is the recorded one, and under the
    # installed placement its balancedness is what plan predicted for it, beside what it was served with.
    assert served_windows[0]["load"] == windows[0]["load"]
    assert served_windows[0]["balancedness"] == pytest.approx(predicted, abs=1e-12)
    assert served_windows[0]["balancedness_eplb_off"] == pytest.approx(windows[0]["balancedness"], abs=1e-12)
    print(
        f"first window: balancedness {served_windows[0]['balancedness']:.4f} served from the placement, "
        f"{windows[0]['balancedness']:.4f} as recorded (upstream's initial placement); plan predicted "
        f"{predicted:.4f}"
    )
    assert served_windows[0]["balancedness"] >= windows[0]["balancedness"]
    # The first rearrangement's commits carry their placement rows, and they start from the file's.
    commits = [r for r in records if r["event"] == "commit" and r["rearrangement"] == 1]
    assert sorted(c["layer"] for c in commits) == list(range(layers))

    # 4. A placement for other MoE layers is refused when the model registers (start-up validation
    #    cannot know L before the model is built), naming the field and both values.
    for r in reports:
        kind, message = r["refused"]
        assert kind == "EplbConfigError", message
        assert message.startswith("1 EPLB configuration rule(s) violated:\n  - [initial-placement] ")
        assert f"num_moe_layers: the file's {2 * layers}, the model's {layers}" in message

    # 5. Static: the W8A8 server started on the served run's events file (its last committed placement),
    #    interval beyond the run: the placement stays, every slot holds its expert in the format's storage.
    last = pf.read_placement(served)
    assert torch.equal(torch.tensor(last.physical_to_logical_map), reports[0]["served"]["maps"][-1])
    for r in reports:
        s = r["static"]
        assert torch.equal(s["map"], torch.tensor(last.physical_to_logical_map))
        assert s["slot_mismatches"] == []  # fingerprints over every W8A8 kernel tensor
        assert s["verifier_commits_checked"] == layers
        assert s["num_rearrangements"] == 0
        assert all(torch.equal(m, s["map"]) for m in s["maps"])
        assert s["unequal_steps"] == []  # bit-equal to the EPLB-off model every step
    static_records = _records(static_events)
    assert [r["event"] for r in static_records] == ["run_start", "initial_placement"]
    assert static_records[1]["source"].startswith(f"{served} (the last committed placement of model ")
