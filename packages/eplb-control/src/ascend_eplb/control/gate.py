"""The gain gate: the selected placement policy, wrapped so that a rearrangement buying too little moves
nothing.

Upstream vLLM 0.33.0 runs ``EplbState.policy.rebalance_experts(weight, num_replicas, num_groups, num_nodes,
num_ranks, old_global_expert_indices)`` where a closed window is decided: in asynchronous mode in its
async worker thread (``async_worker.run_rebalance_experts``), in synchronous mode inside
``EplbState.rearrange``. ``weight`` is the window's global logical load ``(L, E)``, all-reduced on the
main thread before, so equal on every EP rank. :func:`gated_policy` builds, for one
:class:`~ascend_eplb.control.state.AscendEplbState`, an upstream :class:`AbstractEplbPolicy` subclass
that the state puts in ``EplbState.policy`` (after upstream's ``add_model`` set it). Its
``rebalance_experts`` calls :func:`decide`:

1. the committed placement's balancedness on the window at or above ``target_balancedness``: the
   committed placement is returned unchanged, the policy does not run (reason ``"balanced"``);
2. otherwise the selected policy (:data:`POLICIES`) runs; if its placement gains less than
   ``min_balancedness_gain`` over the committed one, the committed placement is returned (reason
   ``"min_gain"``);
3. otherwise the policy's placement is returned, exactly.

An unchanged placement moves nothing through upstream's transaction: ``transfer_layer`` posts no send
or receive for a slot whose expert stays (``move_to_buffer``: ``is_unchanged``), and the per-layer
commits write the same maps. The decision is a pure function of the window, the committed placement and
the settings (float64 host arithmetic in a fixed order), so every rank decides alike with no collective.
The gate runs where upstream runs the policy: in asynchronous mode (the only mode serving accepts) it
costs the serving thread nothing; in synchronous mode its two balancedness passes run inside
``EplbState.rearrange`` on the runner thread, beside the policy.

The decision reaches the runner thread through a :class:`DecisionChannel` (a lock-guarded queue the
worker puts into, in the order it calls the policy: the state's models in registration order); the
state takes it at the first commit of that model's rearrangement, on the runner thread, and publishes it
on the controller's bus (:class:`~ascend_eplb.control.bus.DecisionEvent`). The worker made the decision
before it published that layer, so it is there when the first commit runs.

Balancedness and expert moves are :mod:`ascend_eplb.control.policy`'s (the project's one definition of
each; ``notes/placement-cost.md``); a decision's figures are their means / sums over the L layers.
"""

from __future__ import annotations

import collections
import threading
from typing import ClassVar

import torch
from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from ascend_eplb.control.policy import MigrationAwarePolicy, balancedness, moved_experts
from ascend_eplb.control.policy_config import POLICY_NAMES, PlacementDecision, PolicySettings

__all__ = ["POLICIES", "DecisionChannel", "GatedPolicy", "decide", "gated_policy"]

