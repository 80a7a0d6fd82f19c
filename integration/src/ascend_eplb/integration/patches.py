"""Where upstream is touched: the one registry of every binding of upstream vLLM 0.33.0 and torch the
process replaces, and the one check of the signatures it relies on (:func:`check_upstream`).

Each replacement rebinds one binding that vLLM does not expose as an extension point and calls the
plane that owns the behaviour; nothing here re-implements EPLB state, policy, routing or movement. Two
kinds, both listed here and nowhere else:

* :data:`PATCHES`: module-level bindings (module globals, class attributes, torch functions), as
  :class:`~ascend_eplb.control.patching.Patch` specs declared by their owners and collected here. This
  module owns the single :class:`~ascend_eplb.control.patching.PatchSet` of the process
  (:func:`apply_patches`), which checks every signature before the first change (``RuntimeError``
  naming the drifted binding; nothing half-applied).
* :data:`INSTANCE_BINDINGS`: upstream methods replaced on single instances
  (:class:`~ascend_eplb.control.patching.InstanceBinding`); the class keeps its method. Their owners
  bind them while serving (at model registration, at each async commit).

Every upstream signature relied on (patched, bound per instance, overridden by control's subclasses, or
whose call order a hook relies on) is listed once, in the one table
:data:`ascend_eplb.control.upstream.SIGNATURES` (in control, whose constructors check their entries;
control cannot import this package). :func:`check_upstream`, run first by :func:`apply_patches`, checks
the whole table with the one checker, :func:`~ascend_eplb.control.patching.check_signature`.

============================================================  ==========================================
binding (vLLM 0.33.0 / torch 2.13.0)                          replacement (owner)
============================================================  ==========================================
module-level (:data:`PATCHES`)
``vllm.config.parallel.current_platform``                     EPLB-capable view of the platform, where it
                                                              is not CUDA-alike (control.host_adaptation)
``torch.Event``, ``torch.accelerator.set_device_index``,      host events, streams and cache release,
``current_stream``, ``set_stream``, ``empty_cache``,          only without an accelerator
``EplbState.__init__``                                        (control.host_adaptation)
``ParallelConfig.__post_init__``                              communicator unset -> ``"torch_gloo"``
                                                              before upstream probes NIXL/XCCL
                                                              (integration)
``eplb_communicator.create_eplb_communicator``                ``"torch_gloo"`` -> movement's
``eplb_state.create_eplb_communicator``                       ``AscendGlooEplbCommunicator(cpu_group)``
                                                              (integration)
``eplb_state._commit_eplb_maps_for_layer``,                   per-layer commit hooks: move, commit,
``eplb_state._commit_eplb_maps``                              refresh, acknowledge (control.commit_hooks)
``async_worker.transfer_run_periodically``                    records the worker's exception before the
                                                              thread ends (integration.watchdog)
``vllm.v1.worker.gpu.model_runner.EPLBController``            EPLB on: ``create_eplb_controller(current
                                                              vllm config, device)``; off: upstream's
``GPUModelRunner.shutdown`` (same module)                     the controller's ``shutdown()`` first, when
                                                              it has one (the watchdog's end of life),
                                                              then upstream's (integration)
per instance (:data:`INSTANCE_BINDINGS`)
``BaseRouter._apply_eplb_mapping`` of each MoE layer's        dataplane's map-and-record op through the
router, bound before its model is registered                  layer's replica lookup (dataplane.router,
                                                              bound by control.router_adaptation)
``CpuGpuEvent.record`` of the ``consumed_event`` of each      upstream's record, then the
async layer result committed                                  ``acknowledge`` event (control.state)
============================================================  ==========================================

Control's ``AscendEPLBController`` builds the Ascend state and adapts the routers itself (a subclass,
not a patch); a runner gets it from :func:`ascend_eplb.integration.runner.create_eplb_controller`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ascend_eplb.control import commit_hooks, host_adaptation, upstream
from ascend_eplb.control.patching import InstanceBinding, Patch, PatchSet, check_signatures
from ascend_eplb.control.state import ACKNOWLEDGEMENT_BINDING
from ascend_eplb.dataplane.router import UPSTREAM_MAPPING_SIGNATURE
from ascend_eplb.integration import watchdog

__all__ = [
    "INSTANCE_BINDINGS",
    "PATCHES",
    "applied_bindings",
    "apply_patches",
    "check_upstream",
    "patches_applied",
    "remove_patches",
]

_OWNER = "ascend_eplb.integration.patches"


def _wrap_post_init(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def __post_init__(self: Any) -> None:  # noqa: N807 (the name upstream calls)
        if self.enable_eplb and self.eplb_config.communicator is None:
            self.eplb_config.communicator = "torch_gloo"
        original(self)

    return __post_init__


def _wrap_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_eplb_communicator(
        group_coordinator: Any, backend: str, expert_weights: Any, expert_buffer: Any
    ) -> Any:
        if backend == "torch_gloo":
            from ascend_eplb.movement import AscendGlooEplbCommunicator

            return AscendGlooEplbCommunicator(group_coordinator.cpu_group)
        return original(group_coordinator, backend, expert_weights, expert_buffer)

    return create_eplb_communicator


def _wrap_runner_controller(original: type) -> Callable[[Any, Any], Any]:
    def EPLBController(parallel_config: Any, device: Any) -> Any:  # noqa: N802 (the name upstream calls)
        """Upstream ``GPUModelRunner.__init__``'s ``EPLBController(self.parallel_config, self.device)``:
        with EPLB on, the controller :func:`~ascend_eplb.integration.runner.create_eplb_controller`
        builds from the current vLLM config (set by vLLM's worker around ``init_device``, where the
        runner is constructed): the same :mod:`~ascend_eplb.integration.serving` read and build,
        without applying the patches again (this wrapper is one of them); with EPLB off, upstream's
        class itself."""
        if not parallel_config.enable_eplb:
            return original(parallel_config, device)
        from vllm.config import get_current_vllm_config_or_none

        from ascend_eplb.integration.serving import build_serving_controller, read_serving_setup

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None or vllm_config.parallel_config is not parallel_config:
            raise RuntimeError(
                "Ascend EPLB: the Model Runner V2 controller was built outside vLLM's "
                "set_current_vllm_config() of this runner's config, so its Ascend settings cannot be "
                "read; construct the runner inside set_current_vllm_config(vllm_config) or call "
                "ascend_eplb.integration.runner.create_eplb_controller(vllm_config, device)"
            )
        return build_serving_controller(parallel_config, device, read_serving_setup(vllm_config))

    EPLBController.__wrapped__ = original  # type: ignore[attr-defined]  (signature check, removal)
    return EPLBController


def _wrap_runner_shutdown(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def shutdown(self: Any) -> None:
        """Upstream ``GPUModelRunner.shutdown``, after the EPLB controller's end of life (Ascend's
        ``AscendEPLBController.shutdown``: a cycle in flight is logged; upstream's controller has none)."""
        controller = getattr(self, "eplb", None)
        try:
            if controller is not None and hasattr(controller, "shutdown"):
                controller.shutdown()
        finally:
            original(self)

    return shutdown


