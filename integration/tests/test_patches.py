"""The one registry of the upstream surface: idempotent, removable, signature-checked before anything
changes, and equal to what the process really replaces (module-level here; per instance in the serving
world of ``test_mrv2_e2e.py``, which measures every live object after a real registration and commit)."""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm

import pytest
import torch

from ascend_eplb.control import upstream
from ascend_eplb.control.patching import InstanceBinding, Signature
from ascend_eplb.control.surface import table as surface_table
from ascend_eplb.integration import patches
from ascend_eplb.integration import upstream as integration_upstream

_MISSING = object()


def _bindings():
    return {patch.name: patch.current() for patch in patches.PATCHES}


def _process_bindings() -> dict[str, object]:
    """Every binding of the loaded torch and vLLM modules, by name, as the process holds it now: each
    module global (``module.attr``, modules excluded) and each attribute of a class its module defines
    (``module.Class.attr``). The objects are kept, so identity comparisons are exact."""
    out: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # touching deprecated torch aliases warns
        for modname, module in list(sys.modules.items()):
            if module is None or modname.split(".")[0] not in ("torch", "vllm"):
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, types.ModuleType):
                    continue
                out[f"{modname}.{attr}"] = value
                if isinstance(value, type) and value.__module__ == modname and value.__qualname__ == attr:
                    for cattr, cvalue in list(vars(value).items()):
                        out[f"{modname}.{attr}.{cattr}"] = cvalue
    return out


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


def test_every_patch_of_the_process_is_in_the_one_registry():
    assert [p.name for p in patches.PATCHES] == [
        "vllm.config.parallel.current_platform",
        "torch.Event",
        "torch.accelerator.set_device_index",
        "torch.accelerator.current_stream",
        "torch.accelerator.set_stream",
        "torch.accelerator.empty_cache",
        "vllm.distributed.eplb.eplb_state.EplbState.__init__",
        "vllm.config.parallel.ParallelConfig.__post_init__",
        "vllm.distributed.eplb.eplb_communicator.create_eplb_communicator",
        "vllm.distributed.eplb.eplb_state.create_eplb_communicator",
        "vllm.distributed.eplb.eplb_state._commit_eplb_maps_for_layer",
        "vllm.distributed.eplb.eplb_state._commit_eplb_maps",
        "vllm.distributed.eplb.async_worker.transfer_run_periodically",
        "vllm.model_executor.models.deepseek_mtp.fused_moe_make_expert_params_mapping",
        "vllm.v1.worker.gpu.model_runner.EPLBController",
        "vllm.v1.worker.gpu.model_runner.GPUModelRunner.shutdown",
        "vllm.v1.worker.gpu.model_runner.GPUModelRunner.prepare_inputs",
    ]
    assert {p.owner for p in patches.PATCHES} == {
        "ascend_eplb.control.host_adaptation",
        "ascend_eplb.integration.patches",
        "ascend_eplb.control.commit_hooks",
        "ascend_eplb.integration.watchdog",
    }


def test_a_patch_claimed_by_two_owners_is_refused_naming_it():
    # The registry keyed its patches by name: a second owner's patch of the same name silently replaced the
    # first, which was then never installed. The registry is a PatchSet built at import: a binding listed
    # twice fails there, named.
    from ascend_eplb.control import host_adaptation
    from ascend_eplb.control.patching import PatchSet

    first = host_adaptation.PATCHES[0]
    with pytest.raises(ValueError, match="listed more than once") as info:
        PatchSet((*patches.PATCHES, first))
    assert str(info.value) == f"a binding may be patched once; listed more than once: ['{first.name}']"
    assert patches._REGISTRY.patches == patches.PATCHES


