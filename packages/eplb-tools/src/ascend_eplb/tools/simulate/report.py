"""``report.json``: what a run saw, from every rank's statistics and the serving events file, with the
checks' verdicts and costs, as one :class:`SimulateReport` (its :meth:`~SimulateReport.to_json` is the
file).

Totals count the start-up install of ``--initial-placement`` as they count a rearrangement (its layers,
experts, bytes), each beside the install's share. Shape letters (DESIGN.md section 2): L MoE layers,
E logical experts, P physical experts, N EP ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ascend_eplb.control import measures
from ascend_eplb.control.policy_config import SKIP_REASONS
from ascend_eplb.integration.events.reader import read_events
from ascend_eplb.integration.events.records import (
    CommitRecord,
    InitialPlacementRecord,
    RearrangementRealisedRecord,
    RearrangementRecord,
    WindowRecord,
)
from ascend_eplb.integration.model_names import DRAFT_SUFFIX, is_draft
from ascend_eplb.integration.regular_files import EVENTS_FILE, read_regular_file
from ascend_eplb.tools.costs import estimate_costs, read_model_size
from ascend_eplb.tools.simulate.checks import CHECKS
from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.simulate.stats import InstallSeen, OutputTolerance, RankStats
from ascend_eplb.tools.simulate.verdicts import JUDGED, PASSED, check_verdicts, run_verdict
from ascend_eplb.world.compilation import is_compiled

__all__ = [
    "DraftReport",
    "InstallReport",
    "RearrangementOutcome",
    "SimulateReport",
    "build_report",
    "events_outcomes",
]


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: dataclasses as objects, tuples as lists."""
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class RearrangementOutcome:
    """What one closed window became (the events file's ``rearrangement`` record and the
    ``rearrangement_realised`` ones of the windows after it).

    ``rearrangement``: the 1-based window index (None for a window without load); ``step``: the step the
    record was made in; ``balancedness_before`` and ``balancedness_planned``: its window under the
    placement in force and under the policy's; ``estimate_balancedness_before`` and
    ``estimate_balancedness_planned``: the same on the load estimate it was planned on (None on the
    window); ``balancedness_realised``: the mean balancedness of the windows with load that closed under
    the placement it left (one that moved: every window until the next that moved; a skipped one: the
    next window, under the placement it kept), ``windows_realised`` of them (None and 0 until one
    closed); ``bytes_moved``: estimated (experts x one expert's bytes).
    """

    model: str | None
    rearrangement: int | None
    step: int
    policy: str
    skipped: str | None
    balancedness_before: float | None
    balancedness_planned: float | None
    load_estimate: str
    estimate_balancedness_before: float | None
    estimate_balancedness_planned: float | None
    balancedness_realised: float | None
    windows_realised: int
    experts_moved: int
    bytes_moved: int
    layers_changed: int


@dataclass(frozen=True)
class InstallReport:
    """With ``--initial-placement``: the file, what its start-up install moved (the events file's
    ``initial_placement`` record: counted in every total of the report as a rearrangement is), and the
    first step's mean balancedness measured beside the one ``plan`` computes for the installed placement
    on that step's load and EPLB off's, ``plan``'s own prediction on the load the file was made from (its
    ``source``, when it says), and whether every rank's slots held their logical experts right after
    start-up (None: the world's only evidence is the verifier's check of the install)."""

    source: str
    layers_committed: int
    layers_changed: int | None
    experts_moved: int | None
    bytes_moved: int | None
    first_step_balancedness: float | None
    first_step_planned: float | None
    first_step_off: float | None
    plan_predicted_on_its_load: float | None
    slots_hold_their_experts: bool | None
    slot_mismatches: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class EventsOutcomes:
    """What the serving events file says a run did (:func:`events_outcomes`)."""

    records: tuple[RearrangementOutcome, ...]
    install: InitialPlacementRecord | None
    #: per rank, the logical experts it received: in the start-up install, in the rearrangements' commits.
    install_received: tuple[int, ...]
    rearrangements_received: tuple[int, ...]
    rearrangement_layer_commits: int


