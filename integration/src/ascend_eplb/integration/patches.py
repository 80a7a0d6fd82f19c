"""The one registry of patches of upstream vLLM 0.33.0 and torch (:func:`apply_patches`).

Each patch replaces one binding that vLLM does not expose as an extension point and calls the plane
that owns the behaviour; nothing here re-implements EPLB state, policy, routing or movement. The
planes declare their patches as :class:`~ascend_eplb.control.patching.Patch` specs; this module owns the
single :class:`~ascend_eplb.control.patching.PatchSet` of the process, which checks every signature
before the first change (``RuntimeError`` naming the drifted binding; nothing half-applied).

========================================================  ==============================================
binding (vLLM 0.33.0 / torch 2.13.0)                      replacement (owner)
========================================================  ==============================================
``vllm.config.parallel.current_platform``                 EPLB-capable view of the platform, where it is
                                                          not CUDA-alike (control.host_adaptation)
``torch.Event``, ``torch.accelerator.set_device_index``,  host events and streams, only without an
``current_stream``, ``set_stream``,                       accelerator (control.host_adaptation)
``EplbState.__init__``
``ParallelConfig.__post_init__``                          communicator unset -> ``"torch_gloo"`` before
                                                          upstream probes NIXL/XCCL (integration)
``eplb_communicator.create_eplb_communicator``            ``"torch_gloo"`` -> movement's
``eplb_state.create_eplb_communicator``                   ``AscendGlooEplbCommunicator(cpu_group)``
                                                          (integration)
``eplb_state._commit_eplb_maps_for_layer``,               per-layer commit hooks: move, commit, refresh,
``eplb_state._commit_eplb_maps``                          acknowledge (control.commit_hooks)
``async_worker.transfer_run_periodically``                records the worker's exception before the
                                                          thread ends (integration.watchdog)
========================================================  ==============================================

Control's ``AscendEPLBController`` builds the Ascend state and adapts the routers itself (a subclass,
not a patch); a runner gets it from :func:`ascend_eplb.integration.runner.create_eplb_controller`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ascend_eplb.control import commit_hooks, host_adaptation
from ascend_eplb.control.patching import Patch, PatchSet
from ascend_eplb.integration import watchdog

__all__ = ["PATCHES", "applied_bindings", "apply_patches", "patches_applied", "remove_patches"]

_OWNER = "ascend_eplb.integration.patches"
_FACTORY_PARAMS = ("group_coordinator", "backend", "expert_weights", "expert_buffer")


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


#: Every patch of the process, in installation order.
PATCHES: tuple[Patch, ...] = (
    *host_adaptation.PATCHES,
    Patch("vllm.config.parallel", "ParallelConfig.__post_init__", ("self",), _wrap_post_init, _OWNER),
    Patch(
        "vllm.distributed.eplb.eplb_communicator",
        "create_eplb_communicator",
        _FACTORY_PARAMS,
        _wrap_factory,
        _OWNER,
    ),
    Patch(
        "vllm.distributed.eplb.eplb_state", "create_eplb_communicator", _FACTORY_PARAMS, _wrap_factory, _OWNER
    ),
    *commit_hooks.PATCHES,
    *watchdog.PATCHES,
)

_REGISTRY = PatchSet(PATCHES)


def apply_patches() -> bool:
    """Install every applicable patch of :data:`PATCHES`; idempotent.

    Returns:
        True if this call installed them, False if they were installed already.

    Raises:
        RuntimeError: a binding drifted from vLLM 0.33.0 / torch 2.13.0; the message names it. Every
            check runs before the first change, so nothing is half-applied.
    """
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
