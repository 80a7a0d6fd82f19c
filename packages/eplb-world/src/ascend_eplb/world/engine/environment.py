"""The environment of every process of the engine world, written down once.

vLLM's engine spawns its engine-core and worker processes, which inherit the environment of the process
that starts the engine; so the engine world's environment is set when that process starts (a fresh
``python``), never in a process that has already imported torch, Triton or vLLM. :func:`engine_environment`
builds it from a base environment; nothing here imports torch or vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "ENGINE_ENVIRONMENT",
    "REMOVED",
    "SWITCH",
    "cache_root",
    "engine_environment",
    "opted_in",
]

#: The opt-in of the engine world's plugins (``vllm.platform_plugins`` and ``vllm.general_plugins`` of
#: this package): without ``1`` they return at once and vLLM runs as if this package were not installed.
SWITCH = "ASCEND_EPLB_ENGINE_WORLD"

#: The environment variable of the project's cache root (:func:`cache_root`).
CACHE_ENV = "ASCEND_EPLB_CACHE"

#: Every variable the engine world sets, and why.
ENGINE_ENVIRONMENT: Mapping[str, str] = {
    SWITCH: "1",
    # Model Runner V2's kernels are Triton's; this host's Triton has no CPU backend, so they run in
    # Triton's interpreter, which must be on before torch or vLLM first imports triton.language.
    "TRITON_INTERPRET": "1",
    # vLLM 0.33.0's default, stated: the V2 runner (the CPU platform would otherwise pick V1).
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    # Thread binding needs one NUMA node per rank; a 2-core host has one.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # No hub, no network: checkpoints are local folders.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # Loopback only: vLLM's own sockets and Gloo.
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    # The world observes the workers by sending them functions (vLLM's collective_rpc with a callable),
    # which vLLM pickles only with this switch.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    # One torch thread per process: several ranks share the host's cores.
    "OMP_NUM_THREADS": "1",
    # A compiled engine traces and compiles the model in its own warm-up: vLLM's compile cache would hand
    # it the graph an earlier engine compiled and outlive it (the host points VLLM_CACHE_ROOT at its own
    # TMPDIR, which vLLM still creates folders under).
    "VLLM_DISABLE_COMPILE_CACHE": "1",
}

#: Variables the engine world removes: ``VLLM_TARGET_DEVICE=cpu`` makes vLLM skip platform plugins, so the
#: world's platform plugin (which registers what Triton's interpreter needs before vLLM checks for Triton)
#: would never run.
REMOVED = ("VLLM_TARGET_DEVICE",)


def engine_environment(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default ``os.environ``) with :data:`ENGINE_ENVIRONMENT` set, :data:`REMOVED` removed and
    ``extra`` set last (e.g. ``ASCEND_EPLB="1"``, ``TORCHDYNAMO_DISABLE="1"``)."""
    env = dict(os.environ if base is None else base)
    for name in REMOVED:
        env.pop(name, None)
    env.update(ENGINE_ENVIRONMENT)
    env.update(extra)
    return env


def opted_in(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is an engine-world process (:data:`SWITCH` is ``1``)."""
    return (os.environ if environ is None else environ).get(SWITCH) == "1"


def cache_root() -> Path:
    """The project's cache folder: ``$ASCEND_EPLB_CACHE``, default ``~/.cache/ascend-eplb`` (an empty or
    blank value is unset: ``Path("")`` would be the current folder). It holds the presets (``models/``)
    and vLLM's model-class inspections kept across engines (``vllm-modelinfos/``)."""
    raw = os.environ.get(CACHE_ENV, "")
    return Path(raw) if raw.strip() else Path.home() / ".cache" / "ascend-eplb"
