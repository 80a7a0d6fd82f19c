"""The vllm.general_plugins entry point: discoverable, idempotent, and inert with EPLB off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

from ascend_eplb.integration.plugin import eplb_requested, register

PLANES = [
    "ascend_eplb.control",
    "ascend_eplb.dataplane",
    "ascend_eplb.movement",
    "ascend_eplb.quant_views",
    "ascend_eplb.integration.patches",
    "ascend_eplb.integration.model_facts",
    "ascend_eplb.integration.rules",
    "ascend_eplb.integration.settings",
    "ascend_eplb.integration.validation",
]

_PROBE = r"""
import json, os, sys
from importlib.metadata import entry_points

def patched():
    import torch
    import vllm.config.parallel as parallel
    from vllm.distributed.eplb import eplb_communicator, eplb_state
    marker = "_ascend_eplb_patch"
    return {
        "platform": type(parallel.current_platform).__name__,
        "post_init": getattr(parallel.ParallelConfig.__post_init__, marker, None),
        "factory": getattr(eplb_communicator.create_eplb_communicator, marker, None),
        "factory_in_state": getattr(eplb_state.create_eplb_communicator, marker, None),
        "event": torch.Event.__name__,
        "commit_hook": getattr(eplb_state._commit_eplb_maps_for_layer, marker, None),
    }

def planes():
    ours = (m for m in sys.modules if m.startswith("ascend_eplb."))
    return sorted(m for m in ours if not m.startswith("ascend_eplb.world"))

def world():
    return sorted(m for m in sys.modules if m.startswith("ascend_eplb.world"))

# Phase 1, EPLB not requested: the entry point as vLLM finds it, called by hand and by vLLM's loader.
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "ascend_eplb"]
register = ep.load()
off = {"first": register()}
off["loaded"] = sorted(m for m in sys.modules if m.startswith(("ascend_eplb.", "vllm")))
off["second"] = register()
import vllm.plugins
vllm.plugins.load_general_plugins()  # vLLM's own loader calls the entry point again
# A runner built with EPLB off: upstream's controller, nothing validated, patched or imported.
import torch
from vllm.config import ParallelConfig, VllmConfig
from ascend_eplb.integration.runner import create_eplb_controller
controller = create_eplb_controller(VllmConfig(parallel_config=ParallelConfig()), torch.device("cpu"))
off["controller"] = [type(controller).__module__, type(controller).__qualname__, controller.state]
off["patched"] = patched()
off["planes"] = planes()
off["world"] = world()
# Phase 2, same process, EPLB requested (as an engine or worker started with ASCEND_EPLB=1).
os.environ["ASCEND_EPLB"] = "1"
on = {"first": register(), "second": register()}
vllm.plugins.plugins_loaded = False
vllm.plugins.load_general_plugins()  # and once more through vLLM's loader
on["third"] = register()
on["patched"] = patched()
on["planes"] = planes()
print(json.dumps({"off": off, "on": on}))
"""


def _probe() -> dict:
    """One fresh interpreter: EPLB off first, then on (one vLLM import for both)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_EPLB", "VLLM_PLUGINS")}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=240, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_is_discoverable():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "ascend_eplb"]
    assert ep.value == "ascend_eplb.integration.plugin:register"
    assert ep.load() is register


def test_eplb_request_comes_from_env_or_command_line():
    assert eplb_requested({"ASCEND_EPLB": "1"}, []) is True
    assert eplb_requested({"ASCEND_EPLB": "true"}, []) is True
    assert eplb_requested({"ASCEND_EPLB": "0"}, []) is False
    assert eplb_requested({}, ["vllm", "serve", "m", "--enable-eplb"]) is True
    assert eplb_requested({}, ["vllm", "serve", "m", "--enable-eplb=false"]) is False
    assert eplb_requested({}, ["vllm", "serve", "m", "--enable-expert-parallel"]) is False


def test_the_one_truthy_parsing_of_a_switch():
    from ascend_eplb.integration.switches import TRUE_VALUES, is_true

    assert TRUE_VALUES == ("1", "true", "yes", "on")
    for value in ("1", "true", "TRUE", " Yes ", "on\n"):
        assert is_true(value) is True, value
    for value in (None, "", "0", "false", "off", "no", "2", "truthy", "y"):
        assert is_true(value) is False, value
    # its users read it: the entry point, and start-up validation's V1 switches
    assert eplb_requested({"ASCEND_EPLB": " ON "}, []) is True
    assert eplb_requested({}, ["vllm", "serve", "m", "--enable-eplb=Yes"]) is True


def test_eplb_off_isolation_then_register_with_eplb_on_patches_once_and_is_idempotent():
    """One subprocess (one test, so xdist cannot split it): EPLB-off facts first, then EPLB on."""
    probe = _probe()
    result = probe["off"]
    assert result["first"] is False
    assert result["second"] is False
    # Nothing beyond the entry point's own module and its truthy parsing (both standard library only)
    # was imported by register().
    assert result["loaded"] == [
        "ascend_eplb.integration",
        "ascend_eplb.integration.__about__",
        "ascend_eplb.integration.plugin",
        "ascend_eplb.integration.switches",
    ]
    assert result["patched"] == {
        "platform": "CpuPlatform",
        "post_init": None,
        "factory": None,
        "factory_in_state": None,
        "event": "Event",
        "commit_hook": None,
    }
    assert result["controller"] == ["vllm.v1.worker.gpu.eplb_utils", "EPLBController", None]
    assert result["planes"] == [
        "ascend_eplb.integration",
        "ascend_eplb.integration.__about__",
        "ascend_eplb.integration.plugin",
        "ascend_eplb.integration.runner",
        "ascend_eplb.integration.switches",
    ]
    assert not [m for m in result["planes"] if m.startswith(tuple(PLANES))]
    # The test world's own entry point (installed in this environment, not in a serving image), which
    # vLLM's loader calls too: without its opt-in it loads its light modules and returns.
    assert result["world"] == [
        "ascend_eplb.world",
        "ascend_eplb.world.__about__",
        "ascend_eplb.world.engine",
        "ascend_eplb.world.engine.environment",
        "ascend_eplb.world.engine.plugin",
    ]

    result = probe["on"]
    assert result["first"] is True
    assert result["second"] is True
    assert result["third"] is True
    assert result["patched"] == {
        "platform": "EplbCapablePlatform",
        "post_init": "ascend_eplb.integration.patches",
        "factory": "ascend_eplb.integration.patches",
        "factory_in_state": "ascend_eplb.integration.patches",
        "event": "HostEvent",
        "commit_hook": "ascend_eplb.control.commit_hooks",
    }
    assert "ascend_eplb.control" in result["planes"]
