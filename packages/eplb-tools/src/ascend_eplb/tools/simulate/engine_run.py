"""``simulate`` on a real model: vLLM's own engine serves the workload twice, EPLB off then on.

Each engine is an :class:`~ascend_eplb.world.engine.host.EngineWorld` (``vllm.LLM`` with Model Runner V2's
CPU runner, TP x EP ranks as vLLM's workers, the project's plugin with the verifier, the watchdog and the
events file on). The workload: ``--batch-size`` requests of :data:`PROMPT_TOKENS` random token ids (from
``--seed``), each generating ``--steps`` tokens greedily, served together. The EPLB-off engine's
completions are the ``outputs`` check's reference; the EPLB-on engine's workers are observed through
vLLM's RPC (``world.engine.probes``): every step's recorded load with the placement it routed with, every
commit's slots against the checkpoint. :func:`run_engines` turns both into the ranks' ``RankStats`` the
report reads and :class:`EngineFigures` (throughput and TPOT of each engine: EPLB's overhead on this host).
Shape letters: GLOSSARY.md.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ascend_eplb.control import measures
from ascend_eplb.integration.guardrail_facts import InFlightAtShutdown
from ascend_eplb.integration.model_names import DRAFT_SUFFIX
from ascend_eplb.tools.check import check_serve_command
from ascend_eplb.tools.simulate.config import PROMPT_TOKENS, ROUND_TOKENS, SimulateConfig, ascend_policy_keys
from ascend_eplb.tools.simulate.faults import WORKER_FAULTS, inject_stale_lookup, inject_worker_fault
from ascend_eplb.tools.simulate.launching import write_scrape
from ascend_eplb.tools.simulate.lifecycle import RunPhase
from ascend_eplb.tools.simulate.stats import DraftStats, InstallSeen, OutputTolerance, RankStats
from ascend_eplb.world.checkpoints import checkpoint_info
from ascend_eplb.world.engine import probes
from ascend_eplb.world.engine.host import Completion, EngineError, EngineWorld
from ascend_eplb.world.engine.spec import EngineSpec, EplbSpec

__all__ = ["EngineFigures", "EngineRun", "inject_fault", "run_engines", "workload"]

#: Top candidates vLLM returns per generated token (the ``outputs`` check compares them all).
LOGPROBS = 5


@dataclass(frozen=True)
class EngineFigures:
    """What one engine took (seconds): ``start_s`` vLLM's start-up (imports, load, profile, KV cache),
    ``generate_s`` the workload, ``tokens`` generated, and vLLM's own per-request TTFT and TPOT medians."""

    start_s: float
    generate_s: float
    tokens: int
    ttft_s: float | None
    tpot_s: float | None

    @property
    def throughput(self) -> float:
        """Generated tokens per second of the workload."""
        return self.tokens / self.generate_s if self.generate_s > 0 else 0.0


@dataclass(frozen=True)
class EngineRun:
    """Both engines of a run: the ranks' statistics of the EPLB-on engine and each engine's figures."""

    results: list[RankStats]
    off: EngineFigures
    on: EngineFigures


def workload(config: SimulateConfig, vocab_size: int) -> list[tuple[list[list[int]], int]]:
    """The rounds of the workload: each ``--batch-size`` prompts of :data:`PROMPT_TOKENS` token ids drawn
    from ``--seed``, and the tokens each generates; ``--steps`` tokens per request in all, at most
    :data:`ROUND_TOKENS` per round (served one round after the other)."""
    g = torch.Generator().manual_seed(config.seed)
    rounds, left = [], config.steps
    while left > 0:
        tokens = min(left, ROUND_TOKENS)
        rounds.append(
            (torch.randint(0, vocab_size, (config.batch_size, PROMPT_TOKENS), generator=g).tolist(), tokens)
        )
        left -= tokens
    return rounds


