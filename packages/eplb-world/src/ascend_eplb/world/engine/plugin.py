"""The engine world's vLLM plugins: entry points of this package, inert unless opted in.

``vllm.platform_plugins`` :func:`platform_plugin` and ``vllm.general_plugins`` :func:`general_plugin` run
in every vLLM process of an environment where this package is installed. Without
``ASCEND_EPLB_ENGINE_WORLD=1`` (:mod:`.environment`) both return at once, import nothing and change nothing:
vLLM runs as if this package were absent. With it, vLLM's own engine (``LLM``, ``vllm serve``) runs Model
Runner V2 on this CPU host: the platform plugin selects vLLM's ``CpuPlatform`` after making Triton's
interpreter acceptable to it (:data:`.platform_patches.PLATFORM_PATCHES`); the general plugin defines the
``_C`` kernels (:mod:`.kernels`) and installs :data:`.patches.ENGINE_PATCHES`.
"""

from __future__ import annotations

from ascend_eplb.world.engine.environment import opted_in

__all__ = ["CPU_PLATFORM", "general_plugin", "platform_plugin"]

#: The platform the engine world serves on: vLLM's own CPU platform.
CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"


def platform_plugin() -> str | None:
    """Entry point of ``vllm.platform_plugins``: :data:`CPU_PLATFORM` when opted in (after the platform
    patches), else None (vLLM's own detection decides)."""
    if not opted_in():
        return None
    # local: nothing before the opt-in (world.engine's import-order rule)
    from ascend_eplb.world.engine.platform_patches import install_platform_patches

    install_platform_patches()
    return CPU_PLATFORM


def general_plugin() -> None:
    """Entry point of ``vllm.general_plugins``: when opted in, the ``_C`` kernels and the engine patches."""
    if not opted_in():
        return
    # local: nothing before the opt-in (world.engine's import-order rule)
    from ascend_eplb.world.engine.kernels import register
    from ascend_eplb.world.engine.patches import install_engine_patches

    register()
    install_engine_patches()
