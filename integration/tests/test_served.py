"""EPLB through ``vllm serve`` driven by vLLM's own client: the API server, its engine core and Model Runner
V2's CPU workers at TP=2 x EP=2 (Qwen3-MoE), async EPLB through the project's plugin with the verifier and
the watchdog on, the events file and the Prometheus metrics switched on; ``vllm bench serve`` (random
prompts through the checkpoint's word-level tokenizer, ``--ignore-eos``, seed 0, 4 requests at a time)
sends the load, the OpenAI completions API the greedy requests judged against the offline engine
(``vllm.LLM``, EPLB off), and vLLM's ``/metrics`` is scraped over HTTP.

One server and one offline engine for the module (``served``); the async worker's timing is not the
test's to choose: the assertions hold whichever steps the commits landed on.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ascend_eplb.integration.prometheus import METRICS
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.engine.host import Completion, EngineWorld
from ascend_eplb.world.engine.server import ServedEngine
from ascend_eplb.world.engine.session import Shutdown
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

#: What the server is called (``--served-model-name``): the ``model_name`` of vLLM's series and ours.
SERVED_NAME = "tiny-qwen3-moe"
#: ``vllm bench serve``: prompts, tokens in and out of each, requests in flight at most.
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 8, 16, 16, 4
#: The OpenAI API's greedy requests, as token ids (the tiny checkpoint's vocabulary is 128).
PROMPTS = [[(5 * i + 3 * j + 2) % 128 for j in range(5 + i)] for i in range(4)]
MAX_TOKENS = 12

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]


@dataclass
class Served:
    offline: list[Completion]
    api: list[tuple[int, ...]]
    bench: dict[str, Any]
    bench_window: tuple[float, float]
    api_sent: float
    events: list[dict[str, Any]]
    metrics: str
    shutdown: Shutdown
    server_folder: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    root = tmp_path_factory.mktemp("served")
    folder = write_checkpoint("qwen3-moe", root / "model", seed=0)  # with its word-level tokenizer
    info = checkpoint_info(folder)
    with EngineWorld(EngineSpec(str(folder)), root / "offline") as engine:
        offline = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    eplb = EplbSpec(window_size=4, step_interval=4, num_redundant_experts=info.redundant_experts_for(2, 2))
    events = root / "events.jsonl"
    env = {
        "ASCEND_EPLB_VERIFY": "1",
        "ASCEND_EPLB_ON_WORKER_FAILURE": "raise",
        "ASCEND_EPLB_EVENTS": str(events),
    }
    server = ServedEngine(
        EngineSpec(str(folder), eplb=eplb), root / "serve", served_model_name=SERVED_NAME, env=env
    )
    with server:
        started = time.time()
        bench = server.bench(
            root / "bench.json", num_prompts=NUM_PROMPTS, input_len=INPUT_LEN, output_len=OUTPUT_LEN,
            max_concurrency=CONCURRENCY, seed=0,
        )  # fmt: skip
        window = (started, time.time())
        api_sent = time.time()
        api = server.complete(PROMPTS, max_tokens=MAX_TOKENS)
        metrics = server.get("/metrics")
    records = [json.loads(line) for line in events.read_text().splitlines()]
    completed, during = _completed(records), _completed(records, window)
    print(  # the figures of the run (pytest -s)
        f"offline engine ready in {engine.ready['seconds']:.0f} s; "
        f"vllm serve ready in {server.ready_s:.0f} s; "
        f"vllm bench serve: {bench['completed']} requests in {window[1] - window[0]:.0f} s wall "
        f"({bench['duration']:.1f} s benchmark); "
        f"{len(completed)} rearrangements completed, {len(during)} then"
    )
    return Served(offline, api, bench, window, api_sent, records, metrics, server.shutdown, server.folder)


def _completed(
    events: list[dict[str, Any]], window: tuple[float, float] | None = None
) -> list[dict[str, Any]]:
    """The completed rearrangements' records (within ``window``, wall-clock seconds, when given)."""
    start, end = window or (float("-inf"), float("inf"))
    return [
        e
        for e in events
        if e["event"] == "rearrangement" and e["skipped"] is None and start <= e["time"] <= end
    ]


