"""Start-up validation of Model Runner V2 EPLB on Ascend: a ``VllmConfig`` read and judged.

Runs before any weight or buffer is allocated (vLLM Ascend calls it from its platform's
``check_and_update_config``): :func:`validate_eplb_config` reads the settings from the ``VllmConfig``
(:func:`settings_from_vllm_config`; where each comes from: README "Where start-up reads each setting"),
judges them by :func:`ascend_eplb.integration.rules.check_settings` (the one ``ascend-eplb check`` calls)
and raises one :class:`EplbConfigError` listing every violated rule with the value and the fix. Imports
no vLLM, YAML or argument parser at module level and allocates nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ascend_eplb.integration.model_facts import read_moe_facts
from ascend_eplb.integration.rules import Violation, check_settings
from ascend_eplb.integration.settings import V1_EPLB_ENV_SWITCHES, V1_EPLB_KEYS, EplbSettings

__all__ = [
    "ASCEND_QUANT_TYPES",
    "DTYPE_FORMATS",
    "EplbConfigError",
    "as_dict",
    "ascend_format_name",
    "experts_format",
    "parallel_and_eplb_fields",
    "quantization_format_name",
    "settings_from_vllm_config",
    "validate_eplb_config",
]

#: msModelSlim quant types of routed-expert weights (vllm_ascend quantization) -> quant_views format names.
ASCEND_QUANT_TYPES = {
    "W8A8_DYNAMIC": "w8a8_dynamic",
    "W8A8": "w8a8_dynamic",
    "W4A8_DYNAMIC": "w4a8_dynamic",
    "W8A8_MXFP8": "mxfp8",
    "W4A4_MXFP4": "mxfp4",
    "W4A16": "w4a16",
    "W4A16_MXFP4": "w4a16_mxfp4",
    "W4A8_MXFP4": "w4a8_mxfp4",
}
#: Checkpoint dtypes -> quant_views format names (an unquantized model's routed experts).
DTYPE_FORMATS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


class EplbConfigError(ValueError):
    """Every rule the EPLB configuration violates, in one error.

    Attributes:
        violations: the violated rules, in rule order.
    """

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        lines = [f"{len(self.violations)} EPLB configuration rule(s) violated:"]
        lines += [f"  - {v}" for v in self.violations]
        super().__init__("\n".join(lines))


def as_dict(obj: Any) -> dict[str, Any]:
    """``obj`` (None, a mapping, or an object with ``__dict__``) as a dict, the way vLLM Ascend's
    ``AscendConfig`` reads ``additional_config``; ``TypeError`` naming the type otherwise."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    raise TypeError(f"additional_config.eplb_config must be a mapping, got {type(obj).__name__}")


def quantization_format_name(vllm_config: Any) -> str | None:
    """The quant_views format name of the model's routed experts (None: no model config to read).

    Raises:
        EplbConfigError: an msModelSlim description whose routed experts mix quant types.
    """
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    method = getattr(model_config, "quantization", None)
    if method is None:
        dtype = str(getattr(model_config, "dtype", "bfloat16")).removeprefix("torch.")
        return DTYPE_FORMATS.get(dtype, dtype)
    description = getattr(getattr(vllm_config, "quant_config", None), "quant_description", None)
    if isinstance(description, Mapping):
        name = experts_format(description)
        if name is not None:
            return name
    return str(method).lower()


def ascend_format_name(name: str) -> str:
    """A quant_views format name, or an msModelSlim quant type (``W8A8_DYNAMIC``) mapped to one by
    :data:`ASCEND_QUANT_TYPES`; any other name lower-cased."""
    return ASCEND_QUANT_TYPES.get(name.upper(), name.lower())


def experts_format(description: Mapping[Any, Any]) -> str | None:
    """The format of an msModelSlim description's routed-expert weights (None: it has none).

    Raises:
        EplbConfigError: the routed experts mix quant types.
    """
    types = sorted(
        {
            str(v).upper()
            for k, v in description.items()
            if ".experts." in str(k) and str(k).endswith("weight")
        }
    )
    if len(types) > 1:
        raise EplbConfigError(
            [Violation("quantization", f"routed experts mix quant types {types}; fix: quantize uniformly")]
        )
    return ascend_format_name(types[0]) if types else None


def parallel_and_eplb_fields(
    parallel: Any, eplb_config: Any, additional: Mapping[str, Any], env: Mapping[str, str]
) -> dict[str, Any]:
    """The settings a ``ParallelConfig`` and vLLM's ``EngineArgs`` name alike (same field names), with
    the ``EPLBConfig``, the Ascend ``additional_config`` and the V1 switches of the environment."""
    return {
        "enable_expert_parallel": bool(parallel.enable_expert_parallel),
        "enable_elastic_ep": bool(getattr(parallel, "enable_elastic_ep", False)),
        "enable_dbo": bool(getattr(parallel, "enable_dbo", False)),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "prefill_context_parallel_size": getattr(parallel, "prefill_context_parallel_size", 1),
        "data_parallel_size": parallel.data_parallel_size,
        "all2all_backend": getattr(parallel, "all2all_backend", "allgather_reducescatter"),
        "window_size": eplb_config.window_size,
        "step_interval": eplb_config.step_interval,
        "num_redundant_experts": eplb_config.num_redundant_experts,
        "use_async": eplb_config.use_async,
        "policy": eplb_config.policy,
        "communicator": eplb_config.communicator,
        "log_balancedness": eplb_config.log_balancedness,
        "ascend_eplb_config": as_dict(additional.get("eplb_config")),
        "legacy_top_level_keys": {k: additional[k] for k in V1_EPLB_KEYS if k in additional},
        "environment": {k: env[k] for k in V1_EPLB_ENV_SWITCHES if k in env},
    }


