"""Upstream EPLB on hosts without an accelerator, and on platforms vLLM does not call CUDA-alike.

vLLM 0.33.0's EPLB runs unmodified on a CPU host but at five points (measured: ``notes/upstream-on-cpu.md``,
``notes/real-models-on-cpu.md``; README "Host adaptation"), each declared on its factory
(``@upstream.SURFACE.replaces``), listed in :data:`PATCHES`, installed by integration's ``apply_patches()``;
points 2-5 apply only where ``torch.accelerator.is_available()`` is False:

1. ``ParallelConfig`` refuses ``enable_eplb`` unless CUDA-alike or XPU (Ascend's platform too): the proxy
   :class:`EplbCapablePlatform`, bound to ``vllm.config.parallel.current_platform`` only.
2. ``torch.Event`` ("cpu backend doesn't support events") -> :class:`HostEvent`.
3. ``torch.accelerator.set_device_index`` / ``current_stream`` / ``set_stream`` -> no-op / CPU stream /
   no-op (upstream imports ``device_stream`` by name in three modules: these are the narrow point).
4. ``EplbState.__init__`` sets ``device_index = 0`` on a CPU device (the async worker asserts it).
5. ``torch.accelerator.empty_cache`` (vLLM's model loader) -> no-op.
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any

import torch

from ascend_eplb.control import upstream
from ascend_eplb.control.patching import Patch, patches_of

__all__ = ["PATCHES", "EplbCapablePlatform", "HostEvent", "has_accelerator"]

_TorchEvent = torch.Event

#: vLLM 0.33.0 text of the single ``is_cuda_alike()`` use in ``vllm.config.parallel`` (the EPLB check).
_EPLB_PLATFORM_CHECK = "if not current_platform.is_cuda_alike() and not current_platform.is_xpu():"
_EPLB_PLATFORM_ERROR = "Expert parallelism load balancing is only supported on"
_NO_ACCELERATOR = "no accelerator (`torch.accelerator.is_available()` is False)"


def has_accelerator() -> bool:
    """Whether torch sees an accelerator (npu, cuda, xpu) in this process."""
    return bool(torch.accelerator.is_available())


def _no_accelerator() -> bool:
    return not has_accelerator()


def _platform_not_cuda_alike() -> bool:
    # local: integration's ``patches`` imports this module without vLLM
    import vllm.config.parallel as parallel_module

    return not parallel_module.current_platform.is_cuda_alike()


def _check_parallel_module(_platform: Any) -> None:
    # local: integration's ``patches`` imports this module without vLLM
    import vllm.config.parallel as parallel_module

    source = inspect.getsource(parallel_module)
    uses = source.count("current_platform.is_cuda_alike()")
    if uses != 1 or _EPLB_PLATFORM_CHECK not in source or _EPLB_PLATFORM_ERROR not in source:
        raise RuntimeError(
            "upstream ParallelConfig._validate_parallel_config changed: vllm.config.parallel must consult "
            f"current_platform.is_cuda_alike() exactly once, in the EPLB check (found {uses} uses); the "
            "host platform proxy of ascend_eplb.control.host_adaptation must be reviewed"
        )


def _check_platform(platform: Any) -> None:
    if not callable(getattr(platform, "is_cuda_alike", None)):
        raise RuntimeError("upstream vllm.config.parallel.current_platform has no is_cuda_alike()")
    _check_parallel_module(platform)


class HostEvent(_TorchEvent):
    """A ``torch.Event`` for host-only execution: ``record`` stores a ``time.perf_counter`` timestamp.

    It stays an instance of ``torch.Event``. Host work is synchronous, so an event is complete as soon as
    it is recorded: ``wait``, ``synchronize`` return at once and ``query`` is True.
    """

    def __init__(self, device: Any = None, *, enable_timing: bool = False, **_: Any) -> None:
        # torch.Event.__new__ consumes the constructor arguments; no super().__init__ call.
        self._recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s (the unit of ``torch.Event``).

        Raises:
            RuntimeError: either event was never recorded.
        """
        if self._recorded_at is None or getattr(end_event, "_recorded_at", None) is None:
            raise RuntimeError("HostEvent.elapsed_time: both events must be recorded first")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


@upstream.SURFACE.replaces(
    ("vllm.config.parallel", "current_platform"),
    "`EplbCapablePlatform`: `is_cuda_alike()` is True, everything else the real platform's (the module "
    "must consult it exactly once, in the EPLB check)",
    when=_platform_not_cuda_alike,
    applies="the platform is not CUDA-alike",
    check=_check_platform,
)
class EplbCapablePlatform:
    """The platform as ``vllm.config.parallel`` sees it: ``is_cuda_alike()`` True, everything else forwarded.

    That module consults ``is_cuda_alike()`` only in the EPLB check (its source is checked at installation, so
    a new use fails loudly), and ``ParallelConfig.__post_init__``'s communicator choice still runs.
    """

    def __init__(self, platform: Any) -> None:
        object.__setattr__(self, "_platform", platform)

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_platform"), name)

    def __repr__(self) -> str:
        return f"EplbCapablePlatform({object.__getattribute__(self, '_platform')!r})"


@upstream.SURFACE.replaces(
    ("torch", "Event"),
    "`HostEvent`: a `torch.Event` that records a host timestamp",
    when=_no_accelerator,
    applies=_NO_ACCELERATOR,
)
def _as_host_event(_original: Any) -> type[HostEvent]:
    return HostEvent


def _set_device_index(device: Any, /) -> None:
    return None


def _current_stream(device: Any = None, /) -> torch.Stream:
    return torch.Stream(device="cpu")


def _set_stream(stream: torch.Stream) -> None:
    return None


def _empty_cache() -> None:
    return None


@upstream.SURFACE.replaces(
    "torch.accelerator.set_device_index", "a no-op", when=_no_accelerator, applies=_NO_ACCELERATOR
)
def _as_set_device_index(_original: Any) -> Any:
    return _set_device_index


@upstream.SURFACE.replaces(
    "torch.accelerator.current_stream", "the CPU stream", when=_no_accelerator, applies=_NO_ACCELERATOR
)
def _as_current_stream(_original: Any) -> Any:
    return _current_stream


@upstream.SURFACE.replaces(
    "torch.accelerator.set_stream", "a no-op", when=_no_accelerator, applies=_NO_ACCELERATOR
)
def _as_set_stream(_original: Any) -> Any:
    return _set_stream


@upstream.SURFACE.replaces(
    "torch.accelerator.empty_cache",
    "a no-op (vLLM's model loader calls it)",
    when=_no_accelerator,
    applies=_NO_ACCELERATOR,
)
def _as_empty_cache(_original: Any) -> Any:
    return _empty_cache


@upstream.SURFACE.replaces(
    "vllm.distributed.eplb.eplb_state.EplbState.__init__",
    "upstream's, then `device_index = 0` on a CPU device (the async worker asserts it)",
    when=_no_accelerator,
    applies=_NO_ACCELERATOR,
)
def _wrap_eplb_state_init(original: Any) -> Any:
    @functools.wraps(original)
    def init(self: Any, parallel_config: Any, device: torch.device) -> None:
        original(self, parallel_config, device)
        if self.device_index is None and self.device.type == "cpu":
            self.device_index = 0

    return init


#: The adaptation, in installation order (see the module docstring for each point).
PATCHES: tuple[Patch, ...] = patches_of(
    EplbCapablePlatform,
    _as_host_event,
    _as_set_device_index,
    _as_current_stream,
    _as_set_stream,
    _as_empty_cache,
    _wrap_eplb_state_init,
)