def _serve(
    engine: EngineWorld, rounds: list[tuple[list[list[int]], int]], deadline: float
) -> tuple[list[Completion], float]:
    """The workload's rounds through ``engine`` (greedy, :data:`LOGPROBS` candidates), and its seconds."""
    started, out = time.perf_counter(), []
    for prompts, tokens in rounds:
        out += engine.generate(prompts, max_tokens=tokens, logprobs=LOGPROBS, timeout=_left(deadline))
    return out, time.perf_counter() - started


def _specs(config: SimulateConfig, folder: Path) -> tuple[EngineSpec, EngineSpec]:
    ascend: dict[str, Any] = {
        "load_collection_phase": config.load_collection_phase,
        **ascend_policy_keys(config),
    }
    if config.initial_placement is not None:
        ascend["initial_placement"] = str(Path(config.initial_placement).resolve())
    off = EngineSpec(
        model=str(folder),
        dtype={"bf16": "bfloat16", "fp16": "float16"}.get(config.quant_format, "float32"),
        tensor_parallel_size=config.tp_size,
        data_parallel_size=config.data_parallel_size,
        speculative_tokens=config.speculative_tokens,
        compilation=config.compilation,
        max_num_seqs=config.batch_size,
        max_model_len=config.engine_max_model_len,
        seed=config.seed,
    )
    eplb = EplbSpec(config.window_size, config.step_interval, config.num_redundant_experts, ascend)
    return off, EngineSpec(**{**off.__dict__, "eplb": eplb})


def _figures(engine: EngineWorld, completions: list[Completion], generate_s: float) -> EngineFigures:
    ttft = [c.ttft_s for c in completions if c.ttft_s is not None]
    tpot = [c.tpot_s for c in completions if c.tpot_s is not None]
    return EngineFigures(
        float(engine.ready.get("seconds", 0.0)),
        generate_s,
        sum(len(c.token_ids) for c in completions),
        float(np.median(ttft)) if ttft else None,
        float(np.median(tpot)) if tpot else None,
    )


def inject_fault(worker: Any, fault: str) -> None:
    """``--fault`` in this worker (run on every worker through vLLM's RPC): an async-worker fault on the
    last EP rank, or layer 0's stale lookup refresh on every rank."""
    # local: runs in vLLM's workers; this process starts vLLM's engine in processes of its own
    from vllm.distributed.parallel_state import get_ep_group

    state = worker.model_runner.eplb.state
    (model_state, *_) = state.model_states.values()
    group = get_ep_group()
    if fault in WORKER_FAULTS and group.rank_in_group == group.world_size - 1:
        inject_worker_fault(model_state.communicator, fault, group.rank_in_group)
    if fault == "wrong-lookup-refresh":
        inject_stale_lookup(model_state.model.moe_layers[0].eplb_state)