def test_each_patch_is_declared_on_its_replacement_and_every_declared_one_is_in_the_registry():
    """Issue 39: the rows named their replacement functions by string, 800 lines away, and each owner
    turned them into patches from its ``globals()``. Each row now decorates its factory: the patch's
    ``replace`` carries it, and no factory of the serving product declares a replacement the registry
    does not install."""
    from ascend_eplb.control.patching import DECLARED_ATTR, patches_of

    assert all(patch in patches_of(patch.replace) for patch in patches.PATCHES)
    assert all(patch.owner == patch.replace.__module__ for patch in patches.PATCHES)
    declared = [
        patch
        for module in _product_modules()
        for value in vars(module).values()
        if getattr(value, "__module__", None) == module.__name__
        and DECLARED_ATTR in getattr(value, "__dict__", {})
        for patch in patches_of(value)
    ]
    assert sorted(p.name for p in declared) == sorted(p.name for p in patches.PATCHES)
    # One factory, two bindings: the communicator factory and its import by name, in the order written.
    assert [p.name for p in patches_of(patches._wrap_factory)] == [
        "vllm.distributed.eplb.eplb_communicator.create_eplb_communicator",
        "vllm.distributed.eplb.eplb_state.create_eplb_communicator",
    ]
    with pytest.raises(TypeError) as info:
        patches_of(patches.check_upstream)
    assert str(info.value) == (
        "ascend_eplb.integration.patches.check_upstream declares no replacement of upstream (decorate it "
        "with its row: replaces(...))"
    )
    with pytest.raises(KeyError, match=r"vllm\.nowhere\.f is not in ascend_eplb\.control\.upstream"):
        upstream.SURFACE.replaces("vllm.nowhere.f", "nothing")

    def _as_stream(original):
        return original

    _as_stream.__module__ = "ascend_eplb.tests"
    with pytest.raises(ValueError, match=r"unknown user\(s\) \['tests'\] of the upstream table"):
        upstream.SURFACE.replaces("torch.accelerator.set_stream", "nothing")(_as_stream)


def test_the_registry_is_what_the_process_really_replaces(clean):
    """apply_patches() rebinds exactly the registry's bindings and nothing else in torch and vLLM: every
    module global and class attribute of every loaded torch/vLLM module (about 175,000) is compared
    before and after, so a binding replaced outside the registry, or an entry that replaces nothing,
    fails; remove_patches() gives every one of them back."""
    for patch in patches.PATCHES:
        importlib.import_module(patch.module)  # the target modules are loaded before the first look
    before = _process_bindings()
    assert patches.apply_patches() is True
    after = _process_bindings()
    replaced = [name for name in before if name in after and after[name] is not before[name]]
    assert sorted(replaced) == sorted(patches.applied_bindings()) == sorted(p.name for p in patches.PATCHES)
    assert sorted(set(after) - set(before)) == []  # nothing bound that was not there
    assert patches.remove_patches() is True
    restored = _process_bindings()
    assert [name for name in before if restored.get(name, _MISSING) is not before[name]] == []


def test_apply_twice_changes_nothing_and_remove_restores(clean):
    before = _bindings()
    assert patches.apply_patches() is True
    after_first = _bindings()
    # Every binding is replaced on this host without an accelerator (control's host adaptation included).
    assert {k for k in before if before[k] is not after_first[k]} == set(before)
    assert patches.applied_bindings() == list(before)
    assert patches.apply_patches() is False
    assert all(after_first[k] is v for k, v in _bindings().items())

    from vllm.config.parallel import current_platform
    from vllm.distributed.eplb import eplb_communicator, eplb_state

    from ascend_eplb.control import commit_hooks_installed

    assert current_platform.is_cuda_alike() is True
    assert commit_hooks_installed()
    original_factory = before["vllm.distributed.eplb.eplb_communicator.create_eplb_communicator"]
    assert eplb_communicator.create_eplb_communicator.__wrapped__ is original_factory
    assert eplb_state.create_eplb_communicator.__wrapped__ is original_factory

    assert patches.remove_patches() is True
    assert all(before[k] is v for k, v in _bindings().items())
    assert not commit_hooks_installed()
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
    factory = ("group_coordinator", "backend", "expert_weights", "expert_buffer")
    _assert_drift(
        patches.apply_patches,
        "vllm.distributed.eplb.eplb_communicator.create_eplb_communicator",
        factory,
        (*factory, "extra"),
    )
    assert all(before[k] is v for k, v in _bindings().items())
    assert patches.patches_applied() is False


def test_a_binding_missing_upstream_is_named(clean, monkeypatch):
    from vllm.distributed.eplb import eplb_state

    monkeypatch.delattr(eplb_state, "_commit_eplb_maps")
    with pytest.raises(
        RuntimeError, match=r"upstream vllm\.distributed\.eplb\.eplb_state\._commit_eplb_maps is missing"
    ):
        patches.apply_patches()
    assert patches.patches_applied() is False
    assert torch.Event.__name__ == "Event"


