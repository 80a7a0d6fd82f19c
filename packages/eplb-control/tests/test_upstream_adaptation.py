"""In-process checks of the adaptations of upstream vLLM 0.33.0 (no ranks): host adaptation, commit
hooks, signature drift, layer-state lookups, registration errors."""

from __future__ import annotations

import collections
import os
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest
import torch
from vllm.config import EPLBConfig, ParallelConfig
from vllm.distributed.eplb import eplb_state as upstream_state
from vllm.distributed.eplb.eplb_state import EplbLayerState, EplbState, compute_logical_maps
from vllm.v1.worker.gpu.eplb_utils import EPLBController

from ascend_eplb.control import (
    AscendEPLBController,
    AscendEplbLayerState,
    AscendEplbState,
    CommitEvent,
    EventBus,
    Patch,
    PatchSet,
    RearrangementEvent,
    ShutdownEvent,
    StepEvent,
    commit_hooks,
    commit_hooks_installed,
    host_adaptation,
)
from ascend_eplb.control.layout import RankCoordinates
from ascend_eplb.dataplane import build_replica_table
from ascend_eplb.testing.tagged import TaggedExperts
from ascend_eplb.world.toy_moe import ToyModelConfig, ToyMoEModel

EPLB_REFUSED = "Expert parallelism load balancing is only supported on"


def _eplb_parallel_config() -> ParallelConfig:
    return ParallelConfig(
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        eplb_config=EPLBConfig(num_redundant_experts=2, communicator="torch_gloo"),
    )


@pytest.fixture
def control_patches():
    """This plane's patches installed the way the integration installs them; removed afterwards."""
    patches = PatchSet([*host_adaptation.PATCHES, *commit_hooks.PATCHES])
    assert patches.apply() is True
    yield patches
    patches.remove()


def test_host_adaptation_covers_the_five_points_and_is_removable():
    assert not torch.accelerator.is_available()
    original_event, original_init = torch.Event, EplbState.__dict__["__init__"]
    original_empty_cache = torch.accelerator.empty_cache
    patches = PatchSet(host_adaptation.PATCHES)
    with pytest.raises(ValueError, match=EPLB_REFUSED):
        _eplb_parallel_config()
    try:
        assert patches.apply() is True
        patched = (torch.Event, torch.accelerator.current_stream, EplbState.__dict__["__init__"])
        assert patches.apply() is False  # idempotent: nothing wrapped twice
        assert (torch.Event, torch.accelerator.current_stream, EplbState.__dict__["__init__"]) == patched
        assert patches.applied_names() == [
            "vllm.config.parallel.current_platform",
            "torch.Event",
            "torch.accelerator.set_device_index",
            "torch.accelerator.current_stream",
            "torch.accelerator.set_stream",
            "torch.accelerator.empty_cache",
            "vllm.distributed.eplb.eplb_state.EplbState.__init__",
        ]
        # 1. platform check: EPLB configs validate, the communicator choice is untouched.
        pc = _eplb_parallel_config()
        assert pc.enable_eplb
        assert pc.eplb_config.communicator == "torch_gloo"
        # 2. events record and time on the host.
        start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        assert isinstance(start, original_event)
        start.record()
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) >= 0.0
        # 3. stream calls.
        torch.accelerator.set_device_index(0)
        stream = torch.accelerator.current_stream()
        assert stream.device == torch.device("cpu")
        torch.accelerator.set_stream(stream)
        # 4. device index for the async worker.
        assert EplbState(pc, torch.device("cpu")).device_index == 0
        # 5. the model loader's cache release.
        assert torch.accelerator.empty_cache() is None
    finally:
        patches.remove()
    assert patches.remove() is False
    assert torch.Event is original_event
    assert EplbState.__dict__["__init__"] is original_init
    assert EplbState(_parallel_config_without_eplb(), torch.device("cpu")).device_index is None
    with pytest.raises(RuntimeError, match="Cannot access accelerator"):
        torch.accelerator.current_stream()
    assert torch.accelerator.empty_cache is original_empty_cache
    with pytest.raises(RuntimeError, match="Cannot access accelerator"):
        torch.accelerator.empty_cache()


