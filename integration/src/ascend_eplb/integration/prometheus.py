"""Prometheus metrics of a serving worker: the events file's facts as series on vLLM's ``/metrics``.

Switched on by ``ASCEND_EPLB_METRICS=1``
(:func:`~ascend_eplb.integration.guardrail_facts.metrics_requested`; off by default: only that reader,
standard library, runs). On, prometheus_client's multiprocess mode: each worker writes to
``PROMETHEUS_MULTIPROC_DIR`` (a writable folder in vLLM's environment; vLLM sets one itself with
``--api-server-count`` > 1; one it did not create must be emptied between runs or counters add up), which
vLLM's API server serves through ``MultiProcessCollector``. A :class:`PrometheusMetrics` follows the records
of the controller's ``EventsRecorder``, so a scrape and the events file agree. Series (:data:`METRICS`) are
labelled ``model_name`` as vLLM's own series are (the served name, ``--served-model-name``; a draft's with
upstream's `` (draft)`` suffix) and, where the value differs per rank, ``rank``; ``kind``, ``check`` and
``reason`` take the watchdog's, verifier's and gate's few values (bounded by models x EP ranks). Rank-equal
values are written by EP rank 0; every series exists from registration (counters at 0); gauges keep the most
recent value (``multiprocess_mode="mostrecent"``, no ``pid`` label).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.parallel_state import get_ep_group

from ascend_eplb.control.bus import RegistrationEvent
from ascend_eplb.control.policy_config import SKIP_REASONS
from ascend_eplb.integration.events.recorder import EventsRecord
from ascend_eplb.integration.guardrail_facts import VERIFIER_CHECKS
from ascend_eplb.integration.model_names import DRAFT_SUFFIX, is_draft

__all__ = ["METRICS", "PrometheusMetrics"]

#: Every series: ``(name as scraped, type, labels, what it counts)``.
METRICS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("ascend_eplb_window_balancedness", "gauge", ("model_name",),
     "Balancedness (mean rank load / max rank load per MoE layer, averaged over layers) of the last closed "
     "load window under the placement in force when it closed"),
    ("ascend_eplb_window_balancedness_eplb_off", "gauge", ("model_name",),
     "Balancedness of the same window's load under upstream's initial placement (EPLB off)"),
    ("ascend_eplb_window_split_balancedness", "gauge", ("model_name",),
     "With replica_split on: the balancedness each batch executed under the batch split, the mean over the "
     "window's recorded batches and the MoE layers (accumulated on the device, read once per window; on "
     "split rows with batch_local, EP rank 0's own rows)"),
    ("ascend_eplb_window_split_balancedness_equal", "gauge", ("model_name",),
     "With replica_split on: the equal split's balancedness on the same batches' counts (each replica "
     "count / replicas), the same mean"),
    ("ascend_eplb_rearrangement_balancedness_planned", "gauge", ("model_name",),
     "Balancedness the last rearrangement that moved experts planned: its window's load under the policy's "
     "placement"),
    ("ascend_eplb_rearrangement_balancedness_planned_on_estimate", "gauge", ("model_name",),
     "The same placement's balancedness on the load estimate it was planned on (only with "
     "load_estimate=pooled)"),
    ("ascend_eplb_rearrangement_balancedness_realised", "gauge", ("model_name",),
     "Balancedness the placement in force realised: the mean, over the windows closed under it since it "
     "was committed, of each window's load under it"),
    ("ascend_eplb_rearrangements_started_total", "counter", ("model_name",),
     "Rearrangements started: load windows handed to upstream's policy"),
    ("ascend_eplb_rearrangements_completed_total", "counter", ("model_name",),
     "Rearrangements whose last MoE layer committed a planned placement (not skipped)"),
    ("ascend_eplb_rearrangements_skipped_total", "counter", ("model_name", "reason"),
     "Windows closed without moving an expert, by reason: balanced (target_balancedness reached), min_gain "
     "(the policy's placement gains less than min_balancedness_gain), no_load (no EP rank recorded load)"),
    ("ascend_eplb_layers_committed_total", "counter", ("model_name",), "MoE layer placements committed"),
    ("ascend_eplb_experts_moved_total", "counter", ("model_name",),
     "Expert weights that crossed ranks, over completed rearrangements"),
    ("ascend_eplb_bytes_received_total", "counter", ("model_name", "rank"),
     "Expert weight bytes this EP rank received in rearrangements"),
    ("ascend_eplb_commit_publish_to_acknowledge_seconds", "gauge", ("model_name", "rank"),
     "Last layer commit on this EP rank: seconds from the step boundary that saw the layer published (or "
     "its move) to the acknowledgement of the staging buffer"),
    ("ascend_eplb_worker_failures_total", "counter", ("model_name", "kind"),
     "Async EPLB worker failures the watchdog decided (kind: died, stalled), each counted for every model "
     "of the worker: it stops EPLB for all of them"),
    ("ascend_eplb_verifier_violations_total", "counter", ("model_name", "check"),
     "Serving verifier violations (ASCEND_EPLB_VERIFY=1) by check (fingerprints, lookups)"),
)  # fmt: skip
_FAILURE_KINDS = ("died", "stalled")
#: The one series that exists only where the load estimate is on (a gauge at 0 would read as a plan).
_PLANNED_ON_ESTIMATE = "ascend_eplb_rearrangement_balancedness_planned_on_estimate"
#: The series that exist only where the batch split is on.
_SPLIT = ("ascend_eplb_window_split_balancedness", "ascend_eplb_window_split_balancedness_equal")


_FAMILIES: dict[str, Any] | None = None


def _families() -> dict[str, Any]:
    """The process's metric objects, built once (two objects of one name would overwrite each other's
    values in this process's multiprocess file). Not registered in prometheus_client's global registry:
    the API server collects them from the files."""
    global _FAMILIES
    if _FAMILIES is None:
        # local: prometheus_client picks its value class when imported (guardrail_facts.metrics_requested)
        from prometheus_client import Counter, Gauge

        families = {}
        for name, kind, labels, doc in METRICS:
            if kind == "counter":
                families[name] = Counter(name.removesuffix("_total"), doc, labels, registry=None)
            else:
                families[name] = Gauge(name, doc, labels, registry=None, multiprocess_mode="mostrecent")
        _FAMILIES = families
    return _FAMILIES


class PrometheusMetrics:
    """The series of :data:`METRICS` for one controller's models, from its events recorder's records.

    Args:
        served_model_name: vLLM's ``model_config.served_model_name`` (what vLLM's own series carry as
            ``model_name``): the target's ``model_name`` label, a draft's with `` (draft)`` appended; None
            (a world without a model config): upstream's name of each model (``EplbModelState.model_name``).

    Use :meth:`attach` (``create_eplb_controller`` does when
    :func:`~ascend_eplb.integration.guardrail_facts.metrics_requested`).
    """

    def __init__(self, served_model_name: str | None = None) -> None:
        self._rank: int | None = None
        self._served = served_model_name
        self._labels: dict[str, str] = {}  # upstream's model name -> its model_name label
        self._series = _families()
        # Model name -> (the controller's state, the model's config) where the batch split is on.
        self._split: dict[str, tuple[Any, Any]] = {}

    def _label(self, model: str) -> str:
        """The ``model_name`` label of the model upstream names ``model``."""
        if self._served is None:
            return model
        return self._served + DRAFT_SUFFIX if is_draft(model) else self._served

    def attach(self, bus: Any) -> None:
        """Subscribe to a controller's event bus (control's ``AscendEPLBController.bus``, once, when the
        controller is built, after its events recorder): create each registered model's series at its
        registration and follow the recorder's records
        (:class:`~ascend_eplb.integration.events.recorder.EventsRecord`)."""
        bus.subscribe(RegistrationEvent, self._on_registered)
        bus.subscribe(EventsRecord, self._on_record)

    def _on_registered(self, event: Any) -> None:
        self._rank = get_ep_group().rank_in_group
        upstream_name = event.controller.state.model_states[event.model_config.compute_hash()].model_name
        self._labels[upstream_name] = name = self._label(upstream_name)
        s = self._series
        rank = str(self._rank)
        s["ascend_eplb_bytes_received_total"].labels(name, rank)
        s["ascend_eplb_commit_publish_to_acknowledge_seconds"].labels(name, rank)
        if self._rank != 0:
            return
        state = event.controller.state
        estimating = state.policy_settings.estimating
        splitting = state.split_scope != "off"
        if splitting:
            self._split[name] = (state, event.model_config)
        for metric, _, labels, _ in METRICS:
            if labels != ("model_name",) or (metric == _PLANNED_ON_ESTIMATE and not estimating):
                continue
            if metric in _SPLIT and not splitting:
                continue
            s[metric].labels(name)
        for kind in _FAILURE_KINDS:
            s["ascend_eplb_worker_failures_total"].labels(name, kind)
        for reason in SKIP_REASONS:
            s["ascend_eplb_rearrangements_skipped_total"].labels(name, reason)
        for check in VERIFIER_CHECKS:
            s["ascend_eplb_verifier_violations_total"].labels(name, check)

    def _on_record(self, published: Any) -> None:
        record = published.record  # an ascend_eplb.integration.events.records.Record
        s, event = self._series, record.event
        model = None if record.model is None else self._label(record.model)
        if event == "commit":
            rank = str(self._rank)
            s["ascend_eplb_bytes_received_total"].labels(model, rank).inc(record.bytes_received)
            if record.publish_to_acknowledge_s is not None:
                s["ascend_eplb_commit_publish_to_acknowledge_seconds"].labels(model, rank).set(
                    record.publish_to_acknowledge_s
                )
        if self._rank != 0:
            return
        if event == "window":
            s["ascend_eplb_rearrangements_started_total"].labels(model).inc()
            s["ascend_eplb_window_balancedness"].labels(model).set(record.balancedness)
            s["ascend_eplb_window_balancedness_eplb_off"].labels(model).set(record.balancedness_eplb_off)
            split = self._split.get(model)
            taken = split[0].take_split_balancedness(split[1]) if split is not None else None
            if taken is not None:
                s["ascend_eplb_window_split_balancedness"].labels(model).set(taken[0])
                s["ascend_eplb_window_split_balancedness_equal"].labels(model).set(taken[1])
        elif event == "commit":
            s["ascend_eplb_layers_committed_total"].labels(model).inc()
        elif event == "rearrangement" and record.skipped is not None:
            s["ascend_eplb_rearrangements_skipped_total"].labels(model, record.skipped).inc()
        elif event == "rearrangement":
            s["ascend_eplb_rearrangements_completed_total"].labels(model).inc()
            s["ascend_eplb_experts_moved_total"].labels(model).inc(record.experts_moved)
            s["ascend_eplb_rearrangement_balancedness_planned"].labels(model).set(record.balancedness_planned)
            if record.estimate_balancedness_planned is not None:
                s[_PLANNED_ON_ESTIMATE].labels(model).set(record.estimate_balancedness_planned)
        elif event == "rearrangement_realised":
            s["ascend_eplb_rearrangement_balancedness_realised"].labels(model).set(
                record.balancedness_realised_mean
            )
        elif event == "worker_failure":
            for name in self._labels.values():  # it stops EPLB for every model of the worker
                s["ascend_eplb_worker_failures_total"].labels(name, record.kind).inc()
        elif event == "verifier_violation":
            for name in [model] if model is not None else self._labels.values():
                s["ascend_eplb_verifier_violations_total"].labels(name, record.check).inc()