def test_a_second_use_of_the_platform_in_vllm_config_parallel_is_refused(clean, monkeypatch):
    import inspect

    import vllm.config.parallel as parallel_module

    getsource = inspect.getsource
    source = getsource(parallel_module)
    monkeypatch.setattr(
        inspect,
        "getsource",
        lambda m: (
            source + "\nx = current_platform.is_cuda_alike()\n" if m is parallel_module else getsource(m)
        ),
    )
    with pytest.raises(RuntimeError, match=r"must consult current_platform\.is_cuda_alike\(\) exactly once"):
        patches.apply_patches()
    assert patches.patches_applied() is False


def test_upstream_runner_construction_gets_the_ascend_controller_only_with_eplb_and_a_current_config(clean):
    from types import SimpleNamespace

    import vllm.v1.worker.gpu.model_runner as upstream_runner
    from vllm.config import ParallelConfig
    from vllm.v1.worker.gpu.eplb_utils import EPLBController

    patches.apply_patches()
    off = upstream_runner.EPLBController(ParallelConfig(), torch.device("cpu"))
    assert type(off) is EPLBController  # EPLB off: upstream's class itself
    with pytest.raises(RuntimeError, match=r"built outside vLLM's set_current_vllm_config\(\)"):
        upstream_runner.EPLBController(SimpleNamespace(enable_eplb=True), torch.device("cpu"))
    patches.remove_patches()
    assert upstream_runner.EPLBController is EPLBController


def test_every_upstream_signature_is_listed_once_and_the_replacements_take_theirs_from_the_table():
    table = patches.SURFACE.signatures
    assert all(name == entry.name for name, entry in table.items())
    assert list(table).count("vllm.distributed.eplb.eplb_state.EplbState.__init__") == 1
    entry = table["vllm.distributed.eplb.eplb_state.EplbState.__init__"]
    with pytest.raises(ValueError, match=r"EplbState.__init__ is listed twice"):
        surface_table(entry, Signature(entry.module, entry.qualname, ("self",)))
    # Each patch of a function and each instance binding uses the table's entry, not a copy of it.
    for patch in patches.PATCHES:
        if patch.params is None:
            assert patch.name in ("vllm.config.parallel.current_platform", "torch.Event")
        else:
            assert patch.params == table[patch.name].params, patch.name
    assert all(
        isinstance(b, InstanceBinding) and table[b.name] is b.signature for b in upstream.INSTANCE_BINDINGS
    )
    # The state's binding is the surface's row itself, not a second declaration of it.
    from ascend_eplb.control.state import ACKNOWLEDGEMENT_BINDING

    assert ACKNOWLEDGEMENT_BINDING in patches.INSTANCE_BINDINGS
    assert upstream.SURFACE.instance_binding(ACKNOWLEDGEMENT_BINDING.name) is ACKNOWLEDGEMENT_BINDING
    # No entry is dead: each is replaced, overridden, pinned, or relied on by a module that checks it when
    # it is built or used (movement, which cannot import control, the events file and control.measures,
    # whose restatement of upstream's initial placement the events file uses, rely on the integration's
    # check_upstream).
    replaced = (
        {p.name for p in patches.PATCHES}
        | {b.name for b in upstream.INSTANCE_BINDINGS}
        | {o.signature.name for o in upstream.OVERRIDES}
        | {b.name for b in upstream.BODIES}
    )
    constructors = {
        upstream.CONTROLLER,
        upstream.STATE,
        upstream.COMMIT_HOOKS,
        upstream.INITIAL_PLACEMENT,
        upstream.MOVEMENT,
        integration_upstream.EVENTS,
        upstream.MEASURES,
    }
    assert [n for n, e in table.items() if n not in replaced and not set(e.users) & constructors] == []
    assert all(entry.users for entry in table.values())
    with pytest.raises(
        KeyError, match=r"vllm\.nowhere\.f is not in ascend_eplb\.control\.upstream\.SIGNATURES"
    ):
        upstream.SURFACE.signature("vllm.nowhere.f")


def test_the_registry_checks_the_whole_table_and_names_a_drifted_instance_binding(clean, monkeypatch):
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    patches.check_upstream()  # vLLM 0.33.0 / torch 2.13.0 as installed: nothing drifted

    def _apply_eplb_mapping(self, topk_ids, ubatch):
        raise AssertionError("never called")

    monkeypatch.setattr(BaseRouter, "_apply_eplb_mapping", _apply_eplb_mapping)
    drift = ("BaseRouter._apply_eplb_mapping", ("self", "topk_ids"), ("self", "topk_ids", "ubatch"))
    _assert_drift(patches.check_upstream, *drift)
    before = _bindings()
    _assert_drift(patches.apply_patches, *drift)  # the check runs before the first binding changes
    assert all(before[k] is v for k, v in _bindings().items())
    assert patches.patches_applied() is False