def test_commit_hooks_are_idempotent_and_removable():
    originals = (upstream_state._commit_eplb_maps_for_layer, upstream_state._commit_eplb_maps)
    patches = PatchSet(commit_hooks.PATCHES)
    assert not commit_hooks_installed()
    assert patches.apply() is True
    wrapped = (upstream_state._commit_eplb_maps_for_layer, upstream_state._commit_eplb_maps)
    assert commit_hooks_installed()
    assert patches.apply() is False
    assert (upstream_state._commit_eplb_maps_for_layer, upstream_state._commit_eplb_maps) == wrapped
    assert tuple(w.__wrapped__ for w in wrapped) == originals
    # A second set cannot wrap the wrappers: a binding is patched once.
    with pytest.raises(RuntimeError, match=r"_commit_eplb_maps_for_layer is already patched by"):
        PatchSet(commit_hooks.PATCHES).apply()
    assert patches.remove() is True
    assert (upstream_state._commit_eplb_maps_for_layer, upstream_state._commit_eplb_maps) == originals
    assert patches.remove() is False
    assert not commit_hooks_installed()


def test_commit_hook_drift_is_refused_before_anything_is_wrapped(monkeypatch):
    def drifted(model_state, new_physical_to_logical_map, layer, stream):
        raise AssertionError("never called")

    monkeypatch.setattr(upstream_state, "_commit_eplb_maps_for_layer", drifted)
    original_commit = upstream_state._commit_eplb_maps
    with pytest.raises(
        RuntimeError,
        match=r"upstream vllm\.distributed\.eplb\.eplb_state\._commit_eplb_maps_for_layer changed signature",
    ):
        PatchSet([*host_adaptation.PATCHES, *commit_hooks.PATCHES]).apply()
    assert not commit_hooks_installed()
    assert upstream_state._commit_eplb_maps is original_commit
    assert not isinstance(torch.Event, type) or torch.Event.__name__ == "Event"  # host patches untouched


def test_a_failing_replacement_rolls_back_the_patches_before_it():
    original_event = torch.Event

    def broken(_original):
        raise OSError("replacement cannot be built")

    patches = PatchSet([
        *host_adaptation.PATCHES,
        Patch("torch", "Stream", None, broken, "tests"),
    ])  # fmt: skip
    with pytest.raises(OSError, match="replacement cannot be built"):
        patches.apply()
    assert torch.Event is original_event
    assert not patches.installed
    with pytest.raises(ValueError, match=r"listed more than once: \['torch.Event'\]"):
        PatchSet([*host_adaptation.PATCHES, host_adaptation.PATCHES[1]])


def test_state_construction_needs_the_commit_hooks():
    with pytest.raises(RuntimeError, match="AscendEplbState needs the commit hooks"):
        AscendEplbState(_parallel_config_without_eplb(), torch.device("cpu"))


@pytest.mark.parametrize(
    ("owner", "name", "qualname"),
    [
        (EplbState, "rearrange", "EplbState.rearrange"),
        (EplbState, "add_model", "EplbState.add_model"),
        (EplbLayerState, "set_layer_state", "EplbLayerState.set_layer_state"),
        (upstream_state, "_move_to_workspace", "_move_to_workspace"),
    ],
)
def test_state_construction_names_the_drifted_upstream_method(
    control_patches, monkeypatch, owner, name, qualname
):
    def drifted(self, *, something_new):
        raise AssertionError("never called")

    monkeypatch.setattr(owner, name, drifted)
    with pytest.raises(RuntimeError, match=rf"upstream \S*{qualname} changed signature"):
        AscendEplbState(_parallel_config_without_eplb(), torch.device("cpu"))


