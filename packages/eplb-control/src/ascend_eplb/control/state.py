"""``AscendEplbState`` / ``AscendEplbLayerState``: upstream EPLB state plus a stable device lookup per layer.

Upstream ``EplbState`` stays the only placement state (``physical_to_logical_map`` ``(L, P)``,
``logical_to_physical_map`` ``(L, E, 1024)``, ``logical_replica_count`` ``(L, E)``). Each MoE layer's
:class:`AscendEplbLayerState` also owns a dataplane ``ReplicaLookup`` (int32 ``(rows, E)``, fixed
``data_ptr``: what the router op gathers from), refreshed in place right after upstream commits the
layer (asynchronous commit) or all layers (synchronous commit, ``update_mapping``), before the async
worker's staging buffer is acknowledged (the :class:`~ascend_eplb.control.commit_hooks.CommitObserver`
this state implements). :class:`AscendEplbState` adds only: a per-model decision on windows without load
(:meth:`~AscendEplbState.rearrange`), the policy, gain gate and load estimate of
:class:`~ascend_eplb.control.policy_config.PolicySettings`, a commit log and the bus events, and
signature checks of what it overrides or relies on (README "Gain gate", "Load estimate").
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed import ReduceOp, all_reduce
from vllm.distributed.eplb.eplb_state import EplbLayerState, EplbModelState, EplbState
from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
from vllm.distributed.parallel_state import get_ep_group
from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from ascend_eplb.control import upstream
from ascend_eplb.control.bus import CommitEvent, CommitEventKind, DecisionEvent, EventBus, RearrangementEvent
from ascend_eplb.control.commit_hooks import attach_observer, commit_hooks_installed
from ascend_eplb.control.estimate import LoadEstimate
from ascend_eplb.control.gate import DecisionChannel, ModelChannels, gated_policy
from ascend_eplb.control.layout import RowLayout
from ascend_eplb.control.outcome import Outcomes, PublishTimes
from ascend_eplb.control.policy_config import PlacementDecision, PolicySettings
from ascend_eplb.control.split_config import SplitScope
from ascend_eplb.dataplane import DEFAULT_ROWS, SPLIT_STATS_SIZE, BatchSplit, ReplicaLookup

__all__ = [
    "ACKNOWLEDGEMENT_BINDING",
    "COMMIT_LOG_MAXLEN",
    "AscendEplbLayerState",
    "AscendEplbState",
    "UnloadedModelsKeepPlacement",
    "check_upstream_state_signatures",
    "keeping_unloaded_placement",
]

logger = init_logger(__name__)

#: Events kept in :attr:`AscendEplbState.commit_log` (4 per layer per rearrangement; oldest dropped).
COMMIT_LOG_MAXLEN = 4096


def check_upstream_state_signatures() -> None:
    """Check every upstream row this module and the commit hooks rely on
    (:mod:`ascend_eplb.control.upstream`): the state methods and module functions they override, hook,
    call or bind per instance, the body whose order they rely on, the attributes they read or add, and
    this module's overrides.

    Raises:
        RuntimeError: one changed signature or body, or an attribute drifted, since vLLM 0.33.0; the
            message names it.
    """
    upstream.SURFACE.check(upstream.STATE, upstream.COMMIT_HOOKS)


#: The upstream method this module replaces per instance: the ``record`` of the async layer result's
#: ``consumed_event`` being acknowledged, wrapped so the acknowledgement is logged when it happens
#: (:meth:`AscendEplbState.after_commit`); its row of the one upstream surface,
#: :data:`ascend_eplb.control.upstream.INSTANCE_BINDINGS`.
ACKNOWLEDGEMENT_BINDING = upstream.SURFACE.instance_binding(
    "vllm.distributed.eplb.eplb_utils.CpuGpuEvent.record"
)


class UnloadedModelsKeepPlacement(AbstractEplbPolicy):
    """The base of the classes :func:`keeping_unloaded_placement` builds; not used itself.

    Upstream's worker calls ``EplbState.policy`` once per registered model with that model's window
    (``weight``, the global logical load ``(L, E)``, equal on every EP rank). A window without any load (a
    model that ran no forward while the others did, e.g. a draft) is no evidence for a placement (vLLM
    Ascend #12154), yet upstream's default policy would plan one and move experts for nothing. This policy
    returns that model's committed placement unchanged and hands every other window to :attr:`policy`.
    """

    policy: ClassVar[type[AbstractEplbPolicy]]

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
        """Upstream's policy call: a copy of ``old_global_expert_indices`` (int64 ``(L, P)``) when
        ``weight`` holds no positive entry and a placement is in force, else :attr:`policy`'s."""
        if old_global_expert_indices is not None and not bool((torch.as_tensor(weight) > 0).any()):
            return old_global_expert_indices.clone()
        return cls.policy.rebalance_experts(
            weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices
        )


def keeping_unloaded_placement(policy: type[AbstractEplbPolicy]) -> type[UnloadedModelsKeepPlacement]:
    """``policy`` (an upstream policy class, or the gated one) wrapped so that a model whose window holds
    no load keeps its committed placement (:class:`UnloadedModelsKeepPlacement`): what
    :meth:`AscendEplbState.rearrange` puts in ``EplbState.policy`` for a rearrangement in which some
    registered models recorded load and some did not."""
    name = f"UnloadedModelsKeepPlacement{policy.__name__}"
    return type(name, (UnloadedModelsKeepPlacement,), {"policy": policy, "__module__": __name__})


@dataclass
class AscendEplbLayerState(EplbLayerState):
    """Upstream ``EplbLayerState`` of one MoE layer plus the layer's device replica lookup.

    The upstream fields (``expert_load_view`` int32 ``(P,)``, ``logical_to_physical_map`` ``(E, 1024)``,
    ``logical_replica_count`` ``(E,)``, the shared 0-d bool ``should_record_tensor``,
    ``num_unpadded_tokens_tensors``) are views or references of the owning ``EplbModelState``.
    ``replica_lookup`` is built by the first :meth:`set_layer_state`, then only refreshed in place (its
    ``data_ptr`` never changes, so captured graphs stay valid); it is the same on every rank.

    Attributes:
        replica_lookup: the layer's lookup; None until :meth:`set_layer_state`.
        moe_layer_idx: the layer index upstream registered this state under.
        row_layout: int64 ``(4,)`` on the maps' device, the model's ``(replica_offset, num_slices,
            recording_slice, local_chunk)`` (:mod:`ascend_eplb.control.layout`), set by
            ``AscendEplbState.add_model``, written by the controller's ``prepare_forward`` (None: offset 0,
            first unpadded rows recorded); with the table, it decides which replica a rank picks.
        lookup_rows: rows of the table (dataplane's ``DEFAULT_ROWS``, 1024: vLLM Ascend's routing table).
        lookup_ranks: the EP size when the batch split is on (the lookup then keeps the split's inputs,
            dataplane's ``ReplicaLookup(num_ranks=...)``); None: off.
        batch_split: the dataplane's ``BatchSplit`` the bound router follows (set by
            ``AscendEplbState.add_model`` when the split is on); None: the equal split.
    """

    replica_lookup: ReplicaLookup | None = None
    moe_layer_idx: int | None = None
    row_layout: torch.Tensor | None = None
    lookup_rows: int = DEFAULT_ROWS
    lookup_ranks: int | None = None
    batch_split: BatchSplit | None = None

    @classmethod
    def from_upstream(
        cls, state: EplbLayerState, *, lookup_rows: int = DEFAULT_ROWS, lookup_ranks: int | None = None
    ) -> AscendEplbLayerState:
        """An :class:`AscendEplbLayerState` carrying ``state``'s upstream fields (references, not copies).

        A lookup is built only if ``state`` already has its maps; otherwise the first
        :meth:`set_layer_state` (called by upstream ``add_model``) builds it.
        """
        new = cls(
            expert_load_view=state.expert_load_view,
            logical_to_physical_map=state.logical_to_physical_map,
            logical_replica_count=state.logical_replica_count,
            should_record_tensor=state.should_record_tensor,
            num_unpadded_tokens_tensors=state.num_unpadded_tokens_tensors,
            lookup_rows=lookup_rows,
            lookup_ranks=lookup_ranks,
        )
        if (
            new.logical_to_physical_map is not None
            and new.logical_replica_count is not None
            and new.expert_load_view is not None
        ):
            new.replica_lookup = new._build_lookup(
                new.logical_to_physical_map, new.logical_replica_count, int(new.expert_load_view.shape[-1])
            )
        return new

    def _build_lookup(
        self,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
        num_physical_experts: int,
    ) -> ReplicaLookup:
        lookup = ReplicaLookup(
            int(logical_to_physical_map.shape[0]),
            logical_to_physical_map.device,
            rows=self.lookup_rows,
            num_physical_experts=num_physical_experts,
            num_ranks=self.lookup_ranks,
        )
        lookup.refresh_(logical_to_physical_map, logical_replica_count)
        return lookup

    def set_layer_state(
        self,
        moe_layer_idx: int,
        expert_load_view: torch.Tensor,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
    ) -> None:
        """Upstream's registration (row ``moe_layer_idx`` of each tensor), then build or refresh the lookup.

        Args:
            moe_layer_idx: the layer's index among the model's MoE layers.
            expert_load_view: int32 ``(L, P)`` (``(L, capacity)`` under elastic EP), upstream's load pass.
            logical_to_physical_map: int64 ``(L, E, 1024)``, padded with -1.
            logical_replica_count: int64 ``(L, E)``.

        Raises:
            ValueError: the maps are rejected by ``ReplicaLookup.refresh_`` (nothing is changed then).
        """
        l2p, count = logical_to_physical_map[moe_layer_idx], logical_replica_count[moe_layer_idx]
        if self.replica_lookup is None:
            # Replica ids index the layer's load view: bound them by its length (P, or the elastic-EP
            # capacity).
            lookup = self._build_lookup(l2p, count, int(expert_load_view.shape[-1]))
        else:
            lookup = self.replica_lookup
            lookup.refresh_(l2p, count)
        super().set_layer_state(
            moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count
        )
        self.replica_lookup = lookup
        self.moe_layer_idx = moe_layer_idx

    def refresh_replica_lookup(self) -> None:
        """Rewrite the lookup in place from this layer's (committed) upstream maps.

        Raises:
            RuntimeError: called before :meth:`set_layer_state`.
        """
        if (
            self.replica_lookup is None
            or self.logical_to_physical_map is None
            or self.logical_replica_count is None
        ):
            raise RuntimeError("AscendEplbLayerState.refresh_replica_lookup called before set_layer_state")
        self.replica_lookup.refresh_(self.logical_to_physical_map, self.logical_replica_count)


class AscendEplbState(EplbState):
    """Upstream ``EplbState`` whose layers' replica lookups follow every placement commit.

    Built like upstream's (as ``AscendEPLBController.prepare_load`` does) once integration's
    ``apply_patches()`` installed the commit hooks (else ``RuntimeError``, as for a drifted upstream
    signature); every MoE layer of a registered model carries an :class:`AscendEplbLayerState`. ``bus``
    (None: its own) gets each :class:`CommitEvent` as logged (on the runner thread: a subscriber's exception
    stops upstream's commit), a ``RearrangementEvent`` per window handed to the policy and the
    ``DecisionEvent``\\ s; ``policy_settings`` None: upstream's default policy, gate off.

    Attributes:
        commit_log: the recent :class:`CommitEvent`\\ s, oldest first (at most :data:`COMMIT_LOG_MAXLEN`).
        collect_commit_evidence, commit_probe: events carry device reads (tests; off by default), and
            ``commit_probe(model_state, layer)``'s return at each ``move`` while collecting.
        num_rearrangements / num_skipped_rearrangements: windows handed to the policy (gate skips
            included, profile ones not) / windows without load on any rank (never handed over).
        skipped_rearrangements: ``Counter`` of skipped windows by reason (``"balanced"``, ``"min_gain"``,
            ``"no_load"``), counted when the decision is published.
        policy_settings, channels: the settings in force; the registered models' ``ModelChannels``.
        outcomes, publish_times: each window's figures and outcome, on ``bus``; each layer's publication
            to acknowledgement (:mod:`~ascend_eplb.control.outcome`'s ``Outcomes``, ``PublishTimes``).
    """

    def __init__(
        self,
        parallel_config: Any,
        device: torch.device,
        *,
        bus: EventBus | None = None,
        policy_settings: PolicySettings | None = None,
        split_scope: SplitScope = "off",
    ) -> None:
        settings = PolicySettings.of(policy_settings)
        check_upstream_state_signatures()
        if not commit_hooks_installed():
            raise RuntimeError(
                "AscendEplbState needs the commit hooks of ascend_eplb.control.commit_hooks installed "
                "(ascend_eplb.integration.patches.apply_patches() installs them); without them replica "
                "lookups would not follow placement commits"
            )
        super().__init__(parallel_config, device)
        self.commit_log: collections.deque[CommitEvent] = collections.deque(maxlen=COMMIT_LOG_MAXLEN)
        self.collect_commit_evidence = False
        self.commit_probe: Callable[[EplbModelState, int], Any] | None = None
        self.num_rearrangements = 0
        self.num_skipped_rearrangements = 0
        self.skipped_rearrangements: collections.Counter[str] = collections.Counter()
        self._consecutive_skips = 0
        self.policy_settings = settings
        self.channels = ModelChannels()
        self._gated_policy = None if settings.is_upstream_default else gated_policy(settings, self.channels)
        # Per model (with the estimate on): int64 (L, E + 1) on the device, the logical selections of the
        # passes this rank recorded since the last regular rearrangement (column E: empty slots).
        self._new_load: dict[str, torch.Tensor] = {}
        self._selected_policy: type[AbstractEplbPolicy] = self.policy  # what add_model selects
        # Model keys whose decision of the rearrangement in flight is still to be published.
        self._awaiting_decision: set[str] = set()
        self._layer_states: dict[str, dict[int, list[AscendEplbLayerState]]] = {}
        self.bus = EventBus() if bus is None else bus
        self.outcomes = Outcomes(self.bus)
        self.publish_times = PublishTimes()
        self.row_layouts: dict[str, torch.Tensor] = {}
        """Per registered model (by config hash): its int64 ``(4,)`` row-layout tensor."""
        self.row_layout_in_force: dict[str, RowLayout] = {}
        """Per registered model: the :class:`~ascend_eplb.control.layout.RowLayout` its tensor holds
        (absent before the first ``set_row_layout``)."""
        self.split_scope: SplitScope = split_scope
        """The batch split's scope (``ascend_eplb.control.split_config``); ``"off"``: the equal split."""
        self.split_stats: dict[str, torch.Tensor] = {}
        """Per registered model, with the split on: float32 ``(L, SPLIT_STATS_SIZE)`` on the device, each
        layer's ``BatchSplit.stats`` (executed and equal-split balancedness summed over the recorded
        batches, and their count), read by :meth:`take_split_balancedness`."""

    # ----------------------------------------------------------------- registration
    def add_model(self, model: Any, model_config: Any, model_name: str | None = None) -> None:
        """Upstream ``add_model`` after checking every MoE layer carries an :class:`AscendEplbLayerState`.

        Raises:
            TypeError: a MoE layer's ``eplb_state`` is not an :class:`AscendEplbLayerState` (checked
                before anything is registered; the message names the layer).
        """
        for idx, layer in enumerate(model.moe_layers):
            layer_state = getattr(layer, "eplb_state", None)
            if not isinstance(layer_state, AscendEplbLayerState):
                raise TypeError(
                    f"MoE layer {idx} ({type(layer).__name__}) has eplb_state of type "
                    f"{type(layer_state).__name__}; AscendEplbState needs an AscendEplbLayerState on every "
                    "MoE layer (AscendEplbLayerState.from_upstream converts an upstream one)"
                )
        super().add_model(model, model_config, model_name)
        if self._gated_policy is not None:
            # Upstream's add_model has just set self.policy = EPLB_POLICIES[eplb_config.policy] (its
            # option stays "default"): select ours in its place, for every model of this state.
            self.policy = self._gated_policy
        self._selected_policy = self.policy
        by_layer: dict[int, list[AscendEplbLayerState]] = collections.defaultdict(list)
        for layer in model.moe_layers:
            layer_state = layer.eplb_state
            if layer_state.replica_lookup is None or layer_state.moe_layer_idx is None:
                raise RuntimeError(
                    f"{type(layer).__name__}.set_eplb_state did not register its AscendEplbLayerState "
                    "(set_layer_state was not called)"
                )
            by_layer[layer_state.moe_layer_idx].append(layer_state)
        key = model_config.compute_hash()
        self._layer_states[key] = dict(by_layer)
        shape = (model.num_moe_layers, model.num_logical_experts, model.num_physical_experts)
        estimate = None
        if self.policy_settings.estimating:
            estimate = LoadEstimate()
            num_layers, num_logical = model.num_moe_layers, model.num_logical_experts
            self._new_load[key] = torch.zeros(
                num_layers, num_logical + 1, dtype=torch.int64, device=self.device
            )
        self.channels.add(key, DecisionChannel(self.model_states[key].model_name, shape, estimate))
        # One row layout per model, shared by its layers (like upstream's should_record_tensor). The
        # controller's prepare_forward, which precedes every forward, writes the forward's layout into
        # it; until then it holds the op's neutral layout (offset 0, the first unpadded rows recorded).
        layout = torch.tensor([0, 1, 0, 0], dtype=torch.int64, device=self.device)
        for group in by_layer.values():
            for layer_state in group:
                layer_state.row_layout = layout
        self.row_layouts[key] = layout
        if self.split_scope != "off":
            self._add_batch_split(key, model.num_moe_layers, by_layer)
        attach_observer(self.model_states[key], self)

    def _add_batch_split(
        self, key: str, num_layers: int, by_layer: dict[int, list[AscendEplbLayerState]]
    ) -> None:
        """Give every layer of a model its ``BatchSplit`` (a row of the model's stats each)."""
        stats = torch.zeros(num_layers, SPLIT_STATS_SIZE, dtype=torch.float32, device=self.device)
        self.split_stats[key] = stats
        ep = get_ep_group()
        gather = None
        if self.split_scope == "global":

            def gather(local: torch.Tensor) -> torch.Tensor:
                return ep.all_gather(local.unsqueeze(0), dim=0)

        for idx, group in by_layer.items():
            for layer_state in group:
                if layer_state.replica_lookup is None or layer_state.replica_lookup.split_inputs is None:
                    raise RuntimeError(
                        f"MoE layer {idx}'s replica lookup keeps no split inputs: the batch split needs the "
                        "routers adapted with lookup_ranks (AscendEPLBController does it when replica_split "
                        "is on)"
                    )
                layer_state.batch_split = BatchSplit(
                    gather_counts=gather, rank=ep.rank_in_group, stats=stats[idx]
                )

    def take_split_balancedness(self, model_config: Any) -> tuple[float, float] | None:
        """The batch split's executed balancedness and the equal split's on the same counts, each the mean
        over the layers of their recorded batches' mean, since the last call; then the stats restart.

        One device-to-host read: call at a window's end, not per step. None with the split off, or when
        no batch was recorded since.
        """
        stats = self.split_stats.get(model_config.compute_hash())
        if stats is None:
            return None
        with gpu_sync_allowed():
            values = stats.to("cpu", copy=True)
        stats.zero_()
        counted = values[:, 2] > 0
        if not bool(counted.any()):
            return None
        means = values[counted, :2] / values[counted, 2:3]
        return float(means[:, 0].mean()), float(means[:, 1].mean())

    def set_row_layout(self, layout: RowLayout) -> None:
        """Write ``layout`` into every registered model's row-layout tensor, where it differs.

        One small host-to-device copy per model when the layout changes (never on the device's
        critical path of a forward); nothing when it is already in force. Called by the controller's
        ``prepare_forward`` before the forward, outside any captured graph.
        """
        for key, tensor in self.row_layouts.items():
            if self.row_layout_in_force.get(key) != layout:
                tensor.copy_(torch.tensor(layout.values(), dtype=torch.int64), non_blocking=True)
                self.row_layout_in_force[key] = layout

    def _key_of(self, model_state: EplbModelState) -> str | None:
        for key, candidate in self.model_states.items():
            if candidate is model_state:
                return key
        return None

    def layer_states(self, model_config: Any) -> dict[int, list[AscendEplbLayerState]]:
        """The :class:`AscendEplbLayerState`\\ s of a registered model, by MoE layer index."""
        return self._layer_states[model_config.compute_hash()]

    # ----------------------------------------------------------------- commit, refresh, acknowledge
    def _log(
        self, kind: CommitEventKind, model_state: EplbModelState, layer: int, seconds: float | None = None,
        **evidence: Any,
    ) -> None:  # fmt: skip
        event = CommitEvent(
            kind, model_state.model_name, layer, self.num_rearrangements, dict(evidence), model_state, seconds
        )
        self.commit_log.append(event)
        self.bus.publish(event)
        if kind == "acknowledge":
            self.outcomes.acknowledged(model_state, layer)

    def _lookup_evidence(self, layer_states: list[AscendEplbLayerState]) -> dict[str, Any]:
        lookups = [ls.replica_lookup for ls in layer_states if ls.replica_lookup is not None]
        return {
            "checksums": [lk.checksum() for lk in lookups],
            "data_ptrs": [lk.table.data_ptr() for lk in lookups],
        }

    def before_commit(
        self, model_state: EplbModelState, layers: tuple[int, ...], new_physical_to_logical_map: torch.Tensor
    ) -> None:
        """:class:`~ascend_eplb.control.commit_hooks.CommitObserver`: ``layers``' weights already moved.

        At the first commit of a model's gated rearrangement, its decision is published first.
        """
        key = self._key_of(model_state)
        if key in self._awaiting_decision:
            self._awaiting_decision.discard(key)
            self._publish_decision(model_state, self.num_rearrangements, self._take_decision(model_state))
        self.publish_times.seen(model_state.model_name, layers)
        for layer in layers:
            if self.collect_commit_evidence:
                with gpu_sync_allowed():
                    map_before = model_state.physical_to_logical_map[layer].tolist()
                probe = self.commit_probe(model_state, layer) if self.commit_probe is not None else None
                self._log("move", model_state, layer, map_before=map_before, probe=probe)
            else:
                self._log("move", model_state, layer)

    def after_commit(
        self, model_state: EplbModelState, layers: tuple[int, ...], acknowledged_by: Any | None
    ) -> None:
        """:class:`~ascend_eplb.control.commit_hooks.CommitObserver`: refresh the committed layers' lookups.

        ``acknowledged_by`` is the async ``AsyncEplbLayerResult`` being consumed (None for a
        synchronous commit); its acknowledgement is logged when it happens.
        """
        key = self._key_of(model_state)
        assert key is not None
        for layer in layers:
            if self.collect_commit_evidence:
                with gpu_sync_allowed():
                    self._log(
                        "commit", model_state, layer, map=model_state.physical_to_logical_map[layer].tolist()
                    )
            else:
                self._log("commit", model_state, layer)
            self._refresh_layer(model_state, key, layer)
        if acknowledged_by is None:  # synchronous: nothing to acknowledge
            self.publish_times.drop(model_state.model_name, layers)
        elif tuple(layers) == (acknowledged_by.layer_idx,):
            self._observe_acknowledgement(model_state, key, acknowledged_by)

    def _refresh_layer(self, model_state: EplbModelState, key: str, layer: int) -> None:
        layer_states = self._layer_states[key].get(layer, [])
        for layer_state in layer_states:
            layer_state.refresh_replica_lookup()
        if self.collect_commit_evidence:
            with gpu_sync_allowed():
                self._log("refresh", model_state, layer, **self._lookup_evidence(layer_states))
        else:
            self._log("refresh", model_state, layer)

    def _observe_acknowledgement(self, model_state: EplbModelState, key: str, result: Any) -> None:
        event = result.consumed_event
        record = event.record
        layer = result.layer_idx

        def record_and_log(stream: torch.Stream | None = None) -> None:
            # The evidence is read before ``record`` releases the async worker, which may at once publish
            # the next layer into ``pending_result`` (read after, it said "not cleared": a test flaked).
            evidence: dict[str, Any] = {}
            if self.collect_commit_evidence:
                with gpu_sync_allowed():
                    evidence = self._lookup_evidence(self._layer_states[key].get(layer, []))
                evidence = {"pending_result_cleared": model_state.pending_result is None, **evidence}
            record(stream)
            seconds = self.publish_times.acknowledged(model_state.model_name, layer)
            self._log("acknowledge", model_state, layer, seconds, **evidence)

        event.record = record_and_log  # ACKNOWLEDGEMENT_BINDING

    def update_mapping(self, model_config: Any, expanded_physical_to_logical: torch.Tensor) -> None:
        """Upstream ``update_mapping`` (elastic EP), then refresh every layer's lookup of that model.

        Serving refuses elastic EP (start-up rule ``elastic-ep``); this stays so that control used alone
        never routes on a stale lookup when vLLM remaps (see the README, "Modes serving refuses").
        """
        super().update_mapping(model_config, expanded_physical_to_logical)
        key = model_config.compute_hash()
        model_state = self.model_states[key]
        for layer in sorted(self._layer_states.get(key, {})):
            self._refresh_layer(model_state, key, layer)

    # ----------------------------------------------------------------- rearrangement gate
    def _take_decision(self, model_state: EplbModelState) -> PlacementDecision:
        key = self._key_of(model_state)
        assert key is not None
        decision = self.channels[key].take()
        if decision is None:
            # The policy's thread decides before it publishes a layer, and the policy is called once
            # per model and rearrangement: a missing decision means upstream's call order changed.
            raise RuntimeError(
                f"EPLB rearrangement {self.num_rearrangements} of {model_state.model_name}: its first layer "
                "commits, but the gated policy made no decision for it (upstream's policy call changed?)"
            )
        return decision

    def _publish_decision(
        self, model_state: EplbModelState, rearrangement: int | None, decision: PlacementDecision
    ) -> None:
        if decision.skipped is not None:
            self.skipped_rearrangements[decision.skipped] += 1
        self.bus.publish(DecisionEvent(self, model_state.model_name, rearrangement, decision, model_state))
        self.outcomes.decided(model_state.model_name, rearrangement, decision, model_state)

    def step(self, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> None:
        """Upstream's ``step``; with the load estimate on, first each model's pass that upstream's copies
        into the load window (its condition, pinned in :data:`ascend_eplb.control.upstream.BODIES`: not a
        dummy or profile step, and ``_should_record_current_step``) is added to the model's new
        selections, mapped to logical experts by the placement it was recorded under (upstream's commits
        come later in its step). One device ``scatter_add_`` per model, no host synchronisation."""
        if self._new_load and not is_dummy and not is_profile and self._should_record_current_step(log_stats):
            for key, new in self._new_load.items():
                model_state = self.model_states[key]
                mapping = model_state.physical_to_logical_map
                logical = mapping.masked_fill(mapping < 0, new.shape[1] - 1).long()
                new.scatter_add_(1, logical, model_state.expert_load_pass[:, : mapping.shape[1]].long())
        super().step(is_dummy, is_profile, log_stats)
        self.publish_times.seen_pending(self.model_states.values())

    def new_selections(self) -> dict[str, torch.Tensor]:
        """Per model with the load estimate on (by config hash): int64 ``(L, E)`` CPU, the global logical
        selections recorded since the last regular rearrangement (then zeroed).

        Only what is new since the last call: upstream's windows overlap when ``window_size`` exceeds
        ``step_interval``, and a rank's dummy steps leave older passes in its window. One
        ``all_reduce(SUM)`` over ``get_ep_group().cpu_group`` (none for one rank) makes them the same on
        every rank. Reads them to the host.
        """
        with gpu_sync_allowed():
            parts = [new[:, :-1].to("cpu", copy=True) for new in self._new_load.values()]
        for new in self._new_load.values():
            new.zero_()
        flat = torch.cat([part.flatten() for part in parts])
        cpu_group = get_ep_group().cpu_group
        if cpu_group.size() > 1:
            all_reduce(flat, op=ReduceOp.SUM, group=cpu_group)
        chunks = flat.split([part.numel() for part in parts])
        return {
            key: chunk.view(part.shape)
            for key, chunk, part in zip(self._new_load, chunks, parts, strict=True)
        }

    def models_with_load(self) -> dict[str, bool]:
        """Per registered model (by config hash, in registration order): whether any EP rank's load window
        holds a non-zero count (valid physical slots only).

        One ``all_reduce(MAX)`` of an int32 flag per model over ``get_ep_group().cpu_group`` (none for one
        rank), so every rank gets the same answer. Reads the windows to the host (one synchronisation per
        rearrangement).
        """
        local = []
        for model_state in self.model_states.values():
            valid = (model_state.physical_to_logical_map >= 0).unsqueeze(0)
            with gpu_sync_allowed():
                local.append(int(bool((model_state.expert_load_window * valid).any())))
        flags = torch.tensor(local, dtype=torch.int32)
        cpu_group = get_ep_group().cpu_group
        if cpu_group.size() > 1:
            all_reduce(flags, op=ReduceOp.MAX, group=cpu_group)
        return {key: bool(flag) for key, flag in zip(self.model_states, flags.tolist(), strict=True)}

    def rearrange(
        self,
        is_profile: bool = False,
        rank_mapping: dict[int, int] | None = None,
        use_last_expert_load: bool = False,
    ) -> torch.Tensor | None:
        """Upstream ``rearrange``, decided per registered model on whether its window holds load.

        Regular rearrangements only (not profile, elastic-EP ``rank_mapping`` or ``use_last_expert_load``
        ones): :meth:`models_with_load` (one collective, the same answer on every rank) says which models
        recorded load on some EP rank. None did: the rearrangement is skipped (upstream's is not called),
        a :class:`~ascend_eplb.control.bus.DecisionEvent` with reason ``"no_load"`` is published per
        model and EP rank 0 logs the first skip of each idle stretch. Some did: each model without load
        gets its ``"no_load"`` decision at once (rearrangement None: none started for it) and keeps its
        committed placement (``EplbState.policy`` is :func:`keeping_unloaded_placement` of the selected
        policy for this rearrangement: upstream's worker still commits its unchanged layers, nothing
        moves), while the others rearrange through upstream's transaction, in its order. Only regular
        rearrangements are gated (the gated policy's channels are told before upstream's call and expect a
        decision from the loaded models only, and each model's load estimate takes the selections recorded
        since the last regular rearrangement: :meth:`new_selections`); the others run the selected policy
        alone.
        """
        regular = not is_profile and rank_mapping is None and not use_last_expert_load
        unloaded: list[str] = []
        selections: dict[str, torch.Tensor] = {}
        if regular and self.model_states:
            loaded = self.models_with_load()
            if not any(loaded.values()):
                self.num_skipped_rearrangements += 1
                self._consecutive_skips += 1
                if self._consecutive_skips == 1 and get_ep_group().rank_in_group == 0:
                    logger.info(
                        "EPLB: no EP rank recorded expert load in the last %d-step window; skipping the "
                        "rearrangement until load is recorded again",
                        self.expert_load_window_size,
                    )
                for model_state in self.model_states.values():
                    decision = PlacementDecision(
                        self.policy_settings.policy,
                        "no_load",
                        None,
                        None,
                        0,
                        self.policy_settings.load_estimate,
                    )
                    self._publish_decision(model_state, None, decision)
                return None
            self._consecutive_skips = 0
            if self._new_load:
                selections = self.new_selections()
                for key, new in selections.items():
                    estimate = self.channels[key].estimate
                    assert estimate is not None
                    estimate.update(new)
            unloaded = [key for key, has_load in loaded.items() if not has_load]
        # The policy upstream runs for this rearrangement's models (add_model set the selected one): a model
        # without load keeps its placement (no policy call, no gate decision), decided here at once.
        selected = self._selected_policy
        self.policy = keeping_unloaded_placement(selected) if unloaded else selected
        for key in unloaded:
            decision = PlacementDecision(
                self.policy_settings.policy, "no_load", None, None, 0, self.policy_settings.load_estimate
            )
            self._publish_decision(self.model_states[key], None, decision)
        if not is_profile:
            self.num_rearrangements += 1
        if self._gated_policy is not None:
            # No policy call is in flight: upstream starts a rearrangement only when the last one's
            # every layer committed.
            loaded_keys = [key for key in self.model_states if key not in unloaded]
            self.channels.expect(loaded_keys, gating=regular)
            self._awaiting_decision = set(loaded_keys) if regular else set()
        result = super().rearrange(is_profile, rank_mapping, use_last_expert_load)
        if not is_profile:
            self.bus.publish(RearrangementEvent(self, selections))
            if self.outcomes.listening:
                world_size = get_ep_group().world_size
                self.outcomes.windows_closed(
                    self.model_states, self.num_rearrangements, world_size, self.policy_settings, selections
                )
        return result