def test_the_checker_names_a_drifted_method_that_is_only_relied_on(clean, monkeypatch):
    from vllm.distributed.eplb.eplb_state import EplbState

    def rearrange(self, is_profile=False, rank_mapping=None):
        raise AssertionError("never called")

    monkeypatch.setattr(EplbState, "rearrange", rearrange)
    _assert_drift(
        patches.check_upstream,
        "EplbState.rearrange",
        ("self", "is_profile", "rank_mapping", "use_last_expert_load"),
        ("self", "is_profile", "rank_mapping"),
    )
    monkeypatch.delattr(EplbState, "rearrange")
    with pytest.raises(
        RuntimeError, match=r"upstream vllm\.distributed\.eplb\.eplb_state\.EplbState\.rearrange is missing"
    ):
        patches.check_upstream()


def test_on_an_accelerator_host_the_state_base_is_still_checked(clean, monkeypatch):
    """A review found that where the host adaptation does not apply (an accelerator is present),
    ``check_upstream`` skipped ``EplbState.__init__``, which the state subclass still relies on; a patch
    target only that patch relies on (``torch.accelerator.is_available``) is still skipped there."""
    import dataclasses

    from vllm.distributed.eplb.eplb_state import EplbState

    from ascend_eplb.control import upstream

    host = [p for p in patches.PATCHES if p.owner == "ascend_eplb.control.host_adaptation"]
    assert {p.name for p in host} >= {"vllm.distributed.eplb.eplb_state.EplbState.__init__"}
    off = {id(p): dataclasses.replace(p, when=lambda: False) for p in host}
    monkeypatch.setattr(patches, "PATCHES", tuple(off.get(id(p), p) for p in patches.PATCHES))

    def drifted_init(self, parallel_config, device, extra):
        raise AssertionError("never called")

    monkeypatch.setattr(EplbState, "__init__", drifted_init)
    drift = (
        "EplbState.__init__",
        ("self", "parallel_config", "device"),
        ("self", "parallel_config", "device", "extra"),
    )
    _assert_drift(patches.check_upstream, *drift)
    monkeypatch.undo()
    table = upstream.SIGNATURES
    only_host = [
        p.name for p in host if p.name in table and set(table[p.name].users) == {upstream.HOST_ADAPTATION}
    ]
    assert only_host  # there are such targets, and with the patches off they are not checked:
    monkeypatch.setattr(patches, "PATCHES", tuple(off.get(id(p), p) for p in patches.PATCHES))
    checked = []
    monkeypatch.setattr(patches, "check_signatures", lambda entries: checked.extend(e.name for e in entries))
    patches.check_upstream()
    assert set(only_host).isdisjoint(checked)
    assert "vllm.distributed.eplb.eplb_state.EplbState.__init__" in checked


def test_a_user_of_the_table_that_does_not_exist_is_refused():
    from ascend_eplb.control import upstream

    with pytest.raises(ValueError, match="unknown user") as info:
        upstream.SURFACE.check("control.contoller")
    assert str(info.value) == (
        f"unknown user(s) ['control.contoller'] of the upstream table; the users are {upstream.USERS!r}"
    )
    with pytest.raises(ValueError, match="unknown user"):
        upstream.SURFACE.used_by("state")
    assert upstream.SURFACE.used_by(upstream.CONTROLLER)  # the controller relies on entries of its own


def test_the_upstream_tables_are_rendered_from_the_rows():
    """Issue 30: the registry's table was docstring prose no test checked; ``UPSTREAM.md`` is the
    rendering of the rows, and every row kind is in it."""
    from pathlib import Path

    from ascend_eplb.integration.surface import render

    doc = Path(__file__).resolve().parents[1] / "UPSTREAM.md"
    text = render()
    assert doc.read_text() == text, "run: python -m ascend_eplb.integration.surface > integration/UPSTREAM.md"
    rows = [
        *(p.name for p in patches.PATCHES),
        *(b.name for b in upstream.INSTANCE_BINDINGS),
        *(o.name.removeprefix("ascend_eplb.") for o in upstream.OVERRIDES),
        *(f"{a.cls}.{a.attr}" for a in patches.SURFACE.attributes),
        *(b.digest for b in upstream.BODIES),
        *patches.SURFACE.signatures,
    ]
    assert [r for r in rows if f"`{r}`" not in text] == []
    assert "| `EPLBController.step` | `37b8a37ca00d9a08` | `control.controller` |" in text
    # Serving's rows only: the CPU world's and the tools' are their packages' own.
    assert "`world." not in text
    assert "`tools." not in text
    assert (
        "| `vllm.distributed.eplb.eplb_state.EplbState.rearrange` | "
        "`(self, is_profile=False, rank_mapping=None, use_last_expert_load=False)` | `control.state` |"
    ) in text