def _parallel_config_without_eplb() -> ParallelConfig:
    return ParallelConfig()


def test_a_table_entry_checks_the_function_bound_now_and_names_its_drift(monkeypatch):
    from ascend_eplb.control import upstream
    from ascend_eplb.control.patching import InstanceBinding, Signature

    entry = upstream.SURFACE.signature("vllm.distributed.eplb.eplb_state._move_to_workspace")
    assert entry.label == "vllm.distributed.eplb.eplb_state._move_to_workspace"
    entry.check()
    upstream.SURFACE.check(upstream.STATE, upstream.CONTROLLER, upstream.COMMIT_HOOKS)

    def _move_to_workspace(model_state, ep_rank, is_profile):
        raise AssertionError("never called")

    monkeypatch.setattr(upstream_state, "_move_to_workspace", _move_to_workspace)
    with pytest.raises(RuntimeError) as info:
        upstream.SURFACE.check(upstream.COMMIT_HOOKS)
    assert str(info.value) == (
        "upstream vllm.distributed.eplb.eplb_state._move_to_workspace changed signature: expected parameters "
        "('model_state', 'ep_rank') (vLLM 0.33.0), found ('model_state', 'ep_rank', 'is_profile'); "
        "ascend_eplb must be updated for this version"
    )
    # A patch of a function takes binding and parameters from its entry; a binding per instance names
    # the attribute it sets.
    patch = Patch.on(entry, lambda original: original, "tests")
    assert (patch.name, patch.params) == (entry.name, ("model_state", "ep_rank"))
    event = upstream.SURFACE.signature("vllm.distributed.eplb.eplb_utils.CpuGpuEvent.record")
    assert (event.label, InstanceBinding(event, "tests", "nowhere").attr) == ("CpuGpuEvent.record", "record")
    with pytest.raises(
        RuntimeError, match=r"upstream vllm\.distributed\.eplb\.eplb_state\.nowhere is missing"
    ):
        Signature("vllm.distributed.eplb.eplb_state", "nowhere", ()).check()


def test_controller_construction_names_the_drifted_upstream_method(monkeypatch):
    def prepare_forward(self, model_config, num_unpadded_tokens):
        raise AssertionError("never called")

    monkeypatch.setattr(EPLBController, "prepare_forward", prepare_forward)
    with pytest.raises(RuntimeError, match=r"upstream EPLBController\.prepare_forward changed signature"):
        AscendEPLBController(_parallel_config_without_eplb(), torch.device("cpu"))


def test_controller_rejects_an_unknown_phase():
    with pytest.raises(ValueError, match=r"load_collection_phase='mixed' is not allowed; allowed phases"):
        AscendEPLBController(
            _parallel_config_without_eplb(), torch.device("cpu"), load_collection_phase="mixed"
        )
    ctrl = AscendEPLBController(_parallel_config_without_eplb(), torch.device("cpu"), "decode")
    with pytest.raises(ValueError, match="batch_has_prefill='yes' must be a bool"):
        ctrl.set_batch_phase("yes")
    ctrl.prepare_load()
    assert ctrl.state is None  # EPLB off: nothing is built


def test_add_model_refuses_a_layer_without_an_ascend_layer_state(control_patches):
    model = ToyMoEModel(
        [TaggedExperts(i, [0, 1, 2, 3], lambda layer, e: float(e)) for i in range(2)], 8, 0, 2, 2
    )
    model.layers[0].router.eplb_state = AscendEplbLayerState.from_upstream(model.layers[0].router.eplb_state)
    state = AscendEplbState(_parallel_config_without_eplb(), torch.device("cpu"))
    with pytest.raises(TypeError, match=r"MoE layer 1 \(ToyMoELayer\) has eplb_state of type EplbLayerState"):
        state.add_model(model, ToyModelConfig())
    assert state.model_states == {}
    assert model.layers[0].eplb_state.replica_lookup is None


