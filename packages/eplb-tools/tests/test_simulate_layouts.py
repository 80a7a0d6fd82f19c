"""`ascend-eplb simulate --dp N --tp M` (issue 29): the DP x TP layouts of vLLM's real model classes.

The options' rules (no process started), the real rows of each layout's gathered batch the ``load``
check counts, and one run at DP=2 x TP=2 (sequence-parallel MoE, ``gathered-sp``) on a model folder with
every check on.
"""

from __future__ import annotations

import pytest

from ascend_eplb.tools.cli import build_parser, main
from ascend_eplb.tools.simulate.config import SimulateConfig, config_from_args
from ascend_eplb.tools.simulate.driver import run_simulation
from ascend_eplb.world.checkpoints import write_checkpoint


def _config(*argv: str) -> SimulateConfig:
    return config_from_args(build_parser().parse_args(["simulate", *argv]))


def test_the_ranks_are_dp_x_tp_and_a_layout_that_does_not_fit_is_refused_before_any_process(tmp_path, capsys):
    assert (_config("--dp", "2", "--tp", "2").num_ranks, _config("--dp", "2", "--tp", "1").num_ranks) == (
        4,
        2,
    )
    default = _config("--dp", "2")  # --ranks' default 2, TP = 2 / 2
    assert (default.num_ranks, default.data_parallel_size, default.tp_size) == (2, 2, 1)
    assert (_config().tp_size, _config().data_parallel_size) == (2, 1)
    out = str(tmp_path / "o")
    cases = [
        (
            ["--dp", "2", "--tp", "1", "--ranks", "4"],
            "ranks=4 with dp=2 x tp=1: the ranks must be dp x tp = 2",
        ),
        (["--dp", "3", "--ranks", "4"], "dp=3: must divide ranks=4 (ranks = dp x tp)"),
        (
            ["--model", "replay", "--dp", "2"],
            "dp=2, tp=None: apply to a real model; --model replay runs the split layout (each rank routes "
            "rows of its own, vLLM Ascend's MC2)",
        ),
    ]
    for argv, message in cases:
        assert main(["simulate", *argv, "--out", out]) == 2, argv
        assert f"  - {message}" in capsys.readouterr().err.splitlines()
    assert not (tmp_path / "o").exists()


@pytest.mark.multirank
def test_simulate_serves_a_model_folder_at_dp2_x_tp2_with_every_check(tmp_path):
    """A Qwen3-MoE folder at DP=2 x TP=2 through vLLM's DP engine: its CPU experts route each rank's own
    rows before dispatch (``split`` rows, as control reads vLLM's own dispatch decision); the load check
    counts each DP rank's real tokens once (its TP ranks', a dummy batch none), the outputs equal the
    EPLB-off engine's."""
    folder = write_checkpoint("qwen3-moe", tmp_path / "model", seed=0)
    config = SimulateConfig(
        model=str(folder), num_ranks=4, data_parallel_size=2, tensor_parallel_size=2, num_redundant_experts=4,
        batch_size=12, steps=16, window_size=2, step_interval=6, progress=False, timeout_s=600,
        out_dir=str(tmp_path / "out"),
    )  # fmt: skip
    report = run_simulation(config).to_json()
    assert report["passed"], report["first_violation"]
    assert report["checks"] == dict.fromkeys(("outputs", "load", "fingerprints", "lookups", "worker"), True)
    layout = (
        report["data_parallel_size"],
        report["tensor_parallel_size"],
        report["ranks"],
        report["moe_rows"],
        report["compilation"],
    )
    assert layout == (2, 2, 4, "split", "eager (enforce_eager)")
    assert report["rearrangements_completed"] >= 2
    assert report["max_output_error"] <= 1e-5
    evidence = report["check_evidence"]["load"]
    assert f" of {report['steps']} steps recorded load: " in evidence, evidence
    assert "real selections, each counted once, padding never" in evidence, evidence
