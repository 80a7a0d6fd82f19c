"""`ascend-eplb check`'s readers judged by start-up validation's rules: one test per rule with its exact
message through a config file; every form (schema, engine arguments, command line, model folder); all
violations in one report."""

from __future__ import annotations

import copy
import json
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm

from ascend_eplb.integration.rules import moe_fact_errors
from ascend_eplb.integration.settings import LOAD_COLLECTION_PHASES
from ascend_eplb.tools.check import check_config_file

#: The ``compiled-forward`` rule's message for vLLM's STOCK_TORCH_COMPILE mode.
STOCK_MESSAGE = (
    "compilation mode STOCK_TORCH_COMPILE (the model runner's torch.compile of the whole model, guards kept) "
    "is not validated with Ascend EPLB; fix: use vLLM's default VLLM_COMPILE or DYNAMO_TRACE_ONCE "
    "(compilation_config.mode), or run eager (--enforce-eager)"
)

#: A supported configuration: EP over TP 2 x DP 2 = 4 ranks, 64 logical + 4 redundant experts.
BASE = {
    "use_v2_model_runner": True,
    "parallel_config": {
        "enable_eplb": True,
        "enable_expert_parallel": True,
        "tensor_parallel_size": 2,
        "data_parallel_size": 2,
        "eplb_config": {"window_size": 10, "step_interval": 30, "num_redundant_experts": 4},
    },
    "additional_config": {"eplb_config": {"load_collection_phase": "decode"}},
    "model": {"num_logical_experts": 64, "quantization": "w8a8_dynamic"},
    "compilation_config": {"cudagraph_mode": "NONE"},
}


def _check(tmp_path, data, environ=None):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return check_config_file(path, environ=environ or {})


def _with(**changes):
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        _merge(data, dotted, value)
    return data


def test_supported_config_is_ok_with_resolved_settings(tmp_path):
    result = _check(tmp_path, BASE)
    assert result.ok
    assert result.exit_code == 0
    assert result.violations == ()
    assert result.resolved["communicator"] == "torch_gloo"
    assert result.resolved["num_ranks"] == 4
    assert result.resolved["num_physical_experts"] == 68
    assert result.resolved["num_local_physical_experts"] == 17
    assert result.resolved["load_collection_phase"] == "decode"
    assert result.report.splitlines()[0] == "ok"
    assert "  communicator: torch_gloo" in result.report.splitlines()
    ok, report = result
    assert ok is True
    assert report == result.report


def test_the_policy_and_gate_keys_are_resolved_by_name(tmp_path):
    defaults = _check(tmp_path, BASE).resolved
    assert (defaults["placement_policy"], defaults["min_balancedness_gain"]) == ("default", 0.0)
    assert defaults["target_balancedness"] is None
    assert defaults["policy"] == "default"  # upstream's eplb_config.policy, which stays default
    keys = {"policy": "migration_aware", "min_balancedness_gain": 0.02, "target_balancedness": 0.95}
    result = _check(tmp_path, _with(**{f"additional_config__eplb_config__{k}": v for k, v in keys.items()}))
    assert result.ok
    lines = result.report.splitlines()
    assert "  placement_policy: migration_aware" in lines
    assert "  min_balancedness_gain: 0.02" in lines
    assert "  target_balancedness: 0.95" in lines