def test_step_events_are_published_only_when_upstream_steps():
    calls = []
    ctrl = AscendEPLBController(_parallel_config_without_eplb(), torch.device("cpu"))
    ctrl.bus.subscribe(StepEvent, lambda e: calls.append((e.is_dummy, e.is_profile)))
    ctrl.prepare_load()
    ctrl.step()  # EPLB off: upstream's step returns at once, and no step event is published
    assert calls == []


def test_the_controller_and_its_state_publish_on_one_bus(control_patches, monkeypatch):
    ctrl = AscendEPLBController(_eplb_parallel_config(), torch.device("cpu"))
    ctrl.prepare_load()
    assert ctrl.state.bus is ctrl.bus
    heard = []
    ctrl.bus.subscribe(CommitEvent, heard.append)
    ctrl.bus.subscribe(RearrangementEvent, heard.append)
    ctrl.bus.subscribe(ShutdownEvent, heard.append)
    model_state = SimpleNamespace(model_name="m")
    ctrl.state._log("move", model_state, 3)
    (event,) = heard
    assert (event.kind, event.model_name, event.layer, event.rearrangement) == ("move", "m", 3, 0)
    assert event.model_state is model_state
    assert list(ctrl.state.commit_log) == [event]

    # Upstream's rearrange (which needs the EP group) stubbed, with its signature.
    def rearrange(self, is_profile=False, rank_mapping=None, use_last_expert_load=False):
        return "rearranged"

    monkeypatch.setattr(EplbState, "rearrange", rearrange)
    assert ctrl.state.rearrange() == "rearranged"  # no model registered: no skip decision either
    assert ctrl.state.num_rearrangements == 1
    assert heard[1] == RearrangementEvent(ctrl.state)
    ctrl.shutdown()
    ctrl.shutdown()
    assert heard[2:] == [ShutdownEvent(ctrl)]  # once
    alone = AscendEplbState(_parallel_config_without_eplb(), torch.device("cpu"))
    assert isinstance(alone.bus, EventBus)
    assert alone.bus is not ctrl.bus


def test_stop_eplb_sets_upstreams_fields_once():
    ctrl = AscendEPLBController(_parallel_config_without_eplb(), torch.device("cpu"))
    flag = torch.ones((), dtype=torch.bool)
    ms = SimpleNamespace(rebalanced=True, pending_result=object())
    ctrl.state = SimpleNamespace(should_record_tensor=flag, model_states={"k": ms})
    assert (ctrl.suppressed, ctrl.eplb_stopped) == (False, None)
    assert ctrl.stop_eplb("worker died") is True
    assert (ctrl.suppressed, ctrl.eplb_stopped, bool(flag)) == (True, "worker died", False)
    assert (ms.rebalanced, ms.pending_result) == (False, None)
    ms.rebalanced, pending = True, object()
    ms.pending_result = pending
    assert ctrl.stop_eplb("again") is False  # idempotent: nothing changes, the first reason stays
    assert (ctrl.eplb_stopped, ms.rebalanced, ms.pending_result) == ("worker died", True, pending)
    bare = AscendEPLBController(_parallel_config_without_eplb(), torch.device("cpu"))
    assert bare.stop_eplb("before load") is True  # no state yet: upstream's switch only
    assert bare.suppressed is True
    for bad in (None, "", 123):
        with pytest.raises(ValueError, match="must be a non-empty str") as info:
            ctrl.stop_eplb(bad)
        assert str(info.value) == f"reason={bad!r} must be a non-empty str (why EPLB stopped)"
    assert ctrl.eplb_stopped == "worker died"


