"""Rank functions of the integration's end-to-end tests (loaded by path in each rank process).

``mrv2_world`` is one Ascend Model Runner V2 worker with EPLB on, on CPU over Gloo: vLLM's plugin loader
discovers the integration's entry point, which applies the patches (``ASCEND_EPLB=1``), the runner builds
its controller through :class:`~ascend_eplb.integration.runner.Mrv2EplbWiring`, and vLLM 0.33.0's own
``EPLBController`` / ``EplbState`` / async worker / default policy run the rearrangements. The model is
the repository's toy MoE model (``ascend_eplb.world.toy_moe``): each layer routes through upstream's
real ``CustomRoutingRouter`` (a ``BaseRouter``), fed with the real ESFT DeepSeek-V2-Lite routing trace, and
holds tagged expert weights. The rank returns what it observed.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ascend_eplb.testing import RankContext
from ascend_eplb.testing.oracles import tag

NUM_MOE_LAYERS = 2
NUM_LOGICAL = 64  # DeepSeek-V2-Lite routed experts, as in the trace
NUM_REDUNDANT = 4
TOP_K = 6
TOKENS = 24  # real tokens per batch and rank
PADDING = 8  # padded rows appended to every batch (never recorded)
DUMMY_TOKENS = 16  # tokens of the profile and warm-up dummy forwards
WINDOW = 2
INTERVAL = 6
DEADLINE_S = 30.0
PHASE = "decode"  # load collected from decode batches only


def _trace(num_sequences: int) -> list[list[torch.Tensor]]:
    """Per MoE layer: the first sequences' top-6 ids of the real ESFT trace, int64 ``(tokens, 6)``."""
    from ascend_eplb.world.esft import esft_sequences

    return [esft_sequences(layer, num_sequences) for layer in range(NUM_MOE_LAYERS)]


def _build_model(ep_rank: int, num_ranks: int):
    """The repository's toy MoE model with tagged weights; built inside the rank (it imports vLLM)."""
    from ascend_eplb.testing.tagged import TaggedExperts
    from ascend_eplb.world.toy_moe import ToyMoEModel, initial_local_experts

    local = initial_local_experts(ep_rank, num_ranks, NUM_LOGICAL, NUM_REDUNDANT)
    experts = [TaggedExperts(layer, local, tag) for layer in range(NUM_MOE_LAYERS)]
    return ToyMoEModel(experts, NUM_LOGICAL, NUM_REDUNDANT, num_ranks, TOP_K)


def instance_bindings() -> set[str]:
    """The upstream methods the process has replaced on single instances now, measured: for every live
    object (classes excluded) whose instance ``__dict__`` holds a callable under the name of a function
    defined by a torch or vLLM class of its type's MRO, ``module.Class.method`` of that class."""
    import gc
    import inspect

    found: set[str] = set()
    for obj in gc.get_objects():
        if isinstance(obj, type):
            continue
        try:
            attrs = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            continue
        if not isinstance(attrs, dict) or not attrs:
            continue
        for attr, value in list(attrs.items()):
            if not isinstance(attr, str) or not callable(value):
                continue
            for base in type(obj).__mro__:
                if inspect.isfunction(base.__dict__.get(attr)):
                    if base.__module__.split(".")[0] in ("torch", "vllm"):
                        found.add(f"{base.__module__}.{base.__qualname__}.{attr}")
                    break
    return found