RULES = [
    (
        "model-runner-v2",
        {"use_v2_model_runner": False},
        "enable_eplb=True with use_v2_model_runner=False: upstream EPLB is supported by Model Runner V2 "
        "only; fix: set VLLM_USE_V2_MODEL_RUNNER=1 (or use the V1 dynamic_eplb path without --enable-eplb)",
    ),
    (
        "v1-controls",
        {"additional_config__eplb_config__dynamic_eplb": True, "additional_config__gate_eplb": True},
        "Model Runner V1 EPLB controls cannot be mixed with V2 EPLB: got "
        "additional_config.eplb_config.dynamic_eplb, additional_config.gate_eplb; fix: remove them and use "
        "--eplb-config (window_size, step_interval, num_redundant_experts); the Ascend V2 keys are "
        "load_collection_phase, initial_placement, policy, min_balancedness_gain, target_balancedness, "
        "load_estimate, replica_split",
    ),
    (
        "unknown-ascend-key",
        {"additional_config__eplb_config__load_scope": "decode"},
        "unknown additional_config.eplb_config key(s) ['load_scope']; fix: the Ascend Model Runner V2 keys "
        "are ['load_collection_phase', 'initial_placement', 'policy', 'min_balancedness_gain', "
        "'target_balancedness', 'load_estimate', 'replica_split']",
    ),
    (
        "load-collection-phase",
        {"additional_config__eplb_config__load_collection_phase": "chunked"},
        "eplb_config.load_collection_phase='chunked' is not one of ['all', 'prefill', 'decode']; fix: use "
        "'all', 'prefill' or 'decode'",
    ),
    (
        "placement-policy",
        {"additional_config__eplb_config__policy": "greedy"},
        "additional_config.eplb_config.policy='greedy' is not one of ['default', 'migration_aware', "
        "'split_aware']; fix: use 'default' (upstream's DefaultEplbPolicy), 'migration_aware' (the fewest "
        "expert moves from the placement in force) or 'split_aware' (the same, replicas placed to link ranks "
        "for the batch split)",
    ),
    (
        "min-balancedness-gain",
        {"additional_config__eplb_config__min_balancedness_gain": -0.1},
        "additional_config.eplb_config.min_balancedness_gain=-0.1 must be a number in [0, 1) (a gain of "
        "balancedness, which lies in (0, 1]; 0 turns the check off); fix: set a small gain such as 0.01, "
        "or 0",
    ),
    (
        "target-balancedness",
        {"additional_config__eplb_config__target_balancedness": 0},
        "additional_config.eplb_config.target_balancedness=0 must be a number in (0, 1] (a balancedness; "
        "leave it unset to turn the check off); fix: set a target such as 0.95, or remove "
        "target_balancedness",
    ),
    (
        "async-only",
        {"parallel_config__eplb_config__use_async": False},
        "eplb_config.use_async=False: only asynchronous EPLB is supported (no silent switch); fix: set "
        "--eplb-config.use_async=true",
    ),
    (
        "communicator",
        {"parallel_config__eplb_config__communicator": "nixl"},
        "eplb_config.communicator='nixl' is not supported on Ascend; fix: leave it unset or set 'torch_gloo' "
        "(AscendGlooEplbCommunicator, CPU staging over Gloo)",
    ),
    (
        "policy",
        {"parallel_config__eplb_config__policy": "stair"},
        "eplb_config.policy='stair': only vLLM's 'default' policy is supported; fix: set policy='default'",
    ),
    (
        "elastic-ep",
        {"parallel_config__enable_elastic_ep": True},
        "enable_elastic_ep=True is not supported with Ascend EPLB; fix: disable elastic EP",
    ),
    (
        "expert-parallel",
        {"parallel_config__enable_expert_parallel": False},
        "enable_expert_parallel=False: EPLB needs expert parallelism; fix: pass --enable-expert-parallel",
    ),
    (
        "experts-divisible",
        {"parallel_config__eplb_config__num_redundant_experts": 2},
        "logical experts (64) + num_redundant_experts (2) = 66 physical experts is not divisible by 4 EP "
        "ranks; fix: choose num_redundant_experts so that 64 + num_redundant_experts is a multiple of 4, "
        "e.g. 4 (EP size 4 = TP 2 x PCP 1 x DP 2)",
    ),
    (
        "window-size",
        {"parallel_config__eplb_config__window_size": 0},
        "eplb_config.window_size=0 must be a positive integer; fix: set --eplb-config.window_size to a "
        "value > 0",
    ),
    (
        "step-interval",
        {"parallel_config__eplb_config__step_interval": -3},
        "eplb_config.step_interval=-3 must be a positive integer; fix: set --eplb-config.step_interval to "
        "a value > 0",
    ),
    (
        "redundant-experts",
        {"parallel_config__eplb_config__num_redundant_experts": -1},
        "eplb_config.num_redundant_experts=-1 must be an integer >= 0; fix: set "
        "--eplb-config.num_redundant_experts to 0 or more",
    ),
    # Above the int32 limit (a review found these passed): each named with the limit.
    (
        "window-size",
        {"parallel_config__eplb_config__window_size": 2**31},
        "eplb_config.window_size=2147483648 exceeds 2147483647 (int32 device tables and load counters); "
        "fix: set --eplb-config.window_size to at most 2147483647",
    ),
    (
        "step-interval",
        {"parallel_config__eplb_config__step_interval": 99999999999999999999},
        "eplb_config.step_interval=99999999999999999999 exceeds 2147483647 (int32 device tables and load "
        "counters); fix: set --eplb-config.step_interval to at most 2147483647",
    ),
    (
        "redundant-experts",
        {"parallel_config__eplb_config__num_redundant_experts": 2**32},
        "eplb_config.num_redundant_experts=4294967296 is more than 1023, the most upstream's EplbState takes "
        "(its add_model asserts num_redundant_experts <= 1023 on every rank); fix: set "
        "--eplb-config.num_redundant_experts to at most 1023",
    ),
    (
        "compiled-forward",
        {"compilation_config": {"mode": "STOCK_TORCH_COMPILE"}},
        STOCK_MESSAGE,
    ),
    (
        "compiled-forward",
        {"compilation_config": {"mode": 2, "inductor_compile_config": {"freezing": True}}},
        "inductor freezing (compilation_config.inductor_compile_config freezing, or "
        "TORCHINDUCTOR_FREEZING=1) folds the expert weights into the compiled code as constants, so the "
        "weights EPLB moves in place would never be read again; fix: turn freezing off",
    ),
    (
        "graph-capture",
        {"compilation_config": {"cudagraph_mode": "FULL_GRAPH"}},
        "cudagraph_mode=FULL_GRAPH is not one of vLLM's modes ['NONE', 'PIECEWISE', 'FULL', "
        "'FULL_DECODE_ONLY', 'FULL_AND_PIECEWISE']; fix: name one of them",
    ),
    (
        "speculative-moe-draft",
        {
            "speculative_config": {
                "method": "draft_model",
                "draft_is_moe": True,
                "draft_architectures": ["Qwen2MoeForCausalLM"],
            }
        },
        "the MoE draft of speculative method='draft_model', vLLM class Qwen2MoeForCausalLM "
        "(Qwen2MoeForCausalLM), has no MixtureOfExperts part: upstream does not balance it, so its routed "
        "experts would run beside a balanced target without a placement of their own; fix: disable "
        "speculative decoding, use a dense draft, or a draft whose class upstream balances (vLLM's "
        'DeepSeekMTP: --speculative-config \'{"method": "mtp"}\' on DeepSeek-V3/R1)',
    ),
    (
        "micro-batching",
        {"parallel_config__enable_dbo": True},
        "enable_dbo=True (dual-batch overlap) is not validated with Ascend EPLB yet (per-micro-batch "
        "unpadded token counts have no test); fix: disable --enable-dbo",
    ),
    (
        "row-layout",
        {"parallel_config__prefill_context_parallel_size": 2, "parallel_config__data_parallel_size": 1},
        "prefill_context_parallel_size=2: the MoE rows gathered over the PCP group are not placed by the "
        "replica rule (which ranks route the same rows is not modelled); use 1; fix: set "
        "--prefill-context-parallel-size 1",
    ),
]


@pytest.mark.parametrize(("rule", "changes", "message"), RULES, ids=[r[0] for r in RULES])
def test_each_rule_reports_its_exact_message(tmp_path, rule, changes, message):
    data = copy.deepcopy(BASE)
    for key, value in changes.items():
        _merge(data, key, value)
    result = _check(tmp_path, data)
    assert not result.ok
    assert result.exit_code == 2
    assert [(v.rule, v.message) for v in result.violations] == [(rule, message)]
    assert f"[{rule}] {message}" in result.report


def _merge(data, dotted, value):
    *parents, leaf = dotted.split("__")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return data


def test_v1_environment_switch_is_rejected(tmp_path):
    result = _check(tmp_path, BASE, environ={"DYNAMIC_EPLB": "true", "EXPERT_MAP_RECORD": "0"})
    assert [(v.rule, v.message) for v in result.violations] == [
        (
            "v1-env",
            "Model Runner V1 EPLB environment switches cannot be mixed with V2 EPLB: got "
            "DYNAMIC_EPLB='true'; fix: unset DYNAMIC_EPLB",
        )
    ]


def test_phase_without_eplb_is_rejected_and_v1_keys_alone_are_not_ours(tmp_path):
    data = _with(parallel_config__enable_eplb=False)
    result = _check(tmp_path, data)
    assert [(v.rule, v.message) for v in result.violations] == [
        (
            "phase-without-eplb",
            "eplb_config.load_collection_phase='decode' needs Model Runner V2 EPLB, but enable_eplb=False; "
            "fix: pass --enable-eplb or remove load_collection_phase",
        )
    ]
    # EPLB off with V1 dynamic EPLB: the V1 path, untouched by this validation.
    v1 = _with(parallel_config__enable_eplb=False, additional_config={"eplb_config": {"dynamic_eplb": True}})
    assert _check(tmp_path, v1, environ={"DYNAMIC_EPLB": "1"}).ok


def test_unsupported_quantization_format_is_rejected_with_quant_views_reason(tmp_path):
    from ascend_eplb.quant_views import UnsupportedFormatError, get_format

    with pytest.raises(UnsupportedFormatError) as info:
        get_format("w4a16")
    result = _check(tmp_path, _with(model__quantization="w4a16"))
    assert [(v.rule, v.message) for v in result.violations] == [
        ("quantization", f"quantization format 'w4a16': {info.value}; fix: use a supported format")
    ]


def test_three_violations_are_reported_together(tmp_path):
    data = _with(
        parallel_config__eplb_config__use_async=False,
        parallel_config__eplb_config__communicator="torch_nccl",
    )
    data["parallel_config"]["enable_elastic_ep"] = True
    result = _check(tmp_path, data)
    assert [v.rule for v in result.violations] == ["async-only", "communicator", "elastic-ep"]
    assert result.report.splitlines()[0] == "3 EPLB configuration rule(s) violated:"


