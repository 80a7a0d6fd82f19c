"""The CPU world's upstream surface as one document: every row, rendered where every owner of a row is
importable.

The stand-ins are declared on their factories (``@ascend_eplb.world.upstream.SURFACE.replaces``) and
listed in :data:`ascend_eplb.world.stand_ins.STAND_INS`; the instance bindings, attributes and signatures
are the tables of :mod:`ascend_eplb.world.upstream` (its ``SURFACE``). :func:`render` writes their tables
(``UPSTREAM.md`` of this package; a test keeps them equal: ``python -m ascend_eplb.world.surface`` prints
it). Importing it imports vLLM (the stand-ins subclass and patch vLLM's classes).
"""

from __future__ import annotations

from ascend_eplb.control.markdown import markdown_table, patch_table
from ascend_eplb.world import stand_ins, upstream
from ascend_eplb.world.engine import kernels, patches, platform_patches

__all__ = ["render"]


def render() -> str:
    """The tables of every row of the CPU world, as Markdown (what ``UPSTREAM.md`` of this package holds)."""
    return upstream.SURFACE.render(
        "The CPU world's upstream surface",
        "What the CPU world (`ascend_eplb.world`: vLLM's own engine on this host, and the world's serving "
        "worker) meets of upstream vLLM 0.33.0, torch 2.13.0 and Triton where this CPU build of vLLM lacks "
        "a device kernel or collective, and what the world reads. Generated "
        "from the rows (each stand-in's on its factory in `ascend_eplb.world.stand_ins`, the tables of "
        "`ascend_eplb.world.upstream`) by `python -m ascend_eplb.world.surface > "
        "packages/eplb-world/UPSTREAM.md`; a test keeps this file equal to them. Never installed or checked "
        "by serving: `world.stand_ins.install_stand_ins` checks every row before it installs anything.",
        [
            ("Module-level stand-ins (`STAND_INS`, in installation order)", patch_table(stand_ins.STAND_INS)),
            (
                "The engine world's platform patches (`engine.platform_patches.PLATFORM_PATCHES`, while vLLM "
                "resolves its platform; opted in by `ASCEND_EPLB_ENGINE_WORLD=1`)",
                patch_table(platform_patches.PLATFORM_PATCHES),
            ),
            (
                "The engine world's patches (`engine.patches.ENGINE_PATCHES`, in every engine process)",
                patch_table(patches.ENGINE_PATCHES),
            ),
            (
                "The engine world's worker patches (`engine.patches.WORKER_PATCHES`, in every worker process "
                "once vLLM's CPU worker module is imported: `engine.worker`)",
                patch_table(patches.WORKER_PATCHES),
            ),
            (
                "The engine world's `_C` kernels (`engine.kernels.KERNELS`: torch forms, registered in "
                "torch's `_C` namespace)",
                markdown_table(
                    ("op schema", "called by"), ((f"`{k.schema}`", f"`{k.caller}`") for k in kernels.KERNELS)
                ),
            ),
        ],
    )


if __name__ == "__main__":
    print(render(), end="")