def _product_modules():
    import pkgutil

    names = []
    for package in ("quant_views", "dataplane", "movement", "control", "integration"):
        root = importlib.import_module(f"ascend_eplb.{package}")
        names.append(root.__name__)
        names += [m.name for m in pkgutil.walk_packages(root.__path__, f"{root.__name__}.")]
    return [importlib.import_module(name) for name in names]


def _overriding(cls: type, bases: list[type]) -> set[str]:
    """The attributes ``cls`` defines itself over one of ``bases``: methods, properties, ``__init__``
    (not a dataclass-generated one); other dunders and ABC bookkeeping excluded."""
    names = set()
    for name, value in vars(cls).items():
        if (name.startswith("__") and name != "__init__") or name == "_abc_impl":
            continue
        if not any(name in vars(base) for base in bases):
            continue
        code = getattr(value, "__code__", None)
        if name == "__init__" and code is not None and code.co_filename == "<string>":
            continue  # generated by @dataclass from the fields
        names.add(name)
    return names


def test_every_override_of_an_upstream_class_is_declared():
    """Each class of the serving product that subclasses a vLLM class declares exactly the upstream
    methods it overrides (the movement communicator's of ``EplbCommunicator`` included), and each
    extends upstream's parameters."""
    import inspect

    declared: dict[str, set[str]] = {}
    for row in upstream.OVERRIDES:
        declared.setdefault(row.subclass, set()).add(row.method)
    found: dict[str, set[str]] = {}
    for module in _product_modules():
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "vllm"]
                if bases and (overridden := _overriding(cls, bases)):
                    found[f"{cls.__module__}.{cls.__qualname__}"] = overridden
    # A subclass that overrides nothing of vLLM's (SplitAwarePolicy: its base's methods, one class
    # variable) has no row.
    assert found == declared
    assert "ascend_eplb.control.policy.SplitAwarePolicy" not in found
    upstream.SURFACE.check_rows()


def test_a_repeat_apply_returns_at_once_without_checking_again(clean, monkeypatch):
    """Issue 30: ``apply_patches`` ran ``check_upstream()`` before its installed-already check."""
    assert patches.apply_patches() is True

    def check_upstream():
        raise AssertionError("a repeat call must not check again")

    monkeypatch.setattr(patches, "check_upstream", check_upstream)
    assert patches.apply_patches() is False
    assert patches.patches_applied() is True


def test_check_upstream_names_a_lost_attribute_and_a_changed_body_the_serving_path_relies_on(
    clean, monkeypatch
):
    from vllm.distributed.eplb import eplb_state
    from vllm.distributed.eplb.eplb_state import EplbState

    from ascend_eplb.control.patching import source_digest

    def __init__(self, parallel_config, device):  # noqa: N807 (the name upstream defines)
        self.device_index = None
        self.should_record_tensor = None
        self.model_states = {}
        self.expert_rearrangement_step = 0
        self.expert_rearrangement_step_interval = 0

    monkeypatch.setattr(EplbState, "__init__", __init__)
    with pytest.raises(RuntimeError) as info:
        patches.apply_patches()
    assert str(info.value) == (
        "upstream EplbState.async_worker is missing (integration.watchdog reads it); ascend_eplb must be "
        "updated for this version"
    )
    monkeypatch.undo()

    # The order of invariant 6 lives in upstream's _move_to_workspace: acknowledging before the commit
    # (same signature) is a changed body, refused before anything is patched.
    def _move_to_workspace(model_state, ep_rank):
        result = model_state.pending_result
        model_state.pending_result = None
        result.consumed_event.record()
        eplb_state._commit_eplb_maps_for_layer(
            model_state, result.new_physical_to_logical_map, result.layer_idx
        )

    monkeypatch.setattr(eplb_state, "_move_to_workspace", _move_to_workspace)
    before = _bindings()
    with pytest.raises(RuntimeError) as info:
        patches.apply_patches()
    assert str(info.value).startswith(
        f"upstream vllm.distributed.eplb.eplb_state._move_to_workspace changed its body: source digest "
        f"{source_digest(_move_to_workspace)}, vLLM 0.33.0's is 303b2c6ca50e734e; the per-layer order move, "
        "commit, refresh, acknowledge (invariant 6)"
    )
    assert all(before[k] is v for k, v in _bindings().items())
    assert patches.patches_applied() is False


