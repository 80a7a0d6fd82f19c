"""The serving world on a CPU host: what ``ascend-eplb simulate`` runs and the tests of the packages under
the tools run too (one world, one path). Nothing of the serving path imports it.

Re-exports its modules' names: :mod:`~ascend_eplb.world.checkpoints` (tiny checkpoints of vLLM's real
MoE architectures), :mod:`~ascend_eplb.world.stand_ins` (the CPU stand-ins for what this host lacks),
:mod:`~ascend_eplb.world.kernel_logs` (what the expert methods consumed), :mod:`~ascend_eplb.world.compiled`
(a compiled world observed), :mod:`~ascend_eplb.world.slots` (what each physical slot must hold) and
:mod:`~ascend_eplb.world.serving` (a rank's model and the :class:`~ascend_eplb.world.serving.ServingWorker`).
:mod:`~ascend_eplb.world.quant_method` (vLLM Ascend's quantized experts) and
:mod:`~ascend_eplb.world.toy_moe` (the toy MoE model) are imported by name. Importing the package imports
no vLLM or transformers (each function imports them): the tools' option parsing and ``plan`` import it.
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
