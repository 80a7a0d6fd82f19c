"""bind_router against a duck-typed router that mirrors vLLM 0.33.0 BaseRouter's EPLB method."""

from dataclasses import dataclass, field

import pytest
import torch

from ascend_eplb.dataplane import (
    ReplicaLookup,
    bind_router,
    build_replica_table,
    is_bound,
    map_to_physical,
    unbind_router,
)


class Router:
    """Mirrors upstream: ``_select_experts`` computes routing, then ``self._apply_eplb_mapping``."""

    def __init__(self, top_k: int, eplb_state=None):
        self.top_k = top_k
        self.eplb_state = eplb_state
        self.calls = 0

    def _apply_eplb_mapping(self, topk_ids: torch.Tensor) -> torch.Tensor:
        # Upstream's mapping is the identity off CUDA.
        return topk_ids

    def select_experts(self, router_logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        topk_ids = torch.topk(router_logits, self.top_k, dim=-1).indices
        return self._apply_eplb_mapping(topk_ids)


ORIGINAL = Router.__dict__["_apply_eplb_mapping"]


class DriftedRouter(Router):
    def _apply_eplb_mapping(self, topk_ids, ubatch):  # upstream changed the signature
        return topk_ids


class NoMappingRouter:
    eplb_state = None


@dataclass
class LayerState:
    replica_lookup: ReplicaLookup | None = None
    expert_load_view: torch.Tensor | None = None
    should_record_tensor: torch.Tensor | None = None
    num_unpadded_tokens_tensors: list[torch.Tensor] | None = field(default=None)
    row_layout: torch.Tensor | None = None


# 8 logical experts, 10 physical: experts 2 and 5 have a second replica in slots 8 and 9.
L2P = torch.tensor([[0, -1], [1, -1], [2, 8], [3, -1], [4, -1], [5, 9], [6, -1], [7, -1]])
COUNT = torch.tensor([1, 1, 2, 1, 1, 2, 1, 1])


def _state(unpadded=(5,)) -> LayerState:
    lookup = ReplicaLookup(8, "cpu", rows=16, num_physical_experts=10)
    lookup.refresh_(L2P, COUNT)
    return LayerState(
        replica_lookup=lookup,
        expert_load_view=torch.zeros(10, dtype=torch.int32),
        should_record_tensor=torch.tensor(True),
        num_unpadded_tokens_tensors=[torch.tensor(n, dtype=torch.int32) for n in unpadded],
    )


LOGITS = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))


def test_bound_router_maps_through_the_lookup_and_records_once():
    router, other = Router(3), Router(3)
    state = _state()
    bind_router(router, state)
    assert router.eplb_state is state
    assert is_bound(router)
    assert not is_bound(other)
    assert Router.__dict__["_apply_eplb_mapping"] is ORIGINAL  # class untouched
    logical = torch.topk(LOGITS, 3, dim=-1).indices
    physical = router.select_experts(LOGITS)
    expected = map_to_physical(logical, build_replica_table(L2P, COUNT, 0, rows=16))
    assert torch.equal(physical, expected)
    assert not torch.equal(physical, logical)  # replicas 8/9 were chosen for some rows
    assert int(state.expert_load_view.sum()) == 5 * 3  # 5 unpadded rows, K = 3
    assert torch.equal(other.select_experts(LOGITS), logical)  # other instance unaffected


def test_bound_router_applies_the_row_layout_it_reads_at_each_call():
    router = Router(3)
    state = _state(unpadded=(3,))
    state.row_layout = torch.tensor([1, 1, 0, 0])
    bind_router(router, state)
    logical = torch.topk(LOGITS, 3, dim=-1).indices
    table = build_replica_table(L2P, COUNT, 0, rows=16)
    # Offset 1: token t reads row t + 1, the rule with phase 1.
    assert torch.equal(
        router.select_experts(LOGITS), map_to_physical(logical, build_replica_table(L2P, COUNT, 1, rows=16))
    )
    assert int(state.expert_load_view.sum()) == 3 * 3
    # A gathered batch of 7 rows in 2 slices of 3 (row 6 is beyond both): slice 1 records rows 3..5.
    state.expert_load_view.zero_()
    state.row_layout.copy_(torch.tensor([0, 2, 1, 0]))
    physical = router.select_experts(LOGITS)
    assert torch.equal(physical, map_to_physical(logical, table))
    want = torch.bincount(physical[3:6].flatten(), minlength=10).to(torch.int32)
    assert torch.equal(state.expert_load_view, want)
    # A rank that shares its rows with the recording rank records none of them.
    state.expert_load_view.zero_()
    state.row_layout.copy_(torch.tensor([0, 1, -1, 0]))
    assert torch.equal(router.select_experts(LOGITS), physical)
    assert int(state.expert_load_view.sum()) == 0


