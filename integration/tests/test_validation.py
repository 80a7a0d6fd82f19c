"""Start-up validation: one test per rule with its exact message; all violations in one error."""

from __future__ import annotations

import copy
import json
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm

from ascend_eplb.integration.validation import (
    LOAD_COLLECTION_PHASES,
    EplbConfigError,
    check_config_file,
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
}


def _check(tmp_path, data, environ=None):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return check_config_file(path, environ=environ or {})


def _with(**changes):
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
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
        "--eplb-config (window_size, step_interval, num_redundant_experts); the only Ascend V2 key is "
        "load_collection_phase",
    ),
    (
        "unknown-ascend-key",
        {"additional_config__eplb_config__load_scope": "decode"},
        "unknown additional_config.eplb_config key(s) ['load_scope']; fix: the only Ascend Model Runner V2 "
        "key is 'load_collection_phase'",
    ),
    (
        "load-collection-phase",
        {"additional_config__eplb_config__load_collection_phase": "chunked"},
        "eplb_config.load_collection_phase='chunked' is not one of ['all', 'prefill', 'decode']; fix: use "
        "'all', 'prefill' or 'decode'",
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
    (
        "graph-capture",
        {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
        "graph capture (cudagraph_mode=FULL_DECODE_ONLY) is not validated with Ascend EPLB yet (the lookup's "
        "in-place refresh under graph replay has no test); fix: run eager (--enforce-eager)",
    ),
    (
        "speculative-moe-draft",
        {"speculative_config": {"method": "mtp", "draft_is_moe": True}},
        "speculative decoding with an MoE draft (method='mtp') is not validated with Ascend EPLB yet (the "
        "draft model's layer states have no test); fix: disable speculative decoding or use a dense draft",
    ),
    (
        "micro-batching",
        {"parallel_config__enable_dbo": True},
        "enable_dbo=True (dual-batch overlap) is not validated with Ascend EPLB yet (per-micro-batch "
        "unpadded token counts have no test); fix: disable --enable-dbo",
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


def test_phases_match_the_control_plane():
    from ascend_eplb.control import LOAD_COLLECTION_PHASES as CONTROL_PHASES

    assert LOAD_COLLECTION_PHASES == CONTROL_PHASES


def test_vllm_config_is_resolved_and_every_violation_is_in_one_error(monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.config import EPLBConfig, ParallelConfig, VllmConfig

    from ascend_eplb.integration.validation import validate_eplb_config

    vc = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True))
    vc.parallel_config.enable_eplb = True
    vc.parallel_config.eplb_config = EPLBConfig(window_size=2, step_interval=4, use_async=True)
    vc.additional_config = {"eplb_config": {"load_collection_phase": "prefill"}}
    settings = validate_eplb_config(vc)
    assert settings.communicator == "torch_gloo"
    assert vc.parallel_config.eplb_config.communicator is None  # resolved, not written back
    assert settings.ascend_eplb_config == {"load_collection_phase": "prefill"}
    assert settings.num_ranks == 2

    vc.parallel_config.eplb_config = EPLBConfig(use_async=False, communicator="torch_nccl")
    vc.parallel_config.enable_expert_parallel = False
    vc.additional_config = {"eplb_config": {"load_collection_phase": "prefill", "expert_map_path": "m.json"}}
    with pytest.raises(EplbConfigError) as info:
        validate_eplb_config(vc)
    assert isinstance(info.value, ValueError)
    assert [v.rule for v in info.value.violations] == [
        "v1-controls",
        "async-only",
        "communicator",
        "expert-parallel",
    ]
    text = str(info.value)
    assert "additional_config.eplb_config.expert_map_path" in text
    assert "eplb_config.use_async=False" in text
    assert "eplb_config.communicator='torch_nccl'" in text


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
