"""The gain gate on hand-made loads: each skip reason, the base policy's placement exactly when it passes,
the settings' rules, and the policy class upstream's ``EplbState`` runs.

The loads: one MoE layer, 4 logical experts, no redundancy, 2 ranks (slots 0-1 on rank 0, 2-3 on rank
1), committed placement ``[0, 1, 2, 3]``. Balancedness = mean rank load / max rank load.
"""

from __future__ import annotations

import threading

import pytest
import torch
from vllm.distributed.eplb.policy import DefaultEplbPolicy
from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy

from ascend_eplb.control.estimate import LoadEstimate
from ascend_eplb.control.gate import (
    POLICIES,
    DecisionChannel,
    GatedPolicy,
    ModelChannels,
    decide,
    gated_policy,
)
from ascend_eplb.control.policy import MigrationAwarePolicy
from ascend_eplb.control.policy_config import (
    LOAD_ESTIMATES,
    POLICY_NAMES,
    SKIP_REASONS,
    PlacementDecision,
    PolicySettings,
)

OLD = torch.tensor([[0, 1, 2, 3]])
#: rank loads 11 and 9: balancedness 10 / 11; upstream's default packs {6, 4} and {5, 5}: 1.0.
SLIGHT = torch.tensor([[6, 5, 4, 5]])
#: rank loads 20 and 2: balancedness 11 / 20 = 0.55; upstream's default reaches 1.0.
SKEWED = torch.tensor([[10, 10, 1, 1]])
#: rank loads 2 and 2: already even.
EVEN = torch.tensor([[1, 1, 1, 1]])


def _on_window(policy, skipped, before, planned, moved) -> PlacementDecision:
    """A decision planned on the window: its figures on the window are the same."""
    return PlacementDecision(policy, skipped, before, planned, moved, "window", before, planned)


def _decide(settings: PolicySettings, load: torch.Tensor) -> tuple[list[list[int]], PlacementDecision]:
    placement, decision = decide(settings, load, 4, 1, 1, 2, OLD)
    assert placement.dtype == torch.int64
    return placement.tolist(), decision


