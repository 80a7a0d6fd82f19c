"""The modes production runs, through vLLM's own engine (issue 42 item 3): compiled execution, the MTP draft
compiled, and data parallelism through vLLM's DP engine, each with async EPLB through the project's plugin,
the verifier and the watchdog on, every round's outputs against HF transformers (``engine_judging``,
shared with ``test_engine``, which holds the equality with the EPLB-off engine).

* ``compiled``: Qwen3-MoE at TP=2 x EP=2, ``DYNAMO_TRACE_ONCE`` with the ``eager`` backend
  (what vLLM's CPU platform compiles under its CI switch): the warm-up traces the whole model, router
  binding and EPLB's mapping included, with upstream's profile rearrangement before it;
* ``mtp-inductor``: DeepSeek-V3 (MLA) with its MTP draft (one speculative token) at TP=2 x
  EP=2, vLLM's default ``VLLM_COMPILE`` (``DYNAMO_TRACE_ONCE`` with ``inductor`` on CPU): target and draft
  compiled, both balanced;
* ``dp2``: Qwen3-MoE at DP=2 x TP=1 (EP=2) through vLLM's DP engine (a coordinator and one
  engine core per DP rank; a rank without requests runs dummy batches), eager.

One EPLB-on engine per configuration (a module-scoped fixture instance).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ascend_eplb.testing import load_module
from ascend_eplb.world.checkpoints import checkpoint_info, write_checkpoint
from ascend_eplb.world.engine.spec import COMPILATIONS, EngineSpec, EplbSpec

judging = load_module(Path(__file__).with_name("engine_judging.py"))

#: name -> (arch, checkpoint sizes, EngineSpec fields besides the model and EPLB). The names are short:
#: vLLM's IPC sockets live under the test's folder, and a socket path has at most 107 characters.
CONFIGS = {
    "compiled": ("qwen3-moe", {}, {"compilation": COMPILATIONS["eager"]}),
    "mtp-inductor": (
        "deepseek-v3",
        {"num_experts": 16, "top_k": 4, "mtp_layers": 1},
        {"compilation": COMPILATIONS["inductor"], "speculative_tokens": 1},
    ),
    "dp2": ("qwen3-moe", {}, {"tensor_parallel_size": 1, "data_parallel_size": 2}),
}

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1200)]


@pytest.fixture(
    scope="module",
    params=[pytest.param(name, id=name) for name in CONFIGS],
)
def served(request, tmp_path_factory):
    arch, sizes, fields = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    folder = write_checkpoint(arch, root / "model", seed=0, **sizes)
    spec = EngineSpec(str(folder), **fields)
    redundant = checkpoint_info(folder).redundant_experts_for(spec.num_ranks, 2)
    eplb = EplbSpec(window_size=4, step_interval=4, num_redundant_experts=redundant)
    # HF transformers is the outputs' reference here; the EPLB-off engine's equality is test_engine's.
    served = judging.serve(EngineSpec(str(folder), eplb=eplb, **fields), root, reference=False)
    print(f"\n{request.param}: start-up {served.started['on']:.1f} s")
    return served


def test_greedy_outputs_equal_the_eplb_off_engine_and_hf_through_three_rearrangements(served):
    judging.check_outputs(served)


def test_every_commit_leaves_each_local_slot_holding_its_logical_expert(served):
    judging.check_commits(served)


def test_the_recorded_load_is_each_dp_ranks_real_tokens_times_k_once(served):
    judging.check_load(served)


def test_the_forward_runs_as_configured_and_nothing_is_compiled_again_after_a_commit(served):
    judging.check_compiled(served)


def test_the_async_worker_is_alive_and_the_engine_shuts_down_leaving_nothing(served):
    judging.check_worker_and_shutdown(served)
