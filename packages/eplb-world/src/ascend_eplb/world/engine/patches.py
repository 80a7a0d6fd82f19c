"""The engine world's patches of vLLM 0.33.0: what its engine needs on a CPU host beyond the ``_C`` kernels
(:mod:`.kernels`) and the platform patches (:mod:`.platform_patches`).

:data:`ENGINE_PATCHES` are installed by the general plugin in every engine process, after vLLM resolved
its platform; :data:`WORKER_PATCHES` by :mod:`.worker` in every worker process, after vLLM's CPU worker
module. Each is declared on its factory (``@ascend_eplb.world.upstream.SURFACE.replaces``) and checked
against vLLM's signature before anything changes (``PatchSet``). Imports vLLM (through the world's
``stand_ins``) and Triton (control's host adaptation): only the general plugin, after the opt-in, and the
worker import it (:mod:`~ascend_eplb.world.engine`'s import-order rule).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ascend_eplb.control.host_adaptation import HostEvent
from ascend_eplb.control.patching import Patch, PatchSet, patches_of
from ascend_eplb.world import stand_ins, upstream

__all__ = [
    "ENGINE_PATCHES",
    "WORKER_PATCHES",
    "install_engine_patches",
    "install_worker_patches",
]


@upstream.SURFACE.replaces(
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts.apply",
    "with an `expert_map` (expert parallelism), each selection's global physical id -> its local slot, -1 "
    "for another rank's, before upstream's (vLLM 0.33.0 passes the map but its CPU kernel reads global ids "
    "as local slots: outputs on EP ranks > 0 were wrong; vllm-project/vllm#57837)",
)
def _local_expert_ids(original: Any) -> Any:
    @functools.wraps(original)
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, **kwargs):  # fmt: skip
        if expert_map is not None:
            local = expert_map[topk_ids.clamp(min=0).long()]
            topk_ids = torch.where(topk_ids >= 0, local, -1).to(topk_ids.dtype)
        return original(
            self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
            expert_map, *args, **kwargs,
        )  # fmt: skip

    return apply


def _check_cpu_event_placeholder(original: Any) -> None:
    if getattr(original, "__name__", None) != "_EventPlaceholder" or hasattr(original, "elapsed_time"):
        raise RuntimeError(
            f"torch.Event after vllm.v1.worker.cpu.shm is {original!r}, not vLLM 0.33.0's _EventPlaceholder "
            "without elapsed_time: the engine world's worker row must be reviewed "
            "(ascend_eplb.world.engine.patches)"
        )


@upstream.SURFACE.replaces(
    ("vllm.v1.worker.cpu.shm", "torch.Event"),
    "`torch.Event` as vLLM's CPU worker module leaves it (its `_EventPlaceholder`: no `elapsed_time`) -> "
    "control's `HostEvent` again: vLLM imports that module after the plugins ran, undoing the host "
    "adaptation's row, and upstream's profile rearrangement (`EplbState.rearrange(is_profile=True)`, in "
    "the warm-up vLLM's CPU worker runs for a compiled model) times itself with `elapsed_time`",
    check=_check_cpu_event_placeholder,
)
def _host_event_after_cpu_worker(original: Any) -> Any:
    return HostEvent


#: Installed in every engine process by the general plugin: the EP ids above, the world's 16-bit linear
#: layers (``ascend_eplb.world.stand_ins``, stand-in 3: on an AMX host vLLM packs bf16/fp16 weights with a
#: ``_C`` op) and its variable-size collectives (data parallelism's gather before routing, stand-in 5).
ENGINE_PATCHES: tuple[Patch, ...] = (
    *patches_of(_local_expert_ids),
    *(p for p in stand_ins.STAND_INS if p.name != "torch._dynamo.config.disable"),
)

#: Installed in every worker process once vLLM's CPU worker module is imported (:mod:`.worker`).
WORKER_PATCHES: tuple[Patch, ...] = patches_of(_host_event_after_cpu_worker)

_ENGINE = PatchSet(ENGINE_PATCHES)
_WORKER = PatchSet(WORKER_PATCHES)


def install_engine_patches() -> bool:
    """Install :data:`ENGINE_PATCHES`; idempotent. True if this call installed them."""
    return _ENGINE.apply()


def install_worker_patches() -> bool:
    """Install :data:`WORKER_PATCHES` (after vLLM's CPU worker module is imported); idempotent. True if this
    call installed them."""
    return _WORKER.apply()