#: Policy name -> the upstream policy class it selects (keys checked equal to ``POLICY_NAMES`` here).
POLICIES: dict[str, type[AbstractEplbPolicy]] = {
    "default": DefaultEplbPolicy,
    "migration_aware": MigrationAwarePolicy,
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
) -> tuple[torch.Tensor, PlacementDecision]:
    """The placement to move to and why: the gate of the module docstring around ``settings.policy``.

    Args:
        settings: the policy and the gate.
        weight: ``(L, E)`` global load per logical expert of the closed window (int or float, CPU).
        num_replicas, num_groups, num_nodes, num_ranks: upstream's policy arguments (P, groups, nodes,
            N).
        old_global_expert_indices: int64 ``(L, P)``, the committed placement; None (no placement in
            force): the policy runs with no gate.

    Returns:
        ``(placement, decision)``: int64 ``(L, P)`` on CPU, a copy of the committed placement when
        skipped (``decision.skipped`` names why), else the policy's result itself.

    Raises:
        ValueError: from the policy or the measures, naming the value and the rule.
    """
    base = POLICIES[settings.policy]
    old = old_global_expert_indices
    if old is None:
        new = base.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks, None)
        planned = float(balancedness(weight, new, num_ranks).mean())
        return new, PlacementDecision(settings.policy, None, None, planned, None)
    if not bool((torch.as_tensor(weight) > 0).any()):
        # A model without load while another model of the state has some (AscendEplbState.rearrange
        # skips a window only when no model of any rank recorded load), or a caller's all-zero window.
        return old.clone(), PlacementDecision(settings.policy, "no_load", None, None, 0)
    before = float(balancedness(weight, old, num_ranks).mean())
    target = settings.target_balancedness
    if target is not None and before >= target:
        return old.clone(), PlacementDecision(settings.policy, "balanced", before, None, 0)
    new = base.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks, old)
    planned = float(balancedness(weight, new, num_ranks).mean())
    if settings.min_balancedness_gain > 0 and planned - before < settings.min_balancedness_gain:
        return old.clone(), PlacementDecision(settings.policy, "min_gain", before, planned, 0)
    moved = int(moved_experts(old, new, num_ranks).sum())
    return new, PlacementDecision(settings.policy, None, before, planned, moved)


class DecisionChannel:
    """The hand-off of :class:`PlacementDecision` s from the thread that runs the policy to the runner
    thread: a lock-guarded FIFO, plus the switch that says whether the policy call is gated.

    Attributes:
        gating: True for a regular rearrangement; False for the calls the gate must not judge (upstream's
            profile rearrangement, which reserves the communication buffers with a worst-case move;
            elastic-EP ``rank_mapping`` and ``use_last_expert_load`` ones). Written by the state on the
            runner thread before upstream's ``rearrange``, while no policy call is in flight.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decisions: collections.deque[PlacementDecision] = collections.deque()
        self.gating = True

    def put(self, decision: PlacementDecision) -> None:
        """Append ``decision`` (the policy's thread)."""
        with self._lock:
            self._decisions.append(decision)

    def take(self) -> PlacementDecision | None:
        """The oldest decision not taken yet, or None (the runner thread)."""
        with self._lock:
            return self._decisions.popleft() if self._decisions else None

    def clear(self) -> None:
        """Drop every decision not taken (the runner thread, when a rearrangement starts)."""
        with self._lock:
            self._decisions.clear()


class GatedPolicy(AbstractEplbPolicy):
    """The base of the classes :func:`gated_policy` builds (one per state); not used itself."""

    settings: ClassVar[PolicySettings]
    channel: ClassVar[DecisionChannel]

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
        """Upstream's policy call: :func:`decide` (its decision put on the channel), or the selected
        policy alone when the channel is not gating."""
        if not cls.channel.gating:
            return POLICIES[cls.settings.policy].rebalance_experts(
                weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices
            )
        placement, decision = decide(
            cls.settings, weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices
        )
        cls.channel.put(decision)
        return placement


def gated_policy(settings: PolicySettings, channel: DecisionChannel) -> type[GatedPolicy]:
    """A :class:`GatedPolicy` subclass bound to ``settings`` and ``channel``: what ``EplbState.policy``
    holds (upstream types it ``type[AbstractEplbPolicy]`` and calls its classmethod).

    Raises:
        ValueError: ``settings`` selects upstream's default policy with the gate off (nothing to wrap:
            upstream's ``DefaultEplbPolicy`` itself stays the policy).
    """
    if settings.is_upstream_default:
        raise ValueError(
            f"{settings.describe()}: nothing to wrap; upstream's DefaultEplbPolicy stays the policy"
        )
    name = f"Gated{POLICIES[settings.policy].__name__}"
    return type(name, (GatedPolicy,), {"settings": settings, "channel": channel, "__module__": __name__})
