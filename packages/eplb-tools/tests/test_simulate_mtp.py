"""The main job's model on vLLM's engine with ``simulate --speculative-tokens``: the DeepSeek-V3 preset
(routing skewed like the ESFT trace) and its MTP draft (vLLM's ``DeepSeekMTP``, the preset's MTP layer)
served beside the target by vLLM's engine, both balanced in the one EPLB state, every check on both; then
plan on the run's events file and a run started from the placement it exports."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ascend_eplb.integration.events.reader import read_events
from ascend_eplb.integration.events.records import (
    InitialPlacementRecord,
    RearrangementRealisedRecord,
    RearrangementRecord,
    WindowRecord,
)
from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.simulate.driver import run_simulation
from ascend_eplb.tools.simulate.models import resolve_model
from ascend_eplb.tools.simulate.plot import balancedness_figure

#: The preset on 2 ranks (TP=2 x EP=2), rearranging every 8 steps: both models complete >= 2.
MTP = dict(speculative_tokens=1, num_ranks=2, steps=24, window_size=4, step_interval=8, progress=False,
           timeout_s=600)  # fmt: skip


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_the_preset_with_its_mtp_draft_balances_both_models_every_check_on_both(tmp_path, capsys):
    folder = str(resolve_model("deepseek-v3").folder)
    draft = f"{folder} (draft)"
    report = run_simulation(SimulateConfig(**MTP, out_dir=str(tmp_path)))
    assert report.passed, report.first_violation
    assert report.checks == dict.fromkeys(("outputs", "load", "fingerprints", "lookups", "worker"), True)
    served = (report.model, report.format, report.layers, report.num_logical_experts, report.top_k)
    assert served == ("DeepseekV3ForCausalLM", "float32", 4, 64, 6)
    assert report.max_output_error <= 1e-5
    # The load is skewed like the real trace's: without EPLB, within 0.05 of the trace's own figure at
    # the steps' size (the batch's 32 decoding requests), and EPLB balances it beyond that.
    trace_off = _trace_balancedness_off(4, 2, 4, 32)
    assert abs(report.balancedness_off_mean - trace_off) <= 0.05, (report.balancedness_off_mean, trace_off)
    assert report.balancedness_after > report.balancedness_off_after
    # vLLM's engine served it twice, EPLB off then on: each one's figures
    for engine in (report.engine_off, report.engine_on):
        assert engine.tokens == 32 * 24
        assert engine.start_s > 0
        assert engine.generate_s > 0
        assert engine.tpot_s > 0
    d = report.draft
    assert d is not None
    assert (d.model, d.architecture, d.forwards_per_step, d.layers) == (draft, "DeepSeekMTP", 1, 1)
    # Both models rearranged, each on its own load, in upstream's one cycle (the draft's layer first).
    assert d.rearrangements_completed >= 2
    assert report.rearrangements_completed >= 2
    # Upstream commits every layer of a completed rearrangement, the draft's one MTP layer included.
    assert d.layers_committed >= d.rearrangements_completed * d.layers
    # Measured by its communicators beside estimated from its records (a cycle in flight: received, no
    # record yet), as the target's.
    assert d.bytes_received is not None
    assert d.bytes_received >= d.bytes_moved > 0
    assert d.experts_moved > 0
    assert d.max_output_error <= 1e-5
    assert d.initial_placement is None
    # Each record is its model's: the target's top-level records and the draft's section share none.
    runs = read_events(tmp_path / "events.jsonl").runs
    assert len(runs) == 1
    records = [r for _, r in runs[0].records]
    windows = {m: sum(isinstance(r, WindowRecord) and r.model == m for r in records) for m in (folder, draft)}
    assert windows[folder] == windows[draft] == report.rearrangements
    done = {
        m: [r.rearrangement for r in records if isinstance(r, RearrangementRecord) and r.model == m]
        for m in (folder, draft)
    }
    assert [r.rearrangement for r in report.rearrangement_records] == done[folder]
    assert [r.rearrangement for r in d.rearrangement_records] == done[draft]
    assert {r.model for r in report.rearrangement_records} == {folder}
    assert {r.model for r in d.rearrangement_records} == {draft}
    # Planned and realised per model: each section's figures are its own model's records' (realised: the
    # mean over the windows a placement served, from that model's rearrangement_realised records).
    for m, outcomes in ((folder, report.rearrangement_records), (draft, d.rearrangement_records)):
        planned = [
            (r.balancedness_before, r.balancedness_planned)
            for r in records
            if isinstance(r, RearrangementRecord) and r.model == m
        ]
        assert [(o.balancedness_before, o.balancedness_planned) for o in outcomes] == planned
        served = {
            r.placed_by: (r.balancedness_realised_mean, r.windows_realised)
            for r in records
            if isinstance(r, RearrangementRealisedRecord) and r.model == m and r.placed_by is not None
        }
        moved = [o for o in outcomes if o.skipped is None and o.rearrangement in served]
        assert moved  # its first completed rearrangement's placement served a window
        assert [(o.balancedness_realised, o.windows_realised) for o in moved] == [
            served[o.rearrangement] for o in moved
        ]
    # The load check counted the draft's real selections of its forwards on the steps the target recorded
    # (one record flag for both models): its real tokens x K, the target's x L.
    assert d.load_steps_recorded > 0
    assert report.check_evidence["load"].startswith(
        f"{d.load_steps_recorded} of {report.steps} steps recorded load"
    )
    assert d.load_selections > 0
    assert d.load_selections % 6 == 0
    # Its balancedness with EPLB beside EPLB off on the same steps, after its first completed rearrangement.
    assert len(d.balancedness_per_step) == len(d.balancedness_off_per_step) == report.steps
    assert d.balancedness_after > d.balancedness_off_after
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["draft"] == report.to_json()["draft"]
    assert saved["draft"]["rearrangement_records"][0]["model"] == draft
    out = capsys.readouterr().out
    assert f"  draft {draft} (vLLM's DeepSeekMTP, 1 MoE layer, 1 forward(s) per step after the target)" in out
    assert "with the MTP draft proposing 1 token per step (its moved experts: the fingerprints check" in out
    assert "vLLM's engine, EPLB on beside off (EPLB's overhead on this host" in out
    assert (tmp_path / "balancedness.png").stat().st_size > 0
    # The plot marks each model's planned and realised (the draft's hollow, its labels its own).
    labels = balancedness_figure(report).axes[0].get_legend_handles_labels()[1]
    marks = ("planned", "realised", "MTP draft planned", "MTP draft realised")
    assert [x for x in labels if x.startswith(marks)] == [
        "planned (its window)", "realised (the windows it served)", "MTP draft planned (its window)",
        "MTP draft realised (the windows it served)",
    ]  # fmt: skip

    # plan reads the events file of both models: each model's sweep on its own windows, one placement
    # file of both (version 2, each named as upstream names it); simulate starts from it with the draft,
    # and refuses it without (a placement file naming a model that run does not serve).
    from ascend_eplb.integration.placement_file import read_placements
    from ascend_eplb.tools.cli import main

    both = tmp_path / "both.json"
    assert (
        main(["plan", str(tmp_path / "events.jsonl"), "--ranks", "2", "--export-expert-map", str(both)]) == 0
    )
    out = capsys.readouterr().out
    assert f"model {draft}:" in out
    assert f"model {folder}:" in out
    assert f"wrote {both}: the placements of 2 models:" in out
    placements = read_placements(both)
    assert [(p.model, p.num_moe_layers, p.num_physical_experts, p.num_ranks) for p in placements] == [
        (draft, 1, 68, 2),
        (folder, 4, 68, 2),
    ]
    provenance = json.loads(both.read_text())["source"]
    assert [m["model"] for m in provenance["models"]] == [draft, folder]
    source = resolve_model("deepseek-v3")
    with pytest.raises(ValueError, match=re.escape(f"names model {draft}, which this server does not serve")):
        SimulateConfig(
            **{**MTP, "speculative_tokens": 0}, initial_placement=str(both), out_dir=str(tmp_path / "o")
        ).validate_model(source)
    # The run's events file starts either run: with the draft each model on its last committed placement,
    # without it the target (the draft's records are of a model that run does not serve: not read).
    events = str(tmp_path / "events.jsonl")
    for tokens in (1, 0):
        options = {**MTP, "speculative_tokens": tokens}
        SimulateConfig(**options, initial_placement=events, out_dir=str(tmp_path / "o")).validate_model(
            source
        )
    # Started from it with the draft, each model's start-up install is its own: its record, its totals,
    # every slot holding its expert from step 0, plan's prediction for it beside its first step.
    restarted = run_simulation(
        SimulateConfig(**{**MTP, "steps": 8}, initial_placement=str(both), out_dir=str(tmp_path / "o"))
    )
    assert restarted.passed, restarted.first_violation
    summary = capsys.readouterr().out
    lines = (tmp_path / "o" / "events.jsonl").read_text().splitlines()
    # Both installs are recorded before any step's record.
    assert [json.loads(line)["event"] for line in lines[:3]] == ["run_start", *["initial_placement"] * 2]
    installs = {
        r.model: r
        for _, r in read_events(tmp_path / "o" / "events.jsonl").runs[0].records
        if isinstance(r, InitialPlacementRecord)
    }
    # The target's install as the summary and the checks say it: its first step measured beside plan's
    # measure and EPLB off, plan's prediction, the fingerprints check of both installs, the totals' note.
    start, predicted = restarted.initial_placement, provenance["models"][1]["balancedness_after"]
    assert (start.source, start.plan_predicted_on_its_load) == (str(both), predicted)
    assert start.first_step_balancedness == restarted.balancedness_per_step[0]
    assert start.first_step_off == restarted.balancedness_off_per_step[0]
    assert (
        f"  initial placement {both}: first step balancedness {start.first_step_balancedness:.4f} measured "
        "(each token's selection served by one replica of its expert), "
        f"{start.first_step_planned:.4f} on plan's measure of that step's load (each expert's load split "
        "evenly over its replicas: the two differ by how the replicas shared the step's tokens), EPLB off "
        f"{start.first_step_off:.4f}; plan predicted {predicted:.4f} on the load it was made from; every "
        "slot held its logical expert from step 0"
    ) in summary
    assert (
        "; the first 5 were the start-up install of the initial placement, checked before the first step"
        in restarted.check_evidence["fingerprints"]
    )
    assert "(every total counts the start-up install of 4 layers as a rearrangement)" in summary
    assert f"start-up install (before step 0): {installs[folder].experts_moved} experts, " in summary
    done = [r for r in restarted.rearrangement_records if r.skipped is None]
    assert restarted.experts_moved == installs[folder].experts_moved + sum(r.experts_moved for r in done)
    assert restarted.bytes_moved == installs[folder].bytes_moved + sum(r.bytes_moved for r in done)
    for model, install, layers in (
        (folder, restarted.initial_placement, 4),
        (draft, restarted.draft.initial_placement, 1),
    ):
        assert (
            installs[model].placement
            == next(p for p in placements if p.model == model).physical_to_logical_map
        )
        assert install.layers_committed == layers
        assert (install.experts_moved, install.bytes_moved) == (
            installs[model].experts_moved,
            installs[model].bytes_moved,
        )
        assert install.slots_hold_their_experts is True
        assert install.plan_predicted_on_its_load == next(
            m["balancedness_after"] for m in provenance["models"] if m["model"] == model
        )
    d = restarted.draft
    done = [r for r in d.rearrangement_records if r.skipped is None]
    assert d.experts_moved == installs[draft].experts_moved + sum(r.experts_moved for r in done)
    assert d.layers_committed == 1 + d.rearrangements_completed  # its one MTP layer each time


def test_a_draft_is_refused_before_any_process_where_there_is_none(tmp_path, capsys):
    from ascend_eplb.tools.cli import main

    assert (
        main(["simulate", "--model", "replay", "--speculative-tokens", "1", "--out", str(tmp_path / "o")])
        == 2
    )
    assert (
        "speculative tokens=1: the MTP draft is a real model's (--model deepseek-v3 or a DeepSeek-V3 folder "
        "with its MTP layer); --model replay has none"
    ) in capsys.readouterr().err
    qwen = str(resolve_model("qwen3-moe").folder)
    assert (
        main(["simulate", "--model", "qwen3-moe", "--speculative-tokens", "2", "--out", str(tmp_path / "o")])
        == 2
    )
    assert (
        "speculative tokens=2: the MTP draft needs a float32 DeepSeek-V3 checkpoint with its MTP layer; "
        "model qwen3-moe is Qwen3MoeForCausalLM in float32 with 0 MTP layer(s)"
    ) in capsys.readouterr().err
    assert qwen  # the preset exists (written once into the cache)
    # Upstream's one cycle moves the draft's MTP layer and the target's 4, one layer per step: 7 steps
    # complete the first rearrangement from step 2, not 6 (the worker check failed such a run).
    short = ["--steps", "6", "--step-interval", "8", "--window-size", "4", "--ranks", "2"]
    assert main(["simulate", "--speculative-tokens", "1", *short, "--out", str(tmp_path / "o")]) == 2
    assert (
        "steps=6: too few to complete a rearrangement: the first starts at step 2 (upstream starts its "
        "counter at 3/4 of step interval 8) and upstream commits at most one of the 5 MoE layers (the "
        "target's 4 and its draft's 1: one cycle moves both) per step, so at least 7 steps"
    ) in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse's refusal of the value
        main(["simulate", "--speculative-tokens", "-1", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "argument --speculative-tokens: -1: must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _trace_balancedness_off(
    num_moe_layers: int, num_ranks: int, num_redundant: int, step_tokens: int
) -> float:
    """The embedded ESFT trace's own EPLB-off balancedness: its first MoE layers' selections in steps of
    ``step_tokens`` tokens, on upstream's initial placement (the metric simulate reports per step)."""
    import torch

    from ascend_eplb.control import measures
    from ascend_eplb.tools.trace import load_trace

    trace = load_trace()
    ids = torch.from_numpy(trace.topk_ids[:num_moe_layers].astype(np.int64))  # [L, T, K]
    e = trace.num_logical_experts
    p2l = measures.upstream_initial_placement(e, num_redundant, num_moe_layers)
    values = []
    for start in range(0, ids.shape[1] - step_tokens + 1, step_tokens):
        load = torch.stack([torch.bincount(ids[layer, start : start + step_tokens].reshape(-1), minlength=e)
                            for layer in range(num_moe_layers)])  # fmt: skip
        values.append(measures.mean_balancedness(measures.rank_loads(load, p2l, num_ranks)))
    return float(np.mean(values))
