"""`ascend-eplb plan` equals upstream's default policy on the real ESFT per-task shares."""

import inspect
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from ascend_eplb.control import measures
from ascend_eplb.tools import cli, plan, plan_compare, trace
from ascend_eplb.world.esft import ESFT_TASKS, embedded_trace_path, task_shares_path

#: ESFT's raw text of the translation task's MoE layers 1 and 2, byte-identical (data/esft/ORIGIN.md).
ESFT_TEXT = Path(__file__).with_name("data") / "esft"


def _upstream(load, ranks, redundant, nodes=1, groups=1):
    num_moe_layers, num_experts = load.shape
    linear = list(range(num_experts)) + [i % num_experts for i in range(redundant)]
    old = torch.tensor([linear] * num_moe_layers)
    return DefaultEplbPolicy.rebalance_experts(
        torch.from_numpy(load), num_experts + redundant, groups, nodes, ranks, old
    )


@pytest.mark.parametrize("task", ESFT_TASKS)
def test_plan_matches_direct_upstream_policy_call(task):
    load = trace.load_load_matrix(task_shares_path(task))
    assert load.shape == (26, 64)
    result = plan.plan(load, num_ranks=8, redundancy=[0, 8, 16])
    for level, r in zip(result.levels, (0, 8, 16), strict=True):
        expected = _upstream(load, 8, r)
        np.testing.assert_array_equal(np.array(level.physical_to_logical_map), expected.numpy())
        after = measures.rank_loads(torch.from_numpy(load), expected, 8).numpy()
        assert level.balancedness_after == pytest.approx(np.mean(after.mean(1) / after.max(1)))
        assert level.balancedness_after > level.balancedness_before
    # Hierarchical branch (groups divisible by nodes) too.
    hier = plan.plan(load, num_ranks=4, redundancy=[4], num_nodes=2, num_expert_groups=8)
    np.testing.assert_array_equal(
        np.array(hier.levels[0].physical_to_logical_map), _upstream(load, 4, 4, 2, 8).numpy()
    )


# One `ascend-eplb plan` call in a fresh interpreter: the vllm modules it imported, where its policy
# class came from, and its JSON.
_FRESH_PLAN = """
import inspect, json, sys
from ascend_eplb.tools import cli, plan
code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "vllm": [m for m in sys.modules if m.split(".")[0] == "vllm"],
                  "policy_file": inspect.getsourcefile(plan.upstream_policy())}), file=sys.stderr)
"""


def test_a_plan_call_runs_upstreams_policy_file_without_importing_vllm_and_prints_the_same():
    path = task_shares_path("summary")
    argv = ["plan", str(path), "--ranks", "4", "--json"]
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PLAN, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["code"] == 0
    assert report["vllm"] == []
    assert report["policy_file"] == inspect.getsourcefile(DefaultEplbPolicy)
    # Here vllm's module is imported by name: the plan uses its class, and prints the very same.
    assert plan.upstream_policy() is DefaultEplbPolicy
    expected = plan.plan(trace.load_load_matrix(path), num_ranks=4)
    assert json.loads(done.stdout) == json.loads(json.dumps(expected.to_json()))
    assert [lv.num_redundant_experts for lv in expected.levels] == list(range(0, 65, 4))


def test_upstream_policy_is_imported_by_name_when_its_files_do_not_load_alone(monkeypatch):
    def fail():
        raise ImportError("stand-in for a later vLLM whose policy files import more")

    package = sys.modules["vllm.distributed.eplb.policy"]
    monkeypatch.setattr(package, "default", package.default)  # the import below rebinds it
    monkeypatch.delitem(sys.modules, plan.UPSTREAM_POLICY_MODULE)
    monkeypatch.setattr(plan, "_load_policy_files", fail)
    policy = plan.upstream_policy()
    assert policy.__module__ == plan.UPSTREAM_POLICY_MODULE
    assert inspect.getsourcefile(policy) == inspect.getsourcefile(DefaultEplbPolicy)
    assert sys.modules[plan.UPSTREAM_POLICY_MODULE].DefaultEplbPolicy is policy


def test_metrics_on_a_hand_checked_matrix():
    # 4 experts on 2 ranks, no redundancy: linear puts {0,1} | {2,3} -> loads 10 | 2.
    load = np.array([[9.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    result = plan.plan(load, num_ranks=2, redundancy=[0, 2])
    assert result.layers_excluded == [1]
    zero, two = result.levels
    assert zero.balancedness_before == pytest.approx(6 / 10)
    assert zero.hottest_rank_share_before == pytest.approx(10 / 12)
    # With 2 redundant slots the policy replicates the hot expert 0.
    new = np.array(two.physical_to_logical_map)
    assert new.shape == (1, 6)
    assert (new[0] == 0).sum() >= 2
    loads = measures.rank_loads(torch.from_numpy(load[:1]), torch.from_numpy(new), 2).numpy()
    assert two.balancedness_after == pytest.approx(float(loads.mean() / loads.max()))
    moved_expected = sum(
        e not in set(measures.upstream_initial_placement(4, 2, 1)[0, r * 3 : (r + 1) * 3].tolist())
        for r in range(2)
        for e in new[0, r * 3 : (r + 1) * 3].tolist()
    )
    assert two.experts_moved == moved_expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"num_ranks": 3, "redundancy": [0]},
            r"redundant experts=0: logical experts \(4\) \+ num_redundant_experts \(0\) = 4 physical experts "
            r"is not divisible by 3 EP ranks; fix: .* e.g. 2",
        ),
        (
            {"num_ranks": 2, "redundancy": [1, -1]},
            r"redundant experts=1: .* = 5 .*; redundant experts=-1: must be >= 0",
        ),
        ({"num_ranks": 4, "redundancy": [0], "num_nodes": 3}, r"nodes=3: must be >= 1 and divide ranks=4"),
        (
            {"num_ranks": 2, "redundancy": [0], "num_expert_groups": 3},
            r"expert groups=3: must be >= 1 and divide E=4",
        ),
    ],
)
def test_plan_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan.plan(np.ones((2, 4)), **kwargs)
    with pytest.raises(ValueError, match="all 2 layers have zero load"):
        plan.plan(np.zeros((2, 4)), num_ranks=2, redundancy=[0])