@dataclass(frozen=True)
class DraftReport:
    """With ``--speculative-tokens N``: the MTP draft's figures (``report.json``'s ``draft``), each as the
    target's top-level field of the same name: its balancedness with EPLB and without (rank 0's per step,
    over the N forwards), its rearrangements (the events file's records of its name), what they and its
    start-up install moved (estimated; totals count the install as the target's do) and what its
    communicators received (measured), and what its checks compared.

    ``model``: upstream's name (``"<target> (draft)"``); ``architecture``: its vLLM class;
    ``forwards_per_step``: N; ``layers``: its MoE (MTP) layers.
    """

    model: str
    architecture: str
    forwards_per_step: int
    layers: int
    rearrangements_completed: int
    layers_committed: int
    balancedness_before: float | None
    balancedness_after: float | None
    balancedness_off_after: float | None
    balancedness_off_mean: float | None
    balancedness_per_step: tuple[float, ...]
    balancedness_off_per_step: tuple[float, ...]
    commit_completed_steps: tuple[int, ...]
    initial_placement: InstallReport | None
    bytes_received: int | None
    bytes_received_per_rank: tuple[int | None, ...]
    rearrangement_records: tuple[RearrangementOutcome, ...]
    rearrangements_skipped: dict[str, int]
    experts_moved: int
    bytes_moved: int
    busiest_rank_experts_received: int
    max_output_error: float
    load_steps_recorded: int
    load_selections: int