def test_a_window_balanced_enough_keeps_the_placement_without_running_the_policy(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the policy ran")

    monkeypatch.setattr(DefaultEplbPolicy, "rebalance_experts", never)
    placement, decision = _decide(PolicySettings(target_balancedness=0.9), SLIGHT)
    assert placement == [[0, 1, 2, 3]]
    assert decision == _on_window("default", "balanced", 10 / 11, None, 0)
    # Exactly at the target is balanced enough; 1.0 skips only an even window.
    assert _decide(PolicySettings(target_balancedness=10 / 11), SLIGHT)[1].skipped == "balanced"
    assert _decide(PolicySettings(target_balancedness=1.0), EVEN)[1] == _on_window(
        "default", "balanced", 1.0, None, 0
    )


def test_a_small_gain_keeps_the_placement_with_the_planned_figure():
    placement, decision = _decide(PolicySettings(min_balancedness_gain=0.1), SLIGHT)
    assert placement == [[0, 1, 2, 3]]
    assert decision == _on_window("default", "min_gain", 10 / 11, 1.0, 0)
    # Upstream's default re-packs an even window for no gain (two experts move): the gate keeps it.
    assert DefaultEplbPolicy.rebalance_experts(EVEN, 4, 1, 1, 2, OLD).tolist() == [[0, 2, 1, 3]]
    assert _decide(PolicySettings(min_balancedness_gain=0.01), EVEN) == (
        [[0, 1, 2, 3]],
        _on_window("default", "min_gain", 1.0, 1.0, 0),
    )


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_enough_gain_returns_the_base_policys_placement_exactly(policy):
    base = POLICIES[policy].rebalance_experts(SKEWED, 4, 1, 1, 2, OLD)
    settings = PolicySettings(policy=policy, min_balancedness_gain=0.4, target_balancedness=0.9)
    placement, decision = _decide(settings, SKEWED)
    assert placement == base.tolist()
    assert decision == _on_window(policy, None, 0.55, 1.0, 2)
    # The gain of the slight load (1/11 = 0.0909...) passes a gate just below it.
    placement, decision = _decide(PolicySettings(policy=policy, min_balancedness_gain=0.09), SLIGHT)
    assert placement == POLICIES[policy].rebalance_experts(SLIGHT, 4, 1, 1, 2, OLD).tolist()
    assert decision.skipped is None


def test_the_gate_off_always_runs_the_policy_and_a_window_without_load_is_no_load():
    placement, decision = _decide(PolicySettings(policy="migration_aware"), SLIGHT)
    assert placement == MigrationAwarePolicy.rebalance_experts(SLIGHT, 4, 1, 1, 2, OLD).tolist()
    assert decision == _on_window("migration_aware", None, 10 / 11, 1.0, 2)
    assert _decide(PolicySettings(target_balancedness=0.5), torch.zeros(1, 4, dtype=torch.int64)) == (
        [[0, 1, 2, 3]],
        _on_window("default", "no_load", None, None, 0),
    )
    # Without a placement in force the policy runs and nothing is judged.
    placement, decision = decide(PolicySettings(min_balancedness_gain=0.5), SLIGHT, 4, 1, 1, 2, None)
    assert placement.tolist() == DefaultEplbPolicy.rebalance_experts(SLIGHT, 4, 1, 1, 2, None).tolist()
    assert decision == _on_window("default", None, None, 1.0, None)


def test_the_decision_is_the_same_twice_and_the_kept_placement_is_a_copy():
    settings = PolicySettings(policy="migration_aware", min_balancedness_gain=0.1)
    first, second = decide(settings, SLIGHT, 4, 1, 1, 2, OLD), decide(settings, SLIGHT, 4, 1, 1, 2, OLD)
    assert first[1] == second[1]
    assert torch.equal(first[0], second[0])
    assert first[0].data_ptr() != OLD.data_ptr()


def test_the_gate_judges_the_expected_gain_on_the_estimate_and_keeps_both_figures():
    # The window is slightly uneven (10/11) but the estimate of the load to come is even: with a target
    # of 0.99 the committed placement is kept, judged on the estimate.
    settings = PolicySettings(policy="migration_aware", target_balancedness=0.99, load_estimate="pooled")
    placement, decision = decide(settings, SLIGHT, 4, 1, 1, 2, OLD, estimate=EVEN.double())
    assert placement.tolist() == OLD.tolist()
    assert decision == PlacementDecision("migration_aware", "balanced", 1.0, None, 0, "pooled", 10 / 11, None)
    # The window is even, the estimate skewed: the policy plans on the estimate (on the window the
    # default policy would not move) and the gain is expected on it, the window's figures beside.
    settings = PolicySettings(min_balancedness_gain=0.4, load_estimate="pooled")
    placement, decision = decide(settings, EVEN, 4, 1, 1, 2, OLD, estimate=SKEWED.double())
    planned = DefaultEplbPolicy.rebalance_experts(SKEWED.double(), 4, 1, 1, 2, OLD)
    assert placement.tolist() == planned.tolist() == [[0, 2, 1, 3]]
    assert decision == PlacementDecision("default", None, 0.55, 1.0, 2, "pooled", 1.0, 1.0)
    # A gain expected on the estimate below the gate's: kept, both figures kept.
    settings = PolicySettings(min_balancedness_gain=0.1, load_estimate="pooled")
    placement, decision = decide(settings, SKEWED, 4, 1, 1, 2, OLD, estimate=SLIGHT.double())
    assert placement.tolist() == OLD.tolist()
    assert decision == PlacementDecision("default", "min_gain", 10 / 11, 1.0, 0, "pooled", 0.55, 1.0)


def _channels(*models: tuple[str, tuple[int, int, int], bool]) -> ModelChannels:
    channels = ModelChannels()
    for name, shape, estimating in models:
        channels.add(name, DecisionChannel(name, shape, LoadEstimate() if estimating else None))
    return channels


def test_the_state_policy_is_an_upstream_policy_class_that_leaves_each_models_decision_on_its_channel():
    channels = _channels(("a", (1, 4, 4), False))
    policy = gated_policy(PolicySettings(policy="migration_aware", target_balancedness=0.9), channels)
    assert issubclass(policy, GatedPolicy)
    assert issubclass(policy, AbstractEplbPolicy)
    assert policy.__name__ == "GatedMigrationAwarePolicy"
    channels.expect(["a"], gating=True)
    assert policy.rebalance_experts(SLIGHT, 4, 1, 1, 2, OLD).tolist() == [[0, 1, 2, 3]]
    assert channels["a"].take() == _on_window("migration_aware", "balanced", 10 / 11, None, 0)
    assert channels["a"].take() is None
    # Called from another thread, as upstream's async worker does.
    channels.expect(["a"], gating=True)
    out: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: out.append(policy.rebalance_experts(SKEWED, 4, 1, 1, 2, OLD)))
    worker.start()
    worker.join()
    assert out[0].tolist() == MigrationAwarePolicy.rebalance_experts(SKEWED, 4, 1, 1, 2, OLD).tolist()
    assert channels["a"].take() == _on_window("migration_aware", None, 0.55, 1.0, 2)
    # Not gating (upstream's profile rearrangement): the selected policy alone, no decision.
    channels.expect(["a"], gating=False)
    assert policy.rebalance_experts(EVEN, 4, 1, 1, 2, OLD).tolist() == (
        MigrationAwarePolicy.rebalance_experts(EVEN, 4, 1, 1, 2, OLD).tolist()
    )
    assert channels["a"].take() is None
    with pytest.raises(ValueError, match=r"policy=default, gate off: nothing to wrap"):
        gated_policy(PolicySettings(), channels)


