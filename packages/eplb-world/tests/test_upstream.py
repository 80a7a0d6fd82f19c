"""The CPU world's upstream surface: its stand-ins, instance bindings, attributes and signatures are rows
of its own table (``ascend_eplb.world.upstream``), rendered in ``UPSTREAM.md``, checked before anything
is installed, and never installed or checked by serving."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from ascend_eplb.control.patching import Signature
from ascend_eplb.control.surface import table as surface_table
from ascend_eplb.integration import patches
from ascend_eplb.world import stand_ins, surface, upstream

_STAND_IN_NAMES = [
    "vllm.model_executor.layers.utils.check_cpu_sgl_kernel",
    "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase.all_gatherv",
    "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase.reduce_scatterv",
    "torch._dynamo.config.disable",
]

#: The calls the world's serving worker makes to load and run an MTP draft as Model Runner V2 does.
#: The callers of the engine world's `_C` kernels (checked by `engine.kernels.register`).
_KERNEL_CALLERS = [
    "vllm._custom_ops.cpu_prepack_moe_weight",
    "vllm._custom_ops.cpu_fused_moe",
    "vllm._custom_ops.cpu_attn_get_scheduler_metadata",
    "vllm._custom_ops.cpu_attn_reshape_and_cache",
    "vllm._custom_ops.cpu_attention_with_kv_cache",
    "vllm._custom_ops.mla_decode_kvcache_cpu",
]
#: What the engine world's patches replace (`engine.patches`).
_ENGINE_PATCHED = [
    "vllm.platforms.vllm_version_matches_substr",
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts.apply",
]


def _assert_drift(call, name: str, expected: tuple[str, ...], found: tuple[str, ...]) -> None:
    """``call()`` raises the checker's error naming ``name`` and both parameter lists, exactly."""
    with pytest.raises(RuntimeError) as info:
        call()
    assert str(info.value) == (
        f"upstream {name} changed signature: expected parameters {expected} (vLLM 0.33.0), found {found}; "
        "ascend_eplb must be updated for this version"
    )


@pytest.fixture
def clean():
    patches.remove_patches()
    yield
    patches.remove_patches()


def test_the_cpu_worlds_stand_ins_are_rows_of_its_surface_that_serving_never_installs():
    """Issue 30 item 2: the CPU world built its own PatchSet of three vLLM bindings (and switched TorchDynamo
    off, and bound methods per instance) in no row. Its stand-ins are the rows of its surface's
    ``STAND_INS``, built by the world from the rows (issue 39: the world's own table, not control's; each
    declared on its factory); serving's registry holds none of them."""
    world = stand_ins.stand_in_patches()
    assert world.patches == stand_ins.STAND_INS
    assert [p.name for p in world.patches] == _STAND_IN_NAMES
    assert {p.owner for p in world.patches} == {"ascend_eplb.world.stand_ins"}
    assert [p.replace for p in world.patches] == [
        stand_ins._without_absent_sgl_kernel,
        stand_ins._cpu_all_gatherv,
        stand_ins._cpu_reduce_scatterv,
        stand_ins._dynamo_disabled,
    ]
    assert [p.check for p in world.patches] == [
        None,
        stand_ins._check_cpu_communicator_lacks_all_gatherv,
        stand_ins._check_cpu_communicator_lacks_reduce_scatterv,
        stand_ins._check_dynamo_switch,
    ]
    # Every factory of the world that declares a stand-in is listed (none declared and never installed).
    from ascend_eplb.control.patching import DECLARED_ATTR, patches_of

    declared = [v for v in vars(stand_ins).values() if DECLARED_ATTR in getattr(v, "__dict__", {})]
    assert [p for v in declared for p in patches_of(v)] == list(stand_ins.STAND_INS)
    source = inspect.getsource(stand_ins)
    assert "Patch(" not in source  # the rows are the one spelling of the bindings and parameters
    assert '"input_", "dim=0"' not in source
    assert set(_STAND_IN_NAMES).isdisjoint(p.name for p in patches.PATCHES)
    assert [b.name for b in patches.INSTANCE_BINDINGS] == [
        "vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter._apply_eplb_mapping",
        "vllm.distributed.eplb.eplb_utils.CpuGpuEvent.record",
    ]
    assert [(b.name, b.owner) for b in upstream.INSTANCE_BINDINGS] == [
        (
            "vllm.model_executor.layers.attention.attention.Attention.forward",
            "ascend_eplb.world.stand_ins",
        ),
        (
            "vllm.model_executor.layers.attention.mla_attention.MLAAttention.forward",
            "ascend_eplb.world.stand_ins",
        ),
        (
            "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.get_expert_weights",
            "ascend_eplb.world.quant_method",
        ),
    ]
    assert list(upstream.SIGNATURES) == [
        *_STAND_IN_NAMES[:3],
        "vllm.model_executor.layers.attention.attention.Attention.forward",
        "vllm.model_executor.layers.attention.mla_attention.MLAAttention.forward",
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod.register_oot",
        "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts.get_expert_weights",
        "vllm.model_executor.layers.quantization.get_quantization_config",
        "vllm.model_executor.layers.quantization.register_quantization_config",
        *_KERNEL_CALLERS,
        *_ENGINE_PATCHED,
    ]
    upstream.SURFACE.check()  # vLLM 0.33.0 / torch 2.13.0 as installed: nothing drifted