@dataclass(frozen=True)
class SimulateReport:
    """``report.json`` (:meth:`to_json`). Per-step lists are rank 0's; ``balancedness*`` are mean
    balancedness (:func:`ascend_eplb.control.measures.mean_balancedness`).

    Totals, the start-up install included as a rearrangement is (``initial_placement`` has its share):
    ``layers_committed``, ``experts_moved`` and ``bytes_moved`` (estimated: experts x one expert's
    bytes), ``bytes_received`` (measured by the ranks' communicators, summed; per rank
    ``bytes_received_per_rank``), ``busiest_rank_experts_received``.
    """

    ranks: int
    data_parallel_size: int
    tensor_parallel_size: int
    moe_rows: str | None
    compilation: str | None
    model: str
    format: str
    trace: str
    layers: int
    num_logical_experts: int
    num_redundant_experts: int
    top_k: int
    batch_size: int
    padded_size: int
    window_size: int
    step_interval: int
    load_collection_phase: str
    steps: int
    rearrangements: int
    rearrangements_completed: int
    layers_committed: int
    balancedness_before: float | None
    balancedness_after: float | None
    balancedness_off_after: float | None
    balancedness_off_mean: float | None
    balancedness_per_step: tuple[float, ...]
    balancedness_off_per_step: tuple[float, ...]
    rank_load_share_per_step: tuple[tuple[float, ...], ...]
    commit_completed_steps: tuple[int, ...]
    initial_placement: InstallReport | None
    bytes_received: int
    bytes_received_per_rank: tuple[int, ...]
    policy: str
    min_balancedness_gain: float
    target_balancedness: float | None
    load_estimate: str
    rearrangement_records: tuple[RearrangementOutcome, ...]
    rearrangements_skipped: dict[str, int]
    experts_moved: int
    bytes_moved: int
    busiest_rank_experts_received: int
    costs: dict[str, Any] | None
    out_dir: str
    commit_seconds: tuple[float, ...]
    step_seconds_p50: float | None
    step_seconds_p99: float | None
    step_seconds_p50_in_flight: float | None
    step_seconds_p50_idle: float | None
    world_cpu_seconds_per_step_p50: float | None
    verifier_seconds_per_step_p50: float | None
    verifier_seconds_per_step_mean: float | None
    step_seconds_p50_without_verifier: float | None
    max_output_error: float
    output_tolerance: OutputTolerance
    checks: dict[str, bool | None]
    check_evidence: dict[str, str]
    first_violation: str | None
    worker_failure: tuple[str, int] | None
    in_flight_at_end: tuple[Any, ...]
    verdict: str
    passed: bool
    wall_seconds: float
    config: dict[str, Any]
    draft: DraftReport | None = None
    #: vLLM's engine serving the workload EPLB off and on (a real model): each engine's figures
    #: (``engine_run.EngineFigures``: start-up, workload seconds, tokens, TTFT and TPOT medians).
    engine_off: Any | None = None
    engine_on: Any | None = None
    #: ``--replica-split`` (``additional_config.eplb_config.replica_split``) and the scope the controller
    #: put in force (``ascend_eplb.control.split_config.SplitScope``; None: not read).
    replica_split: str = "equal"
    split_scope: str | None = None
    #: With the batch split on (empty, None with it off): rank 0's per step, the equal split's
    #: balancedness on the step's counts and placement (``RankStats.balancedness_equal_split_per_step``)
    #: beside ``balancedness_per_step``, what the split executed; and both means over the steps that have
    #: both (``split_steps`` of them).
    balancedness_equal_split_per_step: tuple[float | None, ...] = ()
    split_steps: int = 0
    balancedness_split_mean: float | None = None
    balancedness_equal_split_mean: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The report as ``report.json`` holds it."""
        return _plain(self)


def build_report(
    config: SimulateConfig, routing: Any, results: list[RankStats], wall_s: float, engines: Any | None = None
) -> SimulateReport:

    r0 = results[0]
    bal = list(r0.balancedness_per_step)
    commit_steps = [i for i, c in enumerate(r0.commits_per_step) if c]
    rearr = r0.rearrangements_per_step
    first_rearr = next((i for i, n in enumerate(rearr) if n > 0), None)
    # A rearrangement is complete when its last MoE layer commits (upstream commits layers in order).
    completed = [i for i, c in enumerate(r0.commits_per_step) if routing.num_moe_layers - 1 in c]
    bal_off = list(r0.balancedness_off_per_step)
    before = bal[: first_rearr + 1] if first_rearr is not None else bal
    # From the first completed rearrangement on, routing runs on placements EPLB chose.
    after = bal[completed[0] + 1 :] if completed else []
    off_after = bal_off[completed[0] + 1 :] if completed else []
    received = tuple(int(res.bytes_received or 0) for res in results)  # per rank, measured
    violations = [res.violation for res in results if res.violation is not None]
    # With a draft, the top-level figures are the target's (upstream names its draft "<target> (draft)").
    target = None if r0.draft is None else r0.draft.model.removesuffix(DRAFT_SUFFIX)
    events_file = Path(config.out_dir) / "events.jsonl"
    outcomes = events_outcomes(events_file, config.num_ranks, model=target)
    done = outcomes.records
    verdicts = check_verdicts(
        config, routing, results, violations, experts_moved=_experts_moved(config, events_file),
        gate_skipped=sum(r.rearrangement is not None and r.skipped is not None for r in done),
    )  # fmt: skip
    verdict = run_verdict(verdicts)
    secs = np.array(r0.step_seconds)
    in_flight = np.array(r0.step_in_flight, dtype=bool)
    install = _install(
        config, [res.install for res in results], bal, bal_off, outcomes.install, routing.num_moe_layers,
        _plan_predicted(config, draft=False),
    )  # fmt: skip
    install_layers = 0 if install is None else install.layers_committed
    busiest = [
        a + b for a, b in zip(outcomes.install_received, outcomes.rearrangements_received, strict=True)
    ]

    return SimulateReport(
        ranks=config.num_ranks,
        # The parallel layout served: DP x TP ranks (EP over all), and the MoE row layout the controller
        # used (``ascend_eplb.control.layout``: replicated, gathered, gathered-sp; the replay world split).
        data_parallel_size=config.data_parallel_size,
        tensor_parallel_size=config.tp_size,
        moe_rows=r0.moe_rows,
        # How vLLM ran the model (the real-model world): "eager (enforce_eager)" or the compilation mode
        # and backend vLLM's CPU platform resolved (DYNAMO_TRACE_ONCE, eager|inductor).
        compilation=_compilation_title(config, r0.compilation),
        model=routing.architecture if not config.replays else "replay",
        format=config.quant_format,
        trace=routing.name,
        layers=routing.num_moe_layers,
        num_logical_experts=routing.num_logical_experts,
        num_redundant_experts=config.num_redundant_experts,
        top_k=routing.top_k,
        batch_size=config.batch_size,
        padded_size=config.effective_padded_size,
        window_size=config.window_size,
        step_interval=config.step_interval,
        load_collection_phase=config.load_collection_phase,
        steps=r0.steps_run,
        rearrangements=r0.num_rearrangements,
        rearrangements_completed=_completed(done, len(completed)),
        layers_committed=sum(len(c) for c in r0.commits_per_step) + install_layers,
        balancedness_before=_mean(before),
        balancedness_after=_mean(after),
        balancedness_off_after=_mean(off_after),
        balancedness_off_mean=_mean(bal_off),
        balancedness_per_step=tuple(bal),
        balancedness_off_per_step=tuple(bal_off),
        rank_load_share_per_step=r0.rank_load_share_per_step,
        commit_completed_steps=tuple(completed),
        initial_placement=install,
        bytes_received=sum(received),
        bytes_received_per_rank=received,
        # The placement policy and the gain gate the serving config set, and what each rearrangement
        # did with them: the serving events file's records (EP rank 0's events.jsonl).
        policy=config.policy,
        min_balancedness_gain=config.min_balancedness_gain,
        target_balancedness=config.target_balancedness,
        load_estimate=config.load_estimate,
        rearrangement_records=done,
        rearrangements_skipped={r: sum(x.skipped == r for x in done) for r in SKIP_REASONS},
        experts_moved=sum(x.experts_moved for x in done) + _or0(install and install.experts_moved),
        bytes_moved=sum(x.bytes_moved for x in done) + _or0(install and install.bytes_moved),
        busiest_rank_experts_received=max(busiest, default=0),
        costs=_costs(
            config, max(outcomes.rearrangements_received, default=0), outcomes.rearrangement_layer_commits
        ),
        out_dir=str(Path(config.out_dir).resolve()),
        commit_seconds=tuple(float(secs[i]) for i in commit_steps),
        step_seconds_p50=_percentile(secs, 50),
        step_seconds_p99=_percentile(secs, 99),
        step_seconds_p50_in_flight=float(np.percentile(secs[in_flight], 50)) if in_flight.any() else None,
        step_seconds_p50_idle=float(np.percentile(secs[~in_flight], 50)) if (~in_flight).any() else None,
        # CPU seconds one step costs the whole world (sum over ranks of each rank's median): what the
        # step needs from the machine whatever else runs on it; wall / this = cores the world got.
        world_cpu_seconds_per_step_p50=_sum_or_none(_percentile(res.step_cpu_seconds, 50) for res in results),
        # The serving verifier's own time per step (its checks at each commit and its collective at the
        # step boundary after one), measured inside the same steps: the cost of ASCEND_EPLB_VERIFY=1.
        verifier_seconds_per_step_p50=_percentile(r0.verifier_seconds, 50),
        verifier_seconds_per_step_mean=_mean(list(r0.verifier_seconds)),
        step_seconds_p50_without_verifier=_percentile(secs - np.array(r0.verifier_seconds), 50),
        max_output_error=max(res.max_output_error for res in results),
        output_tolerance=r0.output_tolerance,  # what the world's outputs check compared with
        # True passed, False failed, None not judged; ``check_evidence``: what each check saw, or why not.
        checks={name: JUDGED[verdicts[name][0]] for name in CHECKS},
        check_evidence={name: verdicts[name][1] for name in CHECKS},
        first_violation=violations[0][1] if violations else None,
        worker_failure=r0.worker_failure,
        in_flight_at_end=tuple(cycle for res in results for cycle in res.in_flight_at_end),
        verdict=verdict,
        passed=verdict == PASSED,
        wall_seconds=wall_s,
        config=config.to_json(),
        draft=_draft(config, results, first_rearr),
        engine_off=None if engines is None else engines.off,
        engine_on=None if engines is None else engines.on,
        replica_split=config.replica_split,
        split_scope=r0.split_scope,
        **_split_figures(bal, r0.balancedness_equal_split_per_step),
    )


def _split_figures(executed: list[float | None], equal: tuple[float | None, ...]) -> dict[str, Any]:
    """The batch split's fields of the report: ``equal`` per step (empty with the split off) and, over the
    steps where both exist, the mean of ``executed`` and of ``equal``."""
    pairs = zip(executed, equal, strict=True) if equal else ()
    both = [(x, e) for x, e in pairs if x is not None and e is not None]
    return {
        "balancedness_equal_split_per_step": tuple(equal),
        "split_steps": len(both),
        "balancedness_split_mean": _mean([x for x, _ in both]),
        "balancedness_equal_split_mean": _mean([e for _, e in both]),
    }


def _draft(config: SimulateConfig, results: list[RankStats], first_rearr: int | None) -> DraftReport | None:
    """With ``--speculative-tokens``: :class:`DraftReport` (None without a draft), its figures computed as
    the target's are (``first_rearr``: the step the first rearrangement started, both models' alike)."""

    drafts = [res.draft for res in results]
    d0 = drafts[0]
    if d0 is None:
        return None
    ranks = [d for d in drafts if d is not None]
    bal, bal_off = list(d0.balancedness_per_step), list(d0.balancedness_off_per_step)
    completed = [i for i, c in enumerate(d0.commits_per_step) if d0.num_moe_layers - 1 in c]
    before = bal[: first_rearr + 1] if first_rearr is not None else bal
    after = bal[completed[0] + 1 :] if completed else []
    off_after = bal_off[completed[0] + 1 :] if completed else []
    received = tuple(None if d is None else d.bytes_received for d in drafts)
    outcomes = events_outcomes(Path(config.out_dir) / "events.jsonl", config.num_ranks, model=d0.model)
    done = outcomes.records
    install = _install(
        config, [None if d is None else d.install for d in drafts], bal, bal_off, outcomes.install,
        d0.num_moe_layers, _plan_predicted(config, draft=True),
    )  # fmt: skip
    busiest = [
        a + b for a, b in zip(outcomes.install_received, outcomes.rearrangements_received, strict=True)
    ]
    return DraftReport(
        model=d0.model,
        architecture="DeepSeekMTP",
        forwards_per_step=d0.forwards_per_step,
        layers=d0.num_moe_layers,
        rearrangements_completed=_completed(done, len(completed)),
        layers_committed=sum(len(c) for c in d0.commits_per_step)
        + (0 if install is None else d0.num_moe_layers),
        balancedness_before=_mean(before),
        balancedness_after=_mean(after),
        balancedness_off_after=_mean(off_after),
        balancedness_off_mean=_mean(bal_off),
        balancedness_per_step=tuple(bal),
        balancedness_off_per_step=tuple(bal_off),
        commit_completed_steps=tuple(completed),
        initial_placement=install,
        bytes_received=None if None in received else sum(r or 0 for r in received),
        bytes_received_per_rank=received,
        rearrangement_records=done,
        rearrangements_skipped={r: sum(x.skipped == r for x in done) for r in SKIP_REASONS},
        experts_moved=sum(x.experts_moved for x in done) + _or0(install and install.experts_moved),
        bytes_moved=sum(x.bytes_moved for x in done) + _or0(install and install.bytes_moved),
        busiest_rank_experts_received=max(busiest, default=0),
        max_output_error=max(d.max_output_error for d in ranks),
        load_steps_recorded=max(d.load_steps_recorded for d in ranks),
        load_selections=d0.load_selections,
    )


def _mean(values: list[float | None]) -> float | None:
    """The mean of the steps' figures that exist (None: a step that recorded no load), or None."""
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def _percentile(values: Any, q: float) -> float | None:
    """The ``q``-th percentile of ``values``, or None when there are none (a run that served no step)."""
    return float(np.percentile(values, q)) if len(values) else None


