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

from ascend_eplb.integration.model_facts import MAX_REDUNDANT_EXPERTS, MoeFacts
from ascend_eplb.integration.rules import (
    EPLB_OFF_RULES,
    MOE_FACT_RULES,
    RULES,
    Violation,
    check_settings,
    moe_fact_errors,
)
from ascend_eplb.integration.settings import CUDAGRAPH_MODES, EplbSettings
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
    "policy-without-eplb": {"enable_eplb": False, "ascend_eplb_config": {"policy": "migration_aware"}},
    "split-without-eplb": {"enable_eplb": False, "ascend_eplb_config": {"replica_split": "batch"}},
    "model-runner-v2": {"use_v2_model_runner": False},
    "v1-controls": {"legacy_top_level_keys": {"gate_eplb": True}},
    "v1-env": {"environment": {"DYNAMIC_EPLB": "1"}},
    "unknown-ascend-key": {"ascend_eplb_config": {"load_scope": "decode"}},
    "load-collection-phase": {"ascend_eplb_config": {"load_collection_phase": "chunked"}},
    "placement-policy": {"ascend_eplb_config": {"policy": "greedy"}},
    "min-balancedness-gain": {"ascend_eplb_config": {"min_balancedness_gain": -0.5}},
    "target-balancedness": {"ascend_eplb_config": {"target_balancedness": 1.5}},
    "load-estimate": {"ascend_eplb_config": {"load_estimate": "ema"}},
    "replica-split": {"ascend_eplb_config": {"replica_split": "even"}},
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
    "moe-layers": {
        "moe_facts": MoeFacts(
            "config.json",
            {
                "n_routed_experts": 64,
                "num_experts_per_tok": 6,
                "num_hidden_layers": 3,
                "first_k_dense_replace": 3,
            },
            architectures=("DeepseekV3ForCausalLM",),
        )
    },
    "moe-model-class": {"model_architectures": ("Qwen2MoeForCausalLM",)},
    "experts-divisible": {"num_redundant_experts": 2},
    "initial-placement": {"ascend_eplb_config": {"initial_placement": "no-such-placement.json"}},
    "quantization": {"quantization": "w4a16"},
    "compiled-forward": {"compilation_mode": "STOCK_TORCH_COMPILE"},
    "graph-capture": {"cudagraph_mode": "FULL_GRAPH"},
    "speculative-moe-draft": {
        "speculative_method": "draft_model",
        "speculative_draft_is_moe": True,
        "speculative_draft_architectures": ("Qwen2MoeForCausalLM",),
    },
    "micro-batching": {"enable_dbo": True},
    "row-layout": {"prefill_context_parallel_size": 2, "data_parallel_size": 1},
}


def test_the_supported_settings_break_no_rule():
    judged = check_settings(GOOD)
    assert (list(judged), judged.unjudged) == ([], [])


def test_a_redundancy_the_rules_refuse_is_refused_once_never_judged_again():
    """A breaker's case: R above INT32_MAX was refused by ``redundant-experts`` and then judged by
    ``experts-divisible``, whose fix proposed another R above the limit."""
    for value in (1024, 2**31 + 1, 10**23 - 1, -1, "4"):
        judged = check_settings(replace(GOOD, num_redundant_experts=value))
        assert [v.rule for v in judged] == ["redundant-experts"], value
    assert judged[0].message == (
        "eplb_config.num_redundant_experts='4' must be an integer >= 0; fix: set "
        "--eplb-config.num_redundant_experts to 0 or more"
    )


def test_the_most_redundant_experts_is_upstreams_and_refused_above_it():
    """Issue 43: the rule took R up to INT32_MAX; upstream's EplbState.add_model asserts R <= 1023 on every
    rank, after start-up had accepted it."""
    import inspect

    from vllm.distributed.eplb.eplb_state import EplbState

    assert f"MAX_EXPERT_REDUNDANCY = {MAX_REDUNDANT_EXPERTS}" in inspect.getsource(EplbState.add_model)
    assert check_settings(replace(GOOD, num_redundant_experts=1020)) == []  # 64 + 1020 on 4 ranks
    (violation,) = check_settings(replace(GOOD, num_redundant_experts=1024))
    assert str(violation) == (
        "[redundant-experts] eplb_config.num_redundant_experts=1024 is more than 1023, the most upstream's "
        "EplbState takes (its add_model asserts num_redundant_experts <= 1023 on every rank); fix: set "
        "--eplb-config.num_redundant_experts to at most 1023"
    )


def test_one_function_per_rule_id_in_report_order():
    assert list(RULES) == list(BREAKS)
    # the model config's own rules (what simulate refuses a folder by) are rules of the registry, in order
    assert [r for r in RULES if r in MOE_FACT_RULES] == list(MOE_FACT_RULES)
    assert EPLB_OFF_RULES == (
        "phase-without-eplb",
        "placement-without-eplb",
        "policy-without-eplb",
        "split-without-eplb",
    )
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


