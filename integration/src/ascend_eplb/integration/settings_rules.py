"""The rules that judge the EPLB settings' own keys and values, one small function per rule id.

The keys given without EPLB, Model Runner V2, V1 controls and switches, the ascend keys, the placement
policy and its gate, the load estimate, the replica split, async, the communicator, expert parallelism,
the window, the step interval and the redundant experts: :data:`SETTINGS_RULES`, the first rules of
:data:`ascend_eplb.integration.rules.RULES` in report order. Each returns None or the violated rule's
message naming the value and the fix; none lacks a fact (the settings hold every key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ascend_eplb.control.policy_config import (
    PolicySettings,
    load_estimate_error,
    min_balancedness_gain_error,
    policy_error,
    target_balancedness_error,
)
from ascend_eplb.control.split_config import replica_split_error
from ascend_eplb.control.values import INT32_MAX, is_int
from ascend_eplb.integration.model_facts import MAX_REDUNDANT_EXPERTS, shown
from ascend_eplb.integration.settings import (
    ASCEND_V2_KEYS,
    LOAD_COLLECTION_PHASES,
    POLICY_KEYS,
    SUPPORTED_COMMUNICATORS,
    V1_EPLB_ENV_SWITCHES,
    V1_EPLB_KEYS,
    EplbSettings,
)
from ascend_eplb.integration.switches import is_true

__all__ = ["SETTINGS_RULES", "SettingsRule", "redundant_ok"]

#: A settings rule: None (the rule holds or does not apply) or the violated rule's message.
SettingsRule = Callable[[EplbSettings], "str | None"]
#: Rule id -> the function that judges it, in report order. Filled by :func:`_rule` below.
SETTINGS_RULES: dict[str, SettingsRule] = {}


def _rule(rule_id: str) -> Callable[[SettingsRule], SettingsRule]:
    """Register the decorated function as the judge of ``rule_id`` (at the end of :data:`SETTINGS_RULES`)."""

    def register(fn: SettingsRule) -> SettingsRule:
        if rule_id in SETTINGS_RULES:
            raise ValueError(f"rule id {rule_id!r} is registered twice")
        SETTINGS_RULES[rule_id] = fn
        return fn

    return register


@_rule("phase-without-eplb")
def _phase_without_eplb(s: EplbSettings) -> str | None:
    phase = s.load_collection_phase
    if s.enable_eplb or phase == "all":
        return None
    return (
        f"eplb_config.load_collection_phase={phase!r} needs Model Runner V2 EPLB, but "
        "enable_eplb=False; fix: pass --enable-eplb or remove load_collection_phase"
    )


@_rule("placement-without-eplb")
def _placement_without_eplb(s: EplbSettings) -> str | None:
    if s.enable_eplb or s.initial_placement is None:
        return None
    return (
        f"eplb_config.initial_placement={s.initial_placement!r} needs Model Runner V2 EPLB, but "
        "enable_eplb=False; fix: pass --enable-eplb or remove initial_placement (vLLM Ascend's static "
        "placement without EPLB reads expert_map_path, a part of the same file)"
    )


@_rule("policy-without-eplb")
def _policy_without_eplb(s: EplbSettings) -> str | None:
    defaults = PolicySettings()
    judge = {
        "policy": policy_error,
        "min_balancedness_gain": min_balancedness_gain_error,
        "target_balancedness": target_balancedness_error,
        "load_estimate": load_estimate_error,
    }
    # A key counts as given unless it is its default, validly: `false` equals the gain's 0.0 but is no
    # number (refused with EPLB on), so it is named here too.
    given = [
        k
        for k in POLICY_KEYS
        if k in s.ascend_eplb_config
        and (judge[k](v := s.ascend_eplb_config[k]) is not None or v != getattr(defaults, k))
    ]
    if s.enable_eplb or not given:
        return None
    shown_keys = ", ".join(f"eplb_config.{k}={s.ascend_eplb_config[k]!r}" for k in given)
    return (
        f"{shown_keys}: the placement policy, the gain gate and the load estimate need Model Runner V2 "
        f"EPLB, but enable_eplb=False; fix: pass --enable-eplb or remove {', '.join(given)}"
    )


@_rule("split-without-eplb")
def _split_without_eplb(s: EplbSettings) -> str | None:
    if s.enable_eplb or s.replica_split == "equal":
        return None
    return (
        f"eplb_config.replica_split={s.replica_split!r} needs Model Runner V2 EPLB (the split is among the "
        "replicas EPLB places), but enable_eplb=False; fix: pass --enable-eplb or remove replica_split"
    )


@_rule("model-runner-v2")
def _model_runner_v2(s: EplbSettings) -> str | None:
    if s.use_v2_model_runner:
        return None
    return (
        "enable_eplb=True with use_v2_model_runner=False: upstream EPLB is supported by Model "
        "Runner V2 only; fix: set VLLM_USE_V2_MODEL_RUNNER=1 (or use the V1 dynamic_eplb path "
        "without --enable-eplb)"
    )


@_rule("v1-controls")
def _v1_controls(s: EplbSettings) -> str | None:
    where = [f"additional_config.eplb_config.{k}" for k in V1_EPLB_KEYS if k in s.ascend_eplb_config]
    where += [f"additional_config.{k}" for k in V1_EPLB_KEYS if k in s.legacy_top_level_keys]
    if not where:
        return None
    static = (
        "; a static placement (expert_map_path) is eplb_config.initial_placement under V2, a file of "
        "ascend-eplb plan --export-expert-map"
        if "expert_map_path" in s.ascend_eplb_config or "expert_map_path" in s.legacy_top_level_keys
        else ""
    )
    return (
        f"Model Runner V1 EPLB controls cannot be mixed with V2 EPLB: got {', '.join(where)}; "
        "fix: remove them and use --eplb-config (window_size, step_interval, "
        f"num_redundant_experts); the Ascend V2 keys are {', '.join(ASCEND_V2_KEYS)}{static}"
    )


@_rule("v1-env")
def _v1_env(s: EplbSettings) -> str | None:
    env_on = [k for k in V1_EPLB_ENV_SWITCHES if is_true(s.environment.get(k))]
    if not env_on:
        return None
    shown = ", ".join(f"{k}={s.environment[k]!r}" for k in env_on)
    return (
        f"Model Runner V1 EPLB environment switches cannot be mixed with V2 EPLB: got {shown}; "
        f"fix: unset {' and '.join(env_on)}"
    )


@_rule("unknown-ascend-key")
def _unknown_ascend_key(s: EplbSettings) -> str | None:
    unknown = sorted(k for k in s.ascend_eplb_config if k not in ASCEND_V2_KEYS and k not in V1_EPLB_KEYS)
    if not unknown:
        return None
    return (
        f"unknown additional_config.eplb_config key(s) {unknown}; fix: the Ascend Model Runner V2 keys are "
        f"{list(ASCEND_V2_KEYS)}"
    )


@_rule("load-collection-phase")
def _load_collection_phase(s: EplbSettings) -> str | None:
    phase = s.load_collection_phase
    if phase in LOAD_COLLECTION_PHASES:
        return None
    return (
        f"eplb_config.load_collection_phase={phase!r} is not one of {list(LOAD_COLLECTION_PHASES)}; "
        "fix: use 'all', 'prefill' or 'decode'"
    )


@_rule("placement-policy")
def _placement_policy(s: EplbSettings) -> str | None:
    reason = policy_error(s.placement_policy)
    if reason is None:
        return None
    return (
        f"{reason}; fix: use 'default' (upstream's DefaultEplbPolicy), 'migration_aware' (the fewest "
        "expert moves from the placement in force) or 'split_aware' (the same, replicas placed to link ranks "
        "for the batch split)"
    )


@_rule("min-balancedness-gain")
def _min_balancedness_gain(s: EplbSettings) -> str | None:
    reason = min_balancedness_gain_error(s.min_balancedness_gain)
    if reason is None:
        return None
    return f"{reason}; fix: set a small gain such as 0.01, or 0"


@_rule("target-balancedness")
def _target_balancedness(s: EplbSettings) -> str | None:
    reason = target_balancedness_error(s.target_balancedness)
    if reason is None:
        return None
    return f"{reason}; fix: set a target such as 0.95, or remove target_balancedness"


@_rule("load-estimate")
def _load_estimate(s: EplbSettings) -> str | None:
    reason = load_estimate_error(s.load_estimate)
    if reason is None:
        return None
    return (
        f"{reason}; fix: use 'window' (upstream's: plan on the closed window) or 'pooled' (plan on the "
        "windows since the last shift of the load)"
    )


@_rule("replica-split")
def _replica_split(s: EplbSettings) -> str | None:
    reason = replica_split_error(s.replica_split)
    if reason is None:
        return None
    return (
        f"{reason}; fix: use 'equal' (each replica an equal share, today's rule), 'batch' (split each batch "
        "by its own load; on split rows one all-gather of E counts per MoE layer) or 'batch_local' (on split "
        "rows each rank splits its own rows)"
    )


@_rule("async-only")
def _async_only(s: EplbSettings) -> str | None:
    if s.use_async is True:
        return None
    return (
        f"eplb_config.use_async={s.use_async!r}: only asynchronous EPLB is supported (no silent "
        "switch); fix: set --eplb-config.use_async=true"
    )


@_rule("communicator")
def _communicator(s: EplbSettings) -> str | None:
    if s.communicator is None or s.communicator in SUPPORTED_COMMUNICATORS:
        return None
    return (
        f"eplb_config.communicator={s.communicator!r} is not supported on Ascend; fix: leave it "
        "unset or set 'torch_gloo' (AscendGlooEplbCommunicator, CPU staging over Gloo)"
    )


@_rule("policy")
def _policy(s: EplbSettings) -> str | None:
    if s.policy == "default":
        return None
    return (
        f"eplb_config.policy={s.policy!r}: only vLLM's 'default' policy is supported; fix: set "
        "policy='default'"
    )


@_rule("elastic-ep")
def _elastic_ep(s: EplbSettings) -> str | None:
    if not s.enable_elastic_ep:
        return None
    return "enable_elastic_ep=True is not supported with Ascend EPLB; fix: disable elastic EP"


@_rule("expert-parallel")
def _expert_parallel(s: EplbSettings) -> str | None:
    if s.enable_expert_parallel:
        return None
    return "enable_expert_parallel=False: EPLB needs expert parallelism; fix: pass --enable-expert-parallel"


def _too_large(name: str, value: Any) -> str | None:
    if is_int(value) and value > INT32_MAX:
        return (
            f"eplb_config.{name}={value!r} exceeds {INT32_MAX} (int32 device tables and load counters); "
            f"fix: set --eplb-config.{name} to at most {INT32_MAX}"
        )
    return None


def _positive(name: str, value: Any) -> str | None:
    if is_int(value) and value > 0:
        return _too_large(name, value)
    return (
        f"eplb_config.{name}={value!r} must be a positive integer; fix: set "
        f"--eplb-config.{name} to a value > 0"
    )


@_rule("window-size")
def _window_size(s: EplbSettings) -> str | None:
    return _positive("window_size", s.window_size)


@_rule("step-interval")
def _step_interval(s: EplbSettings) -> str | None:
    return _positive("step_interval", s.step_interval)


def redundant_ok(s: EplbSettings) -> bool:
    """The rules that read R judge only an R the ``redundant-experts`` rule accepts."""
    return is_int(s.num_redundant_experts) and 0 <= s.num_redundant_experts <= MAX_REDUNDANT_EXPERTS


@_rule("redundant-experts")
def _redundant_experts(s: EplbSettings) -> str | None:
    if redundant_ok(s):
        return None
    if is_int(s.num_redundant_experts) and s.num_redundant_experts > MAX_REDUNDANT_EXPERTS:
        return (
            f"eplb_config.num_redundant_experts={shown(s.num_redundant_experts)} is more than "
            f"{MAX_REDUNDANT_EXPERTS}, the most upstream's EplbState takes (its add_model asserts "
            f"num_redundant_experts <= {MAX_REDUNDANT_EXPERTS} on every rank); fix: set "
            f"--eplb-config.num_redundant_experts to at most {MAX_REDUNDANT_EXPERTS}"
        )
    return (
        f"eplb_config.num_redundant_experts={s.num_redundant_experts!r} must be an integer >= 0; fix: set "
        "--eplb-config.num_redundant_experts to 0 or more"
    )
