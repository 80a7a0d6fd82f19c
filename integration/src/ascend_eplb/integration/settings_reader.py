"""The one reader of the settings: a mapping keyed by vLLM's own config paths, checked and derived once.

Each source only maps into that mapping (path -> value as the source holds it): a ``VllmConfig``
(:func:`ascend_eplb.integration.validation.settings_from_vllm_config`), serve arguments parsed by vLLM's
own parser and this project's config file (``ascend-eplb check``, in the tools), whose schema is
:data:`FILE_SCHEMA`, the mapping's paths nested by their dots. :func:`read_settings` checks each value
once (a ``schema`` violation naming the path; what vLLM parsed passes) and derives every field of
:class:`~ascend_eplb.integration.settings.EplbSettings` once: vLLM's defaults, the model runner, the
graph and compilation modes, inductor freezing, an MTP draft as MoE and the models upstream balances.

Paths: vLLM's (``parallel_config.eplb_config.window_size``, ``additional_config.eplb_config.<key>``,
``compilation_config.mode``, ``speculative_config.method``, ``model_config.enforce_eager``, ...); the
facts a source reads about the model, under ``model.`` (the file's ``model`` section) and
``speculative_config.draft_*``. vLLM is imported only where a default or a name is vLLM's to give.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from ascend_eplb.control.values import INT32_MAX, is_int
from ascend_eplb.integration.model_facts import shown
from ascend_eplb.integration.rules import Violation
from ascend_eplb.integration.settings import (
    COMPILATION_MODES,
    V1_EPLB_ENV_SWITCHES,
    V1_EPLB_KEYS,
    EplbSettings,
)

__all__ = [
    "ASCEND_SECTION",
    "FILE_SCHEMA",
    "V2_RUNNER_SWITCH",
    "additional_paths",
    "file_sections",
    "is_mtp",
    "optimization_level",
    "parallel_paths",
    "read_settings",
    "v2_runner_switch",
]

#: vLLM's switch of the model runner; unset: Model Runner V2, vLLM 0.33.0's default.
V2_RUNNER_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
#: The Ascend keys' section: every ``additional_config.eplb_config.<key>`` is read (the rules judge them).
ASCEND_SECTION = "additional_config.eplb_config"
#: The fields a ``ParallelConfig`` and vLLM's ``EngineArgs`` name alike: switches, then sizes.
_PARALLEL_SWITCHES = ("enable_eplb", "enable_expert_parallel", "enable_elastic_ep", "enable_dbo")
_PARALLEL_SIZES = ("tensor_parallel_size", "prefill_context_parallel_size", "data_parallel_size")
#: The ``EPLBConfig`` fields the rules judge (taken as given), then those checked here: ``log_balancedness``
#: and two that only a file gives, checked and not read.
_EPLB_FIELDS = (
    "window_size",
    "step_interval",
    "num_redundant_experts",
    "use_async",
    "policy",
    "communicator",
)
_EPLB_CHECKED = ("log_balancedness", "log_balancedness_interval", "enable_migration_batching")
#: The config file's schema (``ascend-eplb check CONFIG.json``): every path a file may give, nested by its
#: dots, in the order its sections are read; ``<section>.*`` takes any key. ``environment`` overrides the
#: process environment for the V1 switches.
FILE_SCHEMA = (
    "use_v2_model_runner",
    *(f"parallel_config.{k}" for k in (*_PARALLEL_SWITCHES, *_PARALLEL_SIZES)),
    *(f"parallel_config.eplb_config.{k}" for k in (*_EPLB_FIELDS, *_EPLB_CHECKED)),
    *(f"additional_config.{k}" for k in V1_EPLB_KEYS),
    f"{ASCEND_SECTION}.*",
    "model.num_logical_experts",
    "model.num_moe_layers",
    "model.quantization",
    "compilation_config.cudagraph_mode",
    "compilation_config.mode",
    "compilation_config.inductor_compile_config",
    "speculative_config.method",
    "speculative_config.draft_is_moe",
    "speculative_config.draft_architectures",
    "speculative_config.draft_model_type",
    *(f"environment.{k}" for k in V1_EPLB_ENV_SWITCHES),
)
_DEFAULTS = EplbSettings()


def file_sections() -> dict[str, set[str]]:
    """Each section of :data:`FILE_SCHEMA` (``""``: the file itself) -> the keys it takes, in read
    order (``"*"``: any)."""
    sections: dict[str, set[str]] = {}
    for path in FILE_SCHEMA:
        parts = path.split(".")
        for i, key in enumerate(parts):
            sections.setdefault(".".join(parts[:i]), set()).add(key)
    return sections


def _as_dict(obj: Any) -> dict[str, Any]:
    """``obj`` (None, a mapping, or an object with ``__dict__``) as a dict, the way vLLM Ascend's
    ``AscendConfig`` reads ``additional_config``; ``TypeError`` naming the type otherwise."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    raise TypeError(f"additional_config.eplb_config must be a mapping, got {type(obj).__name__}")


