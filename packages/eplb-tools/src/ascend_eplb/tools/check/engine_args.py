"""Engine arguments (a ``vllm serve`` command line, a ``vllm serve --config`` file): parsed by vLLM's own
parser and read into the rules' :class:`~ascend_eplb.integration.settings.EplbSettings` as vLLM resolves
each setting, with no ``VllmConfig`` built. This module imports vLLM: ``check`` imports it only for a serve
command line or a ``--config`` file (``check`` on this package's config-file schema imports no vLLM)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, get_args

from pydantic import TypeAdapter, ValidationError
from vllm.config import SpeculativeConfig
from vllm.config.speculative import MTPModelTypes
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.transformers_utils.config import get_config
from vllm.utils.argparse_utils import FlexibleArgumentParser

from ascend_eplb.integration.model_facts import EXPERT_COUNT_KEYS, TOP_K_KEYS, MoeFacts, read_moe_facts
from ascend_eplb.integration.settings import EplbSettings
from ascend_eplb.integration.settings_reader import (
    additional_paths,
    is_mtp,
    optimization_level,
    parallel_paths,
    read_settings,
)
from ascend_eplb.integration.validation import DTYPE_FORMATS, EplbConfigError, ascend_format_name
from ascend_eplb.tools.check.model_folder import ModelFacts, model_folder_facts

__all__ = [
    "engine_args_problems",
    "mtp_draft_facts",
    "parse_serve_command",
    "settings_from_engine_args",
]


def parse_serve_command(argv: Sequence[str]) -> Any:
    """``argv`` (``serve [MODEL] [options]``) parsed by vLLM's own ``vllm serve`` parser -> ``EngineArgs``.

    The parser is built as ``vllm``'s CLI builds it (``FlexibleArgumentParser`` with the ``serve``
    subcommand's ``ServeSubcommand().subparser_init``: ``make_arg_parser``, ``EngineArgs.add_cli_args``),
    so ``--config FILE``, ``--x.y`` dotted keys, JSON values and underscores behave as in vLLM; the
    positional model wins over ``--model``/``model:`` as in ``ServeSubcommand.cmd``.

    Raises:
        SystemExit: vLLM's parser rejected an argument (status 2, its message on stderr).
        ValueError: not a ``serve`` command line, or vLLM's parser's own checks (``--config`` not a YAML
            file, no model with ``--config``), or ``EngineArgs`` rejected a value.
    """
    argv = list(argv)
    if argv[:1] != ["serve"]:
        raise ValueError(f"a vllm serve command line starts with 'serve' (as after 'vllm'), got {argv[:1]}")
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(required=False, dest="subparser"))
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    return EngineArgs.from_cli_args(args)


def engine_args_problems(engine_args: Any) -> list[str]:
    """What vLLM would refuse in parsed ``EngineArgs`` that its parser let through, judged by vLLM's own
    validators before anything is built: the optimization level (``VllmConfig``'s field), each key of
    ``speculative_config`` (``SpeculativeConfig``'s field of that name, its type and constraints:
    ``num_speculative_tokens`` > 0; a key of no field: vLLM's config forbids extra keys). One message per
    problem, naming the value and vLLM's rule."""
    problems = []
    try:
        optimization_level(engine_args.optimization_level)
    except ValueError as e:
        problems.append(f"{e}; fix: -O0, -O1, -O2 or -O3")
    spec = engine_args.speculative_config
    if isinstance(spec, dict):
        fields = SpeculativeConfig.__pydantic_fields__
        for key, value in spec.items():
            field = fields.get(key)
            if field is None:
                problems.append(
                    f"speculative_config key {key!r} is no field of vLLM's SpeculativeConfig (it refuses "
                    "extra keys)"
                )
                continue
            judged = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            try:
                TypeAdapter(judged).validate_python(value)
            except ValidationError as e:
                problems.append(
                    f"speculative_config {key}={value!r}: vLLM's SpeculativeConfig refuses it "
                    f"({e.errors()[0]['msg']})"
                )
    return problems


def mtp_draft_facts(folder: str, engine_args: Any) -> tuple[tuple[str, ...] | None, str | None, MoeFacts]:
    """The MTP draft of the model in ``folder`` as vLLM 0.33.0 derives it: the folder's HF config (vLLM's
    ``get_config``), rewritten by ``SpeculativeConfig.hf_config_override`` (DeepSeek-V3's becomes
    ``DeepSeekMTPModel``, model_type ``deepseek_mtp``). Returns ``(architectures, model_type, routed-expert
    facts)`` of the draft config.

    Raises:
        ValueError: the folder's config cannot be read by vLLM (naming the folder and why).
    """
    try:
        hf_config = get_config(
            folder, trust_remote_code=bool(getattr(engine_args, "trust_remote_code", False))
        )
    except Exception as e:
        raise ValueError(f"{folder}: vLLM cannot read its config ({type(e).__name__}: {e})") from None
    draft = SpeculativeConfig.hf_config_override(hf_config)
    names = getattr(draft, "architectures", None)
    architectures = (tuple(names) if isinstance(names, list) else names) or None
    text = draft.get_text_config() if hasattr(draft, "get_text_config") else draft
    moe = read_moe_facts(text, f"the MTP draft config of {folder}", architectures=architectures)
    return architectures, getattr(draft, "model_type", None), moe


def settings_from_engine_args(
    engine_args: Any,
    environ: Mapping[str, str] | None = None,
    *,
    num_experts: int | None = None,
    quantization: str | None = None,
) -> EplbSettings:
    """The settings the rules read from vLLM ``EngineArgs`` (parsed, with vLLM's own field defaults):
    their values at vLLM's config paths, read by the one reader
    (:func:`~ascend_eplb.integration.settings_reader.read_settings`, which derives the runner, the modes,
    inductor freezing and an MTP draft as MoE as start-up does).

    No ``VllmConfig`` is built (that needs the model from a hub). Model facts come from
    ``num_experts``/``quantization`` (a format name), else from a local folder ``model``
    (:func:`model_folder_facts`, judged as start-up judges ``hf_config``). A fact neither gives is in
    ``unknown_facts`` (its rule not judged): the expert count or top-k a folder does not state, the
    format of ``quantization ascend`` without a description or of ``dtype auto``, whether a non-MTP draft
    whose ``model`` is not a local folder has experts.

    Raises:
        ValueError: a model folder's ``config.json`` or description cannot be read (naming the file).
        EplbConfigError: the description's routed experts mix quant types, or the reader refuses a value.
    """
    ea = engine_args
    env = os.environ if environ is None else environ
    model = str(ea.model or "")
    facts = model_folder_facts(model) if model and Path(model).is_dir() else None
    if not model:
        missing = "no model is given"
    elif facts is None:
        missing = f"model {model!r} is not a local folder"
    else:
        missing = f"the model folder {model} does not say"
    unknown: dict[str, str] = {}

    moe = facts.moe if facts is not None else None
    if moe is not None and num_experts is not None:
        # The caller's count wins over the folder's, and is judged in its place.
        stated = {k: v for k, v in moe.stated.items() if k not in EXPERT_COUNT_KEYS}
        moe = replace(moe, stated={"num_experts": num_experts, **stated}, block_configs_experts=None)
    experts = num_experts if num_experts is not None else (moe.num_logical_experts if moe else None)
    if experts is None and facts is None:
        unknown["num_logical_experts"] = (
            f"the routed-expert count is unknown ({missing}); pass --num-experts N (before the --) or a "
            "local model folder as MODEL"
        )
    unstated = moe.unstated() if moe is not None else []
    if "experts" in unstated:
        unknown["num_logical_experts"] = (
            f"the routed-expert count is unknown ({moe.source} states none of "
            f"{', '.join(EXPERT_COUNT_KEYS)}, so vLLM reads its config class's default); pass --num-experts "
            "N (before the --) or state it in config.json"
        )
    if "top_k" in unstated:
        unknown["top_k"] = (
            f"the experts per token are unknown ({moe.source} states none of {', '.join(TOP_K_KEYS)}, so "
            "vLLM reads its config class's default); state num_experts_per_tok in config.json"
        )

    fmt: str | None = None
    method = ea.quantization
    if quantization is not None and quantization.lower() != "ascend":
        fmt = ascend_format_name(quantization)
    elif quantization is not None or (method is not None and str(method).lower() == "ascend"):
        fmt = facts.quantization if facts else None
        if fmt is None:
            if facts is None:
                where = missing
            elif facts.description is None:
                where = f"none in {model}"
            else:
                where = f"{facts.description} names no routed-expert weight (no '.experts.' key)"
            unknown["quantization"] = (
                "--quantization ascend takes the routed experts' format from msModelSlim's "
                f"quant_model_description*.json ({where}); pass --quantization FORMAT (before the --) or a "
                "local model folder as MODEL"
            )
    elif method is None:
        dtype = str(ea.dtype).removeprefix("torch.")
        fmt = (facts.dtype if facts else None) if dtype == "auto" else DTYPE_FORMATS.get(dtype, dtype)
        if fmt is None:
            unknown["quantization"] = (
                f"the checkpoint's dtype is unknown (dtype=auto, {missing}); pass --quantization FORMAT "
                "(before the --) or a local model folder as MODEL"
            )
    else:
        fmt = str(method).lower()

    values: dict[str, Any] = {
        **parallel_paths(ea, ea.eplb_config),
        **additional_paths(ea.additional_config),
        "model_config.model": model,
        "model_config.enforce_eager": bool(ea.enforce_eager),
        "model_config.architectures": facts.architectures if facts is not None else None,
        "optimization_level": ea.optimization_level,
        "model.num_logical_experts": experts,
        "model.num_moe_layers": facts.num_moe_layers if facts is not None else None,
        "model.quantization": fmt,
        "model.moe_facts": moe,
    }
    compilation = ea.compilation_config
    configured = getattr(compilation, "cudagraph_mode", None)
    if configured is not None:
        values["compilation_config.cudagraph_mode"] = str(getattr(configured, "name", configured)).upper()
    values["compilation_config.mode"] = getattr(compilation, "mode", None)
    values["compilation_config.inductor_compile_config"] = getattr(
        compilation, "inductor_compile_config", None
    )
    if ea.speculative_config is not None:
        values.update(_draft_paths(dict(ea.speculative_config), model, facts, ea, missing, unknown))
    if values["model.num_moe_layers"] is None:
        unknown["num_moe_layers"] = (
            f"the MoE layer count is unknown ({missing}: config.json's num_hidden_layers); pass a local "
            "model folder as MODEL"
        )
    settings, violations = read_settings(values, env)
    if violations:
        raise EplbConfigError(violations)
    settings.unknown_facts.update(unknown)
    return settings


def _draft_paths(
    spec: dict[str, Any], model: str, facts: ModelFacts | None, ea: Any, missing: str, unknown: dict[str, str]
) -> dict[str, Any]:
    """The speculative config's method (vLLM's name of it) and the draft's facts: an MTP draft's from
    the target's folder (:func:`mtp_draft_facts`), another's from its own local folder; what is unknown
    goes into ``unknown``."""
    method = spec.get("method")
    if method in get_args(MTPModelTypes):
        method = "mtp"  # vLLM's SpeculativeConfig renames the deprecated MTP methods
    draft = spec.get("model")
    values: dict[str, Any] = {
        "speculative_config.method": method or "unset",
        # vLLM's draft config of an MTP method is the target's model; another draft's is its own.
        "speculative_config.draft_model_config.model": str(draft or model),
    }
    if is_mtp(method):
        if facts is None:
            unknown["speculative_draft_architectures"] = (
                f"the MTP draft's model class is unknown ({missing}: vLLM derives it from the target's "
                "config, e.g. DeepSeek-V3's DeepSeekMTPModel); pass a local model folder as MODEL"
            )
            values["speculative_config.draft_model_config.architectures"] = None
        else:
            architectures, model_type, moe = mtp_draft_facts(model, ea)
            values["speculative_config.draft_model_config.architectures"] = architectures
            values["speculative_config.draft_model_type"] = model_type
            values["speculative_config.draft_moe_facts"] = moe
    elif draft and Path(str(draft)).is_dir():
        draft_facts = model_folder_facts(str(draft))
        values["speculative_config.draft_is_moe"] = (draft_facts.num_logical_experts or 0) > 0
        values["speculative_config.draft_model_config.architectures"] = draft_facts.architectures
        values["speculative_config.draft_model_type"] = draft_facts.model_type
        values["speculative_config.draft_moe_facts"] = draft_facts.moe
    else:
        unknown["speculative_draft_is_moe"] = (
            f"whether the draft of speculative method={method!r} has routed experts is unknown "
            f"(draft model {draft!r} is not a local folder); pass the draft's local folder as "
            "speculative-config model"
        )
    return values