def test_schema_errors_name_the_key(tmp_path):
    result = _check(tmp_path, _with(parallel_config__eplb_config__windw_size=3))
    assert [v.rule for v in result.violations] == ["schema"]
    assert "unknown key(s) ['windw_size'] in parallel_config.eplb_config" in result.violations[0].message
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    broken = check_config_file(bad, environ={})
    assert not broken.ok
    assert broken.violations[0].rule == "schema"


def test_phases_match_the_control_plane(tmp_path):
    """Start-up validation accepts exactly the phases the controller accepts, from control's one list."""
    from ascend_eplb.control import LOAD_COLLECTION_PHASES as CONTROL_PHASES
    from ascend_eplb.control.phase import validate_phase

    assert LOAD_COLLECTION_PHASES is CONTROL_PHASES  # control's tuple itself, not a copy
    assert LOAD_COLLECTION_PHASES == ("all", "prefill", "decode")  # DESIGN.md section 4
    for value in (*CONTROL_PHASES, "chunked", "ALL", "Decode", " all", "", None, 0):
        result = _check(tmp_path, _with(additional_config__eplb_config__load_collection_phase=value))
        refused_at_start_up = [v.rule for v in result.violations if v.rule == "load-collection-phase"] != []
        try:
            validate_phase(value)  # what AscendEPLBController.__init__ runs
            refused_by_control = False
        except ValueError:
            refused_by_control = True
        assert refused_at_start_up == refused_by_control == (value not in CONTROL_PHASES), value


def test_a_config_file_without_eplb_settings_gets_upstreams_defaults(tmp_path):
    """The EPLB defaults are stated once (EplbSettings) and are upstream ``EPLBConfig``'s own."""
    from dataclasses import fields

    from vllm.config import EPLBConfig

    from ascend_eplb.integration.settings import EplbSettings
    from ascend_eplb.tools.check.schema import settings_from_file_dict

    upstream = EPLBConfig()
    ours = EplbSettings()
    eplb_fields = ("window_size", "step_interval", "num_redundant_experts", "use_async", "policy")
    eplb_fields += ("communicator", "log_balancedness")
    assert {f: getattr(ours, f) for f in eplb_fields} == {f: getattr(upstream, f) for f in eplb_fields}
    assert set(eplb_fields) <= {f.name for f in fields(EplbSettings)}
    data = copy.deepcopy(BASE)
    del data["parallel_config"]["eplb_config"]
    settings, violations = settings_from_file_dict(data, environ={})
    assert violations == []
    assert {f: getattr(settings, f) for f in eplb_fields} == {f: getattr(upstream, f) for f in eplb_fields}


@pytest.mark.parametrize(
    ("dotted", "label"),
    [
        ("parallel_config__enable_eplb", "parallel_config.enable_eplb"),
        ("parallel_config__enable_expert_parallel", "parallel_config.enable_expert_parallel"),
        ("parallel_config__enable_dbo", "parallel_config.enable_dbo"),
        ("parallel_config__eplb_config__log_balancedness", "parallel_config.eplb_config.log_balancedness"),
        ("speculative_config__draft_is_moe", "speculative_config.draft_is_moe"),
    ],
)
def test_quoted_booleans_are_schema_errors_not_truthy_strings(tmp_path, dotted, label):
    # bool("false") is True: a quoted "false" must not switch anything on.
    result = _check(tmp_path, _with(**{dotted: "false"}))
    assert not result.ok
    assert str(result.violations[0]) == f"[schema] {label}='false' must be a JSON boolean (true or false)"
    # The switch keeps its default (EPLB and EP off), never the truthiness of the string.
    assert [v.rule for v in result.violations[1:]] == {
        "parallel_config.enable_eplb": ["phase-without-eplb"],
        "parallel_config.enable_expert_parallel": ["expert-parallel"],
    }.get(label, [])


def test_log_balancedness_interval_must_be_positive(tmp_path):
    result = _check(tmp_path, _with(parallel_config__eplb_config__log_balancedness_interval=-3))
    assert [str(v) for v in result.violations] == [
        "[schema] parallel_config.eplb_config.log_balancedness_interval=-3 must be an integer in "
        "[1, 2147483647]"
    ]
    ok = _check(tmp_path, _with(parallel_config__eplb_config__log_balancedness_interval=5))
    assert ok.ok, ok.report


def test_readme_config_example_passes(tmp_path):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = re.search(r"## Config file schema.*?```json\n(.*?)```", readme, re.S).group(1)
    path = tmp_path / "readme.json"
    path.write_text(example)
    result = check_config_file(path, environ={})
    assert result.ok, result.report
    assert result.exit_code == 0
    assert "communicator: torch_gloo" in result.report


# -- the forms operators have: engine arguments, command lines, model folders -------------------------

EAGER_ARGS = [
    "--enable-eplb", "-tp", "2", "--data-parallel-size", "2", "--enable-expert-parallel",
    "--eplb-config", '{"num_redundant_experts": 4}', "--enforce-eager",
]  # fmt: skip
EXPERTS_UNJUDGED = (
    "cannot judge: experts-divisible: the routed-expert count is unknown (model 'deepseek-ai/DeepSeek-V3' "
    "is not a local folder); pass --num-experts N (before the --) or a local model folder as "
    "MODEL"
)
QUANT_UNJUDGED = (
    "cannot judge: quantization: the checkpoint's dtype is unknown (dtype=auto, model "
    "'deepseek-ai/DeepSeek-V3' is not a local folder); pass --quantization FORMAT (before the --) or a "
    "local model folder as MODEL"
)


def _model_folder(tmp_path, experts=64, quant_type="W8A8_DYNAMIC"):
    folder = tmp_path / "DeepSeek-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "n_routed_experts": experts,
                "num_experts_per_tok": 6,
                "num_hidden_layers": 4,
                "first_k_dense_replace": 1,
                "torch_dtype": "bfloat16",
            }
        )
    )
    if quant_type is not None:
        (folder / "quant_model_description_w8a8_dynamic.json").write_text(
            json.dumps(
                {
                    "model.layers.1.mlp.experts.0.gate_proj.weight": quant_type,
                    "model.layers.1.mlp.experts.0.down_proj.weight": quant_type,
                    "model.layers.1.self_attn.q_proj.weight": "W8A8",
                }
            )
        )
    return folder


def _serve(*argv, **kw):
    from ascend_eplb.tools.check import check_serve_command

    return check_serve_command(["serve", *argv], environ={}, **kw)


def test_command_line_with_a_model_folder_is_ok_with_every_fact(tmp_path):
    folder = _model_folder(tmp_path)
    result = _serve(str(folder), *EAGER_ARGS, "--quantization", "ascend")
    assert (result.ok, result.verdict, result.unjudged) == (True, "OK", ())
    assert result.resolved["num_logical_experts"] == 64
    assert result.resolved["quantization"] == "w8a8_dynamic"
    assert result.resolved["num_local_physical_experts"] == 17
    assert result.resolved["cudagraph_mode"] == "NONE"


