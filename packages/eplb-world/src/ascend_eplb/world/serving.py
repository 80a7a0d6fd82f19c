"""vLLM 0.33.0's real MoE model classes on a CPU host: a rank's model and the serving worker.

DESIGN.md section 5 asks for the invariants to be proven on vLLM's real model classes, here on the
tiny checkpoints of :mod:`~ascend_eplb.world.checkpoints`: :func:`build_model` builds one rank's model
with vLLM's ``get_model`` under DP x TP with EP over Gloo (:func:`parallel_layout`, every DP rank in one
world as vLLM's external launcher runs them) and :func:`forward` runs a prefill forward (the HF oracle
is ``ascend_eplb.testing.hf``); :class:`ServingWorker` is one Model Runner V2 worker with EPLB on beside
the EPLB-off model; :func:`real_model_world` drives it for N steps. :func:`prepare_world` installs the
project's patches (as the plugin does) and the CPU stand-ins. ``custom_ops=["none"]``: RMSNorm, rotary,
SiluAndMul, embeddings and logits run native torch; eager or compiled as vLLM's CPU platform compiles
(:func:`compilation_of`). vLLM and transformers are imported inside functions (see :mod:`~ascend_eplb.world`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ascend_eplb.control.bus import DecisionEvent
from ascend_eplb.dataplane.graphs import TracedGraph
from ascend_eplb.integration.patches import apply_patches
from ascend_eplb.integration.runner import Mrv2EplbWiring, batch_has_prefill
from ascend_eplb.quant_views import layer_storage, layer_view_names
from ascend_eplb.world.checkpoints import (
    VOCAB_SIZE,
    checkpoint_experts,
    checkpoint_format,
    checkpoint_info,
)
from ascend_eplb.world.compiled import (
    compiled_module,
    dynamo_counters,
    observe_compilation,
)
from ascend_eplb.world.kernel_logs import kernel_log
from ascend_eplb.world.slots import (
    checkpoint_expert_storage,
    initial_physical_to_logical,
    local_slot_mismatches,
    slot_fingerprint_mismatches,
)
from ascend_eplb.world.stand_ins import install_model_stand_ins, install_stand_ins

__all__ = [
    "COMPILATION_MODES",
    "COMPILE_BACKENDS",
    "DraftStep",
    "ParallelLayout",
    "RealModelSpec",
    "ServingWorker",
    "WorkerStep",
    "build_model",
    "compilation_error",
    "compilation_of",
    "forward",
    "forward_draft",
    "init_world",
    "is_compiled",
    "load_draft",
    "load_model",
    "moe_layers",
    "parallel_layout",
    "prepare_world",
    "prompt",
    "real_model_world",
    "routed_experts",
]

# --- a rank's model --------------------------------------------------------------------------------


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


#: The TorchDynamo backends of a compiled world, as vLLM's CPU platform chooses them for
#: ``CompilationMode.VLLM_COMPILE`` (``platforms/cpu.py``: ``DYNAMO_TRACE_ONCE`` with ``inductor``, or
#: ``eager`` under its CI switch ``VLLM_CPU_CI_ENV``).
COMPILE_BACKENDS = ("eager", "inductor")
#: vLLM's ``CompilationMode`` values by name (``vllm/config/compilation.py``).
COMPILATION_MODES = {"NONE": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_TRACE_ONCE": 2, "VLLM_COMPILE": 3}


def compilation_of(backend: str | None) -> dict[str, Any] | None:
    """The ``compilation_config`` of a world compiled with ``backend`` (:data:`COMPILE_BACKENDS`) as
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


def _vllm_config(
    folder: Path,
    num_ranks: int,
    enable_eplb: bool,
    eplb: dict[str, Any] | None,
    data_parallel_size: int = 1,
    compilation: dict[str, Any] | None = None,
    speculative_tokens: int = 0,
) -> Any:
    from vllm.config import (
        AttentionConfig,
        CompilationConfig,
        EPLBConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

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
        enforce_eager=not is_compiled(compilation),
        max_model_len=256,
    )
    # MLA: the reference CPU_MLA backend, never AMX_MLA (picked on CPUs with AMX tiles; its weight
    # processing after loading needs vllm._C). Its forward is replaced by the SDPA stand-in anyway.
    attention = (
        AttentionConfig(backend=AttentionBackendEnum.CPU_MLA) if model_config.use_mla else AttentionConfig()
    )
    # MTP: vLLM derives the draft's config from the target's (DeepSeek-V3: DeepSeekMTPModel).
    speculative = (
        SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=speculative_tokens,
            target_model_config=model_config,
            target_parallel_config=parallel,
        )
        if speculative_tokens
        else None
    )
    return VllmConfig(
        model_config=model_config,
        # No loading progress bar: tqdm's multiprocessing lock would be a semaphore of each rank.
        load_config=LoadConfig(use_tqdm_on_load=False),
        parallel_config=parallel,
        compilation_config=CompilationConfig(**{**(compilation or {}), "custom_ops": ["none"]}),
        attention_config=attention,
        speculative_config=speculative,
    )


