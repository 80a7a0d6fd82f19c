"""Ascend EPLB movement plane: expert weight transfers for vLLM's EPLB over Gloo with CPU staging.

:class:`AscendGlooEplbCommunicator` (upstream ``EplbCommunicator``) and its :class:`EplbTransferError`;
:class:`StagingPool` (bounded, reused CPU buffers); :class:`TransferStats` (bytes and phase timings).
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
