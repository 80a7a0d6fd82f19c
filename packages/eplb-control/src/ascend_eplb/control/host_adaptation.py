"""Device-neutral adaptation of upstream EPLB for hosts without an accelerator (CPU with Gloo).

vLLM 0.33.0's ``EplbState``, its asynchronous worker and ``EPLBController`` run unmodified on a CPU
host, except at exactly four points (measured: ``notes/upstream-on-cpu.md``; DESIGN.md section 6):

1. **platform check**: ``ParallelConfig._validate_parallel_config`` (``vllm/config/parallel.py``
   lines 563-568) refuses ``enable_eplb`` unless ``current_platform.is_cuda_alike()`` or ``is_xpu()``.
   Adapted with a narrow proxy bound to ``vllm.config.parallel.current_platform`` only: it answers
   ``is_cuda_alike() -> True`` and forwards everything else to the real platform. In vLLM 0.33.0 that
   module consults ``is_cuda_alike()`` for the EPLB check and nowhere else (checked at install from the
   module's source, so a new use fails loudly instead of being silently answered). A config helper
   would only cover configs this project builds itself, not ``VllmConfig`` built by vLLM's engine
   arguments; the proxy also keeps ``ParallelConfig.__post_init__``'s communicator choice (line 1116)
   working, since ``enable_eplb`` can be set at construction.
2. **events**: ``torch.Event().record()`` / ``elapsed_time()`` raise "cpu backend doesn't support
   events" (``eplb_state.py`` 783-785, 955-957; ``eplb_utils.CpuGpuEvent.record``). ``torch.Event`` is
   replaced by :class:`HostEvent`, a subclass whose ``record`` takes a host timestamp (CPU work is
   synchronous, so "recorded" is "done").
3. **streams**: ``torch.accelerator.set_device_index`` / ``current_stream`` / ``set_stream`` raise
   "Cannot access accelerator device when none is available" (``async_worker.py`` 33,
   ``eplb_utils.device_stream``, ``eplb_communicator.py`` 232). They become a no-op, the CPU stream and
   a no-op. ``device_stream`` is imported by name into three upstream modules, so the torch functions
   are the single narrow point.
4. **device index**: ``EplbState.__init__`` sets ``device_index`` only for cuda/xpu devices
   (``eplb_state.py`` 295-298), and the async worker asserts it (``async_worker.py`` 28/32). The wrapped
   ``__init__`` sets it to 0 for a CPU device.

Every point does nothing on a host where ``torch.accelerator.is_available()`` is true (npu, cuda, xpu):
:func:`install` returns False there and patches nothing. :func:`install` is idempotent and checks the
signature of every callable it replaces; :func:`uninstall` restores the originals.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Any

import torch

from ascend_eplb.control._signatures import check_signature

__all__ = ["HostEvent", "install", "is_installed", "uninstall"]

_LOCK = threading.Lock()
#: (owner object, attribute name) -> original value, filled while installed.
_ORIGINALS: dict[tuple[Any, str], Any] = {}
_TorchEvent = torch.Event

#: vLLM 0.33.0 text of the single ``is_cuda_alike()`` use in ``vllm.config.parallel`` (the EPLB check).
_EPLB_PLATFORM_CHECK = "if not current_platform.is_cuda_alike() and not current_platform.is_xpu():"
_EPLB_PLATFORM_ERROR = "Expert parallelism load balancing is only supported on"


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


class _EplbCapablePlatform:
    """The platform as ``vllm.config.parallel`` sees it: EPLB-capable, everything else unchanged."""

    def __init__(self, platform: Any) -> None:
        object.__setattr__(self, "_platform", platform)

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_platform"), name)

    def __repr__(self) -> str:
        return f"_EplbCapablePlatform({object.__getattribute__(self, '_platform')!r})"


def _set_device_index(device: Any, /) -> None:
    return None


def _current_stream(device: Any = None, /) -> torch.Stream:
    return torch.Stream(device="cpu")


def _set_stream(stream: torch.Stream) -> None:
    return None


def _check_parallel_module(parallel_module: Any) -> None:
    source = inspect.getsource(parallel_module)
    uses = source.count("current_platform.is_cuda_alike()")
    if uses != 1 or _EPLB_PLATFORM_CHECK not in source or _EPLB_PLATFORM_ERROR not in source:
        raise RuntimeError(
            "upstream ParallelConfig._validate_parallel_config changed: vllm.config.parallel must consult "
            f"current_platform.is_cuda_alike() exactly once, in the EPLB check (found {uses} uses); the "
            "host platform proxy of ascend_eplb.control.host_adaptation must be reviewed"
        )


def _wrap_eplb_state_init(original: Any) -> Any:
    @functools.wraps(original)
    def init(self: Any, parallel_config: Any, device: torch.device) -> None:
        original(self, parallel_config, device)
        if self.device_index is None and self.device.type == "cpu":
            self.device_index = 0

    init._ascend_eplb_host_adaptation = True  # type: ignore[attr-defined]
    return init


def install() -> bool:
    """Adapt upstream EPLB to a host without an accelerator; idempotent.

    Returns:
        True if the adaptation is active after the call; False on a host with an accelerator
        (``torch.accelerator.is_available()``), where nothing is changed.

    Raises:
        RuntimeError: a callable it would replace changed signature since vLLM 0.33.0 / torch 2.13.0
            (naming it), or ``vllm.config.parallel`` consults the platform differently. Nothing is
            changed in that case.
    """
    if torch.accelerator.is_available():
        return False
    import vllm.config.parallel as parallel_module
    from vllm.distributed.eplb.eplb_state import EplbState

    with _LOCK:
        if _ORIGINALS:
            return True
        check_signature(EplbState.__init__, "EplbState.__init__", ("self", "parallel_config", "device"))
        check_signature(torch.accelerator.set_device_index, "torch.accelerator.set_device_index", ("device",))
        check_signature(torch.accelerator.current_stream, "torch.accelerator.current_stream", ("device",))
        check_signature(torch.accelerator.set_stream, "torch.accelerator.set_stream", ("stream",))
        _check_parallel_module(parallel_module)

        replacements: list[tuple[Any, str, Any]] = [
            (parallel_module, "current_platform", _EplbCapablePlatform(parallel_module.current_platform)),
            (torch, "Event", HostEvent),
            (torch.accelerator, "set_device_index", _set_device_index),
            (torch.accelerator, "current_stream", _current_stream),
            (torch.accelerator, "set_stream", _set_stream),
            (EplbState, "__init__", _wrap_eplb_state_init(EplbState.__init__)),
        ]
        for owner, name, value in replacements:
            _ORIGINALS[(owner, name)] = (
                owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            )
            setattr(owner, name, value)
        return True


def uninstall() -> bool:
    """Restore every original :func:`install` replaced; idempotent.

    Returns:
        True if something was restored, False if the adaptation was not installed.
    """
    with _LOCK:
        if not _ORIGINALS:
            return False
        for (owner, name), original in reversed(list(_ORIGINALS.items())):
            setattr(owner, name, original)
        _ORIGINALS.clear()
        return True


def is_installed() -> bool:
    """Whether :func:`install` is in effect in this process."""
    return bool(_ORIGINALS)
