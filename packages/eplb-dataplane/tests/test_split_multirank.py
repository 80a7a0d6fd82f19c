"""The batch split on real rank processes over Gloo (the launcher): ranks agree, global counts hold."""

from pathlib import Path

import pytest
import torch

from ascend_eplb.dataplane import (
    ReplicaLookup,
    map_to_physical_and_record,
    map_to_physical_split_and_record,
    split_boundaries,
)
from ascend_eplb.testing import load_module, run_ranks

ranks = load_module(Path(__file__).with_name("ranks_split.py"))

pytestmark = pytest.mark.multirank


def _alone(ids, num_real, layout=(0, 1, 0, 0)):
    lookup = ReplicaLookup(ranks.E, "cpu", rows=32, num_physical_experts=ranks.P, num_ranks=4)
    lookup.refresh_(*ranks.placement())
    load = torch.zeros(ranks.P, dtype=torch.int64)
    out = map_to_physical_split_and_record(
        ids, lookup.table, *lookup.split_inputs, load, torch.tensor(True), torch.tensor(num_real),
        torch.tensor(layout),
    )  # fmt: skip
    return out, load


def test_ranks_routing_the_same_rows_choose_the_same_replicas(tmp_path):
    results = run_ranks(
        ranks.split_world, world_size=4, tmp_path=tmp_path, args=("replicated",), timeout_s=120
    )
    want, load = _alone(ranks.batch(), ranks.NUM_TOKENS - 6)
    for r in results:
        assert torch.equal(r["out"][: ranks.NUM_TOKENS - 6], want[: ranks.NUM_TOKENS - 6])
        assert torch.equal(r["stats"], results[0]["stats"])
    # The padding rows read the table at each rank's own replica offset (0 or 1): ranks 0 and 2 agree.
    assert torch.equal(results[0]["out"], results[2]["out"])
    # Only the TP leader (rank 0) records, every real selection once.
    assert torch.equal(results[0]["load"], load)
    assert all(int(r["load"].sum()) == 0 for r in results[1:])
    assert int(load.sum()) == (ranks.NUM_TOKENS - 6) * ranks.TOP_K
    # Each replica took the split's share of its expert's selections (not the equal rule's).
    real = ranks.batch()[: ranks.NUM_TOKENS - 6]
    counts = torch.bincount(real.flatten().long(), minlength=ranks.E)
    lookup = ReplicaLookup(ranks.E, "cpu", rows=32, num_physical_experts=ranks.P, num_ranks=4)
    lookup.refresh_(*ranks.placement())
    shares = torch.diff(
        split_boundaries(counts, *lookup.split_inputs), dim=1, prepend=torch.zeros(ranks.E, 1)
    )
    l2p, _ = ranks.placement()
    valid = l2p >= 0
    assert torch.equal(load[l2p[valid]], shares[:, :3][valid].long())
    equal = torch.zeros(ranks.P, dtype=torch.int64)
    map_to_physical_and_record(real, lookup.table, equal, torch.tensor(True), torch.tensor(real.shape[0]))
    assert not torch.equal(equal, load)


def test_split_rows_with_global_counts_choose_the_whole_batchs_replicas(tmp_path):
    results = run_ranks(ranks.split_world, world_size=4, tmp_path=tmp_path, args=("split",), timeout_s=120)
    want, load = _alone(ranks.batch(), ranks.NUM_TOKENS)
    assert torch.equal(torch.cat([r["out"] for r in results]), want)
    assert torch.equal(sum(r["load"] for r in results), load)
    # Every rank solved the same global counts: the same executed balancedness, one batch each.
    assert all(torch.equal(r["stats"], results[0]["stats"]) for r in results)
    assert results[0]["stats"][2].item() == 1.0


def test_split_rows_split_locally_each_by_its_own_counts(tmp_path):
    results = run_ranks(
        ranks.split_world, world_size=4, tmp_path=tmp_path, args=("split-local",), timeout_s=120
    )
    size = ranks.NUM_TOKENS // 4
    for rank, r in enumerate(results):
        want, load = _alone(ranks.batch()[rank * size : (rank + 1) * size], size, (rank, 1, 0, 0))
        assert torch.equal(r["out"], want)
        assert torch.equal(r["load"], load)