def test_a_stop_inside_upstreams_suppress_outlives_it():
    """A review found upstream's suppress() restored both switches on exit, undoing a stop made inside."""
    ctrl = AscendEPLBController(_parallel_config_without_eplb(), torch.device("cpu"))
    flag = torch.ones((), dtype=torch.bool)
    ctrl.state = SimpleNamespace(should_record_tensor=flag, model_states={})
    with ctrl.suppress():
        assert (ctrl.suppressed, bool(flag)) == (True, False)
    assert (ctrl.suppressed, bool(flag)) == (False, True)  # upstream's restore, when not stopped
    with ctrl.suppress():
        assert ctrl.stop_eplb("worker died") is True
    assert (ctrl.suppressed, bool(flag), ctrl.eplb_stopped) == (True, False, "worker died")
    with pytest.raises(RuntimeError, match="boom"), ctrl.suppress():
        raise RuntimeError("boom")
    assert (ctrl.suppressed, bool(flag)) == (True, False)  # stopped, also when the forward raised


def _maps(physical_to_logical: list[list[int]], num_logical: int):
    l2p, count = compute_logical_maps(torch.tensor(physical_to_logical), num_logical)
    l2p = torch.nn.functional.pad(l2p, (0, 1024 - l2p.shape[-1]), value=-1)
    return l2p, count


def test_layer_state_builds_then_refreshes_its_lookup_in_place():
    num_logical, rank = 4, 0  # the table is the same on every rank (phase 0)
    load = torch.zeros(2, 6, dtype=torch.int32)
    l2p, count = _maps([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 2, 3]], num_logical)
    ls = AscendEplbLayerState(lookup_rows=16)
    ls.set_layer_state(1, load, l2p, count)
    assert ls.moe_layer_idx == 1
    assert ls.expert_load_view.data_ptr() == load[1].data_ptr()
    assert torch.equal(ls.replica_lookup.table, build_replica_table(l2p[1], count[1], rank, 16))
    ptr = ls.replica_lookup.table.data_ptr()

    # A commit writes the upstream maps in place; the refresh follows them without moving the table.
    new_l2p, new_count = _maps([[0, 1, 2, 3, 0, 1], [3, 3, 2, 1, 0, 3]], num_logical)
    l2p.copy_(new_l2p)
    count.copy_(new_count)
    ls.refresh_replica_lookup()
    assert ls.replica_lookup.table.data_ptr() == ptr
    assert torch.equal(ls.replica_lookup.table, build_replica_table(new_l2p[1], new_count[1], rank, 16))
    assert int(ls.replica_lookup.table[:, 3].unique().numel()) == 3  # expert 3's three replicas all used

    # A placement naming a slot outside the load view is refused before anything changes.
    before = ls.replica_lookup.table.clone()
    bad_l2p = l2p.clone()
    bad_l2p[0, 0, 0] = 6
    with pytest.raises(ValueError, match=r"outside \[0, 6\)"):
        ls.set_layer_state(0, load, bad_l2p, count)
    assert ls.moe_layer_idx == 1
    assert ls.logical_to_physical_map.data_ptr() == l2p[1].data_ptr()
    assert torch.equal(ls.replica_lookup.table, before)

    converted = AscendEplbLayerState.from_upstream(ls, lookup_rows=16)
    assert converted.expert_load_view is ls.expert_load_view
    assert torch.equal(converted.replica_lookup.table, build_replica_table(l2p[1], count[1], 0, 16))
    with pytest.raises(RuntimeError, match="before set_layer_state"):
        AscendEplbLayerState().refresh_replica_lookup()


def test_an_undeclared_phase_records_nothing_and_warns_once_at_a_real_step(caplog):
    ctrl = AscendEPLBController(_parallel_config_without_eplb(), torch.device("cpu"), "decode")

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "was not declared" in r.getMessage()]

    with caplog.at_level("WARNING"):
        # A dummy run declares no phase (upstream's runner prepares no inputs for it): no warning.
        assert ctrl.phase_matched() is False
        ctrl.step(is_dummy=True, is_profile=True)
        ctrl.step(is_dummy=True)
        assert warned() == []
        # A real batch without a declared phase: its step warns, once per controller.
        assert ctrl.phase_matched() is False
        ctrl.step()
        assert ctrl.phase_matched() is False
        ctrl.step()
    assert warned() == [
        "EPLB: load_collection_phase=decode but a batch's phase was not declared "
        "(AscendEPLBController.set_batch_phase was not called before prepare_forward): its load is not "
        "recorded. The integration's patch of GPUModelRunner.prepare_inputs declares it; a runner that "
        "replaces prepare_inputs must call set_batch_phase once per batch, or use load_collection_phase=all"
    ]
    ctrl.set_batch_phase(False)
    assert ctrl.phase_matched() is True


