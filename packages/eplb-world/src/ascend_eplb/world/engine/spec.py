"""What one engine of the engine world serves, as vLLM's own engine arguments: one source for ``vllm.LLM``
(:meth:`EngineSpec.engine_kwargs`) and ``vllm serve`` (:meth:`EngineSpec.serve_argv`).

The settings every engine of the world takes, and why: float32 unless said (this host's CPU kernels are
torch forms), ``compilation_config.custom_ops = ["none"]`` (vLLM's native torch forms of RMSNorm, rotary
embedding and the activations: their ``_C`` kernels are absent), a KV cache of a few MiB (the automatic size
is most of the host's memory), MLA checkpoints on ``CPU_MLA`` (vLLM's reference MLA backend; an AMX host
would pick ``AMX_MLA``, whose weight packing is a ``_C`` op) and vLLM's CPU worker loaded through the world
(:mod:`.worker`). A compiled engine (:data:`COMPILATIONS`) runs without vLLM's JIT kernel warm-up: it
compiles Triton kernels ahead of the first request, and here every Triton kernel runs in Triton's
interpreter, which compiles nothing and rejects the warm-up's grammar-bitmask store ("mask has unsupported
dtype"; an eager engine skips the warm-up too). Nothing here imports vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["COMPILATIONS", "EngineSpec", "EplbSpec"]

#: The compiled executions vLLM's CPU platform serves, by TorchDynamo backend (``EngineSpec.compilation``):
#: ``inductor`` is vLLM's default mode ``VLLM_COMPILE``, which the platform turns into ``DYNAMO_TRACE_ONCE``
#: with ``inductor``; ``eager`` is ``DYNAMO_TRACE_ONCE`` with the ``eager`` backend, what the platform sets
#: under its CI switch (``vllm/platforms/cpu.py``), named here so that the warm-up still traces.
COMPILATIONS: Mapping[str, Mapping[str, Any]] = {
    "eager": {"mode": "DYNAMO_TRACE_ONCE", "backend": "eager"},
    "inductor": {"mode": "VLLM_COMPILE"},
}

#: vLLM's CPU worker class, loaded through the engine world (:mod:`.worker`).
WORKER_CLS = "ascend_eplb.world.engine.worker.CPUWorker"


@dataclass(frozen=True)
class EplbSpec:
    """EPLB of an engine: upstream's ``--eplb-config`` keys and the project's Ascend keys
    (``additional_config.eplb_config``). The async worker always (the only mode the integration serves)."""

    window_size: int = 4
    step_interval: int = 4
    num_redundant_experts: int = 2
    ascend: Mapping[str, Any] = field(default_factory=dict)

    def eplb_config(self) -> dict[str, Any]:
        """Upstream's ``EPLBConfig`` keys."""
        return {
            "window_size": self.window_size,
            "step_interval": self.step_interval,
            "num_redundant_experts": self.num_redundant_experts,
            "use_async": True,
        }


@dataclass(frozen=True)
class EngineSpec:
    """One engine: the checkpoint ``model`` (a local folder) served in ``dtype`` (vLLM's ``--dtype``), its
    parallel layout (EP on whenever more than one rank serves), EPLB (None: off, upstream's engine
    exactly), the MTP draft's ``speculative_tokens`` (0: none), ``compilation`` (vLLM's
    ``compilation_config`` mode and backend; None: eager) and the scheduler's sizes."""

    model: str
    dtype: str = "float32"
    tensor_parallel_size: int = 2
    data_parallel_size: int = 1
    eplb: EplbSpec | None = None
    speculative_tokens: int = 0
    compilation: Mapping[str, Any] | None = None
    max_num_seqs: int = 8
    max_model_len: int = 256
    kv_cache_memory_bytes: int = 16 << 20
    seed: int = 0

    @property
    def num_ranks(self) -> int:
        """DP x TP: the EP ranks."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def eager(self) -> bool:
        return self.compilation is None

    def _uses_mla(self) -> bool:
        config = json.loads((Path(self.model) / "config.json").read_text())
        return bool(config.get("kv_lora_rank"))

    def environment(self) -> dict[str, str]:
        """The variables this engine's processes take beside the world's (:mod:`.environment`):
        ``ASCEND_EPLB=1`` with EPLB (the integration's plugin), ``TORCHDYNAMO_DISABLE=1`` when eager, and
        with data parallelism ``CPU_VISIBLE_MEMORY_NODES``, memory node 0 for each of the N ranks (vLLM's
        CPU engine binds DP rank d's ranks to nodes d x TP ..; this host has one node)."""
        env = {}
        if self.eplb is not None:
            env["ASCEND_EPLB"] = "1"
        if self.eager:
            env["TORCHDYNAMO_DISABLE"] = "1"
        if self.data_parallel_size > 1:
            env["CPU_VISIBLE_MEMORY_NODES"] = ",".join(["0"] * self.num_ranks)
        return env

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` / ``EngineArgs``."""
        compilation = {"custom_ops": ["none"], **(self.compilation or {})}
        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "seed": self.seed,
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "enable_expert_parallel": self.num_ranks > 1,
            "enforce_eager": self.eager,
            "compilation_config": compilation,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            # vLLM's per-request timing (time to first token, per output token) and its periodic log.
            "disable_log_stats": False,
        }
        kwargs["worker_cls"] = WORKER_CLS
        if not self.eager:
            kwargs["kernel_config"] = {"enable_jit_warmup": False}
        if self._uses_mla():
            kwargs["attention_backend"] = "CPU_MLA"
        if self.speculative_tokens:
            kwargs["speculative_config"] = {
                "method": "mtp",
                "num_speculative_tokens": self.speculative_tokens,
            }
        if self.eplb is not None:
            kwargs["enable_eplb"] = True
            kwargs["eplb_config"] = self.eplb.eplb_config()
            if self.eplb.ascend:
                kwargs["additional_config"] = {"eplb_config": dict(self.eplb.ascend)}
        return kwargs

    def serve_argv(self) -> list[str]:
        """The same engine as ``vllm serve`` arguments (the model folder first, then one flag per keyword:
        True -> the bare flag, a mapping -> its JSON)."""
        kwargs = self.engine_kwargs()
        argv = [kwargs.pop("model")]
        for key, value in kwargs.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is False:
                continue
            elif isinstance(value, Mapping):
                argv += [flag, json.dumps(value)]
            else:
                argv += [flag, str(value)]
        return argv
