"""The support matrix of Model Runner V2 EPLB on Ascend: one small function per rule id.

:data:`RULES` maps each rule id to its judge, in report order; :func:`check_settings` runs them on one
:class:`~ascend_eplb.integration.settings.EplbSettings`. Start-up validation
(:mod:`ascend_eplb.integration.validation`) and ``ascend-eplb check`` both call it, so a rule is judged
the same everywhere and found by its id. The rules of the settings' own keys and values are
:mod:`~ascend_eplb.integration.settings_rules`'; here, those of the model, the placement file, the
quantization, compilation, graphs, the speculative draft and the row layout. Settings live in
:mod:`~ascend_eplb.integration.settings`, a model config's expert facts in
:mod:`~ascend_eplb.integration.model_facts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ascend_eplb.control.layout import default_moe_rows, unplaceable_layout
from ascend_eplb.control.split_config import describe_split, replica_split_error
from ascend_eplb.integration.model_facts import (
    MoeFacts,
    architectures_error,
    experts_divisibility_error,
    read_model_class,
    shown,
)
from ascend_eplb.integration.model_names import is_draft
from ascend_eplb.integration.placement_file import (
    PlacementFileError,
    assign_placements,
    describe_mismatch,
    read_placements,
)
from ascend_eplb.integration.settings import (
    COMPILATION_MODES,
    CUDAGRAPH_MODES,
    EplbSettings,
)
from ascend_eplb.integration.settings_rules import SETTINGS_RULES, redundant_ok

__all__ = [
    "EPLB_OFF_RULES",
    "MOE_FACT_RULES",
    "RULES",
    "Judgement",
    "Rule",
    "Violation",
    "check_settings",
    "moe_fact_errors",
    "split_line",
]


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
    (``EplbSettings.unknown_facts``). At start-up every fact of vLLM's config is known; what may still be
    unjudged there is what this project cannot read without the model (an architecture whose MoE layers
    :data:`LAYER_SCHEMES` does not count, a model class whose module does not import), which start-up
    logs as a warning."""

    def __init__(self, violations=(), unjudged=()):
        super().__init__(violations)
        self.unjudged: list[Violation] = list(unjudged)


#: What a rule function returns: None (the rule holds or does not apply), the violated rule's message
#: (naming the value and the fix), or :meth:`Violation.unjudged` (the rule lacks a fact).
Rule = Callable[[EplbSettings], "str | Violation | None"]

#: Rule id -> the function that judges it, in report order (:func:`check_settings` runs them in this
#: order): the settings' own (:data:`~ascend_eplb.integration.settings_rules.SETTINGS_RULES`), then
#: the model's and the runtime's, filled by :func:`_rule` below, one function per id.
RULES: dict[str, Rule] = dict(SETTINGS_RULES)
#: The rules that judge a configuration with EPLB off (the V1 path, if any, is not ours to judge; only a
#: V2-only key without EPLB is wrong); every other rule of :data:`RULES` judges only with EPLB on.
EPLB_OFF_RULES = ("phase-without-eplb", "placement-without-eplb", "policy-without-eplb", "split-without-eplb")
#: The rules that judge a model config's MoE facts (:class:`MoeFacts`) alone, in :data:`RULES` order:
#: :meth:`MoeFacts.errors` runs them (``ascend-eplb simulate``'s and the cost estimate's refusal of a model
#: folder), so they are the very functions start-up and ``check`` run.
MOE_FACT_RULES = ("routed-experts", "top-k", "expert-groups", "moe-layers")


def _rule(rule_id: str) -> Callable[[Rule], Rule]:
    """Register the decorated function as the judge of ``rule_id`` (at the end of :data:`RULES`)."""

    def register(fn: Rule) -> Rule:
        if rule_id in RULES:
            raise ValueError(f"rule id {rule_id!r} is registered twice")
        RULES[rule_id] = fn
        return fn

    return register


def split_line(s: EplbSettings) -> str | None:
    """The batch split in force on this configuration's rows and its cost (``ascend-eplb check``'s and the
    serving log's line), or None when ``replica_split`` is not a valid value (rule ``replica-split``)."""
    if replica_split_error(s.replica_split) is not None:
        return None
    return describe_split(s.replica_split, default_moe_rows(s))


