"""Ascend EPLB integration for vLLM Model Runner V2: start-up validation, the narrow upstream patches,
the ``vllm.general_plugins`` entry point and the Model Runner V2 wiring.

Importing this package imports nothing else: the submodules load their dependencies when used, so the
plugin entry point stays free of vLLM and of the planes while EPLB is off.
"""

from ascend_eplb.integration.__about__ import __version__

__all__ = ["__version__"]