def test_bind_is_idempotent_and_rebinding_follows_the_new_state():
    router = Router(3)
    first = _state()
    bind_router(router, first)
    bind_router(router, first)
    router.select_experts(LOGITS)
    assert int(first.expert_load_view.sum()) == 15  # mapped and recorded once, not twice
    second = _state(unpadded=(2,))
    bind_router(router, second)
    router.select_experts(LOGITS)
    assert int(first.expert_load_view.sum()) == 15
    assert int(second.expert_load_view.sum()) == 6
    assert unbind_router(router)
    assert not unbind_router(router)
    assert "_apply_eplb_mapping" not in vars(router)
    assert torch.equal(router.select_experts(LOGITS), torch.topk(LOGITS, 3, dim=-1).indices)


def test_micro_batch_selects_its_unpadded_count():
    router = Router(2)
    state = _state(unpadded=(7, 1))
    current = [1]
    bind_router(router, state, ubatch_id=lambda: current[0])
    router.select_experts(LOGITS)
    assert int(state.expert_load_view.sum()) == 1 * 2
    current[0] = 0
    router.select_experts(LOGITS)
    assert int(state.expert_load_view.sum()) == 2 + 7 * 2


def test_record_flag_off_maps_without_recording():
    router = Router(2)
    state = _state()
    state.should_record_tensor.fill_(False)
    bind_router(router, state)
    physical = router.select_experts(LOGITS)
    assert int(state.expert_load_view.sum()) == 0
    logical = torch.topk(LOGITS, 2, -1).indices
    assert torch.equal(physical, map_to_physical(logical, state.replica_lookup.table))


def test_eplb_state_none_returns_ids_and_uninitialised_state_raises():
    router = Router(2)
    bind_router(router, LayerState())
    with pytest.raises(RuntimeError, match="EPLB layer state is not initialised"):
        router.select_experts(LOGITS)
    router.eplb_state = None
    assert torch.equal(router.select_experts(LOGITS), torch.topk(LOGITS, 2, -1).indices)


def test_signature_drift_raises_naming_the_method_and_changes_nothing():
    router = DriftedRouter(2)
    with pytest.raises(RuntimeError, match=r"DriftedRouter\._apply_eplb_mapping has parameters"):
        bind_router(router, _state())
    assert router.eplb_state is None
    assert "_apply_eplb_mapping" not in vars(router)
    with pytest.raises(RuntimeError, match=r"NoMappingRouter\._apply_eplb_mapping is missing"):
        bind_router(NoMappingRouter(), _state())


def test_bad_layer_state_foreign_override_and_bad_ubatch_are_rejected_before_changes():
    router = Router(2)

    class Partial:
        replica_lookup = None
        expert_load_view = None

    with pytest.raises(
        TypeError, match=r"lacks \['should_record_tensor', 'num_unpadded_tokens_tensors', 'row_layout'\]"
    ):
        bind_router(router, Partial())
    with pytest.raises(TypeError, match="ubatch_id must be callable"):
        bind_router(router, _state(), ubatch_id=0)
    assert router.eplb_state is None
    assert not is_bound(router)
    router._apply_eplb_mapping = lambda topk_ids: topk_ids + 1
    with pytest.raises(RuntimeError, match="refusing to replace a binding this adapter did not install"):
        bind_router(router, _state())
    assert router.eplb_state is None


def test_load_view_shorter_than_the_lookups_physical_experts_is_rejected_at_bind():
    # Issue 14: a view of 9 counters for P = 10 would leave slot 9 (a replica of expert 5) unrecorded.
    router = Router(2)
    state = _state()
    state.expert_load_view = torch.zeros(9, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expert_load_view has 9 counters, fewer than the lookup's P = 10"):
        bind_router(router, state)
    assert router.eplb_state is None
    assert not is_bound(router)
    state.expert_load_view = torch.zeros(10, dtype=torch.int64)[None].expand(2, 10)[0]  # a (10,) view
    bind_router(router, state)
    assert is_bound(router)