@_rule("routed-experts")
def _routed_experts(s: EplbSettings) -> str | None:
    return s.moe_facts.experts_error() if s.moe_facts is not None else None


@_rule("top-k")
def _top_k(s: EplbSettings) -> str | Violation | None:
    if "top_k" in s.unknown_facts:
        return Violation.unjudged("top-k", s.unknown_facts["top_k"])
    return s.moe_facts.top_k_error() if s.moe_facts is not None else None


@_rule("expert-groups")
def _expert_groups(s: EplbSettings) -> str | None:
    return s.moe_facts.groups_error() if s.moe_facts is not None else None


@_rule("moe-layers")
def _moe_layers(s: EplbSettings) -> str | Violation | None:
    if s.moe_facts is None:
        return None
    if "layers" in s.moe_facts.unstated():
        return Violation.unjudged(
            "moe-layers",
            f"{s.moe_facts.source} states no num_hidden_layers, so vLLM reads its config class's default; "
            "state num_hidden_layers in config.json",
        )
    if (error := s.moe_facts.layers_error()) is not None:
        return error
    if (why := s.moe_facts.layers_not_counted()) is not None:
        return Violation.unjudged("moe-layers", why)
    return None


@_rule("moe-model-class")
def _moe_model_class(s: EplbSettings) -> str | Violation | None:
    if s.model_architectures is None:
        return None
    if (reason := architectures_error(s.model_architectures)) is not None:
        return reason
    try:
        found = read_model_class(s.model_architectures)
    except Exception as e:  # the class's module does not import here (a multimodal one's torchvision)
        return Violation.unjudged(
            "moe-model-class",
            f"vLLM's model class for architectures {list(s.model_architectures)} does not import here "
            f"({type(e).__name__}: {e}), so whether it has a MixtureOfExperts part is decided when the "
            "model registers",
        )
    if found is None:
        return Violation.unjudged(
            "moe-model-class",
            f"architectures {list(s.model_architectures)} are not in vLLM's model registry, so whether the "
            "model class vLLM builds has a MixtureOfExperts part is decided when the model registers",
        )
    if found.has_moe_part is not False:
        return None
    return (
        f"model class {found.name} (architecture {found.architecture}) has no MixtureOfExperts part "
        "(vLLM's MixtureOfExperts interface: expert_weights, set_eplb_state, the MoE layers): upstream's "
        "EPLBController.maybe_register_model would not register it and the model would be served without "
        "EPLB; fix: serve it without --enable-eplb, or with a model class that implements MixtureOfExperts"
    )


@_rule("experts-divisible")
def _experts_divisible(s: EplbSettings) -> str | Violation | None:
    if not (redundant_ok(s) and s.enable_expert_parallel):
        return None
    if "num_logical_experts" in s.unknown_facts:
        return Violation.unjudged("experts-divisible", s.unknown_facts["num_logical_experts"])
    if s.num_logical_experts is None:
        return None
    reason = experts_divisibility_error(s.num_logical_experts, s.num_redundant_experts, s.num_ranks)
    if reason is None:
        return None
    return (
        f"{reason} (EP size {s.num_ranks} = TP {s.tensor_parallel_size} x PCP "
        f"{s.prefill_context_parallel_size} x DP {s.data_parallel_size})"
    )


