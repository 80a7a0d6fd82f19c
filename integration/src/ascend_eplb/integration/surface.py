"""The serving product's upstream surface as one document: every row, rendered where every owner of a
row is importable.

The rows are declared beside their code: each module-level replacement on its replacement factory
(``@SURFACE.replaces`` of :mod:`ascend_eplb.control.upstream` in control's ``host_adaptation`` and
``commit_hooks``, of :mod:`ascend_eplb.integration.upstream` in this package's ``patches`` and
``watchdog``), collected in installation order by :data:`ascend_eplb.integration.patches.PATCHES`; the
other rows in the tables of those two modules (``patches.SURFACE`` joins them, the integration's
first). :func:`render` writes their tables (``integration/UPSTREAM.md``; a test keeps them equal:
``python -m ascend_eplb.integration.surface`` prints it).
"""

from __future__ import annotations

from ascend_eplb.control.markdown import patch_table
from ascend_eplb.integration import patches

__all__ = ["render"]


def render() -> str:
    """The tables of every row of the serving product, as Markdown (what ``integration/UPSTREAM.md``
    holds)."""
    return patches.SURFACE.render(
        "The upstream surface",
        "Every point where the ascend_eplb serving product meets upstream vLLM 0.33.0 and torch 2.13.0. "
        "Generated from the rows (each replacement's on its replacement factory, "
        "`@upstream.SURFACE.replaces`; the tables of `ascend_eplb.integration.upstream`, then of "
        "`ascend_eplb.control.upstream`) by `python -m ascend_eplb.integration.surface > "
        "integration/UPSTREAM.md`; a test keeps this file equal to them. Integration's `check_upstream()` "
        "checks every row before the first patch (`RuntimeError` naming the one that drifted); the "
        "controller and the state check theirs when they are constructed.",
        [
            ("Module-level replacements (`PATCHES`, in installation order)", patch_table(patches.PATCHES)),
        ],
    )


if __name__ == "__main__":
    print(render(), end="")