def _reads(user: str) -> list[str]:
    return [
        f"{a.cls}.{a.attr}" for a in patches.SURFACE.attributes if user in a.users and a.access == "reads"
    ]


def test_the_serving_reads_outside_the_watchdog_are_rows_that_resolve(clean, monkeypatch):
    """Issue 30 item 2: the event file, the verifier and the start-up placement read upstream attributes
    no row declared. Each is a row now; all resolve against vLLM 0.33.0, and a lost one stops serving."""
    from vllm.distributed.eplb import eplb_state

    assert _reads(integration_upstream.EVENTS) == [
        "EPLBController.state",
        "EplbState.model_states",
        "EplbModelState.physical_to_logical_map",
        "EplbModelState.logical_to_physical_map",
        "EplbModelState.communicator",
        "EplbModelState.model",
        "EplbModelState.pending_result",
        "EplbModelState.model_name",
        "AsyncEplbLayerResult.layer_idx",
        "MixtureOfExperts.expert_weights",
    ]
    # The figures of each window and outcome are control's, which reads the window and the grouping.
    assert _reads(upstream.OUTCOME) == [
        "EplbModelState.last_expert_load",
        "EplbModelState.physical_to_logical_map",
        "EplbModelState.eplb_stats",
        "EplbModelState.model_name",
        "EplbStats.num_groups",
        "EplbStats.num_nodes",
    ]
    assert _reads(integration_upstream.VERIFY) == [
        "EPLBController.state",
        "EplbState.model_states",
        "EplbModelState.physical_to_logical_map",
        "EplbModelState.logical_to_physical_map",
        "EplbModelState.logical_replica_count",
        "EplbModelState.model_name",
        "MixtureOfExperts.moe_layers",
    ]
    assert _reads(integration_upstream.STARTUP_PLACEMENT) == [
        "EPLBController.state",
        "EplbState.model_states",
        "EplbModelState.physical_to_logical_map",
        "EplbModelState.logical_to_physical_map",
        "EplbModelState.communicator",
    ]
    patches.SURFACE.check_rows()  # every row resolves
    monkeypatch.setattr(eplb_state, "EplbStats", type("EplbStats", (), {"num_nodes": 1}))
    with pytest.raises(RuntimeError) as info:
        patches.check_upstream()
    assert str(info.value) == (
        "upstream EplbStats.num_groups is missing (control.outcome reads it); ascend_eplb must be updated "
        "for this version"
    )


def test_the_mtp_drafts_redundant_slots_get_their_weights_mapped(clean):
    # vLLM 0.33.0's DeepSeekMTP.load_weights maps checkpoint experts to slots without its
    # num_redundant_experts: with EPLB's redundant slots (E + R physical) slots E .. P - 1 were never
    # loaded (the verifier's fingerprints check refused the draft at registration). Patched, the draft's
    # own count maps every physical slot, exactly as upstream maps the target's.
    import torch
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.models import deepseek_mtp

    draft = torch.nn.Linear(2, 2)
    draft.num_redundant_experts = 2
    args = (draft, "gate_proj", "down_proj", "up_proj", 4)

    def slots(mapping):
        return sorted({expert_id for _, _, expert_id, _ in mapping})

    assert slots(deepseek_mtp.fused_moe_make_expert_params_mapping(*args)) == [0, 1, 2, 3]
    patches.apply_patches()
    mapped = deepseek_mtp.fused_moe_make_expert_params_mapping(*args)
    assert slots(mapped) == [0, 1, 2, 3, 4, 5]
    assert mapped == RoutedExperts.make_expert_params_mapping(*args, num_redundant_experts=2)
    # A caller that passes the count is served unchanged; a model without redundancy maps E slots.
    assert deepseek_mtp.fused_moe_make_expert_params_mapping(*args, num_redundant_experts=1) == (
        RoutedExperts.make_expert_params_mapping(*args, num_redundant_experts=1)
    )
    draft.num_redundant_experts = 0
    assert slots(deepseek_mtp.fused_moe_make_expert_params_mapping(*args)) == [0, 1, 2, 3]