@_rule("initial-placement")
def _initial_placement(s: EplbSettings) -> str | Violation | None:
    """The placement file (``placement_file.read_placements``): readable, valid, a placement of each model
    the server balances and, in a placement file, of no other (``served_models``, when known: one unnamed
    placement serves the target alone; an events file's records of another model are not read), each
    made for the model's logical experts, physical slots (E + ``num_redundant_experts``), EP size and,
    when known, the target's MoE layers; the first problem found. Start-up does not know L before a
    model is built: each model's layers are compared when it registers
    (``startup_placement.attach_startup_install``, same rule id)."""
    path = s.initial_placement
    if path is None:
        return None
    key = "eplb_config.initial_placement"
    if not isinstance(path, str) or not path.strip():
        return (
            f"{key}={path!r} must be a path (a non-empty string) to a placement file or an events file; "
            "fix: name the file ascend-eplb plan --export-expert-map wrote, or remove initial_placement"
        )
    try:
        placements = read_placements(path, s.served_models)
    except PlacementFileError as e:
        return (
            f"{key}={path}: {'; '.join(e.problems)}; fix: name a placement file of ascend-eplb plan "
            "--export-expert-map (or an events file with a committed placement)"
        )
    served = s.served_models
    if served is not None:
        _, problems = assign_placements(placements, served)
        if problems:
            return (
                f"{key}={path}: {'; '.join(problems)} (the server balances {list(served)}); fix: export a "
                "placement of every model the server balances (ascend-eplb plan --export-expert-map on an "
                "events file that recorded them) or remove initial_placement"
            )
    known = s.num_logical_experts is not None and redundant_ok(s)
    for placement in placements:
        # L is the target's: a draft's layers are compared when it registers.
        differ = placement.mismatches(
            num_moe_layers=None if is_draft(placement.model) else s.num_moe_layers,
            num_logical_experts=s.num_logical_experts if known else None,
            num_physical_experts=s.num_logical_experts + s.num_redundant_experts if known else None,
            num_ranks=s.num_ranks,
        )
        if differ:
            return describe_mismatch(placement, differ)
    for fact in ("num_logical_experts", "num_moe_layers"):
        if fact in s.unknown_facts:
            return Violation.unjudged("initial-placement", s.unknown_facts[fact])
    return None


@_rule("quantization")
def _quantization(s: EplbSettings) -> str | Violation | None:
    if "quantization" in s.unknown_facts:
        return Violation.unjudged("quantization", s.unknown_facts["quantization"])
    name = s.quantization
    if name is None:
        return None
    if name == "float32":
        # Unquantized float32 experts: what exact comparisons on a CPU host need (the test suite, the
        # simulator on real models); no Ascend kernel serves them.
        # local: vLLM only when judged: check runs without vLLM
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return None
        return (
            "float32 expert weights are accepted on a CPU host only (exact comparisons); fix: serve "
            "--dtype bfloat16 or float16"
        )
    # local: quant_views imports torch, only when a format is judged
    from ascend_eplb.quant_views import UnsupportedFormatError, get_format

    try:
        fmt = get_format(name)
    except UnsupportedFormatError as exc:
        return f"quantization format {name!r}: {exc}; fix: use a supported format"
    if not fmt.supports_eplb:
        return (
            f"quantization format {name!r} does not support EPLB (supports_eplb=False); fix: use a "
            "supported format"
        )
    return None


@_rule("compiled-forward")
def _compiled_forward(s: EplbSettings) -> str | Violation | None:
    if "compilation_mode" in s.unknown_facts:
        return Violation.unjudged("compiled-forward", s.unknown_facts["compilation_mode"])
    mode = s.compilation_mode
    if not isinstance(mode, str) or mode.upper() not in COMPILATION_MODES:
        return f"compilation mode={shown(mode)} is not one of vLLM's modes {list(COMPILATION_MODES)}"
    mode = mode.upper()
    if mode == "STOCK_TORCH_COMPILE":
        return (
            "compilation mode STOCK_TORCH_COMPILE (the model runner's torch.compile of the whole model, "
            "guards kept) is not validated with Ascend EPLB; fix: use vLLM's default VLLM_COMPILE or "
            "DYNAMO_TRACE_ONCE (compilation_config.mode), or run eager (--enforce-eager)"
        )
    if s.inductor_freezing and mode != "NONE":
        return (
            "inductor freezing (compilation_config.inductor_compile_config freezing, or "
            "TORCHINDUCTOR_FREEZING=1) folds the expert weights into the compiled code as constants, so "
            "the weights EPLB moves in place would never be read again; fix: turn freezing off"
        )
    unknown = _unknown_inductor_options(s.inductor_compile_config) if mode != "NONE" else []
    if unknown:
        return (
            f"compilation_config.inductor_compile_config names {', '.join(map(repr, unknown))}, which "
            "torch's inductor has no option of (torch._inductor.config): every rank's first compile would "
            "fail; fix: correct or remove them"
        )
    return None


