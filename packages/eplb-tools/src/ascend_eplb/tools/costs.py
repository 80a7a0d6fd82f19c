"""What EPLB costs at a real model's size: expert bytes, redundancy memory, rearrangement traffic.

The simulator runs toy expert sizes; an operator sizing ``num_redundant_experts`` needs the numbers at
the model's own size. Facts come from the model's Hugging Face ``config.json`` (:func:`read_model_size`);
bytes come from quant_views (``get_format(name).expert_nbytes(H, I)``: the exact kernel storage one
expert occupies and EPLB moves, computed without allocating it); time from a stated link speed.

Units: bytes (int), seconds (float), Gbit/s (``link_gbps``, 1 Gbit = 1e9 bit).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ascend_eplb.control.values import is_int
from ascend_eplb.integration.model_facts import EXPERT_COUNT_KEYS, read_moe_facts, text_config
from ascend_eplb.integration.rules import moe_fact_errors
from ascend_eplb.quant_views import get_format
from ascend_eplb.tools.files import json_object

__all__ = [
    "CostEstimate",
    "ModelSize",
    "estimate_costs",
    "format_bytes",
    "read_model_size",
]

_INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")  # Mixtral: no moe_ key


@dataclass(frozen=True)
class ModelSize:
    """The sizes EPLB costs depend on. ``num_moe_layers``: L, counted by start-up's reader
    (:attr:`ascend_eplb.integration.model_facts.MoeFacts.num_moe_layers`)."""

    source: str
    hidden_size: int
    moe_intermediate_size: int
    num_logical_experts: int
    num_moe_layers: int
    top_k: int | None


def _first(cfg: dict[str, Any], keys: tuple[str, ...], source: str, what: str) -> int:
    for k in keys:
        v = cfg.get(k)
        if is_int(v) and v > 0:
            return v
    raise ValueError(f"{source}: no {what} (looked for {', '.join(keys)}; each must be an integer > 0)")


def read_model_size(path: str | Path) -> ModelSize:
    """Read a model's ``config.json`` (a file or the model folder holding it).

    Multimodal configs nest the language model under ``text_config`` (read when present). The routed
    experts, top-k and MoE layers are read and judged as start-up judges them
    (:func:`ascend_eplb.integration.model_facts.read_moe_facts`, the rules of ``MOE_FACT_RULES``). Raises
    ``ValueError`` naming the file and the missing or bad key (a dense model has no routed experts), every
    bad MoE fact at once.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    source = str(file)
    cfg = json_object(file)
    # E, K and L as start-up reads and judges them (vLLM's names and order), every bad one at once.
    facts = read_moe_facts(cfg, source)
    cfg = text_config(cfg)
    hidden = _first(cfg, ("hidden_size",), source, "hidden_size")
    inter = _first(cfg, _INTERMEDIATE_KEYS, source, "MoE intermediate size")
    if "experts" in facts.unstated():
        raise ValueError(
            f"{source}: no routed experts count (a dense model has none): looked for "
            f"{', '.join(EXPERT_COUNT_KEYS)}"
        )
    if errors := moe_fact_errors(facts):
        raise ValueError("; ".join(errors))
    if facts.num_moe_layers is None:  # the rules hold: L is not stated or not counted here
        raise ValueError(
            facts.layers_not_counted()
            or f"{source}: no num_hidden_layers (the decoder layers, an integer > 0)"
        )
    top_k = None if "top_k" in facts.unstated() else facts.top_k
    return ModelSize(source, hidden, inter, facts.num_logical_experts, facts.num_moe_layers, top_k)


@dataclass(frozen=True)
class CostEstimate:
    """EPLB costs of one redundancy level at a model's size (see :func:`estimate_costs`)."""

    quant_format: str
    expert_nbytes: int
    num_redundant_experts: int
    redundant_slots_per_rank_per_layer: int
    redundant_nbytes_per_rank: int
    busiest_rank_experts_received: int | None
    busiest_rank_nbytes_received: int | None
    transfer_seconds: float | None
    link_gbps: float

    def to_json(self) -> dict:
        return asdict(self)


def estimate_costs(
    model: ModelSize,
    quant_format: str,
    *,
    num_ranks: int,
    num_redundant_experts: int,
    link_gbps: float,
    busiest_rank_experts_per_layer: float | None = None,
) -> CostEstimate:
    """Costs of ``num_redundant_experts`` at ``model``'s size in ``quant_format``.

    - expert bytes: ``get_format(quant_format).expert_nbytes(H, I)``;
    - redundancy memory per rank: ``(E + R) / N - ceil(E / N)`` extra slots per MoE layer, times the
      model's MoE layers, times the expert bytes (device memory beyond EPLB-off serving);
    - per rearrangement, when ``busiest_rank_experts_per_layer`` (experts the busiest rank receives per
      MoE layer, from a placement change) is given: that times the model's MoE layers (rounded up),
      its bytes, and the time at ``link_gbps`` (bytes * 8 / (link_gbps * 1e9); the rank's receive
      link is the bottleneck of Gloo-staged movement).

    Raises ``ValueError`` for a format EPLB does not support or sizes its layout cannot hold.
    """

    fmt = get_format(quant_format)
    nbytes = fmt.expert_nbytes(model.hidden_size, model.moe_intermediate_size)
    extra = (model.num_logical_experts + num_redundant_experts) // num_ranks - math.ceil(
        model.num_logical_experts / num_ranks
    )
    received = busy_bytes = seconds = None
    if busiest_rank_experts_per_layer is not None:
        received = math.ceil(busiest_rank_experts_per_layer * model.num_moe_layers)
        busy_bytes = received * nbytes
        seconds = busy_bytes * 8 / (link_gbps * 1e9)
    return CostEstimate(
        quant_format, nbytes, num_redundant_experts, extra, extra * model.num_moe_layers * nbytes,
        received, busy_bytes, seconds, link_gbps,
    )  # fmt: skip


def format_bytes(n: int | None) -> str:
    """``n`` bytes in binary units (``1.50 GiB``); ``n/a`` for None."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"