#: Every patch of the process, in installation order.
PATCHES: tuple[Patch, ...] = (
    *host_adaptation.PATCHES,
    Patch.on(
        upstream.signature("vllm.config.parallel.ParallelConfig.__post_init__"), _wrap_post_init, _OWNER
    ),
    Patch.on(
        upstream.signature("vllm.distributed.eplb.eplb_communicator.create_eplb_communicator"),
        _wrap_factory,
        _OWNER,
    ),
    Patch.on(
        upstream.signature("vllm.distributed.eplb.eplb_state.create_eplb_communicator"), _wrap_factory, _OWNER
    ),
    *commit_hooks.PATCHES,
    *watchdog.PATCHES,
    # The controller of upstream's MRv2 runner (imported there by name from eplb_utils): the plugin
    # alone then serves a runner that keeps upstream's construction.
    Patch.on(
        upstream.signature("vllm.v1.worker.gpu.model_runner.EPLBController"), _wrap_runner_controller, _OWNER
    ),
    Patch.on(
        upstream.signature("vllm.v1.worker.gpu.model_runner.GPUModelRunner.shutdown"),
        _wrap_runner_shutdown,
        _OWNER,
    ),
)

#: Every upstream method the process replaces on single instances (the classes keep theirs).
INSTANCE_BINDINGS: tuple[InstanceBinding, ...] = (
    InstanceBinding(
        upstream.signature(".".join(UPSTREAM_MAPPING_SIGNATURE[:2])),
        "ascend_eplb.dataplane.router",
        "control.router_adaptation.adapt_layer_routers (dataplane.bind_router), on the router of each MoE "
        "layer of a model before it is registered",
    ),
    ACKNOWLEDGEMENT_BINDING,
)

_REGISTRY = PatchSet(PATCHES)


def check_upstream() -> None:
    """Check every upstream signature the process relies on: each entry of the one table,
    :data:`ascend_eplb.control.upstream.SIGNATURES` (the targets of :data:`PATCHES` and of
    :data:`INSTANCE_BINDINGS` included), except a patch target whose patch does not apply in this
    process (the host adaptation's, where an accelerator is present) and that nothing else relies on
    (``EplbState.__init__`` is still checked there: the state subclasses it). Wrappers installed by
    :func:`apply_patches` are checked as the functions they wrap.

    Raises:
        RuntimeError: an entry is missing or its parameters differ from vLLM 0.33.0 / torch 2.13.0;
            the message names it and both parameter lists.
    """
    # Whose reliance a patch that does not apply here takes away: its owner's (as a user id of the table).
    not_applied = {
        patch.name: patch.owner.removeprefix("ascend_eplb.") for patch in PATCHES if not patch.when()
    }
    check_signatures(
        entry
        for entry in upstream.SIGNATURES.values()
        if entry.name not in not_applied or not set(entry.users) <= {not_applied[entry.name]}
    )


def apply_patches() -> bool:
    """Install every applicable patch of :data:`PATCHES`, after :func:`check_upstream`; idempotent.

    Returns:
        True if this call installed them, False if they were installed already.

    Raises:
        RuntimeError: a binding drifted from vLLM 0.33.0 / torch 2.13.0; the message names it. Every
            check runs before the first change, so nothing is half-applied.
    """
    check_upstream()
    return _REGISTRY.apply()


def remove_patches() -> bool:
    """Restore every original :func:`apply_patches` replaced; idempotent. True if something changed."""
    return _REGISTRY.remove()


def patches_applied() -> bool:
    """Whether :func:`apply_patches` is in effect in this process."""
    return _REGISTRY.installed


def applied_bindings() -> list[str]:
    """The bindings replaced now, in installation order (for logs and tests)."""
    return _REGISTRY.applied_names()
