"""Ascend EPLB integration for vLLM Model Runner V2, the serving product: start-up validation (the support
matrix, one settings reader), the one registry of narrow idempotent patches, the ``vllm.general_plugins``
entry point, the Model Runner V2 wiring, the runtime verifier, the worker watchdog, the events file and
the metrics.

Importing this package imports nothing else, so that the plugin entry point stays free of vLLM and of the
planes while EPLB is off; what processes without vLLM read of the guardrails is :mod:`.guardrail_facts`.
"""

from ascend_eplb.integration.__about__ import __version__

__all__ = ["__version__"]
