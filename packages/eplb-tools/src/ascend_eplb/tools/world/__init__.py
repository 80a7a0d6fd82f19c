"""The serving world ``ascend-eplb simulate`` runs on a CPU host, split by job.

* :mod:`~ascend_eplb.tools.world.checkpoints`: tiny checkpoints of vLLM's real MoE architectures
  (written with transformers, read back: sizes, tensors, routed experts).
* :mod:`~ascend_eplb.tools.world.quant_method`: vLLM Ascend's quantized experts on this host
  (msModelSlim checkpoints, the ``"ascend"`` quantization config and a FusedMoE method per format).

Nothing of the serving path imports this package; the tests of the packages under it use it as the
simulator does (one world, one path).
"""
