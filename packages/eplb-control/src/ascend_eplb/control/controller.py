"""``AscendEPLBController``: upstream ``EPLBController`` with a batch load-collection phase.

Per batch the runner calls :meth:`~AscendEPLBController.set_batch_phase` (Model Runner V2: the
integration's patch of ``GPUModelRunner.prepare_inputs``), then
:meth:`~AscendEPLBController.prepare_forward`, the forward and upstream's ``step``. ``prepare_forward``
fills the device record flag once, as (upstream's record decision) and (the batch matches the phase),
and writes the forward's row layout (:mod:`.layout`). A filtered-out rank records zeros while its
``step`` runs like every other rank's, so counters, window and collectives stay identical across ranks
(vLLM Ascend's MRv2 design, PR #14099).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.models.interfaces import get_mixture_of_experts_model
from vllm.v1.worker.gpu.eplb_utils import EPLBController, draft_model_supports_eplb

from ascend_eplb.control import upstream
from ascend_eplb.control.bus import EventBus, RegistrationEvent, ShutdownEvent, StepEvent
from ascend_eplb.control.layout import (
    MOE_ROWS,
    MoeRows,
    RankCoordinates,
    RowLayout,
    current_rank_coordinates,
    default_moe_rows,
    row_layout,
)
from ascend_eplb.control.phase import LoadCollectionPhase, is_phase_matched, validate_phase
from ascend_eplb.control.policy_config import PolicySettings
from ascend_eplb.control.router_adaptation import adapt_layer_routers
from ascend_eplb.control.split_config import replica_split_error, split_scope
from ascend_eplb.control.state import AscendEplbState

logger = init_logger(__name__)

__all__ = ["AscendEPLBController", "check_upstream_controller_signatures"]


def check_upstream_controller_signatures() -> None:
    """Raise ``RuntimeError`` naming the first upstream row this module relies on that drifted from vLLM
    0.33.0 (:mod:`ascend_eplb.control.upstream`): an ``EPLBController`` method it overrides or calls
    (parameters, kinds, defaults), a body it copies or restates (``prepare_load``, ``step``,
    ``suppress``), an upstream attribute it writes, or one of its overrides."""
    upstream.SURFACE.check(upstream.CONTROLLER)


def _has_routed_experts(model: Any) -> bool:
    """Whether ``model`` holds a vLLM ``RoutedExperts`` layer (an MoE layer's experts)."""
    return any(isinstance(module, RoutedExperts) for module in model.modules())


class AscendEPLBController(EPLBController):
    """Upstream ``EPLBController`` that builds :class:`AscendEplbState`, adapts each MoE layer's router
    before its model is registered, and filters load by batch phase.

    Args:
        parallel_config: vLLM ``ParallelConfig`` (EPLB is active when ``enable_eplb``).
        device: the device of the EPLB state and lookups.
        load_collection_phase: ``"all"`` (default), ``"prefill"`` or ``"decode"`` (:func:`.is_phase_matched`).
        policy_settings: a :class:`.PolicySettings`; None: upstream's default policy, gate off.
        replica_split: ``"equal"`` (default, today's rule), ``"batch"`` or ``"batch_local"``
            (:mod:`.split_config`): the routers split each batch among the replicas by its own load, in the
            scope the configuration's rows give (:func:`~.split_config.split_scope`).

    Attributes:
        bus: the controller's and its state's :class:`.EventBus`. ``StepEvent`` after each upstream step
            that ran and ``RegistrationEvent`` after each registration come on every rank alike
            (subscribers may run collectives on the EP CPU group); ``ShutdownEvent`` once (rank-local).
        eplb_stopped: why :meth:`stop_eplb` stopped EPLB rearrangement (None while it runs).

    Raises:
        ValueError: a ``load_collection_phase`` or ``replica_split`` not allowed; TypeError:
        ``policy_settings`` of another type;
        RuntimeError: an upstream method this class overrides or relies on drifted from vLLM 0.33.0.
    """

    state: AscendEplbState | None

    def __init__(
        self,
        parallel_config: Any,
        device: torch.device,
        load_collection_phase: LoadCollectionPhase = "all",
        *,
        policy_settings: PolicySettings | None = None,
        replica_split: str = "equal",
    ) -> None:
        phase = validate_phase(load_collection_phase)
        if (reason := replica_split_error(replica_split)) is not None:
            raise ValueError(reason)
        self.policy_settings = PolicySettings.of(policy_settings)
        """The placement policy and gain gate of the state :meth:`prepare_load` builds."""
        check_upstream_controller_signatures()
        super().__init__(parallel_config, device)
        self.load_collection_phase: LoadCollectionPhase = phase
        self._batch_has_prefill: bool | None = None
        self.last_record_decision: bool | None = None
        """The flag value the last :meth:`prepare_forward` wrote (None before the first fill)."""
        self.bus = EventBus()
        self.steps_run = 0
        """The number of the step in progress: the steps upstream's EPLB ran on this controller before it
        (a :class:`~ascend_eplb.control.bus.StepEvent` each), profile runs not counted. The one step
        number of the events file's records and the verifier's messages."""
        self.eplb_stopped: str | None = None
        self._undeclared_phase_forward = False
        self._warned_undeclared_phase = False
        self._warned_split = False
        self._shut_down = False
        self._ranks: RankCoordinates | None = None
        self._row_layouts: dict[str, RowLayout] = {}
        self._default_rows: MoeRows | None = None
        self.last_row_layout: RowLayout | None = None
        """The row layout the last :meth:`prepare_forward` put in force (None before the first)."""
        self.replica_split = replica_split
        self.split_scope = (
            "off"
            if replica_split == "equal"
            else split_scope(replica_split, default_moe_rows(parallel_config))
        )
        """The batch split's scope on the configuration's rows (``"off"``: the equal split)."""

    def _lookup_ranks(self) -> int | None:
        """The EP size when the batch split is on (the lookups keep its inputs), else None."""
        if self.split_scope == "off":
            return None
        parallel = self.parallel_config
        return int(parallel.data_parallel_size) * int(parallel.tensor_parallel_size)

    def prepare_load(self) -> None:
        """Upstream ``prepare_load``, building an :class:`AscendEplbState` when EPLB is enabled."""
        self.state = None
        self._has_registered_models = False
        self._default_rows = None
        if self.parallel_config.enable_eplb:
            self.state = AscendEplbState(
                self.parallel_config,
                self.device,
                bus=self.bus,
                policy_settings=self.policy_settings,
                split_scope=self.split_scope,
            )

    def maybe_register_speculator(
        self, speculator: Any | None, speculative_config: Any | None, load_dummy_weights: bool
    ) -> bool:
        """Upstream's, after adapting the routers of the draft's MoE layers when upstream registers it
        (its own ``draft_model_supports_eplb`` of the draft's ``MixtureOfExperts`` part, e.g. DeepSeek's
        ``DeepSeekMTP``), under upstream's name ``"<model> (draft)"`` (``eplb_draft_model_name``).

        Raises:
            ValueError: EPLB is on and the draft has routed experts (vLLM ``RoutedExperts`` layers) that
                upstream does not register (start-up's rule ``speculative-moe-draft`` refuses it before
                anything loads; this is the check on the built draft).
        """
        draft = getattr(speculator, "model", None) if speculator is not None else None
        considered = self.parallel_config.enable_eplb and draft is not None and not load_dummy_weights
        if considered and draft_model_supports_eplb(speculative_config, get_mixture_of_experts_model(draft)):
            adapt_layer_routers(draft, lookup_ranks=self._lookup_ranks())
        added = super().maybe_register_speculator(speculator, speculative_config, load_dummy_weights)
        if added:
            self.bus.publish(RegistrationEvent(self, draft, speculative_config.draft_model_config))
        elif considered and _has_routed_experts(draft):
            raise ValueError(
                f"EPLB is on but the MoE draft {type(draft).__qualname__} is not registered by upstream "
                "(draft_model_supports_eplb is False for it): its routed experts would be served without a "
                "placement of their own; disable speculative decoding or use a draft upstream balances"
            )
        return added

    def maybe_register_model(self, model: Any, model_config: Any) -> bool:
        """Upstream's, after :func:`~ascend_eplb.control.router_adaptation.adapt_layer_routers`.

        Raises:
            ValueError: EPLB is on and upstream did not register the model (its class has no
                ``MixtureOfExperts`` part: upstream returns False and would serve it without EPLB).
        """
        if self.parallel_config.enable_eplb:
            adapt_layer_routers(model, lookup_ranks=self._lookup_ranks())
        added = super().maybe_register_model(model, model_config)
        if added:
            self.bus.publish(RegistrationEvent(self, model, model_config))
        elif self.parallel_config.enable_eplb:
            raise ValueError(
                f"EPLB is on but model class {type(model).__qualname__} has no MixtureOfExperts part "
                "(vLLM's get_mixture_of_experts_model finds none): upstream would serve it without EPLB; "
                "serve it without --enable-eplb"
            )
        return added

    def step(self, is_dummy: bool = False, is_profile: bool = False) -> None:
        """Upstream's step, then a :class:`~ascend_eplb.control.bus.StepEvent` when upstream's step ran."""
        ran = (
            self.parallel_config.enable_eplb
            and not self.suppressed
            and self.state is not None
            and self._has_registered_models
        )
        super().step(is_dummy, is_profile)
        undeclared, self._undeclared_phase_forward = self._undeclared_phase_forward, False
        if undeclared and not is_dummy and not self._warned_undeclared_phase:
            # A dummy run never declares a phase (upstream's runner prepares no inputs for it): only a
            # real batch's undeclared phase means the runner misses the call.
            self._warned_undeclared_phase = True
            logger.warning(
                "EPLB: load_collection_phase=%s but a batch's phase was not declared "
                "(AscendEPLBController.set_batch_phase was not called before prepare_forward): its load is "
                "not recorded. The integration's patch of GPUModelRunner.prepare_inputs declares it; a "
                "runner that replaces prepare_inputs must call set_batch_phase once per batch, or use "
                "load_collection_phase=all",
                self.load_collection_phase,
            )
        if ran:
            try:  # what the step's boundary publishes carries the step's number, even if a subscriber raises
                self.bus.publish(StepEvent(self, is_dummy, is_profile, self.steps_run))
            finally:
                self.steps_run += not is_profile

    def shutdown(self) -> None:
        """The runner's end of life: a :class:`~ascend_eplb.control.bus.ShutdownEvent`, once (later calls
        do nothing).
        Upstream's ``EPLBController`` has no such point; the integration calls it from the runner's
        ``shutdown``."""
        if self._shut_down:
            return
        self._shut_down = True
        self.bus.publish(ShutdownEvent(self))

    def stop_eplb(self, reason: str) -> bool:
        """Stop EPLB rearrangement on this rank for good; serving keeps the last committed placement.

        The one writer of upstream's fields for it (the watchdog calls it on every rank): sets
        ``EPLBController.suppressed``, fills ``EplbState.should_record_tensor`` with False, and drops the
        unfinished cycle (``rebalanced = False``, ``pending_result = None`` per model state), so every
        layer stays wholly old or new. A stop inside :meth:`suppress` outlives it. A worker thread waiting
        on the dropped layer keeps waiting (upstream's ``drain_async`` needs every rank in lockstep).

        Returns:
            True if this call stopped EPLB; False (nothing changed, first reason kept) if already stopped.

        Raises:
            ValueError: ``reason`` is not a non-empty ``str`` (nothing changed).
        """
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason={reason!r} must be a non-empty str (why EPLB stopped)")
        if self.eplb_stopped is not None:
            return False
        self.eplb_stopped = reason
        self._hold_stopped()
        state = self.state
        if state is None:
            return True
        for model_state in state.model_states.values():
            model_state.rebalanced = False
            model_state.pending_result = None
        return True

    def _hold_stopped(self) -> None:
        self.suppressed = True
        if self.state is not None and self.state.should_record_tensor is not None:
            self.state.should_record_tensor.fill_(False)

    @contextlib.contextmanager
    def suppress(self) -> Iterator[None]:
        """Upstream's ``suppress()`` (warm-up forwards neither step EPLB nor record load); a
        :meth:`stop_eplb` made inside it stays in force when it exits."""
        try:
            with super().suppress():
                yield
        finally:
            if self.eplb_stopped is not None:
                self._hold_stopped()

    def set_batch_phase(self, batch_has_prefill: bool) -> None:
        """Declare the phase of the next batch; called once per batch before :meth:`prepare_forward`.

        Args:
            batch_has_prefill: True if any request of the batch is in (chunked) prefill.

        Raises:
            ValueError: ``batch_has_prefill`` is not a bool.
        """
        if not isinstance(batch_has_prefill, bool):
            raise ValueError(f"batch_has_prefill={batch_has_prefill!r} must be a bool")
        self._batch_has_prefill = batch_has_prefill

    def phase_matched(self) -> bool:
        """Whether the declared batch phase is collected; a batch whose phase was not declared only
        matches ``"all"`` (the next :meth:`step` that is not a dummy's then warns, once per controller:
        a dummy run declares none)."""
        if self.load_collection_phase == "all":
            return True
        if self._batch_has_prefill is None:
            self._undeclared_phase_forward = True
            return False
        return is_phase_matched(self.load_collection_phase, self._batch_has_prefill)

    def _naive_dispatch(self) -> bool | None:
        """Whether vLLM's MoE runners of the registered models gather the rows before routing (each
        ``MoERunner.do_naive_dispatch_combine``: an expert method with an internal modular kernel routes
        first and dispatches in its kernel); None before a model registered or for layers that do not
        say (not vLLM's ``MoERunner``).

        Raises:
            RuntimeError: the registered models' runners disagree (one row layout serves a forward).
        """
        state = self.state
        if state is None or not state.model_states:
            return None
        seen = {
            getattr(layer, "do_naive_dispatch_combine", None)
            for model_state in state.model_states.values()
            for layer in getattr(model_state.model, "moe_layers", [None])
        }
        if None in seen:
            return None
        if len(seen) != 1:
            raise RuntimeError(
                "EPLB: the MoE layers of the served models differ in whether vLLM gathers their rows "
                "before routing (MoERunner.do_naive_dispatch_combine): one row layout cannot serve them"
            )
        return bool(seen.pop())

    def row_layout_for(self, moe_rows: str | None = None) -> RowLayout:
        """This rank's row layout for a forward whose MoE routes ``moe_rows`` (None: the configuration's,
        :func:`~ascend_eplb.control.layout.default_moe_rows` with the registered models' dispatch,
        :meth:`_naive_dispatch`).

        Raises:
            ValueError: ``moe_rows`` is not one of ``replicated``, ``split``, ``gathered``,
                ``gathered-sp``.
        """
        if moe_rows is None:
            if self._default_rows is None:
                naive_dispatch = self._naive_dispatch()
                rows = default_moe_rows(self.parallel_config, naive_dispatch=naive_dispatch)
                if naive_dispatch is not None:  # fixed once the models' runners are known
                    self._default_rows = rows
            else:
                rows = self._default_rows
        else:
            rows = moe_rows
            self._warn_local_split(rows)
        layout = self._row_layouts.get(rows)
        if layout is None:
            if rows not in MOE_ROWS:
                raise ValueError(f"moe_rows={rows!r} must be None or one of {list(MOE_ROWS)}")
            if self._ranks is None:
                self._ranks = current_rank_coordinates()
            layout = self._row_layouts[rows] = row_layout(rows, self._ranks)
        return layout

    def _warn_local_split(self, rows: str) -> None:
        """Once: ``replica_split=batch`` took its scope from the configuration's rows at construction (no
        all-gather of counts), and a runner names ``split`` rows for a forward (vLLM Ascend's MC2 on a
        TP-only configuration): each rank splits only the rows it routes, as ``batch_local`` does."""
        local = rows == "split" and self.split_scope == "rows" and self.replica_split == "batch"
        if not local or self._warned_split:
            return
        self._warned_split = True
        logger.warning(
            "EPLB: replica_split=batch took its scope from the configuration's %s rows at start-up (no "
            "all-gather of the counts), but a forward routes split rows (each rank its own): each rank "
            "splits only the rows it routes, as replica_split=batch_local does",
            default_moe_rows(self.parallel_config),
        )

    def prepare_forward(
        self,
        model_config: Any,
        num_unpadded_tokens: int,
        ubatch_slices: list | None = None,
        *,
        moe_rows: str | None = None,
    ) -> None:
        """Upstream ``prepare_forward``, then the forward's row layout and one fill of the record flag.

        Args:
            model_config: upstream's.
            num_unpadded_tokens: this rank's real tokens of the batch (upstream's); with
                ``moe_rows="gathered-sp"`` still the rank's whole batch (the chunk is derived).
            ubatch_slices: upstream's.
            moe_rows: the rows this forward's MoE routes (:mod:`ascend_eplb.control.layout`), for a
                runner whose dispatch differs per batch (vLLM Ascend: MC2/ALLTOALL ``"split"``,
                ALLGATHER ``"gathered"`` or ``"gathered-sp"``); None: the configuration's rows.

        The flag becomes (not suppressed) and (upstream ``_should_record_current_step`` for this step)
        and (:meth:`phase_matched`). The declared phase is consumed: the next batch must declare its own.

        Raises:
            ValueError: ``moe_rows`` is not a row layout name (raised before upstream's call).
        """
        layout = self.row_layout_for(moe_rows) if self.parallel_config.enable_eplb else None
        super().prepare_forward(model_config, num_unpadded_tokens, ubatch_slices)
        state = self.state
        try:
            if state is None or not self.parallel_config.enable_eplb or state.should_record_tensor is None:
                return
            assert layout is not None
            state.set_row_layout(layout)
            self.last_row_layout = layout
            decision = (
                not self.suppressed
                and self._has_registered_models
                and state._should_record_current_step(
                    log_stats=self.parallel_config.eplb_config.log_balancedness
                )
                and self.phase_matched()
            )
            state.should_record_tensor.fill_(decision)
            self.last_record_decision = decision
        finally:
            self._batch_has_prefill = None
