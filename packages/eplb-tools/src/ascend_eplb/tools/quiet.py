"""Keep vLLM's start-up lines that do not concern EPLB out of the tools' output.

On a host without an accelerator vLLM 0.33.0 logs, once per process (so per rank), lines about kernels,
runners and settings the tools never use. :func:`install` adds a ``logging.Filter`` to exactly the vLLM
loggers that emit them, dropping only records whose message starts with one of :data:`DROPPED`, and
ignores torch's deprecation warnings that vLLM's collectives raise (:data:`IGNORED_WARNINGS`). Every
other vLLM and ``ascend_eplb`` record passes; vLLM's logging configuration (``VLLM_LOGGING_LEVEL``,
``VLLM_CONFIGURE_LOGGING``) is untouched. ``ASCEND_EPLB_TOOLS_VLLM_NOISE=1`` turns both off.
"""

from __future__ import annotations

import logging
import os
import warnings

from ascend_eplb.integration.switches import is_true

__all__ = ["DROPPED", "IGNORED_WARNINGS", "NOTE", "install"]

#: vLLM logger -> message prefixes dropped from it (vLLM 0.33.0).
DROPPED: dict[str, tuple[str, ...]] = {
    "vllm.platforms.cpu": (
        "Failed to import from vllm._C",  # no CPU kernels are built with VLLM_TARGET_DEVICE=empty
        "Triton is not installed",
        "Reset SSM cache type",  # mamba backends
    ),
    "vllm.platforms.interface": ("Failed to import from vllm._C",),
    "vllm.config.vllm": (
        "Model Runner V2 requires Triton",  # judging vLLM's config here: the engine's runner runs elsewhere
        "Enforce eager set",  # without --compile the engine runs eagerly (enforce_eager), as asked
        "Inductor compilation was disabled by user settings",
        "max_num_scheduled_tokens is set to",  # --speculative-tokens: the scheduler's note, judged here
    ),
    "vllm.ir.op": ("Priority not set for op",),  # per custom op of a real model: its torch form runs
}
#: Python warnings ignored (message regex, category): raised by vLLM's calls into torch.
IGNORED_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # vLLM's TP all-gather
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
