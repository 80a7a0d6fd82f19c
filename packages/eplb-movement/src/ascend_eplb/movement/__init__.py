"""Ascend EPLB movement plane: expert weight transfers for vLLM's EPLB over Gloo with CPU staging.

Public names:

* :class:`AscendGlooEplbCommunicator` — upstream ``EplbCommunicator`` over the EPLB group's Gloo
  group; group-local peers translated to global ranks; D2H into staging, per pair a handshake and
  the Gloo payload, H2D, pipelined expert by expert.
* :class:`EplbTransferError` — a failed ``execute``, naming peers, expert ids and silent ranks.
* :class:`StagingPool`, :class:`StagingPoolError` — bounded, reused (pinned where supported) CPU
  staging buffers keyed by ``(dtype, numel)``.
* :class:`TransferStats` — per-``execute`` and cumulative bytes and phase timings.
"""

from ascend_eplb.movement.__about__ import __version__
from ascend_eplb.movement.communicator import (
    DEFAULT_TRANSFER_TIMEOUT_S,
    AscendGlooEplbCommunicator,
    EplbTransferError,
)
from ascend_eplb.movement.staging import DEFAULT_STAGING_MAX_BYTES, StagingKey, StagingPool, StagingPoolError
from ascend_eplb.movement.stats import TransferStats

__all__ = [
    "DEFAULT_STAGING_MAX_BYTES",
    "DEFAULT_TRANSFER_TIMEOUT_S",
    "AscendGlooEplbCommunicator",
    "EplbTransferError",
    "StagingKey",
    "StagingPool",
    "StagingPoolError",
    "TransferStats",
    "__version__",
]
