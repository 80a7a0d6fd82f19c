"""The public names of ``ascend_eplb.movement``, pinned: adding or removing one is a deliberate change."""

from __future__ import annotations

import importlib

from ascend_eplb.testing.api import check_public_names

PUBLIC = [
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
SUBMODULES = ("communicator", "staging", "stats")


def test_all_is_exactly_the_public_api():
    movement = importlib.import_module("ascend_eplb.movement")
    assert movement.__all__ == PUBLIC
    # Every name is the object a movement module defines or binds (not re-exported from upstream or
    # the test support), and __version__ is the installed distribution's.
    check_public_names("ascend_eplb.movement", "ascend-eplb-movement")
    # Each submodule exports exactly its share (no test helper, nothing else).
    exported = []
    for sub in SUBMODULES:
        module = importlib.import_module(f"ascend_eplb.movement.{sub}")
        for name in module.__all__:
            assert getattr(module, name) is getattr(movement, name), (sub, name)
        exported += module.__all__
    assert sorted([*exported, "__version__"]) == sorted(PUBLIC)
    # The classes are defined in the package itself, not re-exported from upstream or the test harness.
    for name in ("AscendGlooEplbCommunicator", "EplbTransferError", "StagingPool", "TransferStats"):
        assert getattr(movement, name).__module__.startswith("ascend_eplb.movement."), name
    assert issubclass(movement.EplbTransferError, RuntimeError)
    assert issubclass(movement.StagingPoolError, RuntimeError)
    from vllm.distributed.eplb.eplb_communicator import EplbCommunicator

    assert issubclass(movement.AscendGlooEplbCommunicator, EplbCommunicator)
