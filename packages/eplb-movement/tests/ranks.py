"""Rank functions of the movement plane's multi-rank tests (loaded by path in every rank process).

Every expert row is tagged: its contents are a pure function of (layer, logical expert, weight index),
so after a transfer each row can be compared bit for bit with what the new placement says it holds.
"""

from __future__ import annotations

import itertools
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from ascend_eplb.testing import RankContext

# vLLM (and ascend_eplb.movement, which subclasses its communicator) are imported inside the rank
# functions: the fork server preloads them once, and the pytest process never pays for the import.

# --- tagged expert weights --------------------------------------------------------------------------
# One entry per weight view of a layer: (name, dtype, per-expert shape). "int4x8" is packed int4 seen
# as int32 (8 nibbles per element), the way W4A8 weights are viewed for movement.
WEIGHTS = (
    ("w_int8", torch.int8, (24,)),
    ("w_int4x8", torch.int32, (8,)),
    ("w_fp32", torch.float32, (16,)),
    ("w_bf16", torch.bfloat16, (10,)),
    ("w_uint8", torch.uint8, (7,)),
    ("w_int64", torch.int64, (3,)),
)
# A plain list of per-expert tensors (strided: transposed views of one (p, 3, 2) storage).
LIST_SHAPE = (2, 3)


def tag_row(layer: int, expert: int, weight: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The contents of logical expert ``expert``'s row of weight ``weight`` in layer ``layer``."""
    numel = int(np.prod(shape))
    seed = 1000 * layer + 37 * expert + 5 * weight
    ramp = torch.arange(numel, dtype=torch.int64)
    if dtype == torch.int32:  # packed int4: 4 bytes of two nibbles each
        nibbles = (seed + torch.arange(numel * 8)) % 16
        packed = (nibbles[0::2] | (nibbles[1::2] << 4)).to(torch.uint8)
        return packed.view(torch.int32).reshape(shape)
    if dtype == torch.int64:
        return ((seed << 40) + ramp).reshape(shape)
    if dtype == torch.bfloat16:  # small integers are exact in bf16
        return (((seed + ramp) % 256) - 128).to(torch.bfloat16).reshape(shape)
    if dtype == torch.float32:
        return (seed + ramp / 64).to(torch.float32).reshape(shape)
    if dtype == torch.int8:
        return (((seed + ramp) % 256) - 128).to(torch.int8).reshape(shape)
    return ((seed + ramp) % 256).to(dtype).reshape(shape)


def make_layer(layer: int, local_experts: list[int]) -> list:
    """Weight views of one layer on one rank: six ``(p, ...)`` tensors and a list of ``p`` tensors."""
    weights: list = []
    for w, (_, dtype, shape) in enumerate(WEIGHTS):
        weights.append(torch.stack([tag_row(layer, e, w, dtype, shape) for e in local_experts]))
    storage = torch.stack([tag_row(layer, e, len(WEIGHTS), torch.float32, LIST_SHAPE) for e in local_experts])
    storage = storage.transpose(1, 2).contiguous()  # (p, 3, 2)
    weights.append([storage[i].t() for i in range(len(local_experts))])  # strided (2, 3) views
    return weights


def empty_buffers(weights: list) -> list:
    """Upstream's ``expert_buffer`` (``torch.empty_like`` per view), filled with a sentinel."""
    out: list = []
    for w in weights:
        if isinstance(w, list):
            out.append([torch.full_like(x, -7) for x in w])
        else:
            out.append(torch.full_like(w, -7))
    return out


def check_layer(weights: list, layer: int, local_experts: list[int]) -> list[str]:
    """Rows that do not hold their expert's tag (bitwise), as readable strings."""
    bad = []
    for row, expert in enumerate(local_experts):
        for w, (name, dtype, shape) in enumerate(WEIGHTS):
            if not torch.equal(
                weights[w][row].view(torch.uint8), tag_row(layer, expert, w, dtype, shape).view(torch.uint8)
            ):
                bad.append(f"layer {layer} row {row} {name}: expected expert {expert}")
        expected = tag_row(layer, expert, len(WEIGHTS), torch.float32, LIST_SHAPE)
        if not torch.equal(weights[-1][row], expected):
            bad.append(f"layer {layer} row {row} list: expected expert {expert}")
    return bad


def bytes_per_expert() -> int:
    n = sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size() for _, d, s in WEIGHTS)
    return n + int(np.prod(LIST_SHAPE)) * 4


