"""Control's upstream surface: every point where control, dataplane's router and movement's communicator
meet vLLM 0.33.0 and torch 2.13.0, declared once in :data:`SURFACE` (the integration's own rows are
``ascend_eplb.integration.upstream``'s).

Rows (types of :mod:`ascend_eplb.control.patching`): :data:`SIGNATURES` (every upstream callable patched,
bound per instance, overridden, body-pinned or called with arguments we build; not accessors such as
``get_ep_group()``), module-level replacements (each on its factory with ``SURFACE.replaces``, listed by
its owner's ``PATCHES``, installed by integration in one ``PatchSet``), :data:`INSTANCE_BINDINGS`,
:data:`OVERRIDES`, :data:`ATTRIBUTES` (written or read: upstream must declare them; added: it must not)
and :data:`BODIES` (source digests). Users check theirs with ``SURFACE.check(user, ...)`` at construction
or installation; integration's ``check_upstream()`` checks every row, with its own, and renders them
(``integration/UPSTREAM.md``). Nothing here imports vLLM (a row resolves when checked); dataplane's
``UPSTREAM_MAPPING_SIGNATURE`` is listed by reference (``ascend_eplb.dataplane.router``, torch only, the
one other package imported).
"""

from __future__ import annotations

from collections.abc import Mapping

from ascend_eplb.control.patching import Attribute, Body, InstanceBinding, Override, Signature
from ascend_eplb.control.surface import Surface, table
from ascend_eplb.dataplane.router import UPSTREAM_MAPPING_SIGNATURE

__all__ = [
    "ATTRIBUTES",
    "BODIES",
    "COMMIT_OBSERVER_ATTR",
    "INSTANCE_BINDINGS",
    "OVERRIDES",
    "SIGNATURES",
    "SURFACE",
    "USERS",
]

# The users (modules of ascend_eplb that rely on a row).
HOST_ADAPTATION = "control.host_adaptation"
COMMIT_HOOKS = "control.commit_hooks"
CONTROLLER = "control.controller"
STATE = "control.state"
ROUTER_ADAPTATION = "control.router_adaptation"
POLICY = "control.policy"
GATE = "control.gate"
ROUTER = "dataplane.router"
MOVEMENT = "movement.communicator"
INITIAL_PLACEMENT = "control.initial_placement"
MEASURES = "control.measures"
OUTCOME = "control.outcome"
#: Every user id a row may name (what ``SURFACE.used_by`` and ``SURFACE.check`` accept).
USERS = (
    HOST_ADAPTATION,
    COMMIT_HOOKS,
    CONTROLLER,
    STATE,
    ROUTER_ADAPTATION,
    POLICY,
    GATE,
    ROUTER,
    MOVEMENT,
    INITIAL_PLACEMENT,
    MEASURES,
    OUTCOME,
)

#: The attribute :mod:`~ascend_eplb.control.commit_hooks` sets on an upstream ``EplbModelState``: a weak
#: reference to its commit observer.
COMMIT_OBSERVER_ATTR = "_ascend_eplb_commit_observer"

_ACCELERATOR = "torch.accelerator"
_STATE = "vllm.distributed.eplb.eplb_state"
_UTILS = "vllm.distributed.eplb.eplb_utils"
_COMMUNICATOR = "vllm.distributed.eplb.eplb_communicator"
_EXECUTE = "vllm.distributed.eplb.rebalance_execute"
_CONTROLLER = "vllm.v1.worker.gpu.eplb_utils"
_ROUTER = "vllm.model_executor.layers.fused_moe.router.base_router"
_POLICY = "vllm.distributed.eplb.policy.abstract"
_INTERFACES = "vllm.model_executor.models.interfaces"
_MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"