def test_the_policy_and_gate_keys_are_judged_each_naming_value_and_rule_all_at_once():
    keys = {"policy": "stair", "min_balancedness_gain": 1, "target_balancedness": "0.9", "load_estimate": 1}
    judged = check_settings(replace(GOOD, ascend_eplb_config=keys))
    assert [(v.rule, v.message) for v in judged] == [
        (
            "placement-policy",
            "additional_config.eplb_config.policy='stair' is not one of ['default', 'migration_aware', "
            "'split_aware']; fix: use 'default' (upstream's DefaultEplbPolicy), 'migration_aware' (the "
            "fewest expert moves from the placement in force) or 'split_aware' (the same, replicas placed to "
            "link ranks for the batch split)",
        ),
        (
            "min-balancedness-gain",
            "additional_config.eplb_config.min_balancedness_gain=1 must be a number in [0, 1) (a gain of "
            "balancedness, which lies in (0, 1]; 0 turns the check off); fix: set a small gain such as "
            "0.01, or 0",
        ),
        (
            "target-balancedness",
            "additional_config.eplb_config.target_balancedness='0.9' must be a number in (0, 1] (a "
            "balancedness; leave it unset to turn the check off); '0.9' is a string, not a number: write it "
            "unquoted (YAML 1.1 reads an exponent without a dot, 1e-2, as a string: write 0.01 or 1.0e-2); "
            "fix: set a target such as 0.95, or remove target_balancedness",
        ),
        (
            "load-estimate",
            "additional_config.eplb_config.load_estimate=1 is not one of ['window', 'pooled']; fix: use "
            "'window' (upstream's: plan on the closed window) or 'pooled' (plan on the windows since the "
            "last shift of the load)",
        ),
    ]
    keys = {"policy": "migration_aware", "min_balancedness_gain": 0.02, "target_balancedness": 1,
            "load_estimate": "pooled"}  # fmt: skip
    good = replace(GOOD, ascend_eplb_config=keys)
    assert list(check_settings(good)) == []
    assert good.policy_settings().describe() == (
        "policy=migration_aware, gate min_balancedness_gain=0.02 target_balancedness=1, load_estimate=pooled"
    )
    # Absent keys: upstream's default policy, gate off, on the window; upstream's own eplb_config.policy
    # is another key.
    assert GOOD.policy_settings().is_upstream_default
    assert (
        GOOD.placement_policy,
        GOOD.min_balancedness_gain,
        GOOD.target_balancedness,
        GOOD.load_estimate,
    ) == ("default", 0.0, None, "window")
    # EPLB off: a key at its default value is harmless, another value is refused naming each key given.
    off = replace(
        GOOD, enable_eplb=False, ascend_eplb_config={"policy": "default", "min_balancedness_gain": 0}
    )
    assert list(check_settings(off)) == []
    off = replace(off, ascend_eplb_config={"policy": "migration_aware", "target_balancedness": 0.9,
                                           "load_estimate": "pooled"})  # fmt: skip
    assert [str(v) for v in check_settings(off)] == [
        "[policy-without-eplb] eplb_config.policy='migration_aware', eplb_config.target_balancedness=0.9, "
        "eplb_config.load_estimate='pooled': the placement policy, the gain gate and the load estimate "
        "need Model Runner V2 EPLB, but enable_eplb=False; fix: pass --enable-eplb or remove policy, "
        "target_balancedness, load_estimate"
    ]
    # `false` equals the gain's default 0.0 but is no number (refused with EPLB on): named here too.
    off = replace(off, ascend_eplb_config={"min_balancedness_gain": False, "target_balancedness": None})
    assert [str(v) for v in check_settings(off)] == [
        "[policy-without-eplb] eplb_config.min_balancedness_gain=False: the placement policy, the gain "
        "gate and the load estimate need Model Runner V2 EPLB, but enable_eplb=False; fix: pass "
        "--enable-eplb or remove min_balancedness_gain"
    ]


@pytest.mark.parametrize("mode", ["NONE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE", "dynamo_trace_once"])
@pytest.mark.parametrize("graphs", list(CUDAGRAPH_MODES))
def test_compiled_forwards_and_graph_capture_are_accepted_in_the_modes_the_evidence_covers(mode, graphs):
    """Issue 35: vLLM's CPU platform makes VLLM_COMPILE DYNAMO_TRACE_ONCE, which the compiled real-model
    worlds run (``test_compiled``: eager and inductor backends, the whole MoE layer traced); every
    tensor the traced forward reads keeps its storage through rearrangements (the graph-replay
    contract every capture mode relies on). Each vLLM graph mode with each of those compilation modes."""
    judged = check_settings(replace(GOOD, compilation_mode=mode, cudagraph_mode=graphs))
    assert (list(judged), judged.unjudged) == ([], [])


