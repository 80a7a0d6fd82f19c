"""`ascend-eplb check`: the file schema, a `vllm serve --config` YAML, and a command line after `--`."""

from __future__ import annotations

import json

from ascend_eplb.tools.cli import main

ARGS = [
    "--enable-eplb", "-tp", "2", "--data-parallel-size", "2", "--enable-expert-parallel",
    "--eplb-config", '{"num_redundant_experts": 4}',
]  # fmt: skip


def _model(tmp_path, experts=64):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"n_routed_experts": experts, "torch_dtype": "bfloat16"}))
    (folder / "quant_model_description.json").write_text(
        json.dumps({"model.layers.3.mlp.experts.7.up_proj.weight": "W8A8_DYNAMIC"})
    )
    return folder


def test_command_line_after_dashes_with_a_model_folder_is_ok(tmp_path, capsys):
    folder = _model(tmp_path)
    code = main(["check", "--", "serve", str(folder), *ARGS, "--enforce-eager", "--quantization", "ascend"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    first, second = out.splitlines()[:2]
    assert first.startswith(f"ascend-eplb check: vllm serve {folder} --enable-eplb -tp 2 ")
    assert first.endswith("--quantization ascend: OK")
    assert second == "ok"
    assert "  num_local_physical_experts: 17" in out.splitlines()
    assert "  quantization: w8a8_dynamic" in out.splitlines()


def test_command_line_graph_default_and_unjudged_rules(capsys):
    code = main(["check", "--", "serve", "deepseek-ai/DeepSeek-V3", *ARGS])
    out, _ = capsys.readouterr()
    assert code == 2
    assert out.splitlines()[0].endswith(": INVALID")
    assert out.splitlines()[1:3] == [
        "1 EPLB configuration rule(s) violated:",
        "  - [graph-capture] graph capture (cudagraph_mode=FULL_AND_PIECEWISE) is not validated with Ascend "
        "EPLB yet (the lookup's in-place refresh under graph replay has no test); fix: run eager "
        "(--enforce-eager)",
    ]
    model = "deepseek-ai/DeepSeek-V3"
    code = main(["check", "--num-experts", "64", "--", "serve", model, *ARGS, "--enforce-eager"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert out.splitlines()[0].endswith(": OK (1 rule could not be judged)")
    assert out.splitlines()[-1] == (
        "cannot judge: quantization: the checkpoint's dtype is unknown (dtype=auto, model "
        "'deepseek-ai/DeepSeek-V3' is not a local folder); pass --quantization FORMAT (before the --) or a "
        "local model folder as MODEL"
    )


def test_unknown_flag_is_rejected_by_vllms_parser_with_exit_2(capsys):
    code = main(["check", "--", "serve", "deepseek-ai/DeepSeek-V3", "--enable-eplb", "--no-such-flag", "3"])
    out, _ = capsys.readouterr()
    assert code == 2
    assert out.splitlines()[1:] == [
        "1 EPLB configuration rule(s) violated:",
        "  - [engine-args] the command line: vLLM's parser rejects the engine arguments: vllm: error: "
        "unrecognized arguments: --no-such-flag 3",
    ]


def test_serve_config_yaml_and_the_config_flag(tmp_path, capsys):
    folder = _model(tmp_path, experts=62)
    yaml = tmp_path / "serve.yaml"
    yaml.write_text(
        f"model: {folder}\nenable-eplb: true\nenable_expert_parallel: true\ntensor-parallel-size: 4\n"
        "enforce-eager: true\neplb-config: '{\"num_redundant_experts\": 2}'\n"
    )
    assert main(["check", str(yaml)]) == 0
    out, _ = capsys.readouterr()
    assert out.splitlines()[0] == f"ascend-eplb check: {yaml}: OK"
    # --config on the command line is vLLM's: the file's values, the command line's model and -tp win
    code = main(["check", "--", "serve", str(folder), "--config", str(yaml), "-tp", "8"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert {"  num_ranks: 8", "  num_local_physical_experts: 8", "  num_logical_experts: 62"} <= set(
        out.splitlines()
    )
    code = main(["check", "--", "serve", str(folder), "--config", str(yaml), "-tp", "3"])
    out, _ = capsys.readouterr()
    assert code == 2
    assert out.splitlines()[2].startswith(
        "  - [experts-divisible] logical experts (62) + num_redundant_experts (2) = 64 physical experts is "
        "not divisible by 3 EP ranks;"
    )


def test_config_and_command_line_are_exclusive(tmp_path, capsys):
    assert main(["check"]) == 2
    assert capsys.readouterr().err == (
        "ascend-eplb check: error: give either a config file or a vllm serve command line after -- "
        "(ascend-eplb check -- serve MODEL ...), got neither\n"
    )


def test_check_reads_the_format_from_a_real_checkpoints_description_as_start_up_does(tmp_path, capsys):
    """The checkpoints the quantized real-model worlds serve: `check` takes the experts' format from the
    msModelSlim description `ascend_quant.write_quantized_experts` wrote, and refuses a rejected one."""
    from ascend_eplb.tools import world as rm

    args = ["--enable-eplb", "-tp", "2", "--enable-expert-parallel", "--enforce-eager",
            "--eplb-config", '{"num_redundant_experts": 2}', "--quantization", "ascend"]  # fmt: skip
    good = rm.write_checkpoint("qwen3-moe", tmp_path / "w4a8", seed=0, fmt="w4a8_dynamic")
    assert main(["check", "--", "serve", str(good), *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("--quantization ascend: OK")
    assert "  quantization: w4a8_dynamic" in out
    assert "  num_logical_experts: 8" in out
    bad = rm.write_checkpoint("qwen3-moe", tmp_path / "w4a16", seed=0, fmt="w4a16")
    assert main(["check", "--", "serve", str(bad), *args]) == 2
    out = capsys.readouterr().out
    assert (
        "  - [quantization] quantization format 'w4a16': quantization format 'w4a16' does not support EPLB"
        in out
    )


def test_a_bad_num_experts_fact_is_refused_before_the_file_is_read(tmp_path, capsys):
    """A review found ``num_experts=0``, ``-4``, ``64.0`` and ``True`` accepted by the API, and
    ``--num-experts 99999999999`` caught only by chance."""
    import pytest

    from ascend_eplb.tools.check import check_config_file, check_serve_command

    missing = tmp_path / "never-read.json"
    for bad in (0, -4, 64.0, True, 2**31):
        for call, first in ((check_config_file, missing), (check_serve_command, ["serve", "m"])):
            with pytest.raises(ValueError, match="must be an integer in") as info:
                call(first, num_experts=bad)
            assert str(info.value) == f"num_experts={bad!r} must be an integer in [1, 2147483647] (or None)"
    with pytest.raises(ValueError, match="must be a format name") as info:
        check_config_file(missing, quantization=8)
    assert str(info.value) == "quantization=8 must be a format name (a str, or None)"
    code = main(["check", "--num-experts", "99999999999", str(missing)])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.splitlines() == [
        "ascend-eplb check: error: num_experts=99999999999 must be an integer in [1, 2147483647] (or None)"
    ]
