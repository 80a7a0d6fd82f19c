"""The trace-replay world of ``simulate --model replay``: a recorded trace's routing on a quantized
format's storage, through the serving wiring.

The toy MoE model (:mod:`ascend_eplb.world.toy_moe`): each MoE layer routes the replayed trace through
upstream's real router (with dataplane's map-and-record op bound) and holds its local experts in the
format's kernel storage (quant_views); each rank routes rows of its own. The simulator adds the padding
rows, the all-gather dispatch and all-reduce combine, and the EPLB-off reference (the same tokens on one
storage of all ``E`` experts in identity placement). Checks: ``outputs`` (each layer's output within
``steps.OutputTolerance.bound`` of the reference) and ``load`` (the recorded ``expert_load_pass`` equals
the bincount of the real tokens' physical ids, zero with recording off). Shape letters: GLOSSARY.md.
"""

from __future__ import annotations

from ascend_eplb.tools.simulate import cpu_platform as _cpu_platform  # noqa: F401  (before vLLM)

# isort: split

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from vllm.config import EPLBConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import (
    get_ep_group,
    init_distributed_environment,
    initialize_model_parallel,
)

from ascend_eplb.control import measures
from ascend_eplb.integration.runner import Mrv2EplbWiring
from ascend_eplb.integration.verify import EplbVerifier
from ascend_eplb.integration.watchdog import WorkerWatchdog
from ascend_eplb.launch import RankContext
from ascend_eplb.quant_views import get_format
from ascend_eplb.quant_views.reference import expert_seed
from ascend_eplb.tools.simulate.config import ascend_policy_keys
from ascend_eplb.tools.simulate.faults import WORKER_FAULTS, inject_stale_lookup, inject_worker_fault
from ascend_eplb.tools.simulate.resources import HIDDEN_TABLE_ROWS
from ascend_eplb.tools.simulate.stats import RankConfig, RankStats, StepLog
from ascend_eplb.tools.simulate.steps import (
    CheckViolationError,
    CommitWatch,
    RankLoop,
    StepSeen,
    VerifierClock,
    close_step,
    end_of_run,
    record_first_step_plan,
    record_initial_placement,
    record_resources,
    timed_hooks,
)
from ascend_eplb.world.toy_moe import ToyModelConfig, ToyMoEModel, initial_local_experts

__all__ = ["QuantExperts", "run_replay"]


def _hidden_table(generator: torch.Generator, hidden: int) -> torch.Tensor:
    """float32 ``[HIDDEN_TABLE_ROWS, H]``: a trace token's hidden state is row ``token % rows`` (the run's
    memory estimate counts it, :data:`~ascend_eplb.tools.simulate.resources.HIDDEN_TABLE_ROWS`)."""
    return torch.randn(HIDDEN_TABLE_ROWS, hidden, generator=generator)


def _expert_weights(seed: int, layer: int, expert: int, hidden: int, inter: int) -> tuple[torch.Tensor, ...]:
    """Deterministic float32 checkpoint weights of one logical expert: ``w13 (2I, H)``, ``w2 (H, I)``."""
    g = torch.Generator().manual_seed(expert_seed(seed, expert, layer=layer))
    w13 = torch.randn(2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(hidden, inter, generator=g) / inter**0.5
    return w13, w2


class QuantExperts:
    """A layer's local experts in a quant_views format: what the toy layer's ``get_expert_weights``
    hands upstream (the format's weight views) and the storage the verifier fingerprints.

    Args:
        fmt: the quant_views ``ExpertWeightFormat``.
        storage: its ``ExpertStorage`` of this rank's ``p`` slots.
        skip_scale_view: fault injection: the view list forgets one scale tensor.
    """

    def __init__(self, fmt: Any, storage: Any, skip_scale_view: bool = False) -> None:
        self.fmt, self.storage, self.skip_scale_view = fmt, storage, skip_scale_view

    def weight_views(self) -> list[Any]:
        views = list(self.fmt.weight_views(self.storage))
        if self.skip_scale_view:
            names = list(self.storage.kernel_tensors)
            del views[next(i for i, n in enumerate(names) if "scale" in n)]
        return views


def _vllm_config(cfg: RankConfig, num_ranks: int) -> VllmConfig:
    return VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=num_ranks,
            enable_expert_parallel=True,
            enable_eplb=True,
            eplb_config=EPLBConfig(
                window_size=cfg.options.window_size,
                step_interval=cfg.options.step_interval,
                num_redundant_experts=cfg.options.num_redundant_experts,
                use_async=True,
            ),
        ),
        additional_config={
            "eplb_config": {
                "load_collection_phase": cfg.options.load_collection_phase,
                **ascend_policy_keys(cfg.options),
                **(
                    {"initial_placement": cfg.options.initial_placement}
                    if cfg.options.initial_placement
                    else {}
                ),
            }
        },
    )


