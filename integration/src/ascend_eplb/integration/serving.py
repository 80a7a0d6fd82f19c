"""The Ascend controller of a serving worker: its start-up validation, switches and guardrails.

Building it with EPLB on takes two steps, the patches applied between them: :func:`read_serving_setup`
validates the ``VllmConfig`` and reads every ``ASCEND_EPLB_*`` switch (:mod:`.guardrail_facts`), refusing a
bad value before anything is patched or built; :func:`build_serving_controller` builds control's
``AscendEPLBController`` and subscribes the guardrails to its bus, each once (watchdog always; verifier,
events file, Prometheus metrics when switched on), and logs :func:`active_line`. :func:`guardrails_of` hands
them out later. Callers: ``runner.create_eplb_controller`` and the patched ``EPLBController`` of
``patches``; this module imports neither (no cycle).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

from ascend_eplb.control import AscendEPLBController
from ascend_eplb.integration.events.recorder import EventsRecorder
from ascend_eplb.integration.guardrail_facts import read_serving_switches
from ascend_eplb.integration.placement_file import assign_placements, read_placements
from ascend_eplb.integration.prometheus import PrometheusMetrics
from ascend_eplb.integration.startup_placement import attach_startup_install
from ascend_eplb.integration.validation import validate_eplb_config
from ascend_eplb.integration.verify import EplbVerifier
from ascend_eplb.integration.watchdog import WorkerWatchdog

__all__ = [
    "Guardrails",
    "ServingSetup",
    "active_line",
    "build_serving_controller",
    "guardrails_of",
    "read_serving_setup",
]


@dataclass(frozen=True)
class ServingSetup:
    """What EPLB-on serving is configured by, read and checked before anything changes.

    Attributes:
        settings: the validated ``EplbSettings`` (``validate_eplb_config``).
        worker_timeout_s: ``ASCEND_EPLB_WORKER_TIMEOUT_S`` (seconds), the watchdog's stall limit.
        on_worker_failure: ``ASCEND_EPLB_ON_WORKER_FAILURE``, ``"stop"`` (the default) or ``"raise"``.
        verify: ``ASCEND_EPLB_VERIFY`` asks for the runtime verifier.
        events: ``ASCEND_EPLB_EVENTS``, the events file path (str), or None (off).
        metrics: ``ASCEND_EPLB_METRICS`` asks for the Prometheus metrics (prometheus_client is imported
            only then).
        initial_placement: the placement of ``eplb_config.initial_placement`` each model starts on, by
            upstream's name of the model (``{model_name: placement_file.Placement}``, the file's
            placements assigned by ``placement_file.assign_placements`` and judged by the
            ``initial-placement`` rule), or None.
        served_model_name: vLLM's ``model_config.served_model_name`` (``--served-model-name``, else the
            model), the ``model_name`` label of the metrics as of vLLM's own series; None without a model
            config.
    """

    settings: Any
    worker_timeout_s: float
    on_worker_failure: str
    verify: bool
    events: str | None
    metrics: bool = False
    initial_placement: Any = None
    served_model_name: str | None = None


@dataclass(frozen=True)
class Guardrails:
    """The serving guardrails :func:`build_serving_controller` subscribed to one controller's event bus.

    Attributes:
        watchdog: the ``WorkerWatchdog`` (always).
        verifier: the ``EplbVerifier`` (``ASCEND_EPLB_VERIFY=1``), or None.
        recorder: the ``EventsRecorder`` (``ASCEND_EPLB_EVENTS`` or ``ASCEND_EPLB_METRICS``), or None.
        metrics: the ``PrometheusMetrics`` (``ASCEND_EPLB_METRICS=1``), or None.
    """

    watchdog: Any
    verifier: Any | None = None
    recorder: Any | None = None
    metrics: Any | None = None


_GUARDRAILS: weakref.WeakKeyDictionary[Any, Guardrails] = weakref.WeakKeyDictionary()


def guardrails_of(controller: Any) -> Guardrails:
    """The :class:`Guardrails` :func:`build_serving_controller` attached to ``controller``.

    Raises:
        LookupError: ``controller`` was not built by :func:`build_serving_controller` (EPLB off: upstream's
            controller has none).
    """
    try:
        return _GUARDRAILS[controller]
    except (KeyError, TypeError):
        raise LookupError(
            f"{type(controller).__name__} object has no serving guardrails: only a controller built by "
            "ascend_eplb.integration.serving.build_serving_controller (EPLB on) has them"
        ) from None


def read_serving_setup(vllm_config: Any) -> ServingSetup:
    """Validate ``vllm_config`` and read every serving switch; changes nothing.

    Raises:
        EplbConfigError: the configuration violates the support matrix (every violated rule listed).
        ValueError: ``ASCEND_EPLB`` (a word other than the on and off ones), ``ASCEND_EPLB_WORKER_TIMEOUT_S``,
            ``ASCEND_EPLB_ON_WORKER_FAILURE``, ``ASCEND_EPLB_VERIFY``, ``ASCEND_EPLB_EVENTS``,
            ``ASCEND_EPLB_METRICS`` or ``ASCEND_EPLB_MAX_INPUT_MIB`` is invalid (one line per bad switch,
            each naming it and the rule).
    """
    settings = validate_eplb_config(vllm_config)
    values, errors = read_serving_switches(None, serving_process=True)
    if errors:
        raise ValueError("\n".join(errors))
    timeout_s, on_failure = values["worker timeout"], values["on worker failure"]
    placement = None
    if settings.initial_placement is not None:
        placements = read_placements(settings.initial_placement, settings.served_models)
        placement, _ = assign_placements(placements, settings.served_models or ())
    served = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None)
    return ServingSetup(
        settings,
        timeout_s,
        on_failure,
        values["verify"],
        values["events"],
        values["metrics"],
        placement,
        served,
    )


def build_serving_controller(parallel_config: Any, device: Any, setup: ServingSetup) -> Any:
    """Control's ``AscendEPLBController`` for ``parallel_config`` on ``device``, with the guardrails of
    ``setup`` attached; logs :func:`active_line` at INFO. Call it with the patches in effect.

    Raises:
        RuntimeError: an upstream ``EPLBController`` method changed signature (control's check).
    """
    phase = setup.settings.load_collection_phase
    policy_settings = setup.settings.policy_settings()
    controller = AscendEPLBController(
        parallel_config,
        device,
        load_collection_phase=phase,
        policy_settings=policy_settings,
        replica_split=setup.settings.replica_split,
    )
    # Each subscribes once, here; the bus delivers in subscription order on every rank: the watchdog
    # first (a failure stops EPLB before any other subscriber looks at the cycle), then the verifier,
    # then the events recorder, then the metrics (the events file and the metrics are the recorder's
    # record's two consumers).
    bus = controller.bus
    watchdog = WorkerWatchdog(setup.worker_timeout_s, setup.on_worker_failure)
    watchdog.attach(bus)
    verifier = recorder = metrics = None
    if setup.verify:
        verifier = EplbVerifier()
        verifier.attach(bus)
    if setup.events is not None or setup.metrics:
        recorder = EventsRecorder(setup.events)
        recorder.attach(bus)
        if setup.metrics:
            metrics = PrometheusMetrics(setup.served_model_name)
            metrics.attach(bus)
    if setup.initial_placement is not None:
        # After the guardrails: the verifier fingerprints the loaded slots first and checks the install.
        attach_startup_install(bus, setup.initial_placement)
    _GUARDRAILS[controller] = Guardrails(watchdog, verifier, recorder, metrics)
    # The one line that tells an operator, in the serving log, that Ascend EPLB is active and how.
    init_logger(__name__).info(
        "%s",
        active_line(
            phase,
            setup.verify,
            setup.worker_timeout_s,
            setup.on_worker_failure,
            setup.events,
            setup.settings.num_redundant_experts,
            metrics=setup.metrics,
            policy=policy_settings.describe(),
            split=f"replica_split={setup.settings.replica_split} (split scope {controller.split_scope})",
        ),
    )
    return controller


def active_line(
    phase: str,
    verifying: bool,
    timeout_s: float,
    on_failure: str,
    events: Any,
    num_redundant_experts: Any,
    *,
    metrics: bool = False,
    policy: str = "policy=default, gate off",
    split: str = "replica_split=equal",
) -> str:
    """The INFO line :func:`build_serving_controller` logs (also what an operator greps for); ``policy``
    is control's ``PolicySettings.describe()``, ``split`` the batch split in force."""
    return (
        f"Ascend EPLB active: AscendEPLBController, load_collection_phase={phase}, "
        f"num_redundant_experts={num_redundant_experts}, {policy}, {split}, "
        f"verifier={'on' if verifying else 'off'} "
        f"(ASCEND_EPLB_VERIFY), watchdog timeout {timeout_s:g} s on_failure={on_failure}, "
        f"events={events if events is not None else 'off'} (ASCEND_EPLB_EVENTS), "
        f"metrics={'on' if metrics else 'off'} (ASCEND_EPLB_METRICS)"
    )
