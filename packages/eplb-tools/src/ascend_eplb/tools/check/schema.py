"""This package's config-file schema (``ascend-eplb check CONFIG.json``; the integration README
shows it) read into the rules' :class:`~ascend_eplb.integration.settings.EplbSettings`, each key that breaks
the schema a ``schema`` violation naming it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ascend_eplb.control.values import INT32_MAX, is_int
from ascend_eplb.integration.rules import Violation
from ascend_eplb.integration.settings import (
    COMPILATION_MODES,
    V1_EPLB_ENV_SWITCHES,
    V1_EPLB_KEYS,
    EplbSettings,
)
from ascend_eplb.tools.check.engine_args import default_cudagraph_mode
from ascend_eplb.tools.check.report import short

__all__ = ["FILE_KEYS", "V2_RUNNER_SWITCH", "is_engine_args", "settings_from_file_dict", "v2_runner_switch"]

#: vLLM's switch of the model runner; unset: Model Runner V2, vLLM 0.33.0's default.
V2_RUNNER_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"


def v2_runner_switch(environ: Mapping[str, str]) -> tuple[bool | None, Violation | None]:
    """``VLLM_USE_V2_MODEL_RUNNER`` as vLLM 0.33.0 reads it (``envs.maybe_convert_bool``:
    ``bool(int(value))``): ``(None, None)`` unset; ``(value, None)``; ``(None, violation)`` for a value
    ``int()`` refuses (``true``, ``banana``), on which vLLM's start-up raises a bare ``ValueError``."""
    raw = environ.get(V2_RUNNER_SWITCH)
    if raw is None:
        return None, None
    try:
        return bool(int(raw)), None
    except ValueError:
        return None, Violation(
            "model-runner-v2",
            f"{V2_RUNNER_SWITCH}={short(raw)} is not an integer: vLLM reads it with int() (bool(int(value))) "
            f"and its start-up fails with a ValueError; fix: set {V2_RUNNER_SWITCH}=1, or unset it (Model "
            "Runner V2, vLLM 0.33.0's default)",
        )


#: Every field at its default: what a config file that omits a setting means.
_DEFAULTS = EplbSettings()

#: The top-level keys of the schema.
FILE_KEYS = {
    "use_v2_model_runner",
    "parallel_config",
    "additional_config",
    "model",
    "compilation_config",
    "speculative_config",
    "environment",
}
_PARALLEL_KEYS = {
    "enable_eplb",
    "enable_expert_parallel",
    "enable_elastic_ep",
    "enable_dbo",
    "tensor_parallel_size",
    "prefill_context_parallel_size",
    "data_parallel_size",
    "eplb_config",
}
_EPLB_KEYS = {
    "window_size",
    "step_interval",
    "num_redundant_experts",
    "use_async",
    "policy",
    "communicator",
    "log_balancedness",
    "log_balancedness_interval",
    "enable_migration_batching",
}
_MODEL_KEYS = {"num_logical_experts", "num_moe_layers", "quantization"}


