"""Start-up validation of Model Runner V2 EPLB on Ascend: a ``VllmConfig`` read and judged.

Runs before any weight or buffer is allocated (vLLM Ascend calls it from its platform's
``check_and_update_config``): :func:`validate_eplb_config` reads the settings from the ``VllmConfig``
(:func:`settings_from_vllm_config` maps it into the one reader's mapping,
:func:`~ascend_eplb.integration.settings_reader.read_settings`; where each comes from: README "Where
start-up reads each setting"),
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
from ascend_eplb.integration.settings import EplbSettings
from ascend_eplb.integration.settings_reader import additional_paths, parallel_paths, read_settings

__all__ = [
    "ASCEND_QUANT_TYPES",
    "DTYPE_FORMATS",
    "EplbConfigError",
    "ascend_format_name",
    "experts_format",
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


def settings_from_vllm_config(vllm_config: Any, environ: Mapping[str, str] | None = None) -> EplbSettings:
    """The settings the rules read from a ``VllmConfig``: its values at vLLM's config paths and the
    facts of its model configs, read by the one reader (:func:`read_settings`).

    Raises:
        EplbConfigError: a value the reader refuses (none of a config vLLM built), or the msModelSlim
            description's routed experts mix quant types.
    """
    pc = vllm_config.parallel_config
    values = {
        "use_v2_model_runner": bool(vllm_config.use_v2_model_runner),
        **parallel_paths(pc, pc.eplb_config),
        **additional_paths(getattr(vllm_config, "additional_config", None)),
    }
    compilation = getattr(vllm_config, "compilation_config", None)
    values["compilation_config.cudagraph_mode"] = getattr(
        getattr(compilation, "cudagraph_mode", None), "name", "NONE"
    )
    values["compilation_config.mode"] = getattr(getattr(compilation, "mode", None), "name", "NONE")
    values["compilation_config.inductor_compile_config"] = getattr(
        compilation, "inductor_compile_config", None
    )
    model_config = getattr(vllm_config, "model_config", None)
    values["model.quantization"] = quantization_format_name(vllm_config) if pc.enable_eplb else None
    if model_config is not None:
        values["model_config.model"] = str(model_config.model)
        values["model_config.enforce_eager"] = bool(getattr(model_config, "enforce_eager", False))
        values["model_config.architectures"] = _class_names(getattr(model_config, "architectures", None))
        facts = read_moe_facts(
            model_config.hf_text_config,
            f"the config of model {model_config.model}",
            architectures=values["model_config.architectures"],
        )
        values["model.moe_facts"] = facts
        values["model.num_logical_experts"] = facts.num_logical_experts
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        values.update(_draft_paths(spec))
    settings, violations = read_settings(values, os.environ if environ is None else environ)
    if violations:
        raise EplbConfigError(violations)
    return settings


def _class_names(names: Any) -> Any:
    """A config's ``architectures``: a list as a tuple; anything else as it is, for the rule to name
    (never a str's characters); None when it names none."""
    return (tuple(names) if isinstance(names, list) else names) or None


def _draft_paths(spec: Any) -> dict[str, Any]:
    """The speculative config's method and, with a draft model config, the draft's facts."""
    values: dict[str, Any] = {"speculative_config.method": getattr(spec, "method", None)}
    draft = getattr(spec, "draft_model_config", None)
    if draft is None:
        return values
    try:
        draft_experts = int(draft.get_num_experts() or 0)
    except Exception:
        draft_experts = 0
    architectures = _class_names(getattr(draft, "architectures", None))
    values["speculative_config.draft_is_moe"] = draft_experts > 0
    values["speculative_config.draft_model_config.model"] = draft.model
    values["speculative_config.draft_model_config.architectures"] = architectures
    values["speculative_config.draft_model_type"] = getattr(
        getattr(draft, "hf_config", None), "model_type", None
    )
    values["speculative_config.draft_moe_facts"] = read_moe_facts(
        draft.hf_text_config, f"the config of draft model {draft.model}", architectures=architectures
    )
    return values


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
        # local: vLLM only with a VllmConfig in hand: check imports this module
        from vllm.logger import init_logger

        for finding in violations.unjudged:
            init_logger(__name__).warning("EPLB start-up validation: %s", finding)
    if settings.enable_eplb and settings.communicator is None:
        settings.communicator = "torch_gloo"
    return settings
