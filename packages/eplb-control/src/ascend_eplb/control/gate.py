"""The gain gate: the selected placement policy, wrapped so that a rearrangement buying too little
moves nothing (README "Gain gate").

:func:`gated_policy` builds the :class:`AbstractEplbPolicy` subclass an
:class:`~ascend_eplb.control.state.AscendEplbState` puts in ``EplbState.policy``; its
``rebalance_experts`` calls :func:`decide` on the window's global load ``(L, E)`` (or the model's
estimate): ``balanced`` (committed placement at or above ``target_balancedness``, the policy does not
run), ``min_gain`` (the policy gains less than ``min_balancedness_gain``), else the policy's placement.
A pure function in float64 in a fixed order, so every rank decides alike with no collective. Its figures
(before, planned) split each expert's load of the window evenly over its replicas, whatever
``replica_split`` serves (what the batch split executes per batch: ``plan --batch-split``). Each model
has a :class:`DecisionChannel`; :class:`ModelChannels` routes upstream's calls, which name no model, by
call order, checked on the call's shapes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from ascend_eplb.control.estimate import LoadEstimate
from ascend_eplb.control.policy import MigrationAwarePolicy, SplitAwarePolicy, balancedness, moved_experts
from ascend_eplb.control.policy_config import POLICY_NAMES, PlacementDecision, PolicySettings

__all__ = ["POLICIES", "DecisionChannel", "GatedPolicy", "ModelChannels", "decide", "gated_policy"]

#: Policy name -> the upstream policy class it selects (keys checked equal to ``POLICY_NAMES`` here).
POLICIES: dict[str, type[AbstractEplbPolicy]] = {
    "default": DefaultEplbPolicy,
    "migration_aware": MigrationAwarePolicy,
    "split_aware": SplitAwarePolicy,
}
assert tuple(POLICIES) == POLICY_NAMES, (tuple(POLICIES), POLICY_NAMES)


def decide(
    settings: PolicySettings,
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_global_expert_indices: torch.Tensor | None,
    *,
    estimate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PlacementDecision]:
    """The placement to move to and why: the gate of the module docstring around ``settings.policy``.

    Args:
        weight: ``(L, E)`` global load of the closed window (int or float, CPU).
        num_replicas, num_groups, num_nodes, num_ranks: upstream's policy arguments (P, groups, nodes, N).
        old_global_expert_indices: int64 ``(L, P)``, the committed placement; None: no gate.
        estimate: float ``(L, E)``, the load to plan on and judge by instead of the window (None: the window).

    Returns:
        ``(placement, decision)``: int64 ``(L, P)`` on CPU, a copy of the committed placement when
        skipped (``decision.skipped`` names why), else the policy's result itself.

    Raises:
        ValueError: from the policy or the measures, naming the value and the rule.
    """
    base = POLICIES[settings.policy]
    old = old_global_expert_indices
    load = weight if estimate is None else estimate

    def mean(on: torch.Tensor, placement: torch.Tensor) -> float:
        return float(balancedness(on, placement, num_ranks).mean())

    def decision(skipped, before, planned, moved, new=None) -> PlacementDecision:
        on_window = (
            None if before is None else mean(weight, old),
            None if planned is None else mean(weight, new),
        )
        return PlacementDecision(
            settings.policy, skipped, before, planned, moved, settings.load_estimate, *on_window
        )

    if old is None:
        new = base.rebalance_experts(load, num_replicas, num_groups, num_nodes, num_ranks, None)
        return new, decision(None, None, mean(load, new), None, new)
    if not bool((torch.as_tensor(weight) > 0).any()):
        # A model without load while another model of the state has some (AscendEplbState.rearrange
        # skips a window only when no model of any rank recorded load), or a caller's all-zero window.
        return old.clone(), decision("no_load", None, None, 0)
    before = mean(load, old)
    target = settings.target_balancedness
    if target is not None and before >= target:
        return old.clone(), decision("balanced", before, None, 0)
    new = base.rebalance_experts(load, num_replicas, num_groups, num_nodes, num_ranks, old)
    planned = mean(load, new)
    if settings.min_balancedness_gain > 0 and planned - before < settings.min_balancedness_gain:
        return old.clone(), decision("min_gain", before, planned, 0, new)
    return new, decision(None, before, planned, int(moved_experts(old, new, num_ranks).sum()), new)


class DecisionChannel:
    """One registered model's hand-off between the runner thread and the thread that runs the policy.

    Attributes:
        model_name: the model's name as upstream names it.
        shape: ``(L, E, P)`` of its load and placement (a policy call of another shape is not its).
        estimate: the model's :class:`~ascend_eplb.control.estimate.LoadEstimate` (None: the policy
            plans on the window), fed by the runner thread before upstream's rearrangement.
    """

    def __init__(self, model_name: str, shape: tuple[int, int, int], estimate: LoadEstimate | None) -> None:
        self.model_name = model_name
        self.shape = shape
        self.estimate = estimate
        self._lock = threading.Lock()
        self._decision: PlacementDecision | None = None

    def put(self, decision: PlacementDecision) -> None:
        """Leave ``decision`` (the policy's thread; it replaces one not taken)."""
        with self._lock:
            self._decision = decision

    def take(self) -> PlacementDecision | None:
        """The decision left and not taken yet, or None (the runner thread)."""
        with self._lock:
            decision, self._decision = self._decision, None
            return decision


class ModelChannels:
    """The :class:`DecisionChannel` of each model of one state, and the order upstream calls the policy.

    Upstream (vLLM 0.33.0) calls ``EplbState.policy.rebalance_experts`` once per registered model and
    rearrangement, in ``model_states`` order (the async worker's ``transfer_run_periodically``, or
    ``rearrange`` in synchronous mode). :meth:`expect` (the runner thread, before upstream's
    ``rearrange``, while no policy call is in flight) lists those models; each gated call takes the next.

    Attributes:
        gating: True for a regular rearrangement; False for the calls the gate must not judge (upstream's
            profile rearrangement, which reserves the communication buffers with a worst-case move;
            elastic-EP ``rank_mapping`` and ``use_last_expert_load`` ones): the selected policy alone, on
            the window.
    """

    def __init__(self) -> None:
        self._channels: dict[str, DecisionChannel] = {}
        self._lock = threading.Lock()
        self._expected: list[DecisionChannel] = []
        self.gating = True

    def add(self, key: str, channel: DecisionChannel) -> None:
        """Register ``channel`` for model ``key`` (upstream's ``model_states`` key)."""
        self._channels[key] = channel

    def __getitem__(self, key: str) -> DecisionChannel:
        return self._channels[key]

    def __iter__(self) -> Iterator[DecisionChannel]:
        return iter(self._channels.values())

    def expect(self, keys: Iterable[str], *, gating: bool) -> None:
        """The models whose policy calls come next, in order; every channel's decision not taken is
        dropped (the runner thread)."""
        with self._lock:
            for channel in self._channels.values():
                channel.take()
            self._expected = [self._channels[key] for key in keys] if gating else []
            self.gating = gating

    def next_call(self, weight: torch.Tensor, num_replicas: int) -> DecisionChannel:
        """The channel of the policy call with these arguments (the policy's thread).

        Raises:
            RuntimeError: no model was expected, or the call's ``(L, E, P)`` is not the next model's:
                upstream's call order changed (the message names both).
        """
        with self._lock:
            if not self._expected:
                raise RuntimeError(
                    "EplbState.policy was called for a model no rearrangement expected (upstream calls "
                    "the policy once per registered model and rearrangement: did its call order change?)"
                )
            channel = self._expected.pop(0)
        shape = (*tuple(weight.shape), num_replicas)
        if shape != channel.shape:
            raise RuntimeError(
                f"EplbState.policy was called with (L, E, P) = {shape} where {channel.model_name}'s "
                f"{channel.shape} was next (upstream calls the policy once per registered model and "
                "rearrangement, in registration order: did its call order change?)"
            )
        return channel


class GatedPolicy(AbstractEplbPolicy):
    """The base of the classes :func:`gated_policy` builds (one per state); not used itself."""

    settings: ClassVar[PolicySettings]
    channels: ClassVar[ModelChannels]

    @classmethod
    def rebalance_experts(
        cls,
        weight: torch.Tensor,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_global_expert_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Upstream's policy call: :func:`decide` on the calling model's estimate (its decision left on
        its channel), or the selected policy alone on the window when the channels are not gating."""
        if not cls.channels.gating:
            return POLICIES[cls.settings.policy].rebalance_experts(
                weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices
            )
        channel = cls.channels.next_call(weight, num_replicas)
        estimate = None if channel.estimate is None else channel.estimate.load
        placement, decision = decide(
            cls.settings,
            weight,
            num_replicas,
            num_groups,
            num_nodes,
            num_ranks,
            old_global_expert_indices,
            estimate=estimate,
        )
        channel.put(decision)
        return placement


def gated_policy(settings: PolicySettings, channels: ModelChannels) -> type[GatedPolicy]:
    """A :class:`GatedPolicy` subclass bound to ``settings`` and ``channels``: what ``EplbState.policy``
    holds (upstream types it ``type[AbstractEplbPolicy]`` and calls its classmethod).

    Raises:
        ValueError: ``settings`` selects upstream's default policy with the gate off, on the window
            (nothing to wrap: upstream's ``DefaultEplbPolicy`` itself stays the policy).
    """
    if settings.is_upstream_default:
        raise ValueError(
            f"{settings.describe()}: nothing to wrap; upstream's DefaultEplbPolicy stays the policy"
        )
    name = f"Gated{POLICIES[settings.policy].__name__}"
    return type(name, (GatedPolicy,), {"settings": settings, "channels": channels, "__module__": __name__})