def test_cli_plan_json_and_errors(tmp_path, capsys):
    path = task_shares_path("law")
    assert cli.main(["plan", str(path), "--ranks", "8", "--redundant-experts", "0,8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [lv["num_redundant_experts"] for lv in out["levels"]] == [0, 8]
    expected = _upstream(trace.load_load_matrix(path), 8, 8).tolist()
    assert out["levels"][1]["physical_to_logical_map"] == expected
    assert cli.main(["plan", str(path), "--ranks", "8"]) == 0
    text = capsys.readouterr().out
    assert "upstream DefaultEplbPolicy: 26 layers x 64 logical experts, ranks=8" in text
    assert cli.main(["plan", str(path), "--ranks", "6", "--redundant-experts", "4"]) == 2
    assert "68 physical experts is not divisible by 6 EP ranks" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert cli.main(["plan", str(bad), "--ranks", "2"]) == 2
    assert "must be a [L, E] matrix, got shape (2,)" in capsys.readouterr().err
    assert cli.main(["plan", str(tmp_path / "missing.json"), "--ranks", "2"]) == 2
    assert f"{tmp_path / 'missing.json'}: no such file" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert cli.main(["plan", str(broken), "--ranks", "2"]) == 2
    assert f"{broken}: not valid JSON" in capsys.readouterr().err


@pytest.mark.multirank
def test_a_simulated_events_file_plans_like_its_load_matrix_and_like_the_online_record(tmp_path):
    """simulate writes events.jsonl through the serving recorder; plan reads it back."""
    from ascend_eplb.tools.simulate.config import SimulateConfig
    from ascend_eplb.tools.simulate.driver import run_simulation

    report = run_simulation(
        SimulateConfig(
            model="replay",
            num_ranks=2,
            num_redundant_experts=2,
            num_moe_layers=2,
            steps=12,
            window_size=2,
            step_interval=4,
            progress=False,
            timeout_s=240,
            out_dir=str(tmp_path),
        )
    ).to_json()
    # Every check passed; the worker's may be "not judged" where a loaded host's last cycle is still in
    # flight at the end (test_simulate's _passed_but_the_last_cycle): that cycle is then named.
    checks = dict(report["checks"])
    worker = checks.pop("worker")
    assert (checks, report["first_violation"]) == (dict.fromkeys(checks, True), None), report[
        "check_evidence"
    ]
    assert worker is True or (worker is None and report["in_flight_at_end"]), report["check_evidence"]
    events_file = tmp_path / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    windows = [e for e in events if e["event"] == "window"]
    assert len(windows) == report["rearrangements"]
    # A window counts each real (unpadded) token's K selections of every layer once per recorded step:
    # ranks x batch x K = 384 per step and layer, never a padded row.
    for w in windows:
        sums = [sum(row) for row in w["load"]]
        assert sums[0] == sums[1], sums
        assert sums[0] in (384, 768), sums

    total = trace.load_load_matrix(events_file)
    assert np.array_equal(total, np.sum([w["load"] for w in windows], axis=0))
    np.save(tmp_path / "load.npy", total)
    from_events = plan.plan(total, num_ranks=2, redundancy=[2])
    from_matrix = plan.plan(trace.load_load_matrix(tmp_path / "load.npy"), num_ranks=2, redundancy=[2])
    assert from_events == from_matrix
    last = trace.load_load_matrix(events_file, last=1)
    assert np.array_equal(last, np.array(windows[-1]["load"], dtype=np.float64))

    # The online record of the first rearrangement (initial placement -> the policy's) is exactly what
    # plan computes offline on that window.
    (first,) = [e for e in events if e["event"] == "rearrangement" and e["rearrangement"] == 1]
    offline = plan.plan(np.array(windows[0]["load"], dtype=np.float64), num_ranks=2, redundancy=[2]).levels[0]
    assert first["balancedness_before"] == pytest.approx(offline.balancedness_before, abs=1e-12)
    assert first["balancedness_planned"] == pytest.approx(offline.balancedness_after, abs=1e-12)
    assert first["experts_moved"] == offline.experts_moved
    assert (
        cli.main(["plan", str(events_file), "--ranks", "2", "--redundant-experts", "2", "--last", "1"]) == 0
    )


def test_default_sweep_recommendation_and_an_invalid_level_beside_the_valid_ones(tmp_path, capsys):
    path = task_shares_path("translation")
    load = trace.load_load_matrix(path)
    result = plan.plan(load, num_ranks=4)
    assert [lv.num_redundant_experts for lv in result.levels] == list(range(0, 65, 4))
    assert {lv.policy for lv in result.levels} == {"global"}
    best = max(lv.balancedness_after for lv in result.levels)
    chosen = result.level(result.recommended)
    assert chosen.balancedness_after >= best - plan.DEFAULT_MARGIN
    assert all(
        lv.balancedness_after < best - plan.DEFAULT_MARGIN
        for lv in result.levels
        if lv.num_redundant_experts < chosen.num_redundant_experts
    )
    # One invalid level among valid ones: the valid rows are computed and printed, the invalid one is
    # named with its rule, the exit status is 2.
    assert cli.main(["plan", str(path), "--ranks", "8", "--redundant-experts", "0,4,8"]) == 2
    out, err = capsys.readouterr()
    assert (
        "        4  invalid: redundant experts=4: logical experts (64) + num_redundant_experts (4) = 68"
        in out
    )
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["8"])]
    assert [r[:3] for r in rows] == [["0", "64", "global"], ["8", "72", "global"]]
    assert "ascend-eplb plan: error: redundant experts=4:" in err
    # With an export asked for, nothing is written when a requested level is invalid.
    target = tmp_path / "expert_map.json"
    args = [
        "plan",
        str(path),
        "--ranks",
        "8",
        "--redundant-experts",
        "0,4,8",
        "--export-expert-map",
        str(target),
    ]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"ascend-eplb plan: {target} not written: 1 of the requested redundancy levels are invalid (below); "
        "fix or drop them\nascend-eplb plan: error: redundant experts=4:"
    )
    assert not target.exists()


def test_global_policy_is_shown_beside_the_hierarchical_one_on_several_nodes():
    load = trace.load_load_matrix(task_shares_path("translation"))
    result = plan.plan(load, num_ranks=8, redundancy=[8], num_nodes=2, num_expert_groups=8)
    hier, glob = result.level(8, "hierarchical"), result.level(8, "global")
    np.testing.assert_array_equal(np.array(hier.physical_to_logical_map), _upstream(load, 8, 8, 2, 8).numpy())
    np.testing.assert_array_equal(np.array(glob.physical_to_logical_map), _upstream(load, 8, 8, 1, 1).numpy())
    # Node-local packing costs balance on this workload: 0.9710 hierarchical, 0.9958 global.
    assert round(hier.balancedness_after, 4) == 0.9710
    assert round(glob.balancedness_after, 4) == 0.9958


def test_esft_text_files_plan_like_their_compact_trace(tmp_path):
    # ESFT's text of MoE layers 1 and 2 (the repository ships those two of the 26) gives their load.
    from_text = trace.load_load_matrix(ESFT_TEXT)
    assert from_text.shape == (2, 64)
    assert np.array_equal(from_text, trace.load_trace().load()[:2].astype(np.float64))
    one = trace.load_load_matrix(ESFT_TEXT / "expert_weights_1.txt")
    assert np.array_equal(one, from_text[:1])
    assert one.sum() == 8251 * 6


def test_export_expert_map_reads_back_as_the_recommended_placement(tmp_path, capsys):
    path = task_shares_path("law")
    out = tmp_path / "expert_map.json"  # in an existing folder (plan creates none)
    assert (
        cli.main(
            ["plan", str(path), "--ranks", "4", "--redundant-experts", "4", "--export-expert-map", str(out)]
        )
        == 0
    )
    assert f"wrote {out}: num_redundant_experts=4 (global policy), 26 MoE layers x 4 devices" in (
        capsys.readouterr().out
    )
    data = json.loads(out.read_text())
    assert data["moe_layer_count"] == 26
    expected = _upstream(trace.load_load_matrix(path), 4, 4).numpy()
    for layer in data["layer_list"]:
        assert layer["device_count"] == 4
        assert [d["device_id"] for d in layer["device_list"]] == [0, 1, 2, 3]
        row = [e for d in layer["device_list"] for e in d["device_expert"]]
        assert row == expected[layer["layer_id"]].tolist()
        assert all(len(d["device_expert"]) == 17 for d in layer["device_list"])
    # The same file is a placement file (the superset: the model facts it was made for, and provenance).
    from ascend_eplb.integration.placement_file import read_placement

    placement = read_placement(out)
    assert placement.facts() == {
        "num_moe_layers": 26, "num_logical_experts": 64, "num_physical_experts": 68, "num_ranks": 4,
    }  # fmt: skip
    assert np.array_equal(np.array(placement.physical_to_logical_map), expected)
    assert (data["format"], data["version"]) == ("ascend-eplb-placement", 1)
    assert data["source"]["load"] == str(path)
    assert data["source"]["num_redundant_experts"] == 4


