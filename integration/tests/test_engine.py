"""EPLB through vLLM's own engine: ``vllm.LLM`` (scheduler, KV cache, sampler, Model Runner V2's CPU runner,
its dummy and profile runs, start-up and shutdown) at TP=2 x EP=2, async EPLB through the project's
plugin with the verifier and the watchdog on, against the EPLB-off engine and HF transformers.

One engine per model and setting, shared by the module's tests (``served``); the async worker's timing is
not the test's to choose: the engine generates in rounds until three rearrangements have completed, under a
deadline, and every assertion holds whichever step each commit landed on.
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

checks = load_module(Path(__file__).with_name("engine_checks.py"))
#: Rearrangements that must complete (every MoE layer committed) before the outputs are judged.
REARRANGEMENTS = 3
PROMPTS = [[(7 * i + 3 * j + 1) % 128 for j in range(6 + i)] for i in range(6)]
MAX_TOKENS = 12
ROUNDS = 4

MODELS = [
    pytest.param(("qwen3-moe", {}), marks=pytest.mark.xdist_group("engine-qwen3-moe"), id="qwen3-moe"),
    pytest.param(
        ("deepseek-v3", {"num_experts": 16, "top_k": 4}), marks=pytest.mark.xdist_group("engine-deepseek-v3"),
        id="deepseek-v3",
    ),
    pytest.param(("mixtral", {}), marks=pytest.mark.xdist_group("engine-mixtral"), id="mixtral"),
]  # fmt: skip

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]


@dataclass
class Served:
    folder: Path
    info: Any
    off: list[Completion]
    on: list[list[Completion]]
    observed: list[dict[str, Any]]
    states: list[dict[str, Any]]
    slots: list[dict[str, list[str]]]
    shutdown: Any


@pytest.fixture(scope="module", params=MODELS)
def served(request, tmp_path_factory) -> Served:
    arch, sizes = request.param
    root = tmp_path_factory.mktemp(arch)
    folder = write_checkpoint(arch, root / "model", seed=0, **sizes)
    info = checkpoint_info(folder)
    eplb = EplbSpec(window_size=4, step_interval=4, num_redundant_experts=info.redundant_experts_for(2, 2))
    with EngineWorld(EngineSpec(str(folder)), root / "off") as engine:
        off = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    env = {"ASCEND_EPLB_VERIFY": "1", "ASCEND_EPLB_ON_WORKER_FAILURE": "raise"}
    engine = EngineWorld(EngineSpec(str(folder), eplb=eplb), root / "on", env=env)
    with engine:
        engine.run_on_workers(probes.observe, str(folder))
        on, deadline = [], time.monotonic() + 300
        while (
            len(on) < ROUNDS
            or checks.completed(engine.run_on_workers(probes.observed), info.num_moe_layers) < REARRANGEMENTS
        ):
            assert time.monotonic() < deadline, "3 rearrangements did not complete within 300 s"
            on.append(engine.generate(PROMPTS, max_tokens=MAX_TOKENS))
        observed = engine.run_on_workers(probes.observed)
        states = engine.run_on_workers(probes.eplb_state)
        slots = engine.run_on_workers(probes.slot_mismatches, str(folder))
    return Served(folder, info, off, on, observed, states, slots, engine.shutdown)


def test_greedy_outputs_equal_the_eplb_off_engine_and_hf_through_three_rearrangements(served):
    assert checks.completed(served.observed, served.info.num_moe_layers) >= REARRANGEMENTS
    for on in served.on:
        for got, want in zip(on, served.off, strict=True):
            assert checks.judge(got, want) <= 1.0
    # HF transformers on the same checkpoint: the prompt and the generated tokens in one forward.
    for prompt, completion in zip(PROMPTS, served.on[-1], strict=True):
        greedy, reference = checks.hf_reference(served.folder, prompt, completion)
        assert greedy == list(completion.token_ids)
        assert checks.judge(completion, reference) <= 1.0


def test_every_commit_leaves_each_local_slot_holding_its_logical_expert(served):
    for rank in served.observed:
        assert rank["commits"], "no layer committed on this rank"
        assert [c["mismatches"] for c in rank["commits"]] == [[] for _ in rank["commits"]]
    for rank in served.slots:
        assert rank
        assert all(mismatches == [] for mismatches in rank.values())
    placements = [s["placements"] for s in served.states]
    assert all(p == placements[0] for p in placements)
    # The rearrangements moved the target away from upstream's initial placement (the E experts in order,
    # then the first P - E again).
    e = served.info.num_logical_experts
    committed = [
        c["placement"] for c in served.observed[0]["commits"] if c["model_name"] == str(served.folder)
    ]
    initial = list(range(e)) + list(range(len(committed[0]) - e))
    assert any(row != initial for row in committed)


def test_the_recorded_load_is_each_scheduled_real_token_times_k_once_and_dummy_runs_record_nothing(served):
    info = served.info
    assert (
        checks.check_recorded_load(served.observed, str(served.folder), info.top_k, info.num_moe_layers) > 0
    )


def test_the_async_worker_is_alive_and_the_engine_shuts_down_leaving_nothing(served):
    assert [s["async_worker_alive"] for s in served.states] == [True, True]
    assert {s["controller"] for s in served.states} == {"AscendEPLBController"}
    assert served.shutdown.status == 0
    assert served.shutdown.lingering == ()  # every vLLM process exited within 10 s of the engine's end
    assert served.shutdown.shared_memory == ()  # every segment vLLM's processes had mapped is gone
    # vLLM leaves its IPC sockets and file store in TMPDIR; the world's own TMPDIR held them and is gone.
    assert not (served.folder.parent / "on" / "tmp").exists()
