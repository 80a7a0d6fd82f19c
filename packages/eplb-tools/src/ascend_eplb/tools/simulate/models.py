"""The model ``ascend-eplb simulate`` serves: a local checkpoint folder, or a preset written once.

A folder holds ``config.json`` and safetensors of ``Qwen3MoeForCausalLM``, ``DeepseekV3ForCausalLM`` or
``MixtralForCausalLM`` (what ``ascend_eplb.world`` runs on a CPU host); its format is what start-up reads
of it (``check.model_folder.model_folder_facts``) and ``--format`` must match it. A preset
(:data:`PRESETS`) is a tiny random checkpoint written by ``write_checkpoint`` into
``$ASCEND_EPLB_CACHE/models`` (default ``~/.cache/ascend-eplb``) once per recipe version and format:
``deepseek-v3`` (the main job's default) at the embedded ESFT trace's shape (E = 64, top-6, 4 MoE layers,
routing bias fitted to the trace, with DeepSeek-V3's MTP layer), ``qwen3-moe`` and ``mixtral`` at
``write_checkpoint``'s defaults (E = 8, top-2, 2 MoE layers; routed by their random gates). The
recipes and formats: ``SIMULATE.md``, section "simulate".
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from ascend_eplb.integration.model_facts import EXPERT_COUNT_KEYS, TOP_K_KEYS, architectures_error
from ascend_eplb.integration.regular_files import regular_file_problem
from ascend_eplb.integration.rules import moe_fact_errors
from ascend_eplb.quant_views import FORMAT_SUPPORT
from ascend_eplb.tools.check.model_folder import folder_formats, model_folder_facts
from ascend_eplb.tools.files import json_object
from ascend_eplb.tools.trace import load_trace
from ascend_eplb.world.checkpoints import (
    ARCHITECTURES,
    VOCAB_SIZE,
    add_mtp_layer,
    checkpoint_info,
    to_format,
    write_checkpoint,
)
from ascend_eplb.world.engine.environment import CACHE_ENV, cache_root
from ascend_eplb.world.routing_fit import fit_routing_bias

__all__ = [
    "PRESETS",
    "REPLAY",
    "REPLAY_FORMAT",
    "ModelSource",
    "cache_folder",
    "folder_format",
    "moe_problems",
    "resolve_model",
]

#: ``--model`` value of the trace-replay world (synthetic experts in a quant_views format).
REPLAY = "replay"
#: The replay world's ``--format`` when none is given.
REPLAY_FORMAT = "w8a8_dynamic"
#: The format of a preset when ``--format`` is not given (exact comparisons on a CPU host).
PRESET_FORMAT = "float32"
#: The experts' formats vLLM's engine serves on this host (a real model's run; ``--model replay`` serves
#: every format EPLB supports).
ENGINE_FORMATS = (PRESET_FORMAT, "bf16", "fp16")
#: Preset names and the version of their recipe (a new version writes a new folder).
PRESETS = {"deepseek-v3": "v3", "qwen3-moe": "v2", "mixtral": "v2"}
#: The DeepSeek-V3 preset's sizes: the embedded trace's E and top-k, its first MoE layers.
_DEEPSEEK_PRESET = {"num_experts": 64, "top_k": 6, "num_moe_layers": 4}


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model``: what the report and the ranks need of it.

    Attributes:
        name: the preset name or the folder as given.
        folder: the checkpoint folder (absolute).
        architecture: the HF ``architectures`` entry (``DeepseekV3ForCausalLM``, ...).
        num_logical_experts: E; ``top_k``: K; ``num_moe_layers``: L.
        max_positions: the model's ``max_position_embeddings`` (the longest sequence of one step).
        format: the routed experts' format (``float32``, ``bf16``, ``fp16`` or a quantized format).
        num_mtp_layers: DeepSeek-V3's multi-token prediction layers the checkpoint holds (the MoE draft
            of ``--speculative-tokens``; ``CheckpointInfo.num_mtp_layers``).
        vocab_size: V, the ids the workload's prompts are drawn from.
    """

    name: str
    folder: Path
    architecture: str
    num_logical_experts: int
    top_k: int
    num_moe_layers: int
    max_positions: int
    format: str = PRESET_FORMAT
    num_mtp_layers: int = 0
    vocab_size: int = VOCAB_SIZE


