"""What the CPU world's expert methods consumed, logged where a compiled forward can log it.

A compiled forward (vLLM's ``DYNAMO_TRACE_ONCE``) freezes every Python value its one trace read, so a
method cannot count calls in an int or append ids to a list; :class:`KernelLog` keeps them in device
tensors written in place, which the world reads after the forward. Shapes: T rows of the kernel's
batch, K top-k.
"""

from __future__ import annotations

import itertools

import torch
from vllm.config import get_current_vllm_config

__all__ = ["KernelLog", "attach_kernel_log", "kernel_log"]


class KernelLog:
    """What an expert method's ``apply`` consumed, in device tensors allocated once per MoE layer after
    loading, before any forward; ``record`` is a copy into a fixed buffer, a fill and an add, no host read.

    Attributes:
        capacity: the most rows one call may log.
        ids: int64 ``(capacity, K)``: the physical ids of the last call in its first ``rows`` rows.
        rows: int64 0-d: the rows of the last call (T of the kernel's batch: gathered rows included).
        calls: int64 0-d: the calls so far.
    """

    def __init__(self, capacity: int, top_k: int, device: torch.device | str = "cpu") -> None:
        self.capacity = capacity
        self._overflow = f"KernelLog: a call's rows exceed its capacity of {capacity}"
        self.ids = torch.full((capacity, top_k), -1, dtype=torch.int64, device=device)
        self.rows = torch.zeros((), dtype=torch.int64, device=device)
        self.calls = torch.zeros((), dtype=torch.int64, device=device)

    def record(self, ids: torch.Tensor) -> None:
        """Log one call's int64 ``(T, K)`` ids (``T <= capacity``: checked)."""
        rows, message = ids.shape[0], self._overflow
        torch._check(rows <= self.capacity, lambda: message)
        self.ids[:rows].copy_(ids)
        self.rows.fill_(rows)
        self.calls.add_(1)

    def last_ids(self) -> torch.Tensor:
        """int64 ``(rows, K)``: a copy of the last call's ids (reads ``rows`` on the host)."""
        return self.ids[: int(self.rows)].clone()


def kernel_log(layer: torch.nn.Module) -> KernelLog:
    """The :class:`KernelLog` of a ``RoutedExperts`` layer whose method logs (the CPU world's methods).

    Raises:
        RuntimeError: the layer has none (its method is not the CPU world's, or it was not loaded).
    """
    log = getattr(layer, "kernel_log", None)
    if not isinstance(log, KernelLog):
        raise RuntimeError(
            f"{type(layer).__name__} has no KernelLog: its expert method is not the CPU world's"
        )
    return log


def attach_kernel_log(layer: torch.nn.Module) -> KernelLog:
    """Give ``layer`` its :class:`KernelLog` (after loading, before any forward; idempotent).

    Capacity: the rows one forward's MoE may receive, ``(max_num_batched_tokens + TP) x DP`` of the
    current vLLM config (the DP ranks' batches gathered; sequence-parallel chunks rounded up per TP
    rank); ``K`` is the layer's top-k.
    """
    if isinstance(getattr(layer, "kernel_log", None), KernelLog):
        return layer.kernel_log
    config = get_current_vllm_config()
    parallel = config.parallel_config
    capacity = (config.scheduler_config.max_num_batched_tokens + parallel.tensor_parallel_size) * (
        parallel.data_parallel_size
    )
    # The layer's device: per-expert lists (vllm-ascend's NZ layout) leave it no parameter, a buffer then.
    device = next(itertools.chain(layer.parameters(), layer.buffers()), torch.empty(0)).device
    layer.kernel_log = KernelLog(capacity, int(layer.top_k), device)
    return layer.kernel_log
