"""The MTP draft of a simulator rank (``simulate --speculative-tokens N``): its checks and statistics.

The draft is vLLM's ``DeepSeekMTP`` served beside the target by the rank's
:class:`~ascend_eplb.world.serving.ServingWorker` (registered by upstream's
``maybe_register_speculator`` in the one EPLB state, as ``"<model> (draft)"``); each step it runs N
times after the target. :class:`DraftRun` checks, every step, on every rank, what the target's checks
check: ``outputs`` (each draft forward's real rows' logits equal the EPLB-off draft's, fed the EPLB-off
target's hidden states) and ``load`` (the draft's load recorded over all ranks equals the selections of
the physical ids its expert kernel consumed for the real rows of its N forwards, each once), and keeps
the draft's balancedness with EPLB and without, and its commits. Shape letters (DESIGN.md section 2):
L MoE layers (the draft's: its MTP layers), E logical experts, P physical experts, N EP ranks, K top-k.
"""

from __future__ import annotations

from ascend_eplb.tools.simulate import cpu_platform as _cpu_platform  # noqa: F401  (before vLLM)

# isort: split

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from ascend_eplb.control import measures
from ascend_eplb.integration import metrics
from ascend_eplb.tools.simulate.stats import DraftLog, DraftStats, InstallSeen, OutputTolerance, frozen
from ascend_eplb.tools.simulate.steps import CheckViolationError, CommitWatch, record_first_step_plan

__all__ = ["DraftRun", "model_step_loads"]


