"""`ascend-eplb check`: the file schema, a `vllm serve --config` YAML, and a command line after `--`."""

from __future__ import annotations

import json

import pytest

from ascend_eplb.tools.cli import main

ARGS = [
    "--enable-eplb", "-tp", "2", "--data-parallel-size", "2", "--enable-expert-parallel",
    "--eplb-config", '{"num_redundant_experts": 4}',
]  # fmt: skip


def _model(tmp_path, experts=64):
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": experts,
              "num_experts_per_tok": 6, "num_hidden_layers": 4, "first_k_dense_replace": 1,
              "torch_dtype": "bfloat16"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
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


def test_command_line_compiled_modes_and_unjudged_rules(capsys):
    code = main(["check", "--", "serve", "deepseek-ai/DeepSeek-V3", *ARGS, "-cc", '{"mode": 1}'])
    out, _ = capsys.readouterr()
    assert code == 2
    assert out.splitlines()[0].endswith(": INVALID")
    assert out.splitlines()[1:3] == [
        "1 EPLB configuration rule(s) violated:",
        "  - [compiled-forward] compilation mode STOCK_TORCH_COMPILE (the model runner's torch.compile of "
        "the whole model, guards kept) is not validated with Ascend EPLB; fix: use vLLM's default "
        "VLLM_COMPILE or DYNAMO_TRACE_ONCE (compilation_config.mode), or run eager (--enforce-eager)",
    ]
    # vLLM's defaults without --enforce-eager (VLLM_COMPILE, FULL_AND_PIECEWISE graphs) are accepted
    code = main(["check", "--num-experts", "64", "--", "serve", "deepseek-ai/DeepSeek-V3", *ARGS])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert out.splitlines()[0].endswith(": OK (1 rule could not be judged)")
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
    from ascend_eplb.world.checkpoints import write_checkpoint

    args = ["--enable-eplb", "-tp", "2", "--enable-expert-parallel", "--enforce-eager",
            "--eplb-config", '{"num_redundant_experts": 2}', "--quantization", "ascend"]  # fmt: skip
    good = write_checkpoint("qwen3-moe", tmp_path / "w4a8", seed=0, fmt="w4a8_dynamic")
    assert main(["check", "--", "serve", str(good), *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("--quantization ascend: OK")
    assert "  quantization: w4a8_dynamic" in out
    assert "  num_logical_experts: 8" in out
    bad = write_checkpoint("qwen3-moe", tmp_path / "w4a16", seed=0, fmt="w4a16")
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


EXPERTS_RULE = "(the routed experts of each MoE layer; EPLB balances them)"
#: What vLLM 0.33.0 does with no MoE layer (rule `moe-layers`, read from its model classes).
NO_MOE_LAYER = (
    "leave no MoE layer (vLLM 0.33.0 builds the model without routed experts: DeepSeek's with "
    "num_moe_layers=0, which upstream's EPLBController.maybe_register_model does not register, so it "
    "would be served without EPLB; Qwen3-MoE's and Mixtral's raise RuntimeError 'No ... layer found' on "
    "every rank while the model is built)"
)
#: A model folder's config.json (each a MoE fact the issue's operator met crashing after the ranks
#: started, or its neighbour) -> the one violation `check` reports, exactly.
BAD_FACTS = [
    ({"num_local_experts": "8", "num_experts_per_tok": 2},
     f"[routed-experts] {{c}}: num_local_experts='8' must be an integer in [1, 2147483647] {EXPERTS_RULE}; "
     "fix: state one routed-expert count, an integer >= 1"),
    ({"num_local_experts": True, "num_experts_per_tok": 2},
     f"[routed-experts] {{c}}: num_local_experts=True must be an integer in [1, 2147483647] {EXPERTS_RULE}; "
     "fix: state one routed-expert count, an integer >= 1"),
    ({"num_experts": -8, "num_experts_per_tok": 2},
     f"[routed-experts] {{c}}: num_experts=-8 must be an integer in [1, 2147483647] {EXPERTS_RULE}; fix: "
     "state one routed-expert count, an integer >= 1"),
    ({"n_routed_experts": 0, "num_experts_per_tok": 2},
     f"[routed-experts] {{c}}: n_routed_experts=0 must be an integer in [1, 2147483647] {EXPERTS_RULE}; fix: "
     "state one routed-expert count, an integer >= 1"),
    ({"num_local_experts": 8, "num_experts": 16, "num_experts_per_tok": 2},
     "[routed-experts] {c}: num_local_experts=8 disagrees with num_experts=16 (vLLM's EPLB reads "
     "num_experts, a model class may read num_local_experts); fix: state one routed-expert count, an "
     "integer >= 1"),
    ({"num_local_experts": 8, "num_experts_per_tok": 9},
     "[top-k] {c}: num_experts_per_tok=9 must be an integer in [1, 8] (the routed experts each token "
     "selects, of E=8); fix: correct num_experts_per_tok"),
    ({"num_local_experts": 8, "num_experts_per_tok": 0},
     "[top-k] {c}: num_experts_per_tok=0 must be an integer in [1, 8] (the routed experts each token "
     "selects, of E=8); fix: correct num_experts_per_tok"),
    ({"n_routed_experts": 64, "num_experts_per_tok": 8, "n_group": 5, "topk_group": 2},
     "[expert-groups] {c}: n_group=5 must be an integer >= 1 that divides the 64 routed experts (grouped "
     "top-k splits them into n_group equal groups); fix: correct the config"),
    ({"n_routed_experts": 64, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 9},
     "[expert-groups] {c}: topk_group=9 must be an integer in [1, n_group=8]; fix: correct the config"),
    ({"n_routed_experts": 64, "num_experts_per_tok": 20, "n_group": 8, "topk_group": 2},
     "[expert-groups] {c}: num_experts_per_tok=20 exceeds the 16 experts grouped top-k can select "
     "(topk_group=2 of n_group=8 groups of 8); fix: correct the config"),
    # no MoE layer, or layer fields vLLM cannot build (they passed `check`: vLLM then served DeepSeek
    # without EPLB, and Qwen3-MoE raised while the model was built on every rank)
    ({"n_routed_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 3, "first_k_dense_replace": 3},
     f"[moe-layers] {{c}}: num_hidden_layers=3, first_k_dense_replace=3 {NO_MOE_LAYER}; fix: serve it "
     "without --enable-eplb, or correct num_hidden_layers, first_k_dense_replace"),
    ({"num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "mlp_only_layers": [0, 1]},
     f"[moe-layers] {{c}}: num_hidden_layers=2, mlp_only_layers=[0, 1] {NO_MOE_LAYER}; fix: serve it "
     "without --enable-eplb, or correct num_hidden_layers, mlp_only_layers"),
    ({"num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": "4", "decoder_sparse_step": 0},
     "[moe-layers] {c}: num_hidden_layers='4' must be an integer in [1, 2147483647] (the decoder layers; "
     "EPLB balances the routed experts of their MoE layers); decoder_sparse_step=0 must be an integer >= 1 "
     "(every decoder_sparse_step-th layer is MoE; 0 is a ZeroDivisionError in vLLM's Qwen-MoE layers); fix: "
     "correct num_hidden_layers, decoder_sparse_step"),
    ({"num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": -1},
     "[moe-layers] {c}: num_hidden_layers=-1 must be an integer in [1, 2147483647] (the decoder layers; EPLB "
     "balances the routed experts of their MoE layers); fix: correct num_hidden_layers"),
]  # fmt: skip


#: The model class a test folder states, by the name its config gives E (as the real checkpoints of each
#: write it), with the layer fields its class reads.
CLASS_BY_EXPERTS_KEY = {
    "n_routed_experts": {"architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 0},
    "num_experts": {"architectures": ["Qwen3MoeForCausalLM"]},
    "num_local_experts": {"architectures": ["MixtralForCausalLM"]},
}


def _folder(tmp_path, config):
    folder = tmp_path / "model"
    folder.mkdir()
    stated = next((CLASS_BY_EXPERTS_KEY[k] for k in CLASS_BY_EXPERTS_KEY if k in config), {})
    (folder / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, **stated, **config, "torch_dtype": "bfloat16"})
    )
    return folder


@pytest.mark.parametrize(("config", "line"), BAD_FACTS, ids=[str(c) for c, _ in BAD_FACTS])
def test_a_bad_moe_fact_of_a_model_folder_is_refused_naming_field_value_and_rule(
    tmp_path, capsys, config, line
):
    """Issue 31: these folders passed `check` (0 experts) or crashed inside the model after the ranks
    started (a TypeError, pydantic tracebacks, `selected index k out of range`)."""
    folder = _folder(tmp_path, config)
    assert main(["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": INVALID")
    assert out[1:] == [
        "1 EPLB configuration rule(s) violated:",
        f"  - {line.format(c=folder / 'config.json')}",
    ]


def test_every_bad_moe_fact_is_refused_together_in_every_form_check_reads(tmp_path, capsys):
    folder = _folder(tmp_path, {"num_local_experts": "8", "num_experts_per_tok": 0, "n_group": 0})
    config = folder / "config.json"
    expected = [
        "3 EPLB configuration rule(s) violated:",
        f"  - [routed-experts] {config}: num_local_experts='8' must be an integer in [1, 2147483647] "
        f"{EXPERTS_RULE}; fix: state one routed-expert count, an integer >= 1",
        f"  - [top-k] {config}: num_experts_per_tok=0 must be an integer in [1, E] (the routed experts each "
        "token selects); fix: correct num_experts_per_tok",
        f"  - [expert-groups] {config}: n_group=0 must be an integer >= 1 that divides the routed experts "
        "(grouped top-k splits them into n_group equal groups); fix: correct the config",
    ]
    assert main(["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]) == 2
    assert capsys.readouterr().out.splitlines()[1:] == expected
    # the vllm serve --config YAML naming the folder: the same reading, the same three
    yaml = tmp_path / "serve.yaml"
    yaml.write_text(
        f"model: {folder}\nenable-eplb: true\nenable-expert-parallel: true\ntensor-parallel-size: 4\n"
        "enforce-eager: true\n"
    )
    assert main(["check", str(yaml)]) == 2
    assert capsys.readouterr().out.splitlines()[1:] == expected


def test_a_folder_that_omits_a_moe_fact_leaves_its_rule_unjudged_and_an_option_count_wins(tmp_path, capsys):
    """transformers gives an omitted field its config class's default, which `check` cannot know."""
    folder = _folder(tmp_path, {"num_local_experts": "8"})
    assert main(["check", "--num-experts", "8", "--", "serve", str(folder), *ARGS, "--enforce-eager"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": OK (1 rule could not be judged)")
    assert "  num_logical_experts: 8" in out
    assert out[-1] == (
        f"cannot judge: top-k: the experts per token are unknown ({folder / 'config.json'} states none of "
        "num_experts_per_tok, num_experts_per_token, top_k_experts, moe_topk, moe_top_k, top_k, so vLLM "
        "reads its config class's default); state num_experts_per_tok in config.json"
    )
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["MixtralForCausalLM"],
                "num_experts_per_tok": 2,
                "num_hidden_layers": 2,
                "torch_dtype": "bfloat16",
            }
        )
    )
    assert main(["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"cannot judge: experts-divisible: the routed-expert count is unknown ({folder / 'config.json'} "
        "states none of num_experts, moe_num_experts, n_routed_experts, num_local_experts, so vLLM reads "
        "its config class's default); pass --num-experts N (before the --) or state it in config.json"
    )


def test_a_model_folder_whose_vllm_class_has_no_mixture_of_experts_part_is_refused(tmp_path, capsys):
    """Issue 29: start-up's rule ``moe-model-class`` judges the folder's architectures as start-up does
    (vLLM 0.33.0's Qwen2MoeForCausalLM would be served without EPLB); a Qwen3-MoE folder passes."""
    folder = tmp_path / "qwen2-moe"
    folder.mkdir()
    config = {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60, "num_experts_per_tok": 4,
              "num_hidden_layers": 2, "torch_dtype": "bfloat16"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]) == 2
    assert capsys.readouterr().out.splitlines()[1:] == [
        "1 EPLB configuration rule(s) violated:",
        "  - [moe-model-class] model class Qwen2MoeForCausalLM (architecture Qwen2MoeForCausalLM) has no "
        "MixtureOfExperts part (vLLM's MixtureOfExperts interface: expert_weights, set_eplb_state, the MoE "
        "layers): upstream's EPLBController.maybe_register_model would not register it and the model would "
        "be served without EPLB; fix: serve it without --enable-eplb, or with a model class that implements "
        "MixtureOfExperts",
    ]
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3MoeForCausalLM"]}))
    assert main(["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]) == 0, capsys.readouterr().out


def test_a_model_folder_naming_its_architecture_as_a_string_is_refused_as_vllm_refuses_it(tmp_path, capsys):
    """``"architectures": "DeepseekV3ForCausalLM"`` passed `check`: a string is no list of class names, and
    vLLM's ModelConfig refuses it (pydantic: ``Input should be a valid list``) while transformers keeps it;
    a list entry that is no string is refused alike. Rule ``moe-model-class``, the one start-up runs."""
    folder = _folder(tmp_path, {"n_routed_experts": 8, "num_experts_per_tok": 2,
                                "architectures": "DeepseekV3ForCausalLM"})  # fmt: skip
    assert main(["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]) == 2
    assert capsys.readouterr().out.splitlines()[1:] == [
        "1 EPLB configuration rule(s) violated:",
        "  - [moe-model-class] architectures='DeepseekV3ForCausalLM' must be a list of model class names "
        "(vLLM's ModelConfig refuses anything else: 'Input should be a valid list'); fix: write "
        '"architectures": ["DeepseekV3ForCausalLM"]',
        "cannot judge: moe-layers: architectures='DeepseekV3ForCausalLM' name no model class (rule "
        "moe-model-class), so which decoder layers are MoE is not known",
    ]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "architectures": [{"DeepseekV3ForCausalLM": 1}]})
    )
    assert main(["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]) == 2
    assert capsys.readouterr().out.splitlines()[2] == (
        "  - [moe-model-class] architectures=[{'DeepseekV3ForCausalLM': 1}] must be a list of model class "
        "names (vLLM's ModelConfig refuses anything else: 'Input should be a valid string'); fix: write each "
        "entry as a string"
    )
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["DeepseekV3ForCausalLM"]}))
    assert main(["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]) == 0, capsys.readouterr().out


def test_check_reads_architectures_where_vllm_does_and_names_what_it_cannot_judge(tmp_path, capsys):
    """`check` read ``architectures`` from a ``text_config`` merged over the top level (vLLM and start-up
    read the top level), passed a folder naming none, and raised ``ModuleNotFoundError`` (exit 1) on a
    multimodal class whose module needs torchvision."""
    folder = _folder(tmp_path, {"num_experts": 8, "num_experts_per_tok": 2})
    config = json.loads((folder / "config.json").read_text())
    args = ["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]
    # the top level's dense class, whatever the text_config says
    (folder / "config.json").write_text(
        json.dumps(
            {
                **config,
                "architectures": ["LlamaForCausalLM"],
                "text_config": {"architectures": ["Qwen3MoeForCausalLM"]},
            }
        )
    )
    assert main(args) == 2
    assert (
        capsys.readouterr()
        .out.splitlines()[2]
        .startswith(
            "  - [moe-model-class] model class LlamaForCausalLM (architecture LlamaForCausalLM) has no "
            "MixtureOfExperts part"
        )
    )
    # none named: vLLM cannot choose a model class
    for named in ([], None):
        (folder / "config.json").write_text(json.dumps({**config, "architectures": named}))
        assert main(args) == 2
        assert capsys.readouterr().out.splitlines()[1:] == [
            "1 EPLB configuration rule(s) violated:",
            "  - [moe-model-class] architectures names no model class (vLLM's registry raises 'No model "
            'architectures are specified\'); fix: write "architectures": ["<the model class>"], e.g. '
            '["DeepseekV3ForCausalLM"]',
            f"cannot judge: moe-layers: architectures={named!r} name no model class (rule moe-model-class), "
            "so which decoder layers are MoE is not known",
        ]
    # a registered class whose module does not import here: not judged, named (exit 0)
    (folder / "config.json").write_text(
        json.dumps({**config, "architectures": ["Llama4ForConditionalGeneration"]})
    )
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": OK (2 rules could not be judged)")
    assert out[-2].startswith(
        "cannot judge: moe-layers: architecture Llama4ForConditionalGeneration: the MoE "
    )
    assert out[-1].startswith(
        "cannot judge: moe-model-class: vLLM's model class for architectures "
        "['Llama4ForConditionalGeneration'] does not import here (ModuleNotFoundError: "
    )


def test_every_optimization_level_vllm_takes_is_read_as_vllm_reads_it(tmp_path, capsys):
    """Issue 43 case 9: ``-O3`` (also ``-O0``, ``-O2``, ``--optimization-level 2``, all vLLM's) was refused
    as ``[model-folder] the command line: '3'`` (a KeyError's text): vLLM's parser keeps the text, its
    ``VllmConfig`` field reads it. -O0 also turns compilation off, as vLLM's default mode there."""
    folder = _model(tmp_path)
    serve = ["check", "--", "serve", str(folder), *ARGS, "--quantization", "ascend"]
    modes = {}
    for level in (["-O0"], ["-O2"], ["-O3"], ["--optimization-level", "2"], ["-O", "1"]):
        assert main([*serve, *level]) == 0, capsys.readouterr().out
        lines = capsys.readouterr().out.splitlines()
        modes[" ".join(level)] = [
            ln.strip() for ln in lines if ln.strip().startswith(("compilation_mode", "cudagraph_mode"))
        ]
    assert modes == {
        "-O0": ["compilation_mode: NONE", "cudagraph_mode: NONE"],
        "-O2": ["compilation_mode: VLLM_COMPILE", "cudagraph_mode: FULL_AND_PIECEWISE"],
        "-O3": ["compilation_mode: VLLM_COMPILE", "cudagraph_mode: FULL_AND_PIECEWISE"],
        "--optimization-level 2": ["compilation_mode: VLLM_COMPILE", "cudagraph_mode: FULL_AND_PIECEWISE"],
        "-O 1": ["compilation_mode: VLLM_COMPILE", "cudagraph_mode: PIECEWISE"],
    }  # fmt: skip
    assert main([*serve, "-O9"]) == 2
    assert capsys.readouterr().out.splitlines()[1:] == [
        "1 EPLB configuration rule(s) violated:",
        "  - [engine-args] the command line: optimization level '9': Input should be 0, 1, 2 or 3; fix: -O0, "
        "-O1, -O2 or -O3",
    ]


def test_what_vllms_configs_refuse_is_refused_by_check_before_anything_starts(tmp_path, capsys):
    """Issue 43 cases 8 and 14: ``num_speculative_tokens: -1`` passed check (vLLM's SpeculativeConfig
    requires > 0); an inductor option torch does not have passed check, and every rank's compile failed."""
    folder = _model(tmp_path)
    serve = ["check", "--", "serve", str(folder), *ARGS, "--quantization", "ascend"]
    assert main([*serve, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": -1}']) == 2
    assert capsys.readouterr().out.splitlines()[1:] == [
        "1 EPLB configuration rule(s) violated:",
        "  - [engine-args] the command line: speculative_config num_speculative_tokens=-1: vLLM's "
        "SpeculativeConfig refuses it (Input should be greater than 0)",
    ]
    assert (
        main([*serve, "-cc", '{"mode": 3, "inductor_compile_config": {"nope": 1, "freezing": false}}']) == 2
    )
    assert capsys.readouterr().out.splitlines()[1:] == [
        "1 EPLB configuration rule(s) violated:",
        "  - [compiled-forward] compilation_config.inductor_compile_config names 'nope', which torch's "
        "inductor has no option of (torch._inductor.config): every rank's first compile would fail; fix: "
        "correct or remove them",
    ]
    # Eager (mode 0, or --enforce-eager): nothing is compiled, the options are never read.
    assert main([*serve, "-cc", '{"mode": 0, "inductor_compile_config": {"nope": 1}}']) == 0
    capsys.readouterr()


def test_check_names_the_batch_split_in_force_on_the_configurations_rows(tmp_path, capsys):
    folder = _model(tmp_path)
    serve = ["check", "--", "serve", str(folder), *ARGS, "--enforce-eager"]
    route_first = ["--all2all-backend", "deepep_low_latency"]
    cases = [
        ([], "replica_split=equal (each replica an equal share, today's rule)"),
        (["--additional-config", '{"eplb_config": {"replica_split": "batch"}}'],
         "replica_split=batch on gathered-sp rows: every rank routing the rows splits the batch alike, no "
         "communication"),
        (["--additional-config", '{"eplb_config": {"replica_split": "batch"}}', *route_first],
         "replica_split=batch on split rows: the global batch's counts, one all-gather of E int64 counts per "
         "MoE layer per forward (replica_split=batch_local: each rank's own rows, none)"),
        (["--additional-config", '{"eplb_config": {"replica_split": "batch_local"}}', *route_first],
         "replica_split=batch_local on split rows: each rank splits its own rows, no communication"),
    ]  # fmt: skip
    for extra, line in cases:
        code = main([*serve, *extra])
        out, _ = capsys.readouterr()
        assert code == 0, out
        assert f"  replica_split: {line}" in out.splitlines()
    code = main([*serve, "--additional-config", '{"eplb_config": {"replica_split": "even"}}'])
    out, _ = capsys.readouterr()
    assert code == 2
    assert out.splitlines()[1:3] == [
        "1 EPLB configuration rule(s) violated:",
        "  - [replica-split] additional_config.eplb_config.replica_split='even' is not one of ['equal', "
        "'batch', 'batch_local']; fix: use 'equal' (each replica an equal share, today's rule), 'batch' "
        "(split each batch by its own load; on split rows one all-gather of E counts per MoE layer) or "
        "'batch_local' (on split rows each rank splits its own rows)",
    ]
