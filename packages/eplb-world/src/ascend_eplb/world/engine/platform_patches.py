"""The engine world's platform patches of vLLM 0.33.0 and Triton: a CPU build of vLLM, and a Triton whose
``cpu`` backend is the interpreter.

:data:`PLATFORM_PATCHES` are installed by the platform plugin while vLLM resolves its platform and before
``vllm.triton_utils`` checks for Triton, each declared on its factory
(``@ascend_eplb.world.upstream.SURFACE.replaces``) and checked before anything changes (``PatchSet``). vLLM
imports this module while it resolves its platform, so it imports no more of vLLM (its modules would ask
for the platform being resolved). It imports Triton at the top: in an engine process the platform plugin
imports it after the opt-in, and the process started with ``TRITON_INTERPRET=1`` (:mod:`.environment`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton.backends import Backend
from triton.backends.driver import DriverBase

from ascend_eplb.control.patching import Patch, PatchSet, patches_of
from ascend_eplb.world import upstream

__all__ = ["PLATFORM_PATCHES", "install_platform_patches"]


@upstream.SURFACE.replaces(
    "vllm.platforms.vllm_version_matches_substr",
    '`"cpu"` -> True (this `empty` build serves as vLLM\'s CPU build: its Triton check then takes the '
    "`cpu` backend below); every other substring upstream's",
)
def _cpu_build(original: Any) -> Any:
    @functools.wraps(original)
    def vllm_version_matches_substr(substr: str) -> bool:
        return substr == "cpu" or original(substr)

    return vllm_version_matches_substr


def _check_backends(original: Any) -> None:
    if not isinstance(original, dict) or "cpu" in original:
        raise RuntimeError(
            "triton.backends.backends is not a dict without a `cpu` entry: this Triton has a CPU backend "
            "(or another layout), and the engine world's entry must go "
            "(ascend_eplb.world.engine.platform_patches)"
        )


def _active() -> bool:
    return True


@upstream.SURFACE.replaces(
    ("triton.backends", "backends"),
    "upstream's backends and a `cpu` entry whose driver is active: vLLM's Triton check on a CPU build "
    "asks for one; every kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`), which needs no driver",
    check=_check_backends,
)
def _cpu_backend(original: dict[str, Any]) -> dict[str, Any]:
    class InterpreterDriver(DriverBase):
        """The `cpu` backend's driver: active, and nothing else (the interpreter compiles nothing)."""

        is_active = staticmethod(_active)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_current_target(self) -> Any:
            raise NotImplementedError("kernels run in Triton's interpreter (TRITON_INTERPRET=1)")

        def get_benchmarker(self) -> Any:
            raise NotImplementedError("kernels run in Triton's interpreter (TRITON_INTERPRET=1)")

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("kernels run in Triton's interpreter (TRITON_INTERPRET=1)")

    return {**original, "cpu": Backend(compiler=None, driver=InterpreterDriver)}


#: Installed while vLLM resolves its platform (before ``vllm.triton_utils`` checks for Triton).
PLATFORM_PATCHES: tuple[Patch, ...] = patches_of(_cpu_build, _cpu_backend)

_PLATFORM = PatchSet(PLATFORM_PATCHES)


def install_platform_patches() -> bool:
    """Install :data:`PLATFORM_PATCHES`; idempotent. True if this call installed them."""
    return _PLATFORM.apply()