def _rearrange(
    comm, group, weights_by_layer, buffers, old, new, p, migration_batching_layers=()
) -> list[dict]:
    """Upstream's per-layer transaction for every layer: transfer_layer, then move_from_buffer."""
    from vllm.distributed.eplb.rebalance_execute import move_from_buffer, transfer_layer

    rank = group.rank()
    per_layer = []
    for layer, weights in enumerate(weights_by_layer):
        ptrs = [w.data_ptr() if not isinstance(w, list) else [x.data_ptr() for x in w] for w in weights]
        before = [w.clone() if not isinstance(w, list) else [x.clone() for x in w] for w in weights]
        for b in buffers:
            for x in b if isinstance(b, list) else [b]:
                x.fill_(-7)
        executes_before = comm.cumulative_stats.num_executes
        metadata = transfer_layer(
            old_layer_indices=torch.tensor(old),
            new_layer_indices=torch.tensor(new),
            expert_weights=weights,
            expert_weights_buffer=buffers,
            ep_group=group,
            communicator=comm,
            stream=None,
            layer_idx=layer,
            enable_migration_batching=layer in migration_batching_layers,
        )
        stats = comm.cumulative_stats.num_executes - executes_before, comm.last_stats
        move_from_buffer(weights, buffers, metadata, np.asarray(new), rank)
        local_new = new[rank * p : (rank + 1) * p]
        local_old = old[rank * p : (rank + 1) * p]
        bad = check_layer(weights, layer, local_new)
        # Rows whose expert did not change are bit-identical to before (and every view kept its storage).
        for row in range(p):
            if local_old[row] != local_new[row]:
                continue
            for w, weight in enumerate(weights):
                cur = weight[row]
                prev = before[w][row]
                if not torch.equal(cur.reshape(-1).view(torch.uint8), prev.reshape(-1).view(torch.uint8)):
                    bad.append(f"layer {layer} unchanged row {row} weight {w} was modified")
        new_ptrs = [w.data_ptr() if not isinstance(w, list) else [x.data_ptr() for x in w] for w in weights]
        if new_ptrs != ptrs:
            bad.append(f"layer {layer}: a weight view was replaced instead of written in place")
        per_layer.append(
            {
                "bad": bad,
                "executes": stats[0],
                "recv_experts": int(metadata.recv_count),
                "pool_allocations": comm.staging_pool.num_allocations,
                "pool_bytes": comm.staging_pool.size_bytes,
            }
        )
    return per_layer


# Placements (physical_to_logical_map of one layer): 2 ranks x 4 slots, 6 logical experts.
PLACEMENTS_2R = (
    [0, 1, 2, 3, 4, 5, 0, 1],
    # rank 0 needs 4 and 5 from rank 1, 5 twice (one receive, one local copy); rank 1 needs 2 twice.
    [4, 5, 5, 3, 0, 1, 2, 2],
    [4, 1, 5, 3, 0, 2, 2, 5],
    [4, 1, 5, 0, 3, 2, 2, 5],
)