def test_every_request_of_vllm_bench_serve_succeeds(served):
    bench = served.bench
    assert (bench["completed"], bench["failed"], bench["num_prompts"]) == (NUM_PROMPTS, 0, NUM_PROMPTS)
    assert bench["errors"] == [""] * NUM_PROMPTS
    assert bench["max_concurrency"] == CONCURRENCY
    # --ignore-eos: every request ran its whole length.
    assert bench["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert bench["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN


def test_rearrangements_complete_while_the_benchmark_streams_and_nothing_fails(served):
    during = _completed(served.events, served.bench_window)
    assert len(during) >= 2, f"{len(during)} rearrangements completed while vllm bench serve ran"
    assert sum(e["experts_moved"] for e in during) > 0
    # Each completed rearrangement committed every MoE layer (2) of the checkpoint.
    commits = {(e["rearrangement"], e["layer"]) for e in served.events if e["event"] == "commit"}
    assert all({(e["rearrangement"], 0), (e["rearrangement"], 1)} <= commits for e in during)
    kinds = {e["event"] for e in served.events}
    assert "verifier_violation" not in kinds
    assert "worker_failure" not in kinds


def test_greedy_outputs_over_the_openai_api_equal_the_offline_engine_after_rearrangements(served):
    moved = [e for e in _completed(served.events) if e["time"] < served.api_sent and e["experts_moved"] > 0]
    assert moved, "no rearrangement had moved an expert before the API's requests"
    assert served.api == [c.token_ids for c in served.offline]
    assert all(len(ids) == MAX_TOKENS for ids in served.api)


def _scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_vllms_metrics_scraped_over_http_carry_the_eplb_series_labelled_as_vllms_own(served):
    scrape = _scrape(served.metrics)
    # vLLM's own series of the engine (its info gauges have no model) and ours: one model_name.
    vllm_names = [dict(labels).get("model_name") for name, labels in scrape if name.startswith("vllm:")]
    assert len(vllm_names) > 10
    assert set(vllm_names) - {None} == {SERVED_NAME}
    ours = {(name, labels) for name, labels in scrape if name.startswith("ascend_eplb_")}
    # Every series of METRICS (no load estimate here: not the planned-on-estimate gauge; the batch split
    # off: not its two gauges), no other, each labelled with the served name as vLLM's own series are.
    want = set()
    for name, _, labels, _ in METRICS:
        if name.endswith("_on_estimate") or "_split_balancedness" in name:
            continue
        values = {
            "model_name": [SERVED_NAME], "rank": ["0", "1"], "kind": ["died", "stalled"],
            "check": ["fingerprints", "lookups"], "reason": ["balanced", "min_gain", "no_load"],
        }  # fmt: skip
        combos: list[dict[str, str]] = [{}]
        for label in labels:
            combos = [c | {label: v} for c in combos for v in values[label]]
        want |= {(name, tuple(sorted(c.items()))) for c in combos}
    assert ours == want

    def value(name: str, **labels: str) -> float:
        return scrape[(name, tuple(sorted({"model_name": SERVED_NAME, **labels}.items())))]

    events = served.events
    done = _completed(events)
    assert value("ascend_eplb_rearrangements_started_total") == sum(e["event"] == "window" for e in events)
    assert value("ascend_eplb_rearrangements_completed_total") == len(done) >= 2
    assert value("ascend_eplb_layers_committed_total") == sum(e["event"] == "commit" for e in events)
    assert value("ascend_eplb_experts_moved_total") == sum(e["experts_moved"] for e in done)
    # The events file is EP rank 0's: its commits' bytes are rank 0's series.
    assert value("ascend_eplb_bytes_received_total", rank="0") == sum(
        e["bytes_received"] for e in events if e["event"] == "commit"
    )
    last_window = [e for e in events if e["event"] == "window"][-1]
    assert value("ascend_eplb_window_balancedness") == last_window["balancedness"]
    for kind in ("died", "stalled"):
        assert value("ascend_eplb_worker_failures_total", kind=kind) == 0
    for check in ("fingerprints", "lookups"):
        assert value("ascend_eplb_verifier_violations_total", check=check) == 0


def test_the_server_shuts_down_leaving_no_process_shared_memory_or_scratch(served):
    assert served.shutdown.status == 0  # vLLM's graceful shutdown on SIGTERM
    assert served.shutdown.lingering == ()
    assert served.shutdown.shared_memory == ()
    assert not (served.server_folder / "tmp").exists()
    assert not (served.server_folder / "prometheus").exists()