def _sum_or_none(values: Any) -> float | None:
    known = list(values)
    return None if None in known else float(sum(known))


def _completed(records: tuple[RearrangementOutcome, ...], cycles: int) -> int:
    """The rearrangements that completed: one ``rearrangement`` record each, made at its last commit; a
    window the gain gate skipped is not one, though upstream commits its unchanged layers (``cycles``,
    the commit cycles that reached the last layer, counted them: "2 completed" when the gate skipped
    both). ``cycles`` where the events file records nothing (a rank on another host wrote it)."""
    if not records:
        return cycles
    return sum(r.skipped is None and r.rearrangement is not None for r in records)


def _experts_moved(config: SimulateConfig, events_file: Path) -> int | None:
    """The experts every model's rearrangements and start-up installs moved, as the events file's commits
    and installs say (None: no events file here)."""
    if not events_file.is_file():
        return None
    everything = events_outcomes(events_file, config.num_ranks)
    return sum(everything.install_received) + sum(everything.rearrangements_received)


def _compilation_title(config: SimulateConfig, seen: str | None) -> str | None:
    """How the world ran the model, named by what the run asked: a ``--compilation-config`` of mode 0
    (NONE) runs eager, and is titled by its mode, not as ``enforce_eager``."""
    compilation = config.compilation
    if seen is None or compilation is None or is_compiled(compilation):
        return seen
    return "NONE (compilation_config mode 0: eager execution)"