#: Every upstream signature relied on, by ``module.qualname``.
SIGNATURES: Mapping[str, Signature] = table(
    # torch: the host adaptation's stream and cache functions (replaced without an accelerator).
    Signature(_ACCELERATOR, "set_device_index", ("device", "/"), (HOST_ADAPTATION,)),
    Signature(_ACCELERATOR, "current_stream", ("device=None", "/"), (HOST_ADAPTATION,)),
    Signature(_ACCELERATOR, "set_stream", ("stream",), (HOST_ADAPTATION,)),
    Signature(_ACCELERATOR, "empty_cache", (), (HOST_ADAPTATION,)),
    # Upstream's EPLB state: wrapped (__init__, by the host adaptation), overridden or called (state).
    Signature(_STATE, "EplbState.__init__", ("self", "parallel_config", "device"), (HOST_ADAPTATION, STATE)),
    Signature(_STATE, "EplbState.add_model", ("self", "model", "model_config", "model_name=None"), (STATE,)),
    Signature(
        _STATE,
        "EplbState.rearrange",
        ("self", "is_profile=False", "rank_mapping=None", "use_last_expert_load=False"),
        (STATE,),
    ),
    Signature(
        _STATE, "EplbState.update_mapping", ("self", "model_config", "expanded_physical_to_logical"), (STATE,)
    ),
    Signature(
        _STATE, "EplbState.step", ("self", "is_dummy=False", "is_profile=False", "log_stats=False"), (STATE,)
    ),
    Signature(
        _STATE,
        "EplbState.prepare_forward",
        ("self", "model_config", "num_unpadded_tokens", "ubatch_slices=None"),
        (STATE,),
    ),
    Signature(_STATE, "EplbState._should_record_current_step", ("self", "log_stats=False"), (STATE,)),
    # Upstream's initial placement: control.measures restates it (its body pinned by the tools' row).
    Signature(
        _STATE,
        "EplbState.build_initial_global_physical_to_logical_map",
        ("num_routed_experts", "num_redundant_experts"),
        (MEASURES,),
    ),
    Signature(
        _STATE,
        "EplbLayerState.set_layer_state",
        ("self", "moe_layer_idx", "expert_load_view", "logical_to_physical_map", "logical_replica_count"),
        (STATE,),
    ),
    # The commit path: the two commits (replaced by the hooks), the per-layer order they rely on, and
    # the acknowledgement (bound per instance by the state).
    Signature(
        _STATE,
        "_commit_eplb_maps_for_layer",
        ("model_state", "new_physical_to_logical_map", "layer"),
        (COMMIT_HOOKS,),
    ),
    Signature(
        _STATE,
        "_commit_eplb_maps",
        ("model_state", "new_physical_to_logical_map"),
        (COMMIT_HOOKS, INITIAL_PLACEMENT),
    ),
    # The start-up rearrangement onto an initial placement (called by control.initial_placement).
    Signature(
        "vllm.distributed.eplb.rebalance_execute",
        "rearrange_expert_weights_inplace",
        (
            "old_global_expert_indices",
            "new_global_expert_indices",
            "expert_weights",
            "expert_buffer",
            "ep_group",
            "communicator",
            "is_profile=False",
            "rank_mapping=None",
        ),
        (INITIAL_PLACEMENT,),
    ),
    Signature(_STATE, "_move_to_workspace", ("model_state", "ep_rank"), (COMMIT_HOOKS,)),
    Signature(_UTILS, "CpuGpuEvent.record", ("self", "stream=None"), (COMMIT_HOOKS, STATE)),
    # Upstream's MRv2 controller: overridden or called by AscendEPLBController.
    Signature(_CONTROLLER, "EPLBController.__init__", ("self", "parallel_config", "device"), (CONTROLLER,)),
    Signature(_CONTROLLER, "EPLBController.prepare_load", ("self",), (CONTROLLER,)),
    Signature(
        _CONTROLLER, "EPLBController.maybe_register_model", ("self", "model", "model_config"), (CONTROLLER,)
    ),
    Signature(
        _CONTROLLER,
        "EPLBController.maybe_register_speculator",
        ("self", "speculator", "speculative_config", "load_dummy_weights"),
        (CONTROLLER,),
    ),
    Signature(
        _CONTROLLER,
        "EPLBController.prepare_forward",
        ("self", "model_config", "num_unpadded_tokens", "ubatch_slices=None"),
        (CONTROLLER,),
    ),
    Signature(
        _CONTROLLER, "EPLBController.step", ("self", "is_dummy=False", "is_profile=False"), (CONTROLLER,)
    ),
    Signature(_CONTROLLER, "EPLBController.suppress", ("self",), (CONTROLLER,)),
    # Upstream's rule for a draft beside the target: asked by the controller before it adapts a draft's
    # routers (and by start-up's rule speculative-moe-draft, with the draft's class standing in).
    Signature(
        _CONTROLLER, "draft_model_supports_eplb", ("speculative_config", "draft_moe_model"), (CONTROLLER,)
    ),
    # The router's EPLB mapping (bound per router instance by dataplane's adapter; its own declaration).
    Signature(*UPSTREAM_MAPPING_SIGNATURE, users=(ROUTER,)),
    # Upstream's communicator contract: overridden (and one helper called) by movement's communicator.
    Signature(
        _COMMUNICATOR, "EplbCommunicator.add_send", ("self", "tensors", "dst_rank", "expert_id"), (MOVEMENT,)
    ),
    Signature(
        _COMMUNICATOR, "EplbCommunicator.add_recv", ("self", "tensors", "src_rank", "expert_id"), (MOVEMENT,)
    ),
    Signature(_COMMUNICATOR, "EplbCommunicator.execute", ("self",), (MOVEMENT,)),
    Signature(_COMMUNICATOR, "EplbCommunicator.set_stream", ("self", "stream"), (MOVEMENT,)),
    Signature(
        _COMMUNICATOR,
        "EplbCommunicator.set_transfer_context",
        ("self", "old_indices", "layer_idx"),
        (MOVEMENT,),
    ),
    Signature(_COMMUNICATOR, "EplbCommunicator.needs_profile_buffer_reservation", ("self",), (MOVEMENT,)),
    Signature(_COMMUNICATOR, "EplbCommunicator._log_initialized", ("self",), (MOVEMENT,)),
    # Upstream's policy interface (a classmethod, read bound): overridden by the opt-in policy.
    Signature(
        _POLICY,
        "AbstractEplbPolicy.rebalance_experts",
        ("weight", "num_replicas", "num_groups", "num_nodes", "num_ranks", "old_global_expert_indices=None"),
        (POLICY, GATE, STATE),
    ),
)


