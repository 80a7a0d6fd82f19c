"""The public names of ``ascend_eplb.movement``: each a submodule's own, checked by ``check_public_names``."""

from __future__ import annotations

import importlib

from ascend_eplb.testing.api import check_public_names

SUBMODULES = ("communicator", "staging", "stats")


def test_each_public_name_is_a_submodules_own():
    movement = importlib.import_module("ascend_eplb.movement")
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
    assert sorted([*exported, "__version__"]) == sorted(movement.__all__)
    # The classes are defined in the package itself, not re-exported from upstream or the test harness.
    for name in ("AscendGlooEplbCommunicator", "EplbTransferError", "StagingPool", "TransferStats"):
        assert getattr(movement, name).__module__.startswith("ascend_eplb.movement."), name
    assert issubclass(movement.EplbTransferError, RuntimeError)
    assert issubclass(movement.StagingPoolError, RuntimeError)
    from vllm.distributed.eplb.eplb_communicator import EplbCommunicator

    assert issubclass(movement.AscendGlooEplbCommunicator, EplbCommunicator)
