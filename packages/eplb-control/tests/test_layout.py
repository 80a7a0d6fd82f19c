"""Row layouts: exact values per rank, and agreement + count-once through the real dataplane op.

Each layout's dispatch is rebuilt from what vLLM 0.33.0 / vLLM Ascend do with the rows (TP peers hold
copies, a gathered batch concatenates equal padded slices, sequence parallel chunks a DP batch over
its TP ranks); every rank then maps and records with its own row layout through
``map_to_physical_and_record``, and the test checks the two invariants directly: every rank that
routes a row picks the same physical replica for it, and the load summed over ranks counts every real
token's selections exactly once (padding never).
"""

from types import SimpleNamespace

import pytest
import torch

from ascend_eplb.control.layout import (
    MOE_ROWS,
    RankCoordinates,
    RowLayout,
    default_moe_rows,
    row_layout,
    unplaceable_layout,
)
from ascend_eplb.dataplane import ReplicaLookup, build_replica_table, map_to_physical_and_record

E, P, K, PADDED = 6, 12, 2, 8
# Every logical expert has two replicas: slots e and e + 6 (on different ranks for any N in 2, 4).
L2P = torch.tensor([[e, e + E] for e in range(E)])
COUNT = torch.full((E,), 2)


def _ranks(dp: int, tp: int) -> list[RankCoordinates]:
    return [RankCoordinates(d * tp + t, dp * tp, t, tp, d, dp) for d in range(dp) for t in range(tp)]


def test_layout_values_of_each_rank():
    ranks = _ranks(2, 2)
    got = {rows: [row_layout(rows, r).values() for r in ranks] for rows in MOE_ROWS}
    assert got == {
        "replicated": [[0, 1, 0, 0], [0, 1, -1, 0], [1, 1, 0, 0], [1, 1, -1, 0]],
        "split": [[0, 1, 0, 0], [1, 1, 0, 0], [2, 1, 0, 0], [3, 1, 0, 0]],
        "gathered": [[0, 2, 0, 0], [0, 2, -1, 0], [0, 2, 1, 0], [0, 2, -1, 0]],
        "gathered-sp": [[0, 4, 0, 0], [0, 4, 1, 1], [0, 4, 2, 0], [0, 4, 3, 1]],
    }
    with pytest.raises(ValueError, match=r"moe rows 'alltoall' is not one of \['replicated'"):
        row_layout("alltoall", ranks[0])
    with pytest.raises(ValueError, match=r"ep_rank=1 must equal dp_rank \* tp_size \+ tp_rank = 1 \* 2 \+ 0"):
        RankCoordinates(1, 4, 0, 2, 1, 2)
    with pytest.raises(ValueError, match="ep_size=3 must equal dp_size"):
        RankCoordinates(0, 3, 0, 2, 0, 2)


def _dispatch(rows: str, dp: int, tp: int, batches: list[torch.Tensor]):
    """What each EP rank routes and which of those rows are real, per layout.

    ``batches[d]``: DP rank d's padded batch of logical ids ``(PADDED, K)``; its first ``real[d]``
    rows are real. Returns per EP rank ``(routed ids, num_unpadded it is told, global row ids)``:
    the global row id names the DP rank's token a routed row carries (``-1`` for padding).
    """
    per_rank = []
    for d in range(dp):
        for t in range(tp):
            per_rank.append((d, t))
    out = []
    chunk = -(-PADDED // tp)
    for d, t in per_rank:
        ids_of = [batches[x][0] for x in range(dp)]
        token_of = [batches[x][1] for x in range(dp)]
        if rows == "replicated":  # TP peers route their DP rank's whole batch
            out.append((ids_of[d], batches[d][2], token_of[d]))
        elif rows == "split":  # each TP rank routes its chunk of its DP rank's batch
            sl = slice(t * chunk, (t + 1) * chunk)
            real_in_chunk = max(0, min(batches[d][2] - t * chunk, chunk))
            out.append((ids_of[d][sl], real_in_chunk, token_of[d][sl]))
        elif rows == "gathered":  # every rank routes the DP batches, concatenated in DP order
            out.append((torch.cat(ids_of), batches[d][2], torch.cat(token_of)))
        else:  # gathered-sp: every rank's chunk, gathered over the EP group in EP order
            chunks = [(x, y) for x in range(dp) for y in range(tp)]
            ids = torch.cat([ids_of[x][y * chunk : (y + 1) * chunk] for x, y in chunks])
            tok = torch.cat([token_of[x][y * chunk : (y + 1) * chunk] for x, y in chunks])
            out.append((ids, batches[d][2], tok))
    return out


@pytest.mark.parametrize("rows", MOE_ROWS)
@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (2, 1), (2, 2), (1, 4)])
def test_ranks_routing_the_same_row_agree_and_every_real_selection_is_counted_once(rows, dp, tp):
    gen = torch.Generator().manual_seed(dp * 10 + tp)
    real = [5, 3, 8, 1][:dp]
    batches = []
    for d in range(dp):
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(PADDED)])
        tokens = torch.tensor([d * 100 + i if i < real[d] else -1 for i in range(PADDED)])
        batches.append((ids, tokens, real[d]))
    lookup = ReplicaLookup(E, "cpu", rows=16, num_physical_experts=P)
    lookup.refresh_(L2P, COUNT)
    choice: dict[tuple[int, int], int] = {}  # (token, k) -> physical id chosen by the first router
    total = torch.zeros(P, dtype=torch.int64)
    for ranks, (ids, unpadded, tokens) in zip(_ranks(dp, tp), _dispatch(rows, dp, tp, batches), strict=True):
        layout = torch.tensor(row_layout(rows, ranks).values())
        load = torch.zeros(P, dtype=torch.int64)
        physical = map_to_physical_and_record(
            ids, lookup.table, load, torch.tensor(True), torch.tensor(unpadded), layout
        )
        total += load
        for i, token in enumerate(tokens.tolist()):
            if token < 0:
                continue
            for k in range(K):
                key = (token, k)
                # Agreement: a rank that routes this token's row picks the same replica as every other.
                assert choice.setdefault(key, int(physical[i, k])) == int(physical[i, k]), (ranks, key)
    # Every real token's K selections counted once over all ranks; no padding counted.
    assert int(total.sum()) == sum(real) * K
    want = torch.zeros(P, dtype=torch.int64)
    for physical_id in choice.values():
        want[physical_id] += 1
    assert torch.equal(total, want)