#: Every upstream method the process replaces on single instances (the classes keep theirs).
INSTANCE_BINDINGS: tuple[InstanceBinding, ...] = (
    InstanceBinding(
        SIGNATURES[".".join(UPSTREAM_MAPPING_SIGNATURE[:2])],
        "ascend_eplb.dataplane.router",
        "control.router_adaptation.adapt_layer_routers (dataplane.bind_router), on the router of each MoE "
        "layer of a model before it is registered",
    ),
    InstanceBinding(
        SIGNATURES[f"{_UTILS}.CpuGpuEvent.record"],
        "ascend_eplb.control.state",
        "AscendEplbState.after_commit, on the consumed_event of each async layer result it commits",
    ),
)


_ASCEND_CONTROLLER = "ascend_eplb.control.controller.AscendEPLBController"
_ASCEND_STATE = "ascend_eplb.control.state.AscendEplbState"
_ASCEND_LAYER_STATE = "ascend_eplb.control.state.AscendEplbLayerState"
_GLOO = "ascend_eplb.movement.communicator.AscendGlooEplbCommunicator"
_MIGRATION_AWARE = "ascend_eplb.control.policy.MigrationAwarePolicy"
_GATED = "ascend_eplb.control.gate.GatedPolicy"
_KEEP_UNLOADED = "ascend_eplb.control.state.UnloadedModelsKeepPlacement"


