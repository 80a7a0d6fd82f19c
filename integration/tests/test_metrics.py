"""The Prometheus metrics (``ASCEND_EPLB_METRICS=1``): switch rules, and a real scrape of a 2-rank
serving world in prometheus_client's multiprocess mode whose values equal the events file's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ascend_eplb.control import measures
from ascend_eplb.integration.guardrail_facts import metrics_requested
from ascend_eplb.integration.prometheus import METRICS
from ascend_eplb.testing import load_module, run_ranks, stop_fork_server
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.slots import initial_physical_to_logical

ranks = load_module(Path(__file__).with_name("ranks_real_models.py"))
PRELOAD = ("vllm", "vllm.model_executor.model_loader", "ascend_eplb.world.own_loop")


def test_the_switch_is_off_unless_asked_and_on_needs_a_multiprocess_folder(tmp_path):
    assert metrics_requested({}) is False
    assert metrics_requested({"ASCEND_EPLB_METRICS": "off"}) is False
    with pytest.raises(ValueError, match=r"ASCEND_EPLB_METRICS='ture': must be one of 1, true, yes, on, 0"):
        metrics_requested({"ASCEND_EPLB_METRICS": "ture"})
    with pytest.raises(
        ValueError, match=r"ASCEND_EPLB_METRICS=1: needs PROMETHEUS_MULTIPROC_DIR, the folder"
    ):
        metrics_requested({"ASCEND_EPLB_METRICS": "1"})
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=rf"PROMETHEUS_MULTIPROC_DIR={missing}: no such folder"):
        metrics_requested({"ASCEND_EPLB_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": str(missing)})
    # This test process imported prometheus_client without the folder set: its values would never
    # leave the process, and that is refused too.
    with pytest.raises(ValueError, match="imported prometheus_client before the variable was set"):
        metrics_requested({"ASCEND_EPLB_METRICS": "yes", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})


def _scrape(folder: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``MultiProcessCollector`` over ``folder``, rendered as vLLM's ``/metrics`` renders it and parsed
    back with prometheus_client's text parser: ``{(sample name, sorted labels): value}`` of ours."""
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


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_scrape_of_a_serving_world_equals_its_events_file(tmp_path, monkeypatch):
    folder = write_checkpoint("qwen3-moe", tmp_path / "qwen3-moe", seed=0)
    prom = tmp_path / "prometheus"
    prom.mkdir()
    events_file = tmp_path / "events.jsonl"
    # prometheus_client picks its multiprocess mode when imported, in the fork server that preloads
    # vLLM: that server must start with the folder in its environment, and later worlds without it.
    stop_fork_server()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    try:
        reports = run_ranks(
            ranks.metrics_world, world_size=2, tmp_path=tmp_path, args=(str(folder), 2, str(events_file), 24),
            timeout_s=200, preload=PRELOAD,
        )  # fmt: skip
    finally:
        stop_fork_server()
    scrape = _scrape(prom)
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    model = reports[0]["model"]

    def value(name: str, **labels: str) -> float:
        return scrape[(name, tuple(sorted({"model_name": model, **labels}.items())))]

    # Every series of METRICS, no other, exists for this model (ranks 0 and 1 where labelled by rank).
    want = set()
    for name, _, labels, _ in METRICS:
        if name.startswith("ascend_eplb_window_split_"):  # only with replica_split on
            continue
        values = {"model_name": [model], "rank": ["0", "1"], "kind": ["died", "stalled"],
                  "check": ["fingerprints", "lookups"],
                  "reason": ["balanced", "min_gain", "no_load"]}  # fmt: skip
        combos = [{}]
        for label in labels:
            combos = [c | {label: v} for c in combos for v in values[label]]
        want |= {(name, tuple(sorted(c.items()))) for c in combos}
    assert set(scrape) == want

    # The run went through every kind of record (rank 0's recorder wrote the file, the same records, after
    # the server's run_start, which came at registration, before the test subscribed).
    assert events[0]["event"] == "run_start"
    assert reports[0]["records"] == events[1:]
    kinds = [e["event"] for e in events]
    assert reports[0]["violation"] == reports[1]["violation"] == "lookups"
    assert reports[0]["step"] == reports[1]["step"]
    skipped = [e for e in events if e["event"] == "rearrangement" and e["skipped"] is not None]
    assert [(e["skipped"], e["rearrangement"]) for e in skipped] == [("no_load", None)]
    assert reports[0]["skipped"] == 1
    assert kinds.count("rearrangement") - len(skipped) >= 2
    assert kinds.count("worker_failure") == 0

    def count(kind: str) -> int:
        return sum(e["event"] == kind and e["model"] == model for e in events)

    assert value("ascend_eplb_rearrangements_started_total") == count("window")
    assert value("ascend_eplb_rearrangements_completed_total") == count("rearrangement") - 1
    assert value("ascend_eplb_rearrangements_skipped_total", reason="no_load") == 1
    assert value("ascend_eplb_rearrangements_skipped_total", reason="balanced") == 0
    assert value("ascend_eplb_rearrangements_skipped_total", reason="min_gain") == 0
    assert value("ascend_eplb_layers_committed_total") == count("commit")
    assert value("ascend_eplb_experts_moved_total") == sum(
        e["experts_moved"] for e in events if e["event"] == "rearrangement"
    )
    for kind in ("died", "stalled"):
        assert value("ascend_eplb_worker_failures_total", kind=kind) == 0
    violations = [e for e in events if e["event"] == "verifier_violation"]
    assert [(v["check"], v["layer"]) for v in violations] == [("lookups", 0)]
    assert value("ascend_eplb_verifier_violations_total", check="lookups") == 1
    assert value("ascend_eplb_verifier_violations_total", check="fingerprints") == 0

    windows = [e for e in events if e["event"] == "window"]
    # Planned and realised: the last rearrangement that moved, on its window and on the load estimate
    # it was planned on; the mean balancedness of the windows closed under its placement since.
    done = [e for e in events if e["event"] == "rearrangement" and e["skipped"] is None]
    assert all(e["load_estimate"] == "pooled" and e["estimate_balancedness_planned"] for e in done)
    assert value("ascend_eplb_rearrangement_balancedness_planned") == done[-1]["balancedness_planned"]
    assert (
        value("ascend_eplb_rearrangement_balancedness_planned_on_estimate")
        == (done[-1]["estimate_balancedness_planned"])
    )
    realised = [e for e in events if e["event"] == "rearrangement_realised"]
    last = realised[-1]
    assert value("ascend_eplb_rearrangement_balancedness_realised") == last["balancedness_realised_mean"]
    placed = next(i for i, e in enumerate(events) if e["event"] == "rearrangement"
                  and e["rearrangement"] == last["placed_by"])  # fmt: skip
    under = [e["balancedness"] for e in events[placed:] if e["event"] == "window"]
    assert last["windows_realised"] == len(under) >= 1
    assert last["balancedness_realised_mean"] == math.fsum(under) / len(under)
    assert last["balancedness_realised"] == under[-1]
    # The estimate took in the selections recorded since the last rearrangement: upstream records only
    # the window's steps (window_size 2 <= step_interval 4), so they are the window's load, exactly.
    assert all(w["new_selections"] == w["load"] for w in windows)
    assert value("ascend_eplb_window_balancedness") == windows[-1]["balancedness"]
    assert value("ascend_eplb_window_balancedness_eplb_off") == windows[-1]["balancedness_eplb_off"]
    # The window's figures, recomputed here: under the placement in force when it closed (the one the
    # rearrangement record of that window judged too) and under upstream's initial placement.
    done = {e["rearrangement"]: e for e in events if e["event"] == "rearrangement" and not e["skipped"]}
    for w in windows:
        if w["rearrangement"] in done:
            assert w["balancedness"] == done[w["rearrangement"]]["balancedness_before"]
    info = checkpoint_info(folder)
    initial = initial_physical_to_logical(info, 2)
    load = torch.tensor(windows[-1]["load"], dtype=torch.float64)
    assert windows[-1]["balancedness_eplb_off"] == measures.mean_balancedness(
        measures.rank_loads(load, initial, 2)
    )
    assert 0 < windows[-1]["balancedness_eplb_off"] < 1

    # Per rank: bytes received are the sum of the rank's commit records (rank 0's are the file's), at
    # most what its communicator received (which also counts the layer in flight when the run ended);
    # the last commit's publish-to-acknowledge time is its last record's.
    for rank, r in enumerate(reports):
        commits = [x for x in r["records"] if x["event"] == "commit"]
        received = value("ascend_eplb_bytes_received_total", rank=str(rank))
        assert received == sum(c["bytes_received"] for c in commits)
        assert 0 < received <= r["bytes_received"]
        last = commits[-1]["publish_to_acknowledge_s"]
        assert value("ascend_eplb_commit_publish_to_acknowledge_seconds", rank=str(rank)) == last
        assert 0 < last < 20


