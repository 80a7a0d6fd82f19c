"""The serving world on a CPU host: what ``ascend-eplb simulate`` runs and the tests of the packages under
the tools run too (one world, one path). Nothing of the serving path imports it.

:mod:`~ascend_eplb.world.engine` runs vLLM's own engine on this host (opted in per process); the modules
below serve the cases that engine cannot (``README.md``, "What runs where"). Their names are this
package's, loaded on first use: importing the package imports neither torch, vLLM nor Triton (vLLM loads
the engine world's plugin entry points, inside this package, in every process of an environment that
installs it). :mod:`~ascend_eplb.world.checkpoints` (tiny checkpoints of vLLM's real MoE architectures),
:mod:`~ascend_eplb.world.routing_fit` (a DeepSeek-V3 checkpoint's routing fitted to a recorded load),
:mod:`~ascend_eplb.world.stand_ins` (the CPU stand-ins for what this host lacks),
:mod:`~ascend_eplb.world.kernel_logs` (what the expert methods consumed),
:mod:`~ascend_eplb.world.slots` (what each physical slot must hold),
:mod:`~ascend_eplb.world.compilation` (the compilations ``simulate --compile`` gives vLLM's engine),
:mod:`~ascend_eplb.world.rank_model` (one rank's model on vLLM's real classes) and
:mod:`~ascend_eplb.world.own_loop` (the world's own loop: the
:class:`~ascend_eplb.world.own_loop.ServingWorker`, :func:`~ascend_eplb.world.own_loop.real_model_world`).
:mod:`~ascend_eplb.world.quant_method` (vLLM Ascend's quantized experts) and
:mod:`~ascend_eplb.world.toy_moe` (the toy MoE model) are imported by name.
"""

import importlib
import importlib.util
from typing import Any

from ascend_eplb.world.__about__ import __version__ as __version__

#: The modules whose public names this package offers, in the order a name is looked up.
_MODULES = (
    "checkpoints",
    "compilation",
    "kernel_logs",
    "own_loop",
    "rank_model",
    "routing_fit",
    "slots",
    "stand_ins",
)


def _module(name: str) -> Any:
    return importlib.import_module(f"{__name__}.{name}")


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return ["__version__", *(n for m in _MODULES for n in _module(m).__all__)]
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a module of the package
        return _module(name)
    for module_name in _MODULES:
        module = _module(module_name)
        if name in module.__all__:
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