def test_decisions_are_tagged_per_model_and_a_stopped_cycle_never_hands_one_to_the_next():
    # Two models (the target, 1 layer x 4 experts; a draft of 2 layers x 4), called in registration order.
    draft_load = torch.cat([SKEWED, EVEN])
    draft_old = torch.cat([OLD, OLD])
    channels = _channels(("target", (1, 4, 4), False), ("draft", (2, 4, 4), False))
    policy = gated_policy(PolicySettings(policy="migration_aware"), channels)
    channels.expect(["target", "draft"], gating=True)
    policy.rebalance_experts(SLIGHT, 4, 1, 1, 2, OLD)
    policy.rebalance_experts(draft_load, 4, 1, 1, 2, draft_old)
    # The target's cycle stopped before its first commit: the draft commits and takes its own decision.
    draft = channels["draft"].take()
    assert draft is not None
    assert draft.balancedness_before == pytest.approx((0.55 + 1.0) / 2)
    # The next rearrangement drops what was not taken.
    channels.expect(["target", "draft"], gating=True)
    assert channels["target"].take() is None
    # A call of another model's shape than the next one's, or one upstream did not announce, is refused.
    with pytest.raises(
        RuntimeError, match=r"called with \(L, E, P\) = \(2, 4, 4\) where target's \(1, 4, 4\)"
    ):
        policy.rebalance_experts(draft_load, 4, 1, 1, 2, draft_old)
    policy.rebalance_experts(draft_load, 4, 1, 1, 2, draft_old)  # the draft's turn
    with pytest.raises(RuntimeError, match=r"a model no rearrangement expected"):
        policy.rebalance_experts(draft_load, 4, 1, 1, 2, draft_old)


def test_each_models_estimate_is_what_its_policy_call_plans_on():
    channels = _channels(("target", (1, 4, 4), True), ("draft", (1, 4, 4), True))
    channels["target"].estimate.update(EVEN)
    channels["draft"].estimate.update(SKEWED)
    policy = gated_policy(PolicySettings(load_estimate="pooled"), channels)
    channels.expect(["target", "draft"], gating=True)
    # Both calls hand over the same (slightly uneven) window; each plans on its own model's estimate.
    assert policy.rebalance_experts(SLIGHT, 4, 1, 1, 2, OLD).tolist() == (
        DefaultEplbPolicy.rebalance_experts(EVEN, 4, 1, 1, 2, OLD).tolist()
    )
    assert policy.rebalance_experts(SLIGHT, 4, 1, 1, 2, OLD).tolist() == [[0, 2, 1, 3]]
    assert channels["target"].take().balancedness_before == 1.0
    assert channels["draft"].take() == PlacementDecision(
        "default", None, 0.55, 1.0, 2, "pooled", 10 / 11, 1.0
    )


