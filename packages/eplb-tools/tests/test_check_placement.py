"""``ascend-eplb check`` judges ``eplb_config.initial_placement`` against a model folder as start-up does:
the rule ``initial-placement`` (the one start-up runs) with the folder's MoE layers and routed experts."""

from __future__ import annotations

import json
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from ascend_eplb.integration import placement_file as pf
from ascend_eplb.tools import cli
from ascend_eplb.tools.check import check_config_file, check_serve_command
from ascend_eplb.tools.check.model_folder import model_folder_facts

#: 8 routed experts, 4 redundant, over TP 2 x DP 2 = 4 EP ranks (3 slots each).
ARGS = ["--enable-eplb", "-tp", "2", "--data-parallel-size", "2", "--enable-expert-parallel",
        "--eplb-config", '{"num_redundant_experts": 4}', "--enforce-eager"]  # fmt: skip
ROW = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]


def _folder(tmp_path):
    folder = tmp_path / "Qwen3-MoE-tiny"
    folder.mkdir()
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
        "num_experts_per_tok": 2, "torch_dtype": "bfloat16",
        "num_hidden_layers": 3, "mlp_only_layers": [0], "decoder_sparse_step": 1,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _placement(tmp_path, layers, name="placement.json"):
    path = tmp_path / name
    pf.write_placement(path, pf.placement_from_map([ROW] * layers, num_logical_experts=8, num_ranks=4))
    return path


def _serve(folder, placement, *extra, **kw):
    config = json.dumps({"eplb_config": {"initial_placement": str(placement)}})
    return check_serve_command(["serve", str(folder), *ARGS, *extra, "--additional-config", config], {}, **kw)


def test_a_placement_made_for_the_folders_model_passes_and_one_for_another_is_named(tmp_path):
    folder = _folder(tmp_path)
    assert model_folder_facts(folder).num_moe_layers == 2  # layer 0 is dense
    ok = _serve(folder, _placement(tmp_path, 2))
    assert (ok.ok, ok.verdict, ok.unjudged) == (True, "OK", ()), ok.report
    wrong = _placement(tmp_path, 3, "three-layers.json")
    bad = _serve(folder, wrong)
    assert [v.rule for v in bad.violations] == ["initial-placement"]
    assert bad.violations[0].message == (
        f"eplb_config.initial_placement={wrong}: made for 3 MoE layers x 8 logical experts, 12 slots on 4 EP "
        "ranks, not this model and layout: num_moe_layers: the file's 3, the model's 2; fix: export a "
        "placement for this model and layout (ascend-eplb plan --export-expert-map) or remove "
        "initial_placement"
    )
    # Another redundancy level: the slots differ, with both redundant counts.
    other = _serve(folder, _placement(tmp_path, 2), "--eplb-config", '{"num_redundant_experts": 8}')
    assert (
        "num_physical_experts: the file's 12 (num_redundant_experts 4), the model's 16 "
        "(num_redundant_experts 8)" in other.violations[0].message
    )
    # A placement that drops an expert, through the same rule.
    dropped = _placement(tmp_path, 2, "dropped.json")
    doc = json.loads(dropped.read_text())
    doc["layer_list"][0]["device_list"][2]["device_expert"] = [6, 6, 0]
    dropped.write_text(json.dumps(doc))
    assert _serve(folder, dropped).violations[0].message == (
        f"eplb_config.initial_placement={dropped}: layer 0: logical expert(s) [7] hold no slot (1 of 8); "
        "every logical expert needs at least one; fix: name a placement file of ascend-eplb plan "
        "--export-expert-map (or an events file with a committed placement)"
    )


def test_without_a_model_folder_the_layers_cannot_be_judged(tmp_path):
    placement = _placement(tmp_path, 2)
    result = _serve("Qwen/Qwen3-30B-A3B", placement, num_experts=8, quantization="bf16")
    assert result.violations == ()
    assert [str(u) for u in result.unjudged] == [
        "cannot judge: initial-placement: the MoE layer count is unknown (model 'Qwen/Qwen3-30B-A3B' is not "
        "a local folder: config.json's num_hidden_layers); pass a local model folder as MODEL"
    ]
    # The config file schema states it as model.num_moe_layers.
    config = {
        "parallel_config": {
            "enable_eplb": True, "enable_expert_parallel": True, "tensor_parallel_size": 4,
            "eplb_config": {"num_redundant_experts": 4},
        },
        "additional_config": {"eplb_config": {"initial_placement": str(placement)}},
        "model": {"num_logical_experts": 8, "num_moe_layers": 2, "quantization": "bf16"},
        "compilation_config": {"cudagraph_mode": "NONE"},
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert check_config_file(path, environ={}).verdict == "OK"
    config["model"]["num_moe_layers"] = 4
    path.write_text(json.dumps(config))
    assert "num_moe_layers: the file's 2, the model's 4" in check_config_file(path, environ={}).report


def test_the_check_command_prints_the_refusal_of_a_truncated_file(tmp_path, capsys):
    folder = _folder(tmp_path)
    truncated = _placement(tmp_path, 2)
    truncated.write_text(truncated.read_text()[:200])
    config = json.dumps({"eplb_config": {"initial_placement": str(truncated)}})
    assert cli.main(["check", "--", "serve", str(folder), *ARGS, "--additional-config", config]) == 2
    out = capsys.readouterr().out
    assert f"[initial-placement] eplb_config.initial_placement={truncated}: not JSON: " in out
    assert "(the file ends early: truncated?)" in out