def init_world(ctx: Any, vllm_config: Any) -> None:
    """vLLM's distributed environment over Gloo for ``ctx``'s world (D x TP of ``vllm_config``);
    idempotent."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

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
    compilation: dict[str, Any] | None = None,
    speculative_tokens: int = 0,
) -> Any:
    """What a worker has before it loads the model of ``folder``: its ``VllmConfig`` and vLLM's world.

    Installs the project's patches (``apply_patches``, as the plugin does) and the CPU stand-ins
    (:func:`~ascend_eplb.world.stand_ins.install_stand_ins`), builds the ``VllmConfig`` (the checkpoint's
    dtype, ``quantization="ascend"`` with an msModelSlim description, ``custom_ops=["none"]``, expert
    parallel, ``enable_eplb``; D > 1: the external launcher's DP fields and environment; compiled: vLLM's
    compile caches under ``ctx.tmp_dir`` unless ``VLLM_CACHE_ROOT`` is set) and initialises vLLM's
    distributed environment once per process (D x TP = ``ctx.world_size`` ranks over Gloo, EP over all).
    ``dispatch``: ``gather`` (vLLM's) or ``all-to-all`` (route-first, vLLM Ascend's MC2 stood in; TP = 1).
    ``compilation`` (:func:`compilation_of`; None: eager): the first forward is TorchDynamo's one trace
    (guards dropped), so what each forward must read fresh is in place before it. ``speculative_tokens``
    N >= 1: vLLM's MTP speculative config (the draft: :func:`load_draft`). Others as :func:`build_model`.

    Raises:
        ValueError: D does not divide the world, an unknown ``dispatch``, ``all-to-all`` with TP > 1 or a
            quantized checkpoint, a ``compilation`` the world cannot serve (:func:`compilation_error`), or a
            compiled world of experts that are not float32.
    """
    layout = parallel_layout(ctx.world_size, data_parallel_size)  # refused before anything changes
    if dispatch == "all-to-all" and layout.tensor_parallel_size != 1:
        raise ValueError(
            f"dispatch='all-to-all' with TP={layout.tensor_parallel_size}: the route-first stand-in routes "
            "each rank's own rows (vLLM Ascend's MC2 with TP = 1); use data_parallel_size = the ranks"
        )
    reason = compilation_error(compilation)
    if reason is not None:
        raise ValueError(reason)
    folder = Path(folder)
    compiled = is_compiled(compilation)
    if compiled and checkpoint_format(folder) is not None:
        raise ValueError(
            f"a compiled world serves float32 experts; {folder} holds {checkpoint_format(folder)} experts, "
            "whose CPU stand-in computes each selection on its own with host reads (eager only)"
        )
    apply_patches()
    install_stand_ins(
        quantized=(folder / "quant_model_description.json").is_file(), dispatch=dispatch, compiled=compiled
    )
    if compiled:
        # vLLM's compile caches (its AOT-compiled models, inductor's kernels) in this world's folder, not
        # in ~/.cache/vllm: every run traces anew, and nothing outlives the world.
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(ctx.tmp_dir) / "vllm-cache"))
    _thread_lock_for_tqdm()
    if data_parallel_size > 1:
        _external_launcher_environment(ctx)
    vllm_config = _vllm_config(
        folder, ctx.world_size, enable_eplb, eplb, data_parallel_size, compilation, speculative_tokens
    )
    init_world(ctx, vllm_config)
    return vllm_config


def load_model(vllm_config: Any) -> torch.nn.Module:
    """vLLM's ``get_model`` (safetensors loader) under ``vllm_config`` (:func:`prepare_world`), then the
    stand-ins of the built model (``stand_ins.install_model_stand_ins``: attention and, for quantized
    experts, vllm-ascend's ``get_expert_weights``)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    with set_current_vllm_config(vllm_config):
        model = get_model(vllm_config=vllm_config)
    install_model_stand_ins(model)
    return model


def load_draft(vllm_config: Any, target_model: torch.nn.Module) -> Any:
    """The draft of ``vllm_config``'s speculative config, as Model Runner V2 loads it: upstream's
    ``init_speculator`` (``MTPSpeculator`` for MTP), whose ``load_model`` builds the draft with vLLM's
    loader from the target's checkpoint (DeepSeek-V3: ``DeepSeekMTP`` from its MTP layer, the target's
    embedding and head shared), then the stand-ins of the built draft (attention, as the target's).

    Returns:
        the speculator; its ``model`` is the draft.
    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    with set_current_vllm_config(vllm_config):
        speculator = init_speculator(vllm_config, torch.device("cpu"), None)
        speculator.load_model(target_model)
    install_model_stand_ins(speculator.model)
    return speculator


def build_model(
    ctx: Any,
    folder: str | os.PathLike[str],
    *,
    enable_eplb: bool = False,
    eplb: dict[str, Any] | None = None,
    data_parallel_size: int = 1,
    dispatch: str = "gather",
    compilation: dict[str, Any] | None = None,
    speculative_tokens: int = 0,
) -> tuple[torch.nn.Module, Any]:
    """One rank's vLLM model of the checkpoint in ``folder`` (:func:`write_checkpoint`): :func:`prepare_world`
    (the arguments are its: ``enable_eplb`` ``ParallelConfig.enable_eplb``, ``eplb`` ``EPLBConfig`` fields,
    ``data_parallel_size`` D, each DP rank feeding its own batch and its TP ranks the same one), then
    :func:`load_model`. Returns ``(model, vllm_config)``.
    """
    vllm_config = prepare_world(
        ctx, folder, enable_eplb=enable_eplb, eplb=eplb, data_parallel_size=data_parallel_size,
        dispatch=dispatch, compilation=compilation, speculative_tokens=speculative_tokens,
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
    return _forward(model, vllm_config, input_ids, positions)[1]


def _forward_context(vllm_config: Any, num_tokens: int) -> Any:
    """``set_forward_context`` of one forward of ``num_tokens`` rows on every DP rank (Model Runner V2
    pads the DP ranks to one token count)."""
    from vllm.forward_context import set_forward_context

    dp = int(vllm_config.parallel_config.data_parallel_size)
    across_dp = torch.tensor([num_tokens] * dp, dtype=torch.int32) if dp > 1 else None
    return set_forward_context(None, vllm_config, num_tokens=num_tokens, num_tokens_across_dp=across_dp)


def _logits(hidden: torch.Tensor, head: Any, vocab_size: int) -> torch.Tensor:
    """float32 ``(T, V)`` logits of ``hidden`` through the vocabulary-parallel ``head``, gathered over TP."""
    from vllm.distributed import tensor_model_parallel_all_gather

    logits = F.linear(hidden, head.weight)  # (T, vocab_size / TP): this rank's vocabulary shard
    logits = tensor_model_parallel_all_gather(logits.contiguous(), dim=-1)
    return logits[:, :vocab_size].float()


def _forward(
    model: torch.nn.Module, vllm_config: Any, input_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward`'s ``(hidden (T, H), logits (T, V))``: the model's output hidden states (what Model
    Runner V2 hands an MTP draft) beside the logits."""
    from vllm.config import set_current_vllm_config

    with (
        torch.inference_mode(),
        set_current_vllm_config(vllm_config),
        _forward_context(vllm_config, int(input_ids.shape[0])),
    ):
        hidden = model(input_ids=input_ids, positions=positions)
        logits = _logits(hidden, model.lm_head, model.config.vocab_size)
    return hidden, logits


def forward_draft(
    draft: torch.nn.Module,
    vllm_config: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of an MTP draft (vLLM's ``DeepSeekMTP``), as Model Runner V2's
    ``TargetDependentARSpeculator._run_model`` calls it inside the forward context.

    Args:
        draft: the speculator's ``model`` (:func:`load_draft`); vllm_config: its config.
        input_ids: int64 ``(T,)``, at row ``t`` the token after the target's token ``t``; positions: int64
            ``(T,)``, ``0..T-1``.
        hidden_states: ``(T, H)``: the target's output (first draft step) or the previous draft step's.

    Returns:
        ``(hidden (T, H), logits (T, V))``: the hidden states of the next step (after the shared head's
        norm, as vLLM recycles them) and float32 logits through the shared head, gathered over TP.
    """
    from vllm.config import set_current_vllm_config

    with (
        torch.inference_mode(),
        set_current_vllm_config(vllm_config),
        _forward_context(vllm_config, int(input_ids.shape[0])),
    ):
        logits_hidden, next_hidden = draft(
            input_ids=input_ids, positions=positions, hidden_states=hidden_states
        )
        layer = draft.model.layers[str(draft.model.mtp_start_layer_idx)]
        logits = _logits(layer.shared_head(logits_hidden), layer.shared_head.head, draft.config.vocab_size)
    return next_hidden, logits


def prompt(seed: int, num_tokens: int = 12, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """A deterministic prompt: int64 ``(num_tokens,)`` ids in ``[0, vocab_size)`` from ``seed``."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=g)


# --- the serving worker ---------------------------------------------------------------------------


@dataclass
class WorkerStep:
    """What one :meth:`ServingWorker.forward_step` saw.

    Attributes:
        logits_on: float32 ``(T, vocab_size)`` of the EPLB-on model (every row, padding included).
        logits_off: the EPLB-off model's on the same ids, or None without an EPLB-off model.
        load: int64 ``(L, P)``: upstream's ``expert_load_pass`` after the forward (this rank's record).
        physical_ids: per MoE layer, int64 ``(T, K)``: the ids the expert kernel consumed.
        recorded: whether this forward recorded load (the device record flag).
        draft: the draft's forwards of the step (:class:`DraftStep`), None without a draft.
    """

    logits_on: torch.Tensor
    logits_off: torch.Tensor | None
    load: torch.Tensor
    physical_ids: list[torch.Tensor]
    recorded: bool
    draft: DraftStep | None = None


@dataclass
class DraftStep:
    """What the draft's forwards of one :meth:`ServingWorker.forward_step` saw (N = the speculative tokens).

    Attributes:
        logits_on: per draft forward, float32 ``(T, vocab_size)`` of the EPLB-on draft.
        logits_off: per draft forward, the EPLB-off draft's (fed the EPLB-off target's hidden states), or
            None without an EPLB-off model.
        load: int64 ``(L_draft, P)``: upstream's ``expert_load_pass`` of the draft after its N forwards.
        physical_ids: per draft forward, per draft MoE layer, int64 ``(T, K)``: the ids its expert kernel
            consumed.
    """

    logits_on: list[torch.Tensor]
    logits_off: list[torch.Tensor] | None
    load: torch.Tensor
    physical_ids: list[list[torch.Tensor]]


class ServingWorker:
    """One Model Runner V2 worker on a real vLLM model with EPLB on, built and driven as serving does,
    beside the EPLB-off model of the same checkpoint (the oracle).

    Built in a serving worker's order: ``ASCEND_EPLB=1``, ``VLLM_USE_V2_MODEL_RUNNER=1`` (else vLLM picks V1
    without Triton), vLLM's plugins (they apply the patches), :func:`prepare_world`, the runner's controller
    from ``Mrv2EplbWiring`` (start-up validation refuses a rejected format before anything loads; set
    ``ASCEND_EPLB_VERIFY`` / ``ASCEND_EPLB_EVENTS`` before), :func:`load_model`, its registration, then the
    EPLB-off model. Per step: :meth:`forward_step` (runner points 7-8) and :meth:`end_step` (point 9,
    upstream's step, where hooks and the verifier may raise). Args: ``num_redundant_experts`` R (``E + R``
    divides by the ranks); ``window_size``, ``step_interval``, ``phase``: ``EPLBConfig``'s (``use_async``
    on); ``initial_placement``: ``eplb_config.initial_placement`` or None (upstream's); ``ascend_keys``: more
    ``additional_config.eplb_config`` keys, judged by start-up validation; ``data_parallel_size`` D, every DP
    rank stepping on its own batch; ``dispatch``: :func:`prepare_world`'s (``all-to-all`` names the rows
    ``split``, as vLLM Ascend's MC2); ``compilation``: :func:`compilation_of`, None eager (compiled,
    :meth:`profile_run` is each model's one trace); ``speculative_tokens`` N >= 1: the MTP draft
    (:func:`load_draft`), registered by upstream as ``"<model> (draft)"``, run N times after the target.
    Attributes: ``experts`` / ``expert_storage`` (the truth slots are checked against), ``model``, ``state``,
    ``speculator`` and ``draft_*`` (None without a draft), ``observer`` / ``traced`` (``eager`` backend).
    """

    def __init__(
        self,
        ctx: Any,
        folder: str | os.PathLike[str],
        *,
        num_redundant_experts: int,
        window_size: int,
        step_interval: int,
        phase: str = "all",
        eplb_off: bool = True,
        initial_placement: str | None = None,
        data_parallel_size: int = 1,
        ascend_keys: dict[str, Any] | None = None,
        dispatch: str = "gather",
        compilation: dict[str, Any] | None = None,
        speculative_tokens: int = 0,
    ) -> None:
        self.layout = parallel_layout(ctx.world_size, data_parallel_size)
        self.compiled = is_compiled(compilation)
        self.speculative_tokens = speculative_tokens
        if speculative_tokens and self.compiled:
            raise ValueError(
                f"speculative_tokens={speculative_tokens} with compilation {compilation}: the MTP draft is "
                "served eager in this world (a compiled draft is not run here)"
            )
        self.moe_rows = "split" if dispatch == "all-to-all" else None
        self.dp_rank, self.tp_rank = self.layout.dp_rank(ctx.rank), self.layout.tp_rank(ctx.rank)
        os.environ["ASCEND_EPLB"] = "1"
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        import vllm.plugins

        vllm.plugins.load_general_plugins()
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import get_ep_group

        self.folder = Path(folder)
        self.info = checkpoint_info(self.folder)
        self.format = checkpoint_format(self.folder)
        if speculative_tokens and (self.format is not None or not self.info.num_mtp_layers):
            raise ValueError(
                f"speculative_tokens={speculative_tokens}: the MTP draft needs a float32 DeepSeek-V3 "
                f"checkpoint with its MTP layer; {self.folder} is {self.format or 'float32'} with "
                f"{self.info.num_mtp_layers} MTP layer(s)"
            )
        self.draft_layers_changed: list[int] = []
        eplb = {
            "num_redundant_experts": num_redundant_experts,
            "window_size": window_size,
            "step_interval": step_interval,
            "use_async": True,
        }
        self.seconds: dict[str, float] = {}
        t0 = time.monotonic()
        # As a serving worker: the runner (its controller: start-up validation) before the model loads.
        self.vllm_config = prepare_world(
            ctx, self.folder, enable_eplb=True, eplb=eplb, data_parallel_size=data_parallel_size,
            dispatch=dispatch, compilation=compilation, speculative_tokens=speculative_tokens,
        )  # fmt: skip
        ascend = {"load_collection_phase": phase, **(ascend_keys or {})}
        if initial_placement is not None:
            ascend["initial_placement"] = initial_placement
        self.vllm_config.additional_config = {
            **(self.vllm_config.additional_config or {}),
            "eplb_config": ascend,
        }
        self.ep_rank = get_ep_group().rank_in_group
        self.model_config = self.vllm_config.model_config
        # Compiled with the eager backend: the one trace of the EPLB-on model is recorded (graph inputs).
        self.observer = (
            observe_compilation(self.vllm_config)
            if self.compiled and self.vllm_config.compilation_config.backend == "eager"
            else None
        )
        self.traced: TracedGraph | None = None
        with set_current_vllm_config(self.vllm_config):
            self.wiring = Mrv2EplbWiring(self.vllm_config, torch.device("cpu"))
        self.model = load_model(self.vllm_config)
        self.method = type(routed_experts(self.model)[0].quant_method)
        # the truth each slot is checked against: float weights, or the format's kernel storage
        self.experts = checkpoint_experts(self.folder) if self.format is None else None
        self.expert_storage = (
            None if self.format is None else checkpoint_expert_storage(self.folder, self.format)
        )
        spec = self.vllm_config.speculative_config
        self.speculator = load_draft(self.vllm_config, self.model) if speculative_tokens else None
        with set_current_vllm_config(self.vllm_config):
            self.wiring.load_model(
                self.model, self.model_config, speculator=self.speculator, speculative_config=spec
            )
        self.state = self.wiring.controller.state
        self.model_state = self.state.model_states[self.model_config.compute_hash()]
        self.draft_model_state = self.draft_experts = None
        if self.speculator is not None:
            self.draft_model_state = self.state.model_states[spec.draft_model_config.compute_hash()]
            self.draft_experts = checkpoint_experts(self.folder, draft=True) if self.format is None else None
        self.seconds["build_on"] = time.monotonic() - t0
        # Under upstream's initial placement (what vLLM's loader filled), or under the placement the
        # start-up installed from initial_placement (the committed map).
        self.initial_slot_mismatches = self._mismatches(
            initial_physical_to_logical(self.info, num_redundant_experts)
            if initial_placement is None
            else self.model_state.physical_to_logical_map
        )
        self.draft_initial_slot_mismatches = None if self.speculator is None else self.draft_slot_mismatches()
        self.model_off = self.vllm_config_off = self.speculator_off = None
        if eplb_off:
            t1 = time.monotonic()
            self.model_off, self.vllm_config_off = build_model(
                ctx, self.folder, enable_eplb=False, data_parallel_size=data_parallel_size,
                dispatch=dispatch, compilation=compilation, speculative_tokens=speculative_tokens,
            )  # fmt: skip
            if speculative_tokens:
                self.speculator_off = load_draft(self.vllm_config_off, self.model_off)
            self.seconds["build_off"] = time.monotonic() - t1

    @property
    def num_physical_experts(self) -> int:
        """P."""
        return int(self.model_state.physical_to_logical_map.shape[1])

    def profile_run(self, input_ids: torch.Tensor) -> None:
        """Runner point 5: a dummy forward of ``input_ids`` (the target's, then the draft's), then upstream's
        profile step."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self._dummy_forward(input_ids)
            self.wiring.profile_run()
        if self.observer is not None and self.traced is None:
            if len(self.observer.graphs) != 1:
                raise RuntimeError(
                    f"the EPLB-on model's first forward compiled {len(self.observer.graphs)} graphs, not one"
                )
            self.traced = self.observer.graphs[0]

    def moved_graph_inputs(self) -> list[str]:
        """The tensors the EPLB-on model's traced graph reads from the model (its state inputs) whose
        storage at their source is not the traced one (dataplane's ``TracedGraph.moved``); [] when every
        one holds.

        Raises:
            RuntimeError: the model is not observed (eager, or compiled with another backend than
                ``eager``), or :meth:`profile_run` has not traced it yet.
        """
        if self.traced is None:
            raise RuntimeError("no traced graph: a world compiled with the eager backend, after profile_run")
        module = compiled_module(self.model)
        return self.traced.moved({"self": module}, type(module).forward.__globals__)

    def dummy_run(self, input_ids: torch.Tensor) -> None:
        """Runner point 6, a warm-up or idle-rank ``_dummy_run``: the dummy forward of ``input_ids`` (the
        target's, then, as upstream's ``_dummy_run`` proposes with ``dummy_run=True``, the draft's), then a
        dummy step (upstream zeroes every registered model's load pass: no load reaches a window)."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self._dummy_forward(input_ids)
            self.wiring.dummy_run()

    def _dummy_forward(self, input_ids: torch.Tensor) -> None:
        num_tokens = int(input_ids.shape[0])
        positions = torch.arange(num_tokens)
        self.wiring.prepare_forward(self.model_config, num_tokens, moe_rows=self.moe_rows)
        hidden, _ = _forward(self.model, self.vllm_config, input_ids, positions)
        for _ in range(self.speculative_tokens):
            self.speculator._prepare_eplb_forward(num_tokens)
            hidden, _ = forward_draft(self.speculator.model, self.vllm_config, input_ids, positions, hidden)

    def wait_for_transfer(self, deadline_s: float) -> None:
        """While a rearrangement is in flight, wait until the async worker published its next layer (of
        whichever registered model it moves: upstream's worker moves them one after the other, in
        registration order).

        Raises:
            AssertionError: the worker died, or published nothing within ``deadline_s`` seconds.
        """
        in_cycle = [ms for ms in self.state.model_states.values() if ms.rebalanced]
        if not in_cycle:
            return
        deadline = time.monotonic() + deadline_s
        while all(ms.pending_result is None for ms in in_cycle):
            if not self.state.async_worker.is_alive():
                raise AssertionError("the async EPLB worker died")
            if time.monotonic() > deadline:
                raise AssertionError(f"no layer transferred within {deadline_s} s")
            time.sleep(0.001)

    def forward_step(
        self,
        input_ids: torch.Tensor,
        *,
        num_unpadded_tokens: int,
        batch_has_prefill: bool,
        draft_input_ids: Any = (),
    ) -> WorkerStep:
        """Runner points 7-8 and the forward: the batch phase, ``prepare_forward`` with the unpadded count,
        the EPLB-on forward (the kernel's physical ids captured), the EPLB-off forward; with a draft, its N
        forwards after the target as Model Runner V2's MTP speculator runs them (upstream's
        ``_prepare_eplb_forward``, then the draft on the previous hidden states), EPLB on and off.

        Args:
            input_ids: int64 ``(T,)``, one sequence; rows ``>= num_unpadded_tokens`` are padding (causal
                attention: they change no real row). batch_has_prefill: the phase the runner declares.
            draft_input_ids: N int64 ``(T,)``, draft forward ``k``'s ids (row ``t``: the token after row ``t``
                of its input hidden states), or empty: no draft forward this step (speculation off).

        Raises:
            ValueError: ``draft_input_ids`` holds neither one sequence per speculative token nor none.
        """
        from vllm.config import set_current_vllm_config

        if len(draft_input_ids) not in (0, self.speculative_tokens):
            raise ValueError(
                f"draft_input_ids holds {len(draft_input_ids)} sequences: must be one per speculative token "
                f"({self.speculative_tokens}), or none"
            )
        positions = torch.arange(input_ids.shape[0])
        with set_current_vllm_config(self.vllm_config):
            self.wiring.prepare_inputs(batch_has_prefill)
            self.wiring.prepare_forward(self.model_config, num_unpadded_tokens, moe_rows=self.moe_rows)
            recorded = bool(self.state.should_record_tensor)
            logs = [kernel_log(layer) for layer in routed_experts(self.model)]
            before = [int(log.calls) for log in logs]
            hidden, logits_on = _forward(self.model, self.vllm_config, input_ids, positions)
            physical_ids = _called_once(logs, before, "the EPLB-on forward")
            load = self.model_state.expert_load_pass.clone().long()
            draft = None
            if self.speculator is not None and draft_input_ids:
                draft_logs = [kernel_log(layer) for layer in routed_experts(self.speculator.model)]
                draft_logits, draft_ids = [], []
                for k, ids in enumerate(draft_input_ids):
                    before = [int(log.calls) for log in draft_logs]
                    self.speculator._prepare_eplb_forward(num_unpadded_tokens)
                    hidden, logits = forward_draft(
                        self.speculator.model, self.vllm_config, ids, positions, hidden
                    )
                    draft_logits.append(logits)
                    draft_ids.append(_called_once(draft_logs, before, f"the EPLB-on draft's forward {k}"))
                draft_load = self.draft_model_state.expert_load_pass.clone().long()
                draft = DraftStep(draft_logits, None, draft_load, draft_ids)
        logits_off = None
        if self.model_off is not None:
            hidden_off, logits_off = _forward(self.model_off, self.vllm_config_off, input_ids, positions)
            if draft is not None:
                draft.logits_off = []
                for ids in draft_input_ids:
                    hidden_off, logits = forward_draft(
                        self.speculator_off.model, self.vllm_config_off, ids, positions, hidden_off
                    )
                    draft.logits_off.append(logits)
        return WorkerStep(logits_on, logits_off, load, physical_ids, recorded, draft)

    def end_step(self) -> list[int]:
        """Runner point 9 (upstream's step, then the controller's hooks: watchdog, verifier, events).

        Returns:
            the target's MoE layers whose committed placement changed in this step (the draft's:
            :attr:`draft_layers_changed`).

        Raises:
            whatever the hooks raise (``EplbVerificationError``, ``EplbWorkerFailureError``).
        """
        from vllm.config import set_current_vllm_config

        before = self.model_state.physical_to_logical_map.clone()
        draft = self.draft_model_state
        draft_before = None if draft is None else draft.physical_to_logical_map.clone()
        with set_current_vllm_config(self.vllm_config):
            self.wiring.after_sampling()
        if draft is not None:
            self.draft_layers_changed = _changed(draft_before, draft.physical_to_logical_map)
        return _changed(before, self.model_state.physical_to_logical_map)

    def describe_experts(self) -> dict[str, Any]:
        """What serves the routed experts: ``methods`` (class name per MoE layer), ``formats``
        (quant_views format per layer, None for float32), ``kernel_names`` (layer 0's kernel tensors,
        [] for float32) and ``view_names`` (per layer, the weight views' attribute names)."""
        layers = routed_experts(self.model)
        formats = [getattr(layer.quant_method, "format_name", None) for layer in layers]
        return {
            "methods": [type(layer.quant_method).__name__ for layer in layers],
            "formats": formats,
            "kernel_names": list(layer_storage(layers[0], formats[0]).kernel_tensors) if formats[0] else [],
            "view_names": [
                layer_view_names(layer, f) if f else ["w13_weight", "w2_weight"]
                for layer, f in zip(layers, formats, strict=True)
            ],
        }

    def slot_mismatches(self) -> list[str]:
        """Local slots not holding their logical expert under the committed placement: the float weights
        (:func:`local_slot_mismatches`), or for a quant_views format the fingerprint over every kernel
        tensor (``quant_method.slot_fingerprint_mismatches``)."""
        return self._mismatches(self.model_state.physical_to_logical_map)

    def draft_slot_mismatches(self) -> list[str]:
        """The draft's local slots not holding their logical expert (its MTP layer's float weights) under
        its committed placement (:func:`local_slot_mismatches`).

        Raises:
            RuntimeError: the worker has no draft.
        """
        if self.speculator is None:
            raise RuntimeError("this ServingWorker serves no draft (speculative_tokens=0)")
        return local_slot_mismatches(
            self.speculator.model,
            self.draft_experts,
            self.draft_model_state.physical_to_logical_map,
            self.ep_rank,
        )

    def _mismatches(self, physical_to_logical: torch.Tensor) -> list[str]:
        if self.format is None:
            return local_slot_mismatches(self.model, self.experts, physical_to_logical, self.ep_rank)
        return slot_fingerprint_mismatches(
            self.model, self.expert_storage, physical_to_logical, self.ep_rank, self.format
        )


def _called_once(logs: list[Any], before: list[int], what: str) -> list[torch.Tensor]:
    """The physical ids each MoE layer's experts consumed in one forward (its ``KernelLog``'s last call),
    after checking that the forward called each layer's experts exactly once (``before``: their call
    counts before it)."""
    calls = [int(log.calls) - n for log, n in zip(logs, before, strict=True)]
    if calls != [1] * len(logs):
        raise RuntimeError(f"{what} called the MoE layers' experts {calls} times, not once each")
    return [log.last_ids() for log in logs]


def _changed(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    """The rows (MoE layers) of two ``(L, P)`` placements that differ."""
    return [layer for layer in range(before.shape[0]) if not torch.equal(before[layer], after[layer])]


# --- the serving-path world ------------------------------------------------------------------------


@dataclass(frozen=True)
class RealModelSpec:
    """Parameters of :func:`real_model_world` (picklable; every rank gets the same).

    ``arch`` an :data:`ARCHITECTURES` key; ``folder`` the checkpoint, written before the world starts;
    ``num_redundant_experts`` R (``E + R`` divides by the ranks); ``steps`` EPLB-on engine steps, each one
    forward of one prompt of ``num_tokens`` T (seeded by ``seed``); ``phase`` ``load_collection_phase``
    (even steps are declared prefill batches, odd steps decode); ``window_size``, ``step_interval``
    upstream's ``EPLBConfig`` fields; ``run_eplb_off`` also run the EPLB-off model on the same prompts;
    ``worker_deadline_s`` how long a step waits for the async worker's layer; ``environ`` set in each rank
    before anything is built (e.g. ``VLLM_ASCEND_ENABLE_NZ``, ``quant_method.FORMAT_SWITCHES``);
    ``data_parallel_size`` D (each DP rank its own prompts, DP rank 0's those of D = 1; its TP ranks the
    same); ``real_tokens`` per DP rank the unpadded rows (Model Runner V2 pads every DP rank to one T;
    empty: all real); ``dispatch`` ``gather`` or ``all-to-all`` (``split`` rows, TP = 1); ``ascend_keys``
    more ``additional_config.eplb_config`` keys (``policy``, the gate's, ``load_estimate``);
    ``compilation`` both models' (:func:`compilation_of`, None eager); ``speculative_tokens`` N >= 1 the MTP
    draft, N forwards per step, each prompt ``num_tokens + N`` ids (draft forward ``k`` takes ids
    ``k + 1 .. k + num_tokens``); ``draft_idle_steps`` steps without the draft (a window with the target's
    load only); ``dummy_steps`` steps before which every rank runs a warm-up dummy run (runner point 6).
    """

    arch: str
    folder: str
    num_redundant_experts: int = 2
    steps: int = 40
    phase: str = "all"
    window_size: int = 2
    step_interval: int = 6
    num_tokens: int = 12
    seed: int = 0
    run_eplb_off: bool = True
    worker_deadline_s: float = 20.0
    environ: dict[str, str] = field(default_factory=dict)
    data_parallel_size: int = 1
    real_tokens: tuple[int, ...] = ()
    dispatch: str = "gather"
    ascend_keys: dict[str, Any] = field(default_factory=dict)
    compilation: dict[str, Any] | None = None
    speculative_tokens: int = 0
    draft_idle_steps: tuple[int, ...] = ()
    dummy_steps: tuple[int, ...] = ()

    def num_real_tokens(self, dp_rank: int) -> int:
        """The real rows of DP rank ``dp_rank``'s prompts.

        Raises:
            ValueError: ``real_tokens`` does not hold one count in ``[0, num_tokens]`` per DP rank.
        """
        if not self.real_tokens:
            return self.num_tokens
        if len(self.real_tokens) != self.data_parallel_size or not all(
            0 <= n <= self.num_tokens for n in self.real_tokens
        ):
            raise ValueError(
                f"real_tokens={self.real_tokens} must hold {self.data_parallel_size} counts in "
                f"[0, {self.num_tokens}], one per DP rank"
            )
        return self.real_tokens[dp_rank]

    def prompt_seed(self, step: int, dp_rank: int) -> int:
        """The seed of DP rank ``dp_rank``'s prompt at ``step`` (D = 1: ``seed * 1000 + step``)."""
        return (self.seed * 1000 + step) * self.data_parallel_size + dp_rank


def real_model_world(ctx: Any, spec: RealModelSpec) -> dict[str, Any]:
    """One :class:`ServingWorker` per rank (verifier on) for ``spec.steps`` steps beside the EPLB-off logits,
    in the world's DP x TP layout. Before a step a pending layer transfer is awaited
    (:meth:`ServingWorker.wait_for_transfer`, ``worker_deadline_s``), so commits come at the same steps in
    every run; after each step with commits every local slot is checked against the checkpoint's expert
    under upstream's committed ``physical_to_logical_map``.

    Returns (every rank) a dict: ``rank``, ``dp_rank``, ``tp_rank``, ``moe_rows`` (``RowLayout.rows``),
    ``num_real_tokens``, ``info`` (E, K, L, P); per step: ``prompts`` int64 ``(T,)``, ``logits_on`` /
    ``logits_off`` float32 ``(T, V)`` (off absent without ``run_eplb_off``), ``load`` int64 ``(L, P)``
    (upstream's ``expert_load_pass``, this rank's), ``recorded``, ``kernel_rows`` (rows the first MoE
    layer's method received), ``maps`` int64 ``(L, P)`` committed; ``commits`` ``[(step, layer)]`` (a changed
    map row or a moved layer); ``slot_checks`` ``[(step, mismatches)]`` (:func:`local_slot_mismatches`) and
    ``initial_slot_mismatches`` (after loading); ``num_rearrangements``; ``worker_alive``; ``seconds``
    (``build_on``, ``build_off``, ``steps``); ``moe_calls`` (EPLB-on applies); ``methods`` and ``formats``
    per MoE layer (format None: float32); ``kernel_names`` (layer 0's kernel tensors, [] for float32);
    ``view_names`` per layer; ``decisions`` (every ``DecisionEvent``), ``estimates`` (each model's load
    estimate, when on); compiled: ``compiled`` (TorchDynamo's counters, the observed graph, moved inputs);
    with a draft: ``draft`` (the draft's per-step records and its registration).
    """
    os.environ["ASCEND_EPLB_VERIFY"] = "1"  # the serving verifier checks every commit and step
    os.environ.update(spec.environ)

    worker = ServingWorker(
        ctx,
        spec.folder,
        num_redundant_experts=spec.num_redundant_experts,
        window_size=spec.window_size,
        step_interval=spec.step_interval,
        phase=spec.phase,
        eplb_off=spec.run_eplb_off,
        data_parallel_size=spec.data_parallel_size,
        dispatch=spec.dispatch,
        ascend_keys=spec.ascend_keys or None,
        compilation=spec.compilation,
        speculative_tokens=spec.speculative_tokens,
    )
    decisions: list[tuple[Any, ...]] = []
    worker.wiring.controller.bus.subscribe(
        DecisionEvent, lambda e: decisions.append((e.model_name, e.rearrangement, asdict(e.decision)))
    )
    info = worker.info
    real = spec.num_real_tokens(worker.dp_rank)
    report: dict[str, Any] = {
        "rank": ctx.rank,
        "dp_rank": worker.dp_rank,
        "tp_rank": worker.tp_rank,
        "num_real_tokens": real,
        "initial_slot_mismatches": worker.initial_slot_mismatches,
        "info": {
            "num_logical_experts": info.num_logical_experts,
            "top_k": info.top_k,
            "num_moe_layers": info.num_moe_layers,
            "num_physical_experts": worker.num_physical_experts,
        },
    }
    n = spec.speculative_tokens
    prompts = [
        prompt(spec.prompt_seed(s, worker.dp_rank), spec.num_tokens + n, info.vocab_size)
        for s in range(spec.steps)
    ]
    worker.profile_run(prompts[0][: spec.num_tokens])
    logits_on, logits_off, loads, recorded, maps, commits, slot_checks = [], [], [], [], [], [], []
    kernel_rows: list[int] = []
    moved: list[tuple[int, list[str]]] = []
    counters_first: dict[str, Any] | None = None
    draft: dict[str, list[Any]] = {
        k: [] for k in ("logits_on", "logits_off", "load", "maps", "commits", "slot_checks", "ran", "dummy")
    }
    t1 = time.monotonic()
    for step in range(spec.steps):
        worker.wait_for_transfer(spec.worker_deadline_s)
        if step in spec.dummy_steps:
            draft["dummy"].append((step, _dummy_run_record(worker, prompts[step][: spec.num_tokens])))
        # Even steps are declared prefill batches, odd steps decode batches (computed = prompt tokens),
        # so a "prefill" or "decode" phase records every other step.
        computed = 0 if step % 2 == 0 else spec.num_tokens
        # speculation off for the batch at an idle step: the draft does not run
        runs_draft = n > 0 and step not in spec.draft_idle_steps
        seen = worker.forward_step(
            prompts[step][: spec.num_tokens],
            num_unpadded_tokens=real,
            batch_has_prefill=batch_has_prefill([computed], [spec.num_tokens]),
            draft_input_ids=[prompts[step][k + 1 : k + 1 + spec.num_tokens] for k in range(n)]
            if runs_draft
            else (),
        )
        logits_on.append(seen.logits_on)
        logits_off.append(seen.logits_off)
        loads.append(seen.load)
        recorded.append(seen.recorded)
        kernel_rows.append(int(seen.physical_ids[0].shape[0]))
        if n:
            draft["ran"].append(runs_draft)
            draft["logits_on"].append(seen.draft.logits_on if runs_draft else [])
            draft["logits_off"].append(seen.draft.logits_off if runs_draft else [])
            draft["load"].append(
                seen.draft.load if runs_draft else worker.draft_model_state.expert_load_pass.clone().long()
            )
        changed = worker.end_step()
        maps.append(worker.model_state.physical_to_logical_map.clone().long())
        if changed:
            commits.extend((step, layer) for layer in changed)
            slot_checks.append((step, worker.slot_mismatches()))
        if worker.traced is not None and (step_moved := worker.moved_graph_inputs()):
            moved.append((step, step_moved))
        if step == 0 and worker.compiled:
            counters_first = dynamo_counters()  # both models traced (their first forwards)
        if n:
            draft["maps"].append(worker.draft_model_state.physical_to_logical_map.clone().long())
            if worker.draft_layers_changed:
                draft["commits"].extend((step, layer) for layer in worker.draft_layers_changed)
                draft["slot_checks"].append((step, worker.draft_slot_mismatches()))
    report["seconds"] = {**worker.seconds, "steps": time.monotonic() - t1}
    if worker.compiled:
        report["compiled"] = {
            "counters_after_first_step": counters_first,
            "counters_end": dynamo_counters(),
            "graph_state_inputs": None if worker.traced is None else [i.source for i in worker.traced.state],
            "graph_ops": None if worker.traced is None else dict(worker.traced.ops),
            "moved": moved,
        }
    report.update(worker.describe_experts())
    layout = worker.wiring.controller.last_row_layout
    report["moe_rows"] = None if layout is None else layout.rows
    report["num_rearrangements"] = worker.state.num_rearrangements
    report["decisions"] = decisions
    report["estimates"] = {
        channel.model_name: (channel.estimate.windows, channel.estimate.load.tolist())
        for channel in worker.state.channels
        if channel.estimate is not None
    }
    report["worker_alive"] = worker.state.async_worker is not None and worker.state.async_worker.is_alive()
    report.update(
        prompts=prompts,
        logits_on=logits_on,
        load=loads,
        recorded=recorded,
        kernel_rows=kernel_rows,
        maps=maps,
        commits=commits,
        slot_checks=slot_checks,
        moe_calls=sum(int(kernel_log(layer).calls) for layer in routed_experts(worker.model)),
    )
    if spec.run_eplb_off:
        report["logits_off"] = logits_off
    if n:
        report["draft"] = {
            **draft,
            "model_name": worker.draft_model_state.model_name,
            "model_names": [ms.model_name for ms in worker.state.model_states.values()],
            "initial_slot_mismatches": worker.draft_initial_slot_mismatches,
            "num_moe_layers": int(worker.draft_model_state.physical_to_logical_map.shape[0]),
            "skipped_rearrangements": dict(worker.state.skipped_rearrangements),
        }
    return report


def _dummy_run_record(worker: ServingWorker, input_ids: torch.Tensor) -> dict[str, Any]:
    """A warm-up dummy run of ``worker`` (:meth:`ServingWorker.dummy_run`) and, per registered model (by
    upstream's name), whether its load window is unchanged by it and its load pass zero after it."""
    before = {ms.model_name: ms.expert_load_window.clone() for ms in worker.state.model_states.values()}
    worker.dummy_run(input_ids)
    return {
        ms.model_name: (
            torch.equal(before[ms.model_name], ms.expert_load_window),
            int(ms.expert_load_pass.abs().sum()) == 0,
        )
        for ms in worker.state.model_states.values()
    }
