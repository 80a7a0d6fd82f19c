"""DeepSeek-V3 (MLA, CPU_MLA) through vLLM's own engine at TP=2 x EP=2, planned by the migration-aware
policy on the pooled load estimate (``additional_config.eplb_config``: ``policy: migration_aware``,
``load_estimate: pooled``), async EPLB through the plugin, verifier and watchdog on.

The engine generates in rounds until three rearrangements have completed (a deadline bounds the wait):
every decision was the migration-aware policy's on the estimate, every rank decided alike and holds the
same estimate, bit for bit, which took in every rearrangement's window; outputs equal HF transformers',
every commit leaves each local slot holding its logical expert.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ascend_eplb.testing import load_module
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.engine import probes
from ascend_eplb.world.engine.host import Completion, EngineWorld
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

judging = load_module(Path(__file__).with_name("engine_judging.py"))
#: The Ascend keys of ``additional_config.eplb_config`` (issue 37).
ESTIMATE = {"policy": "migration_aware", "load_estimate": "pooled"}
REARRANGEMENTS = judging.REARRANGEMENTS
PROMPTS = judging.PROMPTS
MAX_TOKENS = 12

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]


@dataclass
class Served:
    folder: Path
    info: Any
    on: list[Completion]
    observed: list[dict[str, Any]]
    states: list[dict[str, Any]]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    root = tmp_path_factory.mktemp("estimate")
    folder = write_checkpoint("deepseek-v3", root / "model", seed=0, num_experts=16, top_k=4)
    info = checkpoint_info(folder)
    eplb = EplbSpec(
        window_size=4,
        step_interval=4,
        num_redundant_experts=info.redundant_experts_for(2, 2),
        ascend=ESTIMATE,
    )
    env = {"ASCEND_EPLB_VERIFY": "1", "ASCEND_EPLB_ON_WORKER_FAILURE": "raise"}
    with EngineWorld(EngineSpec(str(folder), eplb=eplb), root / "on", env=env) as engine:
        engine.run_on_workers(probes.observe, str(folder))
        deadline = time.monotonic() + 300
        while judging.completed(engine.run_on_workers(probes.observed), info.num_moe_layers) < REARRANGEMENTS:
            assert time.monotonic() < deadline, "3 rearrangements did not complete within 300 s"
            on = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
        observed = engine.run_on_workers(probes.observed)
        states = engine.run_on_workers(probes.eplb_state)
    return Served(folder, info, on, observed, states)


def test_every_decision_is_the_migration_aware_policys_on_the_estimate_and_every_rank_holds_the_same(served):
    model = str(served.folder)
    (rearrangements,) = {s["num_rearrangements"] for s in served.states}
    assert rearrangements >= REARRANGEMENTS
    decisions = served.observed[0]["decisions"]
    assert all(rank["decisions"] == decisions for rank in served.observed)
    # One decision per rearrangement handed to the policy (a window without load: none then), published
    # before its first commit (the last one started may have committed nothing yet), each the
    # migration-aware policy's on the pooled estimate.
    committed = sorted({c["rearrangement"] for c in served.observed[0]["commits"]})
    assert committed == list(range(1, len(committed) + 1))
    assert committed[-1] in (rearrangements - 1, rearrangements)
    assert [n for _, n, _ in decisions if n is not None] == committed
    assert {name for name, _, _ in decisions} == {model}
    assert {d["policy"] for _, _, d in decisions} == {"migration_aware"}
    assert {d["load_estimate"] for _, _, d in decisions} == {"pooled"}
    # Every rank's estimate is the same, bit for bit (floats compared exactly), and took in every window.
    estimates = served.states[0]["estimates"]
    assert all(s["estimates"] == estimates for s in served.states)
    ((windows, load),) = estimates.values()
    assert windows == rearrangements
    assert len(load) == served.info.num_moe_layers
    assert all(len(row) == served.info.num_logical_experts and sum(row) > 0 for row in load)


def test_outputs_equal_hf_and_every_commit_leaves_each_slot_holding_its_expert(served):
    for prompt, completion in zip(PROMPTS, served.on, strict=True):
        greedy, reference = judging.hf_reference(served.folder, prompt, completion)
        assert greedy == list(completion.token_ids)
        assert judging.judge(completion, reference) <= 1.0
    for rank in served.observed:
        assert rank["commits"]
        assert [c["mismatches"] for c in rank["commits"]] == [[] for _ in rank["commits"]]
    assert [s["async_worker_alive"] for s in served.states] == [True, True]
    info = served.info
    assert (
        judging.check_recorded_load(served.observed, str(served.folder), info.top_k, info.num_moe_layers) > 0
    )