@pytest.mark.parametrize(
    ("change", "rule", "message"),
    [
        (
            {"compilation_mode": "STOCK_TORCH_COMPILE"},
            "compiled-forward",
            "compilation mode STOCK_TORCH_COMPILE (the model runner's torch.compile of the whole model, "
            "guards kept) is not validated with Ascend EPLB; fix: use vLLM's default VLLM_COMPILE or "
            "DYNAMO_TRACE_ONCE (compilation_config.mode), or run eager (--enforce-eager)",
        ),
        (
            {"compilation_mode": "VLLM_COMPILE", "inductor_freezing": True},
            "compiled-forward",
            "inductor freezing (compilation_config.inductor_compile_config freezing, or "
            "TORCHINDUCTOR_FREEZING=1) folds the expert weights into the compiled code as constants, so the "
            "weights EPLB moves in place would never be read again; fix: turn freezing off",
        ),
        (
            {"compilation_mode": "PIECEWISE"},
            "compiled-forward",
            "compilation mode='PIECEWISE' is not one of vLLM's modes ['NONE', 'STOCK_TORCH_COMPILE', "
            "'DYNAMO_TRACE_ONCE', 'VLLM_COMPILE']",
        ),
        (
            {"cudagraph_mode": "FULL_GRAPH"},
            "graph-capture",
            "cudagraph_mode=FULL_GRAPH is not one of vLLM's modes ['NONE', 'PIECEWISE', 'FULL', "
            "'FULL_DECODE_ONLY', 'FULL_AND_PIECEWISE']; fix: name one of them",
        ),
    ],
)
def test_the_compiled_modes_without_evidence_are_refused_with_the_rule_and_the_fix(change, rule, message):
    judged = check_settings(replace(GOOD, **change))
    assert [(v.rule, v.message) for v in judged] == [(rule, message)]
    # freezing without compilation compiles nothing
    assert list(check_settings(replace(GOOD, inductor_freezing=True))) == []


def test_start_up_reads_the_compilation_vllm_resolved(monkeypatch):
    """The settings of a ``VllmConfig``: on this CPU host VLLM_COMPILE (vLLM's default) becomes
    DYNAMO_TRACE_ONCE with inductor, accepted; STOCK_TORCH_COMPILE and inductor freezing are refused at
    start-up. (``enforce_eager`` reads as NONE: every eager world of the suite starts through it.)"""
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.config import CompilationConfig, EPLBConfig, ParallelConfig, VllmConfig

    from ascend_eplb.integration.validation import settings_from_vllm_config

    def config(compilation):
        vc = VllmConfig(
            parallel_config=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True),
            compilation_config=CompilationConfig(**compilation),
        )
        vc.parallel_config.enable_eplb = True
        vc.parallel_config.eplb_config = EPLBConfig(window_size=2, step_interval=4, use_async=True)
        return vc

    s = settings_from_vllm_config(config({}), environ={})
    assert (s.compilation_mode, s.cudagraph_mode, s.inductor_freezing) == ("DYNAMO_TRACE_ONCE", "NONE", False)
    validate_eplb_config(config({}))
    s = settings_from_vllm_config(config({"mode": 1}), environ={})
    assert s.compilation_mode == "STOCK_TORCH_COMPILE"
    with pytest.raises(EplbConfigError, match=r"\[compiled-forward\] compilation mode STOCK_TORCH_COMPILE"):
        validate_eplb_config(config({"mode": 1}))
    frozen = config({"inductor_compile_config": {"freezing": True}})
    assert settings_from_vllm_config(frozen, environ={}).inductor_freezing is True
    assert settings_from_vllm_config(config({}), environ={"TORCHINDUCTOR_FREEZING": "1"}).inductor_freezing
    with pytest.raises(EplbConfigError, match=r"\[compiled-forward\] inductor freezing"):
        validate_eplb_config(frozen)


def test_all_violated_rules_come_in_the_registry_order():
    broken = replace(GOOD, **BREAKS["row-layout"], **BREAKS["policy"], **BREAKS["v1-env"])
    assert [v.rule for v in check_settings(broken)] == ["v1-env", "policy", "row-layout"]