def test_settings_name_each_bad_value_and_rule_all_at_once():
    assert POLICY_NAMES == ("default", "migration_aware", "split_aware")
    assert SKIP_REASONS == ("balanced", "min_gain", "no_load")
    defaults = PolicySettings()
    assert LOAD_ESTIMATES == ("window", "pooled")
    assert (
        defaults.policy,
        defaults.min_balancedness_gain,
        defaults.target_balancedness,
        defaults.load_estimate,
    ) == ("default", 0, None, "window")
    assert defaults.is_upstream_default
    assert not defaults.gate_on
    assert not defaults.estimating
    assert not PolicySettings(policy="migration_aware").is_upstream_default
    assert not PolicySettings(load_estimate="pooled").is_upstream_default
    assert (
        PolicySettings(load_estimate="pooled").describe() == "policy=default, gate off, load_estimate=pooled"
    )
    assert PolicySettings(target_balancedness=1).gate_on
    assert PolicySettings(
        policy="migration_aware", min_balancedness_gain=0.02, target_balancedness=0.95
    ).describe() == ("policy=migration_aware, gate min_balancedness_gain=0.02 target_balancedness=0.95")
    with pytest.raises(ValueError, match="policy='greedy'") as info:
        PolicySettings(policy="greedy", min_balancedness_gain=1.0, target_balancedness=0, load_estimate="ema")
    assert str(info.value) == (
        "additional_config.eplb_config.policy='greedy' is not one of ['default', 'migration_aware', "
        "'split_aware']; "
        "additional_config.eplb_config.min_balancedness_gain=1.0 must be a number in [0, 1) (a gain of "
        "balancedness, which lies in (0, 1]; 0 turns the check off); "
        "additional_config.eplb_config.target_balancedness=0 must be a number in (0, 1] (a balancedness; "
        "leave it unset to turn the check off); "
        "additional_config.eplb_config.load_estimate='ema' is not one of ['window', 'pooled']"
    )
    for bad in (None, 1, "Window"):
        with pytest.raises(ValueError, match=rf"load_estimate={bad!r} is not one of \['window', 'pooled'\]"):
            PolicySettings(load_estimate=bad)
    for bad in (-0.1, float("nan"), float("inf"), True, "0.1", None):
        with pytest.raises(ValueError, match=rf"min_balancedness_gain={bad!r} must be a number in \[0, 1\)"):
            PolicySettings(min_balancedness_gain=bad)
    for bad in (1.5, -1, float("nan"), False, "0.9"):
        with pytest.raises(ValueError, match=rf"target_balancedness={bad!r} must be a number in \(0, 1\]"):
            PolicySettings(target_balancedness=bad)
    with pytest.raises(ValueError, match=r"min_balancedness_gain=1000\d+ must be a number in \[0, 1\)"):
        PolicySettings(min_balancedness_gain=10**400)  # an int too large for a float: refused, not raised


def test_policy_settings_of_a_value_is_the_one_check_the_controller_and_the_state_make():
    from ascend_eplb.control.policy_config import PolicySettings

    given = PolicySettings(policy="migration_aware", min_balancedness_gain=0.01)
    assert PolicySettings.of(given) is given
    assert PolicySettings.of(None) == PolicySettings()
    with pytest.raises(TypeError, match=r"^policy_settings=\{'policy': 'default'\} must be an "
                       r"ascend_eplb\.control\.policy_config\.PolicySettings or None$"):  # fmt: skip
        PolicySettings.of({"policy": "default"})