def run_engines(
    config: SimulateConfig, folder: Path, vocab_size: int, deadline: float, phase: RunPhase
) -> EngineRun:
    """Serve the workload on the EPLB-off engine, then on the EPLB-on engine (``config``'s EPLB settings,
    verifier and watchdog on, ``events.jsonl`` in ``--out``), each in a scratch folder of its own removed
    after it; returns the ranks' statistics and both engines' figures.

    Raises:
        EngineError: an engine failed to start or to serve (the message names the cause).
    """
    rounds = workload(config, vocab_size)
    off_spec, on_spec = _specs(config, folder)
    refuse_what_start_up_refuses(on_spec)

    def say(what: str) -> None:
        phase.what = what
        if config.progress:
            print(f"ascend-eplb simulate: {what}", file=sys.stderr, flush=True)

    out = Path(config.out_dir)
    scratch = Path(tempfile.mkdtemp(prefix="ascend-eplb-simulate-"))
    try:
        say(f"starting vLLM's engine, EPLB off ({off_spec.num_ranks} workers)")
        with EngineWorld(off_spec, scratch / "off", start_timeout=_left(deadline)) as engine:
            ready = engine.ready["seconds"]
            requests = f"{config.batch_size} requests x {config.steps} tokens"
            say(f"serving {requests}, EPLB off (ready in {ready:.0f} s)")
            reference, seconds = _serve(engine, rounds, deadline)
            off = _figures(engine, reference, seconds)
        env = {
            "ASCEND_EPLB_VERIFY": "1",
            "ASCEND_EPLB_EVENTS": str((out / "events.jsonl").resolve()),
            "ASCEND_EPLB_WORKER_TIMEOUT_S": str(config.worker_timeout_s),
            "ASCEND_EPLB_ON_WORKER_FAILURE": config.on_worker_failure,
        }
        if config.metrics:
            (scratch / "prometheus").mkdir()
            env |= {"ASCEND_EPLB_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": str(scratch / "prometheus")}
        say(f"starting vLLM's engine, EPLB on ({on_spec.num_ranks} workers)")
        with EngineWorld(on_spec, scratch / "on", env=env, start_timeout=_left(deadline)) as engine:
            # What serving starts on: upstream's initial placement, or the --initial-placement installed.
            start = engine.run_on_workers(probes.eplb_state)[0]["placements"]
            installed = (
                engine.run_on_workers(probes.slot_mismatches, str(folder))
                if config.initial_placement
                else None
            )
            engine.run_on_workers(probes.observe, str(folder))
            if config.fault is not None:
                engine.run_on_workers(inject_fault, config.fault)
            say(f"serving the same requests, EPLB on (ready in {engine.ready['seconds']:.0f} s)")
            started, failure = time.perf_counter(), None
            try:
                completions, seconds = _serve(engine, rounds, deadline)
            except EngineError as e:
                completions, seconds, failure = [], time.perf_counter() - started, _check_of(e)
                if failure is None:
                    raise
            on = _figures(engine, completions, seconds)
            observed = engine.run_on_workers(probes.observed) if failure is None else None
            summaries = engine.run_on_workers(probes.run_summary) if failure is None else None
        if config.metrics:
            write_scrape(scratch / "prometheus", out / "metrics.prom")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tolerance = OutputTolerance(config.outputs_rtol, 1e-6)
    if failure is not None:
        return EngineRun(_failed_ranks(config, tolerance, failure), off, on)
    results = _rank_stats(
        config, folder, observed, summaries, completions, reference, tolerance, start, installed
    )
    return EngineRun(results, off, on)


def refuse_what_start_up_refuses(spec: EngineSpec) -> None:
    """Judge the EPLB-on engine's arguments by the serving path's start-up rules (``ascend-eplb check --
    serve``, vLLM's own parser and model class) before any engine starts: a rule the workers would refuse
    on (a model class without a MixtureOfExperts part) is one message, not an engine's failed start-up.

    Raises:
        ValueError: a rule is violated (the message lists each, as ``check`` prints them).
    """
    result = check_serve_command(["serve", *spec.serve_argv()], {**os.environ, **spec.environment()})
    if not result.ok:
        raise ValueError(
            "refused before vLLM's engine starts (the serving path's start-up rules on the EPLB-on "
            f"engine's arguments, as `ascend-eplb check -- serve` judges them):\n{result.report}"
        )


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 1.0)


#: The serving guardrails' errors as vLLM's engine reports a worker's (``RuntimeError: Worker failed with
#: error '<message>'``): (check, pattern of the message; a named group ``check`` overrides the first).
_GUARDRAIL_ERRORS = (
    ("worker", re.compile(r"(EPLB worker watchdog: [^'\n]*)")),
    ("lookups", re.compile(r"(EPLB verifier: (?P<check>\w+) check failed[^'\n]*)")),
)


def _check_of(error: EngineError) -> tuple[str, str] | None:
    """``(check, message)`` of a serving guardrail that stopped the engine (the verifier's or the
    watchdog's error, as a worker's failure in the engine's report or log), or None (another failure)."""
    text = str(error)
    for check, pattern in _GUARDRAIL_ERRORS:
        match = pattern.search(text)
        if match:
            return match.groupdict().get("check") or check, match.group(1).strip()
    return None


