"""One EP rank of ``ascend-eplb simulate``: a Model Runner V2 worker built the way a serving worker is.

A run on a real model (``--model`` a preset or a folder, :func:`_run_model`) is one
:class:`~ascend_eplb.tools.world.serving.ServingWorker`: vLLM's plugin loader runs the integration's
entry point (the patches), vLLM's loader builds vLLM's own model class with its real routers (TP = EP =
the ranks), the controller comes from :class:`~ascend_eplb.integration.runner.Mrv2EplbWiring` (so from
``create_eplb_controller``: start-up validation, Ascend controller, the watchdog, the runtime verifier
with ``ASCEND_EPLB_VERIFY=1``) and every runner point is driven through that wiring in MRv2 order,
beside the EPLB-off model of the same checkpoint. Its own checks, every step, on every rank:
``outputs`` (logits of the real rows equal the EPLB-off model's) and ``load`` (the load recorded over
all ranks equals the real rows' selections of the physical ids the expert kernel consumed, once).

The trace-replay world (``--model replay``, :func:`_run`) keeps the repository's toy MoE model
(:mod:`ascend_eplb.tools.world.toy_moe`) for the quantized formats: each MoE layer routes the replayed trace
through upstream's real router, on which the integration bound dataplane's map-and-record op, and holds
its local experts in the format's exact kernel storage (quant_views); each rank routes rows of its own
(the ``split`` row layout). The simulator adds what a real runner gets from vLLM: padding rows, the
all-gather dispatch and the all-reduce combine, plus the EPLB-off reference world (the same tokens'
logical experts computed from one storage of all ``E`` experts in identity placement). Its checks:

- ``outputs``: each layer's output for the real tokens equals the EPLB-off reference within
  ``OUTPUT_ATOL + OUTPUT_RTOL * max|reference|``;
- ``load``: the recorded ``expert_load_pass`` equals the bincount of the real (unpadded) tokens'
  physical ids when recording was on, and is zero when it was off.

In both worlds ``fingerprints`` and ``lookups`` are the serving verifier's
(:mod:`ascend_eplb.integration.verify`), raised from the controller's step on every rank alike;
``worker`` is the serving watchdog's (:mod:`ascend_eplb.integration.watchdog`): a dead or stalled async
worker stops EPLB on every rank and the run goes on, so the ``outputs`` check shows serving continue on
the last committed placement. At the end of the run the runner's shutdown point runs (the watchdog's end
of life), and each rank reports what its checks saw (steps, selections, commits checked, the cycle in
flight at shutdown) for the driver's verdicts. The events file (``ASCEND_EPLB_EVENTS``) is written by EP
rank 0 into the output folder.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np
import torch
import torch.distributed as dist
from vllm.config import EPLBConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.eplb.eplb_state import EplbState
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    get_ep_group,
    init_distributed_environment,
    initialize_model_parallel,
)

from ascend_eplb.control.bus import CommitEvent
from ascend_eplb.integration import metrics
from ascend_eplb.integration.runner import Mrv2EplbWiring
from ascend_eplb.integration.serving import guardrails_of
from ascend_eplb.integration.verify import EplbVerificationError, EplbVerifier
from ascend_eplb.integration.watchdog import EplbWorkerFailureError, WorkerWatchdog
from ascend_eplb.launch import RankContext
from ascend_eplb.quant_views import get_format
from ascend_eplb.quant_views.reference import expert_seed
from ascend_eplb.tools.simulate.config import OUTPUT_ATOL, OUTPUT_RTOL, output_rtol
from ascend_eplb.tools.world.toy_moe import ToyModelConfig, ToyMoEModel, initial_local_experts

__all__ = ["QuantExperts", "simulate_rank"]

_HIDDEN_TABLE_ROWS = 4096


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


class _CheckViolationError(Exception):
    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check


def _vllm_config(cfg: dict, num_ranks: int) -> VllmConfig:
    return VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=num_ranks,
            enable_expert_parallel=True,
            enable_eplb=True,
            eplb_config=EPLBConfig(
                window_size=cfg["window_size"],
                step_interval=cfg["step_interval"],
                num_redundant_experts=cfg["num_redundant_experts"],
                use_async=True,
            ),
        ),
        additional_config={"eplb_config": {"load_collection_phase": cfg["load_collection_phase"]}},
    )


def _load_plugins() -> None:
    """vLLM's plugin loading, as every vLLM process does it; the integration's entry point must apply."""
    from vllm.plugins import load_general_plugins

    from ascend_eplb.integration.patches import patches_applied

    os.environ["ASCEND_EPLB"] = "1"
    load_general_plugins()
    if not patches_applied():
        raise RuntimeError(
            "vLLM's plugin loader did not run the ascend_eplb entry point (vllm.general_plugins): "
            "is ascend-eplb-integration installed, and VLLM_PLUGINS unset or naming ascend_eplb?"
        )


def simulate_rank(ctx: RankContext, cfg: dict, routing: dict, gather: bool = False) -> Any:
    """Rank entry point (``run_ranks`` or torchrun): the simulation of this rank.

    Args:
        ctx: the rank's context (rendezvous, rank, world size).
        cfg: ``SimulateConfig.to_json()`` plus ``padded_size`` and ``trace_name``.
        routing: ``topk_ids (L, trace_tokens, K)``, ``topk_weights``, ``seq_offsets``,
            ``num_logical_experts``.
        gather: gather every rank's statistics to each rank at the end (torchrun, where there is no
            launcher to collect them).

    Returns:
        this rank's statistics (``gather``: the list of every rank's).
    """
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["ASCEND_EPLB_VERIFY"] = "1" if cfg.get("verify", True) else "0"
    os.environ["ASCEND_EPLB_WORKER_TIMEOUT_S"] = str(cfg["worker_timeout_s"])
    os.environ["ASCEND_EPLB_ON_WORKER_FAILURE"] = cfg["on_worker_failure"]
    if cfg.get("events_file"):
        os.environ["ASCEND_EPLB_EVENTS"] = cfg["events_file"]
    # PROMETHEUS_MULTIPROC_DIR comes with the fork server's environment (the driver's).
    os.environ["ASCEND_EPLB_METRICS"] = "1" if cfg.get("metrics") else "0"
    torch.set_num_threads(1)
    _load_plugins()
    if cfg.get("model_folder"):
        stats = _run_model(ctx, cfg)  # the worker initialises vLLM's world with the model's config
    else:
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
            _record_resources(ctx, cfg)
            stats = _run(ctx, cfg, routing, vc)
    if gather:
        stats = _gather(ctx, stats)
    # Release vLLM's groups (and the shared-memory message queue of its TP group) so nothing is left
    # for the resource tracker; after a failure the launcher ends the process at once instead.
    destroy_model_parallel()
    destroy_distributed_environment()
    return stats


def _record_resources(ctx: RankContext, cfg: dict) -> None:
    if cfg.get("record_resources"):
        from ascend_eplb.tools.simulate.lifecycle import record_rank_resources

        record_rank_resources(ctx.tmp_dir, ctx.rank)  # the launcher removes what a killed rank left


def _new_stats() -> dict[str, Any]:
    """A rank's statistics, per step (the report's schema, both worlds)."""
    return {
        "balancedness_per_step": [],
        "balancedness_off_per_step": [],
        "rank_load_share_per_step": [],
        "step_seconds": [],
        "step_cpu_seconds": [],
        "verifier_seconds": [],
        "step_in_flight": [],
        "commits_per_step": [],
        "rearrangements_per_step": [],
        "max_output_error": 0.0,
        "worker_failure": None,
        # What the load check compared: steps that recorded, and the real selections they held.
        "load_steps_recorded": 0,
        "load_selections": 0,
    }


def _timed_hooks(controller: Any) -> tuple[WorkerWatchdog, EplbVerifier, list[float]]:
    """Wrap the serving verifier's step and commit subscribers to time them (its cost per step);
    returns the controller's watchdog and verifier (its serving guardrails) and the one-element list
    each step's verifier seconds accumulate into."""
    guardrails = guardrails_of(controller)
    watchdog, verifier = guardrails.watchdog, guardrails.verifier
    assert verifier is not None  # ASCEND_EPLB_VERIFY=1 here
    spent = [0.0]

    def timed(hook):
        def run(*args):
            t = time.perf_counter()
            try:
                hook(*args)
            finally:
                spent[0] += time.perf_counter() - t

        return run

    controller.bus.wrap(verifier.on_step, timed)
    controller.bus.wrap(verifier.on_commit, timed)
    return watchdog, verifier, spent


