"""The ``vllm.general_plugins`` entry point of the Ascend EPLB integration.

vLLM calls :func:`register` once per process before it builds its configs, so whether EPLB is requested
is read from the process: ``ASCEND_EPLB`` (``1``/``true``/``yes``/``on``, inherited by engine and
workers) or ``--enable-eplb`` on the command line. Without either it returns at once, having imported
only this module and :mod:`.switches` (standard library), patched and allocated nothing. With it,
:func:`ascend_eplb.integration.patches.apply_patches` (idempotent; ``runner`` applies it again).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from ascend_eplb.integration.switches import is_true

__all__ = ["ENV_SWITCH", "eplb_requested", "register"]

#: The environment switch that turns the integration on in every vLLM process.
ENV_SWITCH = "ASCEND_EPLB"


def eplb_requested(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> bool:
    """Whether this process was started with EPLB requested (``ASCEND_EPLB`` or ``--enable-eplb``)."""
    env = os.environ if environ is None else environ
    if is_true(env.get(ENV_SWITCH)):
        return True
    for arg in sys.argv if argv is None else argv:
        if arg == "--enable-eplb":
            return True
        if arg.startswith("--enable-eplb="):
            return is_true(arg.split("=", 1)[1])
    return False


def register() -> bool:
    """Entry point of ``vllm.general_plugins``; idempotent.

    Returns:
        True when the patches are in effect after the call (EPLB requested), False otherwise.

    Raises:
        RuntimeError: EPLB requested and an upstream callable changed signature (from ``apply_patches``).
    """
    if not eplb_requested():
        return False
    # local: only when EPLB is requested: the patches import torch, vLLM and the planes
    from ascend_eplb.integration.patches import apply_patches, patches_applied

    apply_patches()
    return patches_applied()
