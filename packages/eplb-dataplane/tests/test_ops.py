"""map_to_physical, map_to_physical_and_record and record_expert_tokens: exact values."""

import pytest
import torch

from ascend_eplb.dataplane import (
    GROUP_LIST_COUNTS,
    GROUP_LIST_CUMSUM,
    ReplicaLookup,
    build_replica_table,
    map_to_physical,
    map_to_physical_and_record,
    record_expert_tokens,
)

ON = torch.tensor(True)
OFF = torch.tensor(False)


def _reference(ids: torch.Tensor, table: torch.Tensor, num_physical: int, num_unpadded: int):
    """Loop reference: mapped ids and the load counted from the first num_unpadded rows."""
    rows, num_experts = table.shape
    rows_of_table, id_rows = table.tolist(), ids.tolist()
    out = [[-1] * len(r) for r in id_rows]
    load = [0] * num_physical
    for t, row in enumerate(id_rows):
        for k, e in enumerate(row):
            if 0 <= e < num_experts:
                out[t][k] = rows_of_table[t % rows][e]
                if t < num_unpadded:
                    load[out[t][k]] += 1
    out, load = torch.tensor(out, dtype=ids.dtype).view(ids.shape), torch.tensor(load)
    return out, load


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_padding_example(dtype):
    ids = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 0], [0, 0]], dtype=dtype)
    lookup = ReplicaLookup(4, "cpu")
    lookup.refresh_(torch.arange(4).unsqueeze(1), torch.ones(4, dtype=torch.int64))
    load = torch.zeros(4, dtype=torch.int32)
    out = map_to_physical_and_record(ids, lookup.table, load, ON, torch.tensor(4))
    assert load.tolist() == [2, 2, 2, 2]
    assert out.dtype == dtype
    assert out.tolist() == ids.tolist()  # all 6 rows mapped, padding included
    load.zero_()
    out = map_to_physical_and_record(ids, lookup.table, load, OFF, torch.tensor(4))
    assert load.tolist() == [0, 0, 0, 0]
    assert out.tolist() == ids.tolist()


def _replicated_table(phase: int, rows: int = 1024) -> tuple[torch.Tensor, int]:
    # 16 logical experts over 24 physical slots: experts 0 and 1 have 3 replicas, 2..5 have 2, the others
    # 1, as a permutation of the slots.
    num_experts, num_physical = 16, 24
    gen = torch.Generator().manual_seed(7)
    slots = torch.randperm(num_physical, generator=gen)
    counts = [1] * num_experts
    for e in (0, 1, 2, 3, 4, 5):
        counts[e] += 1
    counts[0] += 1
    counts[1] += 1
    l2p = torch.full((num_experts, 3), -1, dtype=torch.int64)
    start = 0
    for e, c in enumerate(counts):
        l2p[e, :c] = slots[start : start + c]
        start += c
    assert start == num_physical
    return build_replica_table(l2p, torch.tensor(counts), phase, rows=rows), num_physical


