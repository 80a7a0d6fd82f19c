"""The tiny checkpoints of vLLM's real MoE architectures: writing them, fitting their routing, reading them.

* :func:`write_checkpoint` writes a tiny random checkpoint (``config.json`` + safetensors, float32) of
  ``"qwen3-moe"`` (``Qwen3MoeForCausalLM``), ``"deepseek-v3"`` (``DeepseekV3ForCausalLM``: grouped
  top-k, sigmoid scoring with a nonzero ``e_score_correction_bias``, a shared expert, a dense first
  layer, MLA) or ``"mixtral"`` (``MixtralForCausalLM``) with transformers' own config and model classes;
  never a hub. ``"qwen2-moe"`` (``Qwen2MoeForCausalLM``, whose vLLM 0.33.0 class has no
  ``MixtureOfExperts`` part) is the model EPLB start-up refuses. :func:`to_format` converts a
  checkpoint to a 16-bit dtype or, with :func:`write_quantized_experts`, to msModelSlim's layout of a
  quantized format (what vLLM Ascend serves with ``--quantization ascend``).
* :func:`fit_routing_bias` fits a DeepSeek-V3 checkpoint's routing bias to a recorded popularity.
* :func:`checkpoint_info`, :func:`checkpoint_tensors`, :func:`checkpoint_experts` and
  :func:`checkpoint_format` read such a checkpoint back (sizes, tensors, routed experts, format).

Imports torch and the standard library (transformers and safetensors inside the functions that write or
read weights; ``ascend_eplb.quant_views`` and ``ascend_eplb.integration.validation`` for the formats); no
vLLM. Shape letters (DESIGN.md section 2): E logical experts, H hidden size, I MoE intermediate size, L
MoE layers, K top-k; V is the vocabulary size.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ARCHITECTURES",
    "DESCRIPTION_FILE",
    "EXPERT_KEYS",
    "VOCAB_SIZE",
    "CheckpointInfo",
    "checkpoint_experts",
    "checkpoint_format",
    "checkpoint_info",
    "checkpoint_tensors",
    "fit_routing_bias",
    "format_of_quant_type",
    "msmodelslim_quant_type",
    "to_format",
    "write_checkpoint",
    "write_quantized_experts",
]

#: The architectures :func:`write_checkpoint` writes, with their HF
#: ``architectures`` entry. vLLM 0.33.0's ``Qwen2MoeForCausalLM`` implements no ``MixtureOfExperts``
#: part, so EPLB cannot balance it: its checkpoint is the one start-up must refuse (rule
#: ``moe-model-class``).
ARCHITECTURES = {
    "qwen3-moe": "Qwen3MoeForCausalLM",
    "deepseek-v3": "DeepseekV3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2-moe": "Qwen2MoeForCausalLM",
}
_ARCH_BY_CLASS = {v: k for k, v in ARCHITECTURES.items()}
#: Checkpoint key templates of one routed expert's (gate, up, down) weights per architecture.
EXPERT_KEYS = {
    "qwen3-moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "qwen2-moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "deepseek-v3": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "mixtral": (
        "block_sparse_moe.experts.{e}.w1",
        "block_sparse_moe.experts.{e}.w3",
        "block_sparse_moe.experts.{e}.w2",
    ),
}


@dataclass(frozen=True)
class CheckpointInfo:
    """The sizes of a checkpoint :func:`write_checkpoint` wrote (read
    back from its ``config.json`` by start-up's reader, ``rules.read_moe_facts``).

    Attributes:
        arch: an :data:`ARCHITECTURES` key.
        folder: the checkpoint folder.
        num_logical_experts: E (routed experts per MoE layer).
        top_k: K.
        num_moe_layers: L, as vLLM's model class builds them (``MoeFacts.num_moe_layers``).
        vocab_size: V.
        hidden_size: H.
        moe: the config's MoE facts.
    """

    arch: str
    folder: Path
    num_logical_experts: int
    top_k: int
    num_moe_layers: int
    vocab_size: int
    hidden_size: int
    moe: Any

    @functools.cached_property
    def moe_layer_indices(self) -> range | tuple[int, ...]:
        """The decoder-layer index of each MoE layer, in order (L entries: ``MoeFacts.moe_layer_indices``)."""
        return self.moe.moe_layer_indices()

    def redundant_experts_for(self, num_ranks: int, at_least: int = 1) -> int:
        """The smallest ``R >= at_least`` with ``(E + R) % num_ranks == 0``."""
        r = at_least
        while (self.num_logical_experts + r) % num_ranks:
            r += 1
        return r


def checkpoint_info(folder: str | os.PathLike[str]) -> CheckpointInfo:
    """The sizes of the checkpoint in ``folder`` (its ``config.json``), its MoE facts read and judged as
    start-up reads and judges them.

    Raises:
        ValueError: the checkpoint's architecture is none of :data:`ARCHITECTURES`, or its MoE facts break
            start-up's rules or leave its MoE layers uncounted (every problem named).
    """
    from ascend_eplb.integration.rules import architectures_error, read_moe_facts

    folder = Path(folder)
    file = folder / "config.json"
    config = json.loads(file.read_text())
    if (named := architectures_error(config.get("architectures") or [])) is not None:
        raise ValueError(f"{file}: {named}")
    cls = config["architectures"][0]
    if cls not in _ARCH_BY_CLASS:
        raise ValueError(f"{folder}: architecture {cls} is none of {sorted(ARCHITECTURES.values())}")
    moe = read_moe_facts(config, str(file))
    problems = moe.errors() + [f"{file} states no {fact}" for fact in moe.unstated()]
    if not problems and moe.num_moe_layers is None:
        problems.append(moe.layers_not_counted() or f"{file}: no MoE layer")
    if problems:
        raise ValueError("; ".join(problems))
    return CheckpointInfo(
        arch=_ARCH_BY_CLASS[cls],
        folder=folder,
        num_logical_experts=moe.num_logical_experts,
        top_k=moe.top_k,
        num_moe_layers=moe.num_moe_layers,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        moe=moe,
    )


def checkpoint_tensors(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files (in file-name order), by checkpoint key."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def checkpoint_experts(folder: str | os.PathLike[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every MoE layer's routed experts as the checkpoint holds them, in vLLM's layout.

    Returns:
        per MoE layer (L entries): ``(w13 (E, 2I, H), w2 (E, H, I))`` in the checkpoint's dtype, gate
        rows then up rows, as vLLM's ``w13_weight`` / ``w2_weight`` hold a logical expert.

    Raises:
        KeyError: the experts are quantized (their float weights are not in the checkpoint; see
            ``quant_method.checkpoint_expert_storage``).
    """
    info = checkpoint_info(folder)
    tensors = checkpoint_tensors(folder)
    gate_t, up_t, down_t = EXPERT_KEYS[info.arch]
    out = []
    for layer in info.moe_layer_indices:
        prefix = f"model.layers.{layer}."
        w13, w2 = [], []
        for e in range(info.num_logical_experts):
            gate = tensors[prefix + gate_t.format(e=e) + ".weight"]
            up = tensors[prefix + up_t.format(e=e) + ".weight"]
            w13.append(torch.cat([gate, up]))
            w2.append(tensors[prefix + down_t.format(e=e) + ".weight"])
        out.append((torch.stack(w13), torch.stack(w2)))
    return out


# --- writing ---------------------------------------------------------------------------------------

VOCAB_SIZE = 128  # the tiny checkpoints' vocabulary (V)
_HIDDEN = 64
# Measured: with every weight of std 0.1 the second MoE layer routes nearly every token to the same
# experts (the first layer's output dominates the residual stream). HF's 0.02, token embeddings of std 1
# (they dominate the residual) and router gates of std 0.5 give diverse routing in every layer, and an
# LM head of std 0.3 gives logits of scale ~5.
_INIT_STD = 0.02
_EMBED_STD = 1.0
_ROUTER_STD = 0.5
_HEAD_STD = 0.3


def _hf_config(
    arch: str,
    num_experts: int | None,
    top_k: int | None,
    num_moe_layers: int | None,
    moe_intermediate_size: int | None = None,
) -> Any:
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": _HIDDEN,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "initializer_range": _INIT_STD,
        "num_attention_heads": 4,
    }
    if arch == "qwen3-moe":
        return Qwen3MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=moe_intermediate_size or 32,
            num_hidden_layers=num_moe_layers or 2,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=num_experts or 8,
            num_experts_per_tok=top_k or 2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    if arch == "qwen2-moe":
        return Qwen2MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=moe_intermediate_size or 32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=num_moe_layers or 2,
            num_key_value_heads=2,
            num_experts=num_experts or 8,
            num_experts_per_tok=top_k or 2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    if arch == "mixtral":
        return MixtralConfig(
            **common,
            intermediate_size=moe_intermediate_size or 32,
            num_hidden_layers=num_moe_layers or 2,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=num_experts or 8,
            num_experts_per_tok=top_k or 2,
        )
    if arch == "deepseek-v3":
        return DeepseekV3Config(
            **common,
            intermediate_size=128,
            moe_intermediate_size=moe_intermediate_size or 32,
            num_hidden_layers=1 + (num_moe_layers or 2),
            num_key_value_heads=4,
            n_shared_experts=1,
            n_routed_experts=num_experts or 16,
            num_experts_per_tok=top_k or 4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            topk_method="noaux_tc",  # else vLLM creates no e_score_correction_bias
            scoring_func="sigmoid",
            norm_topk_prob=True,
        )
    raise ValueError(f"unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}")