def cache_folder() -> Path:
    """``$ASCEND_EPLB_CACHE/models`` (default ``~/.cache/ascend-eplb/models``:
    :func:`~ascend_eplb.world.engine.environment.cache_root`)."""
    return cache_root() / "models"


def _cache_error(folder: Path, error: OSError) -> str:
    """Why a preset cannot be written into ``folder`` (under :func:`cache_folder`), naming where the cache
    comes from and the fix."""
    root = folder.parent.parent
    given = os.environ.get(CACHE_ENV, "")
    source = f"{CACHE_ENV}={given}" if given.strip() else f"the default cache {root} ({CACHE_ENV} unset)"
    blocker = folder
    while not blocker.exists() and blocker != blocker.parent:
        blocker = blocker.parent
    if blocker.exists() and not blocker.is_dir():
        why = f"{blocker} is a file, not a folder"
    elif not os.access(blocker, os.W_OK | os.X_OK):
        why = f"{blocker} is not writable"
    else:
        why = f"{error.filename}: {error.strerror}" if error.filename and error.strerror else str(error)
    return (
        f"{source}: cannot write the preset {folder.name} under {folder.parent} ({why}); set {CACHE_ENV} to "
        "a writable folder, or unset it for ~/.cache/ascend-eplb"
    )


def _write_preset(name: str, folder: Path, fmt: str) -> None:
    """Write preset ``name`` in format ``fmt`` into ``folder`` atomically (a scratch folder renamed into
    place): the float32 checkpoint (routing fitted first), then converted (``checkpoints.to_format``)."""

    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        sizes = {"moe_intermediate_size": 64} if fmt.startswith("mx") else {}
        if name == "deepseek-v3":
            write_checkpoint(name, scratch, seed=0, **_DEEPSEEK_PRESET, **sizes)
            layers = _DEEPSEEK_PRESET["num_moe_layers"]
            trace = load_trace().load()
            fit_routing_bias(scratch, trace[:layers])
            # DeepSeek-V3's MTP layer (the draft of --speculative-tokens), routed like the next trace layer;
            # the target's tensors are unchanged by it.
            add_mtp_layer(scratch, popularity=trace[layers])
        else:
            write_checkpoint(name, scratch, seed=0, **sizes)
        to_format(scratch, fmt)
        try:
            scratch.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another process's finished preset
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def folder_format(folder: str | os.PathLike[str]) -> str:
    """The routed experts' format of a model folder, read as start-up validation reads it
    (``folder_formats``, which imports no vLLM: the msModelSlim description's quant type, else the
    checkpoint's dtype, else ``float32``).

    Raises:
        ValueError: ``config.json`` or the description cannot be read (naming the file).
    """

    quantization, dtype = folder_formats(folder)
    return quantization or dtype or PRESET_FORMAT


def moe_problems(folder: str | os.PathLike[str]) -> list[str]:
    """What breaks the rules in a model folder's MoE facts (``config.json``: routed experts, top-k, expert
    groups, MoE layers; ``rules.moe_fact_errors``, no vLLM imported), its ``architectures``
    (``model_facts.architectures_error``), a fact the file does not state and MoE layers not counted.

    Raises:
        ValueError: ``config.json`` cannot be read (naming the file).
    """

    facts = model_folder_facts(folder)
    moe = facts.moe
    names = {
        "experts": ("routed-expert count", EXPERT_COUNT_KEYS),
        "top_k": ("top-k", TOP_K_KEYS),
        "layers": ("decoder layer count", ("num_hidden_layers",)),
    }
    unstated = [
        f"{moe.source} states no {what} (none of {', '.join(keys)}); state it"
        for fact, (what, keys) in names.items()
        if fact in moe.unstated()
    ]
    problems = [*moe_fact_errors(moe), *unstated]
    if (named := architectures_error(facts.architectures)) is not None:
        problems.append(f"{moe.source}: {named}")
    elif (not_counted := moe.layers_not_counted()) is not None:
        problems.append(not_counted)
    return problems


