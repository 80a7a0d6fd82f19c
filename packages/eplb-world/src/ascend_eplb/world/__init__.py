"""The serving world on a CPU host, split by job: what ``ascend-eplb simulate`` runs and the tests of the
packages under the tools run too (one world, one path).

* :mod:`~ascend_eplb.world.checkpoints`: tiny checkpoints of vLLM's real MoE architectures
  (written with transformers, in float, 16-bit or msModelSlim's quantized layout; routing bias fitted
  to a recorded popularity; read back: sizes, tensors, routed experts, format).
* :mod:`~ascend_eplb.world.quant_method`: vLLM Ascend's quantized experts on this host
  (the ``"ascend"`` quantization config and a FusedMoE method per format).
* :mod:`~ascend_eplb.world.stand_ins`: the CPU stand-ins for the device features vLLM lacks on
  this host (expert compute, attention, 16-bit linear layers) and their installation.
* :mod:`~ascend_eplb.world.kernel_logs`: what the CPU expert methods consumed (ids, calls), logged
  in device tensors a compiled forward writes in place.
* :mod:`~ascend_eplb.world.compiled`: a compiled world's models observed as vLLM compiles them
  (dataplane's graph observer as the ``eager`` backend), TorchDynamo's counters.
* :mod:`~ascend_eplb.world.slots`: what each physical slot must hold (upstream's initial placement,
  the checkpoint's experts or their kernel storage) and the slots that do not.
* :mod:`~ascend_eplb.world.serving`: one rank's vLLM model and the serving worker
  (:class:`~ascend_eplb.world.serving.ServingWorker`) ``simulate`` and the real-model tests drive.
* :mod:`~ascend_eplb.world.toy_moe`: the toy MoE model of ``simulate --model replay`` (upstream's
  real routers, pluggable expert storage), which multi-rank tests with tagged weights run too.

This package's names are those of its modules, re-exported; importing it imports no vLLM (each function
imports what it needs). Nothing of the serving path imports it.
"""

from ascend_eplb.world import checkpoints, compiled, kernel_logs, serving, slots, stand_ins
from ascend_eplb.world.__about__ import __version__
from ascend_eplb.world.checkpoints import *  # noqa: F403
from ascend_eplb.world.compiled import *  # noqa: F403
from ascend_eplb.world.kernel_logs import *  # noqa: F403
from ascend_eplb.world.serving import *  # noqa: F403
from ascend_eplb.world.slots import *  # noqa: F403
from ascend_eplb.world.stand_ins import *  # noqa: F403

__all__ = [
    "__version__",
    *checkpoints.__all__,
    *compiled.__all__,
    *kernel_logs.__all__,
    *serving.__all__,
    *slots.__all__,
    *stand_ins.__all__,
]