def upstream_transaction_2r(ctx: RankContext) -> dict:
    """Three rearrangements of two layers through upstream's transaction, plus add-time validation."""
    from ascend_eplb.movement import AscendGlooEplbCommunicator, StagingPool

    ctx.init_gloo()
    group = dist.new_group([0, 1])
    p = 4
    # Host tensors staged like device tensors, so CPU runs the accelerator path's staging.
    comm = AscendGlooEplbCommunicator(
        group, staging_pool=StagingPool(1 << 20), timeout_s=60, stage_host_tensors=True
    )
    out: dict = {"rank": ctx.rank, "rearrangements": [], "errors": {}}

    # Add-time validation: nothing queued, the message names the group's range.
    row = [torch.zeros(3)]
    for name, call in (
        ("send_out_of_range", lambda: comm.add_send(row, 2, expert_id=4)),
        ("recv_negative", lambda: comm.add_recv(row, -1, expert_id=4)),
        ("send_self", lambda: comm.add_send(row, ctx.rank, expert_id=4)),
    ):
        try:
            call()
            out["errors"][name] = None
        except ValueError as exc:
            out["errors"][name] = str(exc)
    out["queued_after_errors"] = comm.num_queued

    weights_by_layer = [
        make_layer(layer, PLACEMENTS_2R[0][ctx.rank * p : (ctx.rank + 1) * p]) for layer in range(2)
    ]
    buffers = empty_buffers(weights_by_layer[0])
    for old, new in itertools.pairwise(PLACEMENTS_2R):
        # Layer 1 goes through upstream's migration batching (one execute per batch).
        layers = _rearrange(
            comm, group, weights_by_layer, buffers, old, new, p, migration_batching_layers=(1,)
        )
        out["rearrangements"].append(layers)
    # Stats of one layer of the first rearrangement, re-run on fresh weights for exact counts.
    weights = [make_layer(0, PLACEMENTS_2R[0][ctx.rank * p : (ctx.rank + 1) * p])]
    _rearrange(comm, group, weights, buffers, PLACEMENTS_2R[0], PLACEMENTS_2R[1], p)
    out["first_layer_stats"] = comm.last_stats.as_dict()
    # The default host path (Gloo reads/writes contiguous CPU rows directly; only the strided
    # per-expert list is staged): same three rearrangements, same exact rows.
    direct = AscendGlooEplbCommunicator(group, staging_pool=StagingPool(1 << 20), timeout_s=60)
    weights_by_layer = [
        make_layer(layer, PLACEMENTS_2R[0][ctx.rank * p : (ctx.rank + 1) * p]) for layer in range(2)
    ]
    out["direct"] = [
        _rearrange(direct, group, weights_by_layer, buffers, old, new, p, migration_batching_layers=(1,))
        for old, new in itertools.pairwise(PLACEMENTS_2R)
    ]
    weights = [make_layer(0, PLACEMENTS_2R[0][ctx.rank * p : (ctx.rank + 1) * p])]
    _rearrange(direct, group, weights, buffers, PLACEMENTS_2R[0], PLACEMENTS_2R[1], p)
    out["direct_first_layer_stats"] = direct.last_stats.as_dict()
    out["cumulative"] = comm.cumulative_stats.as_dict()
    out["bytes_per_expert"] = bytes_per_expert()
    out["global_ranks"] = list(comm.global_ranks)
    out["needs_profile_buffer_reservation"] = comm.needs_profile_buffer_reservation
    return out