def test_command_line_without_facts_reports_what_cannot_be_judged():
    result = _serve("deepseek-ai/DeepSeek-V3", *EAGER_ARGS)
    assert (result.ok, result.exit_code) == (True, 0)
    assert result.verdict == "OK (2 rules could not be judged)"
    assert [str(u) for u in result.unjudged] == [EXPERTS_UNJUDGED, QUANT_UNJUDGED]
    assert result.report.splitlines()[-2:] == [EXPERTS_UNJUDGED, QUANT_UNJUDGED]
    given = _serve("deepseek-ai/DeepSeek-V3", *EAGER_ARGS, num_experts=66, quantization="W8A8_DYNAMIC")
    assert [(v.rule, v.message) for v in given.violations] == [
        (
            "experts-divisible",
            "logical experts (66) + num_redundant_experts (4) = 70 physical experts is not divisible by 4 EP "
            "ranks; fix: choose num_redundant_experts so that 66 + num_redundant_experts is a multiple of 4, "
            "e.g. 6 (EP size 4 = TP 2 x PCP 1 x DP 2)",
        )
    ]
    assert given.unjudged == ()


def test_quantization_ascend_without_a_description_cannot_be_judged(tmp_path):
    folder = _model_folder(tmp_path, quant_type=None)
    result = _serve(str(folder), *EAGER_ARGS, "--quantization", "ascend")
    assert result.verdict == "OK (1 rule could not be judged)"
    assert [str(u) for u in result.unjudged] == [
        f"cannot judge: quantization: --quantization ascend takes the routed experts' format from "
        f"msModelSlim's quant_model_description*.json (none in {folder}); pass --quantization FORMAT "
        "(before the --) or a local model folder as MODEL"
    ]
    w4a16 = tmp_path / "w4a16"
    w4a16.mkdir()
    (w4a16 / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 64})
    )
    (w4a16 / "quant_model_description.json").write_text(json.dumps({"m.experts.0.w1.weight": "W4A16"}))
    bad = _serve(str(w4a16), *EAGER_ARGS, "--quantization", "ascend")
    assert [v.rule for v in bad.violations] == ["quantization"]
    assert bad.violations[0].message.startswith("quantization format 'w4a16': ")


def test_omitted_modes_are_vllms_defaults_compiled_with_graph_capture_and_accepted(tmp_path):
    """Issue 35: without --enforce-eager vLLM compiles (VLLM_COMPILE) and captures graphs
    (FULL_AND_PIECEWISE), both accepted now; the runner's STOCK_TORCH_COMPILE is refused, from the
    command line and from a file."""
    folder = _model_folder(tmp_path)
    args = [a for a in EAGER_ARGS if a != "--enforce-eager"]
    result = _serve(str(folder), *args)
    assert result.ok, result.report
    assert (result.resolved["cudagraph_mode"], result.resolved["compilation_mode"]) == (
        "FULL_AND_PIECEWISE",
        "VLLM_COMPILE",
    )
    data = copy.deepcopy(BASE)
    del data["compilation_config"]
    file_result = _check(tmp_path, data)
    assert file_result.ok, file_result.report
    stock = _serve(str(folder), *args, "-cc", '{"mode": 1}')
    assert [(v.rule, v.message) for v in stock.violations] == [("compiled-forward", STOCK_MESSAGE)]
    eager = _serve(str(folder), *EAGER_ARGS, "-cc", '{"mode": 1}')  # --enforce-eager: nothing compiles
    assert eager.ok, eager.report
    file_stock = _check(tmp_path, _with(compilation_config__mode=1))
    assert [(v.rule, v.message) for v in file_stock.violations] == [("compiled-forward", STOCK_MESSAGE)]
    bad = _check(tmp_path, _with(compilation_config__mode="FAST"))
    assert [(v.rule, v.message) for v in bad.violations] == [
        (
            "schema",
            "compilation_config.mode='FAST' must be one of vLLM's modes, a name of ['NONE', "
            "'STOCK_TORCH_COMPILE', 'DYNAMO_TRACE_ONCE', 'VLLM_COMPILE'] or its number 0-3",
        )
    ]
    assert [str(u) for u in bad.unjudged] == [
        "cannot judge: compiled-forward: compilation_config.mode is not a mode"
    ]


def test_an_mtp_draft_is_judged_by_check_as_start_up_judges_it(tmp_path, monkeypatch):
    # A DeepSeek-V3 folder served with MTP: vLLM derives the draft's config (DeepSeekMTPModel, the
    # target's experts), whose class upstream registers beside the target: accepted, judged, not unjudged.
    folder = _model_folder(tmp_path, quant_type=None)
    spec = '{"method": "mtp", "num_speculative_tokens": 1}'
    result = _serve(str(folder), *EAGER_ARGS, "--speculative-config", spec)
    assert (result.violations, result.unjudged) == ((), ())
    # A config file names the draft's class itself; without it the rule is not judged, never passed.
    file_result = _check(tmp_path, _with(speculative_config={"method": "mtp"}))
    assert file_result.violations == ()
    assert [str(v) for v in file_result.unjudged] == [
        "cannot judge: speculative-moe-draft: the MoE draft's model class is unknown "
        "(speculative_config.draft_architectures is not given; vLLM derives an MTP draft's from the "
        "target's config, e.g. DeepSeek-V3's DeepSeekMTPModel); give speculative_config.draft_architectures, "
        "or check a vllm serve command line with a local model folder"
    ]
    named = _check(
        tmp_path, _with(speculative_config={"method": "mtp", "draft_architectures": ["DeepSeekMTPModel"]})
    )
    assert (named.violations, named.unjudged) == ((), ())
    # Given but invalid (a breaker's case): refused by the schema, and the rule says it was given.
    bad = _check(
        tmp_path, _with(speculative_config={"method": "mtp", "draft_architectures": "DeepSeekMTPModel"})
    )
    assert [v.rule for v in bad.violations] == ["schema"]
    assert [str(v) for v in bad.unjudged] == [
        "cannot judge: speculative-moe-draft: the MoE draft's model class is unknown "
        "(speculative_config.draft_architectures='DeepSeekMTPModel' is invalid, see [schema]; vLLM derives "
        "an MTP draft's from the target's config, e.g. DeepSeek-V3's DeepSeekMTPModel); give "
        "speculative_config.draft_architectures, or check a vllm serve command line with a local model folder"
    ]
    # Start-up validation on vLLM's own SpeculativeConfig of that folder: the same facts, the same verdict.
    from ascend_eplb.integration.rules import check_settings
    from ascend_eplb.integration.validation import settings_from_vllm_config

    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.config import EPLBConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    model_config = ModelConfig(model=str(folder), skip_tokenizer_init=True, enforce_eager=True)
    parallel = ParallelConfig(tensor_parallel_size=1, enable_expert_parallel=True)
    vc = VllmConfig(model_config=model_config, parallel_config=parallel)
    vc.parallel_config.enable_eplb = True
    vc.parallel_config.eplb_config = EPLBConfig()
    vc.speculative_config = SpeculativeConfig(
        method="mtp",
        num_speculative_tokens=1,
        target_model_config=model_config,
        target_parallel_config=parallel,
    )
    settings = settings_from_vllm_config(vc, environ={})
    assert settings.speculative_draft_architectures == ("DeepSeekMTPModel",)
    assert settings.speculative_draft_model_type == "deepseek_mtp"
    assert settings.speculative_draft_moe_facts.num_logical_experts == 64
    judged = check_settings(settings)
    assert (list(judged), judged.unjudged) == ([], [])


