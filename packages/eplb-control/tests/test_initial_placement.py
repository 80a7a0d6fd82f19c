"""The start-up install of a placement (``control.initial_placement``) on real upstream EPLB, 2 ranks over
Gloo: through upstream's transaction and commit, refused before anything moves, and the first
rearrangement's policy starts from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ascend_eplb.control.measures import moved_experts
from ascend_eplb.testing import load_module, run_ranks

ranks = load_module(Path(__file__).with_name("ranks_initial_placement.py"))

PRELOAD = (
    "vllm.distributed.eplb.eplb_state",
    "vllm.v1.worker.gpu.eplb_utils",
    "ascend_eplb.control.controller",
    "ascend_eplb.world.toy_moe",
)
LAYERS = range(ranks.NUM_MOE_LAYERS)


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_install_moves_every_slot_commits_upstreams_maps_and_the_policy_starts_from_it(tmp_path):
    reports = run_ranks(ranks.install_world, world_size=2, tmp_path=tmp_path, timeout_s=200, preload=PRELOAD)
    new = reports[0]["new"]
    assert all(torch.equal(r["new"], new) for r in reports)
    assert not torch.equal(new, reports[0]["initial"])
    for r in reports:
        # Each bad map refused with the values and the rule, nothing moved or committed.
        assert r["refusals"] == {
            "shape": (
                "initial placement of shape (1, 68): must be upstream's physical_to_logical_map shape "
                "(2, 68) (MoE layers, physical experts)"
            ),
            "range": "initial placement layer 0 slot 3 holds 64: a logical expert id must be in [0, 64)",
            "dropped": (
                "initial placement layer 1 holds no slot of logical expert 5: every logical expert needs at "
                "least one"
            ),
            # decided alike on both ranks, though only rank 1's copy differs
            "ranks_differ": (
                "initial placement differs between EP ranks (EP ranks [0]: a (2, 68) map; EP ranks [1]: a "
                "(2, 68) map, the values differing where the shapes agree): every rank must install the same "
                "placement (the same file on every node)"
            ),
            "float": "initial placement has dtype torch.float32: every slot must hold an integer expert id",
        }
        before = r["after_refusals"]
        assert torch.equal(before["map"], r["initial"])
        assert before["tags_hold_the_map"] == [True, True]
        assert before["commit_log"] == []
        # Installed: upstream's maps, every local slot's weights, every lookup.
        installed = r["installed"]
        assert torch.equal(installed["map"], new)
        assert installed["tags_hold_the_map"] == [True, True]
        assert installed["maps_derived"] is True
        assert installed["lookups_equal"] == [True, True]
        assert installed["commit_log"] == [("move", 0, 0), ("move", 1, 0)] + [
            (kind, layer, 0) for layer in LAYERS for kind in ("commit", "refresh")
        ]
        assert r["event"] == {
            "published": [True],
            "source": "test",
            "num_ranks": 2,
            "previous_is_initial": True,
            "placement_is_installed": True,
            "model_name": "toy/initial-placement",
        }
        # What the install moved, per layer (the events file's initial_placement record sums it).
        assert torch.equal(r["event_moved"], moved_experts(r["initial"], new, 2))
        assert r["event_moved"].dtype == torch.int64
        assert r["event_moved"].shape == (len(LAYERS),)
        assert r["after_start"] == (
            "install_initial_placement: the async EPLB worker has started or a rearrangement is in flight; "
            "install the initial placement after registration and before maybe_start_async_loop"
        )
        assert r["still_installed"] is True
        # The first rearrangement: upstream's policy on the recorded window, from the installed placement.
        assert r["window_matches"] is True
        after = r["after_rearrangement"]
        assert torch.equal(after["map"], r["policy_from_installed"])
        assert after["tags_hold_the_map"] == [True, True]
        assert after["lookups_equal"] == [True, True]
        assert r["worker_alive"] is True
    # The check tells the two starts apart: from upstream's initial placement the policy gives another one.
    assert not torch.equal(reports[0]["policy_from_installed"], reports[0]["policy_from_initial"])
