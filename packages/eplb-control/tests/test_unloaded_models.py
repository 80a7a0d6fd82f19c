"""A model whose window holds no load keeps its placement while another registered model rearranges
(``state.keeping_unloaded_placement``), on hand-made windows.

One MoE layer of 4 logical experts and 2 redundant slots on 2 ranks (slots 0-2 on rank 0, 3-5 on rank
1); the committed placement is ``OLD``.
"""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.eplb.policy import DefaultEplbPolicy
from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy

from ascend_eplb.control.gate import DecisionChannel, ModelChannels, gated_policy
from ascend_eplb.control.policy_config import PolicySettings
from ascend_eplb.control.state import UnloadedModelsKeepPlacement, keeping_unloaded_placement

OLD = torch.tensor([[0, 1, 2, 3, 1, 0]])
ZERO = torch.zeros((1, 4), dtype=torch.int64)
SKEWED = torch.tensor([[10, 1, 10, 1]])  # rank loads 15.5 and 6.5 under OLD


def _call(policy: type[AbstractEplbPolicy], weight: torch.Tensor) -> torch.Tensor:
    return policy.rebalance_experts(weight, 6, 1, 1, 2, OLD.clone())


def test_a_window_without_load_keeps_the_committed_placement_that_upstreams_policy_would_move():
    # Upstream's default policy plans a placement from an all-zero window (every expert equally cold):
    # it differs from the committed one, so experts would move on no evidence (vLLM Ascend #12154's class).
    assert not torch.equal(_call(DefaultEplbPolicy, ZERO), OLD)
    keeping = keeping_unloaded_placement(DefaultEplbPolicy)
    assert issubclass(keeping, UnloadedModelsKeepPlacement)
    assert keeping.policy is DefaultEplbPolicy
    kept = _call(keeping, ZERO)
    assert kept.tolist() == OLD.tolist()
    old = OLD.clone()
    assert keeping.rebalance_experts(ZERO, 6, 1, 1, 2, old) is not old  # a copy, never upstream's tensor


def test_a_window_with_load_gets_the_selected_policys_placement_exactly():
    keeping = keeping_unloaded_placement(DefaultEplbPolicy)
    assert torch.equal(_call(keeping, SKEWED), _call(DefaultEplbPolicy, SKEWED))
    # Around the gated policy: the loaded window reaches the gate (one decision on its model's channel),
    # the window without load never does (no decision: the state decides it itself and does not expect
    # that model's call, so the gate's order-routing stays on the loaded models).
    channels = ModelChannels()
    channels.add("target", DecisionChannel("target", (1, 4, 6), None))
    channels.add("draft", DecisionChannel("draft", (1, 4, 6), None))
    gated = keeping_unloaded_placement(gated_policy(PolicySettings(min_balancedness_gain=0.01), channels))
    channels.expect(["target"], gating=True)  # the draft recorded no load in this window
    planned = _call(DefaultEplbPolicy, SKEWED)
    assert not torch.equal(planned, OLD)
    assert torch.equal(_call(gated, SKEWED), planned)  # the target: the policy's placement, exactly
    assert _call(gated, ZERO).tolist() == OLD.tolist()  # the draft: kept, no call reached the gate
    decision = channels["target"].take()
    assert decision is not None
    assert decision.skipped is None
    assert channels["draft"].take() is None
    with pytest.raises(RuntimeError, match="no rearrangement expected"):
        _call(gated, SKEWED)  # a loaded call beyond the expected models is upstream's order changing
