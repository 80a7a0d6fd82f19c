"""The compilations ``simulate --compile`` gives vLLM's engine, named as vLLM names them.

:data:`COMPILE_BACKENDS` and :func:`compilation_of` turn the option into a ``compilation_config``;
:func:`compilation_error` says why this host cannot serve one, :func:`is_compiled` whether it compiles.
Standard library only: ``check`` and ``simulate``'s option rules read it before torch or vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["COMPILATION_MODES", "COMPILE_BACKENDS", "compilation_error", "compilation_of", "is_compiled"]

#: The TorchDynamo backends ``simulate --compile`` takes, as vLLM's CPU platform chooses them for
#: ``CompilationMode.VLLM_COMPILE`` (``platforms/cpu.py``: ``DYNAMO_TRACE_ONCE`` with ``inductor``, or
#: ``eager`` under its CI switch ``VLLM_CPU_CI_ENV``). The world's own loop runs eager.
COMPILE_BACKENDS = ("eager", "inductor")
#: vLLM's ``CompilationMode`` values by name (``vllm/config/compilation.py``).
COMPILATION_MODES = {"NONE": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_TRACE_ONCE": 2, "VLLM_COMPILE": 3}


def compilation_of(backend: str | None) -> dict[str, Any] | None:
    """The ``compilation_config`` of an engine compiled with ``backend`` (:data:`COMPILE_BACKENDS`) as
    vLLM's CPU platform sets it: ``inductor`` is vLLM's default mode, ``VLLM_COMPILE``, which the
    platform turns into ``DYNAMO_TRACE_ONCE`` with ``inductor`` and its inductor options; ``eager`` is
    what it sets under its CI switch, ``DYNAMO_TRACE_ONCE`` with ``eager``. None: None (eager execution,
    ``enforce_eager``).

    Raises:
        ValueError: another backend.
    """
    if backend is None:
        return None
    if backend == "inductor":
        return {"mode": COMPILATION_MODES["VLLM_COMPILE"]}
    if backend == "eager":
        return {"mode": COMPILATION_MODES["DYNAMO_TRACE_ONCE"], "backend": "eager"}
    raise ValueError(f"compile backend {backend!r} must be one of {list(COMPILE_BACKENDS)} (or None: eager)")


def compilation_error(compilation: Any) -> str | None:
    """Why the CPU world cannot serve ``compilation`` (a vLLM ``compilation_config`` mapping, or None:
    eager execution), or None.

    The world serves vLLM's own compilation of the model on this host: ``mode`` ``VLLM_COMPILE`` (3,
    vLLM's default; the CPU platform makes it ``DYNAMO_TRACE_ONCE``) or ``DYNAMO_TRACE_ONCE`` (2) with
    ``backend`` ``eager`` or ``inductor``, or ``NONE`` (0: eager); ``STOCK_TORCH_COMPILE`` (1) is compiled
    by vLLM's model runner, which the world does not run. Keys besides ``mode``, ``backend`` and
    ``inductor_compile_config`` are refused (``custom_ops``: the world runs vLLM's native torch forms,
    as vLLM's CPU kernels are absent here).
    """
    if compilation is None:
        return None
    if not isinstance(compilation, dict):
        return f"compilation_config={compilation!r} must be a mapping (vLLM's --compilation-config)"
    extra = sorted(set(compilation) - {"mode", "backend", "inductor_compile_config"})
    if extra:
        return (
            f"compilation_config keys {extra}: the CPU world takes mode, backend and "
            "inductor_compile_config (custom_ops stays ['none']: vLLM's CPU kernels are absent here)"
        )
    inductor = compilation.get("inductor_compile_config", {})
    if not isinstance(inductor, dict):
        return (
            f"compilation_config inductor_compile_config={inductor!r} must be a mapping (vLLM's "
            "CompilationConfig reads it as a dict of inductor options)"
        )
    mode = compilation.get("mode", COMPILATION_MODES["VLLM_COMPILE"])
    mode = COMPILATION_MODES.get(mode, mode) if isinstance(mode, str) else mode
    if isinstance(mode, bool) or mode not in (0, 2, 3):
        return (
            f"compilation_config mode={compilation.get('mode')!r} must be 0 (NONE), 2 (DYNAMO_TRACE_ONCE) or "
            "3 (VLLM_COMPILE, vLLM's default: DYNAMO_TRACE_ONCE on CPU); 1 (STOCK_TORCH_COMPILE) is "
            "compiled by vLLM's model runner, which the CPU world does not run"
        )
    backend = compilation.get("backend", "inductor" if mode == 3 else "")
    if mode == 2 and backend not in COMPILE_BACKENDS:
        return f"compilation_config backend={backend!r} must be one of {list(COMPILE_BACKENDS)} with mode 2"
    return None


def is_compiled(compilation: dict[str, Any] | None) -> bool:
    """Whether ``compilation`` (valid by :func:`compilation_error`) compiles the model."""
    if compilation is None:
        return False
    mode = compilation.get("mode", COMPILATION_MODES["VLLM_COMPILE"])
    return COMPILATION_MODES.get(mode, mode) != 0 if isinstance(mode, str) else mode != 0
