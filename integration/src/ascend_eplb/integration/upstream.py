"""The integration's upstream surface: what the serving package's own modules (its patches, the
watchdog, the event file, the verifier, the start-up placement, the metrics) rely on of vLLM 0.33.0,
declared once in :data:`SURFACE` (:class:`~ascend_eplb.control.surface.Surface`).

:data:`SIGNATURES` (the targets of this package's patches, each declared on its factory with
``SURFACE.replaces``) and :data:`ATTRIBUTES` (what those modules write, read or add). Integration's
``check_upstream()`` checks them with control's rows; ``integration.surface`` renders both in
``integration/UPSTREAM.md``. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

from ascend_eplb.control.patching import Attribute, Signature
from ascend_eplb.control.surface import Surface, table

__all__ = ["ATTRIBUTES", "SIGNATURES", "SURFACE", "USERS", "WORKER_ERROR_ATTR"]

# The users (modules of this package that rely on a row).
INTEGRATION = "integration.patches"
WATCHDOG = "integration.watchdog"
EVENTS = "integration.events"
VERIFY = "integration.verify"
STARTUP_PLACEMENT = "integration.startup_placement"
PROMETHEUS = "integration.prometheus"
METRICS = "integration.metrics"
#: Every user id a row of this surface names.
USERS = (INTEGRATION, WATCHDOG, EVENTS, VERIFY, STARTUP_PLACEMENT, PROMETHEUS, METRICS)

#: The attribute the watchdog's wrapper of upstream's worker loop sets on an upstream ``EplbState``: the
#: dead worker's exception and traceback.
WORKER_ERROR_ATTR = "_ascend_eplb_worker_error"

_PARALLEL = "vllm.config.parallel"
_STATE = "vllm.distributed.eplb.eplb_state"
_WORKER = "vllm.distributed.eplb.async_worker"
_COMMUNICATOR = "vllm.distributed.eplb.eplb_communicator"
_EXECUTE = "vllm.distributed.eplb.rebalance_execute"
_CONTROLLER = "vllm.v1.worker.gpu.eplb_utils"
_RUNNER = "vllm.v1.worker.gpu.model_runner"
_INTERFACES = "vllm.model_executor.models.interfaces"
_DEEPSEEK_MTP = "vllm.model_executor.models.deepseek_mtp"
_FACTORY = ("group_coordinator", "backend", "expert_weights", "expert_buffer")
_MODEL_STATE = "EplbModelState"
_LAYER_RESULT = "AsyncEplbLayerResult"

#: Every upstream signature the integration relies on, by ``module.qualname``.
SIGNATURES: Mapping[str, Signature] = table(
    # vLLM's parallel config and communicator factory (replaced by the integration).
    Signature(_PARALLEL, "ParallelConfig.__post_init__", ("self",), (INTEGRATION,)),
    Signature(_COMMUNICATOR, "create_eplb_communicator", _FACTORY, (INTEGRATION,)),
    Signature(_STATE, "create_eplb_communicator", _FACTORY, (INTEGRATION,)),
    # The async worker's loop (wrapped by the watchdog).
    Signature(_WORKER, "transfer_run_periodically", ("state", "stream", "is_profile=False"), (WATCHDOG,)),
    # The MRv2 runner's controller construction and shutdown (replaced by the integration).
    Signature(_RUNNER, "EPLBController", ("self", "parallel_config", "device"), (INTEGRATION,)),
    Signature(_RUNNER, "GPUModelRunner.shutdown", ("self",), (INTEGRATION,)),
    # The MRv2 runner's input preparation, where it knows its batch's phase (replaced by the integration).
    Signature(
        _RUNNER,
        "GPUModelRunner.prepare_inputs",
        ("self", "scheduler_output", "batch_req_state", "batch_desc", "num_active_loras"),
        (INTEGRATION,),
    ),
    # DeepSeek-V3's MTP draft's expert-weight mapping (vLLM's deepseek_mtp module calls it by name from its
    # load_weights without num_redundant_experts: replaced there by the integration).
    Signature(
        _DEEPSEEK_MTP,
        "fused_moe_make_expert_params_mapping",
        (
            "model",
            "ckpt_gate_proj_name",
            "ckpt_down_proj_name",
            "ckpt_up_proj_name",
            "num_experts",
            "num_redundant_experts=0",
            "routed_experts_prefix='routed_experts'",
        ),
        (INTEGRATION,),
    ),
)

#: Every attribute of an upstream object the integration's modules write, read or add.
ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(
        _PARALLEL,
        "EPLBConfig",
        "communicator",
        "writes",
        (INTEGRATION,),
        '`"torch_gloo"` when unset and EPLB is on (`ParallelConfig.__post_init__`)',
    ),
    Attribute(
        _STATE,
        "EplbState",
        WORKER_ERROR_ATTR,
        "adds",
        (WATCHDOG,),
        "the dead async worker's exception and traceback",
    ),
    Attribute(_STATE, "EplbState", "async_worker", "reads", (WATCHDOG,), "`is_alive()` every step"),
    Attribute(_STATE, "EplbState", "model_states", "reads", (WATCHDOG,), "each model's cycle"),
    Attribute(
        _STATE,
        "EplbState",
        "expert_rearrangement_step",
        "reads",
        (WATCHDOG,),
        "steps until the next rearrangement, named in a stall (vllm-project/vllm#57883)",
    ),
    Attribute(
        _STATE,
        "EplbState",
        "expert_rearrangement_step_interval",
        "reads",
        (WATCHDOG,),
        "the same",
    ),
    Attribute(_STATE, _MODEL_STATE, "model_name", "reads", (WATCHDOG,), "names the model in a failure"),
    Attribute(_STATE, _MODEL_STATE, "rebalanced", "reads", (WATCHDOG,), "whether a cycle is in flight"),
    Attribute(
        _STATE,
        _MODEL_STATE,
        "pending_result",
        "reads",
        (WATCHDOG,),
        "whether this rank's worker published the layer in flight",
    ),
    Attribute(_EXECUTE, _LAYER_RESULT, "layer_idx", "reads", (WATCHDOG,), "the layer published"),
    Attribute(
        _STATE,
        _MODEL_STATE,
        "communicator",
        "reads",
        (WATCHDOG,),
        "movement's `waiting_on`: the peer a stalled transfer waits on",
    ),
    # The integration's runner patches: the runner's controller, and the batch's phase its input preparation
    # computed.
    Attribute(
        _RUNNER,
        "GPUModelRunner",
        "eplb",
        "reads",
        (INTEGRATION,),
        "the runner's EPLB controller: `set_batch_phase` before `prepare_inputs`, `shutdown()` at its end",
    ),
    Attribute(
        _RUNNER,
        "BatchReqState",
        "has_prefill",
        "reads",
        (INTEGRATION,),
        "the batch's phase (any request still in prefill), declared to the controller",
    ),
    # The serving process's event file, verifier, start-up placement, Prometheus metrics and metrics.
    Attribute(
        _CONTROLLER,
        "EPLBController",
        "state",
        "reads",
        (EVENTS, VERIFY, STARTUP_PLACEMENT, PROMETHEUS),
        "the EPLB state of the controller an event comes from",
    ),
    Attribute(
        _STATE,
        "EplbState",
        "model_states",
        "reads",
        (EVENTS, VERIFY, STARTUP_PLACEMENT, PROMETHEUS),
        "the registered models' states",
    ),
    *(
        Attribute(_STATE, _MODEL_STATE, attr, "reads", (EVENTS,), why)
        for attr, why in (
            ("physical_to_logical_map", "each commit's row; L at the start-up install"),
            ("logical_to_physical_map", "E, its second dimension (the installed start-up placement)"),
            ("communicator", "movement's `cumulative_stats`: the bytes a cycle received"),
            ("model", "`expert_weights`: the bytes of an expert"),
            ("pending_result", "the layer the async worker published (its time)"),
            ("model_name", "names the model in every record"),
        )
    ),
    Attribute(_EXECUTE, _LAYER_RESULT, "layer_idx", "reads", (EVENTS,), "the layer published"),
    Attribute(_INTERFACES, "MixtureOfExperts", "expert_weights", "reads", (EVENTS,), "expert bytes"),
    *(
        Attribute(_STATE, _MODEL_STATE, attr, "reads", (VERIFY,), why)
        for attr, why in (
            ("physical_to_logical_map", "the committed placement each slot's fingerprint must match"),
            ("logical_to_physical_map", "the committed maps each replica lookup must equal"),
            ("logical_replica_count", "the same"),
            ("model_name", "names the model in a violation"),
        )
    ),
    Attribute(
        _INTERFACES, "MixtureOfExperts", "moe_layers", "reads", (VERIFY,), "the MoE layers fingerprinted"
    ),
    *(
        Attribute(_STATE, _MODEL_STATE, attr, "reads", (STARTUP_PLACEMENT,), why)
        for attr, why in (
            ("physical_to_logical_map", "L and P the placement file must match; the placement installed"),
            ("logical_to_physical_map", "E, its second dimension"),
            ("communicator", "movement's `cumulative_stats`: the bytes the install received (its log line)"),
        )
    ),
    Attribute(
        _STATE,
        _MODEL_STATE,
        "model_name",
        "reads",
        (PROMETHEUS,),
        "whose series a record is (a draft's: suffixed)",
    ),
    Attribute(
        "vllm.config.model",
        "ModelConfig",
        "served_model_name",
        "reads",
        (PROMETHEUS,),
        "the `model_name` label (vLLM's own series carry it)",
    ),
    Attribute(
        _STATE,
        _MODEL_STATE,
        "communicator",
        "reads",
        (METRICS,),
        "`bytes_received`: movement's `cumulative_stats`",
    ),
)

#: The integration's surface: its rows, replaced (``SURFACE.replaces``) and checked with control's
#: (``patches.check_upstream``).
SURFACE = Surface(__name__, "the integration's upstream table", USERS, SIGNATURES, attributes=ATTRIBUTES)