#: DeepSeek-V3's routed-expert facts, the target's and (vLLM's MTP draft config is the target's) the draft's.
DEEPSEEK_FACTS = MoeFacts("config.json", {"n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 8})
MTP = {
    "speculative_method": "mtp",
    "speculative_draft_is_moe": True,
    "speculative_draft_architectures": ("DeepSeekMTPModel",),
    "speculative_draft_model_type": "deepseek_mtp",
    "moe_facts": DEEPSEEK_FACTS,
    "speculative_draft_moe_facts": DEEPSEEK_FACTS,
}


def test_an_mtp_draft_upstream_registers_is_accepted_any_other_moe_draft_refused():
    # DeepSeek-V3/R1's MTP draft: vLLM's DeepSeekMTP has a MixtureOfExperts part and upstream's
    # draft_model_supports_eplb registers it beside the target with the target's expert configuration.
    judged = check_settings(replace(GOOD, **MTP))
    assert (list(judged), judged.unjudged) == ([], [])
    fix = (
        "fix: disable speculative decoding, use a dense draft, or a draft whose class upstream balances "
        '(vLLM\'s DeepSeekMTP: --speculative-config \'{"method": "mtp"}\' on DeepSeek-V3/R1)'
    )
    # A draft class without the part (upstream would leave its experts unbalanced): refused.
    no_part = replace(GOOD, **BREAKS["speculative-moe-draft"])
    assert RULES["speculative-moe-draft"](no_part) == (
        "the MoE draft of speculative method='draft_model', vLLM class Qwen2MoeForCausalLM "
        "(Qwen2MoeForCausalLM), has no MixtureOfExperts part: upstream does not balance it, so its routed "
        f"experts would run beside a balanced target without a placement of their own; {fix}"
    )
    # A DSpark draft of DeepSeek-V4.1 (upstream's dspark_draft_supports_eplb: V4 only): refused too.
    dspark = replace(GOOD, **{**MTP, "speculative_method": "dspark", "speculative_draft_model_type": "x"})
    assert "which upstream's draft_model_supports_eplb does not register" in RULES["speculative-moe-draft"](
        dspark
    )
    # A registered class with another expert configuration: upstream's add_model would raise.
    other = MoeFacts("config.json", {"n_routed_experts": 32, "num_experts_per_tok": 6, "n_group": 8})
    assert RULES["speculative-moe-draft"](replace(GOOD, **{**MTP, "speculative_draft_moe_facts": other})) == (
        "the MoE draft (DeepSeekMTP) has 32 routed experts in 8 group(s), the target 64 routed experts in 8 "
        "group(s): upstream's "
        "EplbState balances every registered model with one expert configuration "
        f"(EplbState.assert_confs_equal raises); {fix}"
    )
    # A class the registry does not hold: decided when the draft registers (the controller refuses it).
    unknown = replace(GOOD, **{**MTP, "speculative_draft_architectures": ("NoSuchDraft",)})
    assert check_settings(unknown).unjudged == [
        Violation.unjudged(
            "speculative-moe-draft",
            "the draft's architectures ['NoSuchDraft'] are not in vLLM's model registry, so whether upstream "
            "balances it is decided when the draft registers",
        )
    ]


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


def test_start_up_names_every_bad_serving_switch_at_once(monkeypatch):
    """Issue 31: ``ASCEND_EPLB_WORKER_TIMEOUT_S=-5`` with ``ASCEND_EPLB_ON_WORKER_FAILURE=explode`` named
    only the timeout; start-up reads each switch alone, with the readers ``ascend-eplb check`` reports."""
    from vllm.config import EPLBConfig, ParallelConfig, VllmConfig

    from ascend_eplb.integration.guardrail_facts import serving_switch_errors
    from ascend_eplb.integration.serving import read_serving_setup

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    vc = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True))
    vc.parallel_config.enable_eplb = True
    vc.parallel_config.eplb_config = EPLBConfig(window_size=2, step_interval=4, use_async=True)
    monkeypatch.setenv("ASCEND_EPLB_WORKER_TIMEOUT_S", "-5")
    monkeypatch.setenv("ASCEND_EPLB_ON_WORKER_FAILURE", "explode")
    expected = [
        "ASCEND_EPLB_WORKER_TIMEOUT_S='-5': must be a finite number of seconds > 0",
        "ASCEND_EPLB_ON_WORKER_FAILURE='explode': must be one of stop, raise",
    ]
    with pytest.raises(ValueError, match="ASCEND_EPLB_WORKER_TIMEOUT_S") as info:
        read_serving_setup(vc)
    assert str(info.value).splitlines() == expected == serving_switch_errors()
    monkeypatch.setenv("ASCEND_EPLB_ON_WORKER_FAILURE", "raise")
    monkeypatch.setenv("ASCEND_EPLB_WORKER_TIMEOUT_S", "30")
    setup = read_serving_setup(vc)
    assert (setup.worker_timeout_s, setup.on_worker_failure) == (30.0, "raise")


QWEN2_MOE_REFUSAL = (
    "model class Qwen2MoeForCausalLM (architecture Qwen2MoeForCausalLM) has no MixtureOfExperts part "
    "(vLLM's MixtureOfExperts interface: expert_weights, set_eplb_state, the MoE layers): upstream's "
    "EPLBController.maybe_register_model would not register it and the model would be served without "
    "EPLB; fix: serve it without --enable-eplb, or with a model class that implements MixtureOfExperts"
)