def _override(subclass: str, name: str, users: str, how: str) -> Override:
    return Override(subclass, SIGNATURES[name], (users,), how)


#: Every upstream method a subclass of ours overrides (each extends upstream's parameters).
OVERRIDES: tuple[Override, ...] = (
    _override(
        _ASCEND_CONTROLLER,
        f"{_CONTROLLER}.EPLBController.__init__",
        CONTROLLER,
        "upstream's, after the load-collection phase and this table's checks; then the bus",
    ),
    _override(
        _ASCEND_CONTROLLER,
        f"{_CONTROLLER}.EPLBController.prepare_load",
        CONTROLLER,
        "upstream's body (pinned below) building an `AscendEplbState` on the controller's bus",
    ),
    _override(
        _ASCEND_CONTROLLER,
        f"{_CONTROLLER}.EPLBController.maybe_register_speculator",
        CONTROLLER,
        "adapts the draft's routers when upstream registers it (`draft_model_supports_eplb`), then "
        "upstream's, then a `RegistrationEvent`; with EPLB on, an MoE draft upstream does not register is "
        "refused, `ValueError` naming its class",
    ),
    _override(
        _ASCEND_CONTROLLER,
        f"{_CONTROLLER}.EPLBController.maybe_register_model",
        CONTROLLER,
        "adapts the routers, then upstream's, then a `RegistrationEvent`; with EPLB on, a model upstream "
        "does not register (no `MixtureOfExperts` part) is refused, `ValueError` naming its class",
    ),
    _override(
        _ASCEND_CONTROLLER,
        f"{_CONTROLLER}.EPLBController.step",
        CONTROLLER,
        "upstream's, then a `StepEvent` when upstream's ran (its run condition restated: pinned below)",
    ),
    _override(
        _ASCEND_CONTROLLER,
        f"{_CONTROLLER}.EPLBController.suppress",
        CONTROLLER,
        "upstream's; a `stop_eplb` made inside it outlives it",
    ),
    _override(
        _ASCEND_CONTROLLER,
        f"{_CONTROLLER}.EPLBController.prepare_forward",
        CONTROLLER,
        "upstream's, then the row layout and one fill of the record flag (keyword `moe_rows` added)",
    ),
    _override(
        _ASCEND_STATE,
        f"{_STATE}.EplbState.__init__",
        STATE,
        "this table's checks and the commit hooks' presence, then upstream's (keyword `bus` added)",
    ),
    _override(
        _ASCEND_STATE,
        f"{_STATE}.EplbState.add_model",
        STATE,
        "refuses a layer without an `AscendEplbLayerState`, then upstream's, then the commit observer",
    ),
    _override(
        _ASCEND_STATE,
        f"{_STATE}.EplbState.update_mapping",
        STATE,
        "upstream's, then every layer's lookup refreshed",
    ),
    _override(
        _ASCEND_STATE,
        f"{_STATE}.EplbState.rearrange",
        STATE,
        "decides per model whether its window holds load (one collective): none, skipped; a model "
        "without load keeps its placement while the others go through upstream's (each model's load "
        "estimate fed first, when on), then a `RearrangementEvent`",
    ),
    _override(
        _ASCEND_STATE,
        f"{_STATE}.EplbState.step",
        STATE,
        "with the load estimate on, adds the pass upstream's copies into the load window to the new "
        "selections (its condition restated: pinned below), then upstream's",
    ),
    _override(
        _ASCEND_LAYER_STATE,
        f"{_STATE}.EplbLayerState.set_layer_state",
        STATE,
        "builds (first call) or refreshes the replica lookup, validated before anything changes, then "
        "upstream's",
    ),
    _override(
        _GLOO,
        f"{_COMMUNICATOR}.EplbCommunicator.needs_profile_buffer_reservation",
        MOVEMENT,
        "False: Gloo needs no device buffers from the profile run",
    ),
    _override(
        _GLOO,
        f"{_COMMUNICATOR}.EplbCommunicator.set_stream",
        MOVEMENT,
        "the stream the staging copies run on",
    ),
    _override(
        _GLOO,
        f"{_COMMUNICATOR}.EplbCommunicator.set_transfer_context",
        MOVEMENT,
        "remembers the layer (statistics, errors)",
    ),
    _override(
        _GLOO,
        f"{_COMMUNICATOR}.EplbCommunicator.add_send",
        MOVEMENT,
        "queues one expert's rows for a peer (group rank, validated)",
    ),
    _override(
        _GLOO,
        f"{_COMMUNICATOR}.EplbCommunicator.add_recv",
        MOVEMENT,
        "queues one expert's rows from a peer (group rank, validated)",
    ),
    _override(
        _GLOO,
        f"{_COMMUNICATOR}.EplbCommunicator.execute",
        MOVEMENT,
        "the staged, handshaken Gloo transfer of the queue; a failure clears it and names peers and experts",
    ),
    _override(
        _MIGRATION_AWARE,
        f"{_POLICY}.AbstractEplbPolicy.rebalance_experts",
        POLICY,
        "starts from the placement in force and moves the fewest experts for upstream's balancedness "
        "(`notes/placement-cost.md`)",
    ),
    _override(
        _GATED,
        f"{_POLICY}.AbstractEplbPolicy.rebalance_experts",
        GATE,
        "the gain gate around the selected policy: the committed placement unchanged when the window is "
        "balanced enough or the policy's placement gains too little",
    ),
    _override(
        _KEEP_UNLOADED,
        f"{_POLICY}.AbstractEplbPolicy.rebalance_experts",
        STATE,
        "a model whose window holds no load keeps its committed placement; every other window goes to the "
        "selected policy",
    ),
)