def subgroup_and_failures_4r(ctx: RankContext) -> dict:
    """4 ranks: EPLB groups {0,1} and {2,3} in parallel; then failures over the world group."""
    from vllm.distributed.eplb.rebalance_execute import move_from_buffer, transfer_layer

    from ascend_eplb.movement import AscendGlooEplbCommunicator, EplbTransferError, StagingPool

    ctx.init_gloo()
    groups = {0: dist.new_group([0, 1]), 1: dist.new_group([2, 3])}
    coordination = dist.new_group([0, 1, 2, 3])  # the test's own barrier, untouched by the failures
    mine = groups[ctx.rank // 2]
    out: dict = {"rank": ctx.rank}

    # 1. Upstream transaction inside this pair's group; layer tag differs per group.
    p = 2
    old = [0, 1, 2, 0]
    new = [2, 2, 1, 0]  # group rank 0 gets expert 2 twice from group rank 1; group rank 1 gets 1
    layer = 10 + ctx.rank // 2
    comm = AscendGlooEplbCommunicator(mine, timeout_s=60)
    weights = make_layer(layer, old[mine.rank() * p : (mine.rank() + 1) * p])
    buffers = empty_buffers(weights)
    metadata = transfer_layer(
        torch.tensor(old), torch.tensor(new), weights, buffers, mine, comm, layer_idx=layer
    )
    move_from_buffer(weights, buffers, metadata, np.asarray(new), mine.rank())
    out["pair_bad"] = check_layer(weights, layer, new[mine.rank() * p : (mine.rank() + 1) * p])
    out["pair_global_ranks"] = list(comm.global_ranks)
    out["pair_recv_experts"] = comm.last_stats.num_recv_experts
    try:
        comm.add_recv([torch.zeros(1)], 2, expert_id=1)
        out["pair_range_error"] = None
    except ValueError as exc:
        out["pair_range_error"] = str(exc)

    # Over the world group, 4 ranks in a ring: rank r sends expert 10+r to r+1, receives from r-1.
    world = dist.group.WORLD
    pool = StagingPool(max_bytes=4096)
    wcomm = AscendGlooEplbCommunicator(world, staging_pool=pool, timeout_s=2.0, stage_host_tensors=True)

    def ring(round_: int, numel: int, ring_ranks: tuple[int, ...] = (0, 1, 2, 3)) -> torch.Tensor | None:
        if ctx.rank not in ring_ranks:
            return None
        pos = ring_ranks.index(ctx.rank)
        nxt, prv = ring_ranks[(pos + 1) % len(ring_ranks)], ring_ranks[pos - 1]
        recv = torch.zeros(numel, dtype=torch.int32)
        wcomm.add_send(
            [torch.full((numel,), 100 * round_ + ctx.rank, dtype=torch.int32)], nxt, expert_id=10 + ctx.rank
        )
        wcomm.add_recv([recv], prv, expert_id=10 + prv)
        return recv

    def attempt(recv: torch.Tensor | None) -> dict:
        start = time.monotonic()
        res: dict = {"error": None}
        try:
            wcomm.execute()
        except EplbTransferError as exc:
            res.update(
                error=str(exc),
                phase=exc.phase,
                unanswered=exc.unanswered_ranks,
                peers=exc.peers,
                expert_ids=exc.expert_ids,
                failed_peers=exc.failed_peers,
                cause=type(exc.__cause__).__name__,
            )
        res["recv"] = recv.tolist() if recv is not None else None
        res.update(
            elapsed_s=time.monotonic() - start,
            queued_after=wcomm.num_queued,
            last_failed=wcomm.last_stats.num_failed,
            cumulative_failed=wcomm.cumulative_stats.num_failed,
            pool_bytes=pool.size_bytes,
        )
        return res

    # 2. A layer too big for every rank's staging bound: all ranks fail before posting anything.
    out["too_big"] = attempt(ring(1, 2048))  # 2 x 8 KiB > 4 KiB
    # 3. The next execute starts clean and moves the exact data.
    out["clean"] = attempt(ring(2, 256))
    # 4. Rank 3 alone fails before the handshake (one more tensor than its bound allows) while rank 0
    #    expects data from it: rank 3 says so in its header, so rank 0 raises at once naming it, its
    #    other receive (from rank 2) left untouched; ranks 1 and 2 complete.
    recv = ring(3, 256, ring_ranks=(0, 1, 2))
    if ctx.rank == 0:
        wcomm.add_recv([torch.zeros(256, dtype=torch.int32)], 3, expert_id=99)
    if ctx.rank == 3:
        wcomm.add_send([torch.ones(2048, dtype=torch.int32)], 0, expert_id=99)
    out["failed_peer"] = attempt(recv)
    # 4b. Rank 0 expects expert 99 from rank 3, which queued nothing for it (its execute has nothing
    #    to do): rank 0 names rank 3 after the 2 s timeout; ranks 1 and 2, exchanging between
    #    themselves, complete.
    recv = ring(4, 256, ring_ranks=(1, 2))
    if ctx.rank == 0:
        recv = torch.zeros(256, dtype=torch.int32)
        wcomm.add_recv([recv], 3, expert_id=99)
    out["silent_peer"] = attempt(recv)
    dist.barrier(group=coordination)  # rank 3 must not go on before rank 0's handshake timed out
    # 5. Gloo closed rank 0's connections when its wait timed out: the next ring fails at once on
    #    every rank that talks to rank 0, naming it, instead of hanging.
    out["after_timeout"] = attempt(ring(5, 256))
    return out


def peer_dies_3r(ctx: RankContext) -> dict:
    """Rank 2 exits mid-transfer (after queueing, before execute); ranks 0 and 1 report it."""
    from ascend_eplb.movement import AscendGlooEplbCommunicator, EplbTransferError

    ctx.init_gloo()
    comm = AscendGlooEplbCommunicator(dist.group.WORLD, timeout_s=30.0)
    send = torch.full((1024,), ctx.rank, dtype=torch.float32)
    recvs = {peer: torch.zeros(1024) for peer in range(3) if peer != ctx.rank}
    for peer, buf in recvs.items():
        comm.add_send([send], peer, expert_id=ctx.rank)
        comm.add_recv([buf], peer, expert_id=peer)
    if ctx.rank == 2:
        time.sleep(0.5)
        os._exit(17)
    start = time.monotonic()
    result: dict = {"rank": ctx.rank}
    try:
        comm.execute()
        result["error"] = None
    except EplbTransferError as exc:
        result.update(error=str(exc), unanswered=exc.unanswered_ranks, peers=exc.peers, phase=exc.phase)
    result["elapsed_s"] = time.monotonic() - start
    result["queued_after"] = comm.num_queued
    (ctx.tmp_dir / f"survivor{ctx.rank}.json").write_text(json.dumps(result))
    return result


# Plan disagreements between 2 ranks: rank 1 sends expert 5 to rank 0 as one float32[16] tensor
# (plus, in "missing", expert 7 too); rank 0 receives it into what the case says. In the same
# execute rank 0 sends expert 2 to rank 1 (that direction agrees). Values: rank 0 -> rows of 2s.
MISMATCH_CASES = ("larger", "smaller", "dtype", "count", "expert", "missing")


def _recv_tensors(case: str) -> list[torch.Tensor]:
    """Rank 0's receive rows for expert 5 from rank 1 in ``case`` (sentinel-filled)."""
    shapes = {
        "larger": [(torch.float32, 32)],
        "smaller": [(torch.float32, 8)],
        "dtype": [(torch.int32, 16)],
        "count": [(torch.float32, 16), (torch.int8, 4)],
    }.get(case, [(torch.float32, 16)])
    return [torch.full((n,), -7, dtype=d) for d, n in shapes]


def plan_mismatches_2r(ctx: RankContext) -> dict:
    """Every kind of plan disagreement, on the direct and the staged path, in one world; after each
    the same communicator moves exact data. Plus the add-time type errors."""
    from ascend_eplb.movement import AscendGlooEplbCommunicator, EplbTransferError, StagingPool

    ctx.init_gloo()
    group = dist.group.WORLD
    out: dict = {"rank": ctx.rank, "type_errors": {}}
    peer = 1 - ctx.rank

    comm = AscendGlooEplbCommunicator(group, timeout_s=30)
    for name, call in (
        ("bare_tensor", lambda: comm.add_send(torch.zeros(3, 2), peer, expert_id=1)),
        ("non_tensor", lambda: comm.add_recv([torch.zeros(2), [1.0, 2.0]], peer, expert_id=1)),
        ("float_peer", lambda: comm.add_send([torch.zeros(2)], float(peer), expert_id=1)),
        ("bool_peer", lambda: comm.add_recv([torch.zeros(2)], True, expert_id=1)),
        ("str_expert", lambda: comm.add_recv([torch.zeros(2)], peer, expert_id="1")),
        ("dict_tensors", lambda: comm.add_send({"w": torch.zeros(2)}, peer, expert_id=1)),
    ):
        try:
            call()
            out["type_errors"][name] = None
        except TypeError as exc:
            out["type_errors"][name] = str(exc)
    out["queued_after_type_errors"] = comm.num_queued

    staged = AscendGlooEplbCommunicator(
        group, staging_pool=StagingPool(1 << 20), timeout_s=30, stage_host_tensors=True
    )
    for path, c in (("direct", comm), ("staged", staged)):
        results = out[path] = {}
        for layer, case in enumerate(MISMATCH_CASES):
            c.set_transfer_context(np.zeros(1, dtype=np.int64), layer)
            if ctx.rank == 1:
                send = [torch.full((16,), 5.0)]
                c.add_send(send, 0, expert_id=5)
                if case == "missing":
                    c.add_send([torch.full((16,), 7.0)], 0, expert_id=7)
                recv = [torch.full((16,), -7.0)]
                c.add_recv(recv, 0, expert_id=2)
            else:
                c.add_send([torch.full((16,), 2.0)], 1, expert_id=2)
                recv = _recv_tensors(case)
                c.add_recv(recv, 1, expert_id=6 if case == "expert" else 5)
            before = [t.clone() for t in recv]
            res: dict = {"error": None}
            start = time.monotonic()
            try:
                c.execute()
            except EplbTransferError as exc:
                res.update(
                    error=str(exc),
                    phase=exc.phase,
                    mismatches={str(k): v for k, v in exc.mismatches.items()},
                    peers=exc.peers,
                    expert_ids=exc.expert_ids,
                    unanswered=exc.unanswered_ranks,
                    failed_peers=exc.failed_peers,
                )
            res["elapsed_s"] = time.monotonic() - start
            res["recv_untouched"] = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(recv, before, strict=True)
            )
            res["queued_after"] = c.num_queued
            res["last_failed"] = c.last_stats.num_failed
            # The same communicator (and group) moves exact data next.
            got = torch.full((16,), -7.0)
            if ctx.rank == 1:
                c.add_send([torch.arange(16, dtype=torch.float32) + 100 * layer], 0, expert_id=5)
                c.add_recv([got], 0, expert_id=2)
            else:
                c.add_send([torch.arange(16, dtype=torch.float32) + 1000 * layer], 1, expert_id=2)
                c.add_recv([got], 1, expert_id=5)
            try:
                c.execute()
                res["next"] = got.tolist()
            except EplbTransferError as exc:
                res["next"] = str(exc)
            res["next_handshake_s"] = c.last_stats.handshake_s
            results[case] = res
        out[f"{path}_cumulative"] = c.cumulative_stats.as_dict()
    return out