def test_start_up_refuses_a_model_class_without_a_mixture_of_experts_part(tmp_path, monkeypatch):
    """Issue 29: vLLM 0.33.0's ``Qwen2MoeForCausalLM`` has no MixtureOfExperts part, so upstream's
    ``maybe_register_model`` returned False and the model was served without EPLB after "Ascend EPLB
    active". Start-up resolves the config's architectures through vLLM's registry and refuses it; a class
    with the part passes, and architectures vLLM's registry does not hold are left to the registration."""
    import json

    from ascend_eplb.integration.model_facts import read_model_class

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.config import EPLBConfig, ModelConfig, ParallelConfig, VllmConfig

    config = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 8,
        "num_experts_per_tok": 2, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelConfig(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256
    )
    vc = VllmConfig(
        model_config=model,
        parallel_config=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True),
    )
    vc.parallel_config.enable_eplb = True
    vc.parallel_config.eplb_config = EPLBConfig(window_size=2, step_interval=4, use_async=True)
    with pytest.raises(EplbConfigError) as info:
        validate_eplb_config(vc)
    assert [str(v) for v in info.value.violations] == [f"[moe-model-class] {QWEN2_MOE_REFUSAL}"]
    # EPLB off: the model is vLLM's to serve; nothing is judged.
    vc.parallel_config.enable_eplb = False
    assert validate_eplb_config(vc).enable_eplb is False

    qwen3 = read_model_class(("Qwen3MoeForCausalLM",))
    assert (qwen3.name, qwen3.has_moe_part) == ("Qwen3MoeForCausalLM", True)
    assert read_model_class(("NoSuchModelForCausalLM", "MixtralForCausalLM")).name == "MixtralForCausalLM"
    assert read_model_class(("NoSuchModelForCausalLM",)) is None
    judged = check_settings(replace(GOOD, model_architectures=("NoSuchModelForCausalLM",)))
    assert list(judged) == []
    assert [str(v) for v in judged.unjudged] == [
        "cannot judge: moe-model-class: architectures ['NoSuchModelForCausalLM'] are not in vLLM's model "
        "registry, so whether the model class vLLM builds has a MixtureOfExperts part is decided when the "
        "model registers"
    ]


def _start_up(tmp_path, monkeypatch, config):
    """``validate_eplb_config`` of a VllmConfig built by vLLM from ``config`` written as ``config.json``
    (TP 2 x EP, EPLB on): the violations, or [] when it passes."""
    import json

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.config import EPLBConfig, ModelConfig, ParallelConfig, VllmConfig

    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelConfig(
        model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256
    )
    vc = VllmConfig(
        model_config=model,
        parallel_config=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True),
    )
    vc.parallel_config.enable_eplb = True
    vc.parallel_config.eplb_config = EPLBConfig(window_size=2, step_interval=4, use_async=True)
    try:
        validate_eplb_config(vc)
    except EplbConfigError as e:
        return [str(v) for v in e.violations]
    return []


DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "hidden_size": 64, "num_hidden_layers": 3,
    "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128,
    "max_position_embeddings": 256, "intermediate_size": 128, "moe_intermediate_size": 32,
    "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
}  # fmt: skip
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
    "num_experts_per_tok": 2, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256,
}  # fmt: skip
#: vLLM 0.33.0 with no MoE layer (its model classes, read): DeepSeek's builds every layer dense and sets
#: num_moe_layers=0, so upstream's maybe_register_model registers nothing (is_mixture_of_experts needs
#: num_moe_layers > 0); Qwen3-MoE's and Mixtral's raise RuntimeError while the model is built.
NO_MOE_LAYER = (
    "leave no MoE layer (vLLM 0.33.0 builds the model without routed experts: DeepSeek's with "
    "num_moe_layers=0, which upstream's EPLBController.maybe_register_model does not register, so it "
    "would be served without EPLB; Qwen3-MoE's and Mixtral's raise RuntimeError 'No ... layer found' on "
    "every rank while the model is built)"
)


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (
            {**DEEPSEEK_V3, "first_k_dense_replace": 3},
            f"num_hidden_layers=3, first_k_dense_replace=3 {NO_MOE_LAYER}; fix: serve it without "
            "--enable-eplb, or correct num_hidden_layers, first_k_dense_replace",
        ),
        (
            {**DEEPSEEK_V3, "first_k_dense_replace": 7},
            f"num_hidden_layers=3, first_k_dense_replace=7 {NO_MOE_LAYER}; fix: serve it without "
            "--enable-eplb, or correct num_hidden_layers, first_k_dense_replace",
        ),
        (
            {**DEEPSEEK_V3, "num_hidden_layers": 0},
            "num_hidden_layers=0 must be an integer in [1, 2147483647] (the decoder layers; EPLB balances "
            "the routed experts of their MoE layers); fix: correct num_hidden_layers",
        ),
        (
            {**DEEPSEEK_V3, "first_k_dense_replace": -1},
            "first_k_dense_replace=-1 must be an integer >= 0 (the leading dense layers: vLLM's class "
            "compares layer_idx >= first_k_dense_replace and counts num_moe_layers = num_hidden_layers - "
            "first_k_dense_replace); fix: correct first_k_dense_replace",
        ),
        (
            {**QWEN3_MOE, "mlp_only_layers": [0, 1]},
            f"num_hidden_layers=2, mlp_only_layers=[0, 1] {NO_MOE_LAYER}; fix: serve it without "
            "--enable-eplb, or correct num_hidden_layers, mlp_only_layers",
        ),
        (
            {**QWEN3_MOE, "decoder_sparse_step": 3},
            f"num_hidden_layers=2, decoder_sparse_step=3 {NO_MOE_LAYER}; fix: serve it without "
            "--enable-eplb, or correct num_hidden_layers, decoder_sparse_step",
        ),
        (
            {**QWEN3_MOE, "decoder_sparse_step": 0},
            "decoder_sparse_step=0 must be an integer >= 1 (every decoder_sparse_step-th layer is MoE; 0 "
            "is a ZeroDivisionError in vLLM's Qwen-MoE layers); fix: correct decoder_sparse_step",
        ),
    ],
    ids=["dense-replace-all", "dense-replace-beyond", "no-layers", "negative-dense", "mlp-only-all",
         "sparse-step-beyond", "sparse-step-zero"],
)  # fmt: skip
def test_start_up_refuses_a_config_without_a_moe_layer_naming_the_fields(tmp_path, monkeypatch, config, said):
    """A config whose layer fields leave no MoE layer passed start-up and ``check``: vLLM then served the
    model without EPLB (DeepSeek) or raised while building it on every rank (Qwen3-MoE). Start-up counts the
    MoE layers from ``hf_text_config`` by the rule ``moe-layers``, with the count ``check`` and the tools
    read from ``config.json`` (``MoeFacts.num_moe_layers``)."""
    source = f"the config of model {tmp_path}"
    assert _start_up(tmp_path, monkeypatch, config) == [f"[moe-layers] {source}: {said}"]