def test_a_rank_dependent_replica_rule_breaks_agreement_on_tp_replicated_rows():
    # vLLM Ascend's rule (row + ep_rank + e): the TP+EP ranks routing the same rows disagree.
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    choices = []
    for ep_rank in range(2):
        table = build_replica_table(L2P, COUNT, ep_rank, rows=16, num_physical_experts=P)
        choices.append(map_to_physical_and_record(
            ids, table, torch.zeros(P, dtype=torch.int64), torch.tensor(False), torch.tensor(0)
        ))  # fmt: skip
    assert not torch.equal(choices[0], choices[1])
    # The same rows with the replicated layout on both ranks: one choice.
    lookup = ReplicaLookup(E, "cpu", rows=16, num_physical_experts=P)
    lookup.refresh_(L2P, COUNT)
    agreed = [
        map_to_physical_and_record(
            ids, lookup.table, torch.zeros(P, dtype=torch.int64), torch.tensor(False), torch.tensor(0),
            torch.tensor(row_layout("replicated", r).values()),
        )
        for r in _ranks(1, 2)
    ]  # fmt: skip
    assert torch.equal(agreed[0], agreed[1])


def _config(dp=1, tp=2, backend="allgather_reducescatter", sp=False, pcp=1):
    return SimpleNamespace(
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        all2all_backend=backend,
        use_sequence_parallel_moe=sp,
        prefill_context_parallel_size=pcp,
    )


def test_default_rows_follow_vllms_fused_moe_dispatch():
    assert default_moe_rows(_config(dp=1, tp=2)) == "replicated"
    assert default_moe_rows(_config(dp=2, tp=1)) == "gathered"
    assert default_moe_rows(_config(dp=2, tp=2, sp=True)) == "gathered-sp"
    assert default_moe_rows(_config(dp=2, tp=2, backend="deepep_low_latency")) == "replicated"
    assert default_moe_rows(_config(dp=2, tp=2, backend="deepep_low_latency", sp=True)) == "split"
    assert default_moe_rows(_config(dp=2, tp=1, backend="deepep_high_throughput")) == "split"
    # vLLM's modular-kernel experts (its unquantized CPU and GPU methods) route before they dispatch: the
    # runner's do_naive_dispatch_combine is False, and each DP rank routes its own rows.
    assert default_moe_rows(_config(dp=2, tp=1), naive_dispatch=False) == "split"
    assert default_moe_rows(_config(dp=2, tp=2), naive_dispatch=False) == "replicated"
    assert default_moe_rows(_config(dp=2, tp=2, sp=True), naive_dispatch=False) == "split"
    assert default_moe_rows(_config(dp=2, tp=1), naive_dispatch=True) == "gathered"
    assert default_moe_rows(_config(dp=1, tp=2), naive_dispatch=True) == "replicated"
    assert unplaceable_layout(_config()) is None
    assert "prefill_context_parallel_size=2" in unplaceable_layout(_config(pcp=2))


def test_row_layout_is_a_value_with_its_sharing_group():
    assert RowLayout("split", 1, 1, 0, 0, 1) == row_layout("split", RankCoordinates(1, 2, 1, 2, 0, 1))
    ranks = _ranks(2, 2)
    groups = {rows: [row_layout(rows, r).sharing_group for r in ranks] for rows in MOE_ROWS}
    assert groups == {
        "replicated": [0, 0, 1, 1],
        "split": [0, 1, 2, 3],
        "gathered": [0, 0, 0, 0],
        "gathered-sp": [0, 0, 0, 0],
    }
