"""This package's config-file schema (``ascend-eplb check CONFIG.json``; the README shows it): the one
settings reader's mapping, :data:`~ascend_eplb.integration.settings_reader.FILE_SCHEMA`, nested by its
dots. :func:`settings_from_file_dict` flattens a file into it (each key the schema does not take a
``schema`` violation naming it) and reads it with
:func:`~ascend_eplb.integration.settings_reader.read_settings`, as start-up reads a ``VllmConfig``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ascend_eplb.integration.model_facts import shown
from ascend_eplb.integration.rules import Violation
from ascend_eplb.integration.settings import EplbSettings
from ascend_eplb.integration.settings_reader import ASCEND_SECTION, file_sections, read_settings

__all__ = ["FILE_KEYS", "is_engine_args", "settings_from_file_dict"]

#: Each section of the schema (``""``: the file) -> the keys it takes.
_SECTIONS = file_sections()
#: The top-level keys of the schema.
FILE_KEYS = _SECTIONS[""]
_ABSENT = object()


def _file_paths(data: Any, out: list[Violation]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``data`` flattened into the schema's paths, section by section in schema order, and its
    ``environment`` section (every key of it, as the process environment's override)."""
    values: dict[str, Any] = {}
    nodes: dict[str, Any] = {"": data}
    environment: dict[str, Any] = {}
    for section, allowed in _SECTIONS.items():
        node = nodes.pop(section, _ABSENT)
        if section == ASCEND_SECTION:
            if node is _ABSENT:
                continue
            if not isinstance(node, dict):  # not `or {}`: false, 0 or "" is refused, not read as {}
                out.append(
                    Violation(
                        "schema",
                        f"{section}={shown(node)} must be a JSON object (of the Ascend keys), got "
                        f"{type(node).__name__}",
                    )
                )
                continue
            values.update({f"{section}.{k}": v for k, v in node.items()})
            continue
        node = _check_keys(section or "the config file", None if node is _ABSENT else node, allowed, out)
        if section == "environment":
            environment = node
        for key, value in node.items():
            path = f"{section}.{key}" if section else key
            if key in allowed:
                (nodes if path in _SECTIONS else values)[path] = value
    return values, environment


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
    """Settings from a parsed config file (schema in the package README) plus schema violations; the
    facts a file cannot give are named in ``unknown_facts`` with how to give them."""
    out: list[Violation] = []
    values, environment = _file_paths(data, out)
    env = dict(os.environ if environ is None else environ)
    env.update({k: str(v) for k, v in environment.items()})
    settings, found = read_settings(values, env)
    unknown = settings.unknown_facts
    if settings.num_moe_layers is None:
        unknown["num_moe_layers"] = (
            "the MoE layer count is unknown (model.num_moe_layers is not given); give model.num_moe_layers"
        )
    if settings.num_logical_experts is None:
        given = values.get("model.num_logical_experts")
        said = (
            "model.num_logical_experts is not given"
            if given is None
            else f"model.num_logical_experts={shown(given)} is invalid, see [schema]"
        )
        unknown["num_logical_experts"] = (
            f"the routed-expert count is unknown ({said}); pass --num-experts / model.num_logical_experts"
        )
    quant = values.get("model.quantization", "bf16")
    if isinstance(quant, str) and quant.lower() == "ascend":
        unknown["quantization"] = (
            "quantization 'ascend' takes the routed experts' format from msModelSlim's "
            "quant_model_description*.json, which a config file does not carry; pass --quantization FORMAT"
        )
    if settings.speculative_draft_is_moe and settings.speculative_draft_architectures is None:
        given = values.get("speculative_config.draft_architectures")
        said = " is not given" if given is None else f"={shown(given)} is invalid, see [schema]"
        unknown["speculative_draft_architectures"] = (
            f"the MoE draft's model class is unknown (speculative_config.draft_architectures{said}; "
            "vLLM derives an MTP draft's from the target's config, e.g. DeepSeek-V3's DeepSeekMTPModel); "
            "give speculative_config.draft_architectures, or check a vllm serve command line with a local "
            "model folder"
        )
    return settings, out + found


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