def write_checkpoint(
    arch: str,
    folder: str | os.PathLike[str],
    *,
    seed: int = 0,
    num_experts: int | None = None,
    top_k: int | None = None,
    num_moe_layers: int | None = None,
    fmt: str | None = None,
    moe_intermediate_size: int | None = None,
) -> Path:
    """Write a tiny random checkpoint of ``arch`` into ``folder`` and return the folder.

    Hidden size 64, vocabulary 128, 4 attention heads; ``qwen3-moe``, ``qwen2-moe`` (with a shared
    expert) and ``mixtral``: 2 layers, both MoE, E=8, K=2; ``deepseek-v3``: 3 layers (the first dense),
    E=16 in 4 groups (2 chosen), K=4, one shared expert, MLA (q LoRA 48, kv LoRA 32). Weights are drawn
    from ``seed`` with std 0.02, token embeddings std 1, router gates std 0.5, LM head std 0.3 (routing
    is not degenerate in any layer); DeepSeek's ``e_score_correction_bias`` is nonzero (std 0.05).
    Written with transformers' config class, ``AutoModelForCausalLM.from_config`` and
    ``save_pretrained`` (per-expert keys); about 0.1 s. Sizes: :func:`checkpoint_info`.

    Args:
        arch: an :data:`ARCHITECTURES` key.
        folder: created if missing; its files are overwritten.
        seed: torch seed of the weights.
        num_experts: E instead of the default (DeepSeek: a multiple of its 4 groups).
        top_k: K instead of the default.
        num_moe_layers: L instead of the default 2 (DeepSeek-V3 keeps its dense first layer).
        fmt: the experts' quant_views format (:func:`to_format`): None or ``"float32"``
            (float32 everywhere, a CPU-host-only dtype), ``"bf16"``/``"fp16"`` (the whole checkpoint in
            that dtype), or a quantized format: float32 non-expert weights and the routed experts in
            msModelSlim's layout with its ``quant_model_description.json`` (served with
            ``--quantization ascend``).
        moe_intermediate_size: I instead of the default 32 (the MX formats need a multiple of 64).

    Raises:
        ValueError: unknown ``arch`` or ``fmt``.
    """
    from transformers import AutoModelForCausalLM

    config = _hf_config(arch, num_experts, top_k, num_moe_layers, moe_intermediate_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    param.normal_(0.0, 0.05)
                elif name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
                    param.normal_(0.0, _ROUTER_STD)
                elif name == "model.embed_tokens.weight":
                    param.normal_(0.0, _EMBED_STD)
                elif name == "lm_head.weight":
                    param.normal_(0.0, _HEAD_STD)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.05)
        model.save_pretrained(folder)
    finally:
        torch.random.set_rng_state(generator_state)
    return to_format(folder, fmt)


