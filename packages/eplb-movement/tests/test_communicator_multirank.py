"""AscendGlooEplbCommunicator driven by upstream's own transaction, on real Gloo ranks on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ascend_eplb.testing import RankFailureError, load_module, run_ranks

ranks = load_module(Path(__file__).with_name("ranks.py"))
PRELOAD = ("ascend_eplb.movement", "vllm.distributed.eplb.rebalance_execute")

pytestmark = pytest.mark.multirank


def test_upstream_transaction_two_ranks(tmp_path):
    results = run_ranks(
        ranks.upstream_transaction_2r, world_size=2, tmp_path=tmp_path, timeout_s=120, preload=PRELOAD
    )
    per_expert = results[0]["bytes_per_expert"]
    for rank, out in enumerate(results):
        # Add-time validation: ValueError naming the group's range, nothing queued.
        errors = out["errors"]
        assert "dst_rank=2 is outside the EPLB group's ranks [0, 2)" in errors["send_out_of_range"]
        assert "global ranks [0, 1]" in errors["send_out_of_range"]
        assert "src_rank=-1 is outside the EPLB group's ranks [0, 2)" in errors["recv_negative"]
        assert f"src_rank={rank}" not in errors["send_self"]
        assert "is this rank itself" in errors["send_self"]
        assert out["queued_after_errors"] == 0
        assert out["global_ranks"] == [0, 1]
        assert out["needs_profile_buffer_reservation"] is False

        # Every row of every dtype holds exactly its new expert; unchanged rows are untouched.
        for layers in out["rearrangements"]:
            for layer in layers:
                assert layer["bad"] == []
        # Staging: allocated by the first layer of the first rearrangement, never again.
        allocations = [layer["pool_allocations"] for layers in out["rearrangements"] for layer in layers]
        sizes = [layer["pool_bytes"] for layers in out["rearrangements"] for layer in layers]
        assert allocations[0] > 0
        assert allocations == [allocations[0]] * len(allocations)
        assert sizes == [sizes[0]] * len(sizes)

    # Layer 0 of placements[0] -> placements[1]: upstream's transaction, exact per-rank counts.
    # rank 0 needs experts 4, 5 (5 in two rows: received once) and sends 2; rank 1 needs 2 (twice:
    # received once) and sends 4 and 5. 7 tensors per expert.
    s0, s1 = results[0]["first_layer_stats"], results[1]["first_layer_stats"]
    assert (s0["num_recv_experts"], s0["num_send_experts"]) == (2, 1)
    assert (s1["num_recv_experts"], s1["num_send_experts"]) == (1, 2)
    assert (s0["num_recv_tensors"], s0["num_send_tensors"]) == (14, 7)
    assert (s0["bytes_received"], s0["bytes_sent"]) == (2 * per_expert, per_expert)
    assert (s1["bytes_received"], s1["bytes_sent"]) == (per_expert, 2 * per_expert)
    assert s0["staging_bytes"] == 3 * per_expert
    assert s0["num_executes"] == 1
    assert s0["num_failed"] == 0
    # The default host path moves the same rows; it stages only the strided per-expert list
    # (2 x 24 bytes on rank 0: one send source, ... and its received experts' list tensors).
    list_bytes = 2 * 3 * 4
    for out in results:
        for layers in out["direct"]:
            for layer in layers:
                assert layer["bad"] == []
    d0, d1 = results[0]["direct_first_layer_stats"], results[1]["direct_first_layer_stats"]
    assert (d0["bytes_received"], d0["bytes_sent"]) == (2 * per_expert, per_expert)
    assert (d1["bytes_received"], d1["bytes_sent"]) == (per_expert, 2 * per_expert)
    assert d0["staging_bytes"] == 3 * list_bytes
    assert d1["staging_bytes"] == 3 * list_bytes
    # upstream's metadata agrees: one primary receive per distinct remote expert.
    assert results[0]["rearrangements"][0][0]["recv_experts"] == 2
    assert results[1]["rearrangements"][0][0]["recv_experts"] == 1
    assert results[0]["cumulative"]["num_failed"] == 0
    assert results[0]["cumulative"]["num_executes"] == results[1]["cumulative"]["num_executes"]


def test_subgroup_failure_and_clean_restart_four_ranks(tmp_path):
    results = run_ranks(
        ranks.subgroup_and_failures_4r, world_size=4, tmp_path=tmp_path, timeout_s=120, preload=PRELOAD
    )
    for rank, out in enumerate(results):
        # EPLB groups {0,1} and {2,3}: each pair's transfer lands in its own processes.
        assert out["pair_bad"] == []
        assert out["pair_global_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert out["pair_recv_experts"] == 1
        expected_globals = "[0, 1]" if rank < 2 else "[2, 3]"
        assert "src_rank=2 is outside the EPLB group's ranks [0, 2)" in out["pair_range_error"]
        assert f"global ranks {expected_globals}" in out["pair_range_error"]

    # A layer too big for every rank's staging bound: every rank fails before posting, naming it.
    for rank, out in enumerate(results):
        too_big = out["too_big"]
        assert too_big["phase"] == "staging"
        assert too_big["cause"] == "StagingPoolError"
        assert "max_bytes=4096" in too_big["error"]
        assert too_big["expert_ids"] == sorted({10 + rank, 10 + (rank - 1) % 4})
        assert too_big["unanswered"] == []
        assert too_big["failed_peers"] == sorted({(rank + 1) % 4, (rank - 1) % 4})  # each announced it
        assert too_big["queued_after"] == 0
        assert too_big["last_failed"] == 1

    # The next execute starts clean: exact data on every rank, a clean last_stats.
    for rank, out in enumerate(results):
        clean = out["clean"]
        assert clean["error"] is None
        assert clean["recv"] == [200 + (rank - 1) % 4] * 256
        assert (clean["last_failed"], clean["cumulative_failed"]) == (0, 1)
        assert clean["pool_bytes"] == 2 * 256 * 4

    # Rank 3 alone fails before the handshake and says so: rank 0 raises at once naming it, without
    # writing its receive from rank 2; ranks 1 and 2 complete.
    f0, f3 = results[0]["failed_peer"], results[3]["failed_peer"]
    assert (f3["phase"], f3["cause"], f3["failed_peers"]) == ("staging", "StagingPoolError", [])
    assert "nothing was sent or received and no destination row was written" in f3["error"]
    assert f0["phase"] == "handshake"
    assert f0["failed_peers"] == [3]
    assert f0["unanswered"] == []
    assert "global rank(s) [3] failed before the handshake and sent nothing" in f0["error"]
    assert "no payload moved with global rank(s) [3] and no destination row" in f0["error"]
    assert f0["recv"] == [0] * 256  # the agreed receive from rank 2 went to scratch
    assert f0["elapsed_s"] < 1.9  # announced, not waited out
    assert f0["pool_bytes"] == 3 * 256 * 4  # every posted request completed: buffers kept
    assert results[1]["failed_peer"]["error"] is None
    assert results[1]["failed_peer"]["recv"] == [300] * 256
    assert results[2]["failed_peer"]["error"] is None
    assert results[2]["failed_peer"]["recv"] == [301] * 256

    # Rank 3 queued nothing for rank 0, which expects expert 99 from it: rank 0 names it after the
    # 2 s timeout of the handshake; ranks 1 and 2, exchanging between themselves, complete.
    s0 = results[0]["silent_peer"]
    assert s0["phase"] == "handshake"
    assert s0["unanswered"] == [3]
    assert "global rank(s) [3] did not answer within 2 s" in s0["error"]
    assert (s0["expert_ids"], s0["peers"]) == ([99], [3])
    assert s0["recv"] == [0] * 256
    assert 1.9 < s0["elapsed_s"] < 15
    assert results[3]["silent_peer"]["error"] is None
    assert results[1]["silent_peer"]["recv"] == [402] * 256
    assert results[2]["silent_peer"]["recv"] == [401] * 256

    # Gloo closed rank 0's connections at its timeout: every rank talking to rank 0 fails at once.
    after = [out["after_timeout"] for out in results]
    assert after[0]["unanswered"] == [1, 3]
    assert "closed by a timeout" in after[0]["error"]
    assert after[1]["unanswered"] == [0]
    assert after[3]["unanswered"] == [0]
    assert after[2]["error"] is None
    assert after[2]["recv"] == [501] * 256
    for res in after:
        assert res["elapsed_s"] < 2.0
        assert res["queued_after"] == 0


def test_peer_dies_mid_transfer(tmp_path):
    with pytest.raises(RankFailureError) as info:
        run_ranks(
            ranks.peer_dies_3r, world_size=3, tmp_path=tmp_path, timeout_s=90, grace_s=60, preload=PRELOAD
        )
    reports = info.value.reports
    assert reports[2][0] == 17
    assert reports[0][0] == 0
    assert reports[1][0] == 0
    world_dir = next(tmp_path.glob("world-*"))
    for rank in (0, 1):
        survivor = json.loads((world_dir / f"survivor{rank}.json").read_text())
        assert survivor["unanswered"] == [2]
        assert survivor["peers"] == [r for r in range(3) if r != rank]
        assert "connection to global rank(s) 2 failed" in survivor["error"]
        assert survivor["elapsed_s"] < 30  # the connection loss is reported, not waited out
        assert survivor["queued_after"] == 0


# What rank 1 sends (expert 5, one float32[16]) against what rank 0 receives, per case: the same
# description on both ranks (ranks.MISMATCH_CASES, ranks._recv_tensors).
SENT = "global rank 1 sends expert 5 to global rank 0 as [float32[16]], but global rank 0 receives"
MISMATCH_TEXT = {
    "larger": f"{SENT} expert 5 from global rank 1 into [float32[32]] (transfer 0 between them: tensor 0: "
    "16 elements (64 bytes) sent, 32 elements (128 bytes) expected)",
    "smaller": f"{SENT} expert 5 from global rank 1 into [float32[8]] (transfer 0 between them: tensor 0: "
    "16 elements (64 bytes) sent, 8 elements (32 bytes) expected)",
    "dtype": f"{SENT} expert 5 from global rank 1 into [int32[16]] (transfer 0 between them: tensor 0: "
    "float32 sent, int32 expected)",
    "count": f"{SENT} expert 5 from global rank 1 into [float32[16], int8[4]] (transfer 0 between them: "
    "1 tensor(s) sent, 2 expected)",
    "expert": f"{SENT} expert 6 from global rank 1 into [float32[16]] (transfer 0 between them: expert ids "
    "differ)",
    "missing": "global rank 1 sends 2 expert(s) [5, 7] to global rank 0, but global rank 0 receives 1 "
    "expert(s) [5] from global rank 1",
}


def test_plan_mismatches_fail_on_both_ranks_two_ranks(tmp_path):
    results = run_ranks(
        ranks.plan_mismatches_2r, world_size=2, tmp_path=tmp_path, timeout_s=120, preload=PRELOAD
    )
    for rank, out in enumerate(results):
        peer = 1 - rank
        # Add-time type errors: TypeError naming the value and the rule, nothing queued.
        assert out["type_errors"] == {
            "bare_tensor": "add_send of expert 1: tensors must be a list of torch.Tensor (one per weight "
            "view), got a bare Tensor of shape (3, 2)",
            "non_tensor": "add_recv of expert 1: tensors[1] is a list, not a torch.Tensor",
            "float_peer": f"dst_rank={float(peer)} must be an int, got a float",
            "bool_peer": "src_rank=True must be an int, got a bool",
            "str_expert": "expert_id='1' must be an int, got a str",
            "dict_tensors": "add_send of expert 1: tensors must be a list of torch.Tensor (one per weight "
            "view), got a dict",
        }
        assert out["queued_after_type_errors"] == 0

        for path in ("direct", "staged"):
            for layer, case in enumerate(ranks.MISMATCH_CASES):
                res = out[path][case]
                # Rank 0 sends expert 2 to rank 1 in the same execute; rank 1 sends 5 (and 7 in "missing").
                sending = {0: [5, 7] if case == "missing" else [5]} if rank == 1 else {1: [2]}
                receiving = {0: [2]} if rank == 1 else {1: [6] if case == "expert" else [5]}
                assert res["error"] == (
                    f"EPLB expert transfer of layer {layer} (execute #{2 * layer + 1}, rank {rank}) failed "
                    f"in the handshake phase; sending experts to global ranks {sending}; receiving experts "
                    f"from global ranks {receiving}; the transfer plans disagree: {MISMATCH_TEXT[case]}; "
                    f"no payload moved with global rank(s) [{peer}] and no destination row of this execute "
                    "was written"
                ), (path, case, rank)
                assert res["phase"] == "handshake"
                assert res["mismatches"] == {str(peer): [MISMATCH_TEXT[case]]}
                assert res["peers"] == [peer]
                assert res["unanswered"] == []
                assert res["failed_peers"] == []
                assert res["recv_untouched"] is True  # bit-identical sentinel rows, on both ranks
                assert res["queued_after"] == 0
                assert res["last_failed"] == 1
                assert res["elapsed_s"] < 10  # decided in the handshake, not by a timeout
                # The same communicator and group move exact data at once afterwards.
                base = 100 * layer if rank == 0 else 1000 * layer
                assert res["next"] == [float(base + i) for i in range(16)], (path, case, rank)
                assert res["next_handshake_s"] > 0
            cumulative = out[f"{path}_cumulative"]
            n = len(ranks.MISMATCH_CASES)
            assert (cumulative["num_executes"], cumulative["num_failed"]) == (2 * n, n)
            assert cumulative["bytes_received"] == n * 64  # only the agreed executes count


def test_pairs_start_when_they_agree_and_a_later_mismatch_writes_no_row_three_ranks(tmp_path):
    results = run_ranks(ranks.overlap_3r, world_size=3, tmp_path=tmp_path, timeout_s=120, preload=PRELOAD)
    text = (
        "global rank 2 sends expert 60 to global rank 0 as [float32[64]], but global rank 0 receives expert "
        "60 from global rank 2 into [float32[128]] (transfer 0 between them: tensor 0: 64 elements (256 "
        "bytes) sent, 128 elements (512 bytes) expected)"
    )
    for path in ("staged", "direct"):
        r0, r1, r2 = (out[path] for out in results)
        # Rank 0's pair with rank 1 agreed and moved (on the staged path before rank 2 even started,
        # so before rank 0 knew of the mismatch: rank 1 waited for nothing else); the mismatch with
        # rank 2 then kept every destination row of rank 0 bit-identical, the rows from rank 1 too.
        assert r1["error"] is None, path
        assert r1["received_exact"] is True, path
        assert (r0["phase"], r2["phase"]) == ("handshake", "handshake"), path
        assert r0["mismatches"] == {"2": [text]}, path
        assert r2["mismatches"] == {"0": [text]}, path
        assert "no payload moved with global rank(s) [2] and no destination row" in r0["error"]
        assert r0["untouched"] is True, path
        assert r0["queued_after"] == 0
        # The same communicators then move exact rows between every pair, both ways.
        for rank, res in enumerate((r0, r1, r2)):
            assert res["ring_bad"] == [], (path, rank)
            stats = res["stats"]
            assert (stats["num_send_experts"], stats["num_recv_experts"], stats["num_failed"]) == (8, 8, 0)
            assert stats["bytes_received"] == 8 * (1024 * 4 + 24 * 4)
            # Phase times are parts of the execute's wall time.
            assert stats["handshake_s"] > 0
            assert 0 < res["total_s"] <= res["elapsed_s"]
            if path == "staged":
                assert stats["d2h_s"] > 0
                assert stats["h2d_s"] > 0
                assert stats["staging_bytes"] == 16 * (1024 * 4 + 24 * 4)
            else:  # only the strided views are staged
                assert stats["staging_bytes"] == 16 * 24 * 4