def _outputs_error(
    completions: list[Completion], reference: list[Completion], tolerance: OutputTolerance
) -> tuple[float, str | None]:
    """The worst |logprob - EPLB-off logprob| over every generated token's candidates, and the first
    violation (a greedy token that differs, or an error above ``tolerance``), or None."""
    worst, violation = 0.0, None
    for i, (got, want) in enumerate(zip(completions, reference, strict=True)):
        if got.token_ids != want.token_ids and violation is None:
            at = next(
                k for k, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=False)) if a != b
            )
            violation = (
                f"request {i} token {at}: {got.token_ids[at]} generated, EPLB off {want.token_ids[at]}"
            )
        for k, (a, b) in enumerate(zip(got.logprobs, want.logprobs, strict=False)):
            bound = tolerance.bound(max(abs(v) for v in b.values()))
            for token in a.keys() & b.keys():
                err = abs(a[token] - b[token])
                worst = max(worst, err)
                if err > bound and violation is None:
                    violation = (
                        f"request {i} token {k}: |logprob - EPLB-off logprob| = {err:.3g} > {bound:.3g}"
                    )
    return worst, violation


def _placements(initial: torch.Tensor, commits: list[dict[str, Any]], steps: int) -> list[torch.Tensor]:
    """The placement each of ``steps`` steps routed with: ``initial``, changed by each commit after the
    step it committed in."""
    current, out = initial.clone(), []
    by_step: dict[int, list[dict[str, Any]]] = {}
    for c in commits:
        by_step.setdefault(c["step"], []).append(c)
    for step in range(steps):
        out.append(current.clone())
        for c in by_step.get(step, []):
            current[c["layer"]] = torch.tensor(c["placement"])
    return out


@dataclass
class _Series:
    """One model's figures per serving step, over the ranks (the target's, or its MTP draft's)."""

    balancedness: list[float | None]
    balancedness_off: list[float | None]
    balancedness_equal_split: list[float | None]
    rank_shares: list[list[float | None]]
    commits: list[list[int]]
    recorded_steps: int
    selections: int
    violation: str | None
    first_planned: float | None = None


def _series(
    observed: list[dict[str, Any]],
    serving: list[int],
    model: str,
    start: torch.Tensor,
    initial: torch.Tensor,
    num_logical: int,
    top_k: int,
    data_parallel_size: int = 1,
    split: bool = False,
) -> _Series:
    """``model``'s figures at each serving step (``serving``: indices into the observer's steps; ``start``
    the placement serving began on): the executed balancedness of its recorded load (``None`` for a step
    without), the same load on upstream's ``initial`` placement (EPLB off), with the batch split on
    (``split``) the same load on the placement the step routed with split evenly over each expert's
    replicas (the equal split's, beside the executed one), each rank's share, the layers
    committed, the balancedness the first step's load has on ``start`` split evenly over replicas (what
    ``plan`` predicts for a placement), and the ``load`` check: per step the selections recorded over the
    ranks equal its real tokens (every forward the runner prepared for it) x K x L once, nothing when the
    step did not record; with data parallelism each DP rank's (its TP ranks, rank-major) own tokens, a DP
    rank's dummy batch (vLLM's, while another serves) none of them."""
    num_layers, num_ranks = initial.shape[0], len(observed)
    commits = [c for c in observed[0]["commits"] if c["model_name"] == model]
    placements = _placements(start, commits, len(observed[0]["steps"]))
    out = _Series([], [], [], [], [[] for _ in serving], 0, 0, None)
    tp = num_ranks // data_parallel_size
    for k, i in enumerate(serving):
        groups = [
            [rank["steps"][i] for rank in observed[d * tp : (d + 1) * tp]] for d in range(data_parallel_size)
        ]
        groups = [g for g in groups if not g[0]["is_dummy"]]
        step = [s for g in groups for s in g]
        recorded = any(g[0]["recorded"] for g in groups)
        total = sum(s["selections"].get(model, 0) for s in step)
        want = sum(
            sum(g[0]["forwards"].get(model, [])) * top_k * num_layers for g in groups if g[0]["recorded"]
        )
        if total != want and out.violation is None:
            out.violation = (
                f"{model} step {k}: the ranks recorded {total} selections, its real tokens made {want}"
            )
        if not recorded or model not in step[0]["load"]:
            out.balancedness.append(None)
            out.balancedness_off.append(None)
            if split:
                out.balancedness_equal_split.append(None)
            out.rank_shares.append([None] * num_ranks)
            continue
        out.recorded_steps += 1
        out.selections += want
        physical = torch.tensor(
            sum(np.asarray(s["load"][model]) for s in step if model in s["load"]), dtype=torch.float64
        )  # (L, P)
        rank_load = physical.view(num_layers, num_ranks, -1).sum(dim=-1)  # (L, N)
        out.balancedness.append(measures.mean_balancedness(rank_load))
        logical = torch.zeros(num_layers, num_logical, dtype=torch.float64)
        logical.scatter_add_(1, placements[i].long(), physical)
        out.balancedness_off.append(
            measures.mean_balancedness(measures.rank_loads(logical, initial, num_ranks))
        )
        if split:
            out.balancedness_equal_split.append(
                measures.mean_balancedness(measures.rank_loads(logical, placements[i], num_ranks))
            )
        if out.first_planned is None:
            out.first_planned = measures.mean_balancedness(measures.rank_loads(logical, start, num_ranks))
        total_per_layer = rank_load.sum(dim=1, keepdim=True).clamp(min=1)
        out.rank_shares.append((rank_load / total_per_layer).mean(dim=0).tolist())
    position = {i: k for k, i in enumerate(serving)}
    for c in commits:  # a commit during a step without a forward counts at the next serving step
        k = position.get(c["step"], position.get(min((i for i in serving if i > c["step"]), default=-1)))
        if k is not None:
            out.commits[k].append(c["layer"])
    return out


