"""Where upstream is touched: the registry that installs every module-level replacement of upstream vLLM
0.33.0 and torch in this process, and checks every upstream row it relies on (:func:`check_upstream`).

:data:`PATCHES`: the :class:`~ascend_eplb.control.patching.Patch` es of ``host_adaptation``,
``commit_hooks`` (each declared on its factory with ``@ascend_eplb.control.upstream.SURFACE.replaces``),
``watchdog`` and this module (with ``@ascend_eplb.integration.upstream.SURFACE.replaces``), in the one
installation order declared here (a binding claimed twice fails at import), installed by the process's
single ``PatchSet`` (:func:`apply_patches`: every check before the first change). :data:`SURFACE`: every
row the process relies on (control's and the integration's); :data:`INSTANCE_BINDINGS`: the upstream
methods their owners replace on single instances while serving. Each replacement calls the plane that
owns the behaviour; the CPU world's rows are not installed or checked here. ``integration/UPSTREAM.md``
renders every row (:mod:`ascend_eplb.integration.surface`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm.config import get_current_vllm_config_or_none

from ascend_eplb.control import commit_hooks, host_adaptation
from ascend_eplb.control import upstream as control_upstream
from ascend_eplb.control.patching import InstanceBinding, Patch, PatchSet, check_signatures, patches_of
from ascend_eplb.control.surface import Surface
from ascend_eplb.integration import upstream, watchdog
from ascend_eplb.integration.serving import build_serving_controller, read_serving_setup
from ascend_eplb.movement import AscendGlooEplbCommunicator

__all__ = [
    "INSTANCE_BINDINGS",
    "PATCHES",
    "SURFACE",
    "applied_bindings",
    "apply_patches",
    "check_upstream",
    "patches_applied",
    "remove_patches",
]


@upstream.SURFACE.replaces(
    "vllm.config.parallel.ParallelConfig.__post_init__",
    'communicator unset -> `"torch_gloo"` before upstream probes NIXL/XCCL, then upstream\'s',
)
def _wrap_post_init(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def __post_init__(self: Any) -> None:  # noqa: N807 (the name upstream calls)
        if self.enable_eplb and self.eplb_config.communicator is None:
            self.eplb_config.communicator = "torch_gloo"
        original(self)

    return __post_init__


@upstream.SURFACE.replaces(
    "vllm.distributed.eplb.eplb_communicator.create_eplb_communicator",
    "`\"torch_gloo\"` -> movement's `AscendGlooEplbCommunicator(cpu_group)`; other backends upstream's",
)
@upstream.SURFACE.replaces(
    "vllm.distributed.eplb.eplb_state.create_eplb_communicator", "the same (imported there by name)"
)
def _wrap_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_eplb_communicator(
        group_coordinator: Any, backend: str, expert_weights: Any, expert_buffer: Any
    ) -> Any:
        if backend == "torch_gloo":
            return AscendGlooEplbCommunicator(group_coordinator.cpu_group)
        return original(group_coordinator, backend, expert_weights, expert_buffer)

    return create_eplb_communicator


@upstream.SURFACE.replaces(
    "vllm.model_executor.models.deepseek_mtp.fused_moe_make_expert_params_mapping",
    "upstream's, with the draft's `num_redundant_experts` when `DeepSeekMTP.load_weights` leaves it out "
    "(vLLM 0.33.0 does: the draft's redundant slots got no weight, and EPLB routed tokens to them)",
)
def _wrap_mtp_expert_mapping(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fused_moe_make_expert_params_mapping(
        model: Any,
        ckpt_gate_proj_name: str,
        ckpt_down_proj_name: str,
        ckpt_up_proj_name: str | None,
        num_experts: int,
        num_redundant_experts: int = 0,
        routed_experts_prefix: str = "routed_experts",
    ) -> Any:
        """Upstream's mapping of checkpoint expert weights to physical slots, for vLLM's ``DeepSeekMTP``
        (the one caller in its module, its ``load_weights``): vLLM 0.33.0's passes no
        ``num_redundant_experts``, so with EPLB's redundant experts the draft's slots ``E .. P - 1`` got
        no weight (the target's ``DeepseekV2`` passes its own). Here the draft's own count fills it when
        the caller left it 0; a caller that passes it is served unchanged."""
        if num_redundant_experts == 0:
            num_redundant_experts = int(getattr(model, "num_redundant_experts", 0) or 0)
        return original(
            model, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, num_experts,
            num_redundant_experts, routed_experts_prefix,
        )  # fmt: skip

    return fused_moe_make_expert_params_mapping


@upstream.SURFACE.replaces(
    "vllm.v1.worker.gpu.model_runner.EPLBController",
    "EPLB on: `create_eplb_controller`'s controller for the current vLLM config; off: upstream's class",
)
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


@upstream.SURFACE.replaces(
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.shutdown",
    "the controller's `shutdown()` first, when it has one (the watchdog's end of life), then upstream's",
)
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


@upstream.SURFACE.replaces(
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_inputs",
    "the batch's phase to the controller first, when it has phases (`set_batch_phase(bool("
    "batch_req_state.has_prefill))`), then upstream's",
)
def _wrap_runner_prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_inputs(
        self: Any, scheduler_output: Any, batch_req_state: Any, batch_desc: Any, num_active_loras: int
    ) -> Any:
        """Upstream ``GPUModelRunner.prepare_inputs``, after declaring the batch's phase to the runner's
        EPLB controller when it has phases (Ascend's ``AscendEPLBController.set_batch_phase``; upstream's
        has none): ``batch_req_state.has_prefill``, upstream's own (any request of the batch still in
        prefill, a mixed batch included). The one point of Model Runner V2 that knows the batch before
        ``execute_model`` calls ``eplb.prepare_forward``; dummy runs do not pass here (their phase stays
        undeclared, which records under ``load_collection_phase=all`` only)."""
        controller = getattr(self, "eplb", None)
        if controller is not None and hasattr(controller, "set_batch_phase"):
            controller.set_batch_phase(bool(batch_req_state.has_prefill))
        return original(self, scheduler_output, batch_req_state, batch_desc, num_active_loras)

    return prepare_inputs


#: Every patch of the process, in installation order: the platform and host adaptation first (vLLM's
#: config and EPLB state are built on them), then the config's communicator choice and factory, the commit
#: hooks, the worker loop, and the model runner's draft mapping, controller, shutdown and batch phase.
PATCHES: tuple[Patch, ...] = (
    *host_adaptation.PATCHES,
    *patches_of(_wrap_post_init, _wrap_factory),
    *commit_hooks.PATCHES,
    *watchdog.PATCHES,
    *patches_of(
        _wrap_mtp_expert_mapping, _wrap_runner_controller, _wrap_runner_shutdown, _wrap_runner_prepare_inputs
    ),
)

#: Every upstream row the serving process relies on: the integration's, then control's (a row both rely
#: on is named by its integration user first).
SURFACE: Surface = upstream.SURFACE + control_upstream.SURFACE

#: Every upstream method the serving process replaces on single instances (the classes keep theirs): the
#: surface's rows.
INSTANCE_BINDINGS: tuple[InstanceBinding, ...] = SURFACE.instance_bindings

_REGISTRY = PatchSet(PATCHES)


def check_upstream() -> None:
    """Check every upstream row the serving process relies on: each signature of :data:`SURFACE`
    (control's and the integration's: names, kinds and defaults; the targets of
    :data:`PATCHES` and of :data:`INSTANCE_BINDINGS` included), except a patch target whose patch does
    not apply in this process (the host adaptation's, where an accelerator is present) and that nothing
    else relies on (``EplbState.__init__`` is still checked there: the state subclasses it); then every
    pinned body, attribute and override (``SURFACE.check_rows()``). The CPU
    world's rows are not the surface's: a vLLM change there must not stop a serving process. Wrappers
    installed by :func:`apply_patches` are checked as the functions they wrap.

    Raises:
        RuntimeError: a row is missing or drifted from vLLM 0.33.0 / torch 2.13.0; the message names it
            (for a signature, both parameter lists).
    """
    # Whose reliance a patch that does not apply here takes away: its owner's (as a user id of the table).
    not_applied = {
        patch.name: patch.owner.removeprefix("ascend_eplb.") for patch in PATCHES if not patch.when()
    }
    check_signatures(
        entry
        for entry in SURFACE.signatures.values()
        if entry.name not in not_applied or not set(entry.users) <= {not_applied[entry.name]}
    )
    SURFACE.check_rows()


def apply_patches() -> bool:
    """Install every applicable patch of :data:`PATCHES`, after :func:`check_upstream`; idempotent (a
    repeat call returns at once, checking nothing again).

    Returns:
        True if this call installed them, False if they were installed already.

    Raises:
        RuntimeError: a row drifted from vLLM 0.33.0 / torch 2.13.0; the message names it. Every check
            runs before the first change, so nothing is half-applied.
    """
    if _REGISTRY.installed:
        return False
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
