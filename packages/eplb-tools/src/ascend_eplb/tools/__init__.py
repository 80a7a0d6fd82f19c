"""Operator tools of Ascend EPLB: the ``ascend-eplb`` command (its embedded ESFT trace is the world's).

``simulate`` runs the serving product (``ascend_eplb.integration``) on CPU rank processes over Gloo,
``plan`` answers what-if questions offline from recorded load, ``check`` validates a configuration
with the rules serving start-up applies. Nothing of the serving path imports this package.
"""

from ascend_eplb.tools.__about__ import __version__

__all__ = ["__version__"]