def test_each_rearrangement_record_counts_once_by_its_skip_reason_or_as_completed(tmp_path, monkeypatch):
    """The record -> series mapping of the gate's records (the world above has only a no_load skip)."""
    from prometheus_client import values as prometheus_values

    from ascend_eplb.integration.events.recorder import EventsRecord
    from ascend_eplb.integration.events.records import RearrangementRecord
    from ascend_eplb.integration.prometheus import PrometheusMetrics, _families

    if prometheus_values.ValueClass is not prometheus_values.MutexValue:
        # This process imported prometheus_client in multiprocess mode (the scrape above, in the same
        # pytest worker): its values need a folder, which the scrape's was and is no more.
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))

    metrics = PrometheusMetrics()
    metrics._rank = 0  # EP rank 0 writes the values the same on every rank (set at registration)
    series = _families()
    model = "unit/gate-records"

    def values() -> list[float]:
        skipped = series["ascend_eplb_rearrangements_skipped_total"]
        return [
            *(skipped.labels(model, reason)._value.get() for reason in ("balanced", "min_gain", "no_load")),
            series["ascend_eplb_rearrangements_completed_total"].labels(model)._value.get(),
            series["ascend_eplb_experts_moved_total"].labels(model)._value.get(),
        ]

    start = values()
    for skipped, moved in (("balanced", 0), ("min_gain", 0), (None, 7), ("min_gain", 0), ("no_load", 0)):
        record = RearrangementRecord(
            time=0.0, step=1, model=model, rearrangement=None if skipped == "no_load" else 1,
            policy="default", skipped=skipped, balancedness_before=None if skipped == "no_load" else 0.5,
            balancedness_planned={None: 0.75, "min_gain": 0.625}.get(skipped),
            experts_moved=moved, bytes_moved=moved * 64, layers_changed=int(moved > 0),
        )  # fmt: skip
        metrics._on_record(EventsRecord(record))
    assert [b - a for a, b in zip(start, values(), strict=True)] == [1, 2, 1, 1, 7]
    # Only the completed one sets the planned balancedness (a min_gain skip's plan did not serve).
    assert series["ascend_eplb_rearrangement_balancedness_planned"].labels(model)._value.get() == 0.75


