"""The real-model world of ``simulate`` (``--model`` a preset or a folder): one serving worker per rank.

A :class:`~ascend_eplb.world.serving.ServingWorker`: vLLM's plugin loader applies the integration's
patches, vLLM's loader builds vLLM's model class with its real routers (TP = EP = the ranks), the
controller comes from :class:`~ascend_eplb.integration.runner.Mrv2EplbWiring` (start-up validation, the
watchdog, the runtime verifier) and every runner point is driven through that wiring in MRv2 order,
beside the EPLB-off model of the same checkpoint. Checks every step on every rank: ``outputs`` (logits
of the real rows equal the EPLB-off model's) and ``load`` (the load recorded over all ranks equals the
real rows' selections of the physical ids the expert kernel consumed, once). Shape letters: GLOSSARY.md.
"""

from __future__ import annotations

from ascend_eplb.tools.simulate import cpu_platform as _cpu_platform  # noqa: F401  (before vLLM)

# isort: split

import time
from dataclasses import replace

import torch
import torch.distributed as dist
from vllm.distributed.parallel_state import get_ep_group

from ascend_eplb.control import measures
from ascend_eplb.launch import RankContext
from ascend_eplb.tools.simulate.config import ascend_policy_keys
from ascend_eplb.tools.simulate.draft import DraftRun, model_step_loads
from ascend_eplb.tools.simulate.faults import WORKER_FAULTS, inject_stale_lookup, inject_worker_fault
from ascend_eplb.tools.simulate.stats import RankConfig, RankStats, StepLog
from ascend_eplb.tools.simulate.steps import (
    CheckViolationError,
    CommitWatch,
    RankLoop,
    StepSeen,
    close_step,
    end_of_run,
    record_first_step_plan,
    record_initial_placement,
    record_resources,
    timed_hooks,
)
from ascend_eplb.world.serving import ServingWorker

__all__ = ["real_kernel_rows", "run_model"]