def fit_routing_bias(
    folder: str | os.PathLike[str],
    popularity: Any,
    *,
    iterations: int = 60,
    step: float = 0.02,
    seed: int = 0,
) -> torch.Tensor:
    """Fit a DeepSeek-V3 checkpoint's ``e_score_correction_bias`` so its routing follows ``popularity``.

    The bias shifts expert selection only (upstream ``noaux_tc``: it is added to the scores for the
    top-k choice, not to the routing weights), so this skews which experts tokens pick without changing
    what an expert computes. Each iteration runs HF transformers on 16 random sequences of 64 tokens,
    counts each MoE layer's selections and moves the layer's bias by
    ``step * log(target share / observed share)``; the fitted bias is written back into the checkpoint.

    Args:
        folder: a ``"deepseek-v3"`` checkpoint of :func:`write_checkpoint`.
        popularity: ``(L, E)`` non-negative load per logical expert (e.g. a recorded trace's per-layer
            selections); each layer is normalised to shares.
        iterations: fitting iterations (60 fit the embedded ESFT trace's first 4 MoE layers to an L1
            distance of 0.14-0.17 between target and observed shares, measured on the 64-expert
            preset; balancedness without EPLB then within 0.01 of the trace's).
        step: the bias step per unit of log-share error.
        seed: seed of the fitting tokens.

    Returns:
        float64 ``(L, E)``: the selection shares the fitted checkpoint gave in the last iteration.

    Raises:
        ValueError: not a DeepSeek-V3 checkpoint, or ``popularity`` not ``(L, E)`` with positive rows.
    """
    from transformers import AutoModelForCausalLM

    info = checkpoint_info(folder)
    if info.arch != "deepseek-v3":
        raise ValueError(f"{folder}: only a deepseek-v3 checkpoint has a routing bias, got {info.arch}")
    target = torch.as_tensor(popularity, dtype=torch.float64)
    if target.shape != (info.num_moe_layers, info.num_logical_experts) or bool((target.sum(1) <= 0).any()):
        raise ValueError(
            f"popularity must be (L, E) = ({info.num_moe_layers}, {info.num_logical_experts}) with a "
            f"positive total per layer, got {tuple(target.shape)}"
        )
    target = target / target.sum(1, keepdim=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    gates = [model.model.layers[i].mlp.gate for i in info.moe_layer_indices]
    counts: list[torch.Tensor | None] = [None] * len(gates)

    def counter(layer: int) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            counts[layer] = torch.bincount(output[2].reshape(-1), minlength=info.num_logical_experts)

        return hook

    handles = [gate.register_forward_hook(counter(i)) for i, gate in enumerate(gates)]
    ids = torch.randint(0, info.vocab_size, (16, 64), generator=torch.Generator().manual_seed(seed))
    shares = target
    try:
        for _ in range(iterations):
            with torch.inference_mode():
                model(ids)
            observed = torch.stack([c.double() for c in counts])
            shares = observed / observed.sum(1, keepdim=True)
            with torch.no_grad():
                for layer, gate in enumerate(gates):
                    error = torch.log((target[layer] + 1e-4) / (shares[layer] + 1e-4))
                    gate.e_score_correction_bias += (step * error).float()
    finally:
        for handle in handles:
            handle.remove()
    model.save_pretrained(folder)
    return shares


# --- the msModelSlim layout of quantized experts (vLLM Ascend's ``--quantization ascend``) ---------

#: The msModelSlim description file of a quantized checkpoint.
DESCRIPTION_FILE = "quant_model_description.json"


def msmodelslim_quant_type(fmt: str) -> str:
    """The msModelSlim quant type of a quant_views format name (``w8a8_dynamic`` -> ``W8A8_DYNAMIC``).

    Raises:
        ValueError: no msModelSlim type maps to ``fmt``.
    """
    from ascend_eplb.integration.validation import ASCEND_QUANT_TYPES

    for quant_type, name in ASCEND_QUANT_TYPES.items():
        if name == fmt:
            return quant_type
    raise ValueError(
        f"no msModelSlim quant type for format {fmt!r}; known: {sorted(set(ASCEND_QUANT_TYPES.values()))}"
    )


def format_of_quant_type(quant_type: str) -> str:
    """The quant_views format name of an msModelSlim quant type (``W8A8_DYNAMIC`` -> ``w8a8_dynamic``).

    Raises:
        ValueError: ``quant_type`` is none of ``ASCEND_QUANT_TYPES``.
    """
    from ascend_eplb.integration.validation import ASCEND_QUANT_TYPES

    name = ASCEND_QUANT_TYPES.get(str(quant_type).upper())
    if name is None:
        raise ValueError(f"msModelSlim quant type {quant_type!r} is none of {sorted(ASCEND_QUANT_TYPES)}")
    return name


def write_quantized_experts(folder: str | os.PathLike[str], fmt: str) -> Path:
    """Rewrite the routed experts of a float checkpoint in ``folder`` in msModelSlim's layout of ``fmt``.

    Per MoE layer, the E experts' float weights are quantized together by quant_views'
    ``quantize_checkpoint`` (per expert, so an expert's tensors do not depend on the others) and
    written per expert under the checkpoint's own keys: ``w13_<suffix>`` rows ``[:I]`` as
    ``experts.<e>.gate_proj.<suffix>``, rows ``[I:]`` as ``up_proj``, ``w2_<suffix>`` as ``down_proj``
    (Mixtral: ``w1``/``w3``/``w2``). The description maps every tensor name to its quant type
    (``FLOAT`` for non-expert weights) plus ``model_quant_type``. A rejected format (``w4a16`` ...)
    writes only the description, over the float experts: start-up must refuse it before loading.

    Returns:
        the description file's path.

    Raises:
        ValueError: ``fmt`` has no msModelSlim type, or the checkpoint is not one of :func:`write_checkpoint`.
    """
    from safetensors.torch import save_file

    from ascend_eplb.quant_views import FORMAT_SUPPORT, get_format

    quant_type = msmodelslim_quant_type(fmt)
    folder = Path(folder)
    info = checkpoint_info(folder)
    files = sorted(folder.glob("*.safetensors"))
    tensors = checkpoint_tensors(folder)
    gate_t, up_t, down_t = EXPERT_KEYS[info.arch]
    expert_keys: set[str] = set()
    quantize = FORMAT_SUPPORT[fmt].supports_eplb
    for layer, (w13, w2) in zip(info.moe_layer_indices, checkpoint_experts(folder), strict=True):
        prefix = f"model.layers.{layer}."
        inter = w2.shape[2]
        ckpt = get_format(fmt).quantize_checkpoint(w13, w2) if quantize else None
        for e in range(info.num_logical_experts):
            gate, up, down = (prefix + t.format(e=e) for t in (gate_t, up_t, down_t))
            if ckpt is None:
                expert_keys.update(f"{k}.weight" for k in (gate, up, down))
                continue
            for k in (gate, up, down):
                del tensors[f"{k}.weight"]
            for name, t in ckpt.items():
                stem, suffix = name.split("_", 1)
                parts = {gate: t[e, :inter], up: t[e, inter:]} if stem == "w13" else {down: t[e]}
                for key, part in parts.items():
                    tensors[f"{key}.{suffix}"] = part.contiguous().clone()
                    expert_keys.add(f"{key}.{suffix}")
    if quantize:
        for file in files:
            file.unlink()
        (folder / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    description: dict[str, str] = {"model_quant_type": quant_type}
    description.update({k: (quant_type if k in expert_keys else "FLOAT") for k in sorted(tensors)})
    path = folder / DESCRIPTION_FILE
    path.write_text(json.dumps(description, indent=1) + "\n")
    return path


def to_format(folder: str | os.PathLike[str], fmt: str | None) -> Path:
    """Convert a float32 checkpoint of :func:`write_checkpoint` in ``folder`` to the experts' format
    ``fmt``, in place.

    ``None``/``"float32"``: nothing; ``"bf16"``/``"fp16"``: every floating tensor cast and ``config.json``'s
    dtype set (vLLM then serves it in that dtype); a quantized format: :func:`write_quantized_experts`.

    Returns:
        ``folder``.

    Raises:
        ValueError: ``fmt`` is none of these (as :func:`msmodelslim_quant_type`).
    """
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(fmt or "")
    if fmt in (None, "float32"):
        return folder
    if dtype is None:
        write_quantized_experts(folder, fmt)
        return folder
    for file in sorted(folder.glob("*.safetensors")):
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in load_file(str(file)).items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["dtype"] = {"bf16": "bfloat16", "fp16": "float16"}[fmt]
    config.pop("torch_dtype", None)
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return folder


def checkpoint_format(folder: str | os.PathLike[str]) -> str | None:
    """The routed experts' quant_views format of a checkpoint of :func:`write_checkpoint`: the description's
    (quantized), ``"bf16"``/``"fp16"`` by the checkpoint's dtype, or None (float32, CPU host only).

    Raises:
        ValueError: the description's experts mix quant types or name an unknown one.
    """
    folder = Path(folder)
    description = folder / DESCRIPTION_FILE
    if description.is_file():
        types = {
            str(v).upper() for k, v in json.loads(description.read_text()).items() if ".experts." in k
        } - {"FLOAT"}
        if len(types) != 1:
            raise ValueError(f"{description}: routed experts must have one quant type, got {sorted(types)}")
        return format_of_quant_type(types.pop())
    config = json.loads((folder / "config.json").read_text())
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype)
