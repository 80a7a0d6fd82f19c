"""The host's memory, as the tools check it before a run or a trace sampling starts.

:func:`available_bytes` is what the host can give a new workload now (``psutil``: ``MemAvailable`` on
Linux); :func:`check_sampling` refuses a :func:`~ascend_eplb.tools.trace.sample_trace_from_load` call
whose arrays (:func:`sampling_bytes`) do not fit. ``simulate.resources`` sizes whole runs with them.
"""

from __future__ import annotations

import psutil

__all__ = ["available_bytes", "check_sampling", "gib", "sampling_bytes"]


def gib(n: float) -> str:
    """``n`` bytes as GiB with two decimals, e.g. ``"1.50 GiB"``."""
    return f"{n / 2**30:.2f} GiB"


def available_bytes() -> int:
    """Memory the host can give a new workload now (``psutil.virtual_memory().available``), bytes."""

    return int(psutil.virtual_memory().available)


def sampling_bytes(num_moe_layers: int, num_tokens: int, num_experts: int) -> int:
    """Peak bytes of :func:`ascend_eplb.tools.trace.sample_trace_from_load`: float64 Gumbel noise, the
    perturbed scores and the int64 argsort, each ``[L, T, E]``."""
    return 3 * 8 * num_moe_layers * num_tokens * num_experts


def check_sampling(
    num_moe_layers: int, num_tokens: int, num_experts: int, *, available: int | None = None
) -> None:
    """Raise ``ValueError`` if sampling ``num_tokens`` tokens from an ``[L, E]`` load needs more memory
    than the host has available (``available`` bytes, default :func:`available_bytes`)."""
    need = sampling_bytes(num_moe_layers, num_tokens, num_experts)
    have = available_bytes() if available is None else available
    if need > have:
        raise ValueError(
            f"memory: sampling {num_tokens} tokens from a [{num_moe_layers}, {num_experts}] load matrix "
            f"needs about {gib(need)}, the host has {gib(have)} available (MemAvailable)"
        )
