"""The narrow patches: idempotent, removable, signature-checked before anything changes."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm

import pytest
import torch

from ascend_eplb.integration import patches


def _bindings():
    out = {}
    for target in patches.PATCH_TARGETS:
        out[target.name] = target.current()
    out["torch.Event"] = torch.Event
    out["torch.accelerator.current_stream"] = torch.accelerator.current_stream
    from vllm.distributed.eplb import eplb_state

    out["_commit_eplb_maps_for_layer"] = eplb_state._commit_eplb_maps_for_layer
    return out


def _restore_upstream():
    # Constructing an AscendEplbState installs control's commit hooks by itself; start and end every
    # test from upstream's own bindings whoever installed what.
    from ascend_eplb.control import host_adaptation, uninstall_commit_hooks

    patches.remove_patches()
    uninstall_commit_hooks()
    host_adaptation.uninstall()


@pytest.fixture
def clean():
    _restore_upstream()
    yield
    _restore_upstream()


def test_apply_twice_changes_nothing_and_remove_restores(clean):
    before = _bindings()
    assert patches.apply_patches() is True
    after_first = _bindings()
    changed = {k for k in before if before[k] is not after_first[k]}
    # Every binding is replaced on this host without an accelerator (control's host adaptation included).
    assert changed == set(before)
    assert patches.apply_patches() is False
    assert _bindings() == after_first
    assert all(after_first[k] is _bindings()[k] for k in after_first)

    from vllm.config.parallel import current_platform
    from vllm.distributed.eplb import eplb_communicator, eplb_state
    from vllm.v1.worker.gpu import eplb_utils

    from ascend_eplb.control import AscendEplbState

    assert current_platform.is_cuda_alike() is True
    assert eplb_utils.EplbState is AscendEplbState
    original_factory = before[patches.FACTORY.name]
    assert eplb_communicator.create_eplb_communicator.__wrapped__ is original_factory
    assert eplb_state.create_eplb_communicator.__wrapped__ is original_factory

    assert patches.remove_patches() is True
    assert all(before[k] is _bindings()[k] for k in before)
    assert patches.remove_patches() is False


def test_post_init_resolves_unset_communicator_to_torch_gloo(clean):
    from vllm.config import ParallelConfig

    patches.apply_patches()
    pc = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True)
    assert pc.eplb_config.communicator == "torch_gloo"
    patches.remove_patches()
    with pytest.raises(ValueError, match="Expert parallelism load balancing is only supported on"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True)


def test_signature_drift_raises_naming_it_and_changes_nothing(clean, monkeypatch):
    from vllm.distributed.eplb import eplb_communicator

    def create_eplb_communicator(group_coordinator, backend, expert_weights, expert_buffer, extra=None):
        raise AssertionError("never called")

    monkeypatch.setattr(eplb_communicator, "create_eplb_communicator", create_eplb_communicator)
    before = _bindings()
    with pytest.raises(RuntimeError) as info:
        patches.apply_patches()
    assert str(info.value) == (
        "upstream vllm.distributed.eplb.eplb_communicator.create_eplb_communicator changed signature: "
        "expected parameters ('group_coordinator', 'backend', 'expert_weights', 'expert_buffer') "
        "(vLLM 0.33.0), found ('group_coordinator', 'backend', 'expert_weights', 'expert_buffer', 'extra'); "
        "ascend_eplb.integration.patches must be updated"
    )
    assert all(before[k] is _bindings()[k] for k in before)
    assert patches.patches_applied() is False


def test_drift_of_a_method_is_named_too(clean, monkeypatch):
    from vllm.v1.worker.gpu.eplb_utils import EPLBController

    def maybe_register_model(self, model, model_config, load_dummy_weights):
        raise AssertionError("never called")

    monkeypatch.setattr(EPLBController, "maybe_register_model", maybe_register_model)
    with pytest.raises(
        RuntimeError,
        match=r"upstream vllm\.v1\.worker\.gpu\.eplb_utils\.EPLBController\."
        r"maybe_register_model changed signature",
    ):
        patches.apply_patches()
    assert patches.patches_applied() is False


def test_adapt_layer_routers_names_a_layer_without_router_before_changing_any(clean):
    from types import SimpleNamespace

    from vllm.config import ParallelConfig
    from vllm.distributed.eplb.eplb_state import EplbLayerState
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    from ascend_eplb.control import AscendEplbState

    class TwoLayerMoE(torch.nn.Module, MixtureOfExperts):
        def __init__(self, layers):
            super().__init__()
            self.moe_layers = layers
            self.num_moe_layers = len(layers)

    class LayerWithoutRouter:
        pass

    routed = SimpleNamespace(router=SimpleNamespace(eplb_state=EplbLayerState()))
    model = TwoLayerMoE([routed, LayerWithoutRouter()])
    state = AscendEplbState(ParallelConfig(), torch.device("cpu"))
    with pytest.raises(
        RuntimeError,
        match=r"MoE layer 1 \(LayerWithoutRouter\) has no router with an 'eplb_state'",
    ):
        patches.adapt_layer_routers(state, model)
    assert type(routed.router.eplb_state) is EplbLayerState  # layer 0 untouched