def _rank_stats(
    config: SimulateConfig,
    folder: Path,
    observed: list[dict[str, Any]],
    summaries: list[dict[str, Any]],
    completions: list[Completion],
    reference: list[Completion],
    tolerance: OutputTolerance,
    start: dict[str, list[list[int]]],
    installed: list[dict[str, list[str]]] | None,
) -> list[RankStats]:
    """Each rank's ``RankStats`` from what the observer saw on the EPLB-on engine's workers (``start``:
    each model's placement when serving began; ``installed``: with ``--initial-placement``, each rank's
    slots not holding their expert right after start-up)."""
    info = checkpoint_info(folder)
    target, draft = str(folder), str(folder) + DRAFT_SUFFIX
    max_error, output_violation = _outputs_error(completions, reference, tolerance)
    serving = [i for i, s in enumerate(observed[0]["steps"]) if not s["is_dummy"]]
    initial = measures.upstream_initial_placement(
        info.num_logical_experts, config.num_redundant_experts, info.num_moe_layers
    )
    dp = config.data_parallel_size
    main = _series(
        observed,
        serving,
        target,
        torch.tensor(start[target]),
        initial,
        info.num_logical_experts,
        info.top_k,
        dp,
        split=config.replica_split != "equal",
    )
    drafted = None
    if config.speculative_tokens:
        # upstream's initial placement of the draft: the target's rows, one per MTP layer
        drafted = _series(
            observed, serving, draft, torch.tensor(start[draft]), initial[: info.num_mtp_layers],
            info.num_logical_experts, info.top_k, dp,
        )  # fmt: skip
    mismatched = [c for rank in observed for c in rank["commits"] if c["mismatches"]]
    violation = None
    if output_violation is not None:
        violation = ("outputs", output_violation)
    elif main.violation is not None or (drafted is not None and drafted.violation is not None):
        violation = ("load", main.violation or drafted.violation)
    elif mismatched:
        c = mismatched[0]
        violation = (
            "fingerprints",
            f"{c['model_name']} layer {c['layer']}, rearrangement {c['rearrangement']}: {c['mismatches'][0]}",
        )
    if violation is None and summaries[0]["worker_failure"] is not None:
        violation = ("worker", summaries[0]["worker_failure"][0])

    def seen(rank: int, model: str, series: _Series) -> InstallSeen | None:
        if installed is None:
            return None
        return InstallSeen(installed[rank].get(model), series.first_planned)

    out = []
    for index, (rank, summary) in enumerate(zip(observed, summaries, strict=True)):
        mine = [rank["steps"][i] for i in serving]
        draft_stats = None
        if drafted is not None:
            draft_stats = DraftStats(
                model=draft,
                forwards_per_step=config.speculative_tokens,
                num_moe_layers=info.num_mtp_layers,
                balancedness_per_step=tuple(drafted.balancedness),
                balancedness_off_per_step=tuple(drafted.balancedness_off),
                commits_per_step=tuple(tuple(sorted(c)) for c in drafted.commits),
                max_output_error=max_error,  # the draft proposes, the target's outputs decide
                load_steps_recorded=drafted.recorded_steps,
                load_selections=drafted.selections,
                install=seen(index, draft, drafted),
                bytes_received=summary["bytes_received"].get(draft),
            )
        out.append(
            RankStats(
                output_tolerance=tolerance,
                balancedness_per_step=tuple(main.balancedness),
                balancedness_off_per_step=tuple(main.balancedness_off),
                rank_load_share_per_step=tuple(tuple(s) for s in main.rank_shares),
                step_seconds=tuple(s["seconds"] for s in mine),
                step_cpu_seconds=tuple(s["cpu_seconds"] for s in mine),
                verifier_seconds=tuple(s["verifier_seconds"] for s in mine),
                step_in_flight=tuple(s["in_flight"] for s in mine),
                commits_per_step=tuple(tuple(sorted(c)) for c in main.commits),
                rearrangements_per_step=tuple(s["rearrangements"] for s in mine),
                max_output_error=max_error,
                worker_failure=None
                if summary["worker_failure"] is None
                else tuple(summary["worker_failure"]),
                load_steps_recorded=main.recorded_steps,
                load_selections=main.selections,
                install=seen(index, target, main),
                moe_rows=summary["moe_rows"],
                compilation=summary["compilation"],
                violation=violation,
                num_rearrangements=summary["num_rearrangements"],
                num_skipped_rearrangements=summary["num_skipped_rearrangements"],
                bytes_received=summary["bytes_received"].get(target),
                expert_nbytes=summary["expert_nbytes"][target],
                verifier_commits_checked=summary["verifier_commits_checked"] or 0,
                verifier_steps=summary["verifier_steps"] or 0,
                slots_per_rank=summary["slots_per_rank"],
                in_flight_at_end=tuple(InFlightAtShutdown(**cycle) for cycle in summary["in_flight"]),
                draft=draft_stats,
                balancedness_equal_split_per_step=tuple(main.balancedness_equal_split),
                split_scope=summary["split_scope"],
            )
        )
    return out


def _failed_ranks(
    config: SimulateConfig, tolerance: OutputTolerance, failure: tuple[str, str]
) -> list[RankStats]:
    """The ranks of an EPLB-on engine a serving guardrail stopped (the verifier, or the watchdog with
    ``--on-worker-failure raise``): vLLM's engine ends with its workers, so nothing more of the run can be
    read; each rank carries the guardrail's check and message."""
    check, message = failure
    stopped = RankStats(
        output_tolerance=tolerance, balancedness_per_step=(), balancedness_off_per_step=(),
        rank_load_share_per_step=(), step_seconds=(), step_cpu_seconds=(), verifier_seconds=(),
        step_in_flight=(), commits_per_step=(), rearrangements_per_step=(), max_output_error=0.0,
        worker_failure=(message, 0) if check == "worker" else None, load_steps_recorded=0,
        load_selections=0, install=None, moe_rows=None, compilation=None, violation=failure,
        num_rearrangements=0, num_skipped_rearrangements=0, bytes_received=None, expert_nbytes=0,
        verifier_commits_checked=0, verifier_steps=0, slots_per_rank=0, in_flight_at_end=(),
    )  # fmt: skip
    return [stopped] * config.num_ranks
