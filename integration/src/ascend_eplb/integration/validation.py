"""Start-up validation of Model Runner V2 EPLB on Ascend (the support matrix).

Runs before any weight or buffer is allocated (vLLM Ascend calls it from its platform's
``check_and_update_config``) and raises one :class:`EplbConfigError` that lists every violated rule with
the offending value and the fix. Nothing here imports vLLM or allocates: the phases come from
``ascend_eplb.control.phase``, the int check from ``ascend_eplb.control.values`` and the truthy
parsing of environment switches from ``ascend_eplb.integration.switches`` (all standard library only);
the quantization format check imports ``ascend_eplb.quant_views`` (pure torch) only when EPLB is on.

Where each setting is read from (``validate_eplb_config``):

* vLLM's EPLB and parallel settings: ``vllm_config.parallel_config`` (``enable_eplb``, ``eplb_config``,
  ``enable_expert_parallel``, ``enable_elastic_ep``, ``tensor_parallel_size``,
  ``prefill_context_parallel_size``, ``data_parallel_size``, ``enable_dbo``).
* Runner: ``vllm_config.use_v2_model_runner``.
* The Ascend ``eplb_config``: ``vllm_config.additional_config["eplb_config"]`` (a dict, or an object with
  ``__dict__``), the way vLLM Ascend's ``AscendConfig`` reads it; the historical V1 keys are also looked for
  at the top level of ``additional_config``. The V1 environment switches ``DYNAMIC_EPLB`` and
  ``EXPERT_MAP_RECORD`` are read from ``os.environ``.
* Logical experts: ``vllm_config.model_config.get_num_experts()`` (skipped when there is no model config).
* Quantization format (a name of the quant_views support table, see :func:`quantization_format_name`):
  ``model_config.quantization`` is None -> the model dtype (``bf16``/``fp16``); an Ascend msModelSlim
  config (``vllm_config.quant_config.quant_description``) -> the quant type of its routed-expert weights
  mapped through :data:`ASCEND_QUANT_TYPES`; any other quantization method -> its name, lower-cased.
* Execution features: ``compilation_config.cudagraph_mode`` with ``model_config.enforce_eager``,
  ``speculative_config``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ascend_eplb.control.phase import LOAD_COLLECTION_PHASES as _CONTROL_PHASES
from ascend_eplb.control.values import is_int
from ascend_eplb.integration.switches import is_true

__all__ = [
    "ASCEND_QUANT_TYPES",
    "ASCEND_V2_KEYS",
    "INT32_MAX",
    "LOAD_COLLECTION_PHASES",
    "V1_EPLB_ENV_SWITCHES",
    "V1_EPLB_KEYS",
    "CheckResult",
    "EplbConfigError",
    "EplbSettings",
    "Judgement",
    "ModelFacts",
    "Violation",
    "check_config_file",
    "check_serve_command",
    "check_settings",
    "experts_divisibility_error",
    "model_folder_facts",
    "parse_serve_command",
    "quantization_format_name",
    "settings_from_engine_args",
    "settings_from_file_dict",
    "settings_from_vllm_config",
    "validate_eplb_config",
]

#: Model Runner V1 (legacy dynamic/static EPLB) controls of vLLM Ascend's ``eplb_config`` and of the
#: historical top-level ``additional_config`` (vllm_ascend/ascend_config.py; notes/vllm-ascend-eplb.md 2.2).
V1_EPLB_KEYS = (
    "dynamic_eplb",
    "expert_map_path",
    "expert_map_record_path",
    "expert_heat_collection_interval",
    "algorithm_execution_interval",
    "eplb_policy_type",
    "eplb_heat_collection_stage",
    "num_redundant_experts",
    "init_redundancy_expert",
    "num_iterations_eplb_update",
    "num_wait_worker_iterations",
    "gate_eplb",
)
#: Environment switches of the V1 path (asserted by vLLM Ascend's V1 ``EplbUpdator``).
V1_EPLB_ENV_SWITCHES = ("DYNAMIC_EPLB", "EXPERT_MAP_RECORD")
#: The only Ascend-specific key of the Model Runner V2 ``eplb_config``.
ASCEND_V2_KEYS = ("load_collection_phase",)
#: Values of ``load_collection_phase``: control's own constant (``ascend_eplb.control.phase``, no vLLM).
LOAD_COLLECTION_PHASES = _CONTROL_PHASES
#: Communicators accepted by this integration (``torch_gloo`` -> ``AscendGlooEplbCommunicator``).
SUPPORTED_COMMUNICATORS = ("torch_gloo",)
#: Largest integer a setting may hold (``2**31 - 1``): the sizes and counts feed int32 device tables
#: (the dataplane's replica lookup) and upstream's int32 load counters. The one statement of the
#: limit, also read by ``ascend-eplb simulate``'s integer rules.
INT32_MAX = 2**31 - 1

#: msModelSlim quant types of routed-expert weights (vllm_ascend quantization) -> quant_views format names.
ASCEND_QUANT_TYPES = {
    "W8A8_DYNAMIC": "w8a8_dynamic",
    "W8A8": "w8a8_dynamic",
    "W4A8_DYNAMIC": "w4a8_dynamic",
    "W8A8_MXFP8": "mxfp8",
    "W4A4_MXFP4": "mxfp4",
    "W4A16": "w4a16",
    "W4A16_MXFP4": "w4a16_mxfp4",
    "W4A8_MXFP4": "w4a8_mxfp4",
}
_DTYPE_FORMATS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


@dataclass(frozen=True)
class Violation:
    """One rule's finding; ``rule`` is its stable id.

    Judged (the default): the rule is violated and ``message`` names the value and the fix. Unjudged
    (``judged=False``, :meth:`unjudged`): the rule could not be judged for lack of a fact and ``message``
    says which fact and how to give it; never a pass (``ascend-eplb check`` without the model folder).
    """

    rule: str
    message: str
    judged: bool = True

    @classmethod
    def unjudged(cls, rule: str, reason: str) -> Violation:
        """The finding of ``rule`` not judged for lack of a fact (``reason``: which, and how to give it)."""
        return cls(rule, reason, judged=False)

    def __str__(self) -> str:
        if self.judged:
            return f"[{self.rule}] {self.message}"
        return f"cannot judge: {self.rule}: {self.message}"


class Judgement(list):
    """What :func:`check_settings` returns: the violations (a ``list[Violation]``) plus ``.unjudged``
    (unjudged ``Violation`` s), the rules that could not be judged because a fact is unknown
    (``EplbSettings.unknown_facts``).
    At start-up every fact is known, so ``.unjudged`` is empty there."""

    def __init__(self, violations=(), unjudged=()):
        super().__init__(violations)
        self.unjudged: list[Violation] = list(unjudged)


class EplbConfigError(ValueError):
    """Every rule the EPLB configuration violates, in one error.

    Attributes:
        violations: the violated rules, in rule order.
    """

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        lines = [f"{len(self.violations)} EPLB configuration rule(s) violated:"]
        lines += [f"  - {v}" for v in self.violations]
        super().__init__("\n".join(lines))


@dataclass
class EplbSettings:
    """The settings the rules read, extracted from a ``VllmConfig`` or a config file.

    ``num_ranks`` is the EP size: TP x PCP x DP (the EP group of vLLM's ``ParallelConfig``).
    ``unknown_facts`` maps a fact's field (``num_logical_experts``, ``quantization``,
    ``speculative_draft_is_moe``) to why it is unknown and how to give it; the rule that needs it is
    then reported as unjudged (:meth:`Violation.unjudged`) instead of passing (``ascend-eplb check``
    without the model folder). Start-up validation knows every fact and leaves it empty.

    The EPLB fields' defaults (``window_size`` to ``communicator``, ``log_balancedness``) are upstream
    vLLM 0.33.0 ``EPLBConfig``'s (tested equal); a config file that omits one reads them from here.
    """

    enable_eplb: bool = False
    use_v2_model_runner: bool = True
    enable_expert_parallel: bool = False
    enable_elastic_ep: bool = False
    enable_dbo: bool = False
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    data_parallel_size: int = 1
    window_size: Any = 1000
    step_interval: Any = 3000
    num_redundant_experts: Any = 0
    use_async: Any = True
    policy: Any = "default"
    communicator: Any = None
    log_balancedness: bool = False
    ascend_eplb_config: dict[str, Any] = field(default_factory=dict)
    legacy_top_level_keys: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    num_logical_experts: int | None = None
    quantization: str | None = "bf16"
    cudagraph_mode: str = "NONE"
    speculative_method: str | None = None
    speculative_draft_is_moe: bool = False
    unknown_facts: dict[str, str] = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size * self.prefill_context_parallel_size * self.data_parallel_size


#: Every field at its default: what a config file that omits a setting means.
_DEFAULTS = EplbSettings()


def experts_divisibility_error(
    num_logical_experts: int, num_redundant_experts: int, num_ranks: int
) -> str | None:
    """Why ``E + R`` physical experts cannot be spread evenly over ``N`` EP ranks, or None when they can.

    The one statement of upstream's layout rule (``EplbState``: ``P / N`` local physical experts per
    rank), used by start-up validation, ``ascend-eplb plan`` and ``ascend-eplb simulate``. The message
    names the values and the nearest fix (the next redundancy level that divides).
    """
    p = num_logical_experts + num_redundant_experts
    if num_ranks < 1 or p % num_ranks == 0:
        return None
    fix = num_redundant_experts + (-p) % num_ranks
    return (
        f"logical experts ({num_logical_experts}) + num_redundant_experts ({num_redundant_experts}) = {p} "
        f"physical experts is not divisible by {num_ranks} EP ranks; fix: choose num_redundant_experts so "
        f"that {num_logical_experts} + num_redundant_experts is a multiple of {num_ranks}, e.g. {fix}"
    )


def check_settings(s: EplbSettings) -> Judgement:
    """Apply every rule to ``s`` and return the violations (empty: the configuration is supported).

    The one rules function of start-up validation and ``ascend-eplb check``. A rule whose fact is in
    ``s.unknown_facts`` is not judged: it is listed in the result's ``.unjudged``, never passed silently.
    """
    out = Judgement()
    facts_unknown = s.unknown_facts
    phase = s.ascend_eplb_config.get("load_collection_phase", "all")
    v1_in_config = [k for k in V1_EPLB_KEYS if k in s.ascend_eplb_config]
    v1_top = [k for k in V1_EPLB_KEYS if k in s.legacy_top_level_keys]
    env_on = [k for k in V1_EPLB_ENV_SWITCHES if is_true(s.environment.get(k))]

    if not s.enable_eplb:
        # EPLB off: the V1 path (if any) is not ours to judge; only a V2-only key without EPLB is wrong.
        if phase != "all":
            out.append(
                Violation(
                    "phase-without-eplb",
                    f"eplb_config.load_collection_phase={phase!r} needs Model Runner V2 EPLB, but "
                    "enable_eplb=False; fix: pass --enable-eplb or remove load_collection_phase",
                )
            )
        return out

    if not s.use_v2_model_runner:
        out.append(
            Violation(
                "model-runner-v2",
                "enable_eplb=True with use_v2_model_runner=False: upstream EPLB is supported by Model "
                "Runner V2 only; fix: set VLLM_USE_V2_MODEL_RUNNER=1 (or use the V1 dynamic_eplb path "
                "without --enable-eplb)",
            )
        )
    if v1_in_config or v1_top:
        where = [f"additional_config.eplb_config.{k}" for k in v1_in_config]
        where += [f"additional_config.{k}" for k in v1_top]
        out.append(
            Violation(
                "v1-controls",
                f"Model Runner V1 EPLB controls cannot be mixed with V2 EPLB: got {', '.join(where)}; "
                "fix: remove them and use --eplb-config (window_size, step_interval, "
                "num_redundant_experts); the only Ascend V2 key is load_collection_phase",
            )
        )
    if env_on:
        shown = ", ".join(f"{k}={s.environment[k]!r}" for k in env_on)
        out.append(
            Violation(
                "v1-env",
                f"Model Runner V1 EPLB environment switches cannot be mixed with V2 EPLB: got {shown}; "
                f"fix: unset {' and '.join(env_on)}",
            )
        )
    unknown = sorted(k for k in s.ascend_eplb_config if k not in ASCEND_V2_KEYS and k not in V1_EPLB_KEYS)
    if unknown:
        out.append(
            Violation(
                "unknown-ascend-key",
                f"unknown additional_config.eplb_config key(s) {unknown}; fix: the only Ascend Model "
                "Runner V2 key is 'load_collection_phase'",
            )
        )
    if phase not in LOAD_COLLECTION_PHASES:
        out.append(
            Violation(
                "load-collection-phase",
                f"eplb_config.load_collection_phase={phase!r} is not one of {list(LOAD_COLLECTION_PHASES)}; "
                "fix: use 'all', 'prefill' or 'decode'",
            )
        )
    if s.use_async is not True:
        out.append(
            Violation(
                "async-only",
                f"eplb_config.use_async={s.use_async!r}: only asynchronous EPLB is supported (no silent "
                "switch); fix: set --eplb-config.use_async=true",
            )
        )
    if s.communicator is not None and s.communicator not in SUPPORTED_COMMUNICATORS:
        out.append(
            Violation(
                "communicator",
                f"eplb_config.communicator={s.communicator!r} is not supported on Ascend; fix: leave it "
                "unset or set 'torch_gloo' (AscendGlooEplbCommunicator, CPU staging over Gloo)",
            )
        )
    if s.policy != "default":
        out.append(
            Violation(
                "policy",
                f"eplb_config.policy={s.policy!r}: only vLLM's 'default' policy is supported; fix: set "
                "policy='default'",
            )
        )
    if s.enable_elastic_ep:
        out.append(
            Violation(
                "elastic-ep",
                "enable_elastic_ep=True is not supported with Ascend EPLB; fix: disable elastic EP",
            )
        )
    if not s.enable_expert_parallel:
        out.append(
            Violation(
                "expert-parallel",
                "enable_expert_parallel=False: EPLB needs expert parallelism; fix: pass "
                "--enable-expert-parallel",
            )
        )
    for name in ("window_size", "step_interval"):
        value = getattr(s, name)
        if not is_int(value) or value <= 0:
            out.append(
                Violation(
                    name.replace("_", "-"),
                    f"eplb_config.{name}={value!r} must be a positive integer; fix: set "
                    f"--eplb-config.{name} to a value > 0",
                )
            )
    r = s.num_redundant_experts
    r_ok = is_int(r) and r >= 0
    if not r_ok:
        out.append(
            Violation(
                "redundant-experts",
                f"eplb_config.num_redundant_experts={r!r} must be an integer >= 0; fix: set "
                "--eplb-config.num_redundant_experts to 0 or more",
            )
        )
    if r_ok and s.enable_expert_parallel and "num_logical_experts" in facts_unknown:
        out.unjudged.append(Violation.unjudged("experts-divisible", facts_unknown["num_logical_experts"]))
    elif r_ok and s.num_logical_experts is not None and s.enable_expert_parallel:
        reason = experts_divisibility_error(s.num_logical_experts, r, s.num_ranks)
        if reason is not None:
            out.append(
                Violation(
                    "experts-divisible",
                    f"{reason} (EP size {s.num_ranks} = TP {s.tensor_parallel_size} x PCP "
                    f"{s.prefill_context_parallel_size} x DP {s.data_parallel_size})",
                )
            )
    if "quantization" in facts_unknown:
        out.unjudged.append(Violation.unjudged("quantization", facts_unknown["quantization"]))
    else:
        out.extend(_format_violations(s.quantization))
    if s.cudagraph_mode.upper() != "NONE":
        out.append(
            Violation(
                "graph-capture",
                f"graph capture (cudagraph_mode={s.cudagraph_mode}) is not validated with Ascend EPLB "
                "yet (the lookup's in-place refresh under graph replay has no test); fix: run eager "
                "(--enforce-eager)",
            )
        )
    if s.speculative_method is not None and "speculative_draft_is_moe" in facts_unknown:
        out.unjudged.append(
            Violation.unjudged("speculative-moe-draft", facts_unknown["speculative_draft_is_moe"])
        )
    elif s.speculative_method is not None and s.speculative_draft_is_moe:
        out.append(
            Violation(
                "speculative-moe-draft",
                f"speculative decoding with an MoE draft (method={s.speculative_method!r}) is not "
                "validated with Ascend EPLB yet (the draft model's layer states have no test); fix: "
                "disable speculative decoding or use a dense draft",
            )
        )
    if s.enable_dbo:
        out.append(
            Violation(
                "micro-batching",
                "enable_dbo=True (dual-batch overlap) is not validated with Ascend EPLB yet (per-micro-"
                "batch unpadded token counts have no test); fix: disable --enable-dbo",
            )
        )
    from ascend_eplb.control.layout import unplaceable_layout

    layout_reason = unplaceable_layout(s)
    if layout_reason is not None:
        out.append(Violation("row-layout", f"{layout_reason}; fix: set --prefill-context-parallel-size 1"))
    return out


def _format_violations(name: str | None) -> list[Violation]:
    if name is None:
        return []
    if name == "float32":
        # Unquantized float32 experts: what exact comparisons on a CPU host need (the test suite, the
        # simulator on real models); no Ascend kernel serves them.
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return []
        return [
            Violation(
                "quantization",
                "float32 expert weights are accepted on a CPU host only (exact comparisons); fix: serve "
                "--dtype bfloat16 or float16",
            )
        ]
    from ascend_eplb.quant_views import UnsupportedFormatError, get_format

    try:
        fmt = get_format(name)
    except UnsupportedFormatError as exc:
        return [
            Violation("quantization", f"quantization format {name!r}: {exc}; fix: use a supported format")
        ]
    if not fmt.supports_eplb:
        return [
            Violation(
                "quantization",
                f"quantization format {name!r} does not support EPLB (supports_eplb=False); fix: use a "
                "supported format",
            )
        ]
    return []


def _as_dict(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    raise TypeError(f"additional_config.eplb_config must be a mapping, got {type(obj).__name__}")


def quantization_format_name(vllm_config: Any) -> str | None:
    """The quant_views format name of the model's routed experts (None: no model config to read).

    Raises:
        EplbConfigError: an msModelSlim description whose routed experts mix quant types.
    """
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    method = getattr(model_config, "quantization", None)
    if method is None:
        dtype = str(getattr(model_config, "dtype", "bfloat16")).removeprefix("torch.")
        return _DTYPE_FORMATS.get(dtype, dtype)
    description = getattr(getattr(vllm_config, "quant_config", None), "quant_description", None)
    if isinstance(description, Mapping):
        name = _experts_format(description)
        if name is not None:
            return name
    return str(method).lower()


def _experts_format(description: Mapping[Any, Any]) -> str | None:
    """The format of an msModelSlim description's routed-expert weights (None: it has none)."""
    types = sorted(
        {
            str(v).upper()
            for k, v in description.items()
            if ".experts." in str(k) and str(k).endswith("weight")
        }
    )
    if len(types) > 1:
        raise EplbConfigError(
            [Violation("quantization", f"routed experts mix quant types {types}; fix: quantize uniformly")]
        )
    return ASCEND_QUANT_TYPES.get(types[0], types[0].lower()) if types else None


