"""The CPU world's expert stand-in, its kernel log and its compilation settings, alone (no vLLM world)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ascend_eplb.dataplane import trace_once
from ascend_eplb.quant_views import reference_moe
from ascend_eplb.world.compilation import compilation_error, compilation_of, is_compiled
from ascend_eplb.world.kernel_logs import KernelLog
from ascend_eplb.world.stand_ins import grouped_expert_compute


def _per_slot_loop(x, w13, w2, topk_weights, local_ids):
    """The stand-in before issue 35 (the oracle): per local slot present, its tokens' GEMM, added with
    ``index_add_``; ``torch.unique(...).tolist()`` reads the routing on the host, so it cannot be traced."""
    out = torch.zeros_like(x)
    for slot in torch.unique(local_ids[local_ids >= 0]).tolist():
        tokens, k = (local_ids == slot).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], w13[slot]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[slot])
        out.index_add_(0, tokens, y * topk_weights[tokens, k].to(y.dtype).unsqueeze(-1))
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 12, 48, 200])
def test_grouped_expert_compute_equals_the_per_slot_loop_and_traces_whole(num_tokens):
    """Issue 35: the stand-in every compiled world runs. Against the earlier per-slot loop it is equal
    up to float32 rounding (MKL rounds a GEMM of 1-3 rows differently from the same rows of a larger
    one: measured, those cases differ in the last bits), and both are within float32 rounding of the
    float64 reference; one trace with every guard dropped computes it exactly as eagerly."""
    gen = torch.Generator().manual_seed(num_tokens)
    p, hidden, inter, top_k = 5, 64, 32, 4
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(p, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(p, hidden, inter, generator=gen) / inter**0.5
    local = torch.stack([torch.randperm(p + 3, generator=gen)[:top_k] for _ in range(num_tokens)]) - 3
    local = local.clamp(min=-1)  # distinct slots per token, some selections on other ranks (-1)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=1)
    got = grouped_expert_compute(x, w13, w2, weights, local)
    old = _per_slot_loop(x, w13, w2, weights, local)
    scale = float(old.abs().max())
    assert float((got - old).abs().max()) <= 4e-7 * scale
    reference = reference_moe(w13, w2, x, weights, local).float()
    assert float((got - reference).abs().max()) <= 4e-7 * scale
    assert bool((got[(local < 0).all(dim=1)] == 0).all())  # no local selection: exactly zero
    torch._dynamo.reset()  # one code object for every case: each traces its own
    compiled, observer = trace_once(grouped_expert_compute)
    assert torch.equal(compiled(x, w13, w2, weights, local), got)
    assert len(observer.graphs) == 1


def test_the_kernel_log_records_in_place_within_its_capacity():
    log = KernelLog(capacity=8, top_k=2)
    ids, rows, calls = log.ids, log.rows, log.calls
    log.record(torch.tensor([[3, 1], [0, 2], [5, 4]]))
    log.record(torch.tensor([[7, 6]]))
    assert torch.equal(log.last_ids(), torch.tensor([[7, 6]]))
    assert (int(log.rows), int(log.calls)) == (1, 2)
    assert (log.ids, log.rows, log.calls) == (ids, rows, calls)  # the very tensors, written in place
    torch._dynamo.reset()
    compiled, _ = trace_once(log.record, dynamic=True)
    compiled(torch.tensor([[1, 0], [2, 3]]))
    compiled(torch.tensor([[4, 5], [6, 7], [0, 1]]))
    assert torch.equal(log.last_ids(), torch.tensor([[4, 5], [6, 7], [0, 1]]))
    assert int(log.calls) == 4
    with pytest.raises(RuntimeError, match="KernelLog: a call's rows exceed its capacity of 8"):
        log.record(torch.zeros(9, 2, dtype=torch.int64))


def test_the_worlds_compilation_is_vllms_cpu_platforms_and_the_rest_is_refused():
    assert compilation_of(None) is None
    assert compilation_of("inductor") == {"mode": 3}
    assert compilation_of("eager") == {"mode": 2, "backend": "eager"}
    with pytest.raises(
        ValueError, match=r"compile backend 'aot_eager' must be one of \['eager', 'inductor'\]"
    ):
        compilation_of("aot_eager")
    for ok in (None, {}, {"mode": 0}, {"mode": "VLLM_COMPILE"}, {"mode": 2, "backend": "inductor"}):
        assert compilation_error(ok) is None, ok
    assert [is_compiled(c) for c in (None, {"mode": 0}, {"mode": "NONE"}, {}, {"mode": 2})] == [
        False,
        False,
        False,
        True,
        True,
    ]
    assert compilation_error({"mode": 1}) == (
        "compilation_config mode=1 must be 0 (NONE), 2 (DYNAMO_TRACE_ONCE) or 3 (VLLM_COMPILE, vLLM's "
        "default: DYNAMO_TRACE_ONCE on CPU); 1 (STOCK_TORCH_COMPILE) is compiled by vLLM's model runner, "
        "which the CPU world does not run"
    )
    assert compilation_error({"mode": 2, "backend": "aot_eager"}) == (
        "compilation_config backend='aot_eager' must be one of ['eager', 'inductor'] with mode 2"
    )
    assert compilation_error({"custom_ops": ["all"]}) == (
        "compilation_config keys ['custom_ops']: the CPU world takes mode, backend and "
        "inductor_compile_config (custom_ops stays ['none']: vLLM's CPU kernels are absent here)"
    )
    assert (
        compilation_error("eager")
        == "compilation_config='eager' must be a mapping (vLLM's --compilation-config)"
    )
