"""``ascend-eplb simulate --initial-placement FILE``: every refusal before a rank starts. Record -> plan ->
serve from the placement on vLLM's engine is test_simulate_mtp's (simulate, both models) and
tests/test_engine_initial_placement's (the serving path alone)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from ascend_eplb.integration import placement_file as pf
from ascend_eplb.tools import cli
from ascend_eplb.tools.simulate.config import SimulateConfig
from ascend_eplb.tools.simulate.driver import run_simulation

#: The replay world on 2 of the embedded trace's layers (64 experts), 2 ranks, 2 redundant experts.
REPLAY = ["simulate", "--model", "replay", "--ranks", "2", "--redundant-experts", "2", "--layers", "2",
          "--steps", "12", "--window-size", "2", "--step-interval", "4", "--no-progress"]  # fmt: skip
ROW = [*range(64), 0, 1]


def _placement(tmp_path, rows, experts=64, ranks=2, name="placement.json"):
    path = tmp_path / name
    pf.write_placement(path, pf.placement_from_map(rows, num_logical_experts=experts, num_ranks=ranks))
    return path


def test_a_placement_for_another_model_or_layout_is_refused_before_any_rank_starts(tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        (_placement(tmp_path, [ROW] * 3, name="layers.json"), "num_moe_layers: the file's 3, the model's 2"),
        (
            _placement(tmp_path, [[*range(32), 0, 1]] * 2, experts=32, name="experts.json"),
            "num_logical_experts: the file's 32, the model's 64",
        ),
        (
            _placement(tmp_path, [[*ROW, 2, 3]] * 2, name="redundant.json"),
            "num_physical_experts: the file's 68 (num_redundant_experts 4), the model's 66 "
            "(num_redundant_experts 2)",
        ),
        (
            _placement(tmp_path, [ROW] * 2, ranks=1, name="ranks.json"),
            "num_ranks: the file's 1, the model's 2",
        ),
    ]
    for path, differ in cases:
        assert cli.main([*REPLAY, "--out", str(out), "--initial-placement", str(path)]) == 2
        err = capsys.readouterr().err
        assert (
            "ascend-eplb simulate: error: invalid simulate options:\n  - eplb_config.initial_placement="
            in err
        )
        assert differ in err, err
    truncated = tmp_path / "truncated.json"
    truncated.write_text(_placement(tmp_path, [ROW] * 2).read_text()[:300])
    assert cli.main([*REPLAY, "--out", str(out), "--initial-placement", str(truncated)]) == 2
    err = capsys.readouterr().err
    assert f"  - initial placement={truncated}: not JSON: " in err
    assert "(the file ends early: truncated?)" in err
    with pytest.raises(SystemExit) as stopped:  # the option's type refuses it while parsing
        cli.main([*REPLAY, "--out", str(out), "--initial-placement", ""])
    assert stopped.value.code == 2
    assert (
        "argument --initial-placement: '': an empty path; name the file or folder" in capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="initial placement='': an empty path; name the file or folder"):
        run_simulation(
            SimulateConfig(model="replay", num_moe_layers=2, initial_placement="", out_dir=str(out))
        )
    assert not out.exists()  # refused before anything was written