@pytest.mark.parametrize("num_tokens", [1, 37, 1024, 2500])
def test_matches_loop_reference_and_records_unpadded_tokens_times_k(num_tokens):
    table, num_physical = _replicated_table(phase=1)
    gen = torch.Generator().manual_seed(num_tokens)
    top_k = 6
    ids = torch.stack([torch.randperm(16, generator=gen)[:top_k] for _ in range(num_tokens)])
    for num_unpadded in sorted({0, num_tokens // 2, num_tokens - 1, num_tokens}):
        load = torch.zeros(num_physical, dtype=torch.int32)
        out = map_to_physical_and_record(ids, table, load, ON, torch.tensor(num_unpadded, dtype=torch.int32))
        ref_out, ref_load = _reference(ids, table, num_physical, num_unpadded)
        assert torch.equal(out, ref_out)
        assert torch.equal(load.to(torch.int64), ref_load)
        assert int(load.sum()) == max(num_unpadded, 0) * top_k
        assert torch.equal(map_to_physical(ids, table), ref_out)


def test_invalid_ids_map_to_minus_one_and_are_not_counted():
    table, num_physical = _replicated_table(phase=0, rows=8)
    ids = torch.tensor([[0, -1, 5], [16, 3, 100], [-7, 15, 2]], dtype=torch.int32)
    load = torch.zeros(num_physical, dtype=torch.int64)
    out = map_to_physical_and_record(ids, table, load, ON, torch.tensor(3))
    ref_out, ref_load = _reference(ids, table, num_physical, 3)
    assert torch.equal(out, ref_out)
    assert (out == -1).tolist() == [[False, True, False], [True, False, True], [True, False, False]]
    assert torch.equal(load, ref_load)
    assert int(load.sum()) == 5


def test_load_accumulates_and_non_recording_call_leaves_it():
    table, num_physical = _replicated_table(phase=0)
    ids = torch.randint(0, 16, (300, 4), generator=torch.Generator().manual_seed(3))
    load = torch.zeros(num_physical, dtype=torch.int32)
    map_to_physical_and_record(ids, table, load, ON, torch.tensor(300))
    first = load.clone()
    map_to_physical_and_record(ids, table, load, OFF, torch.tensor(300))
    assert torch.equal(load, first)
    map_to_physical_and_record(ids, table, load, ON, torch.tensor(300))
    assert torch.equal(load, 2 * first)


def test_empty_batch():
    table, num_physical = _replicated_table(phase=0)
    load = torch.zeros(num_physical, dtype=torch.int32)
    ids = torch.empty((0, 8), dtype=torch.int64)
    out = map_to_physical_and_record(ids, table, load, ON, torch.tensor(0))
    assert out.shape == (0, 8)
    assert out.dtype == torch.int64
    assert int(load.sum()) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ids": torch.zeros(4, dtype=torch.int64)}, r"topk_ids must be int32 or int64 \(T, K\)"),
        ({"ids": torch.zeros((4, 2))}, r"topk_ids must be int32 or int64 \(T, K\)"),
        ({"table": torch.zeros((8, 16), dtype=torch.int64)}, r"table must be int32 \(rows, E\)"),
        ({"load": torch.zeros(24)}, r"expert_load_view must be int32 or int64 \(P,\)"),
        ({"record": torch.tensor(1)}, "record_enabled must be a 0-d bool tensor"),
        ({"record": torch.tensor([True])}, "record_enabled must be a 0-d bool tensor"),
        ({"unpadded": torch.tensor([4])}, "num_unpadded_tokens must be a 0-d int32 or int64 tensor"),
        ({"unpadded": torch.tensor(4.0)}, "num_unpadded_tokens must be a 0-d int32 or int64 tensor"),
    ],
)
def test_bad_arguments_raise_before_recording(change, message):
    table, num_physical = _replicated_table(phase=0, rows=8)
    args = {
        "ids": torch.zeros((4, 2), dtype=torch.int64),
        "table": table,
        "load": torch.zeros(num_physical, dtype=torch.int32),
        "record": ON,
        "unpadded": torch.tensor(4),
    }
    args.update(change)
    load = args["load"]
    before = load.clone()
    with pytest.raises(ValueError, match=message):
        map_to_physical_and_record(args["ids"], args["table"], load, args["record"], args["unpadded"])
    assert torch.equal(load, before)


def test_ops_pass_torch_library_opcheck():
    table, num_physical = _replicated_table(phase=2, rows=16)
    ids = torch.randint(-1, 17, (40, 4), generator=torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.ascend_eplb.map_to_physical.default, (ids, table))
    torch.library.opcheck(
        torch.ops.ascend_eplb.map_to_physical_and_record.default,
        (ids, table, torch.zeros(num_physical, dtype=torch.int32), ON, torch.tensor(30)),
    )


@pytest.mark.parametrize("group_list_type", [GROUP_LIST_COUNTS, GROUP_LIST_CUMSUM])
def test_record_expert_tokens_both_conventions(group_list_type):
    counts = torch.tensor([3, 0, 2, 7])
    expert_tokens = counts if group_list_type == GROUP_LIST_COUNTS else torch.cumsum(counts, 0)
    load = torch.zeros(12, dtype=torch.int32)
    record_expert_tokens(expert_tokens, group_list_type, load, 1, 3)
    assert load.tolist() == [0, 0, 0, 0, 3, 0, 2, 7, 0, 0, 0, 0]
    record_expert_tokens(expert_tokens, group_list_type, load, 2, 3, record_enabled=ON)
    record_expert_tokens(expert_tokens, group_list_type, load, 0, 3, record_enabled=OFF)
    assert load.tolist() == [0, 0, 0, 0, 3, 0, 2, 7, 3, 0, 2, 7]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.tensor([1, 2]), 2, 0, 2), r"group_list_type must be 0 \(cumulative sums\) or 1 \(counts\)"),
        ((torch.tensor([1, 2]), 1, 2, 2), r"ep_rank must be an int in \[0, 2\), got 2"),
        ((torch.tensor([1, 2]), 1, 0, 0), "num_ranks must be an int >= 1, got 0"),
        ((torch.tensor([1, 2, 3]), 1, 0, 2), r"has P = 4 slots, expected p \* num_ranks = 3 \* 2"),
        ((torch.tensor([1.0, 2.0]), 1, 0, 2), r"expert_tokens must be int32 or int64 \(p,\)"),
        # A review found these raised AttributeError, or (a bool) were taken as counts.
        (([1, 2], 1, 0, 2), r"expert_tokens must be int32 or int64 \(p,\), got list"),
        ((torch.tensor([1, 2]), True, 0, 2), r"group_list_type must be 0 .* got True"),
    ],
)
def test_record_expert_tokens_rejects_bad_input_before_writing(args, message):
    expert_tokens, group_list_type, ep_rank, num_ranks = args
    load = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        record_expert_tokens(expert_tokens, group_list_type, load, ep_rank, num_ranks)
    assert load.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("load", "message"),
    [
        (torch.zeros(4), r"expert_load_view must be int32 or int64 \(P,\), got torch.float32 \(4,\)"),
        (torch.zeros(1, dtype=torch.int32).expand(4), r"must not be a stride-0 \(expanded\) view"),
    ],
)
def test_record_expert_tokens_checks_the_load_view_as_the_lookup_and_the_map_op_do(load, message):
    # The one load-view rule set (lookup.check_load_view_metadata), here too, before any write.
    with pytest.raises(ValueError, match=message):
        record_expert_tokens(torch.tensor([1, 2]), GROUP_LIST_COUNTS, load, 0, 2)
    assert load.tolist() == [0, 0, 0, 0]


