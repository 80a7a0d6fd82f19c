"""One rank's model on vLLM 0.33.0's real MoE model classes, built and run by the world's own loop.

:func:`build_model` builds one rank's model of the tiny checkpoints of :mod:`~ascend_eplb.world.checkpoints`
with vLLM's ``get_model`` under DP x TP with EP over Gloo (:func:`parallel_layout`, every DP rank in one
world as vLLM's external launcher runs them) and :func:`forward` runs a prefill forward (the HF oracle is
``ascend_eplb.testing.hf``). :func:`prepare_world` installs the project's patches (as the plugin does) and
the CPU stand-ins. ``custom_ops=["none"]``: RMSNorm, rotary, SiluAndMul, embeddings and logits run native
torch, eager. Imports vLLM: only :mod:`~ascend_eplb.world.own_loop` and the tests import this module.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from vllm.config import (
    AttentionConfig,
    CompilationConfig,
    EPLBConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import parallel_state, tensor_model_parallel_all_gather
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from ascend_eplb.integration.patches import apply_patches
from ascend_eplb.world.checkpoints import VOCAB_SIZE
from ascend_eplb.world.stand_ins import install_model_stand_ins, install_stand_ins

__all__ = [
    "ParallelLayout",
    "build_model",
    "forward",
    "init_world",
    "load_model",
    "moe_layers",
    "parallel_layout",
    "prepare_world",
    "prompt",
    "routed_experts",
]


@dataclass(frozen=True)
class ParallelLayout:
    """A world's DP x TP layout (EP spans both: ``ep_rank = dp_rank * tp_size + tp_rank``, vLLM's order).

    Attributes:
        data_parallel_size: D, the DP ranks (each with its own batch).
        tensor_parallel_size: TP, the ranks of one DP rank (fed the same batch).

    The MoE row layout vLLM takes on it is the controller's (``ascend_eplb.control.layout``
    ``default_moe_rows``): on this host ``replicated`` (D = 1), ``gathered`` (D > 1, TP = 1) or
    ``gathered-sp`` (D > 1, TP > 1: vLLM's ``ParallelConfig.use_sequence_parallel_moe`` holds for the
    CPU's ``allgather_reducescatter`` backend with EP, TP > 1 and DP > 1, so no plain ``gathered`` with
    TP > 1 here).
    """

    data_parallel_size: int
    tensor_parallel_size: int

    @property
    def num_ranks(self) -> int:
        """D x TP."""
        return self.data_parallel_size * self.tensor_parallel_size

    def dp_rank(self, rank: int) -> int:
        """The DP rank of global ``rank``."""
        return rank // self.tensor_parallel_size

    def tp_rank(self, rank: int) -> int:
        """The TP rank of global ``rank``."""
        return rank % self.tensor_parallel_size


def parallel_layout(num_ranks: int, data_parallel_size: int = 1) -> ParallelLayout:
    """The :class:`ParallelLayout` of ``num_ranks`` ranks with D = ``data_parallel_size``.

    Raises:
        ValueError: D is not an int >= 1, or does not divide ``num_ranks``.
    """
    if (
        isinstance(data_parallel_size, bool)
        or not isinstance(data_parallel_size, int)
        or data_parallel_size < 1
    ):
        raise ValueError(f"data_parallel_size={data_parallel_size!r} must be an int >= 1")
    if num_ranks % data_parallel_size:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} must divide the {num_ranks} ranks (ranks = DP x TP)"
        )
    return ParallelLayout(data_parallel_size, num_ranks // data_parallel_size)


def _external_launcher_environment(ctx: Any) -> None:
    """``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` of ``ctx``: what vLLM's external launcher reads (its
    ``ParallelConfig`` derives ``data_parallel_rank`` from ``RANK``); under torchrun they are set already
    and equal."""
    os.environ["RANK"] = str(ctx.rank)
    os.environ["LOCAL_RANK"] = str(ctx.local_rank)
    os.environ["WORLD_SIZE"] = str(ctx.world_size)


def _vllm_config(
    folder: Path,
    num_ranks: int,
    enable_eplb: bool,
    eplb: dict[str, Any] | None,
    data_parallel_size: int = 1,
) -> Any:
    layout = parallel_layout(num_ranks, data_parallel_size)
    # D > 1: every DP rank in this one world, as vLLM's external launcher runs them (data_parallel_rank
    # from RANK; the world is D x TP).
    data_parallel = (
        {}
        if layout.data_parallel_size == 1
        else {
            "data_parallel_size": layout.data_parallel_size,
            "distributed_executor_backend": "external_launcher",
        }
    )
    parallel = ParallelConfig(
        tensor_parallel_size=layout.tensor_parallel_size,
        enable_expert_parallel=True,
        enable_eplb=enable_eplb,
        eplb_config=EPLBConfig(**(eplb or {})),
        **data_parallel,
    )
    config = json.loads((folder / "config.json").read_text())
    quantized = (folder / "quant_model_description.json").is_file()
    model_config = ModelConfig(
        model=str(folder),
        tokenizer=str(folder),
        skip_tokenizer_init=True,
        # explicit: vLLM's "auto" would serve a float32 checkpoint in a 16-bit dtype
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        quantization="ascend" if quantized else None,
        enforce_eager=True,
        max_model_len=256,
    )
    # MLA: the reference CPU_MLA backend, never AMX_MLA (picked on CPUs with AMX tiles; its weight
    # processing after loading needs vllm._C). Its forward is replaced by the SDPA stand-in anyway.
    attention = (
        AttentionConfig(backend=AttentionBackendEnum.CPU_MLA) if model_config.use_mla else AttentionConfig()
    )
    return VllmConfig(
        model_config=model_config,
        # No loading progress bar: tqdm's multiprocessing lock would be a semaphore of each rank.
        load_config=LoadConfig(use_tqdm_on_load=False),
        parallel_config=parallel,
        compilation_config=CompilationConfig(custom_ops=["none"]),
        attention_config=attention,
    )


def init_world(ctx: Any, vllm_config: Any) -> None:
    """vLLM's distributed environment over Gloo for ``ctx``'s world (D x TP of ``vllm_config``);
    idempotent."""
    if parallel_state.model_parallel_is_initialized():
        return
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(
            world_size=ctx.world_size,
            rank=ctx.rank,
            distributed_init_method=ctx.init_method,
            local_rank=ctx.local_rank,
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=vllm_config.parallel_config.tensor_parallel_size
        )


def _thread_lock_for_tqdm() -> None:
    """Give tqdm a threading lock before vLLM's loader makes its (disabled) progress bar.

    tqdm's class lock is otherwise a ``multiprocessing`` semaphore, created at the first bar of each
    process and never released: one leaked semaphore per rank at shutdown (the resource tracker warns).
    A rank has no child process to share the lock with.
    """
    if getattr(tqdm, "_lock", None) is None:
        tqdm.set_lock(threading.RLock())


def prepare_world(
    ctx: Any,
    folder: str | os.PathLike[str],
    *,
    enable_eplb: bool = False,
    eplb: dict[str, Any] | None = None,
    data_parallel_size: int = 1,
    dispatch: str = "gather",
) -> Any:
    """What a worker has before it loads the model of ``folder``: its ``VllmConfig`` and vLLM's world.

    Installs the project's patches (``apply_patches``, as the plugin does) and the CPU stand-ins
    (:func:`~ascend_eplb.world.stand_ins.install_stand_ins`), builds the ``VllmConfig`` (the checkpoint's
    dtype, ``quantization="ascend"`` with an msModelSlim description, ``custom_ops=["none"]``, eager,
    expert parallel, ``enable_eplb``; D > 1: the external launcher's DP fields and environment) and
    initialises vLLM's distributed environment once per process (D x TP = ``ctx.world_size`` ranks over
    Gloo, EP over all). ``dispatch``: ``gather`` (vLLM's) or ``all-to-all`` (route-first, vLLM Ascend's
    MC2 stood in; TP = 1). Others as :func:`build_model`.

    Raises:
        ValueError: D does not divide the world, an unknown ``dispatch``, or ``all-to-all`` with TP > 1 or
            a quantized checkpoint.
    """
    layout = parallel_layout(ctx.world_size, data_parallel_size)  # refused before anything changes
    if dispatch == "all-to-all" and layout.tensor_parallel_size != 1:
        raise ValueError(
            f"dispatch='all-to-all' with TP={layout.tensor_parallel_size}: the route-first stand-in routes "
            "each rank's own rows (vLLM Ascend's MC2 with TP = 1); use data_parallel_size = the ranks"
        )
    folder = Path(folder)
    apply_patches()
    install_stand_ins(quantized=(folder / "quant_model_description.json").is_file(), dispatch=dispatch)
    _thread_lock_for_tqdm()
    if data_parallel_size > 1:
        _external_launcher_environment(ctx)
    vllm_config = _vllm_config(folder, ctx.world_size, enable_eplb, eplb, data_parallel_size)
    init_world(ctx, vllm_config)
    return vllm_config


def load_model(vllm_config: Any) -> torch.nn.Module:
    """vLLM's ``get_model`` (safetensors loader) under ``vllm_config`` (:func:`prepare_world`), then the
    stand-ins of the built model (``stand_ins.install_model_stand_ins``: attention and, for quantized
    experts, vllm-ascend's ``get_expert_weights``)."""
    with set_current_vllm_config(vllm_config):
        model = get_model(vllm_config=vllm_config)
    install_model_stand_ins(model)
    return model


def build_model(
    ctx: Any,
    folder: str | os.PathLike[str],
    *,
    enable_eplb: bool = False,
    eplb: dict[str, Any] | None = None,
    data_parallel_size: int = 1,
    dispatch: str = "gather",
) -> tuple[torch.nn.Module, Any]:
    """One rank's vLLM model of the checkpoint in ``folder`` (:func:`write_checkpoint`): :func:`prepare_world`
    (the arguments are its: ``enable_eplb`` ``ParallelConfig.enable_eplb``, ``eplb`` ``EPLBConfig`` fields,
    ``data_parallel_size`` D, each DP rank feeding its own batch and its TP ranks the same one), then
    :func:`load_model`. Returns ``(model, vllm_config)``.
    """
    vllm_config = prepare_world(
        ctx, folder, enable_eplb=enable_eplb, eplb=eplb, data_parallel_size=data_parallel_size,
        dispatch=dispatch,
    )  # fmt: skip
    return load_model(vllm_config), vllm_config


def moe_layers(model: torch.nn.Module) -> list[Any]:
    """The model's MoE layers (``MixtureOfExperts.moe_layers``: vLLM's ``MoERunner`` s), in order."""
    return list(model.moe_layers)


def routed_experts(model: torch.nn.Module) -> list[Any]:
    """Each MoE layer's ``RoutedExperts`` (holding ``w13_weight`` ``(p, 2I, H)``, ``w2_weight``
    ``(p, H, I)``, ``expert_map`` and ``quant_method``), in order."""
    return [layer.routed_experts for layer in moe_layers(model)]


def forward(
    model: torch.nn.Module, vllm_config: Any, input_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One prefill forward of one sequence inside ``set_forward_context``. With D > 1 every DP rank calls it
    together, each on its own batch of the same T (Model Runner V2 pads every DP rank to one count).

    Args:
        model, vllm_config: from :func:`build_model`.
        input_ids: int64 ``(T,)``; positions: int64 ``(T,)``, ``0..T-1`` (the attention stand-ins are
            causal from position 0).

    Returns:
        float32 ``(T, V)`` logits of this rank's batch, on every TP rank (gathered over TP).
    """
    with (
        torch.inference_mode(),
        set_current_vllm_config(vllm_config),
        _forward_context(vllm_config, int(input_ids.shape[0])),
    ):
        hidden = model(input_ids=input_ids, positions=positions)
        logits = F.linear(hidden, model.lm_head.weight)  # (T, V / TP): this rank's vocabulary shard
        logits = tensor_model_parallel_all_gather(logits.contiguous(), dim=-1)
        logits = logits[:, : model.config.vocab_size].float()
    return logits


def _forward_context(vllm_config: Any, num_tokens: int) -> Any:
    """``set_forward_context`` of one forward of ``num_tokens`` rows on every DP rank (Model Runner V2
    pads the DP ranks to one token count)."""
    dp = int(vllm_config.parallel_config.data_parallel_size)
    across_dp = torch.tensor([num_tokens] * dp, dtype=torch.int32) if dp > 1 else None
    return set_forward_context(None, vllm_config, num_tokens=num_tokens, num_tokens_across_dp=across_dp)


def prompt(seed: int, num_tokens: int = 12, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """A deterministic prompt: int64 ``(num_tokens,)`` ids in ``[0, vocab_size)`` from ``seed``."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=g)