def test_the_moe_layers_are_counted_as_vllms_model_classes_build_them(tmp_path, monkeypatch):
    from ascend_eplb.integration.model_facts import read_moe_facts

    # By the model class vLLM builds (the first architecture), only the fields that class reads: DeepSeek's
    # first first_k_dense_replace layers are dense; Qwen-MoE's mlp_only_layers are dense and layer i is MoE
    # when (i + 1) % decoder_sparse_step == 0; Mixtral's every layer.
    ds, qwen, mixtral = ["DeepseekV3ForCausalLM"], ["Qwen3MoeForCausalLM"], ["MixtralForCausalLM"]
    cases = [
        ({"architectures": ds, "num_hidden_layers": 61, "first_k_dense_replace": 3}, 58, range(3, 61)),
        ({"architectures": ["Glm4MoeForCausalLM"], "num_hidden_layers": 46, "first_k_dense_replace": 1},
         45, range(1, 46)),
        ({"architectures": qwen, "num_hidden_layers": 48, "mlp_only_layers": [0, 5],
          "decoder_sparse_step": 1}, 46, (1, 2, 3, 4, *range(6, 48))),
        ({"architectures": qwen, "num_hidden_layers": 8, "decoder_sparse_step": 2}, 4, range(1, 8, 2)),
        ({"architectures": qwen, "num_hidden_layers": 8, "decoder_sparse_step": 3,
          "mlp_only_layers": [2, -1, 9]}, 1, (5,)),
        ({"architectures": mixtral, "num_hidden_layers": 32}, 32, range(32)),
        ({"architectures": qwen, "num_hidden_layers": 8, "mlp_only_layers": None}, 8, range(8)),  # None is []
        # a field the class does not read changes nothing (they were pooled: each of these was refused)
        ({"architectures": mixtral, "num_hidden_layers": 4, "mlp_only_layers": [0, 1, 2, 3]}, 4, range(4)),
        ({"architectures": qwen, "num_hidden_layers": 4, "first_k_dense_replace": 4}, 4, range(4)),
        ({"architectures": ds, "num_hidden_layers": 4, "first_k_dense_replace": 0,
          "decoder_sparse_step": 8}, 4, range(4)),
        # counted, not enumerated: INT32_MAX layers at once (a list of them hung or ran out of memory)
        ({"architectures": qwen, "num_hidden_layers": 2**31 - 1, "decoder_sparse_step": 2,
          "mlp_only_layers": [1]}, 2**30 - 2, None),
    ]  # fmt: skip
    for stated, layers, indices in cases:
        facts = read_moe_facts(stated, "config.json")
        assert (facts.num_moe_layers, facts.layers_error(), facts.layers_not_counted()) == (
            layers,
            None,
            None,
        )
        if indices is not None:
            assert tuple(facts.moe_layer_indices()) == tuple(indices), stated
    # what the class needs and vLLM cannot build is named; what this reading cannot count is not judged
    assert read_moe_facts({"architectures": ds, "num_hidden_layers": 4, "first_k_dense_replace": None}, "c")\
        .layers_error() == (
        "c: first_k_dense_replace=None must be an integer >= 0 (the leading dense layers: vLLM's class "
        "compares layer_idx >= first_k_dense_replace and counts num_moe_layers = num_hidden_layers - "
        "first_k_dense_replace); fix: correct first_k_dense_replace"
    )  # fmt: skip
    assert read_moe_facts(
        {"architectures": ds, "num_hidden_layers": 4, "first_k_dense_replace": 1, "moe_layer_freq": 2}, "c"
    ).layers_error() == (
        "c: moe_layer_freq=2 must be 1 with EPLB (vLLM's DeepSeek class builds a MoE layer only where "
        "layer_idx % moe_layer_freq == 0, yet counts num_moe_layers = num_hidden_layers - "
        "first_k_dense_replace, which upstream's EPLB state is sized by); fix: correct moe_layer_freq"
    )
    # transformers' DeepseekV3Config gives an absent first_k_dense_replace 3 (it was read as 0)
    facts = read_moe_facts({"architectures": ds, "num_hidden_layers": 3}, "c")
    assert (facts.num_moe_layers, facts.layers_error(), facts.layers_not_counted()) == (
        None,
        None,
        "c states no first_k_dense_replace, so vLLM reads its config class's default (DeepseekV3Config's 3, "
        "Glm4MoeConfig's 1); state first_k_dense_replace in config.json",
    )
    # Llama 4 interleaves its MoE layers (interleave_moe_layer_step): not counted here (it counted 48 of 24)
    facts = read_moe_facts({"architectures": ["Llama4ForCausalLM"], "num_hidden_layers": 48}, "c")
    assert (facts.num_moe_layers, facts.layers_error()) == (None, None)
    assert facts.layers_not_counted().startswith(
        "architecture Llama4ForCausalLM: the MoE layers of its model "
    )
    # a multimodal config.json: the layer fields of its text_config, the top level's architectures
    facts = read_moe_facts(
        {"architectures": qwen, "text_config": {"architectures": mixtral, "num_hidden_layers": 4,
                                                "decoder_sparse_step": 2}}, "c"
    )  # fmt: skip
    assert (facts.architectures, facts.num_moe_layers) == (qwen, 2)
    # the one reading of a text_config over the top level (read_moe_facts, check's formats, the cost estimate)
    from ascend_eplb.integration.model_facts import text_config

    nested = {"hidden_size": 8, "text_config": {"hidden_size": 16, "num_hidden_layers": 2}}
    assert text_config(nested) == {**nested, "hidden_size": 16, "num_hidden_layers": 2}
    assert text_config({"hidden_size": 8, "text_config": None}) == {"hidden_size": 8, "text_config": None}
    # a config.json that states no num_hidden_layers: its config class's default, unknown here
    facts = read_moe_facts({"n_routed_experts": 8, "num_experts_per_tok": 2}, "config.json")
    assert (facts.num_moe_layers, facts.unstated()) == (None, ["layers"])
    judged = check_settings(replace(GOOD, moe_facts=facts))
    assert list(judged) == []
    assert [str(v) for v in judged.unjudged] == [
        "cannot judge: moe-layers: config.json states no num_hidden_layers, so vLLM reads its config "
        "class's default; state num_hidden_layers in config.json"
    ]
    # every MoE fact broken: MoeFacts.errors (simulate's and the cost estimate's refusal) is what the
    # registry's rule functions say, one by one
    bad = read_moe_facts(
        {"num_local_experts": "8", "num_experts_per_tok": 0, "n_group": 0, "num_hidden_layers": 0}, "c.json"
    )
    judged = check_settings(replace(GOOD, moe_facts=bad))
    assert [v.rule for v in judged] == list(MOE_FACT_RULES)
    assert moe_fact_errors(bad) == [v.message for v in judged]
    assert judged[-1].message == (
        "c.json: num_hidden_layers=0 must be an integer in [1, 2147483647] (the decoder layers; EPLB "
        "balances the routed experts of their MoE layers); fix: correct num_hidden_layers"
    )
    # start-up: the very count vLLM's DeepSeek-V3 class makes (num_hidden_layers - first_k_dense_replace)
    assert _start_up(tmp_path, monkeypatch, {**DEEPSEEK_V3, "num_hidden_layers": 4}) == []
    facts = read_moe_facts({**DEEPSEEK_V3, "num_hidden_layers": 4}, "config.json")
    assert facts.num_moe_layers == 3
    # a DeepSeek-V3 config.json without first_k_dense_replace: vLLM builds no MoE layer of 3 (its config
    # class's default is 3), which passed start-up (served without EPLB); start-up reads the hf_config
    config = {k: v for k, v in DEEPSEEK_V3.items() if k != "first_k_dense_replace"}
    assert _start_up(tmp_path, monkeypatch, config) == [
        f"[moe-layers] the config of model {tmp_path}: num_hidden_layers=3, first_k_dense_replace=3 "
        f"{NO_MOE_LAYER}; fix: serve it without --enable-eplb, or correct num_hidden_layers, "
        "first_k_dense_replace"
    ]