def test_unknown_flag_is_rejected_by_vllms_parser():
    result = _serve("deepseek-ai/DeepSeek-V3", "--enable-eplb", "--bogus-flag")
    assert [(v.rule, v.message) for v in result.violations] == [
        (
            "engine-args",
            "the command line: vLLM's parser rejects the engine arguments: vllm: error: unrecognized "
            "arguments: --bogus-flag",
        )
    ]
    assert result.exit_code == 2


YAML = """\
model: {model}
enable-eplb: true
enable_expert_parallel: true
tensor-parallel-size: 2
data-parallel-size: 2
enforce-eager: true
quantization: ascend
eplb-config:
  num_redundant_experts: 4
  window_size: 100
additional-config:
  eplb_config:
    load_collection_phase: decode
"""


def test_vllm_serve_config_yaml_and_json_are_read_as_vllm_reads_them(tmp_path):
    folder = _model_folder(tmp_path)
    path = tmp_path / "serve.yaml"
    path.write_text(YAML.format(model=folder))
    result = check_config_file(path, environ={})
    assert (result.ok, result.unjudged) == (True, ()), result.report
    assert (result.resolved["window_size"], result.resolved["load_collection_phase"]) == (100, "decode")
    assert (result.resolved["num_ranks"], result.resolved["quantization"]) == (4, "w8a8_dynamic")
    as_json = tmp_path / "serve.json"
    as_json.write_text(
        json.dumps(
            {
                "model": str(folder), "enable-eplb": True, "enable_expert_parallel": True,
                "tensor_parallel_size": 2, "data-parallel-size": 2, "quantization": "ascend",
                "eplb-config": '{"num_redundant_experts": 2}',
            }
        )
    )  # fmt: skip
    json_result = check_config_file(as_json, environ={})
    assert [v.rule for v in json_result.violations] == ["experts-divisible"]
    no_model = tmp_path / "nomodel.yaml"
    no_model.write_text(YAML.replace("model: {model}\n", ""))
    unknown = check_config_file(no_model, environ={})
    assert unknown.verdict == "OK (2 rules could not be judged)"
    assert [str(u) for u in unknown.unjudged] == [
        "cannot judge: experts-divisible: the routed-expert count is unknown (no model is given); pass "
        "--num-experts N (before the --) or a local model folder as MODEL",
        "cannot judge: quantization: --quantization ascend takes the routed experts' format from "
        "msModelSlim's quant_model_description*.json (no model is given); pass --quantization FORMAT "
        "(before the --) or a local model folder as MODEL",
    ]
    typo = tmp_path / "typo.yaml"
    typo.write_text("enable-eplb: true\nenable-expert-paralel: true\n")
    rejected = check_config_file(typo, environ={})
    assert [str(v) for v in rejected.violations] == [
        f"[engine-args] {typo}: vLLM's parser rejects the engine arguments: vllm: error: unrecognized "
        "arguments: --enable-expert-paralel"
    ]


def test_a_json_engine_args_file_is_read_as_json_and_vllms_field_errors_are_quoted_whole(tmp_path):
    # Tab-indented JSON is JSON (YAML 1.1 refuses a tab): vLLM gets the values JSON read.
    tabs = tmp_path / "tabs.json"
    tabs.write_text(
        '{\n\t"enable-eplb": true,\n\t"enable-expert-parallel": true,\n\t"data-parallel-size": 4,\n'
        '\t"enforce-eager": true\n}\n'
    )
    read = check_config_file(tabs, environ={}, num_experts=64, quantization="w8a8_dynamic")
    assert (read.verdict, read.resolved["num_ranks"]) == ("OK", 4), read.report
    # A field vLLM's pydantic config refuses: the field, the value and the rule, not the docs link.
    negative = tmp_path / "negative.json"
    negative.write_text(
        json.dumps({"enable-eplb": True, "data-parallel-size": 4, "eplb-config": {"window_size": -5}})
    )
    assert [str(v) for v in check_config_file(negative, environ={}).violations] == [
        f"[engine-args] {negative}: vLLM's parser rejects the engine arguments: vllm serve: error: argument "
        "--eplb-config: 1 validation error for EPLBConfig; window_size; Input should be greater than 0 "
        "[type=greater_than, input_value=-5, input_type=int]"
    ]


def test_engine_args_of_only_the_keys_the_schema_shares_are_read_as_engine_args(tmp_path):
    folder = _model_folder(tmp_path)
    path = tmp_path / "serve.yaml"
    path.write_text(f"model: {folder}\ncompilation_config: {{cudagraph_mode: NONE}}\n")
    result = check_config_file(path, environ={})
    # vLLM read it (EPLB is off in it), not the schema ("model must be a JSON object, got str")
    assert (result.verdict, [v.rule for v in result.violations]) == ("OK", []), result.report
    assert (result.resolved["enable_eplb"], result.resolved["quantization"]) == (False, "bf16")  # its dtype