@dataclass
class _ReplayWorld:
    """One rank of the trace-replay world, as :func:`_build_replay_world` builds it: the toy model over
    the format's storage, wired the serving way, the EPLB-off reference storage, the trace and the
    step-invariant tensors the steps and checks share."""

    ctx: RankContext
    cfg: RankConfig
    fmt: Any
    experts: list[QuantExperts]  # per layer, this rank's p slots (EPLB placement)
    ref_storages: list[Any]  # per layer, the reference's experts [ref_lo, ref_hi) in identity placement
    ref_lo: int
    ref_hi: int
    model: ToyMoEModel
    model_config: ToyModelConfig
    wiring: Mrv2EplbWiring
    state: Any
    model_state: Any
    watchdog: WorkerWatchdog
    verifier: EplbVerifier
    verifier_time: VerifierClock
    num_moe_layers: int
    num_logical: int
    num_physical: int
    p: int
    top_k: int
    hidden: int
    batch: int
    padded: int
    num_trace_tokens: int
    ids_all: torch.Tensor  # int64 [L, trace_tokens, K] logical
    w_all: torch.Tensor  # float32 [L, trace_tokens, K]
    seq_starts: np.ndarray  # bool [trace_tokens]: the token starts a sequence
    generator: torch.Generator  # the hidden-state table, then each step's padding ids
    hidden_table: torch.Tensor  # [HIDDEN_TABLE_ROWS, H]
    real: torch.Tensor  # bool [N*T]: real (unpadded) rows of the gathered batch
    layer_offsets: torch.Tensor  # [L, 1, 1]
    initial_p2l: torch.Tensor  # int64 [L, P]: upstream's initial placement (EPLB off)
    group: Any  # the EP CPU group


@dataclass
class _ReplayForward:
    """What one replayed step's forward produced (:func:`_replay_step`), for the checks."""

    recording: bool  # the controller's record decision for this forward
    phys: torch.Tensor  # int64 [L, T, K]: this rank's physical ids, padding included
    all_logical: torch.Tensor  # [L, N*T, K]: every rank's logical ids (dispatch)
    all_phys: torch.Tensor  # [L, N*T, K]: every rank's physical ids (dispatch)
    err: torch.Tensor  # [L]: max |out - ref| over this rank's real rows
    bound: torch.Tensor  # [L]: the outputs check's bound


def run_replay(ctx: RankContext, cfg: RankConfig, routing: dict) -> RankStats:
    """This rank of the trace-replay world: vLLM's world over Gloo (TP = EP = the ranks), build the
    world, then per step the forward, the checks and the step's end (:func:`~ascend_eplb.tools.simulate.
    steps.close_step`), then the end of the run."""
    vc = _vllm_config(cfg, ctx.world_size)
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=ctx.world_size,
            rank=ctx.rank,
            distributed_init_method=ctx.init_method,
            local_rank=ctx.local_rank,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=ctx.world_size)
        record_resources(ctx, cfg)
        return _run_replay(ctx, cfg, routing, vc)


