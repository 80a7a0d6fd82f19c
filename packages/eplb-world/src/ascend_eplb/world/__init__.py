"""The test world: tiny checkpoints of vLLM's real MoE model classes, the embedded ESFT data and the
declared opt-in CPU stand-ins that let vLLM's own engine serve on a host without its device kernels; used
by the tools and the tests, never by a serving image (nothing of the serving path imports it).

:mod:`.engine` runs vLLM's own engine on this host (opted in per process); :mod:`.own_loop` serves the
cases that engine cannot (``README.md``, "What runs where") with :mod:`.rank_model`, :mod:`.stand_ins`,
:mod:`.quant_method`, :mod:`.kernel_logs` and :mod:`.slots`; :mod:`.checkpoints` and :mod:`.routing_fit`
write the models, :mod:`.esft` holds the real load, :mod:`.compilation` the compilations ``simulate
--compile`` gives vLLM's engine, :mod:`.toy_moe` the replay's toy model, :mod:`.upstream` the world's rows
of the upstream surface. Each name is imported from the module that defines it. Importing this package
imports neither torch, vLLM nor Triton: vLLM loads the engine world's plugin entry points, inside it, in
every process of an environment that installs it.
"""

from ascend_eplb.world.__about__ import __version__ as __version__