def parallel_paths(parallel: Any, eplb_config: Any) -> dict[str, Any]:
    """The paths of a ``ParallelConfig`` or vLLM's ``EngineArgs`` (same field names) and their
    ``EPLBConfig``: what the rules read of them (``all2all_backend`` too, which decides the MoE rows)."""
    values = {f"parallel_config.{k}": bool(getattr(parallel, k, False)) for k in _PARALLEL_SWITCHES}
    values.update({f"parallel_config.{k}": getattr(parallel, k, 1) for k in _PARALLEL_SIZES})
    values["parallel_config.all2all_backend"] = getattr(
        parallel, "all2all_backend", _DEFAULTS.all2all_backend
    )
    for k in (*_EPLB_FIELDS, "log_balancedness"):
        values[f"parallel_config.eplb_config.{k}"] = getattr(eplb_config, k)
    return values


def additional_paths(additional_config: Any) -> dict[str, Any]:
    """The paths of vLLM's ``additional_config`` (None, a mapping or an object, read by :func:`_as_dict`):
    each Ascend key, and each historical V1 key at its top level."""
    additional = _as_dict(additional_config)
    values = {f"{ASCEND_SECTION}.{k}": v for k, v in _as_dict(additional.get("eplb_config")).items()}
    values.update({f"additional_config.{k}": additional[k] for k in V1_EPLB_KEYS if k in additional})
    return values


def is_mtp(method: Any) -> bool:
    """Whether a speculative ``method`` is an MTP one, whose draft (the target's MTP layers) is MoE."""
    return "mtp" in str(method or "")


def v2_runner_switch(environ: Mapping[str, str]) -> tuple[bool | None, Violation | None]:
    """``VLLM_USE_V2_MODEL_RUNNER`` as vLLM 0.33.0 reads it (``envs.maybe_convert_bool``:
    ``bool(int(value))``): ``(None, None)`` unset; ``(value, None)``; ``(None, violation)`` for a value
    ``int()`` refuses (``true``, ``banana``), on which vLLM's start-up raises a bare ``ValueError``."""
    raw = environ.get(V2_RUNNER_SWITCH)
    if raw is None:
        return None, None
    try:
        return bool(int(raw)), None
    except ValueError:
        return None, Violation(
            "model-runner-v2",
            f"{V2_RUNNER_SWITCH}={shown(raw)} is not an integer: vLLM reads it with int() (bool(int(value))) "
            f"and its start-up fails with a ValueError; fix: set {V2_RUNNER_SWITCH}=1, or unset it (Model "
            "Runner V2, vLLM 0.33.0's default)",
        )


def optimization_level(value: Any = None) -> Any:
    """``value`` (``-O3``, ``--optimization-level 2``: vLLM's parser keeps the text ``"3"``) as vLLM's
    ``VllmConfig`` reads it: its field's own validator (pydantic, ``OptimizationLevel``); None: vLLM's
    default (``O2``).

    Raises:
        ValueError: vLLM refuses the value (its message).
    """
    # local: vLLM's own validators, only when a value is judged: check imports this module without vLLM
    from pydantic import TypeAdapter, ValidationError
    from vllm.config import VllmConfig
    from vllm.config.vllm import OptimizationLevel

    if value is None:
        return VllmConfig.optimization_level
    try:
        return TypeAdapter(OptimizationLevel).validate_python(value)
    except ValidationError as e:
        raise ValueError(f"optimization level {value!r}: {e.errors()[0]['msg']}") from None


def _default_cudagraph_mode(level: Any = None) -> str:
    """vLLM's ``cudagraph_mode`` when none is set: its optimization level's default (``O2``: graphs)."""
    # local: vLLM's own validators, only when a value is judged: check imports this module without vLLM
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG

    mode = OPTIMIZATION_LEVEL_TO_CONFIG[optimization_level(level)]["compilation_config"]["cudagraph_mode"]
    return mode.name