def test_batch_split_rows_named_on_a_configuration_without_them_split_locally_and_warn_once(
    control_patches, caplog
):
    """vLLM Ascend's MC2 names split rows per forward on a TP-only configuration, whose replicated rows
    gave replica_split=batch the scope 'rows' at construction: no all-gather, each rank's own rows."""
    ctrl = AscendEPLBController(_eplb_parallel_config(), torch.device("cpu"), replica_split="batch")
    local = AscendEPLBController(_eplb_parallel_config(), torch.device("cpu"), replica_split="batch_local")
    for c in (ctrl, local):
        c._ranks = RankCoordinates(ep_rank=0, ep_size=2, tp_rank=0, tp_size=2, dp_rank=0, dp_size=1)
    assert (ctrl.split_scope, local.split_scope) == ("rows", "rows")
    with caplog.at_level("WARNING"):
        for rows in ("replicated", "split", "split", "gathered"):
            assert ctrl.row_layout_for(rows).rows == rows
            assert local.row_layout_for(rows).rows == rows
    assert [r.getMessage() for r in caplog.records if "replica_split" in r.getMessage()] == [
        "EPLB: replica_split=batch took its scope from the configuration's replicated rows at start-up (no "
        "all-gather of the counts), but a forward routes split rows (each rank its own): each rank splits "
        "only the rows it routes, as replica_split=batch_local does"
    ]


def test_remove_refuses_to_drop_a_later_replacement_of_its_binding():
    import types

    module = types.ModuleType("ascend_eplb_test_target")
    module.f = lambda a, b: "original"
    import sys

    sys.modules["ascend_eplb_test_target"] = module
    try:
        first = PatchSet([Patch("ascend_eplb_test_target", "f", ("a", "b"), lambda o: len, "first")])
        assert first.apply() is True  # len cannot carry the marker
        module.f = later = lambda a, b: "later"
        with pytest.raises(RuntimeError, match=r"ascend_eplb_test_target\.f was replaced again after first"):
            first.remove()
        assert module.f is later  # nothing was restored
        module.f = len
        assert first.remove() is True
        assert module.f(1, 2) == "original"
    finally:
        del sys.modules["ascend_eplb_test_target"]


def test_a_changed_default_or_kind_of_an_upstream_parameter_is_named(control_patches, monkeypatch):
    """Issue 30: the check compared parameter names only; a default or a kind that changes is drift too."""

    def step(self, is_dummy=True, is_profile=False, log_stats=False):
        raise AssertionError("never called")

    monkeypatch.setattr(EplbState, "step", step)
    with pytest.raises(RuntimeError) as info:
        AscendEplbState(_parallel_config_without_eplb(), torch.device("cpu"))
    assert str(info.value) == (
        "upstream EplbState.step changed signature: expected (self, is_dummy=False, is_profile=False, "
        "log_stats=False) (vLLM 0.33.0), found (self, is_dummy=True, is_profile=False, log_stats=False) "
        "(a parameter's kind or default changed); ascend_eplb must be updated for this version"
    )

    def keyword_only_step(self, *, is_dummy=False, is_profile=False, log_stats=False):
        raise AssertionError("never called")

    monkeypatch.setattr(EplbState, "step", keyword_only_step)
    with pytest.raises(RuntimeError, match=r"found \(self, \*, is_dummy=False, is_profile=False, log_stats"):
        AscendEplbState(_parallel_config_without_eplb(), torch.device("cpu"))