def _or0(value: int | None) -> int:
    return value or 0


def _install(
    config: SimulateConfig,
    seen: list[InstallSeen | None],
    bal: list[float],
    bal_off: list[float],
    record: InitialPlacementRecord | None,
    num_moe_layers: int,
    predicted: float | None,
) -> InstallReport | None:
    """:class:`InstallReport` of one model of a run with ``--initial-placement`` (None without): ``seen``
    what each rank saw of it right after start-up, ``bal`` and ``bal_off`` its balancedness per step,
    ``record`` its ``initial_placement`` record, ``predicted`` what ``plan`` predicted for it."""
    if config.initial_placement is None:
        return None
    held = [None if s is None else s.slot_mismatches for s in seen]
    first = seen[0]
    return InstallReport(
        source=config.initial_placement,
        layers_committed=num_moe_layers,  # the install commits every layer, changed or not
        layers_changed=None if record is None else record.layers_changed,
        experts_moved=None if record is None else record.experts_moved,
        bytes_moved=None if record is None else record.bytes_moved,
        first_step_balancedness=bal[0] if bal else None,
        first_step_planned=None if first is None else first.first_step_planned,
        first_step_off=bal_off[0] if bal_off else None,
        plan_predicted_on_its_load=predicted,
        slots_hold_their_experts=None if None in held else all(m == [] for m in held),
        slot_mismatches=tuple(tuple(m) for m in held if m),
    )