class _Reading:
    """One reading of a mapping: its values, the violations found and the facts left unknown."""

    def __init__(self, values: Mapping[str, Any]):
        self.values = values
        self.out: list[Violation] = []
        self.unknown: dict[str, str] = {}

    def schema(self, message: str) -> None:
        self.out.append(Violation("schema", message))

    def integer(self, path: str, default: int | None) -> int | None:
        """An integer in [1, INT32_MAX] (``default`` when absent or refused; None allowed if default)."""
        v = self.values.get(path, default)
        if v is None and default is None:
            return None
        if not is_int(v) or not 1 <= v <= INT32_MAX:
            self.schema(f"{path}={shown(v)} must be an integer in [1, {INT32_MAX}]")
            return default
        return v

    def boolean(self, path: str, default: bool) -> bool:
        # JSON true/false only: bool("false") is True, so a quoted value would flip the switch.
        v = self.values.get(path, default)
        if not isinstance(v, bool):
            label = path if "." in path else f"the config file.{path}"
            self.schema(f"{label}={v!r} must be a JSON boolean (true or false)")
            return default
        return v

    def cudagraph_mode(self, level: Any) -> str:
        v = self.values.get("compilation_config.cudagraph_mode")
        if v is None:  # absent or null: vLLM's default for the optimization level
            return _default_cudagraph_mode(level)
        if not isinstance(v, str) or not v:
            self.schema(f"compilation_config.cudagraph_mode={shown(v)} must be a mode name (a string)")
            # Not the default mode: the source stated one, just not a readable one.
            self.unknown["cudagraph_mode"] = "compilation_config.cudagraph_mode is not a mode name"
            return str(v)
        return v

    def compilation_mode(self, level: Any) -> str:
        v = self.values.get("compilation_config.mode")
        if v is None:  # vLLM's default (VllmConfig.__post_init__): VLLM_COMPILE above O0, NONE at O0
            return "VLLM_COMPILE" if level is None or optimization_level(level) > 0 else "NONE"
        if is_int(v) and 0 <= v < len(COMPILATION_MODES):  # a number, or vLLM's CompilationMode
            return COMPILATION_MODES[v]
        if isinstance(v, str) and v.upper() in COMPILATION_MODES:
            return v.upper()
        self.schema(
            f"compilation_config.mode={shown(v)} must be one of vLLM's modes, a name of "
            f"{list(COMPILATION_MODES)} or its number 0-3"
        )
        self.unknown["compilation_mode"] = "compilation_config.mode is not a mode"
        return str(v)

    def draft_architectures(self) -> Any:
        """The draft's classes: as read from its model config (``draft_model_config.architectures``), or
        the file's ``draft_architectures``, a non-empty list of names."""
        read = "speculative_config.draft_model_config.architectures"
        if read in self.values:
            return self.values[read]
        names = self.values.get("speculative_config.draft_architectures")
        if names is None:
            return None
        if isinstance(names, list) and names and all(isinstance(n, str) and n for n in names):
            return tuple(names)
        self.schema(
            f"speculative_config.draft_architectures={shown(names)} must be a non-empty list of model class "
            'names (the draft config\'s architectures, e.g. ["DeepSeekMTPModel"])'
        )
        return None


