"""Issue 35: EPLB under a compiled forward, on vLLM 0.33.0's real model classes.

vLLM's CPU platform compiles every model by default: ``VLLM_COMPILE`` becomes ``DYNAMO_TRACE_ONCE``
(one TorchDynamo trace at the first forward, every guard dropped) with the ``inductor`` backend, or
``eager`` under its CI switch. The serving worlds of ``ascend_eplb.world`` run exactly that
(``compilation_of``), with the plugin, ``Mrv2EplbWiring``, the verifier on and asynchronous
rearrangement, each step's EPLB-off model compiled the same way beside:

* DeepSeek-V3 (grouped top-k + bias, shared expert, dense first layer, MLA) at TP=2 x EP=2
  (``replicated`` rows), backend ``eager``, phase ``decode``: the traced graph is recorded
  (``GraphObserver``), so the test reads what the one trace read, from its inputs;
* Qwen3-MoE at DP=2 x TP=1, EP=2 (``gathered`` rows, vLLM's gather-before-route dispatch traced with the
  world's collectives as custom ops), each DP rank its own batch with its own real rows, backend
  ``inductor``, phase ``prefill``.

Frozen state would show as: load recorded on batches of the wrong phase or not at all (the record
flag), padding counted (the unpadded count), a wrong replica or double counting (the row layout), stale
weights after a commit (logits against the EPLB-off model and HF), a recompilation after a commit.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ascend_eplb import world as rm
from ascend_eplb.testing import load_module, run_ranks
from ascend_eplb.testing.hf import hf_logits

ranks = load_module(Path(__file__).with_name("ranks_real_models.py"))

PRELOAD = ("vllm", "vllm.model_executor.model_loader", "ascend_eplb.world.serving")
#: max |logits - reference| / max |reference| (float32).
TOLERANCE = 1e-5


def _check_logits(reports, folder, real_of):
    """Every step, every rank: the real rows' logits equal the EPLB-off model's and HF's; returns the
    worst relative errors."""
    hf: dict[tuple[int, ...], torch.Tensor] = {}
    worst_off = worst_hf = 0.0
    for r in reports:
        real = real_of(r)
        for step, ids in enumerate(r["prompts"]):
            key = tuple(ids[:real].tolist())
            if key not in hf:
                hf[key] = hf_logits(folder, ids[:real])
            on, off = r["logits_on"][step][:real], r["logits_off"][step][:real]
            worst_off = max(worst_off, float((on - off).abs().max() / off.abs().max()))
            worst_hf = max(worst_hf, float((on - hf[key]).abs().max() / hf[key].abs().max()))
    return worst_off, worst_hf


def _check_cycles(reports, info):
    for r in reports:
        assert r["initial_slot_mismatches"] == []
        assert r["worker_alive"] is True
        committed = [layer for _, layer in r["commits"]]
        assert all(committed.count(layer) >= 3 for layer in range(info.num_moe_layers)), r["commits"]
        assert all(mismatches == [] for _, mismatches in r["slot_checks"]), r["slot_checks"]
    assert any(not torch.equal(m, reports[0]["maps"][0]) for m in reports[0]["maps"])
    for r in reports[1:]:
        assert all(torch.equal(a, b) for a, b in zip(reports[0]["maps"], r["maps"], strict=True))


def _check_compiled(r, num_graphs=2):
    """One trace per model (EPLB on and off), none after (no recompilation after any commit), no graph
    break."""
    c = r["compiled"]
    assert c["counters_after_first_step"] == {"unique_graphs": num_graphs, "graph_breaks": {}}
    assert c["counters_end"] == {"unique_graphs": num_graphs, "graph_breaks": {}}


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_deepseek_v3_traced_once_stays_exact_and_reads_every_eplb_tensor_in_place(tmp_path):
    """DeepSeek-V3, TP=2 x EP=2, ``DYNAMO_TRACE_ONCE`` with the ``eager`` backend, phase ``decode``
    (even steps are declared prefill batches, odd steps decode batches), >= 3 completed rearrangements:

    * every step's logits equal the compiled EPLB-off model's and HF transformers';
    * the load: recorded exactly on the decode batches the window takes, T x K once (TP rank 0), none
      on prefill batches (a record flag frozen at the trace, whose batch declared no phase, records
      nothing ever);
    * one graph per model and no graph break: the whole MoE layer traced, the mapping op once per MoE
      layer in the graph, and no recompilation after any commit;
    * the graph-replay contract: every tensor the traced graph reads from the model, listed from its
      inputs (lookup tables, load views, record flag, unpadded count, row layout, expert weights, ...),
      keeps its storage after every step, commits and window rolls included;
    * a model traced before its registration is refused, naming the fix; bound anyway, its compiled
      forward never runs the binding (records nothing) though the binding itself records.
    """
    folder = rm.write_checkpoint("deepseek-v3", tmp_path / "deepseek-v3", seed=0)
    info = rm.checkpoint_info(folder)
    redundant = info.redundant_experts_for(2, at_least=2)
    spec = rm.RealModelSpec(
        arch="deepseek-v3", folder=str(folder), num_redundant_experts=redundant, steps=24, phase="decode",
        compilation=rm.compilation_of("eager"),
    )  # fmt: skip
    start = time.monotonic()
    reports = run_ranks(
        ranks.compiled_world, world_size=2, tmp_path=tmp_path, args=(spec, True), timeout_s=270,
        preload=PRELOAD,
    )  # fmt: skip
    print(f"\ncompiled deepseek-v3 eager TP=2: {time.monotonic() - start:.1f} s, {reports[0]['seconds']}")
    _check_cycles(reports, info)
    worst_off, worst_hf = _check_logits(reports, folder, lambda r: spec.num_tokens)
    print(f"EPLB on vs off {worst_off:.3g}, vs HF {worst_hf:.3g}")
    assert worst_off <= TOLERANCE
    assert worst_hf <= TOLERANCE

    recorded = reports[0]["recorded"]
    assert all(r["recorded"] == recorded for r in reports)
    assert sum(recorded) == 4  # the decode batches (odd steps) of the windows upstream records
    for step, on in enumerate(recorded):
        assert not (on and step % 2 == 0), step  # a declared prefill batch is outside the decode phase
        total = sum(r["load"][step] for r in reports).sum(dim=1).tolist()
        assert total == [spec.num_tokens * info.top_k if on else 0] * info.num_moe_layers, step
        assert int(reports[1]["load"][step].sum()) == 0  # the TP peer routes the same rows, records none

    for r in reports:
        _check_compiled(r)
        c = r["compiled"]
        assert c["graph_ops"]["ascend_eplb.map_to_physical_and_record"] == info.num_moe_layers
        sources = c["graph_state_inputs"]
        for suffix, count in (
            (".router.eplb_state.replica_lookup.table", info.num_moe_layers),
            (".router.eplb_state.expert_load_view", info.num_moe_layers),
            ("._modules['routed_experts']._parameters['w13_weight']", info.num_moe_layers),
            ("._modules['routed_experts']._parameters['w2_weight']", info.num_moe_layers),
            # shared by the layers of the model: one graph input each
            (".router.eplb_state.should_record_tensor", 1),
            (".router.eplb_state.num_unpadded_tokens_tensors[0]", 1),
            (".router.eplb_state.row_layout", 1),
        ):
            assert sum(s.endswith(suffix) for s in sources) == count, (suffix, sources)
        assert c["moved"] == []  # every state input kept data_ptr, shape and stride, every step
        assert r["moe_calls"] == (spec.steps + 1) * info.num_moe_layers  # logged by the traced kernel

        kind, message = r["refused"]
        assert kind == "RuntimeError"
        assert message.startswith(
            "adapt_layer_routers: DeepseekV3ForCausalLM ran a compiled forward already (model traced by "
            "vLLM's DYNAMO_TRACE_ONCE): the trace froze its routers, so a binding now would never map or "
            "record. Register the model with EPLB before its first forward"
        ), message
        assert r["late_recorded"] == (0, spec.num_tokens * info.top_k)


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_qwen3_moe_inductor_gathered_rows_stay_exact_through_rearrangements(tmp_path):
    """Qwen3-MoE at DP=2 x TP=1, EP=2 (``gathered``: vLLM's gather-before-route dispatch inside the
    trace), each DP rank its own prompts with 12 and 9 real rows of T = 12, ``DYNAMO_TRACE_ONCE`` with
    the ``inductor`` backend as vLLM's CPU platform configures it, phase ``prefill``, >= 3 completed
    rearrangements: every step's real rows equal the compiled EPLB-off model's and HF's; every window's
    load over the ranks is each DP rank's real tokens x K once, on the prefill batches only (padding
    never counted: the unpadded count per DP rank is a device scalar the graph reads); one graph per
    model, no graph break, no recompilation. The slow one (inductor compiles C++ for both models on
    both ranks)."""
    folder = rm.write_checkpoint("qwen3-moe", tmp_path / "qwen3-moe", seed=0)
    info = rm.checkpoint_info(folder)
    redundant = info.redundant_experts_for(2, at_least=2)
    real_tokens = (12, 9)
    spec = rm.RealModelSpec(
        arch="qwen3-moe", folder=str(folder), num_redundant_experts=redundant, steps=24, phase="prefill",
        data_parallel_size=2, real_tokens=real_tokens, compilation=rm.compilation_of("inductor"),
    )  # fmt: skip
    start = time.monotonic()
    reports = run_ranks(
        ranks.compiled_world, world_size=2, tmp_path=tmp_path, args=(spec, False), timeout_s=390,
        preload=PRELOAD,
    )  # fmt: skip
    print(f"\ncompiled qwen3-moe inductor DP=2: {time.monotonic() - start:.1f} s, {reports[0]['seconds']}")
    _check_cycles(reports, info)
    assert all(r["moe_rows"] == "gathered" for r in reports)
    assert all(r["kernel_rows"] == [2 * spec.num_tokens] * spec.steps for r in reports)
    assert not torch.equal(reports[0]["prompts"][0], reports[1]["prompts"][0])
    worst_off, worst_hf = _check_logits(reports, folder, lambda r: r["num_real_tokens"])
    print(f"EPLB on vs off {worst_off:.3g}, vs HF {worst_hf:.3g}")
    assert worst_off <= TOLERANCE
    assert worst_hf <= TOLERANCE

    recorded = reports[0]["recorded"]
    assert all(r["recorded"] == recorded for r in reports)
    assert sum(recorded) == 4  # the prefill batches (even steps) of the windows upstream records
    for step, on in enumerate(recorded):
        assert not (on and step % 2 == 1), step  # a declared decode batch is outside the prefill phase
        total = sum(r["load"][step] for r in reports).sum(dim=1).tolist()
        assert total == [sum(real_tokens) * info.top_k if on else 0] * info.num_moe_layers, step
        for r in reports:  # each DP rank records its own slice of the gathered rows: its real rows
            mine = r["num_real_tokens"] * info.top_k if on else 0
            assert r["load"][step].sum(dim=1).tolist() == [mine] * info.num_moe_layers, step
    for r in reports:
        _check_compiled(r)
        assert r["compiled"]["graph_state_inputs"] is None  # inductor's graphs are not observed


@pytest.mark.timeout(120)
def test_inductor_freezing_reads_weights_moved_in_place_stale_so_start_up_refuses_it():
    """The evidence of rule ``compiled-forward``'s refusal of inductor freezing: a frozen compiled
    linear keeps computing with the weight it was compiled with after the weight is written in place
    (what a rearrangement does to an expert's rows), while the same compilation without freezing
    follows it. About 10 s (two inductor compiles of one linear)."""
    import torch._inductor.config as inductor_config

    from ascend_eplb.integration.rules import check_settings
    from ascend_eplb.integration.settings import EplbSettings

    torch.manual_seed(0)
    x = torch.randn(8, 64)
    for freezing in (True, False):
        torch._dynamo.reset()
        layer = torch.nn.Linear(64, 64, bias=False).eval()
        with torch.no_grad(), inductor_config.patch(freezing=freezing):
            compiled = torch.compile(layer, backend="inductor")
            before = compiled(x).clone()
            layer.weight.copy_(torch.randn(64, 64))  # moved in place, as upstream's move_from_buffer does
            after = compiled(x)
            assert not torch.equal(layer(x), before)
            if freezing:
                assert torch.equal(after, before)  # stale: the compiled code never reads the weight again
            else:
                assert torch.allclose(after, layer(x), rtol=1e-5, atol=1e-6)
    settings = EplbSettings(
        enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=2, num_logical_experts=8,
        num_redundant_experts=2, compilation_mode="VLLM_COMPILE", inductor_freezing=True,
    )  # fmt: skip
    assert [v.rule for v in check_settings(settings)] == ["compiled-forward"]
