"""Rank functions of the control plane's multi-rank tests (loaded by path in each rank process).

One world drives the real upstream stack: ``AscendEPLBController`` over vLLM 0.33.0's
``EPLBController`` / ``EplbState`` / async worker / ``DefaultEplbPolicy`` / Gloo communicator, and the
toy MoE model (``ascend_eplb.world.toy_moe``) with tagged weights, whose upstream routers
run dataplane's op on the real ESFT DeepSeek-V2-Lite routing trace. It returns what it observed; the
tests compare the ranks' reports.
"""

from __future__ import annotations

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
WINDOW = 2
INTERVAL = 8
DEADLINE_S = 30.0


def _trace(num_sequences: int) -> list[list[torch.Tensor]]:
    """Per MoE layer: the first sequences' top-6 ids of the real ESFT trace, int64 ``(tokens, 6)``."""
    from ascend_eplb.world.esft import esft_sequences

    return [esft_sequences(layer, num_sequences) for layer in range(NUM_MOE_LAYERS)]


def _config(world_size: int, use_async: bool, window: int = WINDOW, interval: int = INTERVAL):
    from vllm.config import EPLBConfig, ParallelConfig, VllmConfig

    # Valid as built only with the host adaptation's platform proxy installed (no accelerator here).
    eplb_config = EPLBConfig(
        window_size=window,
        step_interval=interval,
        num_redundant_experts=NUM_REDUNDANT,
        use_async=use_async,
        communicator="torch_gloo",
    )
    parallel_config = ParallelConfig(
        tensor_parallel_size=world_size,
        enable_expert_parallel=True,
        enable_eplb=True,
        eplb_config=eplb_config,
    )
    return VllmConfig(parallel_config=parallel_config)


def _split_ids(rank: int, num_ranks: int, num_tokens: int) -> torch.Tensor:
    """int64 ``(num_tokens, TOP_K)``: rank ``r`` selects only the ``r``-th block of ``E / N`` logical
    experts, cycling through it (token ``t``, choice ``j``: ``(TOP_K t + j) mod (E / N)`` of the block).

    Each rank's local load sits on its own block; over the ranks (N = 2, 24 tokens) the blocks' first
    halves get 5 selections per expert and step, their second halves 4: under upstream's initial
    placement (E = 64, 4 redundant) both ranks carry 144, balancedness 1.0."""
    block = NUM_LOGICAL // num_ranks
    picks = torch.arange(num_tokens * TOP_K, dtype=torch.int64).view(num_tokens, TOP_K)
    return picks % block + rank * block


WINDOWS = ("skewed", "zero", "skewed")