def _plan_predicted(config: SimulateConfig, draft: bool) -> float | None:
    """The mean balancedness ``plan`` predicted for the target's (``draft``: its draft's) placement of
    ``--initial-placement`` on the load it was made from: the ``source`` of ``plan``'s file, each model's
    in a file of several (``source.models``, by role); None: an events file, or no provenance."""
    if config.initial_placement is None:
        return None
    try:
        raw = read_regular_file(config.initial_placement, EVENTS_FILE)
        provenance = json.loads(raw.decode("utf-8")).get("source")
    except (ValueError, AttributeError):
        return None  # an events file (JSON lines), or a file without provenance
    if not isinstance(provenance, dict):
        return None
    entries = provenance.get("models", [provenance])
    for entry in entries if isinstance(entries, list) else []:
        name = entry.get("model") if isinstance(entry, dict) else None
        if isinstance(entry, dict) and is_draft(name if isinstance(name, str) else None) == draft:
            return entry.get("balancedness_after")
    return None


def events_outcomes(events_file: Path, num_ranks: int, *, model: str | None = None) -> EventsOutcomes:
    """What the serving events file (EP rank 0's) says the run did, from its last run, for ``model``
    (upstream's name; None: every model's): its ``rearrangement`` records, oldest first, each with its
    ``rearrangement_realised`` balancedness; the start-up install's record; and per rank the logical
    experts it received, replayed from the committed placements (the install's from upstream's initial
    placement, each ``commit`` from the placement before it:
    :func:`ascend_eplb.control.measures.received_experts`). A rearrangement still moving when the run
    ended has no ``rearrangement`` record yet (its committed layers are counted per rank). No events file
    (a rank on another host wrote it): nothing.
    """
    nothing = (0,) * num_ranks
    if not events_file.is_file():
        return EventsOutcomes((), None, nothing, nothing, 0)
    runs = read_events(events_file).runs
    last = [r for _, r in runs[-1].records if model is None or r.model == model] if runs else []
    realised: dict[tuple[str | None, int | None], tuple[float, int]] = {}
    for r in last:
        if not isinstance(r, RearrangementRealisedRecord):
            continue
        # A skipped one's own window; one that moved, every window under its placement so far (the
        # last record naming it placed_by; a file recorded before that field: its next window).
        if r.placed_by is None or r.windows_realised is None or r.balancedness_realised_mean is None:
            realised[r.model, r.rearrangement] = (r.balancedness_realised, 1)
        else:
            realised.setdefault((r.model, r.rearrangement), (r.balancedness_realised, 1))
            realised[r.model, r.placed_by] = (r.balancedness_realised_mean, r.windows_realised)
    records = tuple(_outcome(r, realised) for r in last if isinstance(r, RearrangementRecord))
    installs = [r for r in last if isinstance(r, InitialPlacementRecord)]
    install_received = torch.zeros(num_ranks, dtype=torch.int64)
    received = torch.zeros(num_ranks, dtype=torch.int64)
    commits = 0
    placements: dict[str | None, torch.Tensor] = {}  # per model, the placement in force
    for r in last:
        if isinstance(r, InitialPlacementRecord):
            new = torch.tensor(r.placement, dtype=torch.int64)
            start = measures.upstream_initial_placement(
                r.num_logical_experts, new.shape[1] - r.num_logical_experts, new.shape[0]
            )
            install_received += measures.received_experts(start, new, num_ranks).sum(dim=0)
            placements[r.model] = new
        elif isinstance(r, WindowRecord) and r.model not in placements:
            e, p = len(r.load[0]), r.num_physical_experts or len(r.load[0])
            placements[r.model] = measures.upstream_initial_placement(e, p - e, len(r.load))
        elif isinstance(r, CommitRecord) and r.placement is not None and r.model in placements:
            current = placements[r.model]
            row = torch.tensor([r.placement], dtype=torch.int64)  # (1, P)
            received += measures.received_experts(current[r.layer : r.layer + 1], row, num_ranks)[0]
            current[r.layer] = row[0]
            commits += 1
    install = installs[-1] if installs else None
    return EventsOutcomes(
        records, install, tuple(install_received.tolist()), tuple(received.tolist()), commits
    )