def _unknown_inductor_options(options: Any) -> list[str]:
    """The keys of ``options`` that torch's inductor refuses, judged by its own ``config.patch`` (what
    vLLM's compile hands them to); torch is imported only when there are options to judge."""
    if not isinstance(options, dict) or not options:
        return []
    # local: torch only when there are options to judge
    import torch._inductor.config as inductor_config

    unknown = []
    for key, value in options.items():
        try:
            with inductor_config.patch({key: value}):
                pass
        except (AttributeError, TypeError, AssertionError):
            unknown.append(str(key))
    return unknown


@_rule("graph-capture")
def _graph_capture(s: EplbSettings) -> str | Violation | None:
    if "cudagraph_mode" in s.unknown_facts:
        return Violation.unjudged("graph-capture", s.unknown_facts["cudagraph_mode"])
    if not isinstance(s.cudagraph_mode, str):
        return f"cudagraph_mode={s.cudagraph_mode!r} must be a mode name (a str, e.g. 'NONE')"
    if s.cudagraph_mode.upper() not in CUDAGRAPH_MODES:
        return (
            f"cudagraph_mode={s.cudagraph_mode} is not one of vLLM's modes {list(CUDAGRAPH_MODES)}; fix: "
            "name one of them"
        )
    return None


def upstream_registers_draft(method: Any, model_type: Any, has_moe_part: bool | None) -> bool:
    """Whether vLLM 0.33.0's MRv2 controller registers a draft with EPLB beside the target: its own
    ``draft_model_supports_eplb`` (``vllm/v1/worker/gpu/eplb_utils.py``) asked about a draft of speculative
    ``method`` whose config's HF ``model_type`` is ``model_type`` and whose class has a ``MixtureOfExperts``
    part (``has_moe_part``; None, a multimodal class whose language model decides, counts as having one).
    Upstream asks it with the built draft; before anything is built the class stands in for the instance
    (the fields it reads: the method, the draft config's ``hf_config.model_type`` for DSpark)."""
    # local: vLLM's MRv2 worker module only when a draft is judged (see read_model_class)
    from vllm.v1.worker.gpu.eplb_utils import draft_model_supports_eplb

    draft_config = SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type))
    speculative_config = SimpleNamespace(method=method, draft_model_config=draft_config)
    return draft_model_supports_eplb(speculative_config, None if has_moe_part is False else object())