def model_step_loads(
    phys: torch.Tensor, placement: torch.Tensor, num_physical: int, num_logical: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's loads of one model from the physical ids its experts consumed for the real rows.

    Args:
        phys: int64 ``(L, selections, K)``: every real selection of the world once.
        placement: int64 ``(L, P)``: the placement in force for the step.
        num_physical, num_logical, num_ranks: P, E, N.

    Returns:
        ``(physical (L, P), rank (L, N) float, logical (L, E))``: selections per physical slot, per rank
        (slot ``s`` on rank ``s // (P / N)``) and per logical expert.
    """
    num_layers = phys.shape[0]
    offsets = torch.arange(num_layers).view(num_layers, 1, 1)
    physical = torch.bincount(
        (phys + offsets * num_physical).reshape(-1), minlength=num_layers * num_physical
    ).view(num_layers, num_physical)
    per_rank = num_physical // num_ranks
    rank = torch.bincount(
        ((phys // per_rank) + offsets * num_ranks).reshape(-1), minlength=num_layers * num_ranks
    ).view(num_layers, num_ranks).float()  # fmt: skip
    logical_ids = placement.gather(1, phys.reshape(num_layers, -1))
    logical = torch.bincount(
        (logical_ids + offsets.view(-1, 1) * num_logical).reshape(-1), minlength=num_layers * num_logical
    ).view(num_layers, num_logical)
    return physical, rank, logical


class DraftRun:
    """The draft of one rank's run: per step :meth:`check_step` (after the step's forwards) and
    :meth:`end_step` (after its EPLB step), then :meth:`finish`.

    Args:
        worker: the rank's ``ServingWorker`` (with ``speculative_tokens`` N >= 1).
        tolerance: the rank's ``outputs`` tolerance (the target's: ``RankConfig.output_tolerance``).
        initial_placement: int64 ``(L, P)``, upstream's initial placement of the draft (what EPLB off
            serves).
        installed: the run started from ``--initial-placement`` (the draft's placement installed at its
            registration): what its slots held right after start-up is kept.

    Attributes:
        stats: what the draft's checks accumulate (:class:`~ascend_eplb.tools.simulate.stats.DraftLog`).
    """

    def __init__(
        self, worker: Any, tolerance: OutputTolerance, initial_placement: torch.Tensor, installed: bool
    ) -> None:
        self.worker = worker
        self.model_state = worker.draft_model_state
        placement = self.model_state.physical_to_logical_map
        self.num_moe_layers, self.num_physical = int(placement.shape[0]), int(placement.shape[1])
        self.num_logical = int(self.model_state.logical_to_physical_map.shape[1])
        self.initial_placement = initial_placement
        self.tolerance = tolerance
        self._commits = CommitWatch(worker.wiring.controller.bus, self.model_state.model_name)
        self.stats = DraftLog(self.model_state.model_name, worker.speculative_tokens, self.num_moe_layers)
        if installed:
            self.stats.install = InstallSeen(worker.draft_initial_slot_mismatches)

    def check_step(
        self,
        step: int,
        seen: Any,
        batch: int,
        real_rows: Callable[[int], torch.Tensor],
        placement: torch.Tensor,
        violation: Any,
        group: Any,
    ) -> Any:
        """The draft's checks of one step; returns the first violation so far.

        Args:
            step: the step.
            seen: the worker's ``WorkerStep`` of the step (its ``draft``).
            batch: the real rows of this rank's batch (its first rows).
            real_rows: bool mask of the real rows among the ``rows`` rows the experts received
                (``model_world.real_kernel_rows`` of the step's layout).
            placement: int64 ``(L, P)``: the draft's placement in force for the step's forwards.
            violation: the first violation so far (None: none).
            group: the EP group's CPU group (the load is all-reduced over it).
        """

        draft, rank, log = seen.draft, self.worker.ep_rank, self.stats
        for k, (on, off) in enumerate(zip(draft.logits_on, draft.logits_off, strict=True)):
            on, off = on[:batch], off[:batch]
            err = float((on - off).abs().max())
            bound = self.tolerance.bound(float(off.abs().max()))
            log.max_output_error = max(log.max_output_error, err)
            if violation is None and err > bound:
                violation = CheckViolationError(
                    "outputs",
                    f"step {step} rank {rank}, {log.model} forward {k}: max |logits - EPLB-off "
                    f"logits| = {err:.3g} > {bound:.3g}",
                )
        # Every real selection of the world, of every draft forward of the step (the load pass sums them).
        phys = torch.cat(
            [torch.stack(ids)[:, real_rows(ids[0].shape[0])] for ids in draft.physical_ids], dim=1
        )
        expected, rank_load, logical_load = model_step_loads(
            phys, placement, self.num_physical, self.num_logical, self.worker.layout.num_ranks
        )
        if not seen.recorded:
            expected = torch.zeros_like(expected)
        recorded = draft.load.clone()
        dist.all_reduce(recorded, group=group)
        log.load_steps_recorded += int(seen.recorded)
        log.load_selections += int(expected.sum())
        if violation is None and not torch.equal(recorded, expected):
            bad = int((recorded != expected).any(dim=1).nonzero()[0])
            violation = CheckViolationError(
                "load",
                f"step {step} {log.model} layer {bad}: the ranks recorded "
                f"{int(recorded[bad].sum())} selections, the real rows of its {len(draft.physical_ids)} "
                "forwards made "
                f"{int(expected[bad].sum())} (recording {'on' if seen.recorded else 'off'})",
            )
        num_ranks = self.worker.layout.num_ranks
        record_first_step_plan(log, step, logical_load, placement, num_ranks)
        log.balancedness_per_step.append(measures.mean_balancedness(rank_load))
        log.balancedness_off_per_step.append(
            measures.mean_balancedness(measures.rank_loads(logical_load, self.initial_placement, num_ranks))
        )
        return violation

    def end_step(self) -> None:
        """After the step's EPLB step: the draft's layers that committed in it."""
        self.stats.commits_per_step.append(self._commits.drain())

    def finish(self) -> DraftStats:
        """The draft's statistics at the run's end (:attr:`stats`, frozen, with the bytes its
        communicator measured receiving)."""
        return DraftStats(
            **{f.name: frozen(getattr(self.stats, f.name)) for f in fields(DraftLog)},
            bytes_received=metrics.bytes_received(self.model_state),
        )