def mrv2_world(ctx: RankContext) -> dict[str, Any]:
    """Init, load, profile run, warm-up, then engine steps until a rearrangement completes and one more
    window passes; every step is checked (weights, lookups, routing) on the spot."""
    os.environ["ASCEND_EPLB"] = "1"
    os.environ["ASCEND_EPLB_VERIFY"] = "1"  # the serving verifier checks every commit and step too
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    import vllm.plugins

    from ascend_eplb.integration.patches import patches_applied

    # vLLM's own loader discovers and runs the vllm.general_plugins entry points before any config
    # exists (what every vLLM process does at start-up).
    vllm.plugins.load_general_plugins()
    report: dict[str, Any] = {"rank": ctx.rank, "registered": patches_applied()}

    from vllm.config import EPLBConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker.gpu import eplb_utils

    from ascend_eplb.control import AscendEPLBController, AscendEplbLayerState, AscendEplbState, CommitEvent
    from ascend_eplb.dataplane import DEFAULT_ROWS, build_replica_table, is_bound
    from ascend_eplb.integration.runner import Mrv2EplbWiring, batch_has_prefill
    from ascend_eplb.movement import AscendGlooEplbCommunicator

    rank, n = ctx.rank, ctx.world_size
    # Communicator left unset: the patched ParallelConfig resolves it to torch_gloo.
    eplb_config = EPLBConfig(
        window_size=WINDOW, step_interval=INTERVAL, num_redundant_experts=NUM_REDUNDANT, use_async=True
    )
    vc = VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=n, enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb_config
        ),
        additional_config={"eplb_config": {"load_collection_phase": PHASE}},
    )
    report["communicator_setting"] = vc.parallel_config.eplb_config.communicator
    device = torch.device("cpu")
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=n, rank=rank, distributed_init_method=ctx.init_method, local_rank=rank, backend="gloo"
        )
        initialize_model_parallel(tensor_model_parallel_size=n)
        # 1'. Upstream's own runner construction, `EPLBController(self.parallel_config, self.device)`
        # looked up in vllm/v1/worker/gpu/model_runner.py: the plugin's patch alone gives it the
        # Ascend controller, from the current vLLM config.
        import vllm.v1.worker.gpu.model_runner as upstream_runner
        from vllm.distributed.parallel_state import get_ep_group

        via_upstream = upstream_runner.EPLBController(vc.parallel_config, device)
        report["upstream_construction"] = type(via_upstream).__name__
        report["upstream_construction_phase"] = via_upstream.load_collection_phase
        del via_upstream

        # 1. runner __init__
        wiring = Mrv2EplbWiring(vc, device)
        ctrl = wiring.controller
        report["controller"] = type(ctrl).__name__
        report["controller_is_ascend"] = isinstance(ctrl, AscendEPLBController)
        report["upstream_controller_subclass"] = isinstance(ctrl, eplb_utils.EPLBController)

        # 2-4. load_model: prepare_load, draft (none), model registration, async worker start.
        model = _build_model(rank, n)
        from ascend_eplb.world.toy_moe import ToyModelConfig

        mc = ToyModelConfig("toy/mrv2-moe")
        upstream_layer_states = [layer.router.eplb_state for layer in model.layers]
        bound_before = instance_bindings()
        report["registered_model"] = wiring.load_model(model, mc)
        # The per-instance replacements of upstream methods, measured after the registration and at the
        # first acknowledgement of an async commit (while the acknowledging record runs).
        report["instance_bindings_after_registration"] = sorted(instance_bindings() - bound_before)
        state = ctrl.state

        def measure_at_acknowledgement(event) -> None:
            if event.kind == "acknowledge" and "instance_bindings_at_acknowledgement" not in report:
                report["instance_bindings_at_acknowledgement"] = sorted(instance_bindings() - bound_before)

        ctrl.bus.subscribe(CommitEvent, measure_at_acknowledgement)
        report["state_class"] = type(state).__name__
        report["state_is_ascend"] = isinstance(state, AscendEplbState)
        state.collect_commit_evidence = True
        state.commit_probe = lambda ms, layer: model.layers[layer].experts.local_tags()
        ms = state.model_states[mc.compute_hash()]
        report["communicator"] = type(ms.communicator).__module__ + "." + type(ms.communicator).__qualname__
        report["communicator_is_movement"] = isinstance(ms.communicator, AscendGlooEplbCommunicator)
        report["worker_started"] = state.async_worker is not None and state.async_worker.is_alive()

        p = model.num_local_physical_experts
        routers = [layer.router for layer in model.layers]
        layer_states = [r.eplb_state for r in routers]
        report["adapted"] = [
            {
                "bound": is_bound(r),
                "ascend_state": isinstance(ls, AscendEplbLayerState),
                "replaced_upstream": ls is not upstream_layer_states[i],
                "layer_sees_it": model.layers[i].eplb_state is ls,
                "load_view_is_upstream_row": ls.expert_load_view.data_ptr()
                == ms.expert_load_pass[i].data_ptr(),
                "shares_record_flag": ls.should_record_tensor is state.should_record_tensor,
                "registered_by_state": state.layer_states(mc)[i] == [ls],
            }
            for i, (r, ls) in enumerate(zip(routers, layer_states, strict=True))
        ]
        table_ptrs = [ls.replica_lookup.table.data_ptr() for ls in layer_states]

        errors: list[str] = []
        forwards = 0

        def check(where: str) -> None:
            for layer, ls in enumerate(layer_states):
                expected = build_replica_table(
                    ms.logical_to_physical_map[layer], ms.logical_replica_count[layer], 0, DEFAULT_ROWS
                )
                if not torch.equal(ls.replica_lookup.table, expected):
                    errors.append(f"{where}: layer {layer} lookup differs from the committed maps")
                if ls.replica_lookup.table.data_ptr() != table_ptrs[layer]:
                    errors.append(f"{where}: layer {layer} lookup table moved")
                committed = ms.physical_to_logical_map[layer, rank * p : (rank + 1) * p].tolist()
                want = [[tag(layer, e), tag(layer, e)] for e in committed]
                if model.layers[layer].experts.local_tags() != want:
                    errors.append(
                        f"{where}: layer {layer} weights {model.layers[layer].experts.local_tags()} != {want}"
                    )
                if model.layers[layer].routing_calls != forwards:
                    errors.append(
                        f"{where}: layer {layer} router called {model.layers[layer].routing_calls} times "
                        f"in {forwards} forwards"
                    )

        trace = _trace(40)
        mismatches = 0

        def forward(seq: int, num_tokens: int) -> torch.Tensor:
            """One model forward of ``num_tokens`` real rows plus PADDING padded rows; (L, E) real counts."""
            nonlocal forwards, mismatches
            ids = [
                torch.cat([trace[layer][seq % 40][:num_tokens], trace[layer][(seq + 1) % 40][:PADDING]])
                for layer in range(NUM_MOE_LAYERS)
            ]
            physical = [phys for _, phys in model.route(ids)]
            forwards += 1
            for layer in range(NUM_MOE_LAYERS):
                # Routing only ever uses the committed placement: every physical id holds the expert.
                mismatches += int(
                    (ms.physical_to_logical_map[layer][physical[layer].long()] != ids[layer]).sum()
                )
            return torch.stack(
                [
                    torch.bincount(ids[layer][:num_tokens].flatten(), minlength=NUM_LOGICAL)
                    for layer in range(NUM_MOE_LAYERS)
                ]
            )

        # 5. profile_run: _dummy_run(is_profile=True) forward, then the profile step.
        wiring.prepare_forward(mc, DUMMY_TOKENS)
        forward(39, DUMMY_TOKENS)
        wiring.profile_run()
        report["load_after_profile"] = int(ms.expert_load_pass.sum())
        # 6. a warm-up _dummy_run: forward then a dummy step.
        wiring.prepare_forward(mc, DUMMY_TOKENS)
        forward(38, DUMMY_TOKENS)
        wiring.dummy_run()
        report["load_after_warmup"] = int(ms.expert_load_pass.sum())
        report["rearrangements_after_dummies"] = state.num_rearrangements
        report["skipped_after_dummies"] = state.num_skipped_rearrangements
        report["counter_after_dummies"] = state.expert_rearrangement_step
        check("after profile and warm-up")

        expected_local = torch.zeros(NUM_MOE_LAYERS, NUM_LOGICAL, dtype=torch.int64)
        steps: list[dict[str, Any]] = []
        initial_map = ms.physical_to_logical_map.clone()
        step = 0
        windows: list[dict[str, Any]] = []

        def engine_step() -> None:
            nonlocal step
            if ms.rebalanced:
                # The async worker must hand over the next layer within the deadline.
                deadline = time.monotonic() + DEADLINE_S
                while ms.pending_result is None:
                    if not state.async_worker.is_alive():
                        raise AssertionError("the async EPLB worker died")
                    if time.monotonic() > deadline:
                        raise AssertionError(f"no layer transferred within {DEADLINE_S} s")
                    time.sleep(0.001)
            # Rank r has a prefill request at step s iff r + s is even: a prompt of 24 tokens of which
            # 0 (prefill) or all (decode) are computed.
            computed = [0 if (rank + step) % 2 == 0 else TOKENS, TOKENS]
            has_prefill = batch_has_prefill(computed, [TOKENS, TOKENS])
            counter_before = state.expert_rearrangement_step
            wiring.prepare_inputs(has_prefill)  # 7
            # 8: unpadded count (PADDING rows follow); each rank routes rows of its own, as vLLM Ascend's
            # MC2 dispatch does: the 'split' row layout.
            wiring.prepare_forward(mc, TOKENS, moe_rows="split")
            recorded = bool(state.should_record_tensor)
            counts = forward(step * n + rank, TOKENS)
            if recorded:
                expected_local.add_(counts)
            wiring.after_sampling()  # 9
            steps.append(
                {
                    "step": step,
                    "has_prefill": has_prefill,
                    "recorded": recorded,
                    "counter_before": counter_before,
                    "counter_after": state.expert_rearrangement_step,
                    "rearrangements": state.num_rearrangements,
                    "skipped": state.num_skipped_rearrangements,
                    "rebalanced": ms.rebalanced,
                }
            )
            check(f"step {step}")
            step += 1

        # Until the first window closes and every layer committed, then one window more.
        while state.num_rearrangements == 0:
            if step > INTERVAL:
                raise AssertionError("the window never closed")
            engine_step()
        expected_global = expected_local.to(torch.int32)
        torch.distributed.all_reduce(expected_global, group=get_ep_group().cpu_group)
        from vllm.distributed.eplb.policy import DefaultEplbPolicy

        policy_map = DefaultEplbPolicy.rebalance_experts(
            expected_global, model.num_physical_experts, 1, 1, n, initial_map
        )
        windows.append(
            {
                "expected_global": expected_global.tolist(),
                "last_expert_load": ms.last_expert_load.tolist(),
                "policy_map": policy_map.tolist(),
            }
        )
        while ms.rebalanced:
            if step > INTERVAL + NUM_MOE_LAYERS + 1:
                raise AssertionError("the rearrangement never finished")
            engine_step()

        report["steps"] = steps
        report["windows"] = windows
        report["errors"] = errors
        report["routing_mismatches"] = mismatches
        report["forwards"] = forwards
        report["routing_calls"] = [layer.routing_calls for layer in model.layers]
        report["initial_map"] = initial_map.tolist()
        report["committed_map"] = ms.physical_to_logical_map.tolist()
        report["num_rearrangements"] = state.num_rearrangements
        report["num_skipped"] = state.num_skipped_rearrangements
        report["rebalanced"] = ms.rebalanced
        report["worker_alive"] = state.async_worker.is_alive()
        from ascend_eplb.control import StepEvent
        from ascend_eplb.integration.serving import guardrails_of

        verifier = guardrails_of(ctrl).verifier
        report["verifier"] = [
            type(verifier).__name__, verifier.commits_checked, verifier.steps, verifier.boundaries_checked
        ]  # fmt: skip
        report["step_hooks"] = [type(h.__self__).__name__ for h in ctrl.bus.subscribers(StepEvent)]
        report["commit_log"] = [
            (e.kind, e.model_name, e.layer, e.rearrangement, dict(e.evidence)) for e in state.commit_log
        ]
        report["table_ptrs"] = table_ptrs
        report["local_slots"] = list(range(rank * p, (rank + 1) * p))
        report["calls"] = [name for name, _ in wiring.calls]
        report["prepare_forward_tokens"] = [
            args[1] for name, args in wiring.calls if name == "prepare_forward"
        ]
    return report