def weights_problems(folder: Path) -> list[str]:
    """Why the ``*.safetensors`` files of ``folder`` cannot be loaded (each rank's load raised a
    127-line traceback): none there, one that is not a regular file, or one the safetensors library
    refuses to open (empty, truncated, a header that lies about its tensors' bytes), each naming the file.
    Only the headers are read."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return [f"model={folder}: the folder has no *.safetensors weights"]
    problems = []
    for file in files:
        if (problem := regular_file_problem(file)) is not None:
            problems.append(f"model={folder}: {problem}")
            continue
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as e:  # SafetensorError (a Rust panic's message), OSError
            said = str(e) or type(e).__name__
            problems.append(
                f"model={folder}: {file.name} is not a whole safetensors file ({said}; {file.stat().st_size} "
                "bytes: empty or truncated?); fix: copy the checkpoint again"
            )
    return problems


def _format_error(fmt: str) -> str | None:
    """Why the experts' format ``fmt`` cannot be served, or None."""

    if fmt != PRESET_FORMAT and fmt not in FORMAT_SUPPORT:
        served = sorted(name for name, support in FORMAT_SUPPORT.items() if support.supports_eplb)
        return f"must be {PRESET_FORMAT} or a format EPLB supports ({', '.join(served)})"
    if fmt != PRESET_FORMAT and not FORMAT_SUPPORT[fmt].supports_eplb:
        return f"does not support EPLB ({FORMAT_SUPPORT[fmt].reason})"
    if fmt not in ENGINE_FORMATS:
        return (
            f"is a quantized format, which vLLM's engine on this host cannot serve (vLLM Ascend's `ascend` "
            f"quantization and its kernels exist on Ascend only): --model replay serves its kernel storage "
            f"(served by vLLM's engine here: {', '.join(ENGINE_FORMATS)})"
        )
    return None


def resolve_model(model: str, fmt: str | None = None) -> ModelSource:
    """The checkpoint of ``--model``: a preset (written into :func:`cache_folder` in format ``fmt`` if
    missing) or a folder (whose format ``fmt``, when given, must be).

    Raises:
        ValueError: ``model`` is neither a preset nor a folder with a ``config.json`` of a supported
            architecture; the folder has no weights or its MoE facts break start-up's rules
            (:func:`moe_problems`), every problem listed; ``fmt`` is not a format EPLB supports (or
            ``float32``); a folder's format is not ``fmt`` (each message names the value and what is
            accepted).
    """

    if model in PRESETS:
        fmt = fmt or PRESET_FORMAT
        if (reason := _format_error(fmt)) is not None:
            raise ValueError(f"format={fmt!r}: {reason}")
        suffix = "" if fmt == PRESET_FORMAT else f"-{fmt}"
        folder = cache_folder() / f"{model}-{PRESETS[model]}{suffix}"
        if not (folder / "config.json").is_file():
            try:
                _write_preset(model, folder, fmt)
            except OSError as e:
                raise ValueError(_cache_error(folder, e)) from None
    else:
        if not model.strip():  # Path("") is the current folder
            raise ValueError(f"model={model!r}: an empty path; name a folder, a preset or {REPLAY}")
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"model={model}: neither a preset ({', '.join(PRESETS)}, or {REPLAY}) nor a folder with a "
                "config.json"
            )
        # The weights, then its MoE facts as start-up reads them: every problem at once, before a rank starts.
        problems = weights_problems(folder)
        problems += moe_problems(folder)  # each names the folder's config.json
        own = folder_format(folder)
        if fmt is not None and fmt != own:
            problems.append(
                f"format={fmt}: the folder's experts are {own} (its quant_model_description.json or dtype, "
                f"as start-up reads it); leave --format out or pass {own}"
            )
        elif (reason := _format_error(own)) is not None:
            # Without --format the format is the folder's own, and the message says so.
            problems.append(
                f"format={fmt!r}: {reason}"
                if fmt is not None
                else f"model={model}: its experts are {own} (its quant_model_description.json or dtype, as "
                f"start-up reads it), a format simulate cannot serve: it {reason}"
            )
        if problems:
            raise ValueError("\n  - ".join(problems))
        fmt = own
    try:
        info = checkpoint_info(folder)
        max_positions = int(json_object(folder / "config.json")["max_position_embeddings"])
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"model={model}: {type(e).__name__}: {e}") from None
    return ModelSource(
        name=model,
        folder=folder.resolve(),
        architecture=ARCHITECTURES[info.arch],
        num_logical_experts=info.num_logical_experts,
        top_k=info.top_k,
        num_moe_layers=info.num_moe_layers,
        max_positions=max_positions,
        format=fmt,
        num_mtp_layers=info.num_mtp_layers,
        vocab_size=info.vocab_size,
    )
