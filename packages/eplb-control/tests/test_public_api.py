"""The public names of ascend_eplb.control, and that its vLLM-free modules import without vLLM."""

import subprocess
import sys

from ascend_eplb.testing.api import check_public_names


def test_each_public_name_is_the_packages_own():
    # Each name is the object a control module defines or binds; __version__ is the installed one.
    check_public_names("ascend_eplb.control", "ascend-eplb-control")


def test_phase_patching_and_measures_import_without_vllm():
    code = (
        "import sys, torch; import ascend_eplb.control as c; "
        "from ascend_eplb.control import measures, phase, patching, policy_config; "
        "assert c.is_phase_matched('decode', False); assert c.PolicySettings().is_upstream_default; "
        "assert c.balancedness(torch.ones(1, 2), torch.tensor([[0, 1]]), 2).tolist() == [1.0]; "
        "print(sorted(m for m in sys.modules if m.startswith('vllm')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_standard_library_modules_import_without_torch():
    # ascend-eplb check and start-up's rules read the settings through these before torch is needed.
    code = (
        "import sys; import ascend_eplb.control as c; "
        "from ascend_eplb.control import bus, patching, phase, policy_config; "
        "assert c.PolicySettings().is_upstream_default; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