def _run_replay(ctx: RankContext, cfg: RankConfig, routing: dict, vc: VllmConfig) -> RankStats:
    world = _build_replay_world(ctx, cfg, routing, vc)
    stats = StepLog(cfg.output_tolerance)
    record_initial_placement(stats, cfg, None)  # the verifier's fingerprints checked the install
    violation: CheckViolationError | None = None
    cursor = 0
    loop = RankLoop(
        ctx, stats, world.wiring, world.state, world.model_state, world.wiring.after_sampling, world.watchdog,
        world.verifier, world.verifier_time, CommitWatch(world.wiring.controller.bus), world.initial_p2l,
        world.p,
    )  # fmt: skip
    for step in range(cfg.options.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        world.verifier_time.seconds = 0.0
        placement = world.model_state.physical_to_logical_map.clone()  # in force for this forward
        fwd = _replay_step(world, cursor, stats)
        cursor += world.ctx.world_size * world.batch
        stats.max_output_error = max(stats.max_output_error, float(fwd.err.max()))
        rank_load = torch.bincount(
            ((fwd.all_phys[:, world.real] // world.p) + world.layer_offsets * ctx.world_size).reshape(-1),
            minlength=world.num_moe_layers * ctx.world_size,
        ).view(world.num_moe_layers, ctx.world_size).float()  # fmt: skip
        if violation is None:
            violation = _check_replay_outputs(world, step, fwd)
        if violation is None:
            violation = _check_replay_load(world, step, fwd, stats)
        logical_load = torch.bincount(
            (fwd.all_logical[:, world.real] + world.layer_offsets * world.num_logical).reshape(-1),
            minlength=world.num_moe_layers * world.num_logical,
        ).view(world.num_moe_layers, world.num_logical)  # fmt: skip
        record_first_step_plan(stats, step, logical_load, placement, ctx.world_size)
        violation, stop = close_step(
            loop, StepSeen(step, (t0, c0), rank_load, logical_load, placement), violation
        )
        if stop:
            break
    return end_of_run(loop, violation)


def _build_replay_world(ctx: RankContext, cfg: RankConfig, routing: dict, vc: VllmConfig) -> _ReplayWorld:
    """Build this rank's trace-replay world: the storage of its slots under upstream's initial placement
    and the EPLB-off reference storage, the toy model, the wiring (runner ``__init__`` and
    ``load_model``: prepare, register with the routers bound, start the worker), the timed serving
    hooks, the injected faults, and the trace as tensors."""
    rank, num_ranks = ctx.rank, ctx.world_size
    ids_all, w_all, seq_offsets = routing["topk_ids"], routing["topk_weights"], routing["seq_offsets"]
    num_moe_layers, num_trace_tokens, top_k = ids_all.shape
    num_logical = int(routing["num_logical_experts"])
    num_redundant = cfg.options.num_redundant_experts
    num_physical = num_logical + num_redundant
    p = num_physical // num_ranks
    hidden, inter, seed = cfg.options.hidden_size, cfg.options.intermediate_size, cfg.options.seed
    batch, padded = cfg.options.batch_size, cfg.padded_size
    seq_starts = np.zeros(num_trace_tokens, dtype=bool)
    seq_starts[seq_offsets[:-1]] = True
    group = get_ep_group().cpu_group
    fmt = get_format(cfg.options.quant_format)

    # Storage: this rank's slots under upstream's initial placement. Reference (the EPLB-off world):
    # logical experts in identity placement, rank r holding the r-th contiguous share of the E, built
    # from the same checkpoint weights and never touched by EPLB.
    mine = initial_local_experts(rank, num_ranks, num_logical, num_redundant)
    shares = np.array_split(np.arange(num_logical), num_ranks)
    ref_lo, ref_hi = int(shares[rank][0]), int(shares[rank][-1]) + 1
    experts, ref_storages = [], []
    for layer in range(num_moe_layers):
        pairs = [_expert_weights(seed, layer, e, hidden, inter) for e in range(num_logical)]
        w13, w2 = torch.stack([w[0] for w in pairs]), torch.stack([w[1] for w in pairs])
        experts.append(
            QuantExperts(
                fmt, fmt.create_storage(w13[mine], w2[mine]), cfg.options.fault == "view-skips-scale"
            )
        )
        ref_storages.append(fmt.create_storage(w13[ref_lo:ref_hi], w2[ref_lo:ref_hi]))
    model = ToyMoEModel(experts, num_logical, num_redundant, num_ranks, top_k)
    model_config = ToyModelConfig(cfg.trace_name)

    device = torch.device("cpu")
    wiring = Mrv2EplbWiring(vc, device)  # runner __init__
    wiring.load_model(model, model_config)  # load_model: prepare, register (routers bound), start worker
    state = wiring.controller.state
    model_state = state.model_states[model_config.compute_hash()]
    watchdog, verifier, verifier_time = timed_hooks(wiring.controller)
    if cfg.options.fault in WORKER_FAULTS and rank == num_ranks - 1:
        inject_worker_fault(model_state.communicator, cfg.options.fault, rank)

    if cfg.options.fault == "wrong-lookup-refresh":
        inject_stale_lookup(model.layers[0].eplb_state)

    g = torch.Generator().manual_seed(seed)
    hidden_table = _hidden_table(g, hidden)
    # EPLB off over the same tokens: upstream's initial placement, each expert's load split evenly over
    # its replicas (control.measures, the policy's own model).
    initial_p2l = measures.upstream_initial_placement(num_logical, num_redundant, num_moe_layers)
    return _ReplayWorld(
        ctx=ctx, cfg=cfg, fmt=fmt, experts=experts, ref_storages=ref_storages, ref_lo=ref_lo, ref_hi=ref_hi,
        model=model, model_config=model_config, wiring=wiring, state=state, model_state=model_state,
        watchdog=watchdog, verifier=verifier, verifier_time=verifier_time, num_moe_layers=num_moe_layers,
        num_logical=num_logical, num_physical=num_physical, p=p, top_k=top_k, hidden=hidden, batch=batch,
        padded=padded, num_trace_tokens=num_trace_tokens,
        ids_all=torch.from_numpy(ids_all.astype(np.int64)),  # [L, trace_tokens, K]
        w_all=torch.from_numpy(w_all.astype(np.float32)), seq_starts=seq_starts, generator=g,
        hidden_table=hidden_table,
        real=torch.cat([torch.arange(padded) < batch] * num_ranks),  # [N*T] real (unpadded) rows
        layer_offsets=torch.arange(num_moe_layers).view(num_moe_layers, 1, 1), initial_p2l=initial_p2l,
        group=group,
    )  # fmt: skip


def _replay_step(w: _ReplayWorld, cursor: int, stats: StepLog) -> _ReplayForward:
    """One replayed step's forward on this rank, from the trace token ``cursor`` on (the world consumes
    ``N * batch_size`` tokens per step): runner points ``prepare_inputs`` and ``prepare_forward``, every
    layer's upstream router, the all-gather dispatch, both worlds' experts, the all-reduce combine."""
    rank, num_ranks = w.ctx.rank, w.ctx.world_size
    batch, padded, hidden, top_k, num_moe_layers = w.batch, w.padded, w.hidden, w.top_k, w.num_moe_layers
    world_rows = num_ranks * padded
    # This rank's real tokens, in trace order.
    tok = torch.from_numpy((cursor + rank * batch + np.arange(batch)) % w.num_trace_tokens)
    pad_ids = torch.randint(0, w.num_logical, (padded - batch, top_k), generator=w.generator)
    w.wiring.prepare_inputs(bool(w.seq_starts[tok.numpy()].any()))
    # Each rank routes rows of its own (vLLM Ascend's MC2 dispatch): the 'split' row layout.
    w.wiring.prepare_forward(w.model_config, batch, moe_rows="split")
    recording = bool(w.wiring.controller.last_record_decision)
    hid = torch.zeros(padded, hidden)
    hid[:batch] = w.hidden_table[tok % HIDDEN_TABLE_ROWS]
    ids = torch.empty(num_moe_layers, padded, top_k, dtype=torch.int64)  # [L, T, K] logical
    ids[:, :batch] = w.ids_all[:, tok]
    ids[:, batch:] = pad_ids
    wts = torch.zeros(num_moe_layers, padded, top_k)
    wts[:, :batch] = w.w_all[:, tok]
    # Every layer's upstream router: replayed selection, then the bound dataplane op (mapping and,
    # when recording, the load of the first batch_size rows).
    phys = torch.stack([pid for _, pid in w.model.route(list(ids), list(wts))]).to(torch.int64)
    # Dispatch: all-gather of every layer's logical and physical ids, weights and the hidden states
    # (one collective per dtype for all layers: the layers here are independent, each reads the
    # batch's hidden states).
    ints = torch.cat([ids, phys], dim=2).transpose(0, 1).contiguous()  # [T, L, 2K]
    floats = torch.cat([hid, wts.transpose(0, 1).reshape(padded, -1)], dim=1)  # [T, H + L*K]
    gi = [torch.empty_like(ints) for _ in range(num_ranks)]
    dist.all_gather(gi, ints, group=w.group)
    gf = [torch.empty_like(floats) for _ in range(num_ranks)]
    dist.all_gather(gf, floats, group=w.group)
    all_ints, all_f = torch.cat(gi).transpose(0, 1), torch.cat(gf)  # [L, N*T, 2K], [N*T, H+L*K]
    all_logical, all_phys = all_ints[..., :top_k], all_ints[..., top_k:]
    all_hid = all_f[:, :hidden]
    all_wts = all_f[:, hidden:].reshape(world_rows, num_moe_layers, top_k).transpose(0, 1)
    # Local experts with the format's reference kernel: [0] EPLB placement (every row, padding
    # included, as a graph-captured runner computes it), [1] the EPLB-off reference (real rows).
    local = all_phys - rank * w.p
    local = torch.where((local >= 0) & (local < w.p), local, -1)
    ref_local = all_logical - w.ref_lo
    ref_local = torch.where((ref_local >= 0) & (ref_local < w.ref_hi - w.ref_lo) & w.real.view(1, -1, 1),
                            ref_local, -1)  # fmt: skip
    out = torch.empty(2, num_moe_layers, world_rows, hidden)
    for layer in range(num_moe_layers):
        out[0, layer] = w.fmt.apply(w.experts[layer].storage, all_hid, all_wts[layer], local[layer])
        out[1, layer] = w.fmt.apply(w.ref_storages[layer], all_hid, all_wts[layer], ref_local[layer])
    dist.all_reduce(out, group=w.group)  # combine (both worlds, all layers, one collective)
    rows = slice(rank * padded, rank * padded + batch)  # the rank keeps its own rows
    err = (out[0, :, rows] - out[1, :, rows]).abs().amax(dim=(1, 2))  # [L]
    bound = stats.output_tolerance.bound(
        out[1, :, rows].abs().amax(dim=(1, 2))
    )  # the tolerance the rank reports
    return _ReplayForward(recording, phys, all_logical, all_phys, err, bound)


def _check_replay_outputs(w: _ReplayWorld, step: int, fwd: _ReplayForward) -> CheckViolationError | None:
    """The ``outputs`` check: each layer's output for this rank's real tokens within the bound."""
    if not bool((fwd.err > fwd.bound).any()):
        return None
    layer = int((fwd.err > fwd.bound).nonzero()[0])
    return CheckViolationError(
        "outputs",
        f"step {step} layer {layer} rank {w.ctx.rank}: "
        f"max |out - ref| = {float(fwd.err[layer]):.3g} > {float(fwd.bound[layer]):.3g}",
    )


def _check_replay_load(
    w: _ReplayWorld, step: int, fwd: _ReplayForward, stats: StepLog
) -> CheckViolationError | None:
    """The ``load`` check: upstream's ``expert_load_pass`` equals the bincount of this rank's real rows'
    physical ids when the step recorded, zero when it did not; counts what it compared in ``stats``."""
    num_moe_layers, num_physical = w.num_moe_layers, w.num_physical
    expected_load = torch.zeros(num_moe_layers, num_physical, dtype=torch.int32)
    if fwd.recording:
        expected_load = torch.bincount(
            (fwd.phys[:, : w.batch] + w.layer_offsets * num_physical).reshape(-1),
            minlength=num_moe_layers * num_physical,
        ).view(num_moe_layers, num_physical).to(torch.int32)  # fmt: skip
    recorded = w.model_state.expert_load_pass.clone()
    stats.load_steps_recorded += int(fwd.recording)
    stats.load_selections += int(expected_load.sum())
    if torch.equal(recorded, expected_load):
        return None
    bad = int((recorded != expected_load).any(dim=1).nonzero()[0])
    return CheckViolationError(
        "load",
        f"step {step} rank {w.ctx.rank} layer {bad}: recorded {recorded[bad].sum().item()} "
        f"selections, expected {expected_load[bad].sum().item()} "
        f"(recording {'on' if fwd.recording else 'off'})",
    )