def read_settings(
    values: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[EplbSettings, list[Violation]]:
    """The settings of ``values`` (path -> value, see the module docstring) and ``environ`` (the V1
    switches, ``VLLM_USE_V2_MODEL_RUNNER``, ``TORCHINDUCTOR_FREEZING``), each value checked once.

    An absent path is vLLM's default (the EPLB fields: :class:`EplbSettings`'s, tested equal to
    ``EPLBConfig``'s). Derived: ``use_v2_model_runner`` from the environment when not given; both modes
    NONE with ``model_config.enforce_eager``, else as given (a name, or the compilation mode's number),
    else vLLM's default for ``optimization_level``; inductor freezing from ``inductor_compile_config`` or
    ``TORCHINDUCTOR_FREEZING=1``; the draft is MoE when stated or the method is MTP; ``served_models``
    (upstream's names: the MoE draft's first) when ``model_config.model`` is given.

    Returns:
        the settings and the ``schema`` violations (a value of the wrong type, which reads as its default;
        a mode that is none: its fact unknown), plus ``model-runner-v2`` for a switch vLLM cannot read.
    """
    r = _Reading(values)
    get = values.get
    v2_env, v2_error = v2_runner_switch(environ)
    if v2_error is not None:
        r.out.append(v2_error)
    inductor = get("compilation_config.inductor_compile_config") or {}
    if not isinstance(inductor, dict):
        r.schema(f"compilation_config.inductor_compile_config={shown(inductor)} must be an object")
        inductor = {}
    r.integer("parallel_config.eplb_config.log_balancedness_interval", 1)  # checked, not judged
    r.boolean("parallel_config.eplb_config.enable_migration_batching", False)
    experts = r.integer("model.num_logical_experts", None)
    layers = r.integer("model.num_moe_layers", None)
    method = get("speculative_config.method")
    draft_is_moe = r.boolean("speculative_config.draft_is_moe", False) or is_mtp(method)
    draft_architectures = r.draft_architectures()
    draft_model_type = get("speculative_config.draft_model_type")
    quantization = get("model.quantization", "bf16")
    ascend = {
        k[len(ASCEND_SECTION) + 1 :]: v for k, v in values.items() if k.startswith(ASCEND_SECTION + ".")
    }
    settings = EplbSettings(
        enable_eplb=r.boolean("parallel_config.enable_eplb", False),
        use_v2_model_runner=r.boolean("use_v2_model_runner", True if v2_env is None else v2_env),
        enable_expert_parallel=r.boolean("parallel_config.enable_expert_parallel", False),
        enable_elastic_ep=r.boolean("parallel_config.enable_elastic_ep", False),
        enable_dbo=r.boolean("parallel_config.enable_dbo", False),
        tensor_parallel_size=r.integer("parallel_config.tensor_parallel_size", 1),
        prefill_context_parallel_size=r.integer("parallel_config.prefill_context_parallel_size", 1),
        data_parallel_size=r.integer("parallel_config.data_parallel_size", 1),
        all2all_backend=get("parallel_config.all2all_backend", _DEFAULTS.all2all_backend),
        **{k: get(f"parallel_config.eplb_config.{k}", getattr(_DEFAULTS, k)) for k in _EPLB_FIELDS},
        log_balancedness=r.boolean(
            "parallel_config.eplb_config.log_balancedness", _DEFAULTS.log_balancedness
        ),
        ascend_eplb_config=ascend,
        legacy_top_level_keys={
            k: get(f"additional_config.{k}") for k in V1_EPLB_KEYS if f"additional_config.{k}" in values
        },
        environment={k: environ[k] for k in V1_EPLB_ENV_SWITCHES if k in environ},
        num_logical_experts=experts,
        num_moe_layers=layers,
        quantization=str(quantization) if quantization is not None else None,
        inductor_freezing=bool(inductor.get("freezing")) or environ.get("TORCHINDUCTOR_FREEZING", "0") == "1",
        inductor_compile_config=dict(inductor),
        speculative_method=method,
        speculative_draft_is_moe=draft_is_moe,
        speculative_draft_architectures=draft_architectures,
        speculative_draft_model_type=draft_model_type if isinstance(draft_model_type, str) else None,
        speculative_draft_moe_facts=get("speculative_config.draft_moe_facts"),
        served_models=_served_models(values, draft_is_moe),
        moe_facts=get("model.moe_facts"),
        model_architectures=get("model_config.architectures"),
    )
    if get("model_config.enforce_eager", False):
        settings.cudagraph_mode = settings.compilation_mode = "NONE"
    else:
        level = get("optimization_level")
        settings.cudagraph_mode = r.cudagraph_mode(level)
        settings.compilation_mode = r.compilation_mode(level)
    settings.unknown_facts = r.unknown
    return settings, r.out


def _served_models(values: Mapping[str, Any], draft_is_moe: bool) -> tuple[str, ...] | None:
    """The names upstream's ``EplbModelState`` gives the balanced models: the target
    (``model_config.model``) and, before it (upstream registers the draft first), an MoE draft's
    (``eplb_draft_model_name`` of ``speculative_config.draft_model_config.model``); None: no model."""
    model = values.get("model_config.model")
    if not model:
        return None
    draft = values.get("speculative_config.draft_model_config.model")
    if not draft_is_moe or draft is None:
        return (model,)
    # local: vLLM only with a draft to name
    from vllm.v1.worker.gpu.eplb_utils import eplb_draft_model_name

    return (eplb_draft_model_name(SimpleNamespace(model=draft)), model)