def real_kernel_rows(rows: str, num_rows: int, padded: int, batch: int, tp_size: int) -> torch.Tensor:
    """bool ``(num_rows,)``: which rows of the batch a rank's experts received are real, each DP rank's
    batch being ``padded`` rows of which the first ``batch`` are real.

    ``replicated``: the rank's own batch. ``gathered``: the DP ranks' batches, one after the other.
    ``gathered-sp``: every EP rank's sequence-parallel chunk of ``ceil(padded / TP)`` rows of its DP
    rank's batch (vLLM's ``_compute_sp_num_tokens``), in EP order (TP rank ``e % TP`` holds chunk
    ``e % TP``). In these layouts every rank's experts receive the same rows.

    Raises:
        ValueError: ``rows`` is another layout (``split``: each rank's own rows, not run here).
    """
    index = torch.arange(num_rows)
    if rows == "replicated":
        return index < batch
    if rows == "gathered":
        return index % padded < batch
    if rows == "gathered-sp":
        chunk = -(-padded // tp_size)
        return (index // chunk) % tp_size * chunk + index % chunk < batch
    raise ValueError(f"rows={rows!r}: the real-model world runs replicated, gathered or gathered-sp rows")


def run_model(ctx: RankContext, cfg: RankConfig) -> RankStats:
    """This rank of a run on a real vLLM model: a :class:`~ascend_eplb.world.serving.ServingWorker`
    (the plugin, vLLM's loader and real model class, ``Mrv2EplbWiring`` with the verifier, watchdog and
    events file) beside its EPLB-off twin, at DP x TP (``data_parallel_size``, EP over every rank): with
    D = 1 vLLM's TP+EP layout (every rank routes the same, TP-replicated, rows), with D > 1 its
    gather-before-route dispatch (the DP ranks' rows gathered, sequence-parallel chunks with TP > 1).

    Each step is one sequence of ``padded_size`` token ids per DP rank (the same on its TP ranks, from
    ``seed`` and the DP rank), its first ``batch_size`` rows real; even steps are declared prefill
    batches, odd steps decode batches.
    Checks, every step: ``outputs`` (the real rows' logits equal the EPLB-off model's within
    ``atol + rtol * max|reference|``, the tolerance the rank reports (``steps.OutputTolerance.bound``): the
    driver's ``cfg.output_tolerance`` (``SimulateConfig.outputs_rtol``: 1e-5 for float32
    activations, 16 units of roundoff for bf16/fp16)) and ``load`` (the load recorded over all ranks equals
    the bincount of the physical ids the expert kernel consumed for the real rows, each selection once,
    when the step records; nothing when it does not; the real rows of the batch the experts received:
    :func:`real_kernel_rows`).
    """

    rank, num_ranks = ctx.rank, ctx.world_size
    num_redundant = cfg.options.num_redundant_experts
    worker = ServingWorker(
        ctx,
        cfg.model_folder,
        num_redundant_experts=num_redundant,
        window_size=cfg.options.window_size,
        step_interval=cfg.options.step_interval,
        phase=cfg.options.load_collection_phase,
        initial_placement=cfg.options.initial_placement,
        ascend_keys=ascend_policy_keys(cfg.options),
        data_parallel_size=cfg.options.data_parallel_size,
        compilation=cfg.compilation,
        speculative_tokens=cfg.options.speculative_tokens,
    )
    record_resources(ctx, cfg)
    info, state, model_state = worker.info, worker.state, worker.model_state
    num_moe_layers, num_logical = info.num_moe_layers, info.num_logical_experts
    num_physical = worker.num_physical_experts
    p = num_physical // num_ranks
    group = get_ep_group().cpu_group
    watchdog, verifier, hook_seconds = timed_hooks(worker.wiring.controller)
    if cfg.options.fault in WORKER_FAULTS and rank == num_ranks - 1:
        inject_worker_fault(model_state.communicator, cfg.options.fault, rank)
    if cfg.options.fault == "wrong-lookup-refresh":
        inject_stale_lookup(worker.model.moe_layers[0].eplb_state)
    batch, padded = cfg.options.batch_size, cfg.padded_size
    n = worker.speculative_tokens
    # each DP rank its own batches (D = 1: the seed's); its TP ranks the same
    g = torch.Generator().manual_seed(cfg.options.seed * worker.layout.data_parallel_size + worker.dp_rank)
    worker.profile_run(torch.randint(0, info.vocab_size, (padded,), generator=g))
    initial_p2l = measures.upstream_initial_placement(num_logical, num_redundant, num_moe_layers)  # EPLB off
    stats = StepLog(cfg.output_tolerance)
    record_initial_placement(stats, cfg, worker.initial_slot_mismatches)
    violation: CheckViolationError | None = None
    draft = None
    if n:
        # upstream's initial placement of the draft: the target's rows, one per MTP layer
        num_draft_layers = int(worker.draft_model_state.physical_to_logical_map.shape[0])
        draft = DraftRun(
            worker, cfg.output_tolerance, initial_p2l[:num_draft_layers], bool(cfg.options.initial_placement)
        )
    loop = RankLoop(
        ctx, stats, worker.wiring, state, model_state, worker.end_step, watchdog, verifier, hook_seconds,
        CommitWatch(worker.wiring.controller.bus, model_state.model_name), initial_p2l, p,
    )  # fmt: skip
    for step in range(cfg.options.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        hook_seconds[0] = 0.0
        # With a draft, the step's sequence and the N tokens after it: draft forward k takes ids k+1 .. k+T.
        ids = torch.randint(0, info.vocab_size, (padded + n,), generator=g)
        placement = model_state.physical_to_logical_map.clone()  # in force for this forward
        draft_placement = None if draft is None else worker.draft_model_state.physical_to_logical_map.clone()
        seen = worker.forward_step(
            ids[:padded], num_unpadded_tokens=batch, batch_has_prefill=step % 2 == 0,
            draft_input_ids=[ids[k + 1 : k + 1 + padded] for k in range(n)],
        )  # fmt: skip
        assert seen.logits_off is not None
        kernel = torch.stack(seen.physical_ids)  # [L, rows, K]: the rows this rank's experts received
        rows = worker.wiring.controller.last_row_layout.rows

        def real_rows(num_rows: int, rows: str = rows) -> torch.Tensor:
            return real_kernel_rows(rows, num_rows, padded, batch, worker.layout.tensor_parallel_size)

        phys = kernel[:, real_rows(kernel.shape[1])]  # [L, real rows, K] physical: every real token, once
        on, off = seen.logits_on[:batch], seen.logits_off[:batch]
        err = float((on - off).abs().max())
        # The driver's tolerance (SimulateConfig.outputs_rtol: the experts' format, 16-bit: its roundoff).
        bound = stats.output_tolerance.bound(float(off.abs().max()))
        stats.max_output_error = max(stats.max_output_error, err)
        if violation is None and err > bound:
            violation = CheckViolationError(
                "outputs",
                f"step {step} rank {rank}: max |logits - EPLB-off logits| = {err:.3g} > {bound:.3g}",
            )
        recorded = seen.load.clone()
        dist.all_reduce(recorded, group=group)  # each real selection must be counted once over the ranks
        expected, rank_load, logical_load = model_step_loads(
            phys, placement, num_physical, num_logical, num_ranks
        )
        if not seen.recorded:
            expected = torch.zeros_like(expected)
        stats.load_steps_recorded += int(seen.recorded)
        stats.load_selections += int(expected.sum())  # the world's (the recorded load is all-reduced)
        if violation is None and not torch.equal(recorded, expected):
            bad = int((recorded != expected).any(dim=1).nonzero()[0])
            violation = CheckViolationError(
                "load",
                f"step {step} layer {bad}: the ranks recorded {int(recorded[bad].sum())} selections, the "
                f"real rows made {int(expected[bad].sum())} (recording {'on' if seen.recorded else 'off'})",
            )
        if draft is not None and seen.draft is not None:
            violation = draft.check_step(step, seen, batch, real_rows, draft_placement, violation, group)
        record_first_step_plan(stats, step, logical_load, placement, num_ranks)
        violation, stop = close_step(loop, StepSeen(step, (t0, c0), rank_load, logical_load), violation)
        if draft is not None:
            draft.end_step()
        if stop:
            break
    compiled = worker.vllm_config.compilation_config
    mode = f"{compiled.mode.name}, {compiled.backend} backend" if worker.compiled else "eager (enforce_eager)"
    result = end_of_run(loop, violation, compilation=mode)
    return result if draft is None else replace(result, draft=draft.finish())
