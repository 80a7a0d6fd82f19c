"""DeepSeek-V3's multi-token prediction draft balanced beside the target (issue 36), on vLLM's real classes.

One world, DP=2 x TP=2 (EP=4: the TP peers route the same rows, the DP ranks' rows are gathered before
routing, sequence-parallel MoE as vLLM takes it on this host), each DP rank its own prompts with its own
real rows (12 and 9 of T = 12). The draft is vLLM's ``DeepSeekMTP``, loaded by upstream's
``MTPSpeculator`` from the checkpoint's MTP layer and registered by upstream's
``maybe_register_speculator`` beside the target in the one ``EplbState``; each step runs the target,
then the draft twice (``num_speculative_tokens=2``) on the previous hidden states, as Model Runner V2's
speculator does, with upstream's own ``_prepare_eplb_forward``. The verifier, the events file and the
Prometheus metrics are on. Then serving restarts on the same ranks from the run's events file: each
model starts from its own last committed placement. No HF transformers oracle of the MTP layer exists
(transformers' DeepseekV3ForCausalLM drops its weights), so the draft's oracle is the EPLB-off draft; the
target's HF check is ``test_real_models``'s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

# Imported before the test sets PROMETHEUS_MULTIPROC_DIR: this process's metrics stay single-process (a
# later test's would read the unset folder); the scrape reads the ranks' files from the folder it names.
import prometheus_client  # noqa: F401
import pytest
import torch

from ascend_eplb import world as rm
from ascend_eplb.testing import load_module, run_ranks, stop_fork_server

ranks = load_module(Path(__file__).with_name("ranks_real_models.py"))

PRELOAD = ("vllm", "vllm.model_executor.model_loader", "ascend_eplb.world.serving")
NUM_TOKENS = 12
REAL_TOKENS = (NUM_TOKENS, NUM_TOKENS - 3)
SPECULATIVE_TOKENS = 2
#: Steps at which the draft does not run (speculation off for the batch): the second window (steps 3
#: and 4, window 2 of interval 4) holds the target's load and none of the draft's.
DRAFT_IDLE = (3, 4)
#: A warm-up dummy run (target and draft) before step 5's forward.
DUMMY = (5,)
#: max |EPLB on - EPLB off| / max |EPLB off| allowed per logits tensor (float32).
TOLERANCE = 1e-5


def _scrape(folder: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name.startswith("ascend_eplb_"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _rel(on: torch.Tensor, off: torch.Tensor) -> float:
    return float((on - off).abs().max()) / float(off.abs().max())


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_the_mtp_draft_rearranges_beside_the_target_each_model_checked_alone(tmp_path, monkeypatch):
    folder = rm.write_checkpoint("deepseek-v3", tmp_path / "deepseek-v3", seed=0, mtp_layers=1)
    info = rm.checkpoint_info(folder)
    assert info.num_mtp_layers == 1
    redundant = info.redundant_experts_for(4, at_least=2)
    events_file, served_events = tmp_path / "events.jsonl", tmp_path / "served.jsonl"
    prom = tmp_path / "prometheus"
    prom.mkdir()
    spec = rm.RealModelSpec(
        arch="deepseek-v3", folder=str(folder), num_redundant_experts=redundant, steps=14, window_size=2,
        step_interval=4, data_parallel_size=2, real_tokens=REAL_TOKENS, speculative_tokens=SPECULATIVE_TOKENS,
        draft_idle_steps=DRAFT_IDLE, dummy_steps=DUMMY,
        environ={"ASCEND_EPLB_METRICS": "1"},
    )  # fmt: skip
    # prometheus_client picks its multiprocess mode when imported, in the fork server that preloads vLLM.
    stop_fork_server()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    start = time.monotonic()
    try:
        reports = run_ranks(
            ranks.mtp_world, world_size=4, tmp_path=tmp_path,
            args=(spec, str(events_file), str(served_events)), timeout_s=390, preload=PRELOAD,
        )  # fmt: skip
    finally:
        stop_fork_server()
    print(f"\nMTP world DP=2 x TP=2: {time.monotonic() - start:.1f} s, {reports[0]['seconds']}")
    target, draft = str(folder), f"{folder} (draft)"
    k, n = info.top_k, SPECULATIVE_TOKENS
    ran = [step not in DRAFT_IDLE for step in range(spec.steps)]

    for r in reports:
        d = r["draft"]
        # Upstream's names, in its registration order (the runner registers the draft first).
        assert d["model_names"] == [draft, target]
        assert (d["model_name"], d["num_moe_layers"]) == (draft, 1)
        assert r["moe_rows"] == "gathered-sp"
        assert d["ran"] == ran
        assert r["worker_alive"] is True
        # Every slot of both models holds its logical expert under the committed placement: after
        # loading (the draft's redundant slots too: vLLM 0.33.0's DeepSeekMTP loads none of them without
        # the integration's patch, and the verifier refused it at registration) and after every commit.
        assert r["initial_slot_mismatches"] == []
        assert d["initial_slot_mismatches"] == []
        assert all(m == [] for _, m in r["slot_checks"]), r["slot_checks"]
        assert all(m == [] for _, m in d["slot_checks"]), d["slot_checks"]
        assert len(r["slot_checks"]) == len({s for s, _ in r["commits"]})
        assert len(d["slot_checks"]) == len({s for s, _ in d["commits"]})
        # The draft's dummy (warm-up) run recorded nothing: no model's window changed, every load pass
        # is zero after upstream's dummy step.
        assert d["dummy"] == [(5, {draft: (True, True), target: (True, True)})]

    # Every rank commits the same placements, of both models, at the same steps.
    first = reports[0]
    for r in reports[1:]:
        assert r["commits"] == first["commits"]
        assert r["draft"]["commits"] == first["draft"]["commits"]
        assert all(torch.equal(a, b) for a, b in zip(first["maps"], r["maps"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(first["draft"]["maps"], r["draft"]["maps"], strict=True))
    # Several rearrangements of both models, in upstream's order (the draft's layer, then the target's).
    assert first["num_rearrangements"] == 4
    target_changes = sorted({s for s, _ in first["commits"]})
    draft_changes = [s for s, _ in first["draft"]["commits"]]
    assert len(target_changes) >= 6
    assert len(draft_changes) == 3
    # The window of steps 3-4 held no load of the draft: the draft kept its placement (decided per
    # model: no_load), while the target rearranged on its own load.
    assert all(r["draft"]["skipped_rearrangements"] == {"no_load": 1} for r in reports)
    assert not any(5 <= s <= 7 for s in draft_changes)
    assert any(5 <= s <= 7 for s in target_changes)

    # Outputs: each model's real rows equal its EPLB-off model's every step (the EPLB-off draft fed the
    # EPLB-off target's hidden states).
    worst = worst_draft = 0.0
    for r in reports:
        real = r["num_real_tokens"]
        for step in range(spec.steps):
            worst = max(worst, _rel(r["logits_on"][step][:real], r["logits_off"][step][:real]))
            on, off = r["draft"]["logits_on"][step], r["draft"]["logits_off"][step]
            assert len(on) == len(off) == (n if ran[step] else 0)
            for a, b in zip(on, off, strict=True):
                worst_draft = max(worst_draft, _rel(a[:real], b[:real]))
    print(f"EPLB on vs off: target {worst:.3g}, draft {worst_draft:.3g}")
    assert worst <= TOLERANCE
    assert worst_draft <= TOLERANCE

    # Load: over all ranks, each model's window load is its real tokens x K, counted once, padding
    # excluded: the target's per forward, the draft's per draft forward (N per step when it runs).
    assert all(r["recorded"] == first["recorded"] for r in reports)
    recorded_steps = [s for s, on in enumerate(first["recorded"]) if on]
    # Window 2 of interval 4 (from upstream's 3/4 start); the dummy step before step 5 is one of upstream's.
    assert recorded_steps == [0, 3, 4, 6, 7, 10, 11]
    for step, recorded in enumerate(first["recorded"]):
        total = sum(r["load"][step] for r in reports).sum(dim=1).tolist()
        draft_total = sum(r["draft"]["load"][step] for r in reports).sum(dim=1).tolist()
        assert total == [sum(REAL_TOKENS) * k if recorded else 0] * info.num_moe_layers, step
        assert draft_total == [n * sum(REAL_TOKENS) * k if recorded and ran[step] else 0], step

    # The events file (EP rank 0) and the scrape: every record and series by upstream's model name.
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    windows = {
        m: [e["rearrangement"] for e in events if e["event"] == "window" and e["model"] == m]
        for m in (draft, target)
    }
    assert windows == {draft: [1, 3, 4], target: [1, 2, 3, 4]}
    decisions = [
        (e["model"], e["rearrangement"], e["skipped"]) for e in events if e["event"] == "rearrangement"
    ]
    assert (draft, None, "no_load") in decisions
    done = {m: [i for mm, i, s in decisions if mm == m and s is None] for m in (draft, target)}
    assert done[target][:3] == [1, 2, 3]
    assert done[draft][:2] == [1, 3]
    commits = {m: sum(e["event"] == "commit" and e["model"] == m for e in events) for m in (draft, target)}
    assert commits[draft] >= 3
    assert commits[target] >= 7
    assert [e for e in events if e["event"] in ("worker_failure", "verifier_violation")] == []
    scrape = _scrape(prom)

    def value(name: str, model: str, **labels: str) -> float:
        return scrape[(name, tuple(sorted({"model": model, **labels}.items())))]

    for model in (draft, target):
        assert value("ascend_eplb_rearrangements_started_total", model) == len(windows[model])
        assert value("ascend_eplb_rearrangements_completed_total", model) == len(done[model])
        assert value("ascend_eplb_layers_committed_total", model) == commits[model]
        assert value("ascend_eplb_rearrangements_skipped_total", model, reason="no_load") == (model == draft)

    # Serving restarted from the events file starts each model on its own last committed placement
    # (installed at its registration through upstream's transaction, each slot then holding its expert,
    # the verifier checking the install); a file of the target's placement alone is refused at start-up.
    for r in reports:
        restart = r["restart"]
        assert set(restart["file"]) == {draft, target}
        assert restart["target"] == restart["file"][target] == first["maps"][-1].tolist()
        assert restart["draft"] == restart["file"][draft] == first["draft"]["maps"][-1].tolist()
        assert restart["slot_mismatches"] == ([], [])
        assert restart["verifier_commits_checked"] == info.num_moe_layers + 1
        assert r["refused"].startswith(
            "1 EPLB configuration rule(s) violated:\n  - [initial-placement] eplb_config.initial_placement="
        )
        assert r["refused"].endswith(
            f"/target-only-{r['rank']}.json: has no placement for model {draft} (the server balances "
            f"['{draft}', '{target}']); fix: export a placement of every model the server balances "
            "(ascend-eplb plan --export-expert-map on an events file that recorded them) or remove "
            "initial_placement"
        )
    started = [json.loads(line) for line in served_events.read_text().splitlines()]
    assert [(e["event"], e["model"]) for e in started] == [
        ("run_start", None),
        ("initial_placement", draft),
        ("initial_placement", target),
    ]