def test_series_carry_the_served_name_as_model_name_and_a_draft_its_suffix(tmp_path, monkeypatch):
    """vLLM's own series label the served name (``--served-model-name``) ``model_name``; ours follow, the
    draft upstream registers beside the target (``"<model> (draft)"``) with the suffix kept."""
    from prometheus_client import values as prometheus_values

    from ascend_eplb.integration.events.recorder import EventsRecord
    from ascend_eplb.integration.events.records import CommitRecord
    from ascend_eplb.integration.prometheus import PrometheusMetrics, _families

    if prometheus_values.ValueClass is not prometheus_values.MutexValue:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # as in the test above
    metrics = PrometheusMetrics("unit-served")
    metrics._rank = 1
    received = _families()["ascend_eplb_bytes_received_total"]
    before = [received.labels(name, "1")._value.get() for name in ("unit-served", "unit-served (draft)")]
    for model, nbytes in (("/ckpt/unit", 64), ("/ckpt/unit (draft)", 8), ("/ckpt/unit", 1)):
        record = CommitRecord(
            time=0.0, step=1, model=model, rearrangement=1, layer=0, publish_to_acknowledge_s=None,
            bytes_received=nbytes,
        )  # fmt: skip
        metrics._on_record(EventsRecord(record))
    after = [received.labels(name, "1")._value.get() for name in ("unit-served", "unit-served (draft)")]
    assert [b - a for a, b in zip(before, after, strict=True)] == [65, 8]
    # The checkpoint path labels nothing.
    assert received.labels("/ckpt/unit", "1")._value.get() == 0
