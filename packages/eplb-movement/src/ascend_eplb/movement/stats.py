"""Statistics of expert transfers, per ``execute`` and cumulative."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["TransferStats"]


@dataclass(frozen=True)
class TransferStats:
    """What one ``execute`` (or a sum of them) moved and how long each phase took.

    Per rank; bytes are payload (``numel x element_size``), seconds host wall-clock
    (``time.perf_counter``); the four phases add up to the execute's time from taking staging on.

    Attributes:
        num_executes, num_failed: ``execute`` calls (empty ones included) and those that raised.
        num_send_experts / num_recv_experts: ``add_send`` / ``add_recv`` calls (expert x peer).
        num_send_tensors / num_recv_tensors: Gloo send / receive operations (one per tensor).
        bytes_sent / bytes_received: payload bytes; staging_bytes: staging used (a source tensor
            sent to several peers is staged once).
        d2h_s: taking staging and copying send tensors into it (on an accelerator: issuing, then
            waiting for each expert's copy before its sends).
        handshake_s: waiting for the peers' plan headers and comparing them.
        gloo_s: the rest: posting the payload (or descriptions) and waiting for every request.
        h2d_s: issuing the copies into destination rows as receives land (asynchronous on an
            accelerator).
    """

    num_executes: int = 0
    num_failed: int = 0
    num_send_experts: int = 0
    num_recv_experts: int = 0
    num_send_tensors: int = 0
    num_recv_tensors: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    staging_bytes: int = 0
    d2h_s: float = 0.0
    handshake_s: float = 0.0
    gloo_s: float = 0.0
    h2d_s: float = 0.0

    def __add__(self, other: TransferStats) -> TransferStats:
        if not isinstance(other, TransferStats):
            return NotImplemented
        return TransferStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def total_s(self) -> float:
        """``d2h_s + handshake_s + gloo_s + h2d_s``."""
        return self.d2h_s + self.handshake_s + self.gloo_s + self.h2d_s

    def as_dict(self) -> dict[str, int | float]:
        """Plain ``{field: value}`` for logs and the simulator's reports."""
        return asdict(self)
