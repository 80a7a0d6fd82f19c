"""MRv2 wiring: batch phase, the EPLB-off controller, the call sequence and its argument checks."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm

import pytest
import torch

from ascend_eplb.integration import patches
from ascend_eplb.integration.runner import Mrv2EplbWiring, batch_has_prefill, create_eplb_controller


def test_batch_has_prefill():
    assert batch_has_prefill([], []) is False
    assert batch_has_prefill([24, 7], [24, 7]) is False  # every request decoding
    assert batch_has_prefill([24, 0], [24, 7]) is True  # one prompt not computed yet
    assert batch_has_prefill([24, 4], [24, 7]) is True  # chunked prefill in progress
    assert batch_has_prefill([30], [24]) is False  # decode past the prompt
    with pytest.raises(ValueError, match="num_computed_tokens has 2 entries") as info:
        batch_has_prefill([1, 2], [3])
    assert str(info.value) == (
        "num_computed_tokens has 2 entries, num_prompt_tokens 1; they must describe the same requests"
    )


def _config(enable_eplb: bool, use_async: bool = True):
    from vllm.config import EPLBConfig, ParallelConfig, VllmConfig

    vc = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True))
    # Set after construction: upstream's ParallelConfig rejects EPLB on this platform without the patches.
    vc.parallel_config.enable_eplb = enable_eplb
    vc.parallel_config.eplb_config = EPLBConfig(window_size=2, step_interval=4, use_async=use_async)
    return vc


class _MoEFree(torch.nn.Module):
    """A model with no MoE layer."""


def test_eplb_off_builds_upstream_controller_and_patches_nothing(monkeypatch):
    from vllm.v1.worker.gpu.eplb_utils import EPLBController

    patches.remove_patches()
    before = {t.name: t.current() for t in patches.PATCHES}
    vc = _config(enable_eplb=False)
    controller = create_eplb_controller(vc, torch.device("cpu"))
    assert type(controller) is EPLBController
    assert controller.parallel_config is vc.parallel_config
    assert controller.device == torch.device("cpu")
    assert controller.state is None
    assert patches.patches_applied() is False
    assert all(before[t.name] is t.current() for t in patches.PATCHES)

    # The whole sequence on the upstream controller: no phase call (upstream has none), nothing stepped.
    wiring = Mrv2EplbWiring(vc, torch.device("cpu"))
    assert type(wiring.controller) is EPLBController
    assert wiring.load_model(_MoEFree(), object()) is False
    wiring.profile_run()
    wiring.dummy_run()
    wiring.dummy_run(skip_eplb=True)
    wiring.prepare_inputs(True)
    wiring.prepare_forward(object(), 24)
    wiring.after_sampling()
    wiring.shutdown()  # upstream's controller has no end of life: nothing is called
    assert wiring.controller.state is None
    assert [name for name, _ in wiring.calls] == [
        "create_eplb_controller",
        "prepare_load",
        "maybe_register_speculator",
        "maybe_register_model",
        "maybe_start_async_loop",
        "step",
        "step",
        "prepare_forward",
        "step",
    ]
    assert wiring.calls[5:7] == [("step", (True, True)), ("step", (True, False))]
    assert wiring.calls[7][1][1:] == (24, None)
    assert wiring.calls[8] == ("step", ())
    # A runner whose dispatch names the batch's MoE rows: upstream's controller is called without them
    # (a review found it raised TypeError from upstream instead).
    wiring.prepare_forward(object(), 8, moe_rows="split")
    assert wiring.calls[9][0] == "prepare_forward"
    assert wiring.calls[9][1][1:] == (8, None)
    assert patches.patches_applied() is False


def test_load_with_dummy_weights_registers_nothing_and_bad_token_counts_are_rejected():
    wiring = Mrv2EplbWiring(_config(enable_eplb=False), torch.device("cpu"))
    assert wiring.load_model(_MoEFree(), object(), load_dummy_weights=True) is False
    assert wiring.calls == [
        ("create_eplb_controller", ()),
        ("prepare_load", ()),
        ("maybe_register_speculator", (None, None, True)),
        ("maybe_start_async_loop", (False, True)),
    ]
    for bad in (-1, 2.0, "24", True):
        with pytest.raises(ValueError, match="must be an int >= 0") as info:
            wiring.prepare_forward(object(), bad)
        assert str(info.value) == f"num_unpadded_tokens={bad!r} must be an int >= 0"
    assert len(wiring.calls) == 4  # nothing was called


def test_invalid_eplb_config_raises_before_any_patch(monkeypatch):
    from ascend_eplb.integration.validation import EplbConfigError

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    patches.remove_patches()
    before = {t.name: t.current() for t in patches.PATCHES}
    with pytest.raises(EplbConfigError) as info:
        create_eplb_controller(_config(enable_eplb=True, use_async=False), torch.device("cpu"))
    assert [v.rule for v in info.value.violations] == ["async-only"]
    assert patches.patches_applied() is False
    assert all(before[t.name] is t.current() for t in patches.PATCHES)


def test_every_bad_serving_switch_is_named_at_once_before_any_patch(monkeypatch):
    """Start-up names every bad switch in one error (as it names every violated rule), before patching;
    ``ascend-eplb check`` reports the same lines (``guardrail_facts.serving_switch_errors``)."""
    from ascend_eplb.integration.guardrail_facts import serving_switch_errors

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setenv("ASCEND_EPLB_WORKER_TIMEOUT_S", "-1")
    monkeypatch.setenv("ASCEND_EPLB_EVENTS", "/")  # a folder, not a file
    patches.remove_patches()
    before = {t.name: t.current() for t in patches.PATCHES}
    with pytest.raises(ValueError, match="ASCEND_EPLB_WORKER_TIMEOUT_S='-1'") as info:
        create_eplb_controller(_config(enable_eplb=True), torch.device("cpu"))
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert lines[0] == "ASCEND_EPLB_WORKER_TIMEOUT_S='-1': must be a finite number of seconds > 0"
    assert lines[1].startswith("ASCEND_EPLB_EVENTS=")
    assert serving_switch_errors() == lines
    assert patches.patches_applied() is False
    assert all(before[t.name] is t.current() for t in patches.PATCHES)


def test_shutdown_runs_the_watchdogs_end_of_life_once_from_the_wiring_and_from_upstreams_runner(monkeypatch):
    """Point 10: ``Mrv2EplbWiring.shutdown`` and the patched ``GPUModelRunner.shutdown`` both reach the
    controller's shutdown event (the watchdog's :meth:`at_shutdown`), once, before upstream's shutdown."""
    from types import SimpleNamespace

    from ascend_eplb.control import AscendEPLBController, ShutdownEvent
    from ascend_eplb.integration.watchdog import WorkerWatchdog

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    try:
        wiring = Mrv2EplbWiring(_config(enable_eplb=True), torch.device("cpu"))
        controller = wiring.controller
        assert type(controller) is AscendEPLBController
        (hook,) = controller.bus.subscribers(ShutdownEvent)
        assert isinstance(hook.__self__, WorkerWatchdog)
        assert hook.__func__ is WorkerWatchdog.at_shutdown
        seen = []
        controller.bus.subscribe(ShutdownEvent, lambda e: seen.append(("hook", e.controller)))
        wiring.shutdown()
        wiring.shutdown()
        assert seen == [("hook", controller)]  # once: the second shutdown does nothing
        assert [name for name, _ in wiring.calls][-2:] == ["shutdown", "shutdown"]

        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner.shutdown" in patches.applied_bindings()
        assert GPUModelRunner.shutdown.__wrapped__.__qualname__ == "GPUModelRunner.shutdown"
        order = []
        patched = patches._wrap_runner_shutdown(lambda runner: order.append("upstream shutdown"))

        def failing_hook(event):
            order.append("controller shutdown")
            raise RuntimeError("hook failed")

        other = AscendEPLBController(_config(enable_eplb=True).parallel_config, torch.device("cpu"))
        other.bus.subscribe(ShutdownEvent, failing_hook)
        with pytest.raises(RuntimeError, match="hook failed"):
            patched(SimpleNamespace(eplb=other))
        assert order == ["controller shutdown", "upstream shutdown"]  # upstream's shutdown runs anyway
        patched(SimpleNamespace(eplb=object()))  # upstream's controller (EPLB off) has no shutdown
        assert order == ["controller shutdown", "upstream shutdown", "upstream shutdown"]
    finally:
        patches.remove_patches()