def _events_file(
    path, loads, *, num_ranks, num_physical_experts, num_expert_groups=1, num_nodes=1, new_selections=None
):
    from ascend_eplb.integration.events.recorder import EventsWriter
    from ascend_eplb.integration.events.records import WindowRecord

    writer = EventsWriter(path)
    for i, load in enumerate(loads, start=1):
        new = None if new_selections is None else tuple(map(tuple, new_selections[i - 1]))
        writer.write(WindowRecord(
            time=0.0, step=4 * i, model="m", rearrangement=i, load=tuple(map(tuple, load)), balancedness=0.5,
            balancedness_eplb_off=0.5, num_ranks=num_ranks, num_physical_experts=num_physical_experts,
            num_expert_groups=num_expert_groups, num_nodes=num_nodes, new_selections=new,
        ))  # fmt: skip
    writer.close()
    return path


def test_export_from_an_events_file_is_for_its_recorded_configuration(tmp_path, capsys):
    """Issue 28: plan EVENTS --ranks N --export-expert-map F needs no more options: the redundant count is
    the recorded server's (not the sweep's recommendation), every MoE layer of the load is in the file
    (one without load keeps upstream's initial placement), and the file is one that server accepts."""
    from ascend_eplb.integration.placement_file import read_placement
    from ascend_eplb.integration.rules import check_settings
    from ascend_eplb.integration.settings import EplbSettings

    load = trace.load_load_matrix(task_shares_path("law"))[:3] * 1000
    load[1] = 0  # a layer without load
    loads = [np.round(load).astype(int).tolist()]
    events = _events_file(tmp_path / "events.jsonl", loads, num_ranks=4, num_physical_experts=64 + 12)
    out = tmp_path / "placement.json"
    assert cli.main(["plan", str(events), "--ranks", "4", "--export-expert-map", str(out)]) == 0
    printed = capsys.readouterr().out
    recommended = next(line for line in printed.splitlines() if line.startswith("recommended:"))
    assert "num_redundant_experts=12 " not in recommended  # the sweep recommends another level ...
    other = int(re.match(r"recommended: num_redundant_experts=(\d+) ", recommended).group(1))
    result = plan.plan(np.array(loads[0], dtype=np.float64), num_ranks=4, redundancy=[0, 4, 8, 12, 16])
    level = result.level(12)
    # ... and the line written just below it says why the recorded level was written (issue 38).
    assert (
        f"wrote {out}: num_redundant_experts=12 (the recorded configuration's level, not the recommended "
        f"{other}: a server refuses a placement of another num_redundant_experts; --redundant-experts "
        f"{other} writes that level's for a server restarted with it; global policy), 3 MoE layers "
        f"x 4 devices; balancedness on its load {level.balancedness_after:.4f} (upstream's initial "
        f"placement: {level.balancedness_before:.4f}); layers [1] had no load and keep upstream's initial "
        "placement"
    ) in printed  # ... the export is the recorded one's
    placement = read_placement(out)
    rows = np.array(placement.physical_to_logical_map)
    assert rows.shape == (3, 76)
    assert np.array_equal(rows[[0, 2]], np.array(level.physical_to_logical_map))
    assert rows[1].tolist() == measures.upstream_initial_placement(64, 12, 1)[0].tolist()
    settings = EplbSettings(
        enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=4, num_redundant_experts=12,
        num_logical_experts=64, num_moe_layers=3, ascend_eplb_config={"initial_placement": str(out)},
    )  # fmt: skip
    assert list(check_settings(settings)) == []
    # --ranks other than the recorded layout's: exported for the ranks asked, with a warning.
    with pytest.warns(UserWarning, match="records 4 EP ranks") as caught:
        assert cli.main(["plan", str(events), "--ranks", "2", "--export-expert-map", str(out)]) == 0
    assert [str(w.message) for w in caught] == [
        f"{events} records 4 EP ranks; the placement is exported for --ranks 2 (a server of the recorded "
        "layout refuses it)"
    ]
    assert read_placement(out).facts()["num_ranks"] == 2
    # An events file that does not record its configuration (an earlier integration): the recommendation.
    old = tmp_path / "old.jsonl"
    old.write_text(
        "\n".join(json.dumps({k: v for k, v in json.loads(line).items() if not k.startswith("num_")})
                  for line in events.read_text().splitlines()) + "\n"
    )  # fmt: skip
    assert cli.main(["plan", str(old), "--ranks", "4", "--export-expert-map", str(out)]) == 0
    assert f"num_redundant_experts={result.recommended} (global policy)" in capsys.readouterr().out


