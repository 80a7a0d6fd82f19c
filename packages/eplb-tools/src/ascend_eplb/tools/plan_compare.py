"""``ascend-eplb plan --policies``: policies compared window by window on recorded load.

:func:`load_windows` reads the closed windows of a load file (an events file's, a routing trace's
windows of :data:`DEFAULT_WINDOW_SEQUENCES` sequences, one load matrix); :func:`compare_policies` runs
each policy on each load estimate through them with serving's gate
(:func:`ascend_eplb.control.gate.decide`, which imports vLLM: only this mode does), from upstream's
initial placement; :func:`recommend_gate` gives gate values from a gate-off run and :func:`choose` the
run to serve with. The text is :func:`ascend_eplb.tools.plan_text.format_comparison`'s.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ascend_eplb.control import measures
from ascend_eplb.control.estimate import LoadEstimate
from ascend_eplb.control.policy_config import SKIP_REASONS, PolicySettings
from ascend_eplb.control.values import is_int
from ascend_eplb.integration import metrics
from ascend_eplb.integration.events.reader import RecordedLoad
from ascend_eplb.tools import trace
from ascend_eplb.tools.plan import validate_plan_args

__all__ = [
    "DEFAULT_WINDOW_SEQUENCES",
    "GATE_DECIMALS",
    "Candidates",
    "Choice",
    "Deployment",
    "ExpertBytes",
    "GateRecommendation",
    "PolicyComparison",
    "PolicyRun",
    "WindowOutcome",
    "Windows",
    "choose",
    "compare_policies",
    "load_windows",
    "recommend_gate",
    "trace_windows",
]

#: Sequences per window when the load is a routing trace: the ESFT windows of SIMULATE.md (and the policy
#: benchmark's, ``packages/eplb-control/benchmarks/bench_policy.py``).
DEFAULT_WINDOW_SEQUENCES = 4
#: Decimals of the recommended gate values.
GATE_DECIMALS = 3


@dataclass(frozen=True)
class WindowOutcome:
    """What one run did at one closed window (one rearrangement), figures on the ``(L, E)`` loads.

    ``balancedness_before``: the window under the placement in force when it closed;
    ``balancedness_after``: the window under the placement in force after the rearrangement (the kept one
    when skipped); ``balancedness_planned``: the window under the policy's placement (None when the
    policy did not run: ``"balanced"``, ``"no_load"``); ``estimate_balancedness_before`` and
    ``estimate_balancedness_planned``: the load estimate the policy planned on under the committed and
    the policy's placement (what the gate judged; None on the window, or where the policy did not run);
    ``balancedness_realised``: the next window under the placement in force after this one (what it
    served until the next rearrangement; None for the last window); ``experts_moved``:
    :func:`ascend_eplb.control.measures.moved_experts` summed over layers (0 when skipped);
    ``bytes_moved``: ``experts_moved`` x one expert's bytes, estimated (None without a model size);
    ``skipped``: None or the gate's reason (:data:`ascend_eplb.control.policy_config.SKIP_REASONS`).
    """

    window: int  # 1-based, as the events file's ``rearrangement``
    skipped: str | None
    balancedness_before: float
    balancedness_after: float
    balancedness_planned: float | None
    estimate_balancedness_before: float | None
    estimate_balancedness_planned: float | None
    balancedness_realised: float | None
    experts_moved: int
    bytes_moved: int | None


@dataclass(frozen=True)
class PolicyRun:
    """One policy on one load estimate (and a gate) through every window, each decision
    :func:`ascend_eplb.control.gate.decide`'s.

    ``load_estimate``: what the policy planned on (``additional_config.eplb_config.load_estimate``).
    ``gate``: ``"off"``, ``"given"`` (the command's ``--min-balancedness-gain`` /
    ``--target-balancedness``) or ``"recommended"`` (:func:`recommend_gate` on the same policy and
    estimate's run with the gate off). Totals: ``rearranged`` (windows that moved to the policy's
    placement), ``skipped`` (by reason, every reason listed), ``experts_moved`` and ``bytes_moved``
    (sums), ``mean_balancedness_after`` and ``mean_balancedness_realised`` (means over the windows that
    have the figure).
    """

    label: str
    policy: str
    load_estimate: str
    gate: str
    min_balancedness_gain: float
    target_balancedness: float | None
    windows: list[WindowOutcome]
    rearranged: int
    skipped: dict[str, int]
    experts_moved: int
    bytes_moved: int | None
    mean_balancedness_after: float
    mean_balancedness_realised: float | None

    def ascend_keys(self) -> dict[str, Any]:
        """The ``additional_config.eplb_config`` keys that serve this run, each only where it differs
        from its default (upstream's policy, on the window, gate off)."""
        keys: dict[str, Any] = {}
        if self.policy != "default":
            keys["policy"] = self.policy
        if self.load_estimate != "window":
            keys["load_estimate"] = self.load_estimate
        if self.min_balancedness_gain > 0:
            keys["min_balancedness_gain"] = self.min_balancedness_gain
        if self.target_balancedness is not None:
            keys["target_balancedness"] = self.target_balancedness
        return keys


@dataclass(frozen=True)
class GateRecommendation:
    """Gate values for one policy on one load estimate (:func:`recommend_gate` gives the rule)."""

    policy: str
    load_estimate: str
    min_balancedness_gain: float
    target_balancedness: float
    mean_in_force: float  # the figure target_balancedness is rounded from
    mean_drift: float  # the figure min_balancedness_gain is rounded from


@dataclass(frozen=True)
class Choice:
    """The run to serve with (:func:`choose`): its label, its ``additional_config.eplb_config`` keys
    (``ascend_keys``: the differences from the defaults), its mean realised balancedness and experts
    moved, and the margin of the rule."""

    label: str
    ascend_keys: dict[str, Any]
    mean_balancedness_realised: float
    experts_moved: int
    margin: float


@dataclass(frozen=True)
class PolicyComparison:
    """The runs of :func:`compare_policies` side by side on one sequence of windows."""

    source: str
    window: str  # what one window is ("4 sequences", "an events-file window", "the whole load")
    evidence: str  # what the load estimate took in per window
    num_windows: int
    num_ranks: int
    num_nodes: int
    num_expert_groups: int
    num_moe_layers: int
    num_logical_experts: int
    num_redundant_experts: int
    expert_nbytes: int | None
    bytes_note: str  # where expert_nbytes comes from, or why bytes are not given
    load_estimates: list[str]
    runs: list[PolicyRun]
    recommended_gates: list[GateRecommendation]
    recommendation_note: str | None = None  # why no gate is recommended
    choice: Choice | None = None  # None: one window, no placement was seen serving a next one

    def to_json(self) -> dict:
        return asdict(self)

    def run(self, policy: str, gate: str = "off", load_estimate: str = "window") -> PolicyRun:
        """The run of ``policy`` on ``load_estimate`` with ``gate`` (``"off"``, ``"given"``,
        ``"recommended"``)."""
        for r in self.runs:
            if r.policy == policy and r.gate == gate and r.load_estimate == load_estimate:
                return r
        raise KeyError(f"no run of the {policy} policy on the {load_estimate} load with the gate {gate}")


@dataclass(frozen=True)
class Windows:
    """Closed load windows, oldest first (:func:`load_windows` reads them from a file).

    Attributes:
        loads: ``[L, E]`` each, >= 0 (int64 counts or float64).
        source: where they come from (a file), for messages and the report.
        window: what one window is (``"4 sequences (of 40)"``, ``"an events-file window ..."``).
        new_selections: ``[L, E]`` per window, the selections recorded since the previous window that
            serving's load estimate took in (an events file recorded with the estimate on); None: each
            window's own load is its new evidence (a trace's windows do not overlap).
        evidence: what the load estimate takes in per window, in words.
    """

    loads: tuple[np.ndarray, ...]
    source: str = ""
    window: str = ""
    new_selections: tuple[np.ndarray, ...] | None = None
    evidence: str = "each window's load"


@dataclass(frozen=True)
class Deployment:
    """What upstream's ``EplbState.rearrange`` passes its policy beside the load: EP ranks N, the
    redundancy level (P = E + ``num_redundant_experts``), nodes and the model's expert groups."""

    num_ranks: int
    num_redundant_experts: int
    num_nodes: int = 1
    num_expert_groups: int = 1


@dataclass(frozen=True)
class Candidates:
    """What :func:`compare_policies` runs: each policy (``additional_config.eplb_config.policy``) on each
    load estimate (``load_estimate``) with the gate off, and with the given gate
    (``min_balancedness_gain`` > 0 or ``target_balancedness`` set)."""

    policies: tuple[str, ...] = ("default", "migration_aware")
    min_balancedness_gain: float = 0.0
    target_balancedness: float | None = None
    load_estimates: tuple[str, ...] = ("window", "pooled")


@dataclass(frozen=True)
class ExpertBytes:
    """One expert's bytes (:func:`ascend_eplb.quant_views.get_format`'s ``expert_nbytes`` at the model's
    size; None: not computed) and where they come from, or why not (``note``)."""

    nbytes: int | None = None
    note: str = ""


def trace_windows(routing: Any, window_sequences: int) -> list[np.ndarray]:
    """int64 ``[L, E]`` per window of ``window_sequences`` consecutive sequences of a routing trace
    (:class:`~ascend_eplb.tools.trace.RoutingTrace`; the last window may hold fewer): each layer's
    top-k selections per logical expert over the window's tokens."""

    if not is_int(window_sequences) or window_sequences < 1:
        raise ValueError(f"window sequences={window_sequences!r}: must be an integer >= 1")
    offsets = np.asarray(routing.seq_offsets)
    bounds = [*offsets[:-1:window_sequences].tolist(), int(offsets[-1])]
    e = routing.num_logical_experts
    out = []
    for start, end in itertools.pairwise(bounds):
        ids = routing.topk_ids[:, start:end].reshape(routing.num_moe_layers, -1)
        out.append(np.stack([np.bincount(row, minlength=e) for row in ids]).astype(np.int64))
    return out


def load_windows(
    path: str | Path,
    *,
    window_sequences: int | None = None,
    last: int | None = None,
    recorded: RecordedLoad | None = None,
) -> Windows:
    """The closed windows of a load file, oldest first (each ``[L, E]``, int64 when the file holds
    counts, else float64):

    - a serving events file (``.jsonl``): the ``window`` records of one model in its last run (the
      ``last`` ones; ``recorded``: the file as :func:`~ascend_eplb.tools.trace.load_recorded` read it);
    - a routing trace (a compact ``.npz`` or ESFT's ``expert_weights_<layer>.txt`` folder, ESFT's 64
      experts, top-6): windows of ``window_sequences`` sequences (:func:`trace_windows`; None:
      :data:`DEFAULT_WINDOW_SEQUENCES`);
    - any other load matrix (:func:`~ascend_eplb.tools.trace.load_load_matrix`): one window.

    :attr:`Windows.new_selections` (the load estimate's evidence: selections since the previous
    rearrangement) is an events file's recorded ``new_selections`` when every window holds them, else
    each window's load; :attr:`Windows.evidence` says which.

    Raises:
        ValueError: the file cannot be read as such, or ``window_sequences`` given for a file other than
            a trace or ``last`` for a file other than an events file (naming it and the rule).
    """

    path = Path(path)
    suffix = path.suffix.lower()
    is_trace = suffix == ".npz" or path.is_dir()
    if window_sequences is not None and not is_trace:
        raise ValueError(
            f"window sequences={window_sequences}: is only for a routing trace (.npz or a folder of ESFT "
            "expert_weights_<layer>.txt); an events file's windows are its own"
        )
    if suffix == ".jsonl":
        recorded = trace.load_recorded(path) if recorded is None else recorded
        trace.load_load_matrix(path, last=last, recorded=recorded)  # its checks of the values
        chosen = slice(-last, None) if last is not None else slice(None)
        windows = tuple(w.numpy() for w in recorded.windows[chosen])
        what = "an events-file window (one rearrangement of the server that recorded it)"
        if recorded.new_selections is not None:
            return Windows(
                windows,
                str(path),
                what,
                tuple(w.numpy() for w in recorded.new_selections[chosen]),
                "the selections each window record holds since the previous one, as serving's estimate "
                "took them in",
            )
        return Windows(
            windows,
            str(path),
            what,
            evidence="each window's load (the file records no selections since each rearrangement: it "
            "was served with load_estimate=window; where upstream's windows overlapped, window_size > "
            "step_interval, their tokens count more than once)",
        )
    if last is not None:
        raise ValueError(f"last={last}: is only for an events file (.jsonl)")
    if is_trace:
        window_sequences = DEFAULT_WINDOW_SEQUENCES if window_sequences is None else window_sequences
        if suffix == ".npz":
            routing = trace.load_trace(path)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                routing = trace.load_trace(trace.convert(path, Path(scratch) / "trace.npz"))
        sequences = int(len(routing.seq_offsets) - 1)
        return Windows(
            tuple(trace_windows(routing, window_sequences)),
            str(path),
            f"{window_sequences} sequences (of {sequences})",
            evidence="each window's tokens (a trace's windows do not overlap)",
        )
    load = trace.load_load_matrix(path)
    if np.array_equal(load, np.round(load)) and load.max() < 2**53:
        load = load.astype(np.int64)
    return Windows((load,), str(path), "the whole load (one window)")


def _run_policy(
    windows: Windows,
    deployment: Deployment,
    settings: Any,
    expert_bytes: ExpertBytes,
    *,
    label: str,
    gate: str,
) -> PolicyRun:
    """``settings`` through ``windows`` as serving runs them: with a load estimate, a
    :class:`~ascend_eplb.control.estimate.LoadEstimate` takes in each window's new selections before
    its decision (``AscendEplbState.rearrange``), and :func:`ascend_eplb.control.gate.decide` plans and
    judges on its load (the gated policy's call)."""
    # local: control's gate imports vLLM, which only `plan --policies` needs
    from ascend_eplb.control.gate import decide

    d = deployment
    loads = [torch.from_numpy(np.asarray(w)) for w in windows.loads]
    evidence = (
        loads if windows.new_selections is None else [torch.from_numpy(w) for w in windows.new_selections]
    )
    num_moe_layers, num_experts = loads[0].shape
    placement = measures.upstream_initial_placement(num_experts, d.num_redundant_experts, num_moe_layers)
    expert_nbytes = expert_bytes.nbytes
    estimate = LoadEstimate() if settings.estimating else None

    def mean_balancedness(load: torch.Tensor, p: torch.Tensor) -> float:
        return measures.mean_balancedness(measures.rank_loads(load, p, d.num_ranks))

    outcomes = []
    for i, load in enumerate(loads):
        before = mean_balancedness(load, placement)
        if estimate is not None:
            estimate.update(evidence[i])
        new, decision = decide(
            settings, load, num_experts + d.num_redundant_experts, d.num_expert_groups, d.num_nodes,
            d.num_ranks, placement, estimate=None if estimate is None else estimate.load,
        )  # fmt: skip
        moved = int(decision.experts_moved or 0)
        realised = mean_balancedness(loads[i + 1], new) if i + 1 < len(loads) else None
        on_estimate = estimate is not None
        outcomes.append(
            WindowOutcome(
                window=i + 1,
                skipped=decision.skipped,
                balancedness_before=before,
                balancedness_after=mean_balancedness(load, new),
                balancedness_planned=decision.window_balancedness_planned,
                estimate_balancedness_before=decision.balancedness_before if on_estimate else None,
                estimate_balancedness_planned=decision.balancedness_planned if on_estimate else None,
                balancedness_realised=realised,
                experts_moved=moved,
                bytes_moved=None if expert_nbytes is None else metrics.bytes_moved(moved, expert_nbytes),
            )
        )
        placement = new
    realised = [o.balancedness_realised for o in outcomes if o.balancedness_realised is not None]
    return PolicyRun(
        label=label,
        policy=settings.policy,
        load_estimate=settings.load_estimate,
        gate=gate,
        min_balancedness_gain=float(settings.min_balancedness_gain),
        target_balancedness=settings.target_balancedness,
        windows=outcomes,
        rearranged=sum(o.skipped is None for o in outcomes),
        skipped={reason: sum(o.skipped == reason for o in outcomes) for reason in SKIP_REASONS},
        experts_moved=sum(o.experts_moved for o in outcomes),
        bytes_moved=None if expert_nbytes is None else sum(o.bytes_moved or 0 for o in outcomes),
        mean_balancedness_after=float(np.mean([o.balancedness_after for o in outcomes])),
        mean_balancedness_realised=float(np.mean(realised)) if realised else None,
    )


def recommend_gate(run: PolicyRun) -> GateRecommendation | None:
    """Gate values for ``run``'s policy and load estimate from its run with the gate off (None: fewer
    than 2 windows, so no placement was seen serving a next one).

    The rule, in the gate's own measure (the balancedness of the load it judges: the window, or the load
    estimate), both figures over the windows that have a next one, rounded to :data:`GATE_DECIMALS`:

    - ``target_balancedness`` = the mean balancedness of the placement in force at each next window
      (on the window: what the run's placements realise on the next window): what rearranging at every
      window keeps on average. A window whose placement in force is at least this balanced has, on
      average, nothing to gain (skip ``"balanced"``).
    - ``min_balancedness_gain`` = the mean drop of a fresh placement from its planned figure to the next
      window's judgement of it (``planned - before`` of the next window for each rearranged window, the
      mean clipped at 0): how much of a placement's fit the load's drift takes away before it serves.
      A planned gain below it does not survive into the window the placement serves (skip
      ``"min_gain"``).

    The values are clipped into the keys' ranges (``[0, 0.999]``, ``[0.001, 1]``).
    """
    windows = run.windows
    if len(windows) < 2:
        return None
    if run.load_estimate == "window":
        # The next window under the placement in force after this one; bit for bit the decision's
        # figures (after = planned where the policy's placement was taken).
        judged = [(o.balancedness_realised, o.balancedness_after) for o in windows[:-1]]
    else:
        judged = [
            (nxt.estimate_balancedness_before, o.estimate_balancedness_planned)
            for o, nxt in itertools.pairwise(windows)
        ]
    kept = [before for before, _ in judged if before is not None]  # None: the next window had no load
    in_force = float(np.mean(kept)) if kept else 1.0
    drops = [
        planned - before
        for o, (before, planned) in zip(windows, judged, strict=False)
        if o.skipped is None and before is not None and planned is not None
    ]
    drift = max(0.0, float(np.mean(drops))) if drops else 0.0
    step = 10.0**-GATE_DECIMALS
    return GateRecommendation(
        policy=run.policy,
        load_estimate=run.load_estimate,
        min_balancedness_gain=min(round(drift, GATE_DECIMALS), 1 - step),
        target_balancedness=min(max(round(in_force, GATE_DECIMALS), step), 1.0),
        mean_in_force=in_force,
        mean_drift=drift,
    )


def choose(runs: Sequence[PolicyRun], margin: float) -> Choice | None:
    """The run to serve with: the highest mean realised balancedness (the next window under each
    placement: what serving sees); among the runs within ``margin`` of it, the one that moves the fewest
    experts (the first in ``runs`` on a tie). None: no run has a realised figure (one window)."""
    judged = [r for r in runs if r.mean_balancedness_realised is not None]
    if not judged:
        return None
    best = max(r.mean_balancedness_realised for r in judged)  # type: ignore[type-var]
    near = [r for r in judged if r.mean_balancedness_realised >= best - margin]  # type: ignore[operator]
    chosen = min(near, key=lambda r: r.experts_moved)
    assert chosen.mean_balancedness_realised is not None
    return Choice(chosen.label, chosen.ascend_keys(), chosen.mean_balancedness_realised, chosen.experts_moved,
                  margin)  # fmt: skip


def _label(policy: str, load_estimate: str, estimates: Sequence[str]) -> str:
    """A run's name: its policy, and its load estimate where more than one is compared."""
    return policy if len(estimates) == 1 else f"{policy} ({load_estimate})"


def compare_policies(
    windows: Windows,
    deployment: Deployment,
    candidates: Candidates = Candidates(),
    expert_bytes: ExpertBytes = ExpertBytes(),
) -> PolicyComparison:
    """Each policy of ``candidates`` on each of its load estimates through ``windows`` from upstream's
    initial placement (``measures.upstream_initial_placement``), each window decided by serving's own
    gate function (:func:`ascend_eplb.control.gate.decide`: upstream's ``DefaultEplbPolicy`` for
    ``"default"``, :class:`ascend_eplb.control.policy.MigrationAwarePolicy` for ``"migration_aware"``,
    the all-zero window skipped as ``"no_load"``; with the load estimate, serving's
    :class:`~ascend_eplb.control.estimate.LoadEstimate` fed each window's new selections) and given the
    placement the previous decision left in force.

    Runs, in order: every policy and estimate with the gate off; with the given gate (if any); with the
    gate :func:`recommend_gate` gives for it (unless no window has a next one). The choice
    (:func:`choose`) takes the margin of the migration-aware policy's own tolerance
    (``MigrationAwarePolicy.balancedness_tolerance``: the balance it counts as upstream's).

    Raises:
        ValueError: naming the value and the rule: no window, windows of different shapes, a policy,
            load estimate or gate value breaking start-up's rules (``ascend_eplb.control.policy_config``),
            an invalid redundancy level or ranks, nodes and expert groups (:func:`validate_plan_args`).
    """
    # local: control's policy imports vLLM, which only `plan --policies` needs
    from ascend_eplb.control.policy import MigrationAwarePolicy

    d, c = deployment, candidates
    if not windows.loads:
        raise ValueError(f"{windows.source or 'load'}: no window to rearrange on")
    arrays = [np.asarray(w) for w in windows.loads]
    shape = arrays[0].shape
    for i, w in enumerate(arrays):
        if w.shape != shape:
            raise ValueError(f"window {i + 1} has shape {w.shape}: every window must be {shape} [L, E]")
        if w.size and (not np.isfinite(w).all() or w.min() < 0):
            raise ValueError(f"window {i + 1}: load must be finite and >= 0")
    if windows.new_selections is not None and len(windows.new_selections) != len(arrays):
        raise ValueError(
            f"new selections: {len(windows.new_selections)} given for {len(arrays)} windows: one per window"
        )
    validate_plan_args(shape, d.num_ranks, d.num_nodes, d.num_expert_groups, [d.num_redundant_experts])
    if not c.policies:
        raise ValueError("policies: give at least one of default, migration_aware")
    if not c.load_estimates:
        raise ValueError("load estimates: give at least one of window, pooled")
    for estimate in c.load_estimates:
        PolicySettings(load_estimate=estimate)  # start-up's rule, naming the value
    gate_given = PolicySettings(c.policies[0], c.min_balancedness_gain, c.target_balancedness).gate_on
    estimates = list(dict.fromkeys(c.load_estimates))
    combos = [(p, e) for e in estimates for p in dict.fromkeys(c.policies)]

    def run(policy: str, estimate: str, gain: float, target: float | None, gate: str) -> PolicyRun:
        settings = PolicySettings(policy, gain, target, estimate)
        suffix = {"off": "", "given": " + gate", "recommended": " + recommended gate"}[gate]
        label = _label(policy, estimate, estimates) + suffix
        return _run_policy(windows, d, settings, expert_bytes, label=label, gate=gate)

    runs = [run(p, e, 0.0, None, "off") for p, e in combos]
    if gate_given:
        runs += [run(p, e, c.min_balancedness_gain, c.target_balancedness, "given") for p, e in combos]
    recommended = []
    for p, e in combos:
        rec = recommend_gate(next(r for r in runs if (r.policy, r.load_estimate, r.gate) == (p, e, "off")))
        if rec is None:
            continue
        recommended.append(rec)
        if PolicySettings(p, rec.min_balancedness_gain, rec.target_balancedness).gate_on:
            runs.append(run(p, e, rec.min_balancedness_gain, rec.target_balancedness, "recommended"))
    return PolicyComparison(
        source=windows.source, window=windows.window, evidence=windows.evidence, num_windows=len(arrays),
        num_ranks=d.num_ranks, num_nodes=d.num_nodes, num_expert_groups=d.num_expert_groups,
        num_moe_layers=int(shape[0]), num_logical_experts=int(shape[1]),
        num_redundant_experts=d.num_redundant_experts, expert_nbytes=expert_bytes.nbytes,
        bytes_note=expert_bytes.note, load_estimates=estimates, runs=runs, recommended_gates=recommended,
        recommendation_note=None if recommended else "one window: no placement was seen serving a next one",
        choice=choose(runs, MigrationAwarePolicy.balancedness_tolerance),
    )  # fmt: skip
