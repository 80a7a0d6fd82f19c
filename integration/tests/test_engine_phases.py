"""The load-collection phase through vLLM's own engine: Qwen3-MoE at TP=2 x EP=2, async EPLB through the
project's plugin, ``additional_config.eplb_config.load_collection_phase`` ``prefill`` and ``decode``.

Upstream's Model Runner V2 never declares a batch's phase; the plugin's patch of
``GPUModelRunner.prepare_inputs`` declares upstream's ``BatchReqState.has_prefill``. One engine per phase
(``served``), four requests at a time and six requests ending at different steps, so that the engine runs
prefill-only, mixed and decode-only batches: exactly the steps of the phase record (a mixed batch is a
prefill), each recording real tokens x K x L over the ranks, every other step nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ascend_eplb.testing import load_module
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.engine import probes
from ascend_eplb.world.engine.host import EngineWorld
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

judging = load_module(Path(__file__).with_name("engine_judging.py"))
PROMPTS = judging.PROMPTS
#: Requests end at different steps: a waiting request is admitted while the others decode (mixed batches).
MAX_TOKENS = [3, 5, 7, 9, 11, 13]
#: Four running requests at most, so that two of the six wait.
MAX_NUM_SEQS = 4

PHASES = [
    pytest.param("prefill", id="prefill"),
    pytest.param("decode", id="decode"),
]

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]


@dataclass
class Served:
    phase: str
    folder: Path
    info: Any
    observed: list[dict[str, Any]]
    log: str


@pytest.fixture(scope="module", params=PHASES)
def served(request, tmp_path_factory) -> Served:
    phase = request.param
    root = tmp_path_factory.mktemp(f"phase-{phase}")
    folder = write_checkpoint("qwen3-moe", root / "model", seed=0)
    info = checkpoint_info(folder)
    # Window = interval: upstream records every step (its _should_record_current_step), so the phase alone
    # decides which steps record.
    eplb = EplbSpec(
        window_size=4, step_interval=4, num_redundant_experts=info.redundant_experts_for(2, 2),
        ascend={"load_collection_phase": phase},
    )  # fmt: skip
    spec = EngineSpec(str(folder), eplb=eplb, max_num_seqs=MAX_NUM_SEQS)
    env = {"ASCEND_EPLB_VERIFY": "1", "ASCEND_EPLB_ON_WORKER_FAILURE": "raise"}
    with EngineWorld(spec, root / "on", env=env) as engine:
        engine.run_on_workers(probes.observe, str(folder))
        engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
        observed = engine.run_on_workers(probes.observed)
    assert engine.shutdown is not None
    assert engine.shutdown.status == 0
    return Served(phase, folder, info, observed, engine.log_path.read_text(errors="replace"))


def _kind(step: dict[str, Any]) -> str:
    """The batch's kind by the scheduler's own account: a request scheduled for the first time brings its
    prompt (prefill); with running requests beside it the batch is mixed."""
    new = step["new_requests"]
    if not new:
        return "decode"
    return "prefill" if len(new) == len(step["scheduled_tokens"]) else "mixed"


def test_exactly_the_steps_of_the_phase_record_each_real_token_times_k_once(served):
    info = served.info
    steps = judging.recorded_steps(served.observed, str(served.folder))
    real = [(s, total) for s, total in steps if not s["is_dummy"]]
    # Every prompt was scheduled whole in its first step (no chunked prefill): a request's later steps are
    # decodes, so a batch holds prefill work exactly when it holds a new request.
    prompt_tokens = sorted(s["scheduled_tokens"][r] for s, _ in real for r in s["new_requests"])
    assert prompt_tokens == sorted(len(p) for p in PROMPTS)
    kinds = [_kind(s) for s, _ in real]
    assert set(kinds) == {"prefill", "mixed", "decode"}, kinds
    for (step, total), kind in zip(real, kinds, strict=True):
        assert step["num_unpadded_tokens"] == sum(step["scheduled_tokens"].values())
        assert step["has_prefill"] is (kind != "decode")  # upstream's flag, declared by the patch
        in_phase = (kind != "decode") if served.phase == "prefill" else (kind == "decode")
        assert step["recorded"] is in_phase, (kind, step)
        assert total == (step["num_unpadded_tokens"] * info.top_k * info.num_moe_layers if in_phase else 0)
    # A dummy run (none after start-up here) prepares no inputs: its phase is undeclared, it records nothing.
    assert all(s["has_prefill"] is None and total == 0 for s, total in steps if s["is_dummy"])


def test_every_real_batch_declared_its_phase_so_the_controller_never_warned(served):
    # The controller warns at the first real step whose batch's phase was not declared; dummy runs, which
    # declare none, do not make it warn.
    assert "phase was not declared" not in served.log