def test_every_world_signature_is_listed_once_used_and_taken_from_the_table():
    table = upstream.SIGNATURES
    assert all(name == entry.name for name, entry in table.items())
    assert all(set(entry.users) <= set(upstream.USERS) and entry.users for entry in table.values())
    entry = table["vllm.model_executor.layers.utils.check_cpu_sgl_kernel"]
    with pytest.raises(ValueError, match=r"check_cpu_sgl_kernel is listed twice"):
        surface_table(entry, Signature(entry.module, entry.qualname, ("n",)))
    # Each stand-in of a function and each instance binding uses the table's entry, not a copy of it.
    for patch in stand_ins.stand_in_patches().patches:
        if patch.params is None:
            assert patch.name == "torch._dynamo.config.disable"
        else:
            assert patch.params == table[patch.name].params, patch.name
    assert all(table[b.name] is b.signature for b in upstream.INSTANCE_BINDINGS)
    # No entry is dead: each is replaced (a stand-in or an instance binding), a registration the world
    # calls (vLLM's out-of-tree method and quantization registries), all checked by install_stand_ins, or
    # a draft call its serving worker makes.
    from ascend_eplb.world.engine import patches as engine_patches
    from ascend_eplb.world.engine import platform_patches

    replaced = {
        p.name
        for p in (*stand_ins.STAND_INS, *engine_patches.ENGINE_PATCHES, *platform_patches.PLATFORM_PATCHES)
    }
    replaced |= {b.name for b in upstream.INSTANCE_BINDINGS}
    assert [n for n in table if n not in replaced] == [
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod.register_oot",
        "vllm.model_executor.layers.quantization.get_quantization_config",
        "vllm.model_executor.layers.quantization.register_quantization_config",
        *_KERNEL_CALLERS,
    ]
    with pytest.raises(
        KeyError, match=r"vllm\.nowhere\.f is not in ascend_eplb\.world\.upstream\.SIGNATURES"
    ):
        upstream.SURFACE.signature("vllm.nowhere.f")