@_rule("speculative-moe-draft")
def _speculative_moe_draft(s: EplbSettings) -> str | Violation | None:
    """An MoE draft is served with EPLB when upstream registers it beside the target (its class has a
    ``MixtureOfExperts`` part and ``draft_model_supports_eplb`` says so: DeepSeek-V3/R1's ``DeepSeekMTP``)
    with the target's expert configuration; any other MoE draft is refused (its experts would run beside
    a balanced target without a placement of their own)."""
    rule = "speculative-moe-draft"
    if s.speculative_method is None:
        return None
    if "speculative_draft_is_moe" in s.unknown_facts:
        return Violation.unjudged(rule, s.unknown_facts["speculative_draft_is_moe"])
    if not s.speculative_draft_is_moe:
        return None
    if "speculative_draft_architectures" in s.unknown_facts:
        return Violation.unjudged(rule, s.unknown_facts["speculative_draft_architectures"])
    archs = s.speculative_draft_architectures
    fix = (
        "fix: disable speculative decoding, use a dense draft, or a draft whose class upstream balances "
        '(vLLM\'s DeepSeekMTP: --speculative-config \'{"method": "mtp"}\' on DeepSeek-V3/R1)'
    )
    if archs is None or (reason := architectures_error(archs)) is not None:
        return Violation.unjudged(
            rule,
            f"the MoE draft of speculative method={s.speculative_method!r} names no model class "
            f"({'no architectures' if archs is None else reason}), so whether upstream balances it is "
            "decided when the draft registers",
        )
    try:
        found = read_model_class(archs)
    except Exception as e:  # the class's module does not import here
        return Violation.unjudged(
            rule,
            f"vLLM's model class for the draft's architectures {list(archs)} does not import here "
            f"({type(e).__name__}: {e}), so whether upstream balances it is decided when the draft registers",
        )
    if found is None:
        return Violation.unjudged(
            rule,
            f"the draft's architectures {list(archs)} are not in vLLM's model registry, so whether upstream "
            "balances it is decided when the draft registers",
        )
    if not upstream_registers_draft(s.speculative_method, s.speculative_draft_model_type, found.has_moe_part):
        why = (
            "has no MixtureOfExperts part"
            if found.has_moe_part is False
            else f"is a {s.speculative_method} draft of model_type {s.speculative_draft_model_type!r}, which "
            "upstream's draft_model_supports_eplb does not register"
        )
        return (
            f"the MoE draft of speculative method={s.speculative_method!r}, vLLM class "
            f"{found.name} ({found.architecture}), {why}: upstream does not balance it, so its routed "
            f"experts would run beside a balanced target without a placement of their own; {fix}"
        )
    draft, target = s.speculative_draft_moe_facts, s.moe_facts
    if draft is not None and target is not None:

        def groups(facts: MoeFacts) -> Any:
            # n_group as the class reads it: stated, or (a whole hf_config without it) one group; a
            # config.json that omits it leaves its config class's default, unknown here.
            return facts.stated.get("n_group", 1 if facts.complete else None)

        mine, theirs = (
            (draft.num_logical_experts, groups(draft)),
            (target.num_logical_experts, groups(target)),
        )
        known = [i for i in (0, 1) if mine[i] is not None and theirs[i] is not None]
        if any(mine[i] != theirs[i] for i in known):

            def said(facts: tuple[Any, Any]) -> str:
                experts = "an unknown number of" if facts[0] is None else str(facts[0])
                return f"{experts} routed experts" + ("" if facts[1] is None else f" in {facts[1]} group(s)")

            return (
                f"the MoE draft ({found.name}) has {said(mine)}, the target {said(theirs)}: "
                "upstream's EplbState balances every registered model with one expert configuration "
                f"(EplbState.assert_confs_equal raises); {fix}"
            )
    return None


@_rule("micro-batching")
def _micro_batching(s: EplbSettings) -> str | None:
    if not s.enable_dbo:
        return None
    return (
        "enable_dbo=True (dual-batch overlap) is not validated with Ascend EPLB yet (per-micro-"
        "batch unpadded token counts have no test); fix: disable --enable-dbo"
    )


@_rule("row-layout")
def _row_layout(s: EplbSettings) -> str | None:
    layout_reason = unplaceable_layout(s)
    if layout_reason is None:
        return None
    return f"{layout_reason}; fix: set --prefill-context-parallel-size 1"


def check_settings(s: EplbSettings) -> Judgement:
    """Apply the rules of :data:`RULES` to ``s``, in order, and return the violations (empty: the
    configuration is supported).

    The one rules function of start-up validation and ``ascend-eplb check``. With EPLB off only
    :data:`EPLB_OFF_RULES` judge. A rule whose fact is in ``s.unknown_facts`` is not judged: it is
    listed in the result's ``.unjudged``, never passed silently.
    """
    out = Judgement()
    for rule_id, judge in RULES.items():
        if (rule_id in EPLB_OFF_RULES) == s.enable_eplb:
            continue
        finding = judge(s)
        if finding is None:
            continue
        if isinstance(finding, Violation):
            out.unjudged.append(finding)
        else:
            out.append(Violation(rule_id, finding))
    return out


def moe_fact_errors(facts: MoeFacts) -> list[str]:
    """The messages of the rules of :data:`MOE_FACT_RULES` that ``facts`` alone break, in order: the very
    rule functions start-up and ``check`` run (``ascend-eplb simulate`` and the cost estimate refuse a
    model folder with them before anything starts)."""
    alone = EplbSettings(enable_eplb=True, moe_facts=facts)
    found = (RULES[rule_id](alone) for rule_id in MOE_FACT_RULES)
    return [m for m in found if isinstance(m, str)]