def test_the_patched_prepare_inputs_declares_the_batch_phase_before_upstreams():
    """Upstream's Model Runner V2 never calls ``set_batch_phase``: the patch of ``GPUModelRunner.
    prepare_inputs`` declares upstream's ``BatchReqState.has_prefill`` (a numpy bool there) to a controller
    with phases before upstream's preparation runs; upstream's controller (EPLB off) is left alone."""
    from types import SimpleNamespace

    import numpy as np

    from ascend_eplb.control import AscendEPLBController

    controller = AscendEPLBController(
        _config(enable_eplb=True).parallel_config, torch.device("cpu"), "prefill"
    )
    runner = SimpleNamespace(eplb=controller)
    seen = []

    def upstream(runner, scheduler_output, batch_req_state, batch_desc, num_active_loras):
        seen.append((controller.phase_matched(), scheduler_output, batch_desc, num_active_loras))
        return "input batch"

    patched = patches._wrap_runner_prepare_inputs(upstream)
    for has_prefill, matched in ((np.True_, True), (np.False_, False)):
        batch = SimpleNamespace(has_prefill=has_prefill)
        assert patched(runner, "scheduler output", batch, "descriptor", 0) == "input batch"
        assert seen[-1] == (matched, "scheduler output", "descriptor", 0)
    assert controller.load_collection_phase == "prefill"
    with pytest.raises(ValueError, match="batch_has_prefill=1 must be a bool"):
        controller.set_batch_phase(1)  # the patch converts upstream's value; a runner's own call is checked
    # Upstream's controller (EPLB off) has no phases: upstream's preparation alone.
    from vllm.v1.worker.gpu.eplb_utils import EPLBController

    plain = SimpleNamespace(
        eplb=EPLBController(_config(enable_eplb=False).parallel_config, torch.device("cpu"))
    )
    assert (
        patched(plain, "scheduler output", SimpleNamespace(has_prefill=True), "descriptor", 0)
        == "input batch"
    )