def settings_from_vllm_config(vllm_config: Any, environ: Mapping[str, str] | None = None) -> EplbSettings:
    """Extract the settings the rules read from a ``VllmConfig`` (see the module docstring)."""
    pc = vllm_config.parallel_config
    ec = pc.eplb_config
    additional = as_dict(getattr(vllm_config, "additional_config", None))
    model_config = getattr(vllm_config, "model_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    draft_experts = 0
    draft_architectures = draft_model_type = draft_facts = None
    if draft is not None:
        try:
            draft_experts = int(draft.get_num_experts() or 0)
        except Exception:
            draft_experts = 0
        names = getattr(draft, "architectures", None)
        draft_architectures = (tuple(names) if isinstance(names, list) else names) or None
        draft_model_type = getattr(getattr(draft, "hf_config", None), "model_type", None)
        draft_facts = read_moe_facts(
            draft.hf_text_config,
            f"the config of draft model {draft.model}",
            architectures=draft_architectures,
        )
    served = None
    if model_config is not None:
        served = (str(model_config.model),)
        if draft is not None and (draft_experts > 0 or "mtp" in str(getattr(spec, "method", "") or "")):
            # vLLM only with a VllmConfig in hand: ascend-eplb check imports this module without it.
            from vllm.v1.worker.gpu.eplb_utils import eplb_draft_model_name

            served = (eplb_draft_model_name(draft), *served)  # upstream registers the draft first
    env = os.environ if environ is None else environ
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(getattr(compilation, "cudagraph_mode", None), "name", "NONE")
    compilation_mode = getattr(getattr(compilation, "mode", None), "name", "NONE")
    if model_config is not None and getattr(model_config, "enforce_eager", False):
        mode = compilation_mode = "NONE"
    inductor = getattr(compilation, "inductor_compile_config", None) or {}
    freezing = bool(inductor.get("freezing")) or env.get("TORCHINDUCTOR_FREEZING", "0") == "1"
    facts = architectures = None
    if model_config is not None:
        architectures = getattr(model_config, "architectures", None)
        # A list as a tuple; anything else as it is, for the rule to name (never a str's characters).
        architectures = (tuple(architectures) if isinstance(architectures, list) else architectures) or None
        facts = read_moe_facts(
            model_config.hf_text_config,
            f"the config of model {model_config.model}",
            architectures=architectures,
        )
    return EplbSettings(
        enable_eplb=bool(pc.enable_eplb),
        use_v2_model_runner=bool(vllm_config.use_v2_model_runner),
        **parallel_and_eplb_fields(pc, ec, additional, env),
        num_logical_experts=facts.num_logical_experts if facts is not None else None,
        quantization=quantization_format_name(vllm_config) if pc.enable_eplb else None,
        cudagraph_mode=mode,
        compilation_mode=compilation_mode,
        inductor_freezing=freezing,
        inductor_compile_config=dict(inductor),
        speculative_method=getattr(spec, "method", None) if spec is not None else None,
        speculative_draft_is_moe=draft_experts > 0 or "mtp" in str(getattr(spec, "method", "") or ""),
        speculative_draft_architectures=draft_architectures,
        speculative_draft_model_type=draft_model_type,
        speculative_draft_moe_facts=draft_facts,
        served_models=served,
        moe_facts=facts,
        model_architectures=architectures,
    )


def validate_eplb_config(vllm_config: Any) -> EplbSettings:
    """Check a ``VllmConfig`` against every rule of the Ascend Model Runner V2 EPLB support matrix.

    Call it at start-up, before any weight or buffer is allocated. With ``enable_eplb=False`` only the
    "load_collection_phase needs EPLB" rule applies and nothing else is read or imported.

    Returns:
        the resolved settings (``communicator`` unset resolves to ``"torch_gloo"``, no other backend is
        probed); the config object itself is not modified.

    Raises:
        EplbConfigError: one error listing every violated rule with the offending value and the fix.
    """
    settings = settings_from_vllm_config(vllm_config)
    violations = check_settings(settings)
    if violations:
        raise EplbConfigError(violations)
    if violations.unjudged:
        from vllm.logger import init_logger  # see settings_from_vllm_config

        for finding in violations.unjudged:
            init_logger(__name__).warning("EPLB start-up validation: %s", finding)
    if settings.enable_eplb and settings.communicator is None:
        settings.communicator = "torch_gloo"
    return settings