def _parallel_and_eplb_fields(
    parallel: Any, eplb_config: Any, additional: Mapping[str, Any], env: Mapping[str, str]
) -> dict[str, Any]:
    """The settings a ``ParallelConfig`` and vLLM's ``EngineArgs`` name alike (same field names), with
    the ``EPLBConfig``, the Ascend ``additional_config`` and the V1 switches of the environment."""
    return {
        "enable_expert_parallel": bool(parallel.enable_expert_parallel),
        "enable_elastic_ep": bool(getattr(parallel, "enable_elastic_ep", False)),
        "enable_dbo": bool(getattr(parallel, "enable_dbo", False)),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "prefill_context_parallel_size": getattr(parallel, "prefill_context_parallel_size", 1),
        "data_parallel_size": parallel.data_parallel_size,
        "window_size": eplb_config.window_size,
        "step_interval": eplb_config.step_interval,
        "num_redundant_experts": eplb_config.num_redundant_experts,
        "use_async": eplb_config.use_async,
        "policy": eplb_config.policy,
        "communicator": eplb_config.communicator,
        "log_balancedness": eplb_config.log_balancedness,
        "ascend_eplb_config": _as_dict(additional.get("eplb_config")),
        "legacy_top_level_keys": {k: additional[k] for k in V1_EPLB_KEYS if k in additional},
        "environment": {k: env[k] for k in V1_EPLB_ENV_SWITCHES if k in env},
    }