class _CommitWatch:
    """The MoE layers whose placement committed, heard on the controller's bus: each ``"commit"``
    :class:`~ascend_eplb.control.bus.CommitEvent` (upstream's commit of one layer returned), kept until
    the step's end drains them. Every commit is heard, however many the run has (the state's
    log of recent commit events keeps only the last ``COMMIT_LOG_MAXLEN``)."""

    def __init__(self, bus: Any) -> None:
        self._layers: set[int] = set()
        bus.subscribe(CommitEvent, self._on_commit)

    def _on_commit(self, event: CommitEvent) -> None:
        if event.kind == "commit":
            self._layers.add(event.layer)

    def drain(self) -> list[int]:
        """The layers committed since the last drain, ascending (each once)."""
        layers, self._layers = sorted(self._layers), set()
        return layers


def _close_step(
    ctx: RankContext, stats: dict, step: int, started: tuple[float, float], violation: Any,
    after_sampling: Any, model_state: Any, state: Any, watchdog: WorkerWatchdog, hook_seconds: list[float],
    commits: _CommitWatch, loads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[Any, bool]:  # fmt: skip
    """The end of one step, the same in both worlds: runner point 9 (``after_sampling``: upstream's step,
    then the watchdog and the verifier, which may raise the same error on every rank), the step's
    timings, a worker failure the watchdog decided, the commits, balancedness and rank shares
    (:func:`_end_of_step` with ``loads`` = ``(rank_load, logical_load, initial_p2l)``), the progress
    message, and whether every rank stops now (one flag all-reduced over the EP group).

    Returns:
        ``(violation, stop)``: the first violation so far, and whether the ranks leave the loop.
    """
    in_flight = bool(model_state.rebalanced)
    verified = None
    try:
        after_sampling()
    except EplbVerificationError as e:
        verified = _CheckViolationError(e.check, str(e))
    except EplbWorkerFailureError as e:  # ASCEND_EPLB_ON_WORKER_FAILURE=raise, on every rank
        verified = _CheckViolationError("worker", str(e))
    stats["step_seconds"].append(time.perf_counter() - started[0])
    stats["step_cpu_seconds"].append(time.process_time() - started[1])  # this process, all its threads
    stats["verifier_seconds"].append(hook_seconds[0])
    stats["step_in_flight"].append(in_flight)
    if watchdog.failure is not None and stats["worker_failure"] is None:
        # EPLB stopped on every rank at this step; serving (and every other check) goes on.
        stats["worker_failure"] = (watchdog.failure.message(), step)
        violation = violation or _CheckViolationError("worker", watchdog.failure.message())
    _end_of_step(stats, state, commits.drain(), *loads, ctx.world_size)
    ctx.send(("step", step, state.num_rearrangements, stats["balancedness_per_step"][-1]))
    if verified is not None:
        # Raised on every rank at this same step boundary: all ranks stop here together.
        return violation or verified, True
    stop = violation is not None and violation.check != "worker"
    flag = torch.tensor([int(stop)], dtype=torch.int32)
    dist.all_reduce(flag, group=get_ep_group().cpu_group)
    return violation, int(flag) > 0


def _end_of_step(
    stats: dict, state: Any, committed_layers: list[int], rank_load: torch.Tensor, logical_load: torch.Tensor,
    initial_p2l: torch.Tensor, num_ranks: int,
) -> None:  # fmt: skip
    """Record the step's commits (``committed_layers``, from the bus), rearrangements, balancedness with
    EPLB (``rank_load`` ``(L, N)``) and without (``logical_load`` ``(L, E)`` on upstream's initial
    placement ``initial_p2l``) and rank shares."""
    stats["commits_per_step"].append(list(committed_layers))
    stats["rearrangements_per_step"].append(state.num_rearrangements)
    loads = rank_load.numpy()
    bal = float(np.mean(loads.mean(axis=1) / np.maximum(loads.max(axis=1), 1)))
    stats["balancedness_per_step"].append(bal)
    # Per-rank share of each layer's selections, averaged over layers (1/N everywhere = balanced).
    stats["rank_load_share_per_step"].append(
        (loads / np.maximum(loads.sum(axis=1, keepdims=True), 1)).mean(axis=0).tolist()
    )
    stats["balancedness_off_per_step"].append(
        metrics.balancedness(metrics.rank_loads(logical_load, initial_p2l, num_ranks))
    )


@dataclass
class _ReplayWorld:
    """One rank of the trace-replay world, as :func:`_build_replay_world` builds it: the toy model over
    the format's storage, wired the serving way, the EPLB-off reference storage, the trace and the
    step-invariant tensors the steps and checks share."""

    ctx: RankContext
    cfg: dict
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
    verifier_time: list[float]
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
    hidden_table: torch.Tensor  # [_HIDDEN_TABLE_ROWS, H]
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


def _run(ctx: RankContext, cfg: dict, routing: dict, vc: VllmConfig) -> dict:
    """This rank of the trace-replay world: build it, then per step the forward, the checks and the
    step's end (:func:`_close_step`), then the end of the run."""
    world = _build_replay_world(ctx, cfg, routing, vc)
    stats = _new_stats()
    violation: _CheckViolationError | None = None
    cursor = 0
    commits = _CommitWatch(world.wiring.controller.bus)
    for step in range(cfg["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        world.verifier_time[0] = 0.0
        fwd = _replay_step(world, cursor)
        cursor += world.ctx.world_size * world.batch
        stats["max_output_error"] = max(stats["max_output_error"], float(fwd.err.max()))
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
        violation, stop = _close_step(
            ctx, stats, step, (t0, c0), violation, world.wiring.after_sampling, world.model_state,
            world.state, world.watchdog, world.verifier_time, commits,
            (rank_load, logical_load, world.initial_p2l),
        )  # fmt: skip
        if stop:
            break
    _end_of_run(
        stats,
        violation,
        world.wiring,
        world.state,
        world.model_state,
        world.watchdog,
        world.verifier,
        world.p,
    )
    stats["expert_nbytes"] = world.fmt.expert_nbytes(world.hidden, cfg["intermediate_size"])
    return stats


def _build_replay_world(ctx: RankContext, cfg: dict, routing: dict, vc: VllmConfig) -> _ReplayWorld:
    """Build this rank's trace-replay world: the storage of its slots under upstream's initial placement
    and the EPLB-off reference storage, the toy model, the wiring (runner ``__init__`` and
    ``load_model``: prepare, register with the routers bound, start the worker), the timed serving
    hooks, the injected faults, and the trace as tensors."""
    rank, num_ranks = ctx.rank, ctx.world_size
    ids_all, w_all, seq_offsets = routing["topk_ids"], routing["topk_weights"], routing["seq_offsets"]
    num_moe_layers, num_trace_tokens, top_k = ids_all.shape
    num_logical = int(routing["num_logical_experts"])
    num_redundant = cfg["num_redundant_experts"]
    num_physical = num_logical + num_redundant
    p = num_physical // num_ranks
    hidden, inter, seed = cfg["hidden_size"], cfg["intermediate_size"], cfg["seed"]
    batch, padded = cfg["batch_size"], cfg["padded_size"]
    seq_starts = np.zeros(num_trace_tokens, dtype=bool)
    seq_starts[seq_offsets[:-1]] = True
    group = get_ep_group().cpu_group
    fmt = get_format(cfg["quant_format"])

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
            QuantExperts(fmt, fmt.create_storage(w13[mine], w2[mine]), cfg["fault"] == "view-skips-scale")
        )
        ref_storages.append(fmt.create_storage(w13[ref_lo:ref_hi], w2[ref_lo:ref_hi]))
    model = ToyMoEModel(experts, num_logical, num_redundant, num_ranks, top_k)
    model_config = ToyModelConfig(cfg["trace_name"])

    device = torch.device("cpu")
    wiring = Mrv2EplbWiring(vc, device)  # runner __init__
    wiring.load_model(model, model_config)  # load_model: prepare, register (routers bound), start worker
    state = wiring.controller.state
    model_state = state.model_states[model_config.compute_hash()]
    watchdog, verifier, verifier_time = _timed_hooks(wiring.controller)
    if cfg["fault"] in WORKER_FAULTS and rank == num_ranks - 1:
        _inject_worker_fault(model_state.communicator, cfg["fault"], rank)

    if cfg["fault"] == "wrong-lookup-refresh":
        _inject_stale_lookup(model.layers[0].eplb_state)

    g = torch.Generator().manual_seed(seed)
    hidden_table = torch.randn(_HIDDEN_TABLE_ROWS, hidden, generator=g)
    # EPLB off over the same tokens: upstream's initial placement (EplbState's linear map, redundant
    # slots replicating experts 0..R-1), each expert's load split evenly over its replicas
    # (integration.metrics, the policy's own model).
    initial_p2l = torch.tensor(
        EplbState.build_initial_global_physical_to_logical_map(num_logical, num_redundant), dtype=torch.int64
    ).expand(num_moe_layers, -1)
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


def _replay_step(w: _ReplayWorld, cursor: int) -> _ReplayForward:
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
    hid[:batch] = w.hidden_table[tok % _HIDDEN_TABLE_ROWS]
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
    bound = OUTPUT_ATOL + OUTPUT_RTOL * out[1, :, rows].abs().amax(dim=(1, 2))
    return _ReplayForward(recording, phys, all_logical, all_phys, err, bound)


def _check_replay_outputs(w: _ReplayWorld, step: int, fwd: _ReplayForward) -> _CheckViolationError | None:
    """The ``outputs`` check: each layer's output for this rank's real tokens within the bound."""
    if not bool((fwd.err > fwd.bound).any()):
        return None
    layer = int((fwd.err > fwd.bound).nonzero()[0])
    return _CheckViolationError(
        "outputs",
        f"step {step} layer {layer} rank {w.ctx.rank}: "
        f"max |out - ref| = {float(fwd.err[layer]):.3g} > {float(fwd.bound[layer]):.3g}",
    )


def _check_replay_load(
    w: _ReplayWorld, step: int, fwd: _ReplayForward, stats: dict
) -> _CheckViolationError | None:
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
    stats["load_steps_recorded"] += int(fwd.recording)
    stats["load_selections"] += int(expected_load.sum())
    if torch.equal(recorded, expected_load):
        return None
    bad = int((recorded != expected_load).any(dim=1).nonzero()[0])
    return _CheckViolationError(
        "load",
        f"step {step} rank {w.ctx.rank} layer {bad}: recorded {recorded[bad].sum().item()} "
        f"selections, expected {expected_load[bad].sum().item()} "
        f"(recording {'on' if fwd.recording else 'off'})",
    )


def _run_model(ctx: RankContext, cfg: dict) -> dict:
    """This rank of a run on a real vLLM model: a :class:`~ascend_eplb.tools.world.serving.ServingWorker`
    (the plugin, vLLM's loader and real model class, ``Mrv2EplbWiring`` with the verifier, watchdog and
    events file) beside its EPLB-off twin, at TP = EP = the ranks (vLLM's TP+EP layout: every rank routes
    the same, TP-replicated, rows).

    Each step is one sequence of ``padded_size`` token ids (the same on every rank, from ``seed``), its
    first ``batch_size`` rows real; even steps are declared prefill batches, odd steps decode batches.
    Checks, every step: ``outputs`` (the real rows' logits equal the EPLB-off model's within
    ``OUTPUT_ATOL + output_rtol(format) * max|reference|``: 1e-5 for float32 activations, 16 units of
    roundoff for bf16/fp16) and ``load`` (the load recorded over all ranks equals
    the bincount of the physical ids the expert kernel consumed for the real rows, each selection once,
    when the step records; nothing when it does not).
    """
    from ascend_eplb.tools.world.serving import ServingWorker, initial_physical_to_logical

    rank, num_ranks = ctx.rank, ctx.world_size
    num_redundant = cfg["num_redundant_experts"]
    worker = ServingWorker(
        ctx,
        cfg["model_folder"],
        num_redundant_experts=num_redundant,
        window_size=cfg["window_size"],
        step_interval=cfg["step_interval"],
        phase=cfg["load_collection_phase"],
    )
    _record_resources(ctx, cfg)
    info, state, model_state = worker.info, worker.state, worker.model_state
    num_moe_layers, num_logical = info.num_moe_layers, info.num_logical_experts
    num_physical = worker.num_physical_experts
    p = num_physical // num_ranks
    group = get_ep_group().cpu_group
    watchdog, verifier, hook_seconds = _timed_hooks(worker.wiring.controller)
    if cfg["fault"] in WORKER_FAULTS and rank == num_ranks - 1:
        _inject_worker_fault(model_state.communicator, cfg["fault"], rank)
    if cfg["fault"] == "wrong-lookup-refresh":
        _inject_stale_lookup(worker.model.moe_layers[0].eplb_state)
    batch, padded = cfg["batch_size"], cfg["padded_size"]
    g = torch.Generator().manual_seed(cfg["seed"])
    worker.profile_run(torch.randint(0, info.vocab_size, (padded,), generator=g))
    initial_p2l = initial_physical_to_logical(info, num_redundant)
    rtol = output_rtol(cfg["quant_format"])  # the real model's experts' format (16-bit: its roundoff)
    layer_offsets = torch.arange(num_moe_layers).view(num_moe_layers, 1, 1)
    stats = _new_stats()
    violation: _CheckViolationError | None = None
    commits = _CommitWatch(worker.wiring.controller.bus)
    for step in range(cfg["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        hook_seconds[0] = 0.0
        ids = torch.randint(0, info.vocab_size, (padded,), generator=g)
        placement = model_state.physical_to_logical_map.clone()  # in force for this forward
        seen = worker.forward_step(ids, num_unpadded_tokens=batch, batch_has_prefill=step % 2 == 0)
        assert seen.logits_off is not None
        phys = torch.stack([x[:batch] for x in seen.physical_ids])  # [L, batch_size, K] physical, real rows
        on, off = seen.logits_on[:batch], seen.logits_off[:batch]
        err = float((on - off).abs().max())
        bound = OUTPUT_ATOL + rtol * float(off.abs().max())
        stats["max_output_error"] = max(stats["max_output_error"], err)
        if violation is None and err > bound:
            violation = _CheckViolationError(
                "outputs",
                f"step {step} rank {rank}: max |logits - EPLB-off logits| = {err:.3g} > {bound:.3g}",
            )
        recorded = seen.load.clone()
        dist.all_reduce(recorded, group=group)  # each real selection must be counted once over the ranks
        expected = torch.zeros(num_moe_layers, num_physical, dtype=torch.int64)
        if seen.recorded:
            expected = torch.bincount(
                (phys + layer_offsets * num_physical).reshape(-1), minlength=num_moe_layers * num_physical
            ).view(num_moe_layers, num_physical)  # fmt: skip
        stats["load_steps_recorded"] += int(seen.recorded)
        stats["load_selections"] += int(expected.sum())  # the world's (the recorded load is all-reduced)
        if violation is None and not torch.equal(recorded, expected):
            bad = int((recorded != expected).any(dim=1).nonzero()[0])
            violation = _CheckViolationError(
                "load",
                f"step {step} layer {bad}: the ranks recorded {int(recorded[bad].sum())} selections, the "
                f"real rows made {int(expected[bad].sum())} (recording {'on' if seen.recorded else 'off'})",
            )
        rank_load = torch.bincount(
            ((phys // p) + layer_offsets * num_ranks).reshape(-1), minlength=num_moe_layers * num_ranks
        ).view(num_moe_layers, num_ranks).float()  # fmt: skip
        logical = placement.gather(1, phys.reshape(num_moe_layers, -1))
        logical_load = torch.bincount(
            (logical + layer_offsets.view(-1, 1) * num_logical).reshape(-1),
            minlength=num_moe_layers * num_logical,
        ).view(num_moe_layers, num_logical)  # fmt: skip
        violation, stop = _close_step(
            ctx, stats, step, (t0, c0), violation, worker.end_step, model_state, state, watchdog,
            hook_seconds, commits, (rank_load, logical_load, initial_p2l),
        )  # fmt: skip
        if stop:
            break
    _end_of_run(stats, violation, worker.wiring, state, model_state, watchdog, verifier, p)
    experts = worker.model.moe_layers[0].routed_experts
    stats["expert_nbytes"] = experts.w13_weight[0].nbytes + experts.w2_weight[0].nbytes
    return stats


def _end_of_run(
    stats: dict, violation: Any, wiring: Mrv2EplbWiring, state: Any, model_state: Any,
    watchdog: WorkerWatchdog, verifier: EplbVerifier, slots_per_rank: int,
) -> None:  # fmt: skip
    """The end of a run, the same in both worlds: the runner's shutdown point (the watchdog logs a cycle
    in flight, :meth:`WorkerWatchdog.at_shutdown`), then what this rank's checks saw."""
    wiring.shutdown()
    stats["violation"] = None if violation is None else (violation.check, str(violation))
    stats["steps_run"] = len(stats["step_seconds"])
    stats["num_rearrangements"] = state.num_rearrangements
    stats["num_skipped_rearrangements"] = state.num_skipped_rearrangements  # all-zero windows
    stats["bytes_moved"] = _bytes_received(model_state)
    stats["verifier_commits_checked"] = verifier.commits_checked
    stats["verifier_steps"] = verifier.steps
    stats["slots_per_rank"] = slots_per_rank
    stats["in_flight_at_end"] = [asdict(cycle) for cycle in watchdog.in_flight_at_shutdown]


def _gather(ctx: RankContext, stats: dict) -> list[dict]:
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, stats, group=get_ep_group().cpu_group)
    return everyone


#: The faults of the async worker (:func:`_inject_worker_fault`), injected on the last rank.
WORKER_FAULTS = ("worker-dies", "worker-stalls", "worker-never-publishes")


def _inject_worker_fault(communicator: Any, fault: str, rank: int) -> None:
    """Fault injection in this rank's async worker, at its second transfer (layer 1 of the first
    rearrangement): it raises (``worker-dies``), never returns (``worker-stalls``: the peers wait in
    their transfer), or completes and then never returns (``worker-never-publishes``: the peers'
    transfers complete and their workers publish layer 1 and wait for it to be consumed, this rank
    never publishes it, so upstream's step counter runs past its interval: vllm-project/vllm#57883)."""
    execute = communicator.execute
    calls = [0]

    def faulty_execute(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            if fault == "worker-dies":
                raise RuntimeError(f"injected fault: the expert transfer of layer 1 failed on rank {rank}")
            if fault == "worker-never-publishes":
                execute(*args, **kwargs)
            time.sleep(3600)
        return execute(*args, **kwargs)

    communicator.execute = faulty_execute


def _inject_stale_lookup(layer_state: Any) -> None:
    """Fault injection: the layer's lookup keeps serving the pre-commit placement after its commit."""
    stale = (layer_state.logical_to_physical_map.clone(), layer_state.logical_replica_count.clone())
    layer_state.refresh_replica_lookup = lambda: layer_state.replica_lookup.refresh_(*stale)


def _bytes_received(model_state: Any) -> int:
    """Bytes this rank received over all rearrangements (movement's transfer statistics)."""
    stats = model_state.communicator.cumulative_stats
    return int(stats.bytes_received)