def test_the_controller_refuses_a_changed_body_it_copies_and_ignores_formatting(monkeypatch):
    from ascend_eplb.control import upstream
    from ascend_eplb.control.patching import source_digest

    (row,) = [b for b in upstream.BODIES if b.signature.qualname == "EPLBController.prepare_load"]

    # Upstream's body, with a docstring, a comment and other spacing: the same digest.
    def prepare_load(self) -> None:
        """A docstring upstream's does not have."""
        self.state = None  # a comment
        self._has_registered_models = False

        if self.parallel_config.enable_eplb:
            self.state = EplbState(self.parallel_config,   self.device)  # fmt: skip

    assert source_digest(prepare_load) == source_digest(EPLBController.prepare_load) == row.digest

    def prepare_load_that_changed(self) -> None:
        self.state = None
        self._has_registered_models = False
        self.loaded = True
        if self.parallel_config.enable_eplb:
            self.state = EplbState(self.parallel_config, self.device)

    prepare_load_that_changed.__name__ = "prepare_load"
    monkeypatch.setattr(EPLBController, "prepare_load", prepare_load_that_changed)
    with pytest.raises(RuntimeError) as info:
        AscendEPLBController(_parallel_config_without_eplb(), torch.device("cpu"))
    found = source_digest(prepare_load_that_changed)
    assert found != row.digest
    assert str(info.value) == (
        f"upstream EPLBController.prepare_load changed its body: source digest {found}, vLLM 0.33.0's is "
        f"{row.digest}; AscendEPLBController.prepare_load copies it, building an AscendEplbState: review it "
        f"against the new body, then update the digest {row.digest} in its row"
    )


def test_an_attribute_we_add_that_upstream_now_declares_is_refused(control_patches, monkeypatch):
    from vllm.distributed.eplb.eplb_state import EplbModelState

    from ascend_eplb.control import upstream

    monkeypatch.setattr(EplbModelState, upstream.COMMIT_OBSERVER_ATTR, None, raising=False)
    with pytest.raises(RuntimeError) as info:
        AscendEplbState(_parallel_config_without_eplb(), torch.device("cpu"))
    assert str(info.value) == (
        "upstream EplbModelState now declares '_ascend_eplb_commit_observer', the attribute "
        "control.commit_hooks sets on its instances; ascend_eplb must be updated for this version"
    )


def test_an_override_must_extend_upstreams_parameters(monkeypatch):
    import sys
    import types

    from ascend_eplb.control.patching import Override, Signature, extends

    assert extends(("self", "a", "b=1", "*", "c=None"), ("self", "a", "b=1"))
    assert extends(("self", "a", "*args", "**kwargs"), ("self", "a"))
    assert not extends(("self", "a", "c"), ("self", "a"))  # an added parameter without a default
    assert not extends(("self", "a", "*", "c"), ("self", "a"))  # keyword-only, still required
    assert not extends(("self", "b"), ("self", "a"))
    assert not extends(("self", "a=2"), ("self", "a=1"))

    class Base:
        def run(self, a, b=1):
            raise AssertionError("never called")

    class Ours(Base):
        def run(self, a, b=1, extra=None):
            raise AssertionError("never called")

    class Narrower(Base):
        def run(self, a):
            raise AssertionError("never called")

    class Inherits(Base):
        pass

    module = types.ModuleType("ascend_eplb_test_overrides")
    module.Base, module.Ours, module.Narrower, module.Inherits = Base, Ours, Narrower, Inherits
    monkeypatch.setitem(sys.modules, module.__name__, module)
    entry = Signature(module.__name__, "Base.run", ("self", "a", "b=1"))
    Override(f"{module.__name__}.Ours", entry, ("tests",), "").check()
    with pytest.raises(RuntimeError) as info:
        Override(f"{module.__name__}.Narrower", entry, ("tests",), "").check()
    assert str(info.value) == (
        "ascend_eplb_test_overrides.Narrower.run(self, a) does not extend upstream Base.run(self, a, b=1): "
        "upstream's parameters must come first, unchanged, and any added one needs a default"
    )
    with pytest.raises(
        RuntimeError, match=r"Inherits\.run is declared as an override of upstream but is not"
    ):
        Override(f"{module.__name__}.Inherits", entry, ("tests",), "").check()


