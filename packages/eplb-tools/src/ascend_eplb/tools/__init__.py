"""Operator tools of Ascend EPLB: the ``ascend-eplb`` command (its embedded ESFT trace is the world's).

``simulate`` drives vLLM's own engine through the serving path (``ascend_eplb.integration``), never a
copy of it (the trace replay runs its ranks over Gloo), ``plan`` answers what-if questions offline from
recorded load, ``check`` validates a configuration with the rules serving start-up applies. Nothing of
the serving path imports this package.
"""

from ascend_eplb.tools.__about__ import __version__

__all__ = ["__version__"]
