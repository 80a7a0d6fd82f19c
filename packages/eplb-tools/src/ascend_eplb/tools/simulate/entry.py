"""The rank function the launcher is handed: importable without vLLM.

The launcher only needs the function's module and name to start it in each rank; the rank module itself
(:mod:`ascend_eplb.tools.simulate.rank`, which imports vLLM) is imported once, by the fork server
(``preload``), and every rank forked from it has it already: the launcher never imports vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["simulate_rank"]


def simulate_rank(ctx: Any, cfg: dict, routing: dict, gather: bool = False) -> Any:
    """:func:`ascend_eplb.tools.simulate.rank.simulate_rank` (same arguments and result)."""
    from ascend_eplb.tools.simulate.rank import simulate_rank as run  # local: imports vLLM (docstring)

    return run(ctx, cfg, routing, gather)
