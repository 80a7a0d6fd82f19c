"""Cross-package end to end: the installed ``ascend-eplb`` console script, as a user runs it.

One short ``simulate`` run (vLLM's engine with 2 workers, EPLB off then on, through every plane) and
``check`` on a valid and an invalid config file. The script is the one pip installed beside this
interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_eplb.testing.configs import VALID_EPLB_CONFIG

SCRIPT = Path(sys.executable).with_name("ascend-eplb")
ENV = os.environ | {"VLLM_TARGET_DEVICE": "cpu", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
GOOD = VALID_EPLB_CONFIG


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    assert SCRIPT.is_file(), f"console script not installed: {SCRIPT}"
    return subprocess.run([str(SCRIPT), *args], env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_console_script_simulate_passes_every_check(tmp_path):
    out = tmp_path / "sim"
    proc = _run(
        "simulate", "--ranks", "2", "--redundant-experts", "2", "--batch-size", "16", "--format", "bf16",
        "--steps", "8", "--window-size", "1", "--step-interval", "2", "--no-progress", "--out", str(out),
        timeout=800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["checks"] == dict.fromkeys(("outputs", "fingerprints", "lookups", "load", "worker"), True)
    assert report["passed"] is True
    # The default model: vLLM's DeepseekV3ForCausalLM on the preset checkpoint (4 MoE layers, written in
    # bf16), served by vLLM's engine: 16 requests x 8 tokens, EPLB off and on.
    assert (report["model"], report["ranks"], report["layers"]) == ("DeepseekV3ForCausalLM", 2, 4)
    assert report["engine_off"]["tokens"] == report["engine_on"]["tokens"] == 16 * 8
    assert report["rearrangements"] >= 1
    assert report["layers_committed"] >= 2
    # A real model's 16-bit experts are compared within 16 units of their roundoff (bf16: 16 x 2^-8).
    assert report["format"] == "bf16"
    assert report["output_tolerance"] == {"rtol": 16 * 2.0**-8, "atol": 1e-6}
    worst = report["max_output_error"]
    assert report["check_evidence"]["outputs"].endswith(
        f"(max error {worst:.3g}, tolerance 1e-06 + 0.0625 x max|reference|)"
    )
    assert "PASS  outputs" in proc.stdout
    assert "PASSED in" in proc.stdout
    assert (out / "balancedness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_console_script_check_good_and_bad_config(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(GOOD))
    broken = json.loads(json.dumps(GOOD))
    broken["parallel_config"]["eplb_config"]["num_redundant_experts"] = 3
    bad.write_text(json.dumps(broken))
    ok = _run("check", str(good), timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "num_physical_experts: 66" in ok.stdout
    rejected = _run("check", str(bad), timeout=120)
    assert rejected.returncode == 2, rejected.stdout + rejected.stderr
    assert "[experts-divisible]" in rejected.stdout
    assert "(64) + num_redundant_experts (3) = 67 physical experts is not divisible" in rejected.stdout


def test_console_script_plan_warns_in_one_line_of_a_truncated_last_events_line(tmp_path):
    """A new user found the skipped line printed as a raw Python warning with its source line."""
    window = json.dumps(
        {
            "event": "window",
            "time": 0.0,
            "step": 1,
            "model": "m",
            "rearrangement": 1,
            "load": [[1, 2], [3, 4]],
            "balancedness": 1.0,
            "balancedness_eplb_off": 1.0,
        }
    )
    events = tmp_path / "events.jsonl"
    events.write_text(window + "\n" + window[:30])
    run = _run("plan", str(events), "--ranks", "2", timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        f"ascend-eplb plan: warning: {events}:2: truncated last line skipped (Expecting ',' delimiter)"
    ]


#: Stands in for the console script under ``sh -c``: says it runs, then exits 130 on Ctrl-C (as
#: ``ascend-eplb`` does: ``packages/eplb-tools/tests/test_stops.py``).
STAND_IN = """#!{python}
import signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
print("running", flush=True)
time.sleep(60)
"""


def test_ctrl_c_under_hatch_run_simulate_reaches_hatch_as_the_commands_130(tmp_path):
    """Issue 38: Ctrl-C under ``hatch run simulate`` exited 254, not the README's 130. hatch runs a script
    through ``sh -c`` and exits with the shell's return code; dash, sent SIGINT while it waits for its
    child, kills itself with SIGINT whatever the child returned (-2, which hatch's ``sys.exit`` makes
    254). The workspace's ``simulate`` script ``exec``s the command, so the shell is the command and its
    130 is what hatch sees. Run here as hatch runs it, Ctrl-C sent to the process group as a terminal
    does."""
    import signal
    import tomllib

    root = Path(__file__).resolve().parents[1]
    script = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["hatch"]["envs"]["default"]
    line = script["scripts"]["simulate"].replace("{args}", "--no-progress")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "ascend-eplb"
    stand_in.write_text(STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    env = os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    shell = subprocess.Popen(
        ["/bin/sh", "-c", line], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert shell.stdout.readline() == "running\n"
    os.killpg(shell.pid, signal.SIGINT)
    assert shell.wait(timeout=30) == 130
