"""The control adaptation on real upstream EPLB: 2 and 4 ranks over Gloo on CPU.

Each world runs three rearrangement windows (skewed real routing load, an all-zero window, skewed load
again) through ``AscendEPLBController`` and vLLM 0.33.0's ``EplbState``, async worker, default policy
and Gloo communicator; ``ranks.control_world`` reports what it observed on each rank. One world runs
the migration-aware policy behind the gain gate instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ascend_eplb.control import PolicySettings
from ascend_eplb.control.policy import balancedness, moved_experts
from ascend_eplb.testing import load_module, run_ranks
from ascend_eplb.testing.oracles import check_commit_order

ranks = load_module(Path(__file__).with_name("ranks.py"))

PRELOAD = (
    "vllm.distributed.eplb.eplb_state",
    "vllm.v1.worker.gpu.eplb_utils",
    "ascend_eplb.control.controller",
    "ascend_eplb.world.toy_moe",
)
LAYERS = range(ranks.NUM_MOE_LAYERS)


def _run(tmp_path, world_size, use_async, phase, windows=ranks.WINDOWS, policy=None):
    return run_ranks(
        ranks.control_world,
        world_size=world_size,
        tmp_path=tmp_path,
        args=(use_async, phase, windows, policy),
        timeout_s=240,  # from the call: the fork server's vLLM import included
        preload=PRELOAD,
    )


def _assert_cycles(reports, use_async):
    world_size = len(reports)
    first = reports[0]
    for r in reports:
        assert r["errors"] == [], r["errors"]
        # Warm-up under suppress records nothing and leaves the flag as it was; profile is no cycle.
        assert r["flag_under_suppress"] is False
        assert r["load_after_warmup"] == 0
        assert r["flag_after_suppress"] is True
        assert r["rearrangements_after_profile"] == 0
        # Every rank stepped upstream identically: counters, window position, collectives.
        assert [(s["counter_before"], s["counter_after"], s["window_step"]) for s in r["steps"]] == [
            (s["counter_before"], s["counter_after"], s["window_step"]) for s in first["steps"]
        ]
        assert r["collectives"] == first["collectives"]
        assert all(s["routing_mismatches"] == 0 for s in r["steps"])
        if use_async:
            assert r["worker_alive"] is True
        assert r["routers_adapted"] == [True] * ranks.NUM_MOE_LAYERS
        # Default settings: upstream's policy object itself runs, nothing wrapped.
        assert r["policy"] == {"is_upstream_default": True, "name": "DefaultEplbPolicy", "settings": "None"}

    for c in range(3):
        cycles = [r["cycles"][c] for r in reports]
        # One global placement, identical on every rank.
        assert all(cy["committed_map"] == cycles[0]["committed_map"] for cy in cycles)
        assert all(cy["expected_global"] == cycles[0]["expected_global"] for cy in cycles)
        cy = cycles[0]
        if cy["zero_window"]:
            # No rank recorded load: the rearrangement was skipped everywhere, placement unchanged.
            assert sum(cy2["local_window_total"] for cy2 in cycles) == 0
            assert all(cy2["num_skipped"] == 1 and cy2["num_rearrangements"] == 1 for cy2 in cycles)
            assert cy["committed_map"] == cy["old_map"]
            # The gate's reason no_load, published on every rank (the only decision with the gate off).
            assert all(
                cy2["decisions"] == [("fake/tiny-moe", None, "default", "no_load", None, None, 0)]
                and cy2["skipped_by_reason"] == {"no_load": 1}
                for cy2 in cycles
            )
        else:
            assert sum(map(sum, cy["expected_global"])) > 0
            # Upstream's window equals exactly what the unfiltered ranks recorded (filtered ones add 0),
            assert all(cy2["last_expert_load"] == cy["expected_global"] for cy2 in cycles)
            # and the committed placement is upstream's default policy on that load.
            assert cy["committed_map"] == cy["policy_map"]
            assert cy["committed_map"] != cy["old_map"]
            assert all(cy2["decisions"] == [] for cy2 in cycles)
    assert [r["cycles"][2]["num_rearrangements"] for r in reports] == [2] * world_size
    # Elastic EP's update_mapping (refused by serving, kept by control): every layer's lookup refreshed
    # in place to the one rebuilt from the remapped placement, one refresh event per layer.
    for r in reports:
        um = r["update_mapping"]
        assert um["map_is_remapped"] is True
        assert um["lookups_rebuilt"] == [True] * ranks.NUM_MOE_LAYERS
        assert um["lookups_changed"] == [True] * ranks.NUM_MOE_LAYERS
        assert um["tables_in_place"] == [True] * ranks.NUM_MOE_LAYERS
        assert um["events"] == [("refresh", layer, 2) for layer in LAYERS]


def _assert_commit_order(reports, use_async):
    for r in reports:
        log = r["commit_log"]
        for rearrangement in (1, 2):
            check_commit_order(
                [e for e in log if e[3] == rearrangement],
                LAYERS,
                local_slots=r["local_slots"],
                maps_before=r["cycles"][0 if rearrangement == 1 else 2]["old_map"],
                table_ptrs=r["table_ptrs"],
                acknowledged=use_async,
            )
    # The refreshed lookups agree across ranks: each rank's checksum equals its rebuild (ranks), and the
    # committed maps they derive from are identical (above).
    for rearrangement in (1, 2):
        for layer in LAYERS:
            maps = {
                tuple(
                    next(
                        e[4]["map"]
                        for e in r["commit_log"]
                        if e[0] == "commit" and e[2] == layer and e[3] == rearrangement
                    )
                )
                for r in reports
            }
            assert len(maps) == 1


@pytest.mark.multirank
def test_async_cycle_with_decode_collection_on_two_ranks(tmp_path):
    reports = _run(tmp_path, 2, True, "decode")
    _assert_cycles(reports, use_async=True)
    _assert_commit_order(reports, use_async=True)
    # Ranks had different phases in the same steps; only decode batches recorded, when upstream records.
    for r in reports:
        recording = [s for s in r["steps"] if s["recorded"]]
        assert recording
        assert all(not s["has_prefill"] for s in recording)
        assert any(
            s["has_prefill"] != t["has_prefill"]
            for s, t in zip(r["steps"], reports[1 - r["rank"]]["steps"], strict=True)
        )


@pytest.mark.multirank
def test_async_cycle_with_prefill_collection_on_four_ranks(tmp_path):
    reports = _run(tmp_path, 4, True, "prefill")
    _assert_cycles(reports, use_async=True)
    _assert_commit_order(reports, use_async=True)
    for r in reports:
        recording = [s for s in r["steps"] if s["recorded"]]
        assert recording
        assert all(s["has_prefill"] for s in recording)


@pytest.mark.multirank
def test_sync_commit_refreshes_every_layer_on_four_ranks(tmp_path):
    reports = _run(tmp_path, 4, False, "all")
    _assert_cycles(reports, use_async=False)
    _assert_commit_order(reports, use_async=False)
    for r in reports:
        # Under "all" every batch of a recording step records, whatever its phase.
        assert {s["has_prefill"] for s in r["steps"] if s["recorded"]} == {True, False}


GATE = {"policy": "migration_aware", "min_balancedness_gain": 0.01, "target_balancedness": 0.99}


@pytest.mark.multirank
def test_the_gate_skips_alike_on_ranks_whose_local_loads_differ_then_migration_aware_rearranges(tmp_path):
    reports = _run(tmp_path, 2, True, "all", ("split", "hot"), GATE)
    settings = PolicySettings(**GATE)
    for r in reports:
        assert r["errors"] == [], r["errors"]
        assert r["policy"] == {
            "is_upstream_default": False,
            "name": "GatedMigrationAwarePolicy",
            "settings": repr(settings),
        }
        assert all(s["routing_mismatches"] == 0 for s in r["steps"])
        assert r["worker_alive"] is True
    split = [r["cycles"][0] for r in reports]
    # Each rank recorded load on its own block of experts only: the local windows differ entirely ...
    block = ranks.NUM_LOGICAL // 2
    for rank, cy in enumerate(split):
        for row in cy["expected_local"]:
            assert sum(row[(1 - rank) * block : (2 - rank) * block]) == 0
            assert sum(row[rank * block : (rank + 1) * block]) == 2 * ranks.TOKENS * ranks.TOP_K
    # ... and the global window, the one upstream hands to the policy, is even under the placement in
    # force: 5 selections per step on the first half of each block, 4 on the second, two steps.
    even = [10 if e % block < block // 2 else 8 for e in range(ranks.NUM_LOGICAL)]
    for cy in split:
        assert cy["last_expert_load"] == cy["expected_global"] == [even] * ranks.NUM_MOE_LAYERS
        # Skipped alike on every rank: same reason and figures, placement unchanged, nothing sent.
        assert cy["decisions"] == [("fake/tiny-moe", 1, "migration_aware", "balanced", 1.0, None, 0)]
        assert cy["skipped_by_reason"] == {"balanced": 1}
        assert (cy["num_rearrangements"], cy["num_skipped"]) == (1, 0)
        assert cy["committed_map"] == cy["old_map"]
        assert cy["transfers"] == {"send": 0, "recv": 0}
    # The skipped rearrangement still ran upstream's per-layer commit, move to acknowledge (unchanged maps).
    for r in reports:
        committed = check_commit_order(
            [e for e in r["commit_log"] if e[3] == 1],
            LAYERS,
            local_slots=r["local_slots"],
            maps_before=r["cycles"][0]["old_map"],
            table_ptrs=r["table_ptrs"],
        )
        assert [committed[layer] for layer in LAYERS] == r["cycles"][0]["old_map"]

    # A window whose load sits on rank 0's experts passes the gate: every rank commits the
    # migration-aware placement.
    skewed = [r["cycles"][1] for r in reports]
    cy = skewed[0]
    assert all(c["committed_map"] == cy["committed_map"] == c["policy_map"] for c in skewed)
    assert cy["committed_map"] != cy["old_map"]
    load = torch.tensor(cy["expected_global"])
    old, new = torch.tensor(cy["old_map"]), torch.tensor(cy["committed_map"])
    before = float(balancedness(load, old, 2).mean())
    planned = float(balancedness(load, new, 2).mean())
    moved = moved_experts(old, new, 2)
    assert before < GATE["target_balancedness"]
    assert planned - before >= GATE["min_balancedness_gain"]
    assert all(
        c["decisions"] == [("fake/tiny-moe", 2, "migration_aware", None, before, planned, int(moved.sum()))]
        for c in skewed
    )
    # Upstream's transaction received exactly the experts the placement moved, one per (layer, rank).
    assert sum(c["transfers"]["recv"] for c in skewed) == int(moved.sum()) > 0
    assert all(c["skipped_by_reason"] == {"balanced": 1} and c["num_rearrangements"] == 2 for c in skewed)


@pytest.mark.multirank
def test_two_models_decide_on_their_own_estimates_and_a_stopped_cycle_never_hands_a_decision_over(tmp_path):
    """Issue 36's crossing and issue 37's estimate: a target and a draft in one state, the
    migration-aware policy on each model's load estimate, windows of 8 passes every 6 steps. In
    rearrangement 2 the target's cycle stops before its first layer moves; the draft's commits and its
    published decision is its own (one shared queue of decisions handed it the target's)."""
    reports = run_ranks(
        ranks.two_model_world, world_size=2, tmp_path=tmp_path, timeout_s=240, preload=PRELOAD
    )
    first = reports[0]
    names = first["model_names"]
    for r in reports:
        assert r["worker_alive"] is True
        # Every rank: the same evidence, calls, decisions and estimates, bit for bit.
        for key in ("calls", "published", "evidence", "expected", "estimates", "maps_at_end"):
            assert r[key] == first[key], key
    # Each estimate took, per rearrangement, exactly the selections routed since the last one (every
    # rank's real tokens x K, once): after the first, 6 steps of them, where upstream's window holds 8
    # passes from the third on (2 of them seen before).
    per_step = 2 * ranks.TOKENS * ranks.TOP_K
    for model in ("target", "draft"):
        evidence, window = first["evidence"][model], first["windows"][model]
        assert evidence == first["expected"][model]
        assert len(evidence) == ranks.TWO_REARRANGEMENTS
        assert [sorted({sum(row) for row in e}) for e in evidence[1:]] == [
            [per_step * ranks.TWO_INTERVAL]
        ] * 3
        assert [sorted({round(sum(row)) for row in w}) for w in window[2:]] == [
            [per_step * ranks.TWO_WINDOW]
        ] * 2
        assert first["estimates"][model][0] == ranks.TWO_REARRANGEMENTS
    # Every policy call in registration order, the target first; each published decision is the one of
    # its own model's call (the draft's in the stopped rearrangement too), planned on its estimate.
    calls = first["calls"]
    rearrangements = range(1, ranks.TWO_REARRANGEMENTS + 1)
    assert [(n, name) for n, name, _ in calls] == [
        (n, name) for n in rearrangements for name in ("target", "draft")
    ]
    decided = {(names[name], n): decision for n, name, decision in calls}
    assert all(d.load_estimate == "pooled" for d in decided.values())
    published = {(model, n): decision for model, n, decision in first["published"]}
    stopped = ranks.STOPPED
    everything = {(names[m], n) for n in rearrangements for m in ("target", "draft")}
    assert set(published) == everything - {(names["target"], stopped)}
    for key, decision in published.items():
        assert decision == decided[key], key
    assert published[(names["draft"], stopped)] != decided[(names["target"], stopped)]
    # The stopped cycle moved none of the target's experts.
    maps = first["maps_at_start"]
    assert maps[stopped]["target"] == maps[stopped - 1]["target"] != maps[stopped - 2]["target"]
