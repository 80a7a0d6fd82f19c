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
import torch

from ascend_eplb.testing.hf import hf_logits
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.engine import probes
from ascend_eplb.world.engine.host import Completion, EngineWorld
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

#: Today's tolerance of an output against its reference: 1e-6 + 1e-5 x max |reference|.
ABS_TOL, REL_TOL = 1e-6, 1e-5
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


def _completed(observed: list[dict[str, Any]], num_layers: int) -> int:
    """Rearrangements whose every MoE layer was acknowledged on every rank (the target model)."""
    done = None
    for rank in observed:
        layers: dict[int, set[int]] = {}
        for c in rank["commits"]:
            if not c["model_name"].endswith(" (draft)"):
                layers.setdefault(c["rearrangement"], set()).add(c["layer"])
        mine = {n for n, seen in layers.items() if len(seen) == num_layers}
        done = mine if done is None else done & mine
    return len(done or ())


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
            or _completed(engine.run_on_workers(probes.observed), info.num_moe_layers) < REARRANGEMENTS
        ):
            assert time.monotonic() < deadline, "3 rearrangements did not complete within 300 s"
            on.append(engine.generate(PROMPTS, max_tokens=MAX_TOKENS))
        observed = engine.run_on_workers(probes.observed)
        states = engine.run_on_workers(probes.eplb_state)
        slots = engine.run_on_workers(probes.slot_mismatches, str(folder))
    return Served(folder, info, off, on, observed, states, slots, engine.shutdown)


def _judge(completion: Completion, reference: Completion) -> float:
    """The worst error of ``completion``'s logprobs against ``reference``'s, in units of the tolerance
    (<= 1 passes), after checking the greedy tokens are equal."""
    assert completion.token_ids == reference.token_ids
    worst = 0.0
    for got, want in zip(completion.logprobs, reference.logprobs, strict=True):
        scale = max(abs(v) for v in want.values())
        for token, value in got.items():
            if token in want:
                worst = max(worst, abs(value - want[token]) / (ABS_TOL + REL_TOL * scale))
    return worst


def test_greedy_outputs_equal_the_eplb_off_engine_and_hf_through_three_rearrangements(served):
    assert _completed(served.observed, served.info.num_moe_layers) >= REARRANGEMENTS
    for on in served.on:
        for got, want in zip(on, served.off, strict=True):
            assert _judge(got, want) <= 1.0
    # HF transformers on the same checkpoint: the prompt and the generated tokens in one forward.
    for prompt, completion in zip(PROMPTS, served.on[-1], strict=True):
        ids = torch.tensor(prompt + list(completion.token_ids))
        logprobs = torch.log_softmax(hf_logits(served.folder, ids), dim=-1)[len(prompt) - 1 : -1]
        assert logprobs.argmax(dim=-1).tolist() == list(completion.token_ids)
        steps = zip(logprobs, completion.logprobs, strict=True)
        reference = Completion(
            completion.token_ids, tuple({t: float(row[t]) for t in step} for row, step in steps)
        )
        assert _judge(completion, reference) <= 1.0


def test_every_commit_leaves_each_local_slot_holding_its_logical_expert(served):
    for rank in served.observed:
        assert rank["commits"], "no layer committed on this rank"
        assert [c["mismatches"] for c in rank["commits"]] == [[] for _ in rank["commits"]]
    for rank in served.slots:
        assert rank
        assert all(mismatches == [] for mismatches in rank.values())
    placements = [s["placements"] for s in served.states]
    assert all(p == placements[0] for p in placements)


def test_the_recorded_load_is_each_scheduled_real_token_times_k_once_and_dummy_runs_record_nothing(served):
    info = served.info
    per_rank = [rank["steps"] for rank in served.observed]
    assert len({len(steps) for steps in per_rank}) == 1
    recorded_steps = 0
    for step in zip(*per_rank, strict=True):
        assert len({(s["is_dummy"], s["num_unpadded_tokens"], s["recorded"]) for s in step}) == 1
        first = step[0]
        total = sum(s["selections"][str(served.folder)] for s in step)
        if first["is_dummy"] or not first["recorded"]:
            assert total == 0
        else:
            recorded_steps += 1
            assert total == first["num_unpadded_tokens"] * info.top_k * info.num_moe_layers
    assert recorded_steps > 0


def test_the_async_worker_is_alive_and_the_engine_shuts_down_leaving_nothing(served):
    assert [s["async_worker_alive"] for s in served.states] == [True, True]
    assert {s["controller"] for s in served.states} == {"AscendEPLBController"}
    assert served.shutdown.status == 0
    assert served.shutdown.lingering == ()  # every vLLM process exited within 10 s of the engine's end
    assert served.shutdown.shared_memory == ()  # every segment vLLM's processes had mapped is gone
    # vLLM leaves its IPC sockets and file store in TMPDIR; the world's own TMPDIR held them and is gone.
    assert not (served.folder.parent / "on" / "tmp").exists()
