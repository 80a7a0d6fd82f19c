"""Issue 19's fault put back through vLLM's own engine: Qwen3-MoE at TP=2 x EP=2 (the ``replicated`` rows:
both TP ranks route the same tokens), async EPLB through the plugin, verifier on with
``ASCEND_EPLB_ON_WORKER_FAILURE=raise`` and the events file.

Each rank's replica offset is forced to its EP rank (``faults.rank_dependent_replicas``, vLLM Ascend's
``row + ep_rank + e``) before the first forward: the outputs go wrong, and at the step boundary of the first
commit the serving verifier names the broken replica agreement on both ranks, which ends the engine.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ascend_eplb.testing import load_module
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.engine import faults, probes
from ascend_eplb.world.engine.host import Completion, EngineError, EngineWorld
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

judging = load_module(Path(__file__).with_name("engine_judging.py"))
PROMPTS = judging.PROMPTS
MAX_TOKENS = 12
#: Upstream starts its rearrangement counter at 3/4 of the interval: the first rearrangement comes 24 steps
#: after registration, after the warm-up's dummy steps and the first round (12 steps), which is judged.
STEP_INTERVAL = 96

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.timeout(600),
]


@dataclass
class Faulted:
    folder: Path
    injected: list[dict[str, list[int]]]
    wrong: list[Completion]
    commits_before: list[list[Any]]
    error: str
    log: str
    events: list[dict[str, Any]]
    shutdown: Any
    num_moe_layers: int


@pytest.fixture(scope="module")
def faulted(tmp_path_factory) -> Faulted:
    root = tmp_path_factory.mktemp("replica-fault")
    folder = write_checkpoint("qwen3-moe", root / "model", seed=0)
    info = checkpoint_info(folder)
    eplb = EplbSpec(
        window_size=4, step_interval=STEP_INTERVAL, num_redundant_experts=info.redundant_experts_for(2, 2)
    )
    events = root / "events.jsonl"
    env = {
        "ASCEND_EPLB_VERIFY": "1",
        "ASCEND_EPLB_ON_WORKER_FAILURE": "raise",
        "ASCEND_EPLB_EVENTS": str(events),
    }
    engine = EngineWorld(EngineSpec(str(folder), eplb=eplb), root / "on", env=env)
    with engine:
        engine.run_on_workers(probes.observe, str(folder))
        injected = engine.run_on_workers(faults.rank_dependent_replicas)
        wrong = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
        commits_before = [rank["commits"] for rank in engine.run_on_workers(probes.observed)]
        error, deadline = None, time.monotonic() + 300
        while error is None:
            assert time.monotonic() < deadline, "the verifier did not stop the engine within 300 s"
            try:
                engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
            except EngineError as e:
                error = str(e)
    records = [json.loads(line) for line in events.read_text().splitlines()]
    log = engine.log_path.read_text(errors="replace")
    return Faulted(
        folder, injected, wrong, commits_before, error, log, records, engine.shutdown, info.num_moe_layers
    )


def test_rank_dependent_replicas_on_the_same_rows_serve_wrong_outputs(faulted):
    # Each rank's offset is its EP rank (rank 1 records nothing: its TP peer records the shared rows).
    model = str(faulted.folder)
    assert faulted.injected == [{model: [0, 1, 0, 0]}, {model: [1, 1, -1, 0]}]
    assert faulted.commits_before == [[], []]  # the judged round ran on the initial placement
    # A token's expert computed on both TP ranks or on neither: far beyond the tolerance of a right choice
    # (<= 1), though small here, where 2 of 8 experts have a second replica.
    worst = max(
        judging.logprob_error(completion, judging.hf_reference(faulted.folder, prompt, completion)[1])
        for prompt, completion in zip(PROMPTS, faulted.wrong, strict=True)
    )
    assert worst > 100, worst


def test_the_verifier_names_the_broken_agreement_at_the_first_commit_on_both_ranks(faulted):
    model = str(faulted.folder)
    # Each worker's log (vLLM prints the traceback of the exception its RPC raised), by EP rank.
    by_rank: dict[int, set[str]] = {}
    for ep_rank, message in re.findall(
        r"\(Worker_TP\d_EP(\d) pid=\d+\) ERROR .*?EplbVerificationError: (.*)", faulted.log
    ):
        by_rank.setdefault(int(ep_rank), set()).add(message)
    assert sorted(by_rank) == [0, 1]
    (first,) = by_rank[0]
    step = re.match(r"EPLB verifier: lookups check failed at step (\d+), rank 0: ", first)
    assert step is not None, first
    # The layers whose replica choices differ on the probe batch (the step's tokens: whichever step the
    # commit landed on), named alike by both ranks.
    layers = re.search(r"'s layer\(s\) (\[[\d, ]+\])$", first)
    assert layers is not None, first
    for rank, messages in by_rank.items():
        assert messages == {
            f"EPLB verifier: lookups check failed at step {step[1]}, rank {rank}: replica agreement: ranks 0 "
            "and 1 route the same rows (replicated row layout) but chose different replicas for the probe "
            f"batch of model {model}'s layer(s) {layers[1]}"
        }
    # What vLLM's engine core died of (a worker's error), and what the engine's client got.
    assert any(
        f"Worker failed with error '{m}'" in faulted.log for messages in by_rank.values() for m in messages
    )
    assert "EngineDeadError" in faulted.error
    # The events file (EP rank 0): the server's run_start, the first window, the commits of the first step
    # that committed (layer 0 on, as many as vLLM's async worker had ready: one, or on a loaded host every
    # layer, which completes the rearrangement) and, at that step's boundary, the violation naming layers
    # among them; nothing committed before that step.
    events = [r["event"] for r in faulted.events]
    commits = [r for r in faulted.events if r["event"] == "commit"]
    done = ["rearrangement"] if len(commits) == faulted.num_moe_layers else []
    assert events == ["run_start", "window", *["commit"] * len(commits), *done, "verifier_violation"]
    violation = faulted.events[-1]
    assert [(c["rearrangement"], c["layer"]) for c in commits] == [(1, i) for i in range(len(commits))]
    assert {c["step"] for c in commits} == {violation["step"]}
    assert set(json.loads(layers[1])) <= {c["layer"] for c in commits}
    assert (violation["check"], violation["rank"], violation["message"]) == ("lookups", 0, first)
    # One step number: the message's is the events file's (control's steps_run, profile run not counted).
    assert violation["step"] == int(step[1])


def test_the_engine_the_verifier_stopped_shuts_down_leaving_nothing(faulted):
    assert faulted.shutdown.status == 0
    assert faulted.shutdown.lingering == ()
    assert faulted.shutdown.shared_memory == ()
    assert not (faulted.folder.parent / "on" / "tmp").exists()
