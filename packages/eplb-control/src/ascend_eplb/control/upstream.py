"""The one table of upstream signatures ascend_eplb relies on (vLLM 0.33.0, torch 2.13.0).

Every upstream callable that a patch replaces, that an instance binding replaces, that a subclass of
this package overrides or calls, or whose call order a hook relies on, is listed here once, with its
parameters in the supported version and the modules that rely on it (``users``). Each user checks its
entries with :func:`check_used_by` (the controller and the state when they are constructed, the commit
hooks before they are installed); the patch specs take their parameters from here
(:meth:`~ascend_eplb.control.patching.Patch.on`). Dataplane's router adapter cannot import this package,
so the signature of the method it binds is its own export (``UPSTREAM_MAPPING_SIGNATURE``), listed here
by reference.

What replaces each binding is listed by the registry of the process, ``ascend_eplb.integration.patches``
(``PATCHES``: module-level; ``INSTANCE_BINDINGS``: per instance); its ``check_upstream()`` checks this
whole table. Nothing here imports vLLM: an entry is resolved when it is checked.
"""

from __future__ import annotations

from collections.abc import Mapping

from ascend_eplb.control.patching import Signature, check_signatures
from ascend_eplb.dataplane.router import UPSTREAM_MAPPING_SIGNATURE

__all__ = ["SIGNATURES", "USERS", "check_used_by", "signature", "used_by"]

# The users (modules of ascend_eplb that rely on an entry).
HOST_ADAPTATION = "control.host_adaptation"
COMMIT_HOOKS = "control.commit_hooks"
CONTROLLER = "control.controller"
STATE = "control.state"
ROUTER = "dataplane.router"
INTEGRATION = "integration.patches"
WATCHDOG = "integration.watchdog"
#: Every user id an entry may name (what :func:`used_by` and :func:`check_used_by` accept).
USERS = (HOST_ADAPTATION, COMMIT_HOOKS, CONTROLLER, STATE, ROUTER, INTEGRATION, WATCHDOG)

_ACCELERATOR = "torch.accelerator"
_PARALLEL = "vllm.config.parallel"
_STATE = "vllm.distributed.eplb.eplb_state"
_UTILS = "vllm.distributed.eplb.eplb_utils"
_WORKER = "vllm.distributed.eplb.async_worker"
_CONTROLLER = "vllm.v1.worker.gpu.eplb_utils"
_RUNNER = "vllm.v1.worker.gpu.model_runner"
_FACTORY = ("group_coordinator", "backend", "expert_weights", "expert_buffer")


def _table(*entries: Signature) -> Mapping[str, Signature]:
    table: dict[str, Signature] = {}
    for entry in entries:
        if entry.name in table:
            raise ValueError(f"upstream signature {entry.name} is listed twice")
        table[entry.name] = entry
    return table


