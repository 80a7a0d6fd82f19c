"""What a local model folder says (``config.json`` and msModelSlim's description): the routed experts
and their format, read as vLLM and start-up validation read them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascend_eplb.control.values import is_int
from ascend_eplb.integration.rules import INT32_MAX
from ascend_eplb.integration.validation import DTYPE_FORMATS, experts_format
from ascend_eplb.tools.check.report import short

__all__ = ["ModelFacts", "folder_formats", "model_folder_facts"]


@dataclass(frozen=True)
class ModelFacts:
    """What a local model folder says: routed experts (None: none stated), the routed experts' format
    from an msModelSlim ``quant_model_description*.json`` (None: no description), the checkpoint's dtype
    as a format (None: not stated), and the description file read."""

    folder: str
    num_logical_experts: int | None
    quantization: str | None
    dtype: str | None
    description: str | None


def _json_object(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{file}: cannot read as JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: must be a JSON object, got {type(data).__name__}")
    return data


def model_folder_facts(folder: str | os.PathLike[str]) -> ModelFacts:
    """Read a local model folder's ``config.json`` and msModelSlim description.

    Routed experts: the first of vLLM's ``CONFIG_FIELD_ALIASES["num_experts"]`` (``num_experts``,
    ``moe_num_experts``, ``n_routed_experts``, ``num_local_experts``) in the text config, as vLLM's
    ``get_num_experts`` reads them (0 or absent: None). Format: the quant type of the description's
    ``.experts.`` weights mapped by :data:`ASCEND_QUANT_TYPES`.

    Raises:
        ValueError: ``config.json`` or the description is missing, not JSON or not an object, or the
            expert count is not an integer >= 0 (naming the file and the key).
        EplbConfigError: the description's routed experts mix quant types.
    """
    from vllm.transformers_utils.config import CONFIG_FIELD_ALIASES

    root = Path(folder)
    config_file = root / "config.json"
    cfg = _text_config(config_file)
    key = next((k for k in CONFIG_FIELD_ALIASES["num_experts"] if k in cfg), None)
    experts = cfg.get(key, 0) if key else 0
    if isinstance(experts, list):
        experts = experts[0] if experts else 0
    if experts is None:
        experts = 0
    if not is_int(experts) or not 0 <= experts <= INT32_MAX:
        raise ValueError(f"{config_file}: {key}={short(experts)} must be an integer in [0, {INT32_MAX}]")
    return ModelFacts(str(root), experts or None, *_formats(root, cfg))


def folder_formats(folder: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """``(quantization, dtype)`` of :func:`model_folder_facts`, without importing vLLM (the expert
    count's aliases are vLLM's): for callers that validate options before any heavy import.

    Raises:
        ValueError, EplbConfigError: as :func:`model_folder_facts` for ``config.json`` and the
            description.
    """
    root = Path(folder)
    quant, dtype, _ = _formats(root, _text_config(root / "config.json"))
    return quant, dtype


def _text_config(config_file: Path) -> dict[str, Any]:
    cfg = _json_object(config_file)
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    return cfg


def _formats(root: Path, cfg: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """The description's routed-expert format, the checkpoint's dtype as a format, the description."""
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    descriptions = sorted(root.glob("quant_model_description*.json"))
    quant = experts_format(_json_object(descriptions[0])) if descriptions else None
    return (
        quant,
        # As start-up reads a dtype (validation.quantization_format_name): float32 stays float32.
        DTYPE_FORMATS.get(str(dtype), str(dtype)) if dtype else None,
        str(descriptions[0]) if descriptions else None,
    )
