"""The serving world ``ascend-eplb simulate`` runs on a CPU host, split by job.

* :mod:`~ascend_eplb.tools.world.checkpoints`: tiny checkpoints of vLLM's real MoE architectures
  (written with transformers, read back: sizes, tensors, routed experts).

Nothing of the serving path imports this package; the tests of the packages under it use it as the
simulator does (one world, one path).
"""