def settings_from_vllm_config(vllm_config: Any, environ: Mapping[str, str] | None = None) -> EplbSettings:
    """Extract the settings the rules read from a ``VllmConfig`` (see the module docstring)."""
    pc = vllm_config.parallel_config
    ec = pc.eplb_config
    additional = _as_dict(getattr(vllm_config, "additional_config", None))
    model_config = getattr(vllm_config, "model_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    draft_experts = 0
    if draft is not None:
        try:
            draft_experts = int(draft.get_num_experts() or 0)
        except Exception:
            draft_experts = 0
    env = os.environ if environ is None else environ
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(getattr(compilation, "cudagraph_mode", None), "name", "NONE")
    if model_config is not None and getattr(model_config, "enforce_eager", False):
        mode = "NONE"
    num_experts = None
    if model_config is not None:
        num_experts = int(model_config.get_num_experts() or 0) or None
    return EplbSettings(
        enable_eplb=bool(pc.enable_eplb),
        use_v2_model_runner=bool(vllm_config.use_v2_model_runner),
        **_parallel_and_eplb_fields(pc, ec, additional, env),
        num_logical_experts=num_experts,
        quantization=quantization_format_name(vllm_config) if pc.enable_eplb else None,
        cudagraph_mode=mode,
        speculative_method=getattr(spec, "method", None) if spec is not None else None,
        speculative_draft_is_moe=draft_experts > 0 or "mtp" in str(getattr(spec, "method", "") or ""),
    )


def validate_eplb_config(vllm_config: Any) -> EplbSettings:
    """Check a ``VllmConfig`` against every rule of the Ascend Model Runner V2 EPLB support matrix.

    Call it at start-up, before any weight or buffer is allocated. With ``enable_eplb=False`` only the
    "load_collection_phase needs EPLB" rule applies and nothing else is read or imported.

    Returns:
        the resolved settings (``communicator`` unset resolves to ``"torch_gloo"``, no other backend is
        probed); the config object itself is not modified.

    Raises:
        EplbConfigError: one error listing every violated rule with the offending value and the fix.
    """
    settings = settings_from_vllm_config(vllm_config)
    violations = check_settings(settings)
    if violations:
        raise EplbConfigError(violations)
    if settings.enable_eplb and settings.communicator is None:
        settings.communicator = "torch_gloo"
    return settings


# -- config files (``ascend-eplb check CONFIG.json``) -------------------------------------------------

_FILE_KEYS = {
    "use_v2_model_runner",
    "parallel_config",
    "additional_config",
    "model",
    "compilation_config",
    "speculative_config",
    "environment",
}
_PARALLEL_KEYS = {
    "enable_eplb",
    "enable_expert_parallel",
    "enable_elastic_ep",
    "enable_dbo",
    "tensor_parallel_size",
    "prefill_context_parallel_size",
    "data_parallel_size",
    "eplb_config",
}
_EPLB_KEYS = {
    "window_size",
    "step_interval",
    "num_redundant_experts",
    "use_async",
    "policy",
    "communicator",
    "log_balancedness",
    "log_balancedness_interval",
    "enable_migration_batching",
}
_MODEL_KEYS = {"num_logical_experts", "quantization"}


def _check_keys(section: str, value: Any, allowed: set[str], out: list[Violation]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        out.append(Violation("schema", f"{section} must be a JSON object, got {type(value).__name__}"))
        return {}
    extra = sorted(set(value) - allowed)
    if extra:
        out.append(Violation("schema", f"unknown key(s) {extra} in {section}; allowed: {sorted(allowed)}"))
    return value


def _short(value: Any) -> str:
    """``repr(value)``, shortened for the message when it is very long (a 400-digit integer)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def settings_from_file_dict(
    data: Any, environ: Mapping[str, str] | None = None
) -> tuple[EplbSettings, list[Violation]]:
    """Settings from a parsed config file (schema in the package README) plus schema violations."""
    out: list[Violation] = []
    top = _check_keys("the config file", data, _FILE_KEYS, out)
    pc = _check_keys("parallel_config", top.get("parallel_config"), _PARALLEL_KEYS, out)
    ec = _check_keys("parallel_config.eplb_config", pc.get("eplb_config"), _EPLB_KEYS, out)
    additional = _check_keys(
        "additional_config", top.get("additional_config"), set(V1_EPLB_KEYS) | {"eplb_config"}, out
    )
    ascend = additional.get("eplb_config") or {}
    if not isinstance(ascend, dict):
        out.append(Violation("schema", "additional_config.eplb_config must be a JSON object"))
        ascend = {}
    model = _check_keys("model", top.get("model"), _MODEL_KEYS, out)
    compilation = _check_keys("compilation_config", top.get("compilation_config"), {"cudagraph_mode"}, out)
    spec = _check_keys("speculative_config", top.get("speculative_config"), {"method", "draft_is_moe"}, out)
    env_file = _check_keys("environment", top.get("environment"), set(V1_EPLB_ENV_SWITCHES), out)
    env = dict(os.environ if environ is None else environ)
    env.update({k: str(v) for k, v in env_file.items()})

    def integer(section: str, d: dict[str, Any], key: str, default: int) -> int:
        v = d.get(key, default)
        if not is_int(v) or not 1 <= v <= INT32_MAX:
            rule = f"must be an integer in [1, {INT32_MAX}]"
            out.append(Violation("schema", f"{section}.{key}={_short(v)} {rule}"))
            return default
        return v

    def boolean(section: str, d: dict[str, Any], key: str, default: bool) -> bool:
        # JSON true/false only: bool("false") is True, so a quoted value would flip the switch.
        v = d.get(key, default)
        if not isinstance(v, bool):
            out.append(Violation("schema", f"{section}.{key}={v!r} must be a JSON boolean (true or false)"))
            return default
        return v

    interval = ec.get("log_balancedness_interval", 1)
    if not is_int(interval) or not 1 <= interval <= INT32_MAX:
        out.append(
            Violation(
                "schema",
                f"parallel_config.eplb_config.log_balancedness_interval={_short(interval)} must be an "
                f"integer in [1, {INT32_MAX}]",
            )
        )
    boolean("parallel_config.eplb_config", ec, "enable_migration_batching", False)

    experts = model.get("num_logical_experts")
    if experts is not None and (not is_int(experts) or not 1 <= experts <= INT32_MAX):
        rule = f"must be an integer in [1, {INT32_MAX}]"
        out.append(Violation("schema", f"model.num_logical_experts={_short(experts)} {rule}"))
        experts = None
    quant = model.get("quantization", "bf16")
    unknown: dict[str, str] = {}
    if experts is None:
        unknown["num_logical_experts"] = (
            "the routed-expert count is unknown (model.num_logical_experts is not given); pass "
            "--num-experts / model.num_logical_experts"
        )
    if isinstance(quant, str) and quant.lower() == "ascend":
        unknown["quantization"] = (
            "quantization 'ascend' takes the routed experts' format from msModelSlim's "
            "quant_model_description*.json, which a config file does not carry; pass --quantization FORMAT"
        )
    settings = EplbSettings(
        enable_eplb=boolean("parallel_config", pc, "enable_eplb", False),
        use_v2_model_runner=boolean("the config file", top, "use_v2_model_runner", True),
        enable_expert_parallel=boolean("parallel_config", pc, "enable_expert_parallel", False),
        enable_elastic_ep=boolean("parallel_config", pc, "enable_elastic_ep", False),
        enable_dbo=boolean("parallel_config", pc, "enable_dbo", False),
        tensor_parallel_size=integer("parallel_config", pc, "tensor_parallel_size", 1),
        prefill_context_parallel_size=integer("parallel_config", pc, "prefill_context_parallel_size", 1),
        data_parallel_size=integer("parallel_config", pc, "data_parallel_size", 1),
        window_size=ec.get("window_size", _DEFAULTS.window_size),
        step_interval=ec.get("step_interval", _DEFAULTS.step_interval),
        num_redundant_experts=ec.get("num_redundant_experts", _DEFAULTS.num_redundant_experts),
        use_async=ec.get("use_async", _DEFAULTS.use_async),
        policy=ec.get("policy", _DEFAULTS.policy),
        communicator=ec.get("communicator", _DEFAULTS.communicator),
        log_balancedness=boolean(
            "parallel_config.eplb_config", ec, "log_balancedness", _DEFAULTS.log_balancedness
        ),
        ascend_eplb_config=dict(ascend),
        legacy_top_level_keys={k: additional[k] for k in V1_EPLB_KEYS if k in additional},
        environment={k: env[k] for k in V1_EPLB_ENV_SWITCHES if k in env},
        num_logical_experts=experts,
        quantization=str(quant) if quant is not None else None,
        cudagraph_mode=str(compilation.get("cudagraph_mode") or _default_cudagraph_mode()),
        speculative_method=spec.get("method") if spec else None,
        speculative_draft_is_moe=boolean("speculative_config", spec, "draft_is_moe", False)
        or "mtp" in str(spec.get("method") or ""),
        unknown_facts=unknown,
    )
    return settings, out


@dataclass(frozen=True)
class CheckResult:
    """Outcome of :func:`check_config_file` / :func:`check_serve_command`: ``ok`` (no violation) and the
    text to print (resolved settings or rules); ``unjudged`` lists the rules that could not be judged."""

    ok: bool
    report: str
    violations: tuple[Violation, ...] = ()
    resolved: dict[str, Any] | None = None
    unjudged: tuple[Violation, ...] = ()

    def __iter__(self):
        """Unpack as ``ok, report = check_config_file(path)``."""
        return iter((self.ok, self.report))

    @property
    def exit_code(self) -> int:
        """0 when no rule is violated (some may be unjudged), 2 otherwise (``ascend-eplb check``'s)."""
        return 0 if self.ok else 2

    @property
    def verdict(self) -> str:
        """``OK``, ``OK (N rule(s) could not be judged)`` or ``INVALID``."""
        if not self.ok:
            return "INVALID"
        n = len(self.unjudged)
        if not n:
            return "OK"
        return f"OK ({n} rule{'' if n == 1 else 's'} could not be judged)"


def _resolved(s: EplbSettings) -> dict[str, Any]:
    d = asdict(s)
    d["communicator"] = s.communicator or "torch_gloo"
    d["load_collection_phase"] = s.ascend_eplb_config.get("load_collection_phase", "all")
    d["num_ranks"] = s.num_ranks
    if s.num_logical_experts is not None:
        d["num_physical_experts"] = s.num_logical_experts + s.num_redundant_experts
        d["num_local_physical_experts"] = d["num_physical_experts"] // s.num_ranks
    for k in ("ascend_eplb_config", "legacy_top_level_keys", "environment", "unknown_facts"):
        d.pop(k)
    return d


def _result(settings: EplbSettings | None, violations: list[Violation]) -> CheckResult:
    unjudged = tuple(getattr(violations, "unjudged", ()))
    tail = [str(u) for u in unjudged]
    if violations:
        text = "\n".join([str(EplbConfigError(violations)), *tail])
        return CheckResult(False, text, tuple(violations), None, unjudged)
    assert settings is not None
    resolved = _resolved(settings)
    lines = ["ok"] + [f"  {k}: {resolved[k]}" for k in sorted(resolved)] + tail
    return CheckResult(True, "\n".join(lines), (), resolved, unjudged)


def _refused(rule: str, message: str) -> CheckResult:
    v = Violation(rule, message)
    return CheckResult(False, str(EplbConfigError([v])), (v,))


def _is_engine_args(data: Any) -> bool:
    """A flat mapping of engine arguments (``vllm serve --config``), not this package's nested schema."""
    return (
        isinstance(data, dict)
        and "parallel_config" not in data
        and not isinstance(data.get("model"), dict)
        and not set(data) <= _FILE_KEYS
    )


def check_config_file(
    path: str | os.PathLike[str],
    environ: Mapping[str, str] | None = None,
    *,
    num_experts: int | None = None,
    quantization: str | None = None,
) -> CheckResult:
    """Validate a config file: this package's JSON schema, or a ``vllm serve --config`` YAML/JSON.

    The form is told by content: the schema (README) has a nested ``parallel_config`` (or a ``model``
    object, or only schema keys); anything else is a flat mapping of vLLM engine arguments (dashes or
    underscores), read by vLLM's own ``--config`` handling and parser (:func:`parse_serve_command`) and
    turned into settings by :func:`settings_from_engine_args` (``model:`` a local folder gives the model
    facts). ``.yaml``/``.yml`` files are read as YAML, anything else as JSON. ``environ`` (default
    ``os.environ``) supplies the V1 switches and ``VLLM_USE_V2_MODEL_RUNNER``; ``num_experts`` and
    ``quantization`` (a format name) give model facts the file lacks (they win over the file's).

    Returns:
        ``CheckResult(ok, report, violations, resolved, unjudged)``, which unpacks as ``ok, report``.

    Never raises: an unreadable, empty, malformed or hostile file, a non-object, an argument vLLM's
    parser rejects, an unreadable model folder, anything the rules did not foresee, is a violation
    (``schema``, ``engine-args`` or ``model-folder``) naming the file and the cause. Only an interrupt
    (``KeyboardInterrupt``) passes through.
    """
    name = os.fspath(path)
    try:
        raw = Path(path).read_bytes()
        text = raw.decode("utf-8")
        is_yaml = str(name).lower().endswith((".yaml", ".yml"))
        if not raw.strip():
            data = None
        elif is_yaml:
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except (Exception, RecursionError, MemoryError) as exc:
        form = "YAML" if str(name).lower().endswith((".yaml", ".yml")) else "JSON"
        return _refused("schema", f"cannot read {name!r} as {form}: {type(exc).__name__}: {exc}")
    if data is None:
        return _refused("schema", f"{name!r}: empty file, not a config")
    try:
        if _is_engine_args(data):
            return _check_engine_args_file(name, raw, environ, num_experts, quantization)
        settings, violations = settings_from_file_dict(data, environ)
        settings = _with_fact_options(settings, num_experts, quantization)
        judged = check_settings(settings)
        return _result(settings, Judgement(violations + judged, judged.unjudged))
    except Exception as exc:  # a structure no schema rule foresaw is still a schema violation
        return _refused(
            "schema", f"{name!r} is not a config of the documented structure ({type(exc).__name__}: {exc})"
        )


def _with_fact_options(s: EplbSettings, num_experts: int | None, quantization: str | None) -> EplbSettings:
    if num_experts is not None:
        s.num_logical_experts = num_experts
        s.unknown_facts.pop("num_logical_experts", None)
    if quantization is not None and quantization.lower() != "ascend":
        s.quantization = _format_name(quantization)
        s.unknown_facts.pop("quantization", None)
    return s


def _format_name(name: str) -> str:
    """A quant_views format name, or an msModelSlim quant type (``W8A8_DYNAMIC``) mapped to one."""
    return ASCEND_QUANT_TYPES.get(name.upper(), name.lower())


def _check_engine_args_file(
    name: str,
    raw: bytes,
    environ: Mapping[str, str] | None,
    num_experts: int | None,
    quantization: str | None,
) -> CheckResult:
    import tempfile

    import yaml

    data = yaml.safe_load(raw.decode("utf-8"))
    with tempfile.TemporaryDirectory(prefix="ascend-eplb-check-") as tmp:
        # vLLM's --config reads YAML files only; JSON is YAML, so a JSON file goes the same way.
        config = name if name.lower().endswith((".yaml", ".yml")) else os.path.join(tmp, "engine_args.yaml")
        if config != name:
            Path(config).write_bytes(raw)
        # Without model: in the file, the model is unknown (vLLM's --config wants one: an empty one).
        argv = ["serve", "--config", config] if "model" in data else ["serve", "", "--config", config]
        return check_serve_command(
            argv, environ, num_experts=num_experts, quantization=quantization, source=name
        )


def check_serve_command(
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    *,
    num_experts: int | None = None,
    quantization: str | None = None,
    source: str | None = None,
) -> CheckResult:
    """Validate a ``vllm serve`` command line (``argv`` after ``vllm``: ``serve MODEL --enable-eplb ...``).

    The arguments go through vLLM's own parser (:func:`parse_serve_command`, ``--config FILE`` included)
    and :func:`settings_from_engine_args`; ``environ``, ``num_experts`` and ``quantization`` as for
    :func:`check_config_file`; ``source`` names the input in messages.

    Never raises (an interrupt aside): an argument vLLM's parser rejects is an ``engine-args`` violation
    quoting vLLM's message (``vllm serve: error: unrecognized arguments: --bogus``); an unreadable model
    folder a ``model-folder`` violation.
    """
    import contextlib
    import io

    where = source or "the command line"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            engine_args = parse_serve_command(argv)
    except SystemExit as exc:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        said = lines[-1] if lines else f"vLLM's parser exited with status {exc.code}"
        return _refused("engine-args", f"{where}: vLLM's parser rejects the engine arguments: {said}")
    except Exception as exc:
        return _refused(
            "engine-args", f"{where}: vLLM's parser rejects the engine arguments: {type(exc).__name__}: {exc}"
        )
    try:
        settings = settings_from_engine_args(
            engine_args, environ, num_experts=num_experts, quantization=quantization
        )
    except EplbConfigError as exc:
        return CheckResult(False, str(exc), tuple(exc.violations))
    except Exception as exc:
        return _refused("model-folder", f"{where}: {exc}")
    return _result(settings, check_settings(settings))


# -- engine arguments (a ``vllm serve`` command line, a ``vllm serve --config`` file) -----------------


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
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = list(argv)
    if argv[:1] != ["serve"]:
        raise ValueError(f"a vllm serve command line starts with 'serve' (as after 'vllm'), got {argv[:1]}")
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(required=False, dest="subparser"))
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    return EngineArgs.from_cli_args(args)


@dataclass(frozen=True)
class ModelFacts:
    """What a local model folder says: routed experts (None: none stated), the routed experts' format
    from an msModelSlim ``quant_model_description*.json`` (None: no description), the checkpoint's dtype
    as a format (None: not stated), and the description file read."""

    folder: str
    num_logical_experts: int | None
    quantization: str | None
    dtype: str | None
    description: str | None


def _json_object(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{file}: cannot read as JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: must be a JSON object, got {type(data).__name__}")
    return data


def model_folder_facts(folder: str | os.PathLike[str]) -> ModelFacts:
    """Read a local model folder's ``config.json`` and msModelSlim description.

    Routed experts: the first of vLLM's ``CONFIG_FIELD_ALIASES["num_experts"]`` (``num_experts``,
    ``moe_num_experts``, ``n_routed_experts``, ``num_local_experts``) in the text config, as vLLM's
    ``get_num_experts`` reads them (0 or absent: None). Format: the quant type of the description's
    ``.experts.`` weights mapped by :data:`ASCEND_QUANT_TYPES`.

    Raises:
        ValueError: ``config.json`` or the description is missing, not JSON or not an object, or the
            expert count is not an integer >= 0 (naming the file and the key).
        EplbConfigError: the description's routed experts mix quant types.
    """
    from vllm.transformers_utils.config import CONFIG_FIELD_ALIASES

    root = Path(folder)
    config_file = root / "config.json"
    cfg = _json_object(config_file)
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    key = next((k for k in CONFIG_FIELD_ALIASES["num_experts"] if k in cfg), None)
    experts = cfg.get(key, 0) if key else 0
    if isinstance(experts, list):
        experts = experts[0] if experts else 0
    if experts is None:
        experts = 0
    if not is_int(experts) or not 0 <= experts <= INT32_MAX:
        raise ValueError(f"{config_file}: {key}={_short(experts)} must be an integer in [0, {INT32_MAX}]")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    descriptions = sorted(root.glob("quant_model_description*.json"))
    quant = None
    if descriptions:
        quant = _experts_format(_json_object(descriptions[0]))
    return ModelFacts(
        str(root),
        experts or None,
        quant,
        _DTYPE_FORMATS.get(str(dtype)) if dtype else None,
        str(descriptions[0]) if descriptions else None,
    )


def _default_cudagraph_mode(optimization_level: Any = None) -> str:
    """vLLM's ``cudagraph_mode`` when none is set: its optimization level's default (``O2``: graphs)."""
    from vllm.config import VllmConfig
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG

    level = VllmConfig.optimization_level if optimization_level is None else optimization_level
    mode = OPTIMIZATION_LEVEL_TO_CONFIG[level]["compilation_config"]["cudagraph_mode"]
    return mode.name


def settings_from_engine_args(
    engine_args: Any,
    environ: Mapping[str, str] | None = None,
    *,
    num_experts: int | None = None,
    quantization: str | None = None,
) -> EplbSettings:
    """The settings the rules read from vLLM ``EngineArgs`` (parsed, with vLLM's own field defaults).

    No ``VllmConfig`` is built (that needs the model from a hub); each setting is read as vLLM resolves
    it: the parallel and EPLB fields as given; ``use_v2_model_runner`` from ``VLLM_USE_V2_MODEL_RUNNER``
    (unset: True, vLLM's default); ``cudagraph_mode`` NONE with ``enforce_eager``, else the compilation
    config's, else the optimization level's default (graph capture); the draft of an MTP method is MoE,
    as at start-up. Model facts come from ``num_experts``/``quantization`` (a format name), else from
    ``model`` when it is a local folder (:func:`model_folder_facts`); a fact neither gives is recorded in
    ``unknown_facts`` (its rule is then not judged): the expert count; the format of ``quantization
    ascend`` without an msModelSlim description, or of ``dtype auto`` without the checkpoint's dtype;
    whether a non-MTP draft has experts when its ``model`` is not a local folder.

    Raises:
        ValueError: a model folder's ``config.json`` or description cannot be read (naming the file).
        EplbConfigError: the description's routed experts mix quant types.
    """
    from typing import get_args

    from vllm.config.speculative import MTPModelTypes
    from vllm.envs import maybe_convert_bool

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

    experts = num_experts if num_experts is not None else (facts.num_logical_experts if facts else None)
    if experts is None and facts is None:
        unknown["num_logical_experts"] = (
            f"the routed-expert count is unknown ({missing}); pass --num-experts / the model folder"
        )

    fmt: str | None = None
    method = ea.quantization
    if quantization is not None and quantization.lower() != "ascend":
        fmt = _format_name(quantization)
    elif quantization is not None or (method is not None and str(method).lower() == "ascend"):
        fmt = facts.quantization if facts else None
        if fmt is None:
            where = f"none in {model}" if facts else missing
            unknown["quantization"] = (
                "--quantization ascend takes the routed experts' format from msModelSlim's "
                f"quant_model_description*.json ({where}); pass --quantization FORMAT / the model folder"
            )
    elif method is None:
        dtype = str(ea.dtype).removeprefix("torch.")
        fmt = (facts.dtype if facts else None) if dtype == "auto" else _DTYPE_FORMATS.get(dtype, dtype)
        if fmt is None:
            unknown["quantization"] = (
                f"the checkpoint's dtype is unknown (dtype=auto, {missing}); pass --quantization FORMAT / "
                "the model folder"
            )
    else:
        fmt = str(method).lower()

    if ea.enforce_eager:
        mode = "NONE"
    else:
        configured = getattr(ea.compilation_config, "cudagraph_mode", None)
        if configured is None:
            mode = _default_cudagraph_mode(ea.optimization_level)
        else:
            mode = str(getattr(configured, "name", configured)).upper()

    spec = ea.speculative_config
    spec_method = None
    draft_is_moe = False
    if spec is not None:
        spec = dict(spec)
        spec_method = spec.get("method")
        if spec_method in get_args(MTPModelTypes):
            spec_method = "mtp"  # vLLM's SpeculativeConfig renames the deprecated MTP methods
        draft = spec.get("model")
        if "mtp" in str(spec_method or ""):
            draft_is_moe = True
        elif draft and Path(str(draft)).is_dir():
            draft_is_moe = (model_folder_facts(str(draft)).num_logical_experts or 0) > 0
        else:
            unknown["speculative_draft_is_moe"] = (
                f"whether the draft of speculative method={spec_method!r} has routed experts is unknown "
                f"(draft model {draft!r} is not a local folder); pass the draft's local folder as "
                "speculative-config model"
            )
        spec_method = spec_method or "unset"

    v2 = maybe_convert_bool(env.get("VLLM_USE_V2_MODEL_RUNNER"))
    additional = _as_dict(ea.additional_config)
    ec = ea.eplb_config
    return EplbSettings(
        enable_eplb=bool(ea.enable_eplb),
        use_v2_model_runner=True if v2 is None else bool(v2),
        **_parallel_and_eplb_fields(ea, ec, additional, env),
        num_logical_experts=experts,
        quantization=fmt,
        cudagraph_mode=mode,
        speculative_method=spec_method,
        speculative_draft_is_moe=draft_is_moe,
        unknown_facts=unknown,
    )