#: The Ascend keys of :func:`gate_events_world`: the migration-aware policy behind the gain gate, both
#: on the load estimate.
GATE_KEYS = {
    "policy": "migration_aware",
    "min_balancedness_gain": 0.01,
    "target_balancedness": 0.99,
    "load_estimate": "pooled",
}
#: :func:`gate_events_world`'s windows: even global load, load on rank 0's experts, prefill only (no
#: load recorded under phase decode), even again.
GATE_WINDOWS = ("split", "hot", "idle", "split")


def _block_ids(block: int, num_ranks: int, num_tokens: int) -> torch.Tensor:
    """int64 ``(num_tokens, TOP_K)`` cycling through the ``block``-th of ``num_ranks`` blocks of experts
    (control's tests route the same loads: ``packages/eplb-control/tests/ranks.py``)."""
    size = NUM_LOGICAL // num_ranks
    return torch.arange(num_tokens * TOP_K, dtype=torch.int64).view(num_tokens, TOP_K) % size + block * size


def gate_events_world(ctx: RankContext, events_file: str) -> dict[str, Any]:
    """The serving wiring (the plugin's patches, ``Mrv2EplbWiring``) with :data:`GATE_KEYS` in
    ``additional_config.eplb_config`` and ``ASCEND_EPLB_EVENTS``, through :data:`GATE_WINDOWS`: ``split``
    (rank ``r`` routes the ``r``-th block of experts: local loads differ, the global load is even),
    ``hot`` (every rank routes rank 0's block), ``idle`` (prefill batches: nothing recorded).

    Returns ``records`` (every record this rank's events recorder published, in order),
    ``step_of_record`` (per record, the 0-based index of the engine step during which it came),
    ``maps`` (per window: the placement before and after), ``expert_bytes`` (of one expert, from the
    tagged weights' own tensors), ``active_policy`` and ``errors``.
    """
    os.environ["ASCEND_EPLB"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["ASCEND_EPLB_EVENTS"] = events_file
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    from vllm.config import EPLBConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    from ascend_eplb.integration.events.recorder import EventsRecord
    from ascend_eplb.integration.runner import Mrv2EplbWiring
    from ascend_eplb.world.toy_moe import ToyModelConfig

    rank, n = ctx.rank, ctx.world_size
    eplb_config = EPLBConfig(
        window_size=WINDOW, step_interval=INTERVAL, num_redundant_experts=NUM_REDUNDANT, use_async=True
    )
    vc = VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=n, enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb_config
        ),
        additional_config={"eplb_config": {"load_collection_phase": PHASE, **GATE_KEYS}},
    )
    report: dict[str, Any] = {"rank": rank}
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=n, rank=rank, distributed_init_method=ctx.init_method, local_rank=rank, backend="gloo"
        )
        initialize_model_parallel(tensor_model_parallel_size=n)
        wiring = Mrv2EplbWiring(vc, torch.device("cpu"))
        ctrl = wiring.controller
        model = _build_model(rank, n)
        mc = ToyModelConfig("toy/gate-moe")
        records: list[dict[str, Any]] = []
        step_of_record: list[int] = []
        step = 0

        def keep(published) -> None:
            records.append(published.record.to_json())
            step_of_record.append(step)

        ctrl.bus.subscribe(EventsRecord, keep)
        assert wiring.load_model(model, mc)
        state = ctrl.state
        ms = state.model_states[mc.compute_hash()]
        report["active_policy"] = state.policy.__name__
        experts = model.layers[0].experts
        report["expert_bytes"] = sum(int(t[0].numel()) * t.element_size() for t in (experts.w13, experts.w2))
        trace = _trace(2)

        def forward(mode: str, num_tokens: int) -> None:
            block = rank if mode == "split" else 0
            real = _block_ids(block, n, num_tokens)
            model.route([torch.cat([real, trace[layer][1][:PADDING]]) for layer in range(NUM_MOE_LAYERS)])

        # profile_run: a dummy forward, then upstream's profile step (not a serving step).
        wiring.prepare_forward(mc, DUMMY_TOKENS)
        forward("split", DUMMY_TOKENS)
        wiring.profile_run()

        def engine_step(mode: str) -> None:
            nonlocal step
            deadline = time.monotonic() + DEADLINE_S
            while ms.rebalanced and ms.pending_result is None:
                assert state.async_worker.is_alive(), "the async EPLB worker died"
                assert time.monotonic() < deadline, f"no layer transferred within {DEADLINE_S} s"
                time.sleep(0.001)
            wiring.prepare_inputs(mode == "idle")  # a prefill batch is not recorded under phase decode
            wiring.prepare_forward(mc, TOKENS, moe_rows="split")
            forward(mode, TOKENS)
            wiring.after_sampling()
            step += 1

        maps = []
        for mode in GATE_WINDOWS:
            before = ms.physical_to_logical_map.tolist()
            closed = state.num_rearrangements + state.num_skipped_rearrangements
            while state.num_rearrangements + state.num_skipped_rearrangements == closed:
                assert step < 100, "the window never closed"
                engine_step(mode)
            while ms.rebalanced:
                engine_step(mode)
            maps.append({"before": before, "after": ms.physical_to_logical_map.tolist()})
        report.update(records=records, step_of_record=step_of_record, maps=maps, steps=step)
    return report
