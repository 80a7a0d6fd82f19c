"""Issue 35: EPLB under a compiled forward. What vLLM's engine compiles with EPLB on (``DYNAMO_TRACE_ONCE``
with the ``eager`` and the ``inductor`` backends, the MTP draft too) is served through vLLM's own engine
in ``test_engine_modes.py``; here, the evidence of the one compiled mode start-up refuses.
"""

from __future__ import annotations

import pytest
import torch


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