def test_record_expert_tokens_names_a_non_tensor_flag_and_a_sparse_view_before_writing():
    load = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="record_enabled must be a 0-d bool tensor, got bool"):
        record_expert_tokens(torch.tensor([1, 2]), GROUP_LIST_COUNTS, load, 0, 2, record_enabled=True)
    assert load.tolist() == [0, 0, 0, 0]
    sparse = torch.zeros(4, dtype=torch.int32).to_sparse()
    with pytest.raises(ValueError, match="dense tensor") as info:
        record_expert_tokens(torch.tensor([1, 2]), GROUP_LIST_COUNTS, sparse, 0, 2)
    assert str(info.value) == "expert_load_view must be a dense tensor, got layout torch.sparse_coo"


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("load_dtype", [torch.int32, torch.int64])
def test_cpu_dispatch_is_the_torch_form_and_equals_loop_reference(ids_dtype, load_dtype):
    # CPU is not a serving device: its dispatch runs the torch form (CompositeExplicitAutograd), for
    # strided tables and load views too, with negative and over-long unpadded counts.
    from ascend_eplb.dataplane import ops

    for name in ("map_to_physical", "map_to_physical_and_record"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"ascend_eplb::{name}", "CPU")
    base, num_physical = _replicated_table(phase=3, rows=40)
    strided_table = torch.zeros((40, 32), dtype=torch.int32)[:, ::2]
    strided_table.copy_(base)
    gen = torch.Generator().manual_seed(11)
    for table in (base, strided_table):
        for num_tokens in (1, 39, 40, 97):
            ids = torch.randint(-3, 19, (num_tokens, 5), generator=gen).to(ids_dtype)
            for num_unpadded in (-2, 0, num_tokens // 3, num_tokens, num_tokens + 5):
                for record in (ON, OFF):
                    n = torch.tensor(num_unpadded, dtype=torch.int32 if num_unpadded % 2 else torch.int64)
                    start = torch.arange(2 * num_physical, dtype=load_dtype)
                    op_load, generic_load = start.clone(), start.clone()
                    got = map_to_physical_and_record(ids, table, op_load[::2], record, n)
                    want = ops._map_to_physical_and_record_generic(ids, table, generic_load[::2], record, n)
                    ref_out, ref_load = _reference(ids, table, num_physical, max(num_unpadded, 0))
                    assert got.dtype == ids_dtype
                    assert torch.equal(got, ref_out)
                    assert torch.equal(want, ref_out)
                    assert torch.equal(map_to_physical(ids, table), ref_out)
                    added = (
                        ref_load.to(load_dtype)
                        if bool(record)
                        else torch.zeros_like(ref_load, dtype=load_dtype)
                    )
                    assert torch.equal(op_load[::2] - start[::2], added)
                    assert torch.equal(generic_load, op_load)  # odd slots untouched


def test_table_entries_beyond_the_load_view_are_mapped_not_counted():
    # E = 4 <= len(load) = 5 < P = 8: the op cannot see P; entries 5..7 are mapped and not counted
    # (ReplicaLookup.check_load_view rejects such a view where P is known).
    table = torch.tensor([[0, 5, 2, 7]], dtype=torch.int32)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1]], dtype=torch.int32)
    load = torch.zeros(5, dtype=torch.int64)
    out = map_to_physical_and_record(ids, table, load, ON, torch.tensor(3))
    assert out.tolist() == [[0, 5], [2, 7], [5, 5]]
    assert load.tolist() == [1, 0, 1, 0, 0]