def test_simulate_reads_a_folders_format_as_check_does_without_importing_vllm(tmp_path):
    import subprocess
    import sys

    from ascend_eplb.tools.check.model_folder import folder_formats, model_folder_facts

    folder = _model_folder(tmp_path)
    facts = model_folder_facts(folder)
    assert folder_formats(folder) == (facts.quantization, facts.dtype) == ("w8a8_dynamic", "bf16")
    probe = (
        "import sys; from ascend_eplb.tools.simulate.models import folder_format; "
        f"print(folder_format({str(folder)!r}), 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["w8a8_dynamic", "False"]


def test_a_description_without_routed_experts_is_named_not_called_missing(tmp_path):
    folder = _model_folder(tmp_path, quant_type=None)
    (folder / "quant_model_description.json").write_text(json.dumps({"model.embed_tokens.weight": "FLOAT"}))
    result = _serve(str(folder), "--enable-eplb", "--enable-expert-parallel", "--quantization", "ascend")
    assert [str(u) for u in result.unjudged] == [
        "cannot judge: quantization: --quantization ascend takes the routed experts' format from "
        f"msModelSlim's quant_model_description*.json ({folder / 'quant_model_description.json'} names no "
        "routed-expert weight (no '.experts.' key)); pass --quantization FORMAT (before the --) or a local "
        "model folder as MODEL"
    ]


def test_file_schema_without_expert_count_cannot_judge_divisibility(tmp_path):
    data = copy.deepcopy(BASE)
    del data["model"]["num_logical_experts"]
    data["model"]["quantization"] = "ascend"
    result = _check(tmp_path, data)
    assert result.verdict == "OK (2 rules could not be judged)"
    assert [u.rule for u in result.unjudged] == ["experts-divisible", "quantization"]
    path = tmp_path / "config.json"
    given = check_config_file(path, environ={}, num_experts=64, quantization="w8a8_dynamic")
    assert (given.verdict, given.resolved["num_physical_experts"]) == ("OK", 68)


GARBAGE = [
    ("missing.json", None),
    ("folder.json", "dir"),
    ("empty.json", b""),
    ("binary.json", b"\xff\xfe\x00garbage"),
    ("truncated.json", b'{"parallel_config": {'),
    ("list.json", b"[1, 2]"),
    ("number.json", b"3"),
    ("deep.json", b"[" * 100000 + b"]" * 100000),
    ("bad.yaml", b"a: [1, 2\n"),
    ("scalar.yaml", b"just text"),
    ("keys.yaml", b"1: 2\n? [a]\n: b\n"),
    ("badtype.yaml", b"tensor-parallel-size: many\n"),
    ("badeplb.yaml", b"enable-eplb: true\neplb-config: {window_size: [1]}\n"),
    ("nested.json", b'{"parallel_config": [1], "model": "x", "environment": 7}'),
]


@pytest.mark.parametrize(("name", "data"), GARBAGE, ids=[g[0] for g in GARBAGE])
def test_check_config_file_never_raises_on_garbage(tmp_path, name, data):
    path = tmp_path / name
    if data == "dir":
        path.mkdir()
    elif data is not None:
        path.write_bytes(data)
    result = check_config_file(path, environ={})
    assert (result.ok, result.exit_code) == (False, 2)
    assert result.violations[0].rule in ("schema", "engine-args")
    assert result.report.startswith(f"{len(result.violations)} EPLB configuration rule(s) violated:")


def test_model_folder_facts_as_vllm_reads_them(tmp_path):
    from vllm.transformers_utils.config import CONFIG_FIELD_ALIASES

    from ascend_eplb.integration.model_facts import EXPERT_COUNT_KEYS, TOP_K_KEYS
    from ascend_eplb.tools.check.model_folder import model_folder_facts

    # The names and their order are vLLM's own (get_num_experts, get_num_experts_per_token).
    assert CONFIG_FIELD_ALIASES["num_experts"] == EXPERT_COUNT_KEYS
    assert CONFIG_FIELD_ALIASES["num_experts_per_token"] == TOP_K_KEYS
    folder = _model_folder(tmp_path)
    facts = model_folder_facts(folder)
    assert (facts.num_logical_experts, facts.quantization, facts.dtype) == (64, "w8a8_dynamic", "bf16")
    assert (facts.moe.experts_key, facts.moe.top_k_key, facts.moe.top_k) == (
        "n_routed_experts",
        "num_experts_per_tok",
        6,
    )
    (folder / "config.json").write_text(
        json.dumps({"text_config": {"num_local_experts": 8, "num_experts_per_tok": [2, 1]}})
    )
    facts = model_folder_facts(folder)
    assert (facts.num_logical_experts, facts.moe.top_k, moe_fact_errors(facts.moe)) == (8, 2, [])
    (folder / "config.json").write_text(
        json.dumps(
            {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": "many", "num_experts_per_tok": 2}
        )
    )
    facts = model_folder_facts(folder)  # read, not raised: the rules judge it
    assert facts.num_logical_experts is None
    broken = _serve(str(folder), *EAGER_ARGS)
    assert [v.rule for v in broken.violations] == ["routed-experts"]
    assert broken.violations[0].message == (
        f"{folder / 'config.json'}: n_routed_experts='many' must be an integer in [1, 2147483647] (the "
        "routed experts of each MoE layer; EPLB balances them); fix: state one routed-expert count, an "
        "integer >= 1"
    )


def test_float32_experts_pass_on_this_cpu_host_and_are_refused_elsewhere(tmp_path, monkeypatch):
    data = copy.deepcopy(BASE)
    data["model"]["quantization"] = "float32"
    assert list(_check(tmp_path, data).violations) == []
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert [(v.rule, v.message) for v in _check(tmp_path, data).violations] == [
        (
            "quantization",
            "float32 expert weights are accepted on a CPU host only (exact comparisons); fix: serve "
            "--dtype bfloat16 or float16",
        )
    ]


@pytest.mark.parametrize("value", [0, False, "", [1]])
def test_a_falsy_or_non_string_cudagraph_mode_is_refused_not_read_as_the_default(tmp_path, value):
    """A review found ``"cudagraph_mode": 0`` reported as the default mode, ``FULL_AND_PIECEWISE``."""
    data = copy.deepcopy(BASE)
    data["compilation_config"] = {"cudagraph_mode": value}
    result = _check(tmp_path, data)
    assert result.exit_code == 2
    assert [(v.rule, v.message) for v in result.violations] == [
        ("schema", f"compilation_config.cudagraph_mode={value!r} must be a mode name (a string)")
    ]
    # No mode the file did not state is judged: graph capture is reported as not judged, with why.
    assert [(v.rule, v.message) for v in result.unjudged] == [
        ("graph-capture", "compilation_config.cudagraph_mode is not a mode name")
    ]


@pytest.mark.parametrize("value", [False, 0, "", [1]])
def test_a_non_object_ascend_eplb_config_is_refused_even_when_falsy(tmp_path, value):
    """A review found ``"eplb_config": false`` passed as an empty object."""
    data = copy.deepcopy(BASE)
    data.setdefault("additional_config", {})["eplb_config"] = value
    result = _check(tmp_path, data)
    assert result.exit_code == 2
    kind = type(value).__name__
    assert [(v.rule, v.message) for v in result.violations] == [
        (
            "schema",
            f"additional_config.eplb_config={value!r} must be a JSON object (of the Ascend keys), got {kind}",
        )
    ]


def test_the_graph_capture_rule_names_a_mode_that_is_not_a_string():
    from ascend_eplb.integration.rules import check_settings
    from ascend_eplb.integration.settings import EplbSettings

    judgement = check_settings(EplbSettings(enable_eplb=True, cudagraph_mode=None))
    assert [(v.rule, v.message) for v in judgement if v.rule == "graph-capture"] == [
        ("graph-capture", "cudagraph_mode=None must be a mode name (a str, e.g. 'NONE')")
    ]


def test_the_serving_switches_start_up_refuses_are_reported_by_check_too(tmp_path):
    """A new user found ``check`` said OK for switches start-up refuses: it now reads them with
    start-up's own readers (``guardrail_facts.serving_switch_errors``), one violation per bad switch."""
    environ = {
        "ASCEND_EPLB_METRICS": "1",
        "ASCEND_EPLB_VERIFY": "maybe",
        "ASCEND_EPLB_WORKER_TIMEOUT_S": "abc",
    }
    result = _check(tmp_path, BASE, environ=environ)
    assert result.exit_code == 2
    assert [(v.rule, v.message) for v in result.violations] == [
        ("serving-switches", "ASCEND_EPLB_WORKER_TIMEOUT_S='abc': must be a finite number of seconds > 0"),
        (
            "serving-switches",
            "ASCEND_EPLB_VERIFY='maybe': must be one of 1, true, yes, on, 0, false, no, off",
        ),
        (
            "serving-switches",
            "ASCEND_EPLB_METRICS=1: needs PROMETHEUS_MULTIPROC_DIR, the folder where every vLLM process "
            "writes its metrics and vLLM's API server reads them (set it in the environment vLLM starts "
            "with)",
        ),
    ]
    folder = tmp_path / "prom"
    folder.mkdir()
    ok = _check(tmp_path, BASE, environ={"ASCEND_EPLB_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": str(folder)})
    assert (ok.exit_code, ok.violations) == (0, ())
    off = copy.deepcopy(BASE)
    off["parallel_config"]["enable_eplb"] = False  # EPLB off: start-up reads no switch, check neither
    assert [v.rule for v in _check(tmp_path, off, environ=environ).violations] == ["phase-without-eplb"]


def test_every_bad_serving_switch_is_reported_at_once_and_a_missing_metrics_folder_as_missing(tmp_path):
    """Issue 31: with both watchdog switches bad only the first was named, and a metrics folder that
    does not exist was called "not a writable folder"."""
    both = {"ASCEND_EPLB_WORKER_TIMEOUT_S": "-5", "ASCEND_EPLB_ON_WORKER_FAILURE": "explode"}
    assert [(v.rule, v.message) for v in _check(tmp_path, BASE, environ=both).violations] == [
        ("serving-switches", "ASCEND_EPLB_WORKER_TIMEOUT_S='-5': must be a finite number of seconds > 0"),
        ("serving-switches", "ASCEND_EPLB_ON_WORKER_FAILURE='explode': must be one of stop, raise"),
    ]
    missing, a_file = tmp_path / "no-such", tmp_path / "a-file"
    a_file.write_text("")
    for folder, said in (
        (missing, "no such folder (ASCEND_EPLB_METRICS is on); create it, empty, before vLLM starts"),
        (a_file, "not a folder (ASCEND_EPLB_METRICS is on)"),
    ):
        environ = {"ASCEND_EPLB_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": str(folder)}
        assert [v.message for v in _check(tmp_path, BASE, environ=environ).violations] == [
            f"PROMETHEUS_MULTIPROC_DIR={folder}: {said}"
        ]


def test_a_float32_model_folder_states_its_format_as_start_up_reads_it(tmp_path):
    """A new user found a float32 folder (the simulate preset's) reported as "does not say" its dtype."""
    folder = _model_folder(tmp_path, quant_type=None)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    result = _serve(str(folder), *EAGER_ARGS)
    assert (result.ok, result.verdict, result.unjudged) == (True, "OK", ())  # float32 on a CPU host
    assert result.resolved["quantization"] == "float32"


def test_a_given_but_invalid_expert_count_is_called_invalid_not_missing(tmp_path):
    """Issue 31: ``check`` said "model.num_logical_experts is not given" of a count it had refused."""
    for given, shown in (("64", "'64'"), (0, "0")):
        data = copy.deepcopy(BASE)
        data["model"]["num_logical_experts"] = given
        result = _check(tmp_path, data)
        assert result.verdict == "INVALID"
        assert [str(v) for v in result.violations] == [
            f"[schema] model.num_logical_experts={shown} must be an integer in [1, 2147483647]"
        ]
        (unjudged,) = [str(u) for u in result.unjudged if u.rule == "experts-divisible"]
        assert unjudged == (
            f"cannot judge: experts-divisible: the routed-expert count is unknown (model.num_logical_experts="
            f"{shown} is invalid, see [schema]); pass --num-experts / model.num_logical_experts"
        )
    del data["model"]["num_logical_experts"]
    (unjudged,) = [str(u) for u in _check(tmp_path, data).unjudged if u.rule == "experts-divisible"]
    assert "(model.num_logical_experts is not given)" in unjudged


def test_vllms_runner_switch_is_read_as_vllm_reads_it_in_every_form(tmp_path):
    """A file that omits ``use_v2_model_runner`` under ``VLLM_USE_V2_MODEL_RUNNER=0`` said OK (vLLM then
    runs Model Runner V1, which start-up refuses); ``VLLM_USE_V2_MODEL_RUNNER=banana`` was a
    ``[model-folder] invalid literal for int()`` on a command line. vLLM reads it with ``int()``."""
    omitted = copy.deepcopy(BASE)
    del omitted["use_v2_model_runner"]
    v1 = _check(tmp_path, omitted, environ={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert [v.rule for v in v1.violations] == ["model-runner-v2"]
    assert _check(tmp_path, omitted, environ={"VLLM_USE_V2_MODEL_RUNNER": "1"}).ok
    assert _check(tmp_path, BASE, environ={"VLLM_USE_V2_MODEL_RUNNER": "0"}).ok  # the file states V2
    bad = (
        "model-runner-v2",
        "VLLM_USE_V2_MODEL_RUNNER='true' is not an integer: vLLM reads it with int() (bool(int(value))) "
        "and its start-up fails with a ValueError; fix: set VLLM_USE_V2_MODEL_RUNNER=1, or unset it (Model "
        "Runner V2, vLLM 0.33.0's default)",
    )
    as_file = _check(tmp_path, omitted, environ={"VLLM_USE_V2_MODEL_RUNNER": "true"})
    assert [(v.rule, v.message) for v in as_file.violations] == [bad]
    from ascend_eplb.tools.check import check_serve_command

    folder = _model_folder(tmp_path)
    environ = {"VLLM_USE_V2_MODEL_RUNNER": "true", "ASCEND_EPLB_ON_WORKER_FAILURE": "explode"}
    served = check_serve_command(["serve", str(folder), *EAGER_ARGS], environ=environ)
    assert [(v.rule, v.message) for v in served.violations] == [
        bad,
        ("serving-switches", "ASCEND_EPLB_ON_WORKER_FAILURE='explode': must be one of stop, raise"),
    ]


def test_an_additional_config_that_is_not_an_object_is_named_as_such_beside_every_other_rule(tmp_path):
    """``--additional-config '[1]'`` (or JSON cut short, which vLLM's parser keeps as a str) was reported as
    ``[model-folder] additional_config.eplb_config must be a mapping, got str``, and no other rule ran."""
    folder = _model_folder(tmp_path)
    odd = [*EAGER_ARGS[:-3], "--eplb-config", '{"num_redundant_experts": 3}', "--enforce-eager"]
    divisible = (
        "experts-divisible",
        "logical experts (64) + num_redundant_experts (3) = 67 physical experts is not divisible by 4 EP "
        "ranks; fix: choose num_redundant_experts so that 64 + num_redundant_experts is a multiple of 4, "
        "e.g. 4 (EP size 4 = TP 2 x PCP 1 x DP 2)",
    )
    cases = [
        ("[1]", "additional_config='[1]' must be a JSON object, got JSON of a list"),
        (
            '{"eplb_config": ',
            """additional_config='{"eplb_config": ' must be a JSON object, got not JSON (Expecting value: """
            "line 1 column 17 (char 16))",
        ),
    ]
    for value, said in cases:
        result = _serve(str(folder), *odd, "--additional-config", value)
        assert [(v.rule, v.message) for v in result.violations] == [
            (
                "engine-args",
                f"the command line: {said}; fix: --additional-config '{{\"eplb_config\": {{...}}}}'",
            ),
            divisible,
        ], value
    nested = _serve(str(folder), *EAGER_ARGS, "--additional-config", '{"eplb_config": [1]}')
    assert [(v.rule, v.message) for v in nested.violations] == [
        (
            "engine-args",
            "the command line: additional_config.eplb_config=[1] must be a JSON object (of the Ascend keys), "
            """got list; fix: --additional-config '{"eplb_config": {"policy": "migration_aware"}}'""",
        )
    ]
    schema = _check(tmp_path, _with(additional_config__eplb_config=[]))
    assert [(v.rule, v.message) for v in schema.violations] == [
        ("schema", "additional_config.eplb_config=[] must be a JSON object (of the Ascend keys), got list")
    ]


def test_a_gate_value_written_as_a_string_says_so(tmp_path):
    """YAML 1.1 (PyYAML, so vLLM's ``--config``) reads ``1e-2`` as the string ``'1e-2'``: the rule alone
    read as if 0.01 were out of [0, 1)."""
    yaml = tmp_path / "serve.yaml"
    yaml.write_text(
        "enable-eplb: true\nenable-expert-parallel: true\nenforce-eager: true\n"
        "additional-config:\n  eplb_config:\n    min_balancedness_gain: 1e-2\n"
        "    target_balancedness: '0.9'\n"
    )
    result = check_config_file(yaml, environ={}, num_experts=64, quantization="bf16")
    string = "is a string, not a number: write it unquoted (YAML 1.1 reads an exponent without a dot, 1e-2, as a string: write 0.01 or 1.0e-2)"  # noqa: E501
    assert [(v.rule, v.message) for v in result.violations] == [
        (
            "min-balancedness-gain",
            "additional_config.eplb_config.min_balancedness_gain='1e-2' must be a number in [0, 1) (a gain "
            f"of balancedness, which lies in (0, 1]; 0 turns the check off); '1e-2' {string}; fix: set a "
            "small gain such as 0.01, or 0",
        ),
        (
            "target-balancedness",
            "additional_config.eplb_config.target_balancedness='0.9' must be a number in (0, 1] (a "
            f"balancedness; leave it unset to turn the check off); '0.9' {string}; fix: set a target such as "
            "0.95, or remove target_balancedness",
        ),
    ]
    words = _check(tmp_path, _with(additional_config__eplb_config__min_balancedness_gain="high"))
    assert words.violations[0].message.endswith(
        "0 turns the check off); fix: set a small gain such as 0.01, or 0"
    )


def test_a_typo_of_the_plugin_switch_and_odd_events_paths_are_refused_with_the_other_switches(tmp_path):
    """``ASCEND_EPLB=ture`` left the integration off, silently, in every process that reads only it;
    ``ASCEND_EPLB_EVENTS=out/`` wrote a file called ``out``; ``~`` (where no shell expands it) made a
    folder called ``~`` in the serving process's working folder."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    environ = {
        "ASCEND_EPLB": "ture",
        "ASCEND_EPLB_EVENTS": f"{tmp_path}/out/",
        "ASCEND_EPLB_WORKER_TIMEOUT_S": "-5",
    }
    assert [(v.rule, v.message) for v in _check(tmp_path, BASE, environ=environ).violations] == [
        (
            "serving-switches",
            "ASCEND_EPLB='ture': must be one of 1, true, yes, on, 0, false, no, off (a process started "
            "without --enable-eplb on its command line reads only this switch and would leave the Ascend "
            "integration off)",
        ),
        ("serving-switches", "ASCEND_EPLB_WORKER_TIMEOUT_S='-5': must be a finite number of seconds > 0"),
        (
            "serving-switches",
            f"ASCEND_EPLB_EVENTS={tmp_path}/out/: is a folder; name the events file (e.g. events.jsonl)",
        ),
    ]
    under_a_file = {"ASCEND_EPLB_EVENTS": f"{a_file}/events.jsonl"}
    assert [v.message for v in _check(tmp_path, BASE, environ=under_a_file).violations] == [
        f"ASCEND_EPLB_EVENTS={a_file}/events.jsonl: {a_file} is a file, not a folder; name an events file in "
        "a writable folder"
    ]
    from ascend_eplb.integration import plugin, switches
    from ascend_eplb.integration.guardrail_facts import events_path

    assert switches.PLUGIN_SWITCH == plugin.ENV_SWITCH
    home = os.path.expanduser("~")
    assert events_path({"ASCEND_EPLB_EVENTS": "~/eplb/events.jsonl"}) == f"{home}/eplb/events.jsonl"
    assert _check(tmp_path, BASE, environ={"ASCEND_EPLB": "0", "ASCEND_EPLB_EVENTS": " "}).ok
    assert not (tmp_path / "out").exists()


def test_a_file_a_command_line_and_a_vllm_config_are_read_alike(monkeypatch):
    """Issue 45: the three sources only map into the one reader's mapping, so the same settings read
    alike: inductor freezing (the options, or TORCHINDUCTOR_FREEZING), an MTP draft as MoE, the modes."""
    from types import SimpleNamespace

    from ascend_eplb.integration.validation import settings_from_vllm_config
    from ascend_eplb.tools.check.engine_args import parse_serve_command, settings_from_engine_args
    from ascend_eplb.tools.check.schema import settings_from_file_dict

    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.config import CompilationConfig, EPLBConfig, ParallelConfig, VllmConfig

    # (vLLM's VllmConfig adds inductor options of its own: inductor_compile_config is not compared.)
    fields = ("compilation_mode", "cudagraph_mode", "inductor_freezing")
    fields += (
        "speculative_method",
        "speculative_draft_is_moe",
        "ascend_eplb_config",
        "legacy_top_level_keys",
    )
    fields += ("enable_eplb", "tensor_parallel_size", "window_size", "environment")
    for env, inductor in (
        ({}, {"freezing": True}),
        ({"TORCHINDUCTOR_FREEZING": "1", "DYNAMIC_EPLB": "1"}, {}),
    ):
        additional = {"eplb_config": {"policy": "migration_aware"}, "gate_eplb": True}
        compilation = {"mode": 2, "cudagraph_mode": "NONE", "inductor_compile_config": inductor}
        file_data = {
            "parallel_config": {
                "enable_eplb": True, "enable_expert_parallel": True, "tensor_parallel_size": 2,
                "eplb_config": {"window_size": 8},
            },
            "additional_config": additional,
            "compilation_config": compilation,
            "speculative_config": {"method": "mtp"},
        }  # fmt: skip
        from_file, violations = settings_from_file_dict(file_data, env)
        assert violations == []
        argv = ["serve", "org/m", "--enable-eplb", "--enable-expert-parallel", "-tp", "2"]
        argv += ["--eplb-config", '{"window_size": 8}', "--additional-config", json.dumps(additional)]
        argv += ["-cc", json.dumps(compilation), "--speculative-config", '{"method": "mtp"}']
        from_args = settings_from_engine_args(parse_serve_command(argv), env)
        vc = VllmConfig(
            parallel_config=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True),
            compilation_config=CompilationConfig(**compilation),
        )
        vc.parallel_config.enable_eplb = True
        vc.parallel_config.eplb_config = EPLBConfig(window_size=8)
        vc.additional_config = additional
        # vLLM's SpeculativeConfig needs a target model to build; the reader reads its method alone.
        vc.speculative_config = SimpleNamespace(method="mtp", draft_model_config=None)
        from_vllm = settings_from_vllm_config(vc, environ=env)
        read = [{f: getattr(s, f) for f in fields} for s in (from_file, from_args, from_vllm)]
        assert (
            read[0]
            == read[1]
            == read[2]
            == {
                "compilation_mode": "DYNAMO_TRACE_ONCE",
                "cudagraph_mode": "NONE",
                "inductor_freezing": True,
                "speculative_method": "mtp",
                "speculative_draft_is_moe": True,
                "ascend_eplb_config": {"policy": "migration_aware"},
                "legacy_top_level_keys": {"gate_eplb": True},
                "enable_eplb": True,
                "tensor_parallel_size": 2,
                "window_size": 8,
                "environment": {"DYNAMIC_EPLB": "1"} if env else {},
            }
        ), env