_MODEL_STATE = "EplbModelState"
_LAYER_RESULT = "AsyncEplbLayerResult"

#: Every attribute of an upstream object control and the planes below it write, read or add.
ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(
        _ROUTER,
        "BaseRouter",
        "eplb_state",
        "writes",
        (ROUTER_ADAPTATION, ROUTER),
        "each MoE layer's router gets an `AscendEplbLayerState` over upstream's tensors, before its model "
        "is registered",
    ),
    Attribute(
        "vllm.compilation.wrapper",
        "TorchCompileWithNoGuardsWrapper",
        "compiled",
        "reads",
        (ROUTER_ADAPTATION,),
        "a model vLLM has traced already is refused (its trace froze the routers); `aot_compiled_fn`, "
        "which `support_torch_compile` sets on the model class it decorates, too",
    ),
    Attribute(_STATE, "EplbState", "device_index", "writes", (HOST_ADAPTATION,), "0 on a CPU device"),
    Attribute(
        _CONTROLLER,
        "EPLBController",
        "state",
        "writes",
        (CONTROLLER,),
        "`prepare_load`: None, then an `AscendEplbState` when EPLB is on",
    ),
    Attribute(
        _CONTROLLER,
        "EPLBController",
        "_has_registered_models",
        "writes",
        (CONTROLLER,),
        "`prepare_load`: False",
    ),
    Attribute(
        _CONTROLLER,
        "EPLBController",
        "suppressed",
        "writes",
        (CONTROLLER,),
        "`stop_eplb`: True for good (upstream's own switch; `suppress` keeps it after a stop)",
    ),
    Attribute(
        _STATE,
        "EplbState",
        "should_record_tensor",
        "writes",
        (CONTROLLER,),
        "filled in place: once per forward by `prepare_forward`, False by `stop_eplb`",
    ),
    Attribute(
        _STATE,
        _MODEL_STATE,
        "rebalanced",
        "writes",
        (CONTROLLER,),
        "`stop_eplb`: False (the unfinished cycle dropped)",
    ),
    Attribute(
        _STATE,
        _MODEL_STATE,
        "pending_result",
        "writes",
        (CONTROLLER,),
        "`stop_eplb`: None (a staged layer is never moved in)",
    ),
    Attribute(
        _STATE,
        _MODEL_STATE,
        COMMIT_OBSERVER_ATTR,
        "adds",
        (COMMIT_HOOKS,),
        "a weak reference to the model state's commit observer (`attach_observer`)",
    ),
    Attribute(
        _EXECUTE,
        _LAYER_RESULT,
        "consumed_event",
        "reads",
        (STATE,),
        "the acknowledgement of the committed layer (its `record` bound per instance)",
    ),
    # What the start-up install hands upstream's transaction and commit (control.initial_placement).
    *(
        Attribute(_STATE, _MODEL_STATE, attr, "reads", (INITIAL_PLACEMENT,), why)
        for attr, why in (
            ("physical_to_logical_map", "the placement replaced (the transaction's old indices), its shape"),
            ("logical_to_physical_map", "E, its second dimension"),
            ("model", "`expert_weights`: the registered weight views the transaction moves"),
            ("expert_buffer", "upstream's one-layer transfer buffer"),
            ("communicator", "the model's communicator (the Ascend Gloo-staged one)"),
            ("rebalanced", "no install while a cycle is in flight"),
            ("model_name", "names the model in the install's event"),
        )
    ),
    Attribute(
        _STATE, "EplbState", "async_worker", "reads", (INITIAL_PLACEMENT,), "no install once it started"
    ),
    Attribute(_STATE, "EplbState", "model_states", "reads", (INITIAL_PLACEMENT,), "the registered model's"),
    Attribute(
        _STATE,
        "EplbState",
        "policy",
        "writes",
        (STATE,),
        "after each `add_model` (which sets upstream's): the state's gated policy class, unless the "
        "settings are upstream's default policy with the gate off; at each regular `rearrange`: the "
        "selected class, or it wrapped to keep the placement of a model without load when some other "
        "registered model has load",
    ),
    Attribute(
        _INTERFACES,
        "MixtureOfExperts",
        "expert_weights",
        "reads",
        (INITIAL_PLACEMENT,),
        "of the registered model (`model_state.model`): the weight views the transaction moves",
    ),
    # What the state reads of upstream's (its own inherited fields, the model states, the layer states).
    *(
        Attribute(_STATE, "EplbState", attr, "reads", (STATE,), why)
        for attr, why in (
            ("model_states", "the registered models: observer attached, a commit's model, the load"),
            ("device", "where the row-layout tensor lives"),
            ("expert_load_window_size", "named in the log of a skipped rearrangement"),
        )
    ),
    *(
        Attribute(_STATE, _MODEL_STATE, attr, "reads", (STATE,), why)
        for attr, why in (
            ("model_name", "names the model in commit and decision events"),
            ("physical_to_logical_map", "the committed map (commit evidence); valid slots of the load check"),
            (
                "expert_load_window",
                "whether this rank recorded load in the window (the skip); its new passes",
            ),
            ("pending_result", "whether upstream cleared it when the layer was acknowledged (evidence)"),
        )
    ),
    *(
        Attribute(_STATE, "EplbLayerState", attr, "reads", (STATE,), why)
        for attr, why in (
            ("expert_load_view", "`AscendEplbLayerState.from_upstream`: carried over by reference"),
            ("logical_to_physical_map", "the same; the replica lookup is built and refreshed from it"),
            ("logical_replica_count", "the same"),
            ("should_record_tensor", "carried over by reference"),
            ("num_unpadded_tokens_tensors", "carried over by reference"),
        )
    ),
    Attribute(_EXECUTE, _LAYER_RESULT, "layer_idx", "reads", (STATE,), "the layer an acknowledgement is of"),
    # What each closed window's figures and outcome read (control.outcome, called by the state).
    *(
        Attribute(_STATE, _MODEL_STATE, attr, "reads", (OUTCOME,), why)
        for attr, why in (
            ("last_expert_load", "the window a rearrangement planned from"),
            ("physical_to_logical_map", "the placement in force when it closed, and after its last layer"),
            ("eplb_stats", "the grouping upstream passed its policy (`num_expert_groups`, `num_nodes`)"),
            ("model_name", "names the model of each window and outcome"),
        )
    ),
    Attribute(_STATE, "EplbStats", "num_groups", "reads", (OUTCOME,), "a window's num_expert_groups"),
    Attribute(_STATE, "EplbStats", "num_nodes", "reads", (OUTCOME,), "a window's num_nodes"),
    Attribute(_STATE, _MODEL_STATE, "pending_result", "reads", (COMMIT_HOOKS,), "the result acknowledged"),
    Attribute(_STATE, "EplbState", "model_states", "reads", (CONTROLLER,), "`stop_eplb`: each model's cycle"),
    Attribute(
        _CONTROLLER, "EPLBController", "parallel_config", "reads", (CONTROLLER,), "EPLB on or off, rows"
    ),
    Attribute(_CONTROLLER, "EPLBController", "device", "reads", (CONTROLLER,), "the state's device"),
    # The configuration's row layout (control.controller.row_layout_for): vLLM's own dispatch decision.
    Attribute(_STATE, _MODEL_STATE, "model", "reads", (CONTROLLER,), "its MoE layers' runners"),
    Attribute(_INTERFACES, "MixtureOfExperts", "moe_layers", "reads", (CONTROLLER,), "each layer's runner"),
    Attribute(
        _MOE_RUNNER,
        "MoERunner",
        "do_naive_dispatch_combine",
        "reads",
        (CONTROLLER,),
        "rows gathered before routing, or routed first (an expert method with an internal modular kernel)",
    ),
)