#: Every upstream signature relied on, by ``module.qualname``.
SIGNATURES: Mapping[str, Signature] = _table(
    # torch: the host adaptation's stream and cache functions (replaced without an accelerator).
    Signature(_ACCELERATOR, "set_device_index", ("device",), (HOST_ADAPTATION,)),
    Signature(_ACCELERATOR, "current_stream", ("device",), (HOST_ADAPTATION,)),
    Signature(_ACCELERATOR, "set_stream", ("stream",), (HOST_ADAPTATION,)),
    Signature(_ACCELERATOR, "empty_cache", (), (HOST_ADAPTATION,)),
    # vLLM's parallel config and communicator factory (replaced by the integration).
    Signature(_PARALLEL, "ParallelConfig.__post_init__", ("self",), (INTEGRATION,)),
    Signature(
        "vllm.distributed.eplb.eplb_communicator", "create_eplb_communicator", _FACTORY, (INTEGRATION,)
    ),
    Signature(_STATE, "create_eplb_communicator", _FACTORY, (INTEGRATION,)),
    # Upstream's EPLB state: wrapped (__init__, by the host adaptation), overridden or called (state).
    Signature(_STATE, "EplbState.__init__", ("self", "parallel_config", "device"), (HOST_ADAPTATION, STATE)),
    Signature(_STATE, "EplbState.add_model", ("self", "model", "model_config", "model_name"), (STATE,)),
    Signature(
        _STATE,
        "EplbState.rearrange",
        ("self", "is_profile", "rank_mapping", "use_last_expert_load"),
        (STATE,),
    ),
    Signature(
        _STATE, "EplbState.update_mapping", ("self", "model_config", "expanded_physical_to_logical"), (STATE,)
    ),
    Signature(_STATE, "EplbState.step", ("self", "is_dummy", "is_profile", "log_stats"), (STATE,)),
    Signature(
        _STATE,
        "EplbState.prepare_forward",
        ("self", "model_config", "num_unpadded_tokens", "ubatch_slices"),
        (STATE,),
    ),
    Signature(_STATE, "EplbState._should_record_current_step", ("self", "log_stats"), (STATE,)),
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
    Signature(_STATE, "_commit_eplb_maps", ("model_state", "new_physical_to_logical_map"), (COMMIT_HOOKS,)),
    Signature(_STATE, "_move_to_workspace", ("model_state", "ep_rank"), (COMMIT_HOOKS,)),
    Signature(_UTILS, "CpuGpuEvent.record", ("self", "stream"), (COMMIT_HOOKS, STATE)),
    # The async worker's loop (wrapped by the watchdog).
    Signature(_WORKER, "transfer_run_periodically", ("state", "stream", "is_profile"), (WATCHDOG,)),
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
        ("self", "model_config", "num_unpadded_tokens", "ubatch_slices"),
        (CONTROLLER,),
    ),
    Signature(_CONTROLLER, "EPLBController.step", ("self", "is_dummy", "is_profile"), (CONTROLLER,)),
    Signature(_CONTROLLER, "EPLBController.suppress", ("self",), (CONTROLLER,)),
    # The MRv2 runner's controller construction and shutdown (replaced by the integration).
    Signature(_RUNNER, "EPLBController", ("self", "parallel_config", "device"), (INTEGRATION,)),
    Signature(_RUNNER, "GPUModelRunner.shutdown", ("self",), (INTEGRATION,)),
    # The router's EPLB mapping (bound per router instance by dataplane's adapter; its own declaration).
    Signature(*UPSTREAM_MAPPING_SIGNATURE, users=(ROUTER,)),
)


def signature(name: str) -> Signature:
    """The entry ``module.qualname`` of :data:`SIGNATURES`.

    Raises:
        KeyError: ``name`` is not in the table (the message says where to add it).
    """
    try:
        return SIGNATURES[name]
    except KeyError:
        raise KeyError(f"{name} is not in ascend_eplb.control.upstream.SIGNATURES; list it there") from None


def _known(users: tuple[object, ...]) -> set[str]:
    unknown = [u for u in users if u not in USERS]
    if unknown:
        raise ValueError(f"unknown user(s) {unknown!r} of the upstream table; the users are {USERS!r}")
    return set(users)  # type: ignore[arg-type]


def used_by(user: str) -> tuple[Signature, ...]:
    """The entries ``user`` relies on, in table order.

    Raises:
        ValueError: ``user`` is not one of :data:`USERS` (a typo would otherwise select nothing).
    """
    _known((user,))
    return tuple(entry for entry in SIGNATURES.values() if user in entry.users)


def check_used_by(*users: str) -> None:
    """Check every entry the ``users`` rely on, in table order.

    Raises:
        ValueError: a user is not one of :data:`USERS` (a typo would otherwise check nothing).
        RuntimeError: one is missing or changed signature since vLLM 0.33.0; the message names it.
    """
    wanted = _known(users)
    check_signatures(entry for entry in SIGNATURES.values() if set(entry.users) & wanted)