def _outcome(
    r: RearrangementRecord, realised: dict[tuple[str | None, int | None], tuple[float, int]]
) -> RearrangementOutcome:
    mean, windows = realised.get((r.model, r.rearrangement), (None, 0))  # a window without load: none
    return RearrangementOutcome(
        model=r.model, rearrangement=r.rearrangement, step=r.step, policy=r.policy, skipped=r.skipped,
        balancedness_before=r.balancedness_before, balancedness_planned=r.balancedness_planned,
        load_estimate=r.load_estimate, estimate_balancedness_before=r.estimate_balancedness_before,
        estimate_balancedness_planned=r.estimate_balancedness_planned, balancedness_realised=mean,
        windows_realised=windows, experts_moved=r.experts_moved, bytes_moved=r.bytes_moved,
        layers_changed=r.layers_changed,
    )  # fmt: skip


def _costs(config: SimulateConfig, busiest_experts: int, layer_commits: int) -> dict | None:
    """With ``--model-config``: the costs at the model's size (:mod:`ascend_eplb.tools.costs`); the busiest
    rank's experts received per layer of a rearrangement are the simulated ones (the rank receiving most
    over the rearrangements' layer commits, the start-up install not counted: it is no rearrangement's
    cost), per layer committed."""
    if config.model_config is None:
        return None

    model = read_model_size(config.model_config)
    per_layer = busiest_experts / layer_commits if busiest_experts and layer_commits else None
    c = estimate_costs(
        model,
        config.quant_format,
        num_ranks=config.num_ranks,
        num_redundant_experts=config.num_redundant_experts,
        link_gbps=config.link_gbps,
        busiest_rank_experts_per_layer=per_layer,
    )
    return {"model": model.source, "num_moe_layers": model.num_moe_layers, **c.to_json()}