def _expert_rows(rank: int, expert: int) -> list[torch.Tensor]:
    """One expert's tensors as ``rank`` sends them: a contiguous float32 row and a strided int32 view
    (so the default path receives one directly and stages the other)."""
    base = 1000 * rank + expert
    return [
        torch.arange(1024, dtype=torch.float32) + base,
        (torch.arange(24, dtype=torch.int32) + base).reshape(4, 6).t(),
    ]


def _sentinel_rows() -> list[torch.Tensor]:
    return [torch.full((1024,), -7.0), torch.full((4, 6), -7, dtype=torch.int32).t()]


def overlap_3r(ctx: RankContext) -> dict:
    """Pairs start their payload as soon as they agree: a mismatch found after an agreeing pair's
    payload arrived leaves every destination row untouched; then exact data over all three ranks."""
    from ascend_eplb.movement import AscendGlooEplbCommunicator, EplbTransferError, StagingPool

    ctx.init_gloo()
    world = dist.group.WORLD
    late = dist.new_group([1, 2])  # rank 2 starts only after rank 1's execute returned
    out: dict = {"rank": ctx.rank}
    comms = {
        "staged": AscendGlooEplbCommunicator(
            world, staging_pool=StagingPool(1 << 22), timeout_s=30, stage_host_tensors=True
        ),
        "direct": AscendGlooEplbCommunicator(world, staging_pool=StagingPool(1 << 22), timeout_s=30),
    }
    for path, comm in comms.items():
        res: dict = {"error": None}
        # Rank 1 sends experts 0..7 to rank 0 and receives expert 50 from it; rank 2 sends expert
        # 60 to rank 0 as float32[64] while rank 0 expects float32[128].
        recv: list[list[torch.Tensor]] = []
        if ctx.rank == 0:
            recv = [_sentinel_rows() for _ in range(8)]
            for e, rows in enumerate(recv):
                comm.add_recv(rows, 1, expert_id=e)
            comm.add_send(_expert_rows(0, 50), 1, expert_id=50)
            recv.append([torch.full((128,), -7.0)])
            comm.add_recv(recv[-1], 2, expert_id=60)
        elif ctx.rank == 1:
            for e in range(8):
                comm.add_send(_expert_rows(1, e), 0, expert_id=e)
            recv = [_sentinel_rows()]
            comm.add_recv(recv[0], 0, expert_id=50)
        else:
            comm.add_send([torch.full((64,), 60.0)], 0, expert_id=60)
            if path == "staged":
                # Rank 0 posts its receives from rank 1 into staging before it has rank 2's header.
                dist.barrier(group=late)
        before = [[t.clone() for t in rows] for rows in recv]
        try:
            comm.execute()
        except EplbTransferError as exc:
            res.update(
                error=str(exc), phase=exc.phase, mismatches={str(k): v for k, v in exc.mismatches.items()}
            )
        if ctx.rank == 1 and path == "staged":
            dist.barrier(group=late)
        res["untouched"] = all(
            torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
            for rows, rows_before in zip(recv, before, strict=True)
            for a, b in zip(rows, rows_before, strict=True)
        )
        res["received_exact"] = all(
            torch.equal(a, b) for rows in recv for a, b in zip(rows, _expert_rows(0, 50), strict=False)
        )
        res["queued_after"] = comm.num_queued
        # Then a ring with every pair in both directions, 4 experts each: exact rows on all ranks.
        received = {}
        for peer in range(3):
            if peer == ctx.rank:
                continue
            for e in range(4):
                comm.add_send(_expert_rows(ctx.rank, 10 * ctx.rank + e), peer, expert_id=10 * ctx.rank + e)
            received[peer] = [_sentinel_rows() for _ in range(4)]
            for e, rows in enumerate(received[peer]):
                comm.add_recv(rows, peer, expert_id=10 * peer + e)
        start = time.perf_counter()
        comm.execute()
        res["elapsed_s"] = time.perf_counter() - start
        res["ring_bad"] = [
            (peer, e)
            for peer, experts in received.items()
            for e, rows in enumerate(experts)
            if not all(
                torch.equal(a, b) for a, b in zip(rows, _expert_rows(peer, 10 * peer + e), strict=True)
            )
        ]
        res["stats"] = comm.last_stats.as_dict()
        res["total_s"] = comm.last_stats.total_s
        out[path] = res
    return out
