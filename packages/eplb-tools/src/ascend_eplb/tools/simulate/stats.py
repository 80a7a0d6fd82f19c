"""What a simulator rank is given (:class:`RankConfig`), accumulates while it runs (:class:`StepLog`) and
hands the driver at the end (:class:`RankStats`, frozen: the report and the verdicts read it). Data only:
no vLLM import (the driver builds and reads them outside the ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ascend_eplb.integration.guardrail_facts import InFlightAtShutdown
from ascend_eplb.tools.simulate.config import SimulateConfig

__all__ = [
    "DraftStats",
    "InstallSeen",
    "OutputTolerance",
    "RankConfig",
    "RankStats",
    "StepLog",
    "frozen",
]


@dataclass(frozen=True)
class OutputTolerance:
    """The ``outputs`` check's tolerance, decided once by the driver (``SimulateConfig.outputs_rtol``)."""

    rtol: float
    atol: float

    def bound(self, reference_max: Any) -> Any:
        """``atol + rtol * max|reference|``: ``reference_max`` a float, or a tensor (one bound each)."""
        return self.atol + self.rtol * reference_max


@dataclass
class InstallSeen:
    """With ``--initial-placement``: what this rank held right after start-up (``slot_mismatches``: the
    slots not holding their logical expert; None where the world has no float or fingerprint truth of
    its own, the verifier's check of the install being the evidence) and, at step 0, the mean balancedness
    ``plan`` predicts for the installed placement on the step's routed load (``first_step_planned``)."""

    slot_mismatches: list[str] | None
    first_step_planned: float | None = None


