"""vLLM's CPU worker as the engine world loads it: ``parallel_config.worker_cls`` of every engine
(:meth:`.spec.EngineSpec.engine_kwargs`) names :data:`CPUWorker` here, vLLM's own class.

vLLM's CPU worker module imports ``vllm.v1.worker.cpu.shm``, which binds ``torch.Event`` to vLLM's
``_EventPlaceholder`` (no-op ``record``/``wait``/``synchronize``, no ``elapsed_time``) at import. vLLM
imports the worker class after the plugins ran, so the project's host adaptation (``torch.Event`` ->
``HostEvent``, ``ascend_eplb.control.host_adaptation``) is undone in each worker, and upstream's profile
rearrangement (the warm-up vLLM's CPU worker runs for a compiled model) raised AttributeError on
``elapsed_time``. Importing this module imports vLLM's CPU worker first, then installs
:data:`.patches.WORKER_PATCHES` (declared, checked against vLLM's placeholder).
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from ascend_eplb.world.engine.patches import install_worker_patches

__all__ = ["CPUWorker"]

install_worker_patches()
