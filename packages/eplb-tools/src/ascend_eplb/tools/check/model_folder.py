"""What a local model folder says (``config.json`` and msModelSlim's description): the routed experts
and their format, read as vLLM and start-up validation read them. Imports no vLLM, so ``simulate`` reads
a folder before the heavy import."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascend_eplb.integration.model_facts import MoeFacts, read_moe_facts, text_config
from ascend_eplb.integration.validation import DTYPE_FORMATS, experts_format
from ascend_eplb.tools.files import json_object

__all__ = ["ModelFacts", "folder_formats", "model_folder_facts"]


@dataclass(frozen=True)
class ModelFacts:
    """What a local model folder says.

    Attributes:
        folder: the folder as given.
        moe: its ``config.json``'s routed-expert facts, as written (E, top-k, expert groups), read by
            start-up validation's own reader (:func:`ascend_eplb.integration.model_facts.read_moe_facts`) and
            judged by its rules ``routed-experts``, ``top-k``, ``expert-groups``.
        quantization: the routed experts' format from an msModelSlim ``quant_model_description*.json``
            (None: no description).
        dtype: the checkpoint's dtype as a format (None: not stated).
        description: the description file read (None: none).
        architectures: ``config.json``'s top-level ``architectures``, whose vLLM model class start-up's
            rule ``moe-model-class`` judges (it needs a ``MixtureOfExperts`` part with EPLB on): a list of
            names as a tuple; ``()`` when it names none (absent, null or ``[]``: vLLM cannot choose a model
            class, and the rule says so); any other value as written (a string: transformers keeps it,
            vLLM's ``ModelConfig`` refuses it, and so does the rule).
        model_type: ``config.json``'s ``model_type`` (None: not a string), what upstream's rule for a draft
            reads (``draft_model_supports_eplb``, DSpark drafts).
    """

    folder: str
    moe: MoeFacts
    quantization: str | None
    dtype: str | None
    description: str | None
    architectures: tuple[str, ...] | Any = None
    model_type: str | None = None

    @property
    def num_logical_experts(self) -> int | None:
        """E when ``config.json`` states a valid one (the ``routed-experts`` rule holds), else None."""
        return self.moe.num_logical_experts

    @property
    def num_moe_layers(self) -> int | None:
        """L from ``config.json`` as start-up counts it (:attr:`MoeFacts.num_moe_layers`; None when it does
        not say or the ``moe-layers`` rule is broken), what an ``initial_placement`` file must have been
        made for."""
        return self.moe.num_moe_layers


def model_folder_facts(folder: str | os.PathLike[str]) -> ModelFacts:
    """Read a local model folder's ``config.json`` and msModelSlim description (no vLLM imported).

    Routed experts: :func:`~ascend_eplb.integration.model_facts.read_moe_facts` of the text config (a
    ``text_config`` merged over the top level), the names and order of vLLM's ``CONFIG_FIELD_ALIASES``;
    a bad value is not raised here but judged by the rules. Format: the quant type of the description's
    ``.experts.`` weights mapped by :data:`ASCEND_QUANT_TYPES`.

    Raises:
        ValueError: ``config.json`` or the description is missing, not JSON or not an object (naming the
            file).
        EplbConfigError: the description's routed experts mix quant types.
    """
    root = Path(folder)
    config_file = root / "config.json"
    raw = json_object(config_file)
    return ModelFacts(
        str(root),
        read_moe_facts(raw, str(config_file)),
        *_formats(root, text_config(raw)),
        architectures=_architectures(raw),
        model_type=raw.get("model_type") if isinstance(raw.get("model_type"), str) else None,
    )


def folder_formats(folder: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """``(quantization, dtype)`` of :func:`model_folder_facts`.

    Raises:
        ValueError, EplbConfigError: as :func:`model_folder_facts`.
    """
    facts = model_folder_facts(folder)
    return facts.quantization, facts.dtype


def _architectures(cfg: dict[str, Any]) -> tuple[str, ...] | Any:
    """The top level's ``architectures`` (vLLM reads them there, not from a ``text_config``), for the
    ``moe-model-class`` rule: a list of names as a tuple, ``()`` when it names none (absent, null or
    ``[]``: vLLM raises "No model architectures are specified"), anything else as it is (never a string's
    characters: a string passed the rule as the tuple of its letters)."""
    names = cfg.get("architectures")
    if names is None or names == []:
        return ()
    return tuple(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else names


def _formats(root: Path, cfg: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """The description's routed-expert format, the checkpoint's dtype as a format, the description."""
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    descriptions = sorted(root.glob("quant_model_description*.json"))
    quant = experts_format(json_object(descriptions[0])) if descriptions else None
    return (
        quant,
        # As start-up reads a dtype (validation.quantization_format_name): float32 stays float32.
        DTYPE_FORMATS.get(str(dtype), str(dtype)) if dtype else None,
        str(descriptions[0]) if descriptions else None,
    )
