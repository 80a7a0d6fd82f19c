"""The tiny checkpoints of vLLM's real MoE architectures: writing them and reading them back.

:func:`write_checkpoint` writes ``"qwen3-moe"``, ``"deepseek-v3"`` (grouped top-k, sigmoid scoring with a
nonzero correction bias, a shared expert, a dense first layer, MLA), ``"mixtral"`` or ``"qwen2-moe"``
(the model EPLB start-up refuses: no ``MixtureOfExperts`` part in vLLM 0.33.0) with transformers' own
classes, never a hub; :func:`to_format` converts one to a 16-bit dtype or msModelSlim's quantized layout
(:func:`write_quantized_experts`); a routing fitted to a recorded popularity is
:func:`ascend_eplb.world.routing_fit.fit_routing_bias`'s;
:func:`checkpoint_info`, :func:`checkpoint_tensors`, :func:`checkpoint_experts` and
:func:`checkpoint_format` read one back. transformers is imported inside functions (see
:mod:`~ascend_eplb.world`); no vLLM. Shapes: E logical experts, H hidden, I MoE intermediate, L MoE
layers, K top-k, V vocabulary.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ascend_eplb.integration.model_facts import architectures_error, read_moe_facts
from ascend_eplb.integration.rules import moe_fact_errors
from ascend_eplb.integration.validation import ASCEND_QUANT_TYPES
from ascend_eplb.quant_views import FORMAT_SUPPORT, get_format

__all__ = [
    "ARCHITECTURES",
    "DESCRIPTION_FILE",
    "EXPERT_KEYS",
    "FORMAT_SWITCHES",
    "MTP_LAYERS_KEY",
    "VOCAB_SIZE",
    "CheckpointInfo",
    "add_mtp_layer",
    "checkpoint_experts",
    "checkpoint_format",
    "checkpoint_info",
    "checkpoint_tensors",
    "format_of_quant_type",
    "format_switch",
    "msmodelslim_quant_type",
    "to_format",
    "write_checkpoint",
    "write_quantized_experts",
    "write_tokenizer",
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
#: The config key of DeepSeek-V3's multi-token prediction (MTP) layers, as vLLM's ``DeepSeekMTP`` and its
#: ``SpeculativeConfig`` read it.
MTP_LAYERS_KEY = "num_nextn_predict_layers"
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
    """The sizes of a checkpoint :func:`write_checkpoint` wrote, read back from its ``config.json`` by
    start-up's reader (``model_facts.read_moe_facts``): ``arch`` (an :data:`ARCHITECTURES` key), ``folder``,
    ``num_logical_experts`` E, ``top_k`` K, ``num_moe_layers`` L (as vLLM's model class builds them),
    ``vocab_size`` V, ``hidden_size`` H, ``moe`` (the config's MoE facts) and ``num_mtp_layers``
    (DeepSeek-V3's MTP layers, ``num_nextn_predict_layers``, each an MoE layer of vLLM's ``DeepSeekMTP`` at
    decoder index ``num_hidden_layers + i``; 0 when the checkpoint holds no MTP weights).
    """

    arch: str
    folder: Path
    num_logical_experts: int
    top_k: int
    num_moe_layers: int
    vocab_size: int
    hidden_size: int
    moe: Any
    num_mtp_layers: int = 0

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
    folder = Path(folder)
    file = folder / "config.json"
    config = json.loads(file.read_text())
    if (named := architectures_error(config.get("architectures") or [])) is not None:
        raise ValueError(f"{file}: {named}")
    cls = config["architectures"][0]
    if cls not in _ARCH_BY_CLASS:
        raise ValueError(f"{folder}: architecture {cls} is none of {sorted(ARCHITECTURES.values())}")
    moe = read_moe_facts(config, str(file))
    problems = moe_fact_errors(moe) + [f"{file} states no {fact}" for fact in moe.unstated()]
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
        num_mtp_layers=_mtp_layers(folder, config),
    )


def _mtp_layers(folder: Path, config: dict[str, Any]) -> int:
    """The MTP layers a checkpoint holds: ``num_nextn_predict_layers`` when the weights of the first
    (decoder index ``num_hidden_layers``) are in its safetensors (read from their headers), else 0 (a
    DeepSeek-V3 config states 1 by default, transformers' config class writes it without the weights)."""
    declared = config.get(MTP_LAYERS_KEY)
    layers = config.get("num_hidden_layers")
    if not isinstance(declared, int) or declared < 1 or not isinstance(layers, int):
        return 0

    prefix = f"model.layers.{layers}."
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if any(key.startswith(prefix) for key in f.keys()):  # noqa: SIM118 (safe_open has no __iter__)
                return declared
    return 0


def checkpoint_tensors(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files (in file-name order), by checkpoint key."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def checkpoint_experts(
    folder: str | os.PathLike[str], *, draft: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every MoE layer's routed experts as the checkpoint holds them, in vLLM's layout (``draft``: those of
    its multi-token prediction layers, the MoE layers of the draft vLLM builds from it).

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
    layers = (
        range(
            info.moe.stated["num_hidden_layers"], info.moe.stated["num_hidden_layers"] + info.num_mtp_layers
        )
        if draft
        else info.moe_layer_indices
    )
    for layer in layers:
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
    # local: transformers (5 s, Triton with it) when writing: simulate's option parser imports this module
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
            # vLLM's CPU MLA backend serves DeepSeek's latent width only: L + R = 512 + 64 = 576.
            kv_lora_rank=512,
            q_lora_rank=48,
            qk_rope_head_dim=64,
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
    mtp_layers: int = 0,
) -> Path:
    """Write a tiny random checkpoint of ``arch`` (an :data:`ARCHITECTURES` key) into ``folder`` (created;
    files overwritten) with transformers' config class, ``from_config`` and ``save_pretrained`` (per-expert
    keys); return the folder. Sizes: :func:`checkpoint_info`.

    Hidden 64, vocabulary 128, 4 heads; ``qwen3-moe``, ``qwen2-moe`` (a shared expert) and ``mixtral``: 2
    MoE layers, E=8, K=2; ``deepseek-v3``: 3 layers (the first dense), E=16 in 4 groups (2 chosen), K=4, one
    shared expert, MLA (q LoRA 48, kv LoRA 512, RoPE 64: the 576-wide latent vLLM's CPU MLA serves). Drawn
    from torch seed ``seed``: std 0.02, embeddings 1,
    router gates 0.5, LM head 0.3 (no layer routes degenerately), DeepSeek's ``e_score_correction_bias``
    0.05. ``num_experts`` E (DeepSeek: a multiple of 4), ``top_k`` K, ``num_moe_layers`` L (DeepSeek keeps its
    dense first layer) and ``moe_intermediate_size`` I (default 32; MX formats need a multiple of 64) override
    the defaults. ``fmt`` (:func:`to_format`): None / ``"float32"`` (a CPU-host-only dtype), ``"bf16"`` /
    ``"fp16"`` (the whole checkpoint), or a quantized format (float32 elsewhere, the routed experts in
    msModelSlim's layout with its description, served with ``--quantization ascend``). ``mtp_layers`` 1
    (``deepseek-v3`` only) adds the MTP layer (:func:`add_mtp_layer`, weights from ``seed + 1``).

    Raises:
        ValueError: unknown ``arch`` or ``fmt``; ``mtp_layers`` other than 0, or 1 for ``deepseek-v3``.
    """
    if mtp_layers not in (0, 1) or (mtp_layers and arch != "deepseek-v3"):
        raise ValueError(f"mtp_layers={mtp_layers!r}: 0, or 1 for deepseek-v3 (DeepSeek-V3's one MTP layer)")
    # local: transformers (5 s, Triton with it) when writing: simulate's option parser imports this module
    from transformers import AutoModelForCausalLM

    config = _hf_config(arch, num_experts, top_k, num_moe_layers, moe_intermediate_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        _draw_weights(model)
        model.save_pretrained(folder)
    finally:
        torch.random.set_rng_state(generator_state)
    write_tokenizer(folder, config.vocab_size)
    if mtp_layers:
        add_mtp_layer(folder, seed=seed + 1)
    return to_format(folder, fmt)


def tokenizer_words(vocab_size: int) -> list[str]:
    """The word of each token id of :func:`write_tokenizer`'s tokenizer: two lowercase letters, in order
    (``aa``, ``ab``, ...; no word is a prefix of another, no digits for a pre-tokenizer to split).

    Raises:
        ValueError: ``vocab_size`` above 676 (26 x 26 words).
    """
    if not 0 < vocab_size <= 26 * 26:
        raise ValueError(f"vocab_size={vocab_size}: the tokenizer's words cover 1 to {26 * 26} ids")
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [a + b for a in letters for b in letters][:vocab_size]


def write_tokenizer(folder: str | os.PathLike[str], vocab_size: int = VOCAB_SIZE) -> None:
    """Write a word-level tokenizer of ``vocab_size`` ids beside a checkpoint (``tokenizer.json``,
    ``tokenizer_config.json``), so that vLLM's serving front end and ``vllm bench serve`` (which detokenize
    random token ids into prompts and tokenize them back) serve it: id ``i`` is the word
    ``tokenizer_words(vocab_size)[i]``, whitespace-separated, every id round-trips; id 1 is the end of
    sequence (requests that must run their length set ``ignore_eos``)."""
    # local: transformers (5 s, Triton with it) when writing: simulate's option parser imports this module
    from transformers import PreTrainedTokenizerFast

    words = tokenizer_words(vocab_size)
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with one space
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0], eos_token=words[1])
    fast.save_pretrained(str(folder))


def _draw_weights(model: Any) -> None:
    """The tiny checkpoints' weights beyond transformers' initialisation, drawn in parameter order from the
    global generator: routing bias std 0.05, router gates std 0.5, token embeddings std 1, LM head std 0.3."""
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


def add_mtp_layer(
    folder: str | os.PathLike[str],
    *,
    seed: int = 1,
    popularity: Any = None,
    iterations: int = 60,
    step: float = 0.02,
    fit_seed: int = 0,
) -> Path:
    """Give a DeepSeek-V3 checkpoint its multi-token prediction (MTP) layer, in place; return ``folder``.

    The layer vLLM serves as the MoE draft ``DeepSeekMTP`` (``vllm/model_executor/models/deepseek_mtp.py``):
    at decoder index ``n = num_hidden_layers``, ``model.layers.n.{enorm, hnorm, eh_proj}``, a whole decoder
    layer with its own MoE (the target's E, K and groups) and ``shared_head.{norm, head}``, head and
    ``embed_tokens`` copies of the target's (as DeepSeek-V3's release); ``config.json`` already states
    ``num_nextn_predict_layers: 1``. The target's tensors, outputs and routing are unchanged. Drawn from
    ``seed`` as :func:`write_checkpoint` draws a layer; ``eh_proj`` std 0.02, norms 1. With ``popularity``
    (``(E,)`` non-negative) its routing bias is fitted as
    :func:`~ascend_eplb.world.routing_fit.fit_routing_bias` does (``iterations``,
    ``step``), the layer run as transformers' ``DeepseekV3DecoderLayer`` on HF's target hidden states of 16
    random sequences of 64 tokens (``fit_seed``) and their next tokens.

    Raises:
        ValueError: not a DeepSeek-V3 checkpoint, one with MTP weights already, a sharded one, or
            ``popularity`` not ``(E,)`` with a positive total.
    """
    # local: transformers (5 s, Triton with it) when writing: simulate's option parser imports this module
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    info = checkpoint_info(folder)
    if info.arch != "deepseek-v3":
        raise ValueError(f"{folder}: only a deepseek-v3 checkpoint has an MTP layer, got {info.arch}")
    if info.num_mtp_layers:
        raise ValueError(f"{folder}: holds the weights of {info.num_mtp_layers} MTP layer(s) already")
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{folder}: {len(files)} safetensors files; the tiny checkpoints have one")
    target = None
    if popularity is not None:
        target = torch.as_tensor(popularity, dtype=torch.float64)
        if target.shape != (info.num_logical_experts,) or float(target.sum()) <= 0:
            raise ValueError(
                f"popularity must be (E,) = ({info.num_logical_experts},) with a positive total, got "
                f"{tuple(target.shape)}"
            )
    hf_config = AutoConfig.from_pretrained(str(folder))
    n = int(hf_config.num_hidden_layers)
    hf_config.num_hidden_layers = n + 1
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        grown = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
        _draw_weights(grown)
        eh_proj = torch.randn(info.hidden_size, 2 * info.hidden_size) * _INIT_STD
    finally:
        torch.random.set_rng_state(generator_state)
    block = grown.model.layers[n]
    if target is not None:
        _fit_mtp_routing(folder, block, eh_proj, target / target.sum(), iterations, step, fit_seed)
    prefix = f"model.layers.{n}."
    with tempfile.TemporaryDirectory() as scratch:
        grown.save_pretrained(scratch)  # transformers' per-expert keys, as the target's
        layer = {k: v for k, v in checkpoint_tensors(scratch).items() if k.startswith(prefix)}
    tensors = checkpoint_tensors(folder)
    ones = torch.ones(info.hidden_size)
    layer.update(
        {
            prefix + "enorm.weight": ones.clone(),
            prefix + "hnorm.weight": ones.clone(),
            prefix + "eh_proj.weight": eh_proj,
            prefix + "shared_head.norm.weight": ones.clone(),
            prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
            prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        }
    )
    tensors.update({k: v.contiguous() for k, v in layer.items()})
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config[MTP_LAYERS_KEY] = 1
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _fit_mtp_routing(
    folder: Path,
    block: Any,
    eh_proj: torch.Tensor,
    target: torch.Tensor,
    iterations: int,
    step: float,
    seed: int,
) -> torch.Tensor:
    """Fit ``block``'s (an HF ``DeepseekV3DecoderLayer``) routing bias in place to the shares ``target``
    ``(E,)`` on the inputs vLLM's MTP layer gives it (:func:`add_mtp_layer`); returns the last observed
    shares, float64 ``(E,)``."""
    # local: transformers (5 s, Triton with it) when writing: simulate's option parser imports this module
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    block.eval()
    eps = model.config.rms_norm_eps

    def rms(x: torch.Tensor) -> torch.Tensor:  # the MTP layer's RMSNorms (weight 1)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    ids = torch.randint(0, model.config.vocab_size, (16, 65), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        hidden = model.model(ids[:, :64]).last_hidden_state  # what vLLM's target hands its draft
        embeds = model.model.embed_tokens(ids[:, 1:]).clone()
        embeds[:, 0] = 0  # vLLM's MTP layer masks the embedding at position 0
        x = F.linear(torch.cat([rms(embeds), rms(hidden)], dim=-1), eh_proj)
        positions = torch.arange(64).unsqueeze(0).expand(16, -1)
        rotary = model.model.rotary_emb(x, positions)
        mask = torch.full((64, 64), float("-inf")).triu(1).view(1, 1, 64, 64)
    counts: list[torch.Tensor] = []
    handle = block.mlp.gate.register_forward_hook(
        lambda module, inputs, output: counts.append(
            torch.bincount(output[2].reshape(-1), minlength=target.numel())
        )
    )
    shares = target
    try:
        for _ in range(iterations):
            counts.clear()
            with torch.inference_mode():
                block(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            shares = counts[0].double() / counts[0].sum()
            with torch.no_grad():
                error = torch.log((target + 1e-4) / (shares + 1e-4))
                block.mlp.gate.e_score_correction_bias += (step * error).float()
    finally:
        handle.remove()
    return shares


# --- the msModelSlim layout of quantized experts (vLLM Ascend's ``--quantization ascend``) ---------

#: The msModelSlim description file of a quantized checkpoint.
DESCRIPTION_FILE = "quant_model_description.json"


#: The vllm-ascend environment switches the world's quantized experts follow (``quant_method``), as
#: vllm-ascend reads them ("0" off).
FORMAT_SWITCHES = {
    "per_expert_lists": "VLLM_ASCEND_ENABLE_NZ",
    "fused_scales": "VLLM_ASCEND_ENABLE_FUSED_MC2",
}


def format_switch(name: str) -> bool:
    """Whether vllm-ascend's switch of ``name`` (a :data:`FORMAT_SWITCHES` key) is on in this process."""
    return os.environ.get(FORMAT_SWITCHES[name], "0").strip() not in ("", "0")


def msmodelslim_quant_type(fmt: str) -> str:
    """The msModelSlim quant type of a quant_views format name (``w8a8_dynamic`` -> ``W8A8_DYNAMIC``).

    Raises:
        ValueError: no msModelSlim type maps to ``fmt``.
    """
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
    name = ASCEND_QUANT_TYPES.get(str(quant_type).upper())
    if name is None:
        raise ValueError(f"msModelSlim quant type {quant_type!r} is none of {sorted(ASCEND_QUANT_TYPES)}")
    return name


def write_quantized_experts(folder: str | os.PathLike[str], fmt: str) -> Path:
    """Rewrite the routed experts of a float checkpoint in ``folder`` in msModelSlim's layout of ``fmt``;
    return the description file's path.

    Per MoE layer quant_views' ``quantize_checkpoint`` quantizes each expert on its own, written under the
    checkpoint's keys: ``w13_<suffix>`` rows ``[:I]`` as ``experts.<e>.gate_proj.<suffix>``, rows ``[I:]``
    as ``up_proj``, ``w2_<suffix>`` as ``down_proj`` (Mixtral: ``w1``/``w3``/``w2``). The description maps
    every tensor to its quant type (``FLOAT`` elsewhere) plus ``model_quant_type``. A rejected format
    (``w4a16`` ...) writes only the description, over the float experts: start-up must refuse it.

    Raises:
        ValueError: ``fmt`` has no msModelSlim type, or the checkpoint is not one of :func:`write_checkpoint`.
    """
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