def control_world(
    ctx: RankContext,
    use_async: bool,
    phase: str,
    windows: tuple[str, ...] = WINDOWS,
    policy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Rearrangement windows, by default three: skewed real load, an all-zero window, skewed real load
    again.

    Phases: under ``decode``/``prefill`` the ranks get different phases in the same step (rank ``r``
    has prefill at step ``s`` iff ``r + s`` is even); in the zero window every rank gets the filtered
    phase (under ``all``: batches of padding only). A ``split`` window routes :func:`_split_ids`
    (every rank's local load differs, the global load is even); a ``hot`` window routes rank 0's block
    on every rank (the load sits on the experts of rank 0). ``policy``: the fields of control's
    ``PolicySettings`` the controller gets (None: upstream's default policy, gate off).
    """
    from vllm.config import set_current_vllm_config
    from vllm.distributed.eplb import eplb_state as upstream_state
    from vllm.distributed.eplb.policy import DefaultEplbPolicy
    from vllm.distributed.parallel_state import (
        get_ep_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from ascend_eplb.control import (
        AscendEPLBController,
        DecisionEvent,
        PatchSet,
        PolicySettings,
        commit_hooks,
        host_adaptation,
    )
    from ascend_eplb.control import state as control_state
    from ascend_eplb.control.gate import POLICIES
    from ascend_eplb.dataplane import DEFAULT_ROWS, build_replica_table, table_checksum
    from ascend_eplb.testing.tagged import TaggedExperts
    from ascend_eplb.world.toy_moe import ToyModelConfig, ToyMoEModel, initial_local_experts

    # What the integration's apply_patches() installs of this plane (control does not install them).
    assert PatchSet([*host_adaptation.PATCHES, *commit_hooks.PATCHES]).apply() is True
    vc = _config(ctx.world_size, use_async)
    rank, n = ctx.rank, ctx.world_size
    report: dict[str, Any] = {"rank": rank}
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=n, rank=rank, distributed_init_method=ctx.init_method, local_rank=rank, backend="gloo"
        )
        initialize_model_parallel(tensor_model_parallel_size=n)
        assert get_ep_group().world_size == n

        # Record every main-thread collective of upstream and of this package, in order.
        collectives: list[tuple[str, tuple[int, ...], str]] = []

        def recording(module, name):
            original = module.all_reduce

            def all_reduce(tensor, *args, **kwargs):
                collectives.append((name, tuple(tensor.shape), str(tensor.dtype)))
                return original(tensor, *args, **kwargs)

            module.all_reduce = all_reduce

        recording(upstream_state, "upstream")
        recording(control_state, "control")

        local = initial_local_experts(rank, n, NUM_LOGICAL, NUM_REDUNDANT)
        experts = [TaggedExperts(layer, local, tag) for layer in range(NUM_MOE_LAYERS)]
        model = ToyMoEModel(experts, NUM_LOGICAL, NUM_REDUNDANT, n, TOP_K)
        mc = ToyModelConfig("fake/tiny-moe")
        settings = PolicySettings(**policy) if policy is not None else None
        ctrl = AscendEPLBController(
            vc.parallel_config, torch.device("cpu"), load_collection_phase=phase, policy_settings=settings
        )
        ctrl.prepare_load()
        state = ctrl.state
        decisions: list[tuple[Any, ...]] = []
        ctrl.bus.subscribe(
            DecisionEvent,
            lambda e: decisions.append(
                (e.model_name, e.rearrangement, e.decision.policy, e.decision.skipped,
                 e.decision.balancedness_before, e.decision.balancedness_planned, e.decision.experts_moved)
            ),
        )  # fmt: skip
        state.collect_commit_evidence = True
        state.commit_probe = lambda ms, layer: model.layers[layer].experts.local_tags()
        # The controller converts each router's upstream layer state and binds dataplane's op first.
        upstream_layer_states = [layer.router.eplb_state for layer in model.layers]
        assert ctrl.maybe_register_model(model, mc)
        report["routers_adapted"] = [
            type(layer.router.eplb_state).__name__ == "AscendEplbLayerState"
            and layer.router.eplb_state is not upstream_layer_states[i]
            and "_apply_eplb_mapping" in vars(layer.router)
            for i, layer in enumerate(model.layers)
        ]
        ctrl.maybe_start_async_loop(True)
        ms = state.model_states[mc.compute_hash()]
        report["policy"] = {
            "is_upstream_default": state.policy is DefaultEplbPolicy,
            "name": state.policy.__name__,
            "settings": repr(getattr(state.policy, "settings", None)),
        }
        # Every expert transfer upstream's transaction posts, counted per cycle.
        transfers = {"send": 0, "recv": 0}

        def counting(kind):
            original = getattr(ms.communicator, f"add_{kind}")

            def add(*args, **kwargs):
                transfers[kind] += 1
                return original(*args, **kwargs)

            setattr(ms.communicator, f"add_{kind}", add)

        counting("send")
        counting("recv")
        p = model.num_local_physical_experts
        layer_states = [model.layers[layer].eplb_state for layer in range(NUM_MOE_LAYERS)]
        table_ptrs = [ls.replica_lookup.table.data_ptr() for ls in layer_states]

        def check_lookups_and_weights(where: str) -> list[str]:
            errors = []
            for layer, ls in enumerate(layer_states):
                expected = build_replica_table(
                    ms.logical_to_physical_map[layer], ms.logical_replica_count[layer], 0, DEFAULT_ROWS
                )
                if not torch.equal(ls.replica_lookup.table, expected):
                    errors.append(f"{where}: layer {layer} lookup differs from the committed maps")
                if ls.replica_lookup.table.data_ptr() != table_ptrs[layer]:
                    errors.append(f"{where}: layer {layer} table moved")
                committed = ms.physical_to_logical_map[layer, rank * p : (rank + 1) * p].tolist()
                want = [[tag(layer, e), tag(layer, e)] for e in committed]
                # Every rank's lookup checksum is what every other rank derives from its committed maps.
                expected_sums = [int(table_checksum(expected))] * n
                gathered: list[Any] = [None] * n
                torch.distributed.all_gather_object(
                    gathered, ls.replica_lookup.checksum(), group=get_ep_group().cpu_group
                )
                if gathered != expected_sums:
                    errors.append(
                        f"{where}: layer {layer} checksums of the ranks {gathered} != {expected_sums}"
                    )
                if model.layers[layer].experts.local_tags() != want:
                    errors.append(
                        f"{where}: layer {layer} weights {model.layers[layer].experts.local_tags()} != {want}"
                    )
            return errors

        trace = _trace(40)
        errors: list[str] = []
        steps: list[dict[str, Any]] = []
        expected_local = torch.zeros(NUM_MOE_LAYERS, NUM_LOGICAL, dtype=torch.int64)

        # Profile forward and step (profile_run), then a warm-up forward under suppress (skip_eplb).
        ctrl.step(is_dummy=True, is_profile=True)
        with ctrl.suppress():
            ctrl.set_batch_phase(False)
            # Each rank routes rows of its own (vLLM Ascend's MC2 dispatch): the 'split' row layout.
            ctrl.prepare_forward(mc, TOKENS, moe_rows="split")
            report["flag_under_suppress"] = bool(state.should_record_tensor)
            model.route([trace[layer][0][:TOKENS] for layer in range(NUM_MOE_LAYERS)])
        report["load_after_warmup"] = int(ms.expert_load_pass.sum())
        report["flag_after_suppress"] = bool(state.should_record_tensor)
        report["rearrangements_after_profile"] = state.num_rearrangements
        errors += check_lookups_and_weights("after profile and warm-up")

        def run_step(step: int, has_prefill: bool, num_tokens: int, mode: str = "skewed") -> None:
            if state.is_async and ms.rebalanced:
                deadline = time.monotonic() + DEADLINE_S
                while ms.pending_result is None:
                    assert state.async_worker is not None
                    assert state.async_worker.is_alive(), "async worker died"
                    assert time.monotonic() < deadline, f"no layer transferred within {DEADLINE_S} s"
                    time.sleep(0.001)
            counter_before = state.expert_rearrangement_step
            ctrl.set_batch_phase(has_prefill)
            ctrl.prepare_forward(mc, num_tokens, moe_rows="split")
            recorded = bool(state.should_record_tensor)
            seq = (step * n + rank) % 40
            mismatched = 0
            for layer in range(NUM_MOE_LAYERS):
                real = trace[layer][seq][:TOKENS][:num_tokens]
                if mode in ("split", "hot"):
                    real = _split_ids(rank if mode == "split" else 0, n, num_tokens)
                ids = torch.cat([real, trace[layer][(seq + 1) % 40][:PADDING]])
                _, phys = model.layers[layer].route(ids)  # upstream's router, dataplane's bound op
                # Routing only ever uses the committed placement: every physical id holds the expert.
                mismatched += int((ms.physical_to_logical_map[layer][phys.long()] != ids).sum())
                if recorded:
                    expected_local[layer] += torch.bincount(real.flatten(), minlength=NUM_LOGICAL)
            ctrl.step()
            steps.append(
                {
                    "step": step,
                    "counter_before": counter_before,
                    "counter_after": state.expert_rearrangement_step,
                    "window_step": state.expert_load_window_step,
                    "has_prefill": has_prefill,
                    "recorded": recorded,
                    "routing_mismatches": mismatched,
                    "rebalanced": ms.rebalanced,
                    "checksums": [ls.replica_lookup.checksum() for ls in layer_states],
                }
            )
            errors.extend(check_lookups_and_weights(f"step {step}"))

        def run_until_rearranged(first_step: int, mode: str) -> int:
            """Step until the window closes, then (async) until every layer committed."""
            step = first_step
            started = state.num_rearrangements + state.num_skipped_rearrangements
            while state.num_rearrangements + state.num_skipped_rearrangements == started:
                assert step - first_step <= INTERVAL, "the window never closed"
                if mode == "zero":
                    has_prefill = phase == "decode"  # the filtered phase for every rank
                    run_step(step, has_prefill, 0 if phase == "all" else TOKENS)
                else:
                    run_step(step, (rank + step) % 2 == 0, TOKENS, mode)
                step += 1
            while ms.rebalanced:
                assert step - first_step <= INTERVAL + NUM_MOE_LAYERS + 1, "the cycle never finished"
                run_step(step, (rank + step) % 2 == 0, TOKENS)
                step += 1
            return step

        cycles = []
        step = 0
        for mode in windows:
            expected_local.zero_()
            transfers.update(send=0, recv=0)
            decided = len(decisions)
            old_map = ms.physical_to_logical_map.clone()
            step = run_until_rearranged(step, mode)
            expected_global = expected_local.to(torch.int32)
            torch.distributed.all_reduce(expected_global, group=get_ep_group().cpu_group)
            # The selected policy alone, on the window's global load, from the placement in force.
            policy_map = POLICIES[state.policy_settings.policy].rebalance_experts(
                expected_global, model.num_physical_experts, 1, 1, n, old_map
            )
            local_window_sum = ms.expert_load_window.sum(dim=0)  # (L, P)
            cycles.append(
                {
                    "zero_window": mode == "zero",
                    "mode": mode,
                    "expected_local": expected_local.tolist(),
                    "expected_global": expected_global.tolist(),
                    "last_expert_load": ms.last_expert_load.tolist(),
                    "old_map": old_map.tolist(),
                    "committed_map": ms.physical_to_logical_map.tolist(),
                    "policy_map": policy_map.tolist(),
                    "local_window_total": int(local_window_sum.sum()),
                    "num_rearrangements": state.num_rearrangements,
                    "num_skipped": state.num_skipped_rearrangements,
                    "skipped_by_reason": dict(state.skipped_rearrangements),
                    "decisions": decisions[decided:],
                    "transfers": dict(transfers),
                    "end_step": step,
                }
            )

        # Elastic EP's remapping (serving refuses elastic EP; control still keeps the lookups right):
        # upstream's update_mapping with the committed map rolled by one rank's slots, after which every
        # layer's lookup, refreshed in place, is the one rebuilt from the new maps.
        commit_log = list(state.commit_log)
        tables_before = [ls.replica_lookup.table.clone() for ls in layer_states]
        remapped = torch.roll(ms.physical_to_logical_map, shifts=p, dims=1)
        state.update_mapping(mc, remapped)
        report["update_mapping"] = {
            "map_is_remapped": torch.equal(ms.physical_to_logical_map, remapped),
            "lookups_rebuilt": [
                torch.equal(
                    ls.replica_lookup.table,
                    build_replica_table(
                        ms.logical_to_physical_map[layer], ms.logical_replica_count[layer], 0, DEFAULT_ROWS
                    ),
                )
                for layer, ls in enumerate(layer_states)
            ],
            "lookups_changed": [
                not torch.equal(ls.replica_lookup.table, tables_before[layer])
                for layer, ls in enumerate(layer_states)
            ],
            "tables_in_place": [
                ls.replica_lookup.table.data_ptr() == table_ptrs[layer]
                for layer, ls in enumerate(layer_states)
            ],
            "events": [(e.kind, e.layer, e.rearrangement) for e in list(state.commit_log)[len(commit_log) :]],
        }

        report["cycles"] = cycles
        report["steps"] = steps
        report["errors"] = errors
        report["collectives"] = collectives
        report["commit_log"] = [
            (e.kind, e.model_name, e.layer, e.rearrangement, dict(e.evidence)) for e in commit_log
        ]
        report["table_ptrs"] = table_ptrs
        report["local_slots"] = list(range(rank * p, (rank + 1) * p))
        report["worker_alive"] = state.async_worker.is_alive() if state.async_worker is not None else None
    return report


#: The two-model world: windows of 8 passes every 6 steps (each window overlaps the last by 2 passes;
#: a cycle of both models takes fewer steps than the interval).
TWO_WINDOW = 8
TWO_INTERVAL = 6
#: Its regular rearrangements, and the one whose target cycle is stopped before the target's first
#: layer moves.
TWO_REARRANGEMENTS = 4
STOPPED = 2


def two_model_world(ctx: RankContext) -> dict[str, Any]:
    """Two models of one state (the target, 2 MoE layers, and a 1-layer draft, as an MTP draft
    registers beside its target), the migration-aware policy on each model's load estimate
    (``load_estimate="pooled"``), asynchronous, on the real ESFT routing (the draft routes MoE layer 2's
    trace). In rearrangement :data:`STOPPED` the target's cycle is stopped on every rank before its first
    layer moves (upstream's coordinated stop: its ``rebalanced`` flag down when the worker checks it),
    and the draft's goes on. Reports every policy call's decision (recomputed by ``gate.decide`` from the
    call's arguments), every published ``DecisionEvent``, every model's evidence handed to its estimate
    beside the selections the ranks routed since the last rearrangement, and each estimate's end value.
    """
    import threading

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_ep_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from ascend_eplb.control import (
        AscendEPLBController,
        DecisionEvent,
        PatchSet,
        PolicySettings,
        commit_hooks,
        host_adaptation,
    )
    from ascend_eplb.control.gate import decide
    from ascend_eplb.testing.tagged import TaggedExperts
    from ascend_eplb.world.esft import esft_sequences
    from ascend_eplb.world.toy_moe import ToyModelConfig, ToyMoEModel, initial_local_experts

    assert PatchSet([*host_adaptation.PATCHES, *commit_hooks.PATCHES]).apply() is True
    vc = _config(ctx.world_size, True, TWO_WINDOW, TWO_INTERVAL)
    rank, n = ctx.rank, ctx.world_size
    report: dict[str, Any] = {"rank": rank}
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=n, rank=rank, distributed_init_method=ctx.init_method, local_rank=rank, backend="gloo"
        )
        initialize_model_parallel(tensor_model_parallel_size=n)
        cpu_group = get_ep_group().cpu_group
        local = initial_local_experts(rank, n, NUM_LOGICAL, NUM_REDUNDANT)
        trace_layers = {"target": (0, 1), "draft": (2,)}
        models, configs, traces = {}, {}, {}
        for name, layers in trace_layers.items():
            experts = [TaggedExperts(layer, local, tag) for layer in layers]
            models[name] = ToyMoEModel(experts, NUM_LOGICAL, NUM_REDUNDANT, n, TOP_K)
            configs[name] = ToyModelConfig(f"fake/{name}")
            traces[name] = [esft_sequences(layer, 40) for layer in layers]
        settings = PolicySettings(policy="migration_aware", load_estimate="pooled")
        ctrl = AscendEPLBController(vc.parallel_config, torch.device("cpu"), policy_settings=settings)
        ctrl.prepare_load()
        state = ctrl.state
        for name in models:
            assert ctrl.maybe_register_model(models[name], configs[name])
        keys = {name: configs[name].compute_hash() for name in models}
        model_states = {name: state.model_states[key] for name, key in keys.items()}
        published: list[tuple[Any, ...]] = []
        ctrl.bus.subscribe(
            DecisionEvent, lambda e: published.append((e.model_name, e.rearrangement, e.decision))
        )

        # Each model's evidence, as its estimate receives it.
        evidence: dict[str, list[list[list[int]]]] = {name: [] for name in models}
        for name, key in keys.items():
            estimate = state.channels[key].estimate
            update = estimate.update

            def recording(selections, _update=update, _name=name):
                evidence[_name].append(selections.tolist())
                _update(selections)

            estimate.update = recording

        # Every policy call, its decision recomputed from its arguments; the stopped one waits for the stop.
        calls: list[tuple[Any, ...]] = []
        stopped = threading.Event()
        gated = state.policy

        class Watching(gated):
            @classmethod
            def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old=None):
                if not cls.channels.gating:  # upstream's profile rearrangement
                    return super().rebalance_experts(
                        weight, num_replicas, num_groups, num_nodes, num_ranks, old
                    )
                name = "target" if weight.shape[0] == len(trace_layers["target"]) else "draft"
                estimate = state.channels[keys[name]].estimate.load
                _, decision = decide(
                    settings, weight, num_replicas, num_groups, num_nodes, num_ranks, old, estimate=estimate
                )
                calls.append((state.num_rearrangements, name, decision))
                placement = super().rebalance_experts(
                    weight, num_replicas, num_groups, num_nodes, num_ranks, old
                )
                if name == "target" and state.num_rearrangements == STOPPED:
                    assert stopped.wait(DEADLINE_S), "the main thread never stopped the target's cycle"
                return placement

        # What the state selects for every rearrangement (a model without load keeps its placement around it).
        state.policy = state._selected_policy = Watching
        ctrl.maybe_start_async_loop(True)
        ctrl.step(is_dummy=True, is_profile=True)

        routed = {
            name: torch.zeros(len(layers), NUM_LOGICAL, dtype=torch.int64)
            for name, layers in trace_layers.items()
        }
        expected: dict[str, list[list[list[int]]]] = {name: [] for name in models}
        maps: list[dict[str, list[list[int]]]] = []
        step = 0
        windows: dict[str, list[list[list[int]]]] = {name: [] for name in models}
        while state.num_rearrangements < TWO_REARRANGEMENTS or any(
            ms.rebalanced for ms in model_states.values()
        ):
            assert step < 200, (
                f"the rearrangements never finished: {state.num_rearrangements} started, "
                f"{state.num_skipped_rearrangements} skipped, in flight "
                f"{[(ms.rebalanced, ms.pending_result is not None) for ms in model_states.values()]}, "
                f"step counter {state.expert_rearrangement_step}, calls {[c[:2] for c in calls]}"
            )
            # The worker serves the models in order: wait for the first one in flight to hand a layer over.
            deadline = time.monotonic() + DEADLINE_S
            for ms in model_states.values():
                if ms.rebalanced:
                    while ms.rebalanced and ms.pending_result is None:
                        assert state.async_worker.is_alive(), "async worker died"
                        assert time.monotonic() < deadline, f"no layer transferred within {DEADLINE_S} s"
                        time.sleep(0.001)
                    break
            ctrl.set_batch_phase(step % 2 == 0)
            for name in models:
                ctrl.prepare_forward(configs[name], TOKENS, moe_rows="split")
            recorded = bool(state.should_record_tensor)
            seq = (step * n + rank) % 40
            for name, model in models.items():
                for i, trace in enumerate(traces[name]):
                    ids = trace[seq][:TOKENS]
                    model.layers[i].route(torch.cat([ids, trace[(seq + 1) % 40][:PADDING]]))
                    if recorded:
                        routed[name][i] += torch.bincount(ids.flatten(), minlength=NUM_LOGICAL)
            before = state.num_rearrangements
            ctrl.step()
            if state.num_rearrangements > before:
                for name in models:
                    total = routed[name].clone()
                    torch.distributed.all_reduce(total, group=cpu_group)
                    expected[name].append(total.tolist())
                    routed[name].zero_()
                maps.append({name: ms.physical_to_logical_map.tolist() for name, ms in model_states.items()})
                for name, ms in model_states.items():
                    windows[name].append(ms.last_expert_load.tolist())  # upstream's window, all-reduced
                if state.num_rearrangements == STOPPED:
                    # Every rank, the same step: the target's cycle stops before its first layer moves.
                    model_states["target"].rebalanced = False
                    stopped.set()
            step += 1
        report["calls"] = calls
        report["published"] = published
        report["evidence"] = evidence
        report["expected"] = expected
        report["maps_at_start"] = maps
        report["maps_at_end"] = {
            name: ms.physical_to_logical_map.tolist() for name, ms in model_states.items()
        }
        report["estimates"] = {
            name: (state.channels[key].estimate.windows, state.channels[key].estimate.load.tolist())
            for name, key in keys.items()
        }
        report["windows"] = windows
        report["worker_alive"] = state.async_worker.is_alive()
        report["model_names"] = {name: ms.model_name for name, ms in model_states.items()}
    return report
