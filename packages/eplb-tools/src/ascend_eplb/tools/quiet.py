"""Keep vLLM's start-up lines that do not concern EPLB out of the tools' output.

On a host without an accelerator (what ``simulate``, ``plan`` and ``check`` run on), vLLM 0.33.0 logs,
once per process (so once per rank), lines about kernels and runners the tools never use: the CPU
platform's ``Failed to import from vllm._C...`` (no CPU kernels are built with
``VLLM_TARGET_DEVICE=empty``), ``Triton is not installed...``, ``Reset SSM cache type...`` (mamba
backends) and the config's ``Model Runner V2 requires Triton; using the V1 model runner instead``
(the simulator builds no vLLM runner; it makes the MRv2 EPLB calls itself), and, per custom op of a
real model class, ``Priority not set for op rms_norm, using native implementation`` (``vllm.ir.op``:
no kernel priority on this platform, the op's torch form runs) and, per model, the config's notes that
eager mode disables compilation (``Enforce eager set...``, ``Inductor compilation was disabled...``:
the real models run eager, as start-up validation requires) and, with ``--speculative-tokens``, the
config's advice to raise ``max_num_batched_tokens`` for the draft token slots (``max_num_scheduled_tokens is
set to ...``: about vLLM's scheduler, which the tools do not run). :func:`install` adds a
``logging.Filter`` to exactly the vLLM loggers that emit them, dropping only records whose message
starts with one of :data:`DROPPED`. Every other vLLM record and every ``ascend_eplb`` record
(watchdog, verifier, controller) passes; vLLM's own logging configuration (``VLLM_LOGGING_LEVEL``,
``VLLM_CONFIGURE_LOGGING``) is untouched. It also ignores torch's ``FutureWarning`` that
``all_gather_into_tensor`` (and ``reduce_scatter_tensor``) is deprecated, which vLLM's TP all-gather
(and sequence-parallel MoE's reduce-scatter) raises once per rank (vLLM's call, not the tools').
``ASCEND_EPLB_TOOLS_VLLM_NOISE=1`` turns both off.
"""

from __future__ import annotations

import logging
import os
import warnings

from ascend_eplb.integration.switches import is_true

__all__ = ["DROPPED", "IGNORED_WARNINGS", "NOTE", "install"]

#: vLLM logger -> message prefixes dropped from it (vLLM 0.33.0 sources in the module docstring).
DROPPED: dict[str, tuple[str, ...]] = {
    "vllm.platforms.cpu": (
        "Failed to import from vllm._C",
        "Triton is not installed",
        "Reset SSM cache type",
    ),
    "vllm.platforms.interface": ("Failed to import from vllm._C",),
    "vllm.config.vllm": (
        "Model Runner V2 requires Triton",
        "Enforce eager set",
        "Inductor compilation was disabled by user settings",
        "max_num_scheduled_tokens is set to",
    ),
    "vllm.ir.op": ("Priority not set for op",),
}
#: Python warnings ignored (message regex, category): raised by vLLM's calls into torch.
IGNORED_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),
    # vLLM's TP reduce-scatter of sequence-parallel MoE (simulate --dp N --tp M > 1)
    (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", FutureWarning),
)
#: The one line the tools print about what remains of vLLM's start-up output.
NOTE = (
    "note: vLLM start-up lines about kernels and runners these tools do not use are hidden "
    "(ASCEND_EPLB_TOOLS_VLLM_NOISE=1 shows them); other vLLM warnings are shown as vLLM logs them"
)


class _Drop(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def install() -> bool:
    """Add the filters (idempotent; before vLLM is imported or after). Returns whether they are on."""
    if is_true(os.environ.get("ASCEND_EPLB_TOOLS_VLLM_NOISE")):
        return False
    for name, prefixes in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(prefixes))
    for message, category in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    return True
