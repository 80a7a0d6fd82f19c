"""``ascend-eplb simulate --initial-placement FILE``: the serving path's ``eplb_config.initial_placement``
on vLLM's real model class, record -> plan -> serve from it, and every refusal before a rank starts."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from ascend_eplb.integration import placement_file as pf
from ascend_eplb.tools import cli
from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.simulate.driver import run_simulation

#: The replay world on 2 of the embedded trace's layers (64 experts), 2 ranks, 2 redundant experts.
REPLAY = ["simulate", "--model", "replay", "--ranks", "2", "--redundant-experts", "2", "--layers", "2",
          "--steps", "12", "--window-size", "2", "--step-interval", "4", "--no-progress"]  # fmt: skip
ROW = [*range(64), 0, 1]


def _placement(tmp_path, rows, experts=64, ranks=2, name="placement.json"):
    path = tmp_path / name
    pf.write_placement(path, pf.placement_from_map(rows, num_logical_experts=experts, num_ranks=ranks))
    return path


def test_a_placement_for_another_model_or_layout_is_refused_before_any_rank_starts(tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        (_placement(tmp_path, [ROW] * 3, name="layers.json"), "num_moe_layers: the file's 3, the model's 2"),
        (
            _placement(tmp_path, [[*range(32), 0, 1]] * 2, experts=32, name="experts.json"),
            "num_logical_experts: the file's 32, the model's 64",
        ),
        (
            _placement(tmp_path, [[*ROW, 2, 3]] * 2, name="redundant.json"),
            "num_physical_experts: the file's 68 (num_redundant_experts 4), the model's 66 "
            "(num_redundant_experts 2)",
        ),
        (
            _placement(tmp_path, [ROW] * 2, ranks=1, name="ranks.json"),
            "num_ranks: the file's 1, the model's 2",
        ),
    ]
    for path, differ in cases:
        assert cli.main([*REPLAY, "--out", str(out), "--initial-placement", str(path)]) == 2
        err = capsys.readouterr().err
        assert (
            "ascend-eplb simulate: error: invalid simulate options:\n  - eplb_config.initial_placement="
            in err
        )
        assert differ in err, err
    truncated = tmp_path / "truncated.json"
    truncated.write_text(_placement(tmp_path, [ROW] * 2).read_text()[:300])
    assert cli.main([*REPLAY, "--out", str(out), "--initial-placement", str(truncated)]) == 2
    err = capsys.readouterr().err
    assert f"  - initial placement={truncated}: not JSON: " in err
    assert "(the file ends early: truncated?)" in err
    with pytest.raises(SystemExit) as stopped:  # the option's type refuses it while parsing
        cli.main([*REPLAY, "--out", str(out), "--initial-placement", ""])
    assert stopped.value.code == 2
    assert (
        "argument --initial-placement: '': an empty path; name the file or folder" in capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="initial placement='': an empty path; name the file or folder"):
        run_simulation(
            SimulateConfig(model="replay", num_moe_layers=2, initial_placement="", out_dir=str(out))
        )
    assert not out.exists()  # refused before anything was written


@pytest.mark.multirank
@pytest.mark.timeout(1200)
def test_record_plan_and_simulate_from_the_placement_on_the_real_model_class(tmp_path, capsys):
    """Issue 28's loop on vLLM's engine serving Qwen3-MoE: a recording run of one window; plan exports for the
    recorded configuration; the run started from the file serves it from step 0 (every check passes, the
    verifier checked the install), its first step balanced as plan predicted, and it rearranges on."""
    config = dict(model="qwen3-moe", num_ranks=2, num_redundant_experts=2, window_size=2, step_interval=4,
                  progress=False, timeout_s=600)  # fmt: skip
    recorded = run_simulation(SimulateConfig(**config, steps=3, out_dir=str(tmp_path / "recorded"))).to_json()
    assert recorded["passed"], recorded["first_violation"]
    events = tmp_path / "recorded" / "events.jsonl"
    placement = tmp_path / "placement.json"
    assert cli.main(["plan", str(events), "--ranks", "2", "--export-expert-map", str(placement)]) == 0
    # The recorded configuration's level (the sweep may recommend another: the message then says why).
    assert "num_redundant_experts=2 (the recorded configuration" in capsys.readouterr().out
    predicted = json.loads(placement.read_text())["source"]["balancedness_after"]

    served = run_simulation(
        SimulateConfig(**config, steps=8, out_dir=str(tmp_path / "served"), initial_placement=str(placement))
    ).to_json()
    summary = capsys.readouterr().out
    assert served["passed"], served["first_violation"]
    assert all(served["checks"].values())
    start = served["initial_placement"]
    assert start["source"] == str(placement)
    assert start["slots_hold_their_experts"] is True
    # vLLM's engine steps its own batches (the recorded window is not the served run's first step): the
    # prediction on the recorded window against the served window is tests/test_engine_initial_placement's.
    assert start["plan_predicted_on_its_load"] == predicted
    assert start["first_step_balancedness"] == served["balancedness_per_step"][0]
    assert start["first_step_off"] == served["balancedness_off_per_step"][0]
    assert (
        f"initial placement {placement}: first step balancedness {start['first_step_balancedness']:.4f} "
        "measured (each token's selection served by one replica of its expert), "
        f"{start['first_step_planned']:.4f} on plan's measure of that step's load (each expert's load split "
        "evenly over its replicas: the two differ by how the replicas shared the step's tokens), EPLB off "
        f"{start['first_step_off']:.4f}; plan predicted {predicted:.4f} on the load it was made from; every "
        "slot held its logical expert from step 0"
    ) in summary
    assert (
        "the first 2 were the start-up install of the initial placement, checked before the first step"
        in (served["check_evidence"]["fingerprints"])
    )
    assert served["rearrangements_completed"] >= 1  # and it rearranged on from it
    records = [json.loads(line) for line in (tmp_path / "served" / "events.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records[:2]] == ["run_start", "initial_placement"]
    assert records[1]["placement"] == [list(r) for r in pf.read_placement(placement).physical_to_logical_map]
    # Every total counts the install as a rearrangement (issue 38 defect 6): its layers, experts and bytes.
    install = records[1]
    counted = (
        start["layers_committed"],
        start["layers_changed"],
        start["experts_moved"],
        start["bytes_moved"],
    )
    assert counted == (2, install["layers_changed"], install["experts_moved"], install["bytes_moved"])
    assert install["experts_moved"] > 0
    done = [r for r in served["rearrangement_records"] if r["skipped"] is None]
    assert served["experts_moved"] == install["experts_moved"] + sum(r["experts_moved"] for r in done)
    assert served["bytes_moved"] == install["bytes_moved"] + sum(r["bytes_moved"] for r in done)
    assert served["layers_committed"] == 2 + sum(r["event"] == "commit" for r in records)
    assert "(every total counts the start-up install of 2 layers as a rearrangement)" in summary
    assert f"start-up install (before step 0): {install['experts_moved']} experts, " in summary
