"""EPLB through vLLM's own engine: ``vllm.LLM`` (scheduler, KV cache, sampler, Model Runner V2's CPU runner,
its dummy and profile runs, start-up and shutdown) at TP=2 x EP=2, async EPLB through the project's
plugin with the verifier and the watchdog on, against the EPLB-off engine and HF transformers.

One engine per model and setting, shared by the module's tests (``served``); the judging is
``engine_judging``'s, shared with the other engine test modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ascend_eplb.testing import load_module
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

judging = load_module(Path(__file__).with_name("engine_judging.py"))

MODELS = [
    pytest.param(("qwen3-moe", {}), id="qwen3-moe"),
    pytest.param(("deepseek-v3", {"num_experts": 16, "top_k": 4}), id="deepseek-v3"),
    pytest.param(("mixtral", {}), id="mixtral"),
]

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", params=MODELS)
def served(request, tmp_path_factory):
    arch, sizes = request.param
    root = tmp_path_factory.mktemp(arch)
    folder = write_checkpoint(arch, root / "model", seed=0, **sizes)
    redundant = checkpoint_info(folder).redundant_experts_for(2, 2)
    eplb = EplbSpec(window_size=4, step_interval=4, num_redundant_experts=redundant)
    return judging.serve(EngineSpec(str(folder), eplb=eplb), root)


def test_greedy_outputs_equal_the_eplb_off_engine_and_hf_through_three_rearrangements(served):
    judging.check_outputs(served)


def test_every_commit_leaves_each_local_slot_holding_its_logical_expert(served):
    judging.check_commits(served)
    # The rearrangements moved the target away from upstream's initial placement (the E experts in order,
    # then the first P - E again).
    e = served.info.num_logical_experts
    committed = [
        c["placement"] for c in served.observed[0]["commits"] if c["model_name"] == str(served.folder)
    ]
    initial = list(range(e)) + list(range(len(committed[0]) - e))
    assert any(row != initial for row in committed)


def test_the_recorded_load_is_each_scheduled_real_token_times_k_once_and_dummy_runs_record_nothing(served):
    judging.check_load(served)


def test_the_async_worker_is_alive_and_the_engine_shuts_down_leaving_nothing(served):
    judging.check_worker_and_shutdown(served)
