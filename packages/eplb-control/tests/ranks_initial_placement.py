"""Rank functions of ``test_initial_placement.py`` (loaded by path in each rank process).

``install_world``: ``AscendEPLBController`` over vLLM 0.33.0's ``EPLBController`` / ``EplbState`` / async
worker / default policy / Gloo communicator, the toy MoE model with tagged weights; the start-up install
of a placement (``control.initial_placement``), its refusals, then one asynchronous rearrangement on the
real ESFT routing trace. Returns what each rank observed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ascend_eplb.testing import RankContext
from ascend_eplb.testing.oracles import tag

NUM_MOE_LAYERS = 2
NUM_LOGICAL = 64
NUM_REDUNDANT = 4
TOP_K = 6
TOKENS = 24
WINDOW = 2
INTERVAL = 4
DEADLINE_S = 30.0


def _trace(num_sequences: int) -> list[list[torch.Tensor]]:
    from ascend_eplb.world.esft import esft_sequences

    return [esft_sequences(layer, num_sequences) for layer in range(NUM_MOE_LAYERS)]


def placement_for(load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """int64 ``(L, P)``: upstream's default policy on ``load`` (``(L, E)``) from upstream's initial
    placement, the placement the test installs (every rank computes the same)."""
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    row = EplbState.build_initial_global_physical_to_logical_map(NUM_LOGICAL, NUM_REDUNDANT)
    initial = torch.tensor([list(row)] * NUM_MOE_LAYERS)
    return DefaultEplbPolicy.rebalance_experts(load, NUM_LOGICAL + NUM_REDUNDANT, 1, 1, num_ranks, initial)


def install_world(ctx: RankContext) -> dict[str, Any]:
    from vllm.config import EPLBConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.eplb.eplb_state import compute_logical_maps
    from vllm.distributed.eplb.policy import DefaultEplbPolicy
    from vllm.distributed.parallel_state import (
        get_ep_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from ascend_eplb.control import AscendEPLBController, PatchSet, commit_hooks, host_adaptation
    from ascend_eplb.control.initial_placement import InitialPlacementEvent, install_initial_placement
    from ascend_eplb.dataplane import build_replica_table
    from ascend_eplb.testing.tagged import TaggedExperts
    from ascend_eplb.world.toy_moe import ToyModelConfig, ToyMoEModel, initial_local_experts

    assert PatchSet([*host_adaptation.PATCHES, *commit_hooks.PATCHES]).apply() is True
    rank, n = ctx.rank, ctx.world_size
    eplb = EPLBConfig(
        window_size=WINDOW, step_interval=INTERVAL, num_redundant_experts=NUM_REDUNDANT, use_async=True,
        communicator="torch_gloo",
    )  # fmt: skip
    vc = VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=n, enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb
        )
    )
    report: dict[str, Any] = {"rank": rank}
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=n, rank=rank, distributed_init_method=ctx.init_method, local_rank=rank, backend="gloo"
        )
        initialize_model_parallel(tensor_model_parallel_size=n)
        local = initial_local_experts(rank, n, NUM_LOGICAL, NUM_REDUNDANT)
        experts = [TaggedExperts(layer, local, tag) for layer in range(NUM_MOE_LAYERS)]
        model = ToyMoEModel(experts, NUM_LOGICAL, NUM_REDUNDANT, n, TOP_K)
        mc = ToyModelConfig("toy/initial-placement")
        ctrl = AscendEPLBController(vc.parallel_config, torch.device("cpu"))
        ctrl.prepare_load()
        state = ctrl.state
        events: list[InitialPlacementEvent] = []
        ctrl.bus.subscribe(InitialPlacementEvent, events.append)
        assert ctrl.maybe_register_model(model, mc)
        ms = state.model_states[mc.compute_hash()]
        initial = ms.physical_to_logical_map.clone()
        p = model.num_local_physical_experts
        trace = _trace(40)
        load = torch.stack(
            [torch.bincount(torch.cat(trace[layer]).flatten(), minlength=NUM_LOGICAL) for layer in range(2)]
        )
        new = placement_for(load, n)

        def observed() -> dict[str, Any]:
            mine = ms.physical_to_logical_map[:, rank * p : (rank + 1) * p]
            l2p, count = compute_logical_maps(ms.physical_to_logical_map.cpu(), NUM_LOGICAL)
            return {
                "map": ms.physical_to_logical_map.clone(),
                "tags_hold_the_map": [
                    model.layers[layer].experts.local_tags()
                    == [[tag(layer, e)] * 2 for e in mine[layer].tolist()]
                    for layer in range(NUM_MOE_LAYERS)
                ],
                "maps_derived": bool(
                    torch.equal(ms.logical_replica_count.cpu(), count)
                    and torch.equal(ms.logical_to_physical_map[:, :, : l2p.shape[-1]].cpu(), l2p)
                ),
                "lookups_equal": [
                    torch.equal(
                        model.layers[layer].eplb_state.replica_lookup.table,
                        build_replica_table(
                            ms.logical_to_physical_map[layer],
                            ms.logical_replica_count[layer],
                            0,
                            model.layers[layer].eplb_state.replica_lookup.rows,
                        ),
                    )
                    for layer in range(NUM_MOE_LAYERS)
                ],
                "commit_log": [(e.kind, e.layer, e.rearrangement) for e in state.commit_log],
            }

        # Refused before anything moves: another shape, an id out of range, a dropped expert.
        refusals = {}
        dropped = new.clone()
        dropped[1][dropped[1] == 5] = 6
        out_of_range = new.clone()
        out_of_range[0, 3] = NUM_LOGICAL
        # Rank 1 read another copy (experts 0 and 1 of layer 0 swapped); a float map would truncate.
        other_copy = new.clone()
        if ctx.rank == 1:
            other_copy[0] = torch.where(
                other_copy[0] == 0, 1, torch.where(other_copy[0] == 1, 0, other_copy[0])
            )
        cases = (
            ("shape", new[:1]), ("range", out_of_range), ("dropped", dropped), ("ranks_differ", other_copy),
            ("float", new.to(torch.float32) + 0.5),
        )  # fmt: skip
        for name, bad in cases:
            try:
                install_initial_placement(state, mc, bad)
            except ValueError as e:
                refusals[name] = str(e)
        report["refusals"] = refusals
        report["after_refusals"] = observed()
        report["initial"] = initial

        event = install_initial_placement(state, mc, new.tolist(), source="test")
        report["installed"] = observed()
        report["new"] = new
        report["event"] = {
            "published": [e is event for e in events],
            "source": event.source,
            "num_ranks": event.num_ranks,
            "previous_is_initial": torch.equal(event.previous, initial),
            "placement_is_installed": torch.equal(event.placement, new),
            "model_name": event.model_name,
        }
        report["event_moved"] = event.moved

        # The async worker runs from now on: a second install is refused, nothing changes.
        ctrl.maybe_start_async_loop(True)
        try:
            install_initial_placement(state, mc, initial)
        except RuntimeError as e:
            report["after_start"] = str(e)
        report["still_installed"] = torch.equal(ms.physical_to_logical_map, new)

        # One rearrangement on real routing: upstream's policy starts from the installed placement.
        expected = torch.zeros(NUM_MOE_LAYERS, NUM_LOGICAL, dtype=torch.int64)
        step = 0
        started = state.num_rearrangements
        while state.num_rearrangements == started or ms.rebalanced:
            assert step < 3 * INTERVAL, "no rearrangement completed"
            if ms.rebalanced:
                deadline = time.monotonic() + DEADLINE_S
                while ms.pending_result is None:
                    assert state.async_worker.is_alive(), "async worker died"
                    assert time.monotonic() < deadline, "no layer transferred"
                    time.sleep(0.001)
            ctrl.prepare_forward(mc, TOKENS, moe_rows="split")  # each rank routes and records its own rows
            recorded = bool(state.should_record_tensor)
            seq = (step * n + rank) % 40
            for layer in range(NUM_MOE_LAYERS):
                ids = trace[layer][seq][:TOKENS]
                model.layers[layer].route(ids)
                if recorded and state.num_rearrangements == started:
                    expected[layer] += torch.bincount(ids.flatten(), minlength=NUM_LOGICAL)
            ctrl.step()
            step += 1
        window = expected.clone()
        torch.distributed.all_reduce(window, group=get_ep_group().cpu_group)
        report["window_matches"] = torch.equal(ms.last_expert_load.cpu(), window)
        report["policy_from_installed"] = DefaultEplbPolicy.rebalance_experts(
            window, NUM_LOGICAL + NUM_REDUNDANT, 1, 1, n, new
        )
        report["policy_from_initial"] = DefaultEplbPolicy.rebalance_experts(
            window, NUM_LOGICAL + NUM_REDUNDANT, 1, 1, n, initial
        )
        report["after_rearrangement"] = observed()
        report["worker_alive"] = state.async_worker.is_alive()
    return report