def test_the_acknowledgement_evidence_is_read_before_the_worker_is_released():
    """``record`` releases upstream's async worker, which may publish the next layer into
    ``pending_result`` at once: the evidence read after it said "acknowledged before upstream cleared its
    pending result" (test_control_multirank flaked in CI). Here ``record`` publishes the next layer itself,
    as the worker did; the evidence is what held when the acknowledgement came."""
    import types

    from ascend_eplb.control.bus import CommitEvent, EventBus
    from ascend_eplb.control.outcome import Outcomes, PublishTimes
    from ascend_eplb.control.state import AscendEplbState

    state = object.__new__(AscendEplbState)  # only what the acknowledgement reads
    state.collect_commit_evidence, state.num_rearrangements = True, 3
    state.commit_log, state.bus, state._layer_states = collections.deque(), EventBus(), {"key": {}}
    state.outcomes = Outcomes(state.bus)
    now = [5.0]
    state.publish_times = PublishTimes(clock=lambda: now[0])
    state.publish_times.seen("m", (1,))  # seen published at 5.0 s, acknowledged at 7.5 s
    now[0] = 7.5
    heard = []
    state.bus.subscribe(CommitEvent, heard.append)
    model_state = types.SimpleNamespace(model_name="m", pending_result=None)  # upstream cleared it
    recorded = []

    def record(stream=None):
        recorded.append(stream)
        model_state.pending_result = "the next layer"  # the released worker publishes at once

    result = types.SimpleNamespace(layer_idx=1, consumed_event=types.SimpleNamespace(record=record))
    state._observe_acknowledgement(model_state, "key", result)
    result.consumed_event.record("stream")
    assert recorded == ["stream"]
    evidence = {"pending_result_cleared": True, "checksums": [], "data_ptrs": []}
    assert heard == [CommitEvent("acknowledge", "m", 1, 3, evidence, publish_to_acknowledge_s=2.5)]
    assert heard[0].publish_to_acknowledge_s == 2.5


def test_an_moe_draft_upstream_does_not_register_is_refused_a_dense_one_passes(control_patches):
    # Upstream's maybe_register_speculator returns False, silently, for a draft without a
    # MixtureOfExperts part (draft_model_supports_eplb): its routed experts would be served with EPLB's
    # redundant slots and no placement. Refused at registration, routers untouched; a dense draft passes.
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    ctrl = AscendEPLBController(_eplb_parallel_config(), torch.device("cpu"))
    spec = SimpleNamespace(method="draft_model", draft_model_config=SimpleNamespace(model="m"))
    draft = torch.nn.Module()
    draft.experts = RoutedExperts.__new__(RoutedExperts)  # a vLLM experts layer, in a class without the part
    torch.nn.Module.__init__(draft.experts)
    with pytest.raises(ValueError, match="EPLB is on but the MoE draft Module") as info:
        ctrl.maybe_register_speculator(SimpleNamespace(model=draft), spec, False)
    assert str(info.value) == (
        "EPLB is on but the MoE draft Module is not registered by upstream (draft_model_supports_eplb is "
        "False for it): its routed experts would be served without a placement of their own; disable "
        "speculative decoding or use a draft upstream balances"
    )
    assert ctrl.maybe_register_speculator(SimpleNamespace(model=torch.nn.Linear(2, 2)), spec, False) is False
    # Dummy weights (a scaling-up worker) and no draft: upstream's False, nothing checked.
    assert ctrl.maybe_register_speculator(SimpleNamespace(model=draft), spec, True) is False
    assert ctrl.maybe_register_speculator(None, spec, False) is False