@dataclass
class StepLog:
    """What a rank accumulates while it runs, one entry per step in each list (both worlds alike).

    Attributes:
        output_tolerance: what this rank's ``outputs`` check compares with.
        balancedness_per_step: mean balancedness of the ranks' routed selections (EPLB on).
        balancedness_off_per_step: mean balancedness of the step's logical load on upstream's initial
            placement (EPLB off, the same tokens).
        balancedness_equal_split_per_step: with the batch split on (``--replica-split``; empty with it
            off), the mean balancedness of the step's logical load on the placement in force split
            evenly over each expert's replicas (``c[e] / count[e]``, the equal split's, the figure the
            data plane's split stats and the ``..._split_balancedness_equal`` gauge accumulate), beside
            ``balancedness_per_step``, what the split executed on the same counts.
        rank_load_share_per_step: per rank, its share of each layer's selections, averaged over layers.
        commits_per_step: the MoE layers that committed in the step.
        rearrangements_per_step: upstream state's rearrangement count at the step's end.
        max_output_error, load_steps_recorded, load_selections: what the ``outputs`` and ``load``
            checks compared.
        worker_failure: the watchdog's message and the step it decided at, or None.
        install: with ``--initial-placement``, :class:`InstallSeen`.
    """

    output_tolerance: OutputTolerance
    balancedness_per_step: list[float] = field(default_factory=list)
    balancedness_off_per_step: list[float] = field(default_factory=list)
    balancedness_equal_split_per_step: list[float] = field(default_factory=list)
    rank_load_share_per_step: list[list[float]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    step_cpu_seconds: list[float] = field(default_factory=list)
    verifier_seconds: list[float] = field(default_factory=list)
    step_in_flight: list[bool] = field(default_factory=list)
    commits_per_step: list[list[int]] = field(default_factory=list)
    rearrangements_per_step: list[int] = field(default_factory=list)
    max_output_error: float = 0.0
    worker_failure: tuple[str, int] | None = None
    load_steps_recorded: int = 0
    load_selections: int = 0
    install: InstallSeen | None = None


@dataclass(frozen=True)
class DraftStats:
    """The MTP draft's statistics at the end of a run on one rank (``--speculative-tokens N``), one entry
    per step in each sequence, as :class:`RankStats` has them for the target.

    Attributes:
        model: upstream's name of the draft (``"<model> (draft)"``).
        forwards_per_step: N.
        num_moe_layers: the draft's MoE layers (its MTP layers).
        max_output_error, load_steps_recorded, load_selections: what the ``outputs`` and ``load`` checks
            compared.
        install: with ``--initial-placement``, what the draft held right after start-up.
        bytes_received: what this rank's communicator measured receiving for the draft over the run, its
            start-up install included (None: not counted).
    """

    model: str
    forwards_per_step: int
    num_moe_layers: int
    balancedness_per_step: tuple[float, ...]
    balancedness_off_per_step: tuple[float, ...]
    commits_per_step: tuple[tuple[int, ...], ...]
    max_output_error: float
    load_steps_recorded: int
    load_selections: int
    install: InstallSeen | None
    bytes_received: int | None


@dataclass(frozen=True)
class RankStats:
    """A rank's statistics at the end of its run (what the driver's report and verdicts read): its
    :class:`StepLog`, frozen, and what its checks and the serving state said at the end.

    Attributes:
        moe_rows: the MoE row layout of its last forward (``ascend_eplb.control.layout``), or None.
        compilation: how vLLM ran the model: ``"eager (enforce_eager)"`` or the compilation mode and
            backend vLLM's CPU platform resolved (``"DYNAMO_TRACE_ONCE, inductor backend"``); None: the
            replay world (no vLLM model class).
        violation: ``(check, message)`` of the first violation, or None.
        num_rearrangements, num_skipped_rearrangements: upstream state's counters (skipped: windows
            without load).
        bytes_received: what this rank's communicator measured receiving over the run, the start-up
            install included (None: not counted).
        expert_nbytes: one expert's bytes as the transaction moves them (the first MoE layer's views).
        verifier_commits_checked, verifier_steps: what the serving verifier checked.
        slots_per_rank: p.
        in_flight_at_end: the watchdog's cycles in flight at shutdown.
        draft: the MTP draft's (:class:`DraftStats`), or None: no draft served.
        balancedness_equal_split_per_step: :attr:`StepLog.balancedness_equal_split_per_step` (empty
            with the split off).
        split_scope: the batch split's scope in force on the controller (``"off"``, ``"rows"``,
            ``"global"``, ``"local"``: ``ascend_eplb.control.split_config.SplitScope``), or None: not read.
    """

    output_tolerance: OutputTolerance
    balancedness_per_step: tuple[float, ...]
    balancedness_off_per_step: tuple[float, ...]
    rank_load_share_per_step: tuple[tuple[float, ...], ...]
    step_seconds: tuple[float, ...]
    step_cpu_seconds: tuple[float, ...]
    verifier_seconds: tuple[float, ...]
    step_in_flight: tuple[bool, ...]
    commits_per_step: tuple[tuple[int, ...], ...]
    rearrangements_per_step: tuple[int, ...]
    max_output_error: float
    worker_failure: tuple[str, int] | None
    load_steps_recorded: int
    load_selections: int
    install: InstallSeen | None
    moe_rows: str | None
    compilation: str | None
    violation: tuple[str, str] | None
    num_rearrangements: int
    num_skipped_rearrangements: int
    bytes_received: int | None
    expert_nbytes: int
    verifier_commits_checked: int
    verifier_steps: int
    slots_per_rank: int
    in_flight_at_end: tuple[InFlightAtShutdown, ...]
    draft: DraftStats | None = None
    balancedness_equal_split_per_step: tuple[float | None, ...] = ()
    split_scope: str | None = None

    @property
    def steps_run(self) -> int:
        return len(self.step_seconds)


def frozen(value: Any) -> Any:
    """``value`` with its lists (nested too) as tuples."""
    return tuple(frozen(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True)
class RankConfig:
    """What every rank of a run is given (pickled to each rank): the run's options and what the driver
    decided for them.

    Attributes:
        options: the validated :class:`SimulateConfig`.
        padded_size: rows of one step (``options.effective_padded_size``).
        trace_name: the routing's name (the replay world's model name).
        events_file: the serving events file (``ASCEND_EPLB_EVENTS``, written by EP rank 0).
        output_tolerance: the ``outputs`` check's tolerance (``SimulateConfig.outputs_rtol``), which each
            rank compares with and reports back.
        model_folder: the real model's checkpoint folder (None: the trace-replay world).
        record_resources: each rank records the resources it holds (the launcher's, not torchrun's).
        compilation: vLLM's ``compilation_config`` of the served model (``options.compilation``; None:
            eager execution, and the replay world).
    """

    options: SimulateConfig
    padded_size: int
    trace_name: str
    events_file: str
    output_tolerance: OutputTolerance
    model_folder: str | None = None
    record_resources: bool = False
    compilation: dict[str, Any] | None = None
