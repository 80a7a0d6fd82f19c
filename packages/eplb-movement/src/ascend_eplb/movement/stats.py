"""Statistics of expert transfers, per ``execute`` and cumulative."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["TransferStats"]


@dataclass(frozen=True)
class TransferStats:
    """What one ``execute`` (or a sum of them) moved and how long each phase took.

    Counts are per rank (this process). Bytes are payload bytes (``numel x element_size``); seconds are
    host wall-clock (``time.perf_counter``).

    Attributes:
        num_executes: ``execute`` calls (1 for one call's stats), including those with nothing queued.
        num_failed: of those, calls that raised.
        num_send_experts / num_recv_experts: ``add_send`` / ``add_recv`` calls (one per expert and
            peer).
        num_send_tensors / num_recv_tensors: Gloo send / receive operations (one per tensor).
        bytes_sent / bytes_received: payload bytes sent to / received from peers.
        staging_bytes: bytes of staging buffers the call used (a source tensor sent to several peers
            is staged once).
        d2h_s: taking the staging buffers and copying send tensors into them: issuing the copies
            (on CPU: the copies themselves) and, on an accelerator, waiting for each expert's copy
            before its sends are posted.
        handshake_s: waiting for the peers' plan headers and comparing them with this rank's.
        gloo_s: the rest of the execute's wall time: posting the payload (and, on a disagreement, the
            full descriptions) and waiting for every request.
        h2d_s: issuing the copies from staging into the destination rows, each as soon as its
            receive landed (on an accelerator these are asynchronous on the transfer stream; on CPU
            they are complete). The four phases add up to the wall time of the execute from taking
            the staging buffers on.
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
