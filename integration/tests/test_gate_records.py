"""The events file of a serving worker with the migration-aware policy behind the gain gate, both on the
load estimate, on 2 ranks over Gloo (``ranks_mrv2.gate_events_world``): every window's ``rearrangement``
record with exact figures on its window and on the estimate, skipped ones with their reason, the realised
balancedness of the windows each placement served, 0-based steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ascend_eplb.control.estimate import LoadEstimate
from ascend_eplb.control.measures import mean_balancedness, moved_experts, rank_loads
from ascend_eplb.testing import load_module, run_ranks

ranks = load_module(Path(__file__).with_name("ranks_mrv2.py"))
PRELOAD = (
    "vllm.distributed.eplb.eplb_state",
    "vllm.v1.worker.gpu.eplb_utils",
    "ascend_eplb.world.toy_moe",
    "ascend_eplb.control",
    "ascend_eplb.movement",
    "ascend_eplb.integration.patches",
    "ascend_eplb.integration.runner",
)
MODEL = "toy/gate-moe"


def _bal(load: list[list[int]], placement: list[list[int]]) -> float:
    load = torch.as_tensor(load, dtype=torch.float64)
    return mean_balancedness(rank_loads(load, torch.tensor(placement), 2))


@pytest.mark.multirank
def test_each_window_is_recorded_with_its_decision_figures_and_the_next_window_realises_it(tmp_path):
    events_file = tmp_path / "events.jsonl"
    reports = run_ranks(
        ranks.gate_events_world, world_size=2, tmp_path=tmp_path, args=(str(events_file),), timeout_s=240,
        preload=PRELOAD,
    )  # fmt: skip
    r0 = reports[0]
    assert r0["active_policy"] == "GatedMigrationAwarePolicy"
    # Rank 0 wrote the file: the records it published, one JSON object per line.
    records = r0["records"]
    written = [json.loads(line) for line in events_file.read_text().splitlines()]
    # The server's first line starts its run, and reaches the records' subscribers as it reaches the file.
    assert {k: v for k, v in written[0].items() if k not in ("time", "run_id", "pid")} == {
        "event": "run_start", "step": 0, "model": None,
    }  # fmt: skip
    assert len(written[0]["run_id"]) == 32
    assert written == records
    # Every rank made the same records (bytes received and timings aside): decided alike.
    decided = [
        [
            {k: v for k, v in x.items() if k != "time"}
            for x in r["records"]
            if x["event"] not in ("commit", "run_start")
        ]
        for r in reports
    ]
    assert decided[0] == decided[1]

    # `step` is the 0-based index of the engine step during which the record came (no profile step).
    assert [x["step"] for x in records] == r0["step_of_record"]
    assert r0["step_of_record"][0] >= 0

    def strip(x):
        return {k: v for k, v in x.items() if k not in ("time", "step")}

    windows = [x for x in records if x["event"] == "window"]
    rearrangements = [strip(x) for x in records if x["event"] == "rearrangement"]
    realised = [strip(x) for x in records if x["event"] == "rearrangement_realised"]
    maps = r0["maps"]
    per_expert = r0["expert_bytes"]
    assert per_expert == 8 * 4 + 8 * 2  # the tagged weights: float32 (2, 4) and bfloat16 (4, 2) per expert

    # Window 1 (split): the global load is even under the placement in force: skipped, nothing moved.
    assert windows[0]["rearrangement"] == 1
    assert windows[0]["balancedness"] == _bal(windows[0]["load"], maps[0]["before"]) == 1.0
    assert maps[0]["after"] == maps[0]["before"]
    # Window 2 (hot): rearranged by the migration-aware policy.
    old, new = maps[1]["before"], maps[1]["after"]
    assert old == maps[0]["after"]
    assert new != old
    moved = int(moved_experts(torch.tensor(old), torch.tensor(new), 2).sum())
    before, planned = _bal(windows[1]["load"], old), _bal(windows[1]["load"], new)
    assert windows[1]["balancedness"] == before
    assert planned - before >= ranks.GATE_KEYS["min_balancedness_gain"]
    changed = sum(a != b for a, b in zip(old, new, strict=True))
    # Window 3 (idle): no rank recorded load, no window record. Window 4 (split) realises window 2's.
    assert maps[2]["after"] == maps[2]["before"] == new
    assert [w["rearrangement"] for w in windows] == [1, 2, 3]
    # What upstream passed its policy: the toy model's one expert group, one node (plan reads them back).
    assert [(w["num_expert_groups"], w["num_nodes"]) for w in windows] == [(1, 1)] * 3
    # The load estimate the policy planned on and the gate judged, replayed from what each window record
    # says it took in (window 2 <= interval 6: upstream recorded only the window's steps, so the
    # window's load): window 1 even, window 2 a shift to rank 0's experts (restarted).
    assert [w["new_selections"] for w in windows] == [w["load"] for w in windows]
    estimate = LoadEstimate()
    estimate.update(torch.tensor(windows[0]["new_selections"]))
    on_estimate_1 = _bal(estimate.load, maps[0]["before"])
    estimate.update(torch.tensor(windows[1]["new_selections"]))
    assert estimate.restarted.tolist() == [True, True]
    on_estimate_2 = (_bal(estimate.load, old), _bal(estimate.load, new))
    assert on_estimate_1 == 1.0
    assert on_estimate_2[1] - on_estimate_2[0] >= ranks.GATE_KEYS["min_balancedness_gain"]
    assert rearrangements[:3] == [
        {"event": "rearrangement", "model": MODEL, "rearrangement": 1, "policy": "migration_aware",
         "skipped": "balanced", "balancedness_before": 1.0, "balancedness_planned": None,
         "load_estimate": "pooled", "estimate_balancedness_before": pytest.approx(on_estimate_1, abs=1e-12),
         "estimate_balancedness_planned": None, "experts_moved": 0, "bytes_moved": 0, "layers_changed": 0},
        {"event": "rearrangement", "model": MODEL, "rearrangement": 2, "policy": "migration_aware",
         "skipped": None, "balancedness_before": before, "balancedness_planned": planned,
         "load_estimate": "pooled",
         "estimate_balancedness_before": pytest.approx(on_estimate_2[0], abs=1e-12),
         "estimate_balancedness_planned": pytest.approx(on_estimate_2[1], abs=1e-12),
         "experts_moved": moved, "bytes_moved": moved * per_expert, "layers_changed": changed},
        {"event": "rearrangement", "model": MODEL, "rearrangement": None, "policy": "migration_aware",
         "skipped": "no_load", "balancedness_before": None, "balancedness_planned": None,
         "load_estimate": "pooled", "estimate_balancedness_before": None,
         "estimate_balancedness_planned": None, "experts_moved": 0, "bytes_moved": 0, "layers_changed": 0},
    ]  # fmt: skip
    assert moved > 0
    # Realised: each window with load under the placement in force, and their mean since it committed
    # (rearrangement 1 kept the start placement: windows 1 and 2 closed under it; 2's served window 3).
    copied = ("skipped", "balancedness_before", "balancedness_planned", "load_estimate",
              "estimate_balancedness_before", "estimate_balancedness_planned")  # fmt: skip
    assert realised[:2] == [
        {"event": "rearrangement_realised", "model": MODEL, "rearrangement": 1,
         **{k: rearrangements[0][k] for k in copied}, "balancedness_realised": windows[1]["balancedness"],
         "placed_by": None, "windows_realised": 2,
         "balancedness_realised_mean": (windows[0]["balancedness"] + windows[1]["balancedness"]) / 2},
        {"event": "rearrangement_realised", "model": MODEL, "rearrangement": 2,
         **{k: rearrangements[1][k] for k in copied}, "balancedness_realised": _bal(windows[2]["load"], new),
         "placed_by": 2, "windows_realised": 1, "balancedness_realised_mean": _bal(windows[2]["load"], new)},
    ]  # fmt: skip
    # Order: a window's realised record comes just before the next window's record.
    kinds = [x["event"] for x in records if x["event"] not in ("commit", "run_start")]
    assert kinds[:7] == [
        "window", "rearrangement", "rearrangement_realised", "window", "rearrangement", "rearrangement",
        "rearrangement_realised",
    ]  # fmt: skip
    # The skipped rearrangement still committed every layer (unchanged), receiving nothing.
    commits = [x for x in records if x["event"] == "commit" and x["rearrangement"] == 1]
    assert [(c["layer"], c["bytes_received"]) for c in commits] == [(0, 0), (1, 0)]
    assert [c["placement"] for c in commits] == maps[0]["before"]