def _check_keys(section: str, value: Any, allowed: set[str], out: list[Violation]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        out.append(Violation("schema", f"{section} must be a JSON object, got {type(value).__name__}"))
        return {}
    extra = sorted(set(value) - allowed)
    if extra:
        out.append(Violation("schema", f"unknown key(s) {extra} in {section}; allowed: {sorted(allowed)}"))
    return value


def settings_from_file_dict(
    data: Any, environ: Mapping[str, str] | None = None
) -> tuple[EplbSettings, list[Violation]]:
    """Settings from a parsed config file (schema in the package README) plus schema violations."""
    out: list[Violation] = []
    top = _check_keys("the config file", data, FILE_KEYS, out)
    pc = _check_keys("parallel_config", top.get("parallel_config"), _PARALLEL_KEYS, out)
    ec = _check_keys("parallel_config.eplb_config", pc.get("eplb_config"), _EPLB_KEYS, out)
    additional = _check_keys(
        "additional_config", top.get("additional_config"), set(V1_EPLB_KEYS) | {"eplb_config"}, out
    )
    ascend = additional.get("eplb_config", {})  # not `or {}`: false, 0 or "" is refused, not read as {}
    if not isinstance(ascend, dict):
        out.append(
            Violation(
                "schema",
                f"additional_config.eplb_config={short(ascend)} must be a JSON object (of the Ascend keys), "
                f"got {type(ascend).__name__}",
            )
        )
        ascend = {}
    model = _check_keys("model", top.get("model"), _MODEL_KEYS, out)
    compilation = _check_keys(
        "compilation_config",
        top.get("compilation_config"),
        {"cudagraph_mode", "mode", "inductor_compile_config"},
        out,
    )
    spec = _check_keys(
        "speculative_config",
        top.get("speculative_config"),
        {"method", "draft_is_moe", "draft_architectures", "draft_model_type"},
        out,
    )
    env_file = _check_keys("environment", top.get("environment"), set(V1_EPLB_ENV_SWITCHES), out)
    env = dict(os.environ if environ is None else environ)
    env.update({k: str(v) for k, v in env_file.items()})
    # A file that omits use_v2_model_runner runs as the environment says (vLLM's VllmConfig reads
    # VLLM_USE_V2_MODEL_RUNNER): `VLLM_USE_V2_MODEL_RUNNER=0 ascend-eplb check CONFIG` said OK.
    v2_env, v2_error = v2_runner_switch(env)
    if v2_error is not None:
        out.append(v2_error)

    def cudagraph_mode(v: Any) -> str:
        if v is None:  # absent or null: vLLM's default for the file's settings
            return default_cudagraph_mode()
        if not isinstance(v, str) or not v:
            out.append(
                Violation(
                    "schema", f"compilation_config.cudagraph_mode={short(v)} must be a mode name (a string)"
                )
            )
            # Not the default mode: the file stated one, just not a readable one.
            unknown["cudagraph_mode"] = "compilation_config.cudagraph_mode is not a mode name"
            return str(v)
        return v

    def compilation_mode(v: Any) -> str:
        if v is None:  # absent or null: vLLM's default (its CPU platform makes it DYNAMO_TRACE_ONCE)
            return "VLLM_COMPILE"
        if is_int(v) and 0 <= v < len(COMPILATION_MODES):
            return COMPILATION_MODES[v]
        if isinstance(v, str) and v.upper() in COMPILATION_MODES:
            return v.upper()
        out.append(
            Violation(
                "schema",
                f"compilation_config.mode={short(v)} must be one of vLLM's modes, a name of "
                f"{list(COMPILATION_MODES)} or its number 0-3",
            )
        )
        unknown["compilation_mode"] = "compilation_config.mode is not a mode"
        return str(v)

    inductor = compilation.get("inductor_compile_config") or {}
    if not isinstance(inductor, dict):
        out.append(
            Violation(
                "schema", f"compilation_config.inductor_compile_config={short(inductor)} must be an object"
            )
        )
        inductor = {}

    def integer(section: str, d: dict[str, Any], key: str, default: int) -> int:
        v = d.get(key, default)
        if not is_int(v) or not 1 <= v <= INT32_MAX:
            rule = f"must be an integer in [1, {INT32_MAX}]"
            out.append(Violation("schema", f"{section}.{key}={short(v)} {rule}"))
            return default
        return v

    def boolean(section: str, d: dict[str, Any], key: str, default: bool) -> bool:
        # JSON true/false only: bool("false") is True, so a quoted value would flip the switch.
        v = d.get(key, default)
        if not isinstance(v, bool):
            out.append(Violation("schema", f"{section}.{key}={v!r} must be a JSON boolean (true or false)"))
            return default
        return v

    integer("parallel_config.eplb_config", ec, "log_balancedness_interval", 1)
    boolean("parallel_config.eplb_config", ec, "enable_migration_batching", False)

    experts = model.get("num_logical_experts")
    if experts is not None and (not is_int(experts) or not 1 <= experts <= INT32_MAX):
        rule = f"must be an integer in [1, {INT32_MAX}]"
        out.append(Violation("schema", f"model.num_logical_experts={short(experts)} {rule}"))
        experts = None
    layers = model.get("num_moe_layers")
    if layers is not None and (not is_int(layers) or not 1 <= layers <= INT32_MAX):
        rule = f"must be an integer in [1, {INT32_MAX}]"
        out.append(Violation("schema", f"model.num_moe_layers={short(layers)} {rule}"))
        layers = None
    quant = model.get("quantization", "bf16")
    unknown: dict[str, str] = {}
    if layers is None:
        unknown["num_moe_layers"] = (
            "the MoE layer count is unknown (model.num_moe_layers is not given); give model.num_moe_layers"
        )
    if experts is None:
        given = model.get("num_logical_experts")
        said = (
            "model.num_logical_experts is not given"
            if given is None
            else f"model.num_logical_experts={short(given)} is invalid, see [schema]"
        )
        unknown["num_logical_experts"] = (
            f"the routed-expert count is unknown ({said}); pass --num-experts / model.num_logical_experts"
        )
    if isinstance(quant, str) and quant.lower() == "ascend":
        unknown["quantization"] = (
            "quantization 'ascend' takes the routed experts' format from msModelSlim's "
            "quant_model_description*.json, which a config file does not carry; pass --quantization FORMAT"
        )
    draft_is_moe = boolean("speculative_config", spec, "draft_is_moe", False) or "mtp" in str(
        spec.get("method") or ""
    )
    draft_architectures = spec.get("draft_architectures")
    said = " is not given"
    if draft_architectures is not None and not (
        isinstance(draft_architectures, list)
        and draft_architectures
        and all(isinstance(n, str) and n for n in draft_architectures)
    ):
        out.append(
            Violation(
                "schema",
                f"speculative_config.draft_architectures={short(draft_architectures)} must be a non-empty "
                'list of model class names (the draft config\'s architectures, e.g. ["DeepSeekMTPModel"])',
            )
        )
        said = f"={short(draft_architectures)} is invalid, see [schema]"
        draft_architectures = None
    if spec and draft_is_moe and draft_architectures is None:
        unknown["speculative_draft_architectures"] = (
            f"the MoE draft's model class is unknown (speculative_config.draft_architectures{said}; "
            "vLLM derives an MTP draft's from the target's config, e.g. DeepSeek-V3's DeepSeekMTPModel); "
            "give speculative_config.draft_architectures, or check a vllm serve command line with a local "
            "model folder"
        )
    draft_model_type = spec.get("draft_model_type")
    settings = EplbSettings(
        enable_eplb=boolean("parallel_config", pc, "enable_eplb", False),
        use_v2_model_runner=boolean(
            "the config file", top, "use_v2_model_runner", True if v2_env is None else v2_env
        ),
        enable_expert_parallel=boolean("parallel_config", pc, "enable_expert_parallel", False),
        enable_elastic_ep=boolean("parallel_config", pc, "enable_elastic_ep", False),
        enable_dbo=boolean("parallel_config", pc, "enable_dbo", False),
        tensor_parallel_size=integer("parallel_config", pc, "tensor_parallel_size", 1),
        prefill_context_parallel_size=integer("parallel_config", pc, "prefill_context_parallel_size", 1),
        data_parallel_size=integer("parallel_config", pc, "data_parallel_size", 1),
        window_size=ec.get("window_size", _DEFAULTS.window_size),
        step_interval=ec.get("step_interval", _DEFAULTS.step_interval),
        num_redundant_experts=ec.get("num_redundant_experts", _DEFAULTS.num_redundant_experts),
        use_async=ec.get("use_async", _DEFAULTS.use_async),
        policy=ec.get("policy", _DEFAULTS.policy),
        communicator=ec.get("communicator", _DEFAULTS.communicator),
        log_balancedness=boolean(
            "parallel_config.eplb_config", ec, "log_balancedness", _DEFAULTS.log_balancedness
        ),
        ascend_eplb_config=dict(ascend),
        legacy_top_level_keys={k: additional[k] for k in V1_EPLB_KEYS if k in additional},
        environment={k: env[k] for k in V1_EPLB_ENV_SWITCHES if k in env},
        num_logical_experts=experts,
        num_moe_layers=layers,
        quantization=str(quant) if quant is not None else None,
        cudagraph_mode=cudagraph_mode(compilation.get("cudagraph_mode", None)),
        compilation_mode=compilation_mode(compilation.get("mode", None)),
        inductor_freezing=bool(inductor.get("freezing")) or env.get("TORCHINDUCTOR_FREEZING", "0") == "1",
        inductor_compile_config=dict(inductor),
        speculative_method=spec.get("method") if spec else None,
        speculative_draft_is_moe=draft_is_moe,
        speculative_draft_architectures=tuple(draft_architectures) if draft_architectures else None,
        speculative_draft_model_type=draft_model_type if isinstance(draft_model_type, str) else None,
        unknown_facts=unknown,
    )
    return settings, out


def is_engine_args(data: Any) -> bool:
    """A flat mapping of engine arguments (``vllm serve --config``), not this package's nested schema.

    The two share key names (``model``, ``additional_config``, ``compilation_config``,
    ``speculative_config``): a mapping of only those is engine arguments when its ``model`` is a str
    (vLLM's model id or folder; the schema's ``model`` is an object)."""
    return (
        isinstance(data, dict)
        and "parallel_config" not in data
        and not isinstance(data.get("model"), dict)
        and (not set(data) <= FILE_KEYS or isinstance(data.get("model"), str))
    )