def test_the_stand_ins_install_from_their_rows_refuse_a_cpu_communicator_of_its_own_and_remove():
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    from ascend_eplb.control.patching import PatchSet

    fresh = PatchSet(stand_ins.STAND_INS)
    was = torch._dynamo.config.disable
    assert fresh.apply() is True
    try:
        assert fresh.applied_names() == _STAND_IN_NAMES
        assert torch._dynamo.config.disable is True
    finally:
        assert fresh.remove() is True
    assert torch._dynamo.config.disable is was
    # A compiled world (install_stand_ins(compiled=True)) keeps TorchDynamo on: stand-in 6 does not apply.
    mode, stand_ins._COMPILED = stand_ins._COMPILED, True
    try:
        compiled = PatchSet(stand_ins.STAND_INS)
        assert compiled.apply() is True
        assert compiled.applied_names() == _STAND_IN_NAMES[:3]
        assert torch._dynamo.config.disable is was
        assert compiled.remove() is True
    finally:
        stand_ins._COMPILED = mode
    with pytest.raises(RuntimeError, match=r"upstream torch\._dynamo\.config\.disable is 'off', not a bool"):
        stand_ins._check_dynamo_switch("off")
    try:
        CpuCommunicator.reduce_scatterv = lambda self, input_, dim=-1, sizes=None: input_
        with pytest.raises(RuntimeError) as info:
            PatchSet(stand_ins.STAND_INS).apply()
    finally:
        del CpuCommunicator.reduce_scatterv
    assert str(info.value) == (
        "upstream CpuCommunicator now implements reduce_scatterv: the harness's stand-in for it must go "
        "(ascend_eplb.world.stand_ins, stand-in 5)"
    )
    assert torch._dynamo.config.disable is was  # verified before the first change


def test_a_drifted_row_of_the_world_does_not_stop_serving_but_stops_the_world(clean, monkeypatch):
    """Serving's check_upstream never sees the CPU world's rows (a vLLM change of Attention.forward must
    not stop a serving process); the world checks them when it installs its stand-ins, before anything
    changes. A lost attribute the world reads stops it too."""
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.layers.attention.attention import Attention

    def forward(self, query, key, value, output_shape=None):
        raise AssertionError("never called")

    monkeypatch.setattr(Attention, "forward", forward)
    patches.check_upstream()
    drift = (
        "Attention.forward",
        ("self", "query", "key", "value", "output_shape", "output_dtype"),
        ("self", "query", "key", "value", "output_shape"),
    )
    _assert_drift(upstream.SURFACE.check, *drift)
    sgl_kernel = layer_utils.check_cpu_sgl_kernel
    _assert_drift(stand_ins.install_stand_ins, *drift)
    assert layer_utils.check_cpu_sgl_kernel is sgl_kernel
    monkeypatch.undo()

    monkeypatch.setattr(
        upstream.SURFACE,
        "attributes",
        (*upstream.SURFACE.attributes[:-1], _lost(upstream.SURFACE.attributes[-1])),
    )
    patches.check_upstream()
    with pytest.raises(RuntimeError) as info:
        stand_ins.install_stand_ins()
    assert str(info.value) == (
        "upstream MixtureOfExperts.moe_layers_lost is missing (world.rank_model reads it); ascend_eplb must "
        "be updated for this version"
    )
    assert layer_utils.check_cpu_sgl_kernel is sgl_kernel


def _lost(row):
    """``row`` for an attribute upstream's class does not declare."""
    import dataclasses

    return dataclasses.replace(row, attr=f"{row.attr}_lost")


def test_the_world_tables_are_rendered_from_the_rows():
    """Issue 39: the CPU world's rows are rendered in this package's ``UPSTREAM.md`` (they were a section of
    control's), every row kind in it."""
    doc = Path(__file__).resolve().parents[1] / "UPSTREAM.md"
    text = surface.render()
    assert doc.read_text() == text, (
        "run: python -m ascend_eplb.world.surface > packages/eplb-world/UPSTREAM.md"
    )
    rows = [
        *(p.name for p in stand_ins.STAND_INS),
        *(b.name for b in upstream.INSTANCE_BINDINGS),
        *(f"{a.cls}.{a.attr}" for a in upstream.ATTRIBUTES),
        *upstream.SIGNATURES,
    ]
    assert [r for r in rows if f"`{r}`" not in text] == []
    assert [p.name for p in stand_ins.STAND_INS if f"| `{p.name}` | {p.does} |" not in text] == []
    assert (
        "| `vllm.model_executor.layers.attention.attention.Attention.forward` | `world.stand_ins` | "
        "install_attention_stand_ins, on each Attention of a model the CPU world built: prefill-only causal "
        "SDPA |"
    ) in text
    assert "Never installed or checked by serving" in text
