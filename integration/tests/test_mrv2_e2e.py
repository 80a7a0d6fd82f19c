"""End to end on 2 ranks over Gloo on CPU: the plugin's patches, the MRv2 call order, upstream EPLB.

``ranks_mrv2.mrv2_world`` runs one Ascend MRv2 worker per rank: ``register()`` (``ASCEND_EPLB=1``)
patches vLLM 0.33.0, ``Mrv2EplbWiring`` makes the runner's calls, upstream's ``EPLBController`` /
``EplbState`` / async worker / default policy rearrange a toy MoE model whose layers route through
upstream's real ``CustomRoutingRouter`` on the real ESFT trace.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ascend_eplb.testing import load_module, run_ranks
from ascend_eplb.testing.oracles import check_commit_order

ranks = load_module(Path(__file__).with_name("ranks_mrv2.py"))

#: Imported once in the fork server, not once per rank.
PRELOAD = (
    "vllm.distributed.eplb.eplb_state",
    "vllm.v1.worker.gpu.eplb_utils",
    "ascend_eplb.world.toy_moe",
    "vllm.distributed.eplb.policy",
    "ascend_eplb.control",
    "ascend_eplb.movement",
    "ascend_eplb.integration.patches",
    "ascend_eplb.integration.runner",
)
LAYERS = range(ranks.NUM_MOE_LAYERS)


@pytest.mark.multirank
def test_mrv2_worker_on_two_ranks_rearranges_through_the_patched_upstream_stack(tmp_path):
    """One world (one test, so xdist cannot run it twice), every check below on its reports."""
    reports = run_ranks(ranks.mrv2_world, world_size=2, tmp_path=tmp_path, timeout_s=240, preload=PRELOAD)
    assert [r["rank"] for r in reports] == [0, 1]
    _patches_build_the_ascend_stack_and_adapt_every_router(reports)
    _mrv2_call_order_and_unpadded_token_counts(reports)
    _a_rearrangement_completes_on_the_recorded_decode_load(reports)
    _commit_log_is_move_commit_refresh_acknowledge_for_every_layer(reports)
    _the_per_instance_bindings_are_the_registrys(reports)


def _patches_build_the_ascend_stack_and_adapt_every_router(reports) -> None:
    for r in reports:
        assert r["registered"] is True
        assert r["communicator_setting"] == "torch_gloo"  # unset, resolved by the patched ParallelConfig
        assert r["controller"] == "AscendEPLBController"
        assert r["controller_is_ascend"] is True
        # Upstream's runner construction, patched by the plugin alone, builds the same controller.
        assert r["upstream_construction"] == "AscendEPLBController"
        assert r["upstream_construction_phase"] == "decode"
        assert r["upstream_controller_subclass"] is True
        assert r["registered_model"] is True
        assert r["state_class"] == "AscendEplbState"
        assert r["state_is_ascend"] is True
        assert r["communicator"] == "ascend_eplb.movement.communicator.AscendGlooEplbCommunicator"
        assert r["communicator_is_movement"] is True
        assert r["worker_started"] is True
        assert (
            r["adapted"]
            == [
                {
                    "bound": True,
                    "ascend_state": True,
                    "replaced_upstream": True,
                    "layer_sees_it": True,
                    "load_view_is_upstream_row": True,
                    "shares_record_flag": True,
                    "registered_by_state": True,
                }
            ]
            * ranks.NUM_MOE_LAYERS
        )


def _mrv2_call_order_and_unpadded_token_counts(reports) -> None:
    for r in reports:
        num_steps = len(r["steps"])
        assert (
            r["calls"]
            == [
                "create_eplb_controller",
                "prepare_load",
                "maybe_register_speculator",
                "maybe_register_model",
                "maybe_start_async_loop",
                "prepare_forward",  # profile _dummy_run
                "step",
                "prepare_forward",  # warm-up _dummy_run
                "step",
            ]
            + ["set_batch_phase", "prepare_forward", "step"] * num_steps
        )
        assert r["prepare_forward_tokens"] == [ranks.DUMMY_TOKENS] * 2 + [ranks.TOKENS] * num_steps
        # Every forward went through each layer's upstream router exactly once.
        assert r["forwards"] == 2 + num_steps
        assert r["routing_calls"] == [2 + num_steps] * ranks.NUM_MOE_LAYERS
        # Dummy runs record nothing; upstream starts at 3/4 of the interval, so the warm-up step reaches
        # it and control skips that rearrangement (no rank recorded load).
        assert r["load_after_profile"] == 0
        assert r["load_after_warmup"] == 0
        assert r["rearrangements_after_dummies"] == 0
        assert r["skipped_after_dummies"] == 1
        assert r["counter_after_dummies"] == 0


def _a_rearrangement_completes_on_the_recorded_decode_load(reports) -> None:
    first = reports[0]
    for r in reports:
        assert r["errors"] == [], r["errors"]
        assert r["routing_mismatches"] == 0
        assert r["num_rearrangements"] == 1
        assert r["num_skipped"] == 1
        assert r["rebalanced"] is False
        assert r["worker_alive"] is True
        # The serving verifier (ASCEND_EPLB_VERIFY=1) checked each layer's commit and saw every step (the
        # warm-up's dummy and the served steps; the profile run is not counted, as in the events file); its
        # collective ran only at the boundaries after a commit (upstream commits one layer per step).
        assert r["verifier"] == [
            "EplbVerifier",
            ranks.NUM_MOE_LAYERS,
            1 + len(r["steps"]),
            ranks.NUM_MOE_LAYERS,
        ]
        # Events file and metrics off: no recorder, no hook of theirs.
        assert r["step_hooks"] == ["WorkerWatchdog", "EplbVerifier"]
        # Only decode batches in upstream's recording window were recorded (phase "decode").
        recorded = [s for s in r["steps"] if s["recorded"]]
        assert len(recorded) == 1
        assert all(not s["has_prefill"] for s in recorded)
        assert [(s["counter_before"], s["counter_after"]) for s in r["steps"]] == [
            (s["counter_before"], s["counter_after"]) for s in first["steps"]
        ]
        assert r["committed_map"] == first["committed_map"]
    (window,) = first["windows"]
    assert sum(map(sum, window["expected_global"])) == 2 * ranks.TOKENS * ranks.TOP_K * ranks.NUM_MOE_LAYERS
    for r in reports:
        # Upstream's window holds exactly the unpadded real tokens the ranks routed in decode batches,
        (w,) = r["windows"]
        assert w["last_expert_load"] == window["expected_global"]
        assert w["expected_global"] == window["expected_global"]
    # and the committed placement is upstream's default policy on that load.
    assert first["committed_map"] == window["policy_map"]
    assert first["committed_map"] != first["initial_map"]


def _commit_log_is_move_commit_refresh_acknowledge_for_every_layer(reports) -> None:
    for r in reports:
        log = r["commit_log"]
        assert {e[3] for e in log} == {1}
        assert {e[1] for e in log} == {"toy/mrv2-moe"}
        committed = check_commit_order(
            log,
            LAYERS,
            local_slots=r["local_slots"],
            maps_before=r["initial_map"],
            table_ptrs=r["table_ptrs"],
        )
        for layer in LAYERS:
            assert committed[layer] == r["committed_map"][layer]


def _the_per_instance_bindings_are_the_registrys(reports) -> None:
    """What the serving process really replaced per instance (measured over every live object) is what
    the registry declares: the routers' mapping from the registration on, the acknowledging record of a
    committed async layer at its commit."""
    from ascend_eplb.integration.patches import INSTANCE_BINDINGS

    declared = {binding.name: binding for binding in INSTANCE_BINDINGS}
    router = "vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter._apply_eplb_mapping"
    for r in reports:
        assert r["instance_bindings_after_registration"] == [router]
        at_acknowledgement = r["instance_bindings_at_acknowledgement"]
        assert sorted(set(at_acknowledgement) | set(r["instance_bindings_after_registration"])) == sorted(
            declared
        )
        assert "vllm.distributed.eplb.eplb_utils.CpuGpuEvent.record" in at_acknowledgement
    assert declared[router].owner == "ascend_eplb.dataplane.router"