def test_an_events_file_of_a_target_and_its_draft_is_one_request_of_a_sweep_per_model(tmp_path, capsys):
    """An events file of the target and its MoE draft (the draft's windows first, as upstream registers
    it) is read into one request before anything is planned: each model its own sweep on its own windows
    (--json: one line per model, named), and an option a model's records refuse is refused naming the
    model, nothing printed. E = 4 in 2 groups, 4 ranks, 4 redundant."""
    from ascend_eplb.integration.events.recorder import EventsWriter
    from ascend_eplb.integration.events.records import WindowRecord

    loads = {"m (draft)": [[1, 1, 6, 2]], "m": [[9, 1, 3, 3], [1, 1, 8, 2]]}
    path = tmp_path / "events.jsonl"
    writer = EventsWriter(path)
    for i in (1, 2):
        for model, load in loads.items():
            writer.write(WindowRecord(
                time=0.0, step=4 * i, model=model, rearrangement=i, load=tuple(map(tuple, load)),
                balancedness=0.5, balancedness_eplb_off=0.5, num_ranks=4, num_physical_experts=8,
                num_expert_groups=2, num_nodes=1,
            ))  # fmt: skip
    writer.close()
    assert cli.main(["plan", str(path), "--ranks", "4", "--redundant-experts", "4", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "model m (draft):\nmodel m:\n"
    printed = [json.loads(line) for line in captured.out.splitlines()]
    assert [p["model"] for p in printed] == ["m (draft)", "m"]
    for p in printed:
        load = np.array(loads[p["model"]], dtype=np.float64) * 2  # its two windows summed
        alone = plan.plan(load, num_ranks=4, redundancy=[4], num_expert_groups=2).to_json()
        assert {k: v for k, v in p.items() if k != "model"} == json.loads(json.dumps(alone))
    assert cli.main(["plan", str(path), "--ranks", "4", "--expert-groups", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines()[0] == (
        f"ascend-eplb plan: error: model m (draft): expert groups=1: {path} records num_expert_groups=2 (the "
        "model's, which upstream passed its policy); give --expert-groups 2 or leave it out"
    )


def test_plan_on_an_events_file_uses_its_recorded_expert_groups_and_nodes(tmp_path, capsys):
    """The events file records the expert groups and nodes upstream passed its policy: plan uses them
    without --expert-groups/--nodes; a --expert-groups that differs is refused naming both values, an
    equal one is accepted; a --nodes that differs is a what-if with a warning; an older file (no such
    fields) plans with 1 and 1. E = 4 in 2 groups ({0, 1}, {2, 3}), 4 ranks on 2 nodes, 4 redundant."""
    loads = [[[9, 1, 3, 3], [1, 1, 8, 2]]]
    events = _events_file(tmp_path / "events.jsonl", loads, num_ranks=4, num_physical_experts=8,
                          num_expert_groups=2, num_nodes=2)  # fmt: skip
    load = np.array(loads[0], dtype=np.float64)
    assert plan.recorded_grouping(trace.load_recorded(events)) == (2, 2)
    argv = ["plan", str(events), "--ranks", "4", "--redundant-experts", "4", "--json"]

    def planned(*extra):
        assert cli.main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    def expected(groups, nodes):
        result = plan.plan(load, num_ranks=4, redundancy=[4], num_nodes=nodes, num_expert_groups=groups)
        return json.loads(json.dumps(result.to_json()))

    grouped = expected(2, 2)
    assert (grouped["num_expert_groups"], grouped["num_nodes"], grouped["policy"]) == (2, 2, "hierarchical")
    # Upstream's hierarchical policy keeps each group's replicas on one node: its placement, not global's.
    assert grouped["levels"][0]["physical_to_logical_map"] == [
        [0, 0, 0, 1, 2, 2, 3, 3],
        [0, 0, 1, 1, 2, 2, 2, 3],
    ]
    assert planned() == grouped
    assert planned("--expert-groups", "2") == grouped
    assert cli.main([*argv, "--expert-groups", "1"]) == 2
    assert capsys.readouterr() == (
        "",
        f"ascend-eplb plan: error: expert groups=1: {events} records num_expert_groups=2 (the model's, which "
        "upstream passed its policy); give --expert-groups 2 or leave it out\n",
    )
    # The policy comparison is refused alike, before any policy runs.
    assert cli.main([*argv, "--policies", "default", "--expert-groups", "4"]) == 2
    assert "expert groups=4: " in capsys.readouterr().err
    # --nodes is the deployment's: a what-if, planned with the groups recorded (one node: upstream's
    # groups still order its packing, so the placement is neither the grouped one nor global's).
    with pytest.warns(UserWarning, match="records 2 node") as caught:
        one_node = planned("--nodes", "1")
    assert [str(w.message) for w in caught] == [f"{events} records 2 node(s); planned for --nodes 1"]
    assert one_node == expected(2, 1)
    assert one_node["levels"][0]["physical_to_logical_map"][1] == [0, 3, 2, 2, 2, 2, 2, 1]
    assert expected(1, 1)["levels"][0]["physical_to_logical_map"][1] == [3, 1, 2, 2, 2, 2, 2, 0]
    # Recorded nodes that do not divide other --ranks: refused, naming them.
    assert cli.main(["plan", str(events), "--ranks", "3", "--redundant-experts", "2"]) == 2
    assert capsys.readouterr().err == (
        f"ascend-eplb plan: error: ranks=3: {events} records num_nodes=2, which does not divide them; give "
        "--nodes\n"
    )
    # The policy comparison uses them too (the level: the recorded P = 8).
    assert cli.main(["plan", str(events), "--ranks", "4", "--policies", "default", "--json"]) == 0
    compared = json.loads(capsys.readouterr().out)
    direct = plan_compare.compare_policies(
        plan_compare.Windows((load,)),
        plan_compare.Deployment(4, 4, num_nodes=2, num_expert_groups=2),
        plan_compare.Candidates(("default",)),
    ).to_json()
    assert (compared["num_expert_groups"], compared["num_nodes"]) == (2, 2)
    assert compared["runs"] == json.loads(json.dumps(direct["runs"]))
    # A file recorded before these fields: 1 and 1, as the options' defaults.
    old = tmp_path / "old.jsonl"
    old.write_text("\n".join(
        json.dumps({k: v for k, v in json.loads(line).items() if k not in ("num_expert_groups", "num_nodes")})
        for line in events.read_text().splitlines()
    ) + "\n")  # fmt: skip
    assert plan.recorded_grouping(trace.load_recorded(old)) == (None, None)
    assert cli.main(["plan", str(old), "--ranks", "4", "--redundant-experts", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected(1, 1)


def test_costs_at_the_model_size(tmp_path, capsys):
    from ascend_eplb.tools.costs import estimate_costs, read_model_size

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_experts_per_tok": 8,
    }))  # fmt: skip
    model = read_model_size(tmp_path)  # DeepSeek-V3's sizes
    assert (model.num_logical_experts, model.num_moe_layers, model.top_k) == (256, 58, 8)
    c = estimate_costs(model, "w8a8_dynamic", num_ranks=32, num_redundant_experts=32, link_gbps=25.0,
                       busiest_rank_experts_per_layer=2.0)  # fmt: skip
    assert c.expert_nbytes == 3 * 7168 * 2048 + (2 * 2048 + 7168) * 4 == 44_085_248
    assert c.redundant_slots_per_rank_per_layer == 1
    assert c.redundant_nbytes_per_rank == 58 * 44_085_248
    assert c.busiest_rank_experts_received == 116
    assert c.transfer_seconds == pytest.approx(116 * 44_085_248 * 8 / 25e9)
    (tmp_path / "dense.json").write_text('{"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2}')
    with pytest.raises(ValueError, match=r"dense.json: no routed experts count \(a dense model has none\)"):
        read_model_size(tmp_path / "dense.json")
    # Llama 4 interleaves its MoE layers (interleave_moe_layer_step): 24 of 48 in vLLM, which the cost
    # estimate counted as 48; not counted here, it is named instead
    (tmp_path / "llama4.json").write_text(json.dumps({
        "architectures": ["Llama4ForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
        "num_local_experts": 16, "num_experts_per_tok": 1, "num_hidden_layers": 48,
        "interleave_moe_layer_step": 2,
    }))  # fmt: skip
    named = (
        "architecture Llama4ForCausalLM: the MoE layers of its model class are not counted here (only those "
        "of DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Glm4MoeForCausalLM, Qwen2MoeForCausalLM, "
        "Qwen3MoeForCausalLM, MixtralForCausalLM); vLLM counts them when it builds the model"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(named)}$"):
        read_model_size(tmp_path / "llama4.json")


def test_plan_refuses_what_it_cannot_plan_or_write_before_planning(tmp_path, capsys):
    load = tmp_path / "load.json"
    load.write_text("[[9, 1, 1, 1], [1, 2, 3, 4]]")
    assert cli.main(["plan", str(load), "--ranks", "9"]) == 2
    assert (
        "ranks=9: no redundancy level in [0, E=4] makes E + level divisible by the ranks"
        in capsys.readouterr().err
    )
    assert cli.main(["plan", str(load), "--ranks", "2", "--redundant-experts", "100000000"]) == 2
    assert (
        "redundant experts=100000000: must be <= 1023 (upstream's EplbState.add_model asserts "
        "num_redundant_experts <= 1023)"
    ) in capsys.readouterr().err
    for target, why in [
        (
            tmp_path / "missing" / "map.json",
            f"the folder {tmp_path / 'missing'} does not exist; fix: create it first",
        ),
        (tmp_path, "is a folder, not a file to write; fix: name the file, not its folder"),
    ]:
        assert cli.main(["plan", str(load), "--ranks", "2", "--export-expert-map", str(target)]) == 2
        assert f"export expert map={target}: {why}" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


# Issue 27: policies compared window by window. A hand-made load: 1 layer, E = 4, 2 ranks, 2 redundant
# (P = 6). Upstream's initial placement [0, 1, 2, 3, 0, 1]: rank 0 holds {0, 1, 2}, rank 1 {3, 0, 1}.
# w1 even (per replica 1, 1, 2, 2: ranks 4 | 4, balancedness 1.0); w2 no load; w3 and w4 hot expert 2
# (per replica 1, 1, 8, 2: ranks 10 | 4, balancedness 7 / 10). One move (a redundant slot of expert 0 or
# 1 on rank 1 re-pointed to expert 2) gives 7 | 7.
_HAND_WINDOWS = [[[2, 2, 2, 2]], [[0, 0, 0, 0]], [[2, 2, 8, 2]], [[2, 2, 8, 2]]]


def _upstream_chain(windows, ranks, redundant):
    """Upstream's DefaultEplbPolicy called directly, window by window, each call given the previous
    placement: (placement after, experts moved) per window (an all-zero window keeps the placement)."""
    from ascend_eplb.control.policy import moved_experts

    num_experts = len(windows[0][0])
    placement = measures.upstream_initial_placement(num_experts, redundant, len(windows[0]))
    out = []
    for w in windows:
        load = torch.tensor(w)
        if load.sum() == 0:
            out.append((placement, 0))
            continue
        new = DefaultEplbPolicy.rebalance_experts(load, num_experts + redundant, 1, 1, ranks, placement)
        out.append((new, int(moved_experts(placement, new, ranks).sum())))
        placement = new
    return out


def test_policies_compared_on_a_hand_made_events_file(tmp_path, capsys):
    from ascend_eplb.control.policy import balancedness

    events = _events_file(tmp_path / "events.jsonl", _HAND_WINDOWS, num_ranks=2, num_physical_experts=6)
    cfg = tmp_path / "config.json"  # H = 8, I = 4: one bf16 expert is 3 x 8 x 4 x 2 = 192 bytes
    cfg.write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 8,
                               "moe_intermediate_size": 4, "n_routed_experts": 4, "num_hidden_layers": 1,
                               "first_k_dense_replace": 0, "num_experts_per_tok": 2}))  # fmt: skip
    argv = [
        "plan",
        str(events),
        "--ranks",
        "2",
        "--target-balancedness",
        "1",
        "--min-balancedness-gain",
        "0.5",
        "--load-estimates",
        "window",
    ]
    assert cli.main([*argv, "--model-config", str(cfg), "--json"]) == 0  # the level: the recorded P = 6
    out = json.loads(capsys.readouterr().out)
    assert (out["num_windows"], out["num_redundant_experts"], out["expert_nbytes"]) == (4, 2, 192)
    runs = {(r["policy"], r["gate"]): r for r in out["runs"]}
    assert list(runs) == [
        ("default", "off"), ("migration_aware", "off"), ("default", "given"), ("migration_aware", "given"),
        ("default", "recommended"), ("migration_aware", "recommended"),
    ]  # fmt: skip

    def column(run, key):
        return [w[key] for w in run["windows"]]

    ours = runs["migration_aware", "off"]
    assert column(ours, "skipped") == [None, "no_load", None, None]
    assert column(ours, "balancedness_before") == [1.0, 1.0, 0.7, 1.0]
    assert column(ours, "balancedness_after") == [1.0, 1.0, 1.0, 1.0]
    assert column(ours, "balancedness_realised") == [1.0, 0.7, 1.0, None]  # w2 no load: 1.0 by definition
    assert column(ours, "estimate_balancedness_planned") == [None] * 4  # planned on the window
    assert column(ours, "experts_moved") == [0, 0, 1, 0]  # the even placement in force moves nothing
    assert column(ours, "bytes_moved") == [0, 0, 192, 0]
    assert (ours["rearranged"], ours["skipped"], ours["experts_moved"], ours["bytes_moved"]) == (
        3, {"balanced": 0, "min_gain": 0, "no_load": 1}, 1, 192,
    )  # fmt: skip
    # Upstream's default recomputes the even window (2 moves) and packs w3 to 7.33 | 6.67 (21 / 22).
    theirs = runs["default", "off"]
    chain = _upstream_chain(_HAND_WINDOWS, 2, 2)
    assert column(theirs, "experts_moved") == [moved for _, moved in chain] == [2, 0, 2, 0]
    assert column(theirs, "balancedness_after") == pytest.approx([1.0, 1.0, 21 / 22, 21 / 22], abs=1e-15)
    assert column(theirs, "balancedness_realised")[1:] == [
        float(balancedness(torch.tensor(_HAND_WINDOWS[2]), chain[1][0], 2).mean()),
        21 / 22,
        None,
    ]
    # The given gate: w1 is at the target (balanced), w3 and w4 gain less than 0.5 (min_gain): nothing moves.
    for policy, planned in (("default", 21 / 22), ("migration_aware", 1.0)):
        gated = runs[policy, "given"]
        assert column(gated, "skipped") == ["balanced", "no_load", "min_gain", "min_gain"]
        assert column(gated, "balancedness_after") == [1.0, 1.0, 0.7, 0.7]
        assert column(gated, "balancedness_planned") == pytest.approx([None, None, planned, planned])
        assert (gated["experts_moved"], gated["bytes_moved"]) == (0, 0)
        assert (gated["min_balancedness_gain"], gated["target_balancedness"]) == (0.5, 1.0)
    # Recommended for migration_aware: target = mean served (1.0 + 0.7 + 1.0) / 3 = 0.9; the gain: a fresh
    # placement lost nothing to the next window (0). With it, w1 and w4 are balanced enough, w3 moves 1.
    rec = next(g for g in out["recommended_gates"] if g["policy"] == "migration_aware")
    assert (rec["target_balancedness"], rec["min_balancedness_gain"]) == (0.9, 0.0)
    assert rec["mean_in_force"] == pytest.approx(0.9, abs=1e-15)
    recommended = runs["migration_aware", "recommended"]
    assert column(recommended, "skipped") == ["balanced", "no_load", None, "balanced"]
    assert column(recommended, "experts_moved") == [0, 0, 1, 0]

    assert cli.main([*argv, "--policies", "migration_aware"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert "moved = experts a rank receives that it did not hold, summed over ranks and layers; bytes: not " \
        "computed (no --model-config: give the model's config.json, and --format, for bytes at its expert " \
        "size)" in text  # fmt: skip
    assert text[3:9] == [
        "window | migration_aware      | migration_aware + gate",
        "       |  after         moved |  after         moved",
        "     1 | 1.0000             0 | 1.0000 skip balanced",
        "     2 | 1.0000  skip no_load | 1.0000  skip no_load",
        "     3 | 1.0000             1 | 0.7000 skip min_gain",
        "     4 | 1.0000             0 | 0.7000 skip min_gain",
    ]
    assert text[11:14] == [
        "  migration_aware                             3                                0/0/1             1 "
        "        n/a     1.0000        0.9000",
        "  migration_aware + gate                      0                                1/2/1             0 "
        "        n/a     0.8500        0.8000",
        "  migration_aware + recommended gate          1                                2/0/1             1 "
        "        n/a     1.0000        0.9000",
    ]
    assert "recommended gate for migration_aware: min_balancedness_gain=0 target_balancedness=0.9" in text
    assert (
        "  with it: 3 of 4 windows skipped (balanced 2, no_load 1); experts moved 1 (gate off: 1); mean "
        "realised 0.9000 (gate off: 0.9000)"
    ) in text
    # Both runs realise 0.9 on the windows that have a next one; the recommended gate moves as few
    # experts (1) as the gate off: the first of them, the gate-off run, is the one to choose.
    assert text[-2:] == [
        'choose: migration_aware: additional_config.eplb_config {"policy": "migration_aware"}; mean realised '
        "0.9000, 1 experts moved",
        "  rule: the highest mean realised balancedness (the next window under each placement: what serving "
        "sees); of the runs within 0.002 of it (the migration-aware policy's tolerance of upstream's "
        "balance), the one that moves the fewest experts",
    ]


# Issue 37: the load estimate compared. The selections each interval adds (what serving's estimate takes
# in) alternate the hot expert between 2 and 3; upstream's windows span two intervals (window_size = 2 x
# step_interval), so each window after the first holds both. Too few tokens for the estimate's shift test
# to call the alternation a shift (X^2 7.2 on 3 degrees of freedom at the second window, p = 0.07 > 1e-3):
# it pools every interval, each rescaled to the latest one's 14 selections.
_NEW = [[[2, 2, 8, 2]], [[2, 2, 2, 8]], [[2, 2, 8, 2]], [[2, 2, 2, 8]]]
_OVERLAPPING = [
    _NEW[0],
    *([[a + b for a, b in zip(x[0], y[0], strict=True)]] for x, y in itertools.pairwise(_NEW)),
]
_POOLED = [[[2, 2, 8, 2]], [[2, 2, 5, 5]], [[2, 2, 6, 4]], [[2, 2, 5, 5]]]


def _mean(load, placement):
    return measures.mean_balancedness(
        measures.rank_loads(torch.tensor(load, dtype=torch.float64), placement, 2)
    )


def test_the_load_estimate_compared_on_an_events_file_takes_in_its_recorded_new_selections(tmp_path):
    from ascend_eplb.control.policy import moved_experts

    assert _OVERLAPPING == [[[2, 2, 8, 2]], [[4, 4, 10, 10]], [[4, 4, 10, 10]], [[4, 4, 10, 10]]]
    events = _events_file(tmp_path / "events.jsonl", _OVERLAPPING, num_ranks=2, num_physical_experts=6,
                          new_selections=_NEW)  # fmt: skip
    windows = plan_compare.load_windows(events)
    assert [w.tolist() for w in windows.new_selections] == _NEW
    assert windows.evidence == (
        "the selections each window record holds since the previous one, as serving's estimate took them in"
    )
    result = plan_compare.compare_policies(
        windows, plan_compare.Deployment(2, 2), plan_compare.Candidates(("default",))
    )
    assert [(r.label, r.gate) for r in result.runs] == [
        ("default (window)", "off"), ("default (pooled)", "off"),
        ("default (window) + recommended gate", "recommended"),
        ("default (pooled) + recommended gate", "recommended"),
    ]  # fmt: skip
    pooled = result.run("default", load_estimate="pooled")
    # Upstream's policy called directly on the hand-pooled estimates, each given the previous placement.
    placement = measures.upstream_initial_placement(4, 2, 1)
    for i, outcome in enumerate(pooled.windows):
        new = DefaultEplbPolicy.rebalance_experts(torch.tensor(_POOLED[i]), 6, 1, 1, 2, placement)
        assert outcome.experts_moved == int(moved_experts(placement, new, 2).sum())
        assert outcome.estimate_balancedness_before == _mean(_POOLED[i], placement)
        assert outcome.estimate_balancedness_planned == _mean(_POOLED[i], new)
        assert outcome.balancedness_planned == _mean(_OVERLAPPING[i], new)
        realised = None if i == 3 else _mean(_OVERLAPPING[i + 1], new)
        assert outcome.balancedness_realised == realised
        placement = new
    # The pooled estimate [2, 2, 5, 5] replicates experts 2 and 3 alike: the windows that hold both are
    # served evenly from the second on (the first, fit to expert 2 alone, serves 21 / 26).
    assert [o.balancedness_realised for o in pooled.windows] == pytest.approx(
        [21 / 26, 1.0, 1.0, None], abs=1e-15
    )
    assert [o.experts_moved for o in pooled.windows] == [1, 3, 4, 2]  # upstream recomputes its packing
    window = result.run("default")
    assert [o.estimate_balancedness_planned for o in window.windows] == [None] * 4
    # The same file without the recorded selections: the estimate takes in the (overlapping) windows.
    old = _events_file(tmp_path / "old.jsonl", _OVERLAPPING, num_ranks=2, num_physical_experts=6)
    windows = plan_compare.load_windows(old)
    assert windows.new_selections is None
    assert windows.evidence.startswith("each window's load (the file records no selections since each ")
    on_loads = plan_compare.compare_policies(
        windows,
        plan_compare.Deployment(2, 2),
        plan_compare.Candidates(("default",), load_estimates=("pooled",)),
    )
    sums = np.cumsum(np.array(_OVERLAPPING, dtype=np.float64), axis=0)
    first = on_loads.runs[0].windows
    assert [o.estimate_balancedness_planned is not None for o in first] == [True] * 4
    placement = measures.upstream_initial_placement(4, 2, 1)
    for i, outcome in enumerate(first):
        estimate = sums[i] / sums[i].sum() * np.sum(_OVERLAPPING[i])
        new = DefaultEplbPolicy.rebalance_experts(torch.from_numpy(estimate), 6, 1, 1, 2, placement)
        assert outcome.estimate_balancedness_planned == _mean(estimate.tolist(), new)
        placement = new


def test_the_load_estimates_compared_on_the_embedded_esft_trace_and_the_run_to_choose():
    """The embedded ESFT trace in windows of 8 sequences (5 windows), 8 ranks, 8 redundant experts: the
    pooled estimate realises more than the window for both policies, and the choice's keys."""
    windows = plan_compare.load_windows(embedded_trace_path(), window_sequences=8)
    assert windows.evidence == "each window's tokens (a trace's windows do not overlap)"
    result = plan_compare.compare_policies(windows, plan_compare.Deployment(8, 8))
    totals = {
        r.label: (r.rearranged, r.experts_moved, round(r.mean_balancedness_realised, 4)) for r in result.runs
    }
    assert totals == {
        "default (window)": (5, 7443, 0.9481),
        "migration_aware (window)": (5, 928, 0.9490),
        "default (pooled)": (5, 6659, 0.9518),
        "migration_aware (pooled)": (5, 732, 0.9523),
        "default (window) + recommended gate": (2, 3083, 0.9517),
        "migration_aware (window) + recommended gate": (2, 493, 0.9510),
        "default (pooled) + recommended gate": (3, 4346, 0.9524),
        "migration_aware (pooled) + recommended gate": (4, 662, 0.9497),
    }
    # The pooled estimate is fed each window's own tokens: its first decision is the window's.
    first = result.run("migration_aware", load_estimate="pooled").windows[0]
    assert first.estimate_balancedness_planned == first.balancedness_planned
    # Within 0.002 of the best realised (0.9524), the run that moves the fewest experts.
    assert result.choice == plan_compare.Choice(
        "migration_aware (window) + recommended gate",
        {"policy": "migration_aware", "min_balancedness_gain": 0.045, "target_balancedness": 0.949},
        result.run("migration_aware", "recommended").mean_balancedness_realised,
        493,
        0.002,
    )


def _hand_trace(path):
    """A compact trace (trace.convert's layout): 1 layer, E = 4, top-1; sequences [0, 0], [1], [2, 3, 3]."""
    np.savez_compressed(
        path,
        topk_ids=np.array([[[0], [0], [1], [2], [3], [3]]], dtype=np.uint8),
        topk_weights_e4=np.full((1, 6, 1), 10_000, dtype=np.uint16),
        seq_offsets=np.array([0, 2, 3, 6], dtype=np.int64),
        layer_ids=np.array([1], dtype=np.int64),
        num_logical_experts=np.array(4, dtype=np.int64),
    )
    return path


def test_a_routing_trace_compares_policies_on_windows_of_sequences(tmp_path, capsys):
    path = _hand_trace(tmp_path / "trace.npz")
    windows = plan_compare.load_windows(path, window_sequences=2)
    assert [w.tolist() for w in windows.loads] == [[[2, 1, 0, 0]], [[0, 0, 1, 2]]]
    assert (windows.window, windows.source) == ("2 sequences (of 3)", str(path))
    windows = plan_compare.load_windows(path)  # default 4 sequences: the whole trace is one window
    assert ([w.tolist() for w in windows.loads], windows.window) == ([[[2, 1, 1, 2]]], "4 sequences (of 3)")
    argv = [
        "plan",
        str(path),
        "--ranks",
        "2",
        "--redundant-experts",
        "0",
        "--window-sequences",
        "2",
        "--json",
    ]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_windows"], out["window"], out["num_redundant_experts"]) == (2, "2 sequences (of 3)", 0)
    ours = out["runs"][1]
    assert (ours["policy"], ours["gate"]) == ("migration_aware", "off")
    # Initial placement {0, 1} | {2, 3}: w1 loads 3 | 0 (1/2), w2 0 | 3 (1/2). Without redundant slots the
    # best is one expert of 0, 1 and one of 2, 3 on each rank: w1 2 | 1 (3/4), w2 1 | 2 (3/4).
    assert [w["balancedness_before"] for w in ours["windows"]] == [0.5, 0.75]
    assert [w["balancedness_after"] for w in ours["windows"]] == [0.75, 0.75]
    assert [w["experts_moved"] for w in ours["windows"]] == [2, 0]
    # ESFT's own text files give the windows of the embedded trace, their compact conversion (on the two
    # MoE layers whose text the repository ships).
    esft = plan_compare.load_windows(ESFT_TEXT)
    embedded = plan_compare.load_windows(embedded_trace_path()).loads
    assert esft.window == "4 sequences (of 40)"
    assert len(esft.loads) == 10
    assert all(a.shape == (2, 64) for a in esft.loads)
    assert all(np.array_equal(a, b[:2]) for a, b in zip(esft.loads, embedded, strict=True))


def test_the_policy_comparison_refuses_what_it_cannot_compare(tmp_path, capsys):
    load = tmp_path / "load.json"
    load.write_text("[[9, 1, 1, 1]]")
    trace_file = _hand_trace(tmp_path / "trace.npz")
    base = ["plan", str(load), "--ranks", "2"]
    only_trace = (
        "window sequences=2: is only for a routing trace (.npz or a folder of ESFT "
        "expert_weights_<layer>.txt); an events file's windows are its own"
    )
    not_with_export = (
        f"export expert map={tmp_path / 'map.json'}: writes one level's placement from the level sweep; not "
        "with the policy comparison (--policies, --load-estimates, --min-balancedness-gain, "
        "--target-balancedness, --window-sequences)"
    )
    for argv, message in [
        ([*base, "--policies", "default"], f"{load}: states no redundancy level (an events file that records "
         "its configuration does); the policy comparison runs one: give --redundant-experts R"),
        ([*base, "--policies", "default", "--redundant-experts", "0,2"],
         "redundant experts=0,2: the policy comparison runs one redundancy level; give one"),
        ([*base, "--redundant-experts", "0", "--window-sequences", "2"], only_trace),
        (["plan", str(trace_file), "--ranks", "2", "--redundant-experts", "0", "--policies", "default",
          "--last", "1"], "last=1: is only for an events file (.jsonl)"),
        ([*base, "--redundant-experts", "1", "--policies", "default"],
         "redundant experts=1: logical experts (4) + num_redundant_experts (1) = 5 physical experts is not "
         "divisible by 2 EP ranks"),
        ([*base, "--redundant-experts", "0", "--target-balancedness", "0.9", "--export-expert-map",
          str(tmp_path / "map.json")], not_with_export),
    ]:  # fmt: skip
        assert cli.main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    # The gate's values and the policy names: start-up's rules (argparse: exit 2, the value and the rule).
    key = "additional_config.eplb_config"
    for option, value, rule in [
        ("--target-balancedness", "0", f"{key}.target_balancedness=0.0 must be a number in (0, 1] (a "
         "balancedness; leave it unset to turn the check off)"),
        ("--min-balancedness-gain", "nan", f"{key}.min_balancedness_gain=nan must be a number in [0, 1)"),
        ("--policies", "default,fewest",
         f"{key}.policy='fewest' is not one of ['default', 'migration_aware', 'split_aware']"),
        ("--load-estimates", "window,mean",
         f"{key}.load_estimate='mean' is not one of ['window', 'pooled']"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            cli.main([*base, option, value])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"ascend-eplb plan: error: argument {option}: '{value.split(',')[-1]}': {rule}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["load.json", "trace.npz"]  # nothing written


def test_a_sweep_row_whose_policy_placement_balances_worse_says_why(tmp_path, capsys):
    """Issue 38: a sweep row with nothing moved read 1.0000 -> 0.9677 with no word why. At
    num_redundant_experts = E on 2 ranks, upstream's initial placement gives each rank one replica of every
    expert (an even split of any load: 1.0); upstream's policy, planning from the load alone, gives the
    hottest expert a third replica and the coldest one, and packs them unevenly (0.9677), with no expert
    crossing ranks (each rank already holds every expert it is given: copies on the rank)."""
    load = tmp_path / "load.json"
    load.write_text("[[1, 4, 2, 3]]")
    assert cli.main(["plan", str(load), "--ranks", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["0"], ["2"], ["4"])}
    level = plan.plan(np.array([[1.0, 4.0, 2.0, 3.0]]), num_ranks=2, redundancy=[4]).levels[0]
    assert (level.balancedness_before, round(level.balancedness_after, 4)) == (1.0, 0.9677)
    assert level.experts_moved == 0
    assert rows["4"][3:5] == ["1.0000", "0.9677"]
    assert rows["4"][-1] == "0"
    assert (
        "experts moved = experts a rank receives that it did not hold, summed over ranks and layers (a slot "
        "refilled with an expert its rank already holds is a copy on the rank: not moved)"
    ) in lines
    (note,) = [line for line in lines if line.startswith("after < before")]
    assert note == (
        "after < before at num_redundant_experts=4: upstream's policy plans from the load alone (replicas to "
        "the hottest experts, then packing), not from the placement in force, so it can balance a load less "
        "than upstream's initial placement did (which, with num_redundant_experts = E on 2 ranks, gives each "
        "rank one replica of every expert: an even split of any load); a server at that level would "
        "rearrange into the worse placement"
    )


def test_plan_reads_the_last_run_of_an_appended_events_file_and_says_so(tmp_path, capsys):
    """Issue 38 defect 5: plan summed the windows of every run appended to one file (runs of other
    redundancy levels included) by other rules than the placement reader; both now read one model of the
    last run (``events.read_events``), and plan says what else the file holds, once."""
    from ascend_eplb.integration.events.recorder import EventsWriter
    from ascend_eplb.integration.events.records import WindowRecord

    first, second = [[9, 1, 3, 3], [1, 1, 8, 2]], [[1, 1, 1, 9], [2, 8, 1, 1]]
    path = tmp_path / "events.jsonl"
    writer = EventsWriter(path)
    # Run 1 served P = 8; run 2 (its rearrangement counter starts again, its steps do not) P = 6.
    for step, rearrangement, load, physical in ((4, 1, first, 8), (8, 2, first, 8), (12, 1, second, 6)):
        writer.write(WindowRecord(
            time=0.0, step=step, model="m", rearrangement=rearrangement, load=tuple(map(tuple, load)),
            balancedness=0.5, balancedness_eplb_off=0.5, num_ranks=2, num_physical_experts=physical,
        ))  # fmt: skip
    writer.close()
    from ascend_eplb.tools.files import InputFileWarning

    with pytest.warns(InputFileWarning) as caught:
        assert cli.main(["plan", str(path), "--ranks", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(
        json.dumps(plan.plan(np.array(second), num_ranks=2).to_json())
    )
    assert [str(w.message) for w in caught] == [
        f"{path} holds 2 runs (a run starts where the step or the rearrangement counter starts again); "
        "run 2, lines 3-3, is read"
    ]
    placement = tmp_path / "placement.json"
    with pytest.warns(InputFileWarning, match="run 2, lines 3-3, is read"):
        assert cli.main(["plan", str(path), "--ranks", "2", "--export-expert-map", str(placement)]) == 0
    assert "num_redundant_experts=2 (the recorded configuration" in capsys.readouterr().out  # run 2's P = 6


def _recorded(path: Path, *, num_ranks=2, num_physical_experts=6) -> Path:
    """An events file of one server: its run_start and two windows of E = 4 on the given layout."""
    records = [{"event": "run_start", "time": 0.0, "step": 0, "model": None, "run_id": "0" * 32, "pid": 1}]
    for i, load in enumerate(([[9, 1, 1, 1]], [[8, 2, 1, 1]]), start=1):
        records.append({"event": "window", "time": 0.0, "step": 4 * i, "model": "m", "rearrangement": i,
                        "load": load, "balancedness": 0.5, "balancedness_eplb_off": 0.5,
                        "num_ranks": num_ranks, "num_physical_experts": num_physical_experts})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_plan_takes_the_ranks_an_events_file_records_and_reads_a_trace_in_both_modes(tmp_path, capsys):
    """Issue 43 confusions: ``plan`` asked for ``--ranks`` that the events file records; ``plan X.npz
    --ranks 4`` refused the ``.npz`` its ``--policies`` mode reads."""
    events = _recorded(tmp_path / "events.jsonl")
    assert cli.main(["plan", str(events), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_ranks"] == 2
    assert cli.main(["plan", str(events), "--ranks", "4", "--json"]) == 0  # given: it wins
    assert json.loads(capsys.readouterr().out)["num_ranks"] == 4
    npz = tmp_path / "trace.npz"
    np.savez_compressed(
        npz, topk_ids=np.array([[[0, 1], [2, 3], [1, 2], [3, 0]]], dtype=np.uint8),
        topk_weights_e4=np.full((1, 4, 2), 5000, dtype=np.uint16), seq_offsets=np.array([0, 2, 4]),
        layer_ids=np.array([1]), num_logical_experts=np.array(4),
    )  # fmt: skip
    assert trace.load_load_matrix(npz).tolist() == [[2.0, 2.0, 2.0, 2.0]]  # its selections
    assert cli.main(["plan", str(npz), "--ranks", "2", "--json"]) == 0
    swept = json.loads(capsys.readouterr().out)
    assert (swept["num_moe_layers"], swept["num_logical_experts"]) == (1, 4)
    assert (
        cli.main(["plan", str(npz), "--ranks", "2", "--policies", "default", "--redundant-experts", "0"]) == 0
    )
    capsys.readouterr()


def test_plan_refuses_a_repeated_level_another_models_config_and_impossible_recorded_ranks(tmp_path, capsys):
    """Issue 43 cases 12 and 14: ``--redundant-experts 2,2,2`` printed the row three times; a
    ``--model-config`` of another model was costed silently; ``num_ranks`` 0 or -2 in the events file
    was warned about, then exported."""
    events = _recorded(tmp_path / "events.jsonl")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "hidden_size": 7168,
        "moe_intermediate_size": 2048,
    }))  # fmt: skip
    zero = _recorded(tmp_path / "zero.jsonl", num_ranks=0)
    cases = [
        (["plan", str(events), "--redundant-experts", "2,2,2"],
         "argument --redundant-experts: '2,2,2': lists 2 3 times; give each once"),
        (["plan", str(events), "--policies", "default,default"],
         "argument --policies: 'default,default': lists default 2 times; give each once"),
        (["plan", str(events), "--model-config", str(other)],
         f"model config={other}: {other / 'config.json'} is a model of 256 routed experts in 58 MoE layers, "
         f"the load {events} one of 4 in 1 loaded layers: a config of another model (its costs would be "
         "another model's); fix: give the config.json of the model that served the load"),
        (["plan", str(zero), "--export-expert-map", str(tmp_path / "map.json")],
         f"{zero}:2: a window's 'num_ranks' must be an integer >= 1, got 0"),
    ]  # fmt: skip
    for argv, line in cases:
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's refusal of an option's value
            code = e.code
        assert code == 2, argv
        assert capsys.readouterr().err.splitlines()[0] == f"ascend-eplb plan: error: {line}", argv
    assert not (tmp_path / "map.json").exists()


def test_batch_split_prints_each_batch_executed_by_todays_rule_and_the_split_beside_the_bound(
    capsys, tmp_path
):
    argv = ["plan", str(embedded_trace_path()), "--ranks", "8", "--redundant-experts", "8", "--batch-split"]
    assert cli.main([*argv, "--window-sequences", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["batch", "sequences", "tokens", "equal", "today", "split", "bound"]
    rows = [line.split() for line in lines[3:-1]]
    assert [(r[0], r[1]) for r in rows] == [(str(b), f"{8 * b}-{8 * b + 7}") for b in range(5)]
    assert sum(int(r[2]) for r in rows) == 8251  # every token of the trace, once
    # The ESFT translation trace at 72 slots, batches of 8 sequences (the dataplane README's table): the
    # split executes within 0.002 of the bound, today's rule 0.027 below it.
    assert lines[-1].split() == ["mean", "0.9642", "0.9627", "0.9879", "0.9897"]
    for r in rows:
        _, today, split, bound = map(float, r[3:])
        assert today < split <= bound
    assert cli.main([*argv, "--window-sequences", "20", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["first_sequence"], r["last_sequence"]) for r in report["rows"]] == [(0, 19), (20, 39)]
    assert report["steps"] == 8
    assert report["means"]["split"] <= report["means"]["bound"]
    load = tmp_path / "load.json"
    load.write_text("[[9, 1, 1, 1]]")
    for bad, message in [
        (["plan", str(load), "--ranks", "2", "--redundant-experts", "0", "--batch-split"],
         f"batch split: {load} is not a routing trace (.npz or a folder of ESFT expert_weights_<layer>.txt); "
         "the split routes each token, a load matrix has none"),
        ([*argv[:-2], "8,16", "--batch-split"],
         "batch split: runs one redundancy level; give --redundant-experts R"),
        ([*argv, "--policies", "default"],
         "batch split: not with --policies (another plan of the same command)"),
    ]:  # fmt: skip
        assert cli.main(bad) == 2, bad
        assert message in capsys.readouterr().err, bad
