"""The ``vllm.general_plugins`` entry point of the Ascend EPLB integration.

vLLM calls :func:`register` once per process (front-end, engine core, every worker) before it builds
its configs, with no arguments. Whether EPLB is requested is therefore read from the process at that
time, never from a config object:

* the environment variable ``ASCEND_EPLB`` (``1``/``true``/``yes``/``on``; inherited by the engine and
  worker processes), or
* the ``--enable-eplb`` flag of the command line that started vLLM (``vllm serve ... --enable-eplb``).

With neither, :func:`register` returns at once: it imports nothing beyond this module and
:mod:`~ascend_eplb.integration.switches` (both import only the standard library), patches nothing and
allocates nothing, so EPLB-off serving and the Model Runner V1 path are untouched. With EPLB requested
it applies :func:`ascend_eplb.integration.patches.apply_patches` (idempotent). The Model Runner V2 wiring
(:mod:`ascend_eplb.integration.runner`) applies the same patches again, lazily, when a runner is created
with ``enable_eplb=True`` (a no-op if register already did), and validates the configuration there.
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
    from ascend_eplb.integration.patches import apply_patches, patches_applied

    apply_patches()
    return patches_applied()