def test_architectures_as_one_string_is_refused_as_vllm_refuses_it(tmp_path, monkeypatch):
    """``"architectures": "DeepseekV3ForCausalLM"`` (a string, not a list) passed ``moe-model-class``: read
    as a tuple it was its characters. transformers keeps the string, and vLLM's ModelConfig refuses it
    (pydantic: ``architectures: Input should be a valid list``) before anything runs, so the rule refuses
    every value that is not a list of class names, saying how to write it."""
    import pydantic

    config = {**DEEPSEEK_V3, "architectures": "DeepseekV3ForCausalLM"}
    with pytest.raises(pydantic.ValidationError, match="Input should be a valid list"):
        _start_up(tmp_path, monkeypatch, config)
    judged = check_settings(replace(GOOD, model_architectures="DeepseekV3ForCausalLM"))
    assert [str(v) for v in judged] == [
        "[moe-model-class] architectures='DeepseekV3ForCausalLM' must be a list of model class names "
        "(vLLM's ModelConfig refuses anything else: 'Input should be a valid list'); fix: write "
        '"architectures": ["DeepseekV3ForCausalLM"]'
    ]
    judged = check_settings(replace(GOOD, model_architectures=["DeepseekV3ForCausalLM", 7]))
    assert [str(v) for v in judged] == [
        "[moe-model-class] architectures=['DeepseekV3ForCausalLM', 7] must be a list of model class names "
        "(vLLM's ModelConfig refuses anything else: 'Input should be a valid string'); fix: write each "
        "entry as a string"
    ]
    assert judged.unjudged == []