#: Every upstream function whose body our code depends on, pinned by
#: :func:`~ascend_eplb.control.patching.source_digest`.
BODIES: tuple[Body, ...] = (
    Body(
        SIGNATURES[f"{_CONTROLLER}.EPLBController.prepare_load"],
        "fb6cd33474d1d15f",
        (CONTROLLER,),
        "AscendEPLBController.prepare_load copies it, building an AscendEplbState",
    ),
    Body(
        SIGNATURES[f"{_CONTROLLER}.EPLBController.step"],
        "37b8a37ca00d9a08",
        (CONTROLLER,),
        "AscendEPLBController.step restates its run condition (a StepEvent exactly when it ran)",
    ),
    Body(
        SIGNATURES[f"{_CONTROLLER}.EPLBController.suppress"],
        "6227688ee34a8821",
        (CONTROLLER,),
        "AscendEPLBController.suppress and stop_eplb rely on it saving and restoring suppressed and "
        "should_record_tensor",
    ),
    Body(
        SIGNATURES[f"{_STATE}.EplbState.step"],
        "185d58bef449a848",
        (STATE,),
        "AscendEplbState.step restates when it copies a pass into the load window (not a dummy or profile "
        "step, `_should_record_current_step`), before its commits change the placement",
    ),
    Body(
        SIGNATURES[f"{_STATE}._move_to_workspace"],
        "303b2c6ca50e734e",
        (COMMIT_HOOKS,),
        "the per-layer order move, commit, refresh, acknowledge (invariant 6): the commit hook runs "
        "inside it after move_from_buffer, before pending_result is cleared and consumed_event.record() "
        "releases the staging buffer",
    ),
)

#: The serving product's surface: its rows, checked (``SURFACE.check(user, ...)``), replaced
#: (``SURFACE.replaces``) and rendered.
SURFACE = Surface(
    __name__,
    "the upstream table",
    USERS,
    SIGNATURES,
    instance_bindings=INSTANCE_BINDINGS,
    overrides=OVERRIDES,
    attributes=ATTRIBUTES,
    bodies=BODIES,
)
