"""What the engine world observes inside vLLM's workers, through the engine's own RPC.

Each function here takes vLLM's worker first and runs on every worker when passed to
:meth:`~.host.EngineWorld.run_on_workers` (vLLM's ``collective_rpc``); its result is plain data. The
observer installed by :func:`observe` watches the real runner's calls on its EPLB controller: every step
(:class:`StepRecord`: dummy or not, the batch the scheduler gave the runner's ``prepare_inputs``, the real
tokens the runner declared for the forward, the record flag, the selections each model recorded on this
rank), every layer commit (:class:`CommitRecord`: each local slot of the committed layer compared with its
logical expert's checkpoint weights, the independent oracle) and every placement decision. It wraps the
runner instance's ``prepare_inputs`` and methods of the controller and its state and subscribes to its
bus: it never calls EPLB itself. Shapes: L MoE layers, E logical experts, P physical experts, p local
slots.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from torch._dynamo.utils import counters

from ascend_eplb.control.bus import CommitEvent, DecisionEvent, ShutdownEvent
from ascend_eplb.integration import metrics
from ascend_eplb.world.checkpoints import checkpoint_experts
from ascend_eplb.world.slots import local_slot_mismatches

__all__ = [
    "CommitRecord",
    "StepRecord",
    "compilation",
    "eplb_state",
    "observe",
    "observed",
    "run_summary",
    "slot_mismatches",
]


@dataclass
class StepRecord:
    """One ``step`` of the runner's EPLB controller on one rank: upstream's ``is_dummy`` / ``is_profile``,
    the ``num_unpadded_tokens`` of the forward's ``prepare_forward`` (None: no forward was prepared since
    the last step), the record flag it set, per model the selections recorded on this rank (the sum of its
    load pass before upstream's step folds it into the window) and, for a step that recorded, that load
    pass itself (``load``: per model L x P ints, physical ids, this rank's share); ``in_flight``: a
    rearrangement was moving when the step began; ``rearrangements``: the state's count after it;
    ``seconds`` / ``cpu_seconds``: this process's wall and CPU time since the previous step ended, of
    which ``verifier_seconds`` in the serving verifier's hooks (0 with the verifier off). The batch of the
    runner's ``prepare_inputs`` in the step (all None: it prepared none, as in a dummy run):
    ``scheduled_tokens``, the scheduler's tokens per request; ``new_requests``, the requests scheduled for
    the first time (the scheduler's ``scheduled_new_reqs``); ``has_prefill``, upstream's
    ``BatchReqState.has_prefill``."""

    is_dummy: bool
    is_profile: bool
    num_unpadded_tokens: int | None
    recorded: bool | None
    selections: dict[str, int]
    load: dict[str, list[list[int]]] = field(default_factory=dict)
    forwards: dict[str, list[int]] = field(default_factory=dict)
    in_flight: bool = False
    rearrangements: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    verifier_seconds: float = 0.0
    scheduled_tokens: dict[str, int] | None = None
    new_requests: list[str] | None = None
    has_prefill: bool | None = None


@dataclass
class CommitRecord:
    """One layer's commit on one rank, at its acknowledgement: the rearrangement, the committed row of
    ``physical_to_logical_map`` (P ints), the local slots of every layer that differ then from their
    logical expert's checkpoint weights under the committed placement (empty: every slot holds its expert
    exactly) and the ``step`` (index into the steps) during which it committed: the steps after it route
    with it."""

    model_name: str
    layer: int
    rearrangement: int
    placement: list[int]
    mismatches: list[str]
    step: int = 0


@dataclass
class _Observer:
    checkpoint: str
    steps: list[StepRecord] = field(default_factory=list)
    commits: list[CommitRecord] = field(default_factory=list)
    prepared: list[tuple[int, bool | None]] = field(default_factory=list)
    forwards: dict[str, list[int]] = field(default_factory=dict)
    batches: list[tuple[dict[str, int], list[str], bool]] = field(default_factory=list)
    decisions: list[tuple[str, int | None, dict[str, Any]]] = field(default_factory=list)
    experts: dict[str, Any] = field(default_factory=dict)
    clock: tuple[float, float] = (0.0, 0.0)
    verifier_seconds: float = 0.0


def _ep_group() -> Any:
    """vLLM's EP group of this worker."""
    # local: runs in vLLM's workers; the processes that name these functions (simulate, the engine tests)
    # import no vLLM
    from vllm.distributed.parallel_state import get_ep_group

    return get_ep_group()


def _experts_of(observer: _Observer, model_state: Any) -> Any:
    draft = model_state.model_name.endswith(" (draft)")
    key = "draft" if draft else "target"
    if key not in observer.experts:
        observer.experts[key] = checkpoint_experts(observer.checkpoint, draft=draft)
    return observer.experts[key]


def observe(worker: Any, checkpoint: str) -> bool:
    """Install the observer on this worker's runner (idempotent); ``checkpoint`` is the model folder whose
    expert weights every committed slot is compared with. Returns whether this call installed it."""
    runner = worker.model_runner
    if getattr(runner, "_ascend_eplb_observer", None) is not None:
        return False
    controller = runner.eplb
    observer = _Observer(checkpoint)
    runner._ascend_eplb_observer = observer
    prepare_forward, step, prepare_inputs = controller.prepare_forward, controller.step, runner.prepare_inputs

    def observed_prepare_inputs(
        scheduler_output: Any, batch_req_state: Any, *args: Any, **kwargs: Any
    ) -> Any:
        scheduled = {str(r): int(n) for r, n in scheduler_output.num_scheduled_tokens.items()}
        new = [str(r.req_id) for r in scheduler_output.scheduled_new_reqs]
        observer.batches.append((scheduled, new, bool(batch_req_state.has_prefill)))
        return prepare_inputs(scheduler_output, batch_req_state, *args, **kwargs)

    def observed_prepare_forward(
        model_config: Any, num_unpadded_tokens: int, *args: Any, **kwargs: Any
    ) -> Any:
        result = prepare_forward(model_config, num_unpadded_tokens, *args, **kwargs)
        observer.prepared.append(
            (int(num_unpadded_tokens), getattr(controller, "last_record_decision", None))
        )
        return result

    state_prepare_forward = controller.state.prepare_forward

    def observed_state_prepare_forward(
        model_config: Any, num_unpadded_tokens: int, *args: Any, **kwargs: Any
    ) -> Any:
        result = state_prepare_forward(model_config, num_unpadded_tokens, *args, **kwargs)
        name = _name_of(model_config, controller.state)
        if name is not None:
            observer.forwards.setdefault(name, []).append(int(num_unpadded_tokens))
        return result

    def observed_step(is_dummy: bool = False, is_profile: bool = False) -> None:
        state = controller.state
        models = [] if state is None else list(state.model_states.values())
        selections = {ms.model_name: int(ms.expert_load_pass.sum()) for ms in models}
        # The target's forward is prepared first; a draft's forwards follow it in the same step.
        tokens, recorded = observer.prepared[0] if observer.prepared else (None, None)
        forwards = observer.forwards
        batch = observer.batches[0] if observer.batches else (None, None, None)
        observer.prepared.clear()
        observer.batches.clear()
        observer.forwards = {}
        load = (
            {ms.model_name: ms.expert_load_pass.tolist() for ms in models}
            if recorded and not is_dummy
            else {}
        )
        in_flight = any(ms.rebalanced for ms in models)
        step(is_dummy=is_dummy, is_profile=is_profile)
        wall, cpu = time.perf_counter(), time.process_time()
        observer.steps.append(
            StepRecord(
                is_dummy, is_profile, tokens, recorded, selections, load, forwards, in_flight,
                0 if state is None else int(state.num_rearrangements),
                wall - observer.clock[0], cpu - observer.clock[1], observer.verifier_seconds, *batch,
            )
        )  # fmt: skip
        observer.clock, observer.verifier_seconds = (wall, cpu), 0.0

    observer.clock = (time.perf_counter(), time.process_time())
    controller.prepare_forward = observed_prepare_forward
    controller.state.prepare_forward = observed_state_prepare_forward
    controller.step = observed_step
    runner.prepare_inputs = observed_prepare_inputs

    def on_commit(event: CommitEvent) -> None:
        if event.kind != "acknowledge":
            return
        ms = event.model_state
        placement = ms.physical_to_logical_map.cpu()
        # Every layer: those not yet committed in this rearrangement still hold their old row and weights.
        rank = _ep_group().rank_in_group
        mismatches = local_slot_mismatches(ms.model, _experts_of(observer, ms), placement, rank)
        observer.commits.append(
            CommitRecord(
                ms.model_name, event.layer, event.rearrangement, placement[event.layer].tolist(), mismatches,
                len(observer.steps),
            )
        )  # fmt: skip

    controller.bus.subscribe(CommitEvent, on_commit)
    controller.bus.subscribe(
        DecisionEvent,
        lambda e: observer.decisions.append((e.model_name, e.rearrangement, asdict(e.decision))),
    )
    _time_verifier(controller, observer)
    return True


def _name_of(model_config: Any, state: Any) -> str | None:
    """Upstream's name of the model ``state`` keys by ``model_config`` (upstream's own key), or None."""
    # local: runs in vLLM's workers; the processes that name these functions import no vLLM
    from vllm.config.utils import compute_hash_cached

    model_state = state.model_states.get(compute_hash_cached(model_config))
    return None if model_state is None else model_state.model_name


def _time_verifier(controller: Any, observer: _Observer) -> None:
    """Add the time the serving verifier's step and commit hooks take to ``observer.verifier_seconds``."""
    # local: integration's serving imports vLLM; the processes that name these functions import none
    from ascend_eplb.integration.serving import guardrails_of

    verifier = guardrails_of(controller).verifier
    if verifier is None:
        return

    def timed(hook: Any) -> Any:
        def run(event: Any) -> None:
            started = time.perf_counter()
            try:
                hook(event)
            finally:
                observer.verifier_seconds += time.perf_counter() - started

        return run

    controller.bus.wrap(verifier.on_step, timed)
    controller.bus.wrap(verifier.on_commit, timed)


def observed(worker: Any) -> dict[str, Any]:
    """What the observer saw on this worker so far: ``{"ep_rank", "steps": [StepRecord as dict], "commits":
    [CommitRecord as dict], "decisions": [(model name, rearrangement, PlacementDecision as dict)]}`` (the
    decisions of every ``DecisionEvent``: a wrapped policy's, and each window without load).

    Raises:
        RuntimeError: :func:`observe` was not called on this worker.
    """
    observer = getattr(worker.model_runner, "_ascend_eplb_observer", None)
    if observer is None:
        raise RuntimeError("no observer on this worker: run observe first")
    return {
        "ep_rank": _ep_group().rank_in_group,
        "steps": [asdict(s) for s in observer.steps],
        "commits": [asdict(c) for c in observer.commits],
        "decisions": list(observer.decisions),
    }


def compilation(worker: Any) -> dict[str, Any]:
    """How this worker's models ran: TorchDynamo's counters of the process (``unique_graphs``: graphs
    compiled so far; ``graph_breaks``: reason -> count) and, per model, the modules vLLM's compile wrapper
    traced (``traced``: the target's as ``"target"``, each model EPLB balances by upstream's model name; []
    runs eager). Unchanged counters between two calls: nothing was traced or compiled again in between."""
    # local: control's router adaptation imports vLLM; the processes that name these functions import none
    from ascend_eplb.control.router_adaptation import traced_modules

    runner = worker.model_runner
    traced = {"target": traced_modules(runner.model)}
    state = getattr(getattr(runner, "eplb", None), "state", None)
    for ms in [] if state is None else state.model_states.values():
        traced[ms.model_name] = traced_modules(ms.model)
    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": dict(counters["graph_break"]),
        "traced": traced,
    }


def slot_mismatches(worker: Any, checkpoint: str) -> dict[str, list[str]]:
    """Per registered model (upstream's model name), the local slots that differ now from their logical
    expert's checkpoint weights under the committed placement (empty lists: every slot holds its expert)."""
    state = worker.model_runner.eplb.state
    out = {}
    for ms in state.model_states.values():
        experts = checkpoint_experts(checkpoint, draft=ms.model_name.endswith(" (draft)"))
        out[ms.model_name] = local_slot_mismatches(
            ms.model, experts, ms.physical_to_logical_map.cpu(), _ep_group().rank_in_group
        )
    return out


def eplb_state(worker: Any) -> dict[str, Any]:
    """The EPLB state of this worker: the controller's class, the async worker thread alive, the number of
    rearrangements, per model the committed ``physical_to_logical_map`` (L x P ints), and per model with a
    load estimate (``load_estimate: pooled``) its windows taken in and its load (L x E floats)."""
    controller = worker.model_runner.eplb
    state = controller.state
    thread = getattr(state, "async_worker", None) if state is not None else None
    return {
        "controller": type(controller).__name__,
        "ep_rank": _ep_group().rank_in_group,
        "async_worker_alive": None if thread is None else bool(thread.is_alive()),
        "num_rearrangements": None if state is None else getattr(state, "num_rearrangements", None),
        "placements": {}
        if state is None
        else {ms.model_name: ms.physical_to_logical_map.tolist() for ms in state.model_states.values()},
        "estimates": {}
        if state is None
        else {
            channel.model_name: (channel.estimate.windows, channel.estimate.load.tolist())
            for channel in state.channels
            if channel.estimate is not None and channel.estimate.load is not None
        },
    }


def run_summary(worker: Any) -> dict[str, Any]:
    """What this worker's serving path holds at the end of a run, per rank: the MoE row layout of its
    last forward, the batch split's scope (``ascend_eplb.control.split_config``), how vLLM ran the model
    (``"eager (enforce_eager)"`` or ``"<mode>, <backend> backend"``), the state's rearrangement counters,
    per model the bytes its communicator received (None: not counted) and one expert's bytes, the serving
    verifier's counters (None: verifier off), p, and the cycles in flight as the watchdog names them at
    the runner's end of life (``InFlightAtShutdown`` as dicts; asking changes nothing) and the watchdog's
    failure (``(message, step)``, or None)."""
    # local: integration's serving imports vLLM; the processes that name these functions import none
    from ascend_eplb.integration.serving import guardrails_of

    runner = worker.model_runner
    controller = runner.eplb
    state = controller.state
    layout = getattr(controller, "last_row_layout", None)
    compilation = runner.vllm_config.compilation_config
    eager = compilation.mode.name == "NONE"
    guardrails = guardrails_of(controller)
    verifier = guardrails.verifier
    in_flight = guardrails.watchdog.at_shutdown(ShutdownEvent(controller))
    models = list(state.model_states.values())
    group = _ep_group()
    return {
        "ep_rank": group.rank_in_group,
        "moe_rows": None if layout is None else layout.rows,
        "split_scope": state.split_scope,
        "compilation": "eager (enforce_eager)"
        if eager
        else f"{compilation.mode.name}, {compilation.backend} backend",
        "num_rearrangements": int(state.num_rearrangements),
        "num_skipped_rearrangements": int(state.num_skipped_rearrangements),
        "bytes_received": {ms.model_name: metrics.bytes_received(ms) for ms in models},
        "expert_nbytes": {ms.model_name: metrics.expert_bytes(ms.model.expert_weights)[0] for ms in models},
        "verifier_commits_checked": None if verifier is None else verifier.commits_checked,
        "verifier_steps": None if verifier is None else verifier.steps,
        "slots_per_rank": int(models[0].physical_to_logical_map.shape[1]) // group.world_size
        if models
        else 0,
        "in_flight": [asdict(cycle) for cycle in in_flight],
        "worker_failure": None
        if guardrails.watchdog.failure is None
        else (guardrails.watchdog.failure.message(), guardrails.watchdog.failure.step),
    }