def test_the_one_reader_derives_each_setting_once_from_vllms_config_paths():
    """Issue 45: inductor freezing, an MTP draft as MoE, eager modes and the balanced models' names are
    derived once, by :func:`read_settings`, from a mapping keyed by vLLM's config paths."""
    from ascend_eplb.integration.settings_reader import read_settings

    values = {
        "parallel_config.enable_eplb": True,
        "parallel_config.eplb_config.window_size": 7,
        "additional_config.eplb_config.policy": "migration_aware",
        "additional_config.gate_eplb": True,
        "compilation_config.mode": 3,
        "compilation_config.cudagraph_mode": "PIECEWISE",
        "compilation_config.inductor_compile_config": {"freezing": True},
        "speculative_config.method": "mtp",
        "speculative_config.draft_model_config.model": "org/m",
        "model_config.model": "org/m",
    }
    s, violations = read_settings(values, {"DYNAMIC_EPLB": "1"})
    assert violations == []
    assert (s.enable_eplb, s.window_size, s.step_interval) == (True, 7, 3000)
    assert (s.ascend_eplb_config, s.legacy_top_level_keys) == (
        {"policy": "migration_aware"},
        {"gate_eplb": True},
    )
    assert (s.compilation_mode, s.cudagraph_mode, s.inductor_freezing) == ("VLLM_COMPILE", "PIECEWISE", True)
    assert (s.speculative_draft_is_moe, s.served_models) == (True, ("org/m (draft)", "org/m"))
    assert s.environment == {"DYNAMIC_EPLB": "1"}
    eager, _ = read_settings({**values, "model_config.enforce_eager": True}, {})
    assert (eager.compilation_mode, eager.cudagraph_mode, eager.inductor_freezing) == ("NONE", "NONE", True)
    dense = {**values, "speculative_config.method": "ngram", "compilation_config.inductor_compile_config": {}}
    s, _ = read_settings(dense, {"TORCHINDUCTOR_FREEZING": "1"})
    assert (s.speculative_draft_is_moe, s.served_models, s.inductor_freezing) == (False, ("org/m",), True)
    # A value of the wrong type is refused by path and read as its default.
    s, violations = read_settings({"parallel_config.tensor_parallel_size": "2", "use_v2_model_runner": 1}, {})
    assert [str(v) for v in violations] == [
        "[schema] the config file.use_v2_model_runner=1 must be a JSON boolean (true or false)",
        "[schema] parallel_config.tensor_parallel_size='2' must be an integer in [1, 2147483647]",
    ]
    assert (s.tensor_parallel_size, s.use_v2_model_runner) == (1, True)


def test_the_config_files_schema_is_the_readers_mapping():
    """The file's sections and keys are the reader's paths nested by their dots."""
    from ascend_eplb.integration.settings import V1_EPLB_ENV_SWITCHES, V1_EPLB_KEYS
    from ascend_eplb.integration.settings_reader import FILE_SCHEMA, file_sections

    sections = file_sections()
    assert list(sections) == [
        "",
        "parallel_config",
        "parallel_config.eplb_config",
        "additional_config",
        "additional_config.eplb_config",
        "model",
        "compilation_config",
        "speculative_config",
        "environment",
    ]
    assert sections[""] == {
        "use_v2_model_runner", "parallel_config", "additional_config", "model", "compilation_config",
        "speculative_config", "environment",
    }  # fmt: skip
    assert sections["parallel_config"] == {
        "enable_eplb", "enable_expert_parallel", "enable_elastic_ep", "enable_dbo", "tensor_parallel_size",
        "prefill_context_parallel_size", "data_parallel_size", "eplb_config",
    }  # fmt: skip
    assert sections["parallel_config.eplb_config"] == {
        "window_size", "step_interval", "num_redundant_experts", "use_async", "policy", "communicator",
        "log_balancedness", "log_balancedness_interval", "enable_migration_batching",
    }  # fmt: skip
    assert sections["additional_config"] == {*V1_EPLB_KEYS, "eplb_config"}
    assert sections["additional_config.eplb_config"] == {"*"}
    assert sections["model"] == {"num_logical_experts", "num_moe_layers", "quantization"}
    assert sections["compilation_config"] == {"cudagraph_mode", "mode", "inductor_compile_config"}
    assert sections["speculative_config"] == {
        "method",
        "draft_is_moe",
        "draft_architectures",
        "draft_model_type",
    }
    assert sections["environment"] == set(V1_EPLB_ENV_SWITCHES)
    assert len(FILE_SCHEMA) == 42  # 1 + 7 + 9 parallel + 12 + 1 additional + 3 + 3 + 4 + 2
