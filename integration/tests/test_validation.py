"""Start-up validation: the support matrix's rules, one function per rule id run in one order, and a
``VllmConfig`` read and judged by them, every violation in one error.

Each rule's exact message, through every form ``ascend-eplb check`` reads, is asserted in the tools'
``tests/test_check_rules.py`` (the same rule functions: :data:`RULES`).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm

from ascend_eplb.integration.rules import (
    EPLB_OFF_RULES,
    RULES,
    EplbSettings,
    MoeFacts,
    Violation,
    check_settings,
)
from ascend_eplb.integration.validation import EplbConfigError, validate_eplb_config

#: A supported configuration: EP over TP 2 x DP 2 = 4 ranks, 64 logical + 4 redundant experts, eager.
GOOD = EplbSettings(
    enable_eplb=True,
    enable_expert_parallel=True,
    tensor_parallel_size=2,
    data_parallel_size=2,
    window_size=10,
    step_interval=30,
    num_redundant_experts=4,
    ascend_eplb_config={"load_collection_phase": "decode"},
    num_logical_experts=64,
    quantization="w8a8_dynamic",
)

#: Rule id -> the one change of :data:`GOOD` that breaks that rule alone (``phase-without-eplb`` with EPLB
#: off), in report order.
BREAKS = {
    "phase-without-eplb": {"enable_eplb": False},
    "placement-without-eplb": {"enable_eplb": False, "ascend_eplb_config": {"initial_placement": "p.json"}},
    "model-runner-v2": {"use_v2_model_runner": False},
    "v1-controls": {"legacy_top_level_keys": {"gate_eplb": True}},
    "v1-env": {"environment": {"DYNAMIC_EPLB": "1"}},
    "unknown-ascend-key": {"ascend_eplb_config": {"load_scope": "decode"}},
    "load-collection-phase": {"ascend_eplb_config": {"load_collection_phase": "chunked"}},
    "async-only": {"use_async": False},
    "communicator": {"communicator": "nixl"},
    "policy": {"policy": "stair"},
    "elastic-ep": {"enable_elastic_ep": True},
    "expert-parallel": {"enable_expert_parallel": False},
    "window-size": {"window_size": 0},
    "step-interval": {"step_interval": True},
    "redundant-experts": {"num_redundant_experts": -1},
    "routed-experts": {
        "moe_facts": MoeFacts("config.json", {"num_local_experts": "64", "num_experts_per_tok": 6})
    },
    "top-k": {"moe_facts": MoeFacts("config.json", {"num_local_experts": 64, "num_experts_per_tok": 65})},
    "expert-groups": {
        "moe_facts": MoeFacts("config.json", {"n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 3})
    },
    "experts-divisible": {"num_redundant_experts": 2},
    "initial-placement": {"ascend_eplb_config": {"initial_placement": "no-such-placement.json"}},
    "quantization": {"quantization": "w4a16"},
    "graph-capture": {"cudagraph_mode": "FULL_DECODE_ONLY"},
    "speculative-moe-draft": {"speculative_method": "mtp", "speculative_draft_is_moe": True},
    "micro-batching": {"enable_dbo": True},
    "row-layout": {"prefill_context_parallel_size": 2, "data_parallel_size": 1},
}


def test_the_supported_settings_break_no_rule():
    judged = check_settings(GOOD)
    assert (list(judged), judged.unjudged) == ([], [])


def test_one_function_per_rule_id_in_report_order():
    assert list(RULES) == list(BREAKS)
    assert EPLB_OFF_RULES == ("phase-without-eplb", "placement-without-eplb")
    assert len({id(fn) for fn in RULES.values()}) == len(RULES)  # one function per id, none shared


@pytest.mark.parametrize("rule", list(BREAKS))
def test_each_rule_is_judged_by_its_own_function(rule):
    broken = replace(GOOD, **BREAKS[rule])
    judged = check_settings(broken)
    assert [v.rule for v in judged] == [rule]
    assert judged.unjudged == []
    # the registry's function for that id gives exactly that message; it holds on the good settings
    assert RULES[rule](broken) == judged[0].message
    assert str(judged[0]) == f"[{rule}] {judged[0].message}"
    assert RULES[rule](GOOD) is None


def test_all_violated_rules_come_in_the_registry_order():
    broken = replace(GOOD, **BREAKS["row-layout"], **BREAKS["policy"], **BREAKS["v1-env"])
    assert [v.rule for v in check_settings(broken)] == ["v1-env", "policy", "row-layout"]


def test_a_rule_without_its_fact_is_unjudged_never_passed():
    unknown = {
        "num_logical_experts": "the expert count is unknown",
        "quantization": "the format is unknown",
        "speculative_draft_is_moe": "the draft is unknown",
    }
    s = replace(GOOD, speculative_method="eagle", unknown_facts=unknown)
    judged = check_settings(s)
    assert list(judged) == []
    assert judged.unjudged == [
        Violation.unjudged("experts-divisible", "the expert count is unknown"),
        Violation.unjudged("quantization", "the format is unknown"),
        Violation.unjudged("speculative-moe-draft", "the draft is unknown"),
    ]
    assert str(judged.unjudged[0]) == "cannot judge: experts-divisible: the expert count is unknown"
    # EPLB off: only phase-without-eplb judges; no unknown fact is reported
    off = check_settings(replace(s, enable_eplb=False, ascend_eplb_config={}))
    assert (list(off), off.unjudged) == ([], [])


def test_vllm_config_is_resolved_and_every_violation_is_in_one_error(monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.config import EPLBConfig, ParallelConfig, VllmConfig

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


def test_start_up_judges_the_models_moe_facts_read_from_its_hf_config_by_checks_reader(tmp_path, monkeypatch):
    """Issue 31: a routed-expert count transformers lets through as a string crashed in the model after
    the ranks started; start-up reads vLLM's ``hf_text_config`` with the reader ``ascend-eplb check`` and
    ``simulate`` read ``config.json`` with, and refuses every bad fact at once."""
    import json

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.config import EPLBConfig, ModelConfig, ParallelConfig, VllmConfig

    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_local_experts": "8",
        "num_experts_per_tok": 0, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelConfig(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256
    )
    assert model.hf_text_config.num_experts == "8"  # transformers' attribute_map: num_local_experts
    vc = VllmConfig(
        model_config=model,
        parallel_config=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True),
    )
    vc.parallel_config.enable_eplb = True
    vc.parallel_config.eplb_config = EPLBConfig(window_size=2, step_interval=4, use_async=True)
    with pytest.raises(EplbConfigError) as info:
        validate_eplb_config(vc)
    source = f"the config of model {tmp_path}"
    assert [str(v) for v in info.value.violations] == [
        f"[routed-experts] {source}: num_experts='8' must be an integer in [1, 2147483647] (the routed "
        "experts of each MoE layer; EPLB balances them); fix: state one routed-expert count, an integer >= 1",
        f"[top-k] {source}: num_experts_per_tok=0 must be an integer in [1, E] (the routed experts each "
        "token selects); fix: correct num_experts_per_tok",
    ]
