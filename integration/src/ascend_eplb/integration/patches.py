"""The narrow, idempotent, signature-checked patches of upstream vLLM 0.33.0 (the entry adapter).

Each patch replaces one upstream binding that vLLM does not expose as an extension point, and calls the
plane that owns the behaviour; nothing here re-implements EPLB state, policy, routing or movement.

==================================================  =============================================
upstream binding (vLLM 0.33.0)                      replacement
==================================================  =============================================
(control) host adaptation, no accelerator only      ``ascend_eplb.control.host_adaptation.install``
``vllm.config.parallel.current_platform``           EPLB-capable view (accelerator hosts; on a host
                                                    without one the control adaptation does it)
``ParallelConfig.__post_init__``                    communicator unset -> ``"torch_gloo"`` before
                                                    upstream probes NIXL/XCCL
``eplb_communicator.create_eplb_communicator``      ``"torch_gloo"`` -> movement's
``eplb_state.create_eplb_communicator``             ``AscendGlooEplbCommunicator(cpu_group)``
``vllm.v1.worker.gpu.eplb_utils.EplbState``         control's ``AscendEplbState`` (state
                                                    construction by ``EPLBController.prepare_load``)
``EPLBController.maybe_register_model``             first converts each MoE layer's upstream
``EPLBController.maybe_register_speculator``        ``EplbLayerState`` to control's
                                                    ``AscendEplbLayerState`` and binds dataplane's
                                                    ``bind_router`` on the router instance
(control) per-layer commit hook                     ``ascend_eplb.control.commit_hooks``
==================================================  =============================================

:func:`apply_patches` checks every signature first and raises ``RuntimeError`` naming the first drifted
callable before anything is changed; :func:`remove_patches` restores every original (tests).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PATCH_TARGETS", "PatchTarget", "apply_patches", "patches_applied", "remove_patches"]

#: Attribute set on every replacement this module installs.
PATCH_MARKER = "_ascend_eplb_integration_patch"

_LOCK = threading.Lock()
#: (owner, attribute) -> original value, in application order, while applied.
_APPLIED: dict[tuple[Any, str], Any] = {}
_CONTROL_INSTALLED: list[Callable[[], Any]] = []


@dataclass(frozen=True)
class PatchTarget:
    """One upstream binding: ``module.qualname`` with its vLLM 0.33.0 parameter names.

    ``params`` is None for a binding that is not a callable (checked another way).
    """

    module: str
    qualname: str
    params: tuple[str, ...] | None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    def owner_and_attr(self) -> tuple[Any, str]:
        owner: Any = importlib.import_module(self.module)
        *path, attr = self.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, attr

    def current(self) -> Any:
        owner, attr = self.owner_and_attr()
        return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


_FACTORY_PARAMS = ("group_coordinator", "backend", "expert_weights", "expert_buffer")
PLATFORM = PatchTarget("vllm.config.parallel", "current_platform", None)
POST_INIT = PatchTarget("vllm.config.parallel", "ParallelConfig.__post_init__", ("self",))
FACTORY = PatchTarget("vllm.distributed.eplb.eplb_communicator", "create_eplb_communicator", _FACTORY_PARAMS)
FACTORY_IN_STATE = PatchTarget(
    "vllm.distributed.eplb.eplb_state", "create_eplb_communicator", _FACTORY_PARAMS
)
STATE_CLASS = PatchTarget("vllm.v1.worker.gpu.eplb_utils", "EplbState", ("self", "parallel_config", "device"))
REGISTER_MODEL = PatchTarget(
    "vllm.v1.worker.gpu.eplb_utils", "EPLBController.maybe_register_model", ("self", "model", "model_config")
)
REGISTER_SPECULATOR = PatchTarget(
    "vllm.v1.worker.gpu.eplb_utils",
    "EPLBController.maybe_register_speculator",
    ("self", "speculator", "speculative_config", "load_dummy_weights"),
)
#: Every binding :func:`apply_patches` replaces (the control plane's own hooks check theirs).
PATCH_TARGETS = (
    PLATFORM,
    POST_INIT,
    FACTORY,
    FACTORY_IN_STATE,
    STATE_CLASS,
    REGISTER_MODEL,
    REGISTER_SPECULATOR,
)


def _signature_of(target: PatchTarget, value: Any) -> tuple[str, ...]:
    fn = inspect.unwrap(value)
    if isinstance(fn, type):
        fn = fn.__init__
    return tuple(inspect.signature(fn).parameters)


def _check(target: PatchTarget) -> None:
    """Raise ``RuntimeError`` naming ``target`` if its binding drifted from vLLM 0.33.0."""
    try:
        value = target.current()
    except (AttributeError, ImportError, KeyError) as exc:
        raise RuntimeError(f"upstream {target.name} is missing ({exc}); expected vLLM 0.33.0") from exc
    if target.params is None:
        if not callable(getattr(value, "is_cuda_alike", None)):
            raise RuntimeError(f"upstream {target.name} has no is_cuda_alike(); expected vLLM 0.33.0")
        return
    if getattr(value, PATCH_MARKER, False):
        value = value.__wrapped__ if hasattr(value, "__wrapped__") else value
    try:
        actual = _signature_of(target, value)
    except (TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot read the signature of upstream {target.name}: {exc}") from exc
    if actual != target.params:
        raise RuntimeError(
            f"upstream {target.name} changed signature: expected parameters {target.params} "
            f"(vLLM 0.33.0), found {actual}; ascend_eplb.integration.patches must be updated"
        )


def _mark(fn: Any) -> Any:
    setattr(fn, PATCH_MARKER, True)
    return fn


# -- replacements -------------------------------------------------------------------------------


class _EplbCapablePlatform:
    """``vllm.config.parallel``'s view of an accelerator platform: ``is_cuda_alike()`` is True.

    vLLM 0.33.0 consults ``is_cuda_alike()`` in that module only for the EPLB gate of
    ``ParallelConfig._validate_parallel_config`` (lines 563-568); everything else is forwarded.
    """

    def __init__(self, platform: Any) -> None:
        object.__setattr__(self, "_platform", platform)

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_platform"), name)


setattr(_EplbCapablePlatform, PATCH_MARKER, True)


def _wrap_post_init(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def __post_init__(self: Any) -> None:  # noqa: N807 (the name upstream calls)
        if self.enable_eplb and self.eplb_config.communicator is None:
            self.eplb_config.communicator = "torch_gloo"
        original(self)

    return _mark(__post_init__)


def _wrap_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_eplb_communicator(
        group_coordinator: Any, backend: str, expert_weights: Any, expert_buffer: Any
    ) -> Any:
        if backend == "torch_gloo":
            from ascend_eplb.movement import AscendGlooEplbCommunicator

            return AscendGlooEplbCommunicator(group_coordinator.cpu_group)
        return original(group_coordinator, backend, expert_weights, expert_buffer)

    return _mark(create_eplb_communicator)


def _wrap_register_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def maybe_register_model(self: Any, model: Any, model_config: Any) -> Any:
        adapt_layer_routers(self.state, model)
        return original(self, model, model_config)

    return _mark(maybe_register_model)


def _wrap_register_speculator(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def maybe_register_speculator(
        self: Any, speculator: Any, speculative_config: Any, load_dummy_weights: bool
    ) -> Any:
        if speculator is not None and hasattr(speculator, "model") and not load_dummy_weights:
            adapt_layer_routers(self.state, speculator.model)
        return original(self, speculator, speculative_config, load_dummy_weights)

    return _mark(maybe_register_speculator)


def adapt_layer_routers(state: Any, model: Any) -> int:
    """Give every MoE layer of ``model`` an ``AscendEplbLayerState`` and bind the router adapter.

    Runs only when ``state`` is control's ``AscendEplbState`` (a plain upstream state is left alone), before
    upstream registers the model: each router's upstream ``EplbLayerState`` becomes
    ``AscendEplbLayerState.from_upstream(state)`` (same tensors, by reference) and dataplane's
    ``bind_router(router, layer_state)`` binds the mapping onto that router instance. Idempotent.

    Returns:
        the number of routers adapted (0 when nothing applies).

    Raises:
        RuntimeError: a MoE layer has no ``router`` carrying an ``eplb_state`` (raised before any
            layer is changed).
    """
    from ascend_eplb.control import AscendEplbLayerState, AscendEplbState

    if not isinstance(state, AscendEplbState):
        return 0
    from vllm.model_executor.models.interfaces import get_mixture_of_experts_model
    from vllm.v1.worker.ubatching import dbo_current_ubatch_id

    from ascend_eplb.dataplane import bind_router

    moe_model = get_mixture_of_experts_model(model)
    if moe_model is None:
        return 0
    routers = []
    for index, layer in enumerate(moe_model.moe_layers):
        router = getattr(layer, "router", None)
        if router is None or not hasattr(router, "eplb_state"):
            raise RuntimeError(
                f"adapt_layer_routers: MoE layer {index} ({type(layer).__name__}) has no router with an "
                "'eplb_state' (vLLM 0.33.0 MoERunner.router); cannot bind the Ascend EPLB mapping"
            )
        routers.append(router)
    adapted = 0
    for router in routers:
        layer_state = router.eplb_state
        if layer_state is None:
            continue
        if not isinstance(layer_state, AscendEplbLayerState):
            layer_state = AscendEplbLayerState.from_upstream(layer_state)
            router.eplb_state = layer_state
        bind_router(router, layer_state, ubatch_id=dbo_current_ubatch_id)
        adapted += 1
    return adapted


def _replacements() -> list[tuple[PatchTarget, Callable[[Any], Any]]]:
    def state_class(_original: Any) -> Any:
        from ascend_eplb.control import AscendEplbState

        return AscendEplbState

    return [
        (POST_INIT, _wrap_post_init),
        (FACTORY, _wrap_factory),
        (FACTORY_IN_STATE, _wrap_factory),
        (STATE_CLASS, state_class),
        (REGISTER_MODEL, _wrap_register_model),
        (REGISTER_SPECULATOR, _wrap_register_speculator),
    ]


def _is_ours(value: Any) -> bool:
    if getattr(value, PATCH_MARKER, False):
        return True
    from ascend_eplb.control import AscendEplbState

    return value is AscendEplbState


def apply_patches() -> bool:
    """Install every patch; idempotent (a second call changes nothing and returns False).

    Order: control's host adaptation (only where ``torch.accelerator.is_available()`` is False), the
    platform view (only if the platform still is not EPLB-capable), the communicator default, both
    factory bindings, the state class, the router binding after ``add_model``, control's commit hooks.

    Returns:
        True if this call installed the patches.

    Raises:
        RuntimeError: an upstream callable changed signature since vLLM 0.33.0; the message names it.
            Every check runs before the first change, so nothing is half-applied.
    """
    with _LOCK:
        if _APPLIED or _CONTROL_INSTALLED:
            return False
        for target in PATCH_TARGETS:
            _check(target)
        from ascend_eplb.control import commit_hooks, host_adaptation

        commit_hooks.check_hooked_signatures()
        try:
            if host_adaptation.install():
                _CONTROL_INSTALLED.append(host_adaptation.uninstall)
            if not PLATFORM.current().is_cuda_alike():
                owner, attr = PLATFORM.owner_and_attr()
                _APPLIED[(owner, attr)] = getattr(owner, attr)
                setattr(owner, attr, _EplbCapablePlatform(getattr(owner, attr)))
            for target, wrap in _replacements():
                owner, attr = target.owner_and_attr()
                original = target.current()
                if _is_ours(original):
                    continue
                _APPLIED[(owner, attr)] = original
                setattr(owner, attr, wrap(original))
            if commit_hooks.install_commit_hooks():
                _CONTROL_INSTALLED.append(commit_hooks.uninstall_commit_hooks)
        except BaseException:
            _restore()
            raise
        return True


def _restore() -> None:
    for (owner, attr), original in reversed(list(_APPLIED.items())):
        setattr(owner, attr, original)
    _APPLIED.clear()
    for undo in reversed(_CONTROL_INSTALLED):
        undo()
    _CONTROL_INSTALLED.clear()


def remove_patches() -> bool:
    """Restore every original :func:`apply_patches` replaced; idempotent. True if something changed."""
    with _LOCK:
        changed = bool(_APPLIED or _CONTROL_INSTALLED)
        _restore()
        return changed


def patches_applied() -> bool:
    """Whether :func:`apply_patches` is in effect in this process."""
    return bool(_APPLIED or _CONTROL_INSTALLED)
