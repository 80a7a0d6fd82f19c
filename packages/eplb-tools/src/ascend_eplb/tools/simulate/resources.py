"""What a simulator run needs from the host, checked before anything starts.

:func:`estimate` sizes a run from its options and the trace's shape: per rank the ``L x p`` expert
storages of the format (``quant_views``' :meth:`~ascend_eplb.quant_views.ExpertWeightFormat.storage_nbytes`,
computed without allocating), the EPLB-off reference world (``L`` storages of ``E / N`` experts), the
float32 checkpoint weights one layer is built from, the trace arrays, the hidden-state table, the
lookups and upstream's placement state, the per-step buffers and statistics, and a process's base
(torch and vLLM imported); times the ranks, plus the launcher and its fork server, plus, when routing is
sampled from a load matrix, the sampling's arrays. :func:`memory_rule` compares it with the memory the host
has available (:func:`~ascend_eplb.tools.host_memory.available_bytes`); :func:`integer_rules` refuses
integer options that would overflow the types they feed. Each returned rule names the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascend_eplb.control.values import INT32_MAX as _INT32_MAX
from ascend_eplb.dataplane import DEFAULT_ROWS as LOOKUP_ROWS
from ascend_eplb.quant_views import get_format
from ascend_eplb.quant_views.reference import LAYER_SEED_STRIDE as _LAYER_STRIDE
from ascend_eplb.quant_views.reference import SEED_STRIDE as _SEED_STRIDE
from ascend_eplb.tools.host_memory import available_bytes, gib, sampling_bytes
from ascend_eplb.tools.simulate.lifecycle import MAX_TIMEOUT_S
from ascend_eplb.world.engine.spec import EngineSpec

__all__ = [
    "PROCESS_BASE_BYTES",
    "ResourceEstimate",
    "estimate",
    "integer_rules",
    "memory_rule",
    "model_memory_rule",
]

#: Resident memory of one process with torch and vLLM imported (measured: 658 MiB, vLLM 0.33.0, torch
#: 2.13.0 CPU), rounded up.
PROCESS_BASE_BYTES = 768 * 2**20
#: Rows of the replay world's hidden-state table (float32 ``[rows, H]``, ``simulate.replay_world``'s
#: ``_hidden_table``, which reads it here: this module does not import vLLM, replay_world does).
HIDDEN_TABLE_ROWS = 4096
_INT64_MAX = 2**63 - 1
#: Python objects per step in the statistics a rank keeps and pickles (floats in lists, ~40 bytes each).
_STAT_BYTES = 40


@dataclass(frozen=True)
class ResourceEstimate:
    """Bytes a run needs. ``per_rank`` is the sum of ``rank_parts``; ``total`` counts every process."""

    rank_parts: dict[str, int]
    per_rank: int
    launcher: int
    sampling: int
    num_ranks: int

    @property
    def total(self) -> int:
        # The fork server is one more process with vLLM imported.
        return self.num_ranks * self.per_rank + self.launcher + PROCESS_BASE_BYTES + self.sampling

    def describe(self) -> str:
        parts = ", ".join(f"{name} {gib(n)}" for name, n in self.rank_parts.items() if n >= 2**20)
        text = f"{gib(self.per_rank)} per rank ({parts}) x {self.num_ranks} ranks"
        text += f" + launcher {gib(self.launcher)}"
        if self.sampling:
            text += f" + sampling the load matrix {gib(self.sampling)}"
        return text


def estimate(
    config: Any,
    *,
    num_moe_layers: int,
    num_logical_experts: int,
    top_k: int,
    num_trace_tokens: int,
    sampled: bool,
) -> ResourceEstimate:
    """Bytes the run of ``config`` (a valid ``SimulateConfig``) needs on this host."""

    fmt = get_format(config.quant_format)
    n, L, E, K = config.num_ranks, num_moe_layers, num_logical_experts, top_k  # noqa: N806 (DESIGN letters)
    H, I = config.hidden_size, config.intermediate_size  # noqa: N806, E741
    P = E + config.num_redundant_experts  # noqa: N806
    p, ref = P // n, math.ceil(E / n)
    T, W = config.effective_padded_size, config.window_size  # noqa: N806
    trace = num_trace_tokens * L * K * (8 + 4)  # int64 ids, float32 weights
    parts = {
        "expert storage": L * fmt.storage_nbytes(p, H, I),
        "reference storage": L * fmt.storage_nbytes(ref, H, I),
        # one layer's float32 checkpoint weights of all E experts, listed then stacked
        "checkpoint weights": 2 * E * 3 * H * I * 4,
        "trace": 2 * trace,  # the pickled copy and the converted one
        "hidden table": HIDDEN_TABLE_ROWS * H * 4,
        "lookups and placement": L * (LOOKUP_ROWS * E * 4 + E * (P - E + 1) * 8 + P * 8 * (3 + W)),
        # dispatch (ids, weights, hidden states of N*T rows, gathered then concatenated), both outputs
        "step buffers": 3 * n * T * (L * 2 * K * 8 + (H + L * K) * 4)
        + 2 * 2 * L * n * T * H * 4
        + n * T * K * (2 * I + H) * 4 * 4,
        "statistics": config.steps * (n + 12) * _STAT_BYTES,
        "process": PROCESS_BASE_BYTES,
    }
    launcher = PROCESS_BASE_BYTES + 2 * trace + n * config.steps * (n + 12) * _STAT_BYTES
    sampling = sampling_bytes(L, num_trace_tokens, E) if sampled else 0
    return ResourceEstimate(parts, sum(parts.values()), launcher, sampling, n)


def integer_rules(config: Any, *, num_moe_layers: int, num_logical_experts: int, top_k: int) -> list[str]:
    """Options that would overflow the integer types they feed (each rule names the value).

    ``config.replays`` (the trace-replay world): the seed must leave room for its expert-weight seeds;
    a real model: the seed must be a torch generator seed (it draws the prompts).
    """
    errors = []
    if config.replays:
        seed_max = (_INT64_MAX - _LAYER_STRIDE * num_moe_layers - num_logical_experts) // _SEED_STRIDE
        why = (
            f"expert weights are seeded with seed x {_SEED_STRIDE} + layer x {_LAYER_STRIDE} + expert, "
            "an int64"
        )
    else:
        seed_max, why = _INT64_MAX, "the torch generator seed of the prompts"
    if not 0 <= config.seed <= seed_max:
        errors.append(f"seed={config.seed}: must be in [0, {seed_max}] ({why})")
    tokens = config.steps * config.num_ranks * config.batch_size
    if tokens > _INT64_MAX:
        errors.append(
            f"steps={config.steps}: steps x ranks x batch size = {tokens} trace positions overflow int64"
        )
    selections = config.num_ranks * config.effective_padded_size * top_k
    if selections > _INT32_MAX:
        errors.append(
            f"padded size={config.effective_padded_size}: ranks x padded size x top-k = {selections} "
            f"selections a step overflow the int32 load counters (at most {_INT32_MAX})"
        )
    if num_logical_experts + config.num_redundant_experts > _INT32_MAX:
        errors.append(
            f"redundant experts={config.num_redundant_experts}: E + redundant = "
            f"{num_logical_experts + config.num_redundant_experts} physical experts overflow the int32 "
            "lookup tables"
        )
    for name, value in (("timeout", config.timeout_s), ("worker timeout", config.worker_timeout_s)):
        if math.isfinite(value) and value > MAX_TIMEOUT_S:
            errors.append(f"{name}={value}: must be at most {MAX_TIMEOUT_S:.0f} s (7 days)")
    return errors


def memory_rule(
    config: Any,
    *,
    num_moe_layers: int,
    num_logical_experts: int,
    top_k: int,
    num_trace_tokens: int,
    sampled: bool = False,
    available: int | None = None,
) -> list[str]:
    """``[the rule]`` when the run of ``config`` (valid otherwise) needs more memory than the host has
    available (``available`` defaults to
    :func:`~ascend_eplb.tools.host_memory.available_bytes`), else ``[]``."""
    need = estimate(
        config,
        num_moe_layers=num_moe_layers,
        num_logical_experts=num_logical_experts,
        top_k=top_k,
        num_trace_tokens=num_trace_tokens,
        sampled=sampled,
    )
    have = available_bytes() if available is None else available
    if need.total <= have:
        return []
    return [
        f"memory: this run needs about {gib(need.total)} ({need.describe()}), the host has {gib(have)} "
        "available (MemAvailable); use fewer layers, ranks or redundant experts, or smaller sizes"
    ]


def model_memory_rule(num_ranks: int, folder: Any) -> list[str]:
    """A run on the real model in ``folder``: one vLLM engine at a time (EPLB off, then on), each a host
    process, vLLM's engine core and ``num_ranks`` workers, each with vLLM imported, every worker holding
    the checkpoint's weights once (at most its safetensors bytes) and its KV cache, plus this process,
    against :func:`available_bytes`. Returns the rule's message, or nothing."""

    weights = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    kv_cache = EngineSpec.kv_cache_memory_bytes
    need = (num_ranks + 3) * PROCESS_BASE_BYTES + num_ranks * (weights + kv_cache)
    have = available_bytes()
    if need > have:
        return [
            f"memory: the run needs about {gib(need)} (vLLM's engine: {num_ranks} workers x (a process "
            f"{gib(PROCESS_BASE_BYTES)} + the checkpoint's {gib(weights)} + a KV cache of {gib(kv_cache)}), "
            "its engine core and host, and this process), this host has "
            f"{gib(have)} available"
        ]
    return []
