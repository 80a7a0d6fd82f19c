"""The support matrix of Model Runner V2 EPLB on Ascend: one small function per rule id.

:data:`RULES` maps each rule id to the function that judges it, in the order the rules are reported;
:func:`check_settings` runs them on one :class:`EplbSettings`. It is the one rules function: start-up
validation (:func:`ascend_eplb.integration.validation.validate_eplb_config`, on the settings read from a
``VllmConfig``) and ``ascend-eplb check`` (the tools' readers of a config file, a ``vllm serve`` command
line and a model folder) both call it, so a rule is judged the same everywhere and is found by its id.

Standard library only at import (the phases from ``ascend_eplb.control.phase``, the placement policy's
and gain gate's settings from ``ascend_eplb.control.policy_config``, the int check from
``ascend_eplb.control.values``, the truthy parsing of environment switches from
``ascend_eplb.integration.switches``); the ``quantization`` rule imports ``ascend_eplb.quant_views``
(pure torch) and the ``row-layout`` rule ``ascend_eplb.control.layout`` only when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ascend_eplb.control.phase import LOAD_COLLECTION_PHASES as _CONTROL_PHASES
from ascend_eplb.control.policy_config import (
    PolicySettings,
    load_estimate_error,
    min_balancedness_gain_error,
    policy_error,
    target_balancedness_error,
)
from ascend_eplb.control.values import is_int
from ascend_eplb.integration.switches import is_true

__all__ = [
    "ASCEND_V2_KEYS",
    "COMPILATION_MODES",
    "CUDAGRAPH_MODES",
    "EPLB_OFF_RULES",
    "EXPERT_COUNT_KEYS",
    "GROUP_KEYS",
    "INT32_MAX",
    "LAYER_KEYS",
    "LAYER_SCHEMES",
    "LOAD_COLLECTION_PHASES",
    "MOE_FACT_RULES",
    "POLICY_KEYS",
    "RULES",
    "SUPPORTED_COMMUNICATORS",
    "TOP_K_KEYS",
    "V1_EPLB_ENV_SWITCHES",
    "V1_EPLB_KEYS",
    "EplbSettings",
    "Judgement",
    "ModelClass",
    "MoeFacts",
    "Rule",
    "Violation",
    "architectures_error",
    "check_settings",
    "experts_divisibility_error",
    "read_model_class",
    "read_moe_facts",
    "shown",
    "text_config",
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
#: The Ascend keys of the placement policy, the gain gate and the load they work on
#: (``ascend_eplb.control.policy_config``).
POLICY_KEYS = ("policy", "min_balancedness_gain", "target_balancedness", "load_estimate")
#: The Ascend-specific keys of the Model Runner V2 ``eplb_config``: ``load_collection_phase``, and
#: ``initial_placement`` (a placement file to start serving on, ``ascend_eplb.integration.placement_file``).
ASCEND_V2_KEYS = ("load_collection_phase", "initial_placement", *POLICY_KEYS)
#: Values of ``load_collection_phase``: control's own constant (``ascend_eplb.control.phase``, no vLLM).
LOAD_COLLECTION_PHASES = _CONTROL_PHASES
#: Communicators accepted by this integration (``torch_gloo`` -> ``AscendGlooEplbCommunicator``).
SUPPORTED_COMMUNICATORS = ("torch_gloo",)
#: vLLM 0.33.0's ``CompilationMode`` names, by value (``vllm/config/compilation.py``).
COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
#: vLLM 0.33.0's ``CUDAGraphMode`` names (``vllm/config/compilation.py``); vLLM Ascend's ACL graph modes
#: take the same names.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
#: Largest integer a setting may hold (``2**31 - 1``): the sizes and counts feed int32 device tables
#: (the dataplane's replica lookup) and upstream's int32 load counters. The one statement of the
#: limit, also read by ``ascend-eplb simulate``'s integer rules.
INT32_MAX = 2**31 - 1


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


@dataclass
class EplbSettings:
    """The settings the rules read, extracted from a ``VllmConfig`` or a config file.

    ``num_ranks`` is the EP size: TP x PCP x DP (the EP group of vLLM's ``ParallelConfig``).
    ``unknown_facts`` maps a fact's field (``num_logical_experts``, ``top_k``, ``quantization``,
    ``speculative_draft_is_moe``) to why it is unknown and how to give it; the rule that needs it is
    then reported as unjudged (:meth:`Violation.unjudged`) instead of passing (``ascend-eplb check``
    without the model folder). Start-up validation knows every fact and leaves it empty.
    ``moe_facts``: the model config's routed-expert facts as written (:func:`read_moe_facts`), judged by
    the ``routed-experts``, ``top-k`` and ``expert-groups`` rules; None where no model config is read (a
    config file of this package's schema, a ``VllmConfig`` without a model), and then those rules pass.
    ``num_logical_experts`` is E once it meets them (None otherwise).

    The EPLB fields' defaults (``window_size`` to ``communicator``, ``log_balancedness``) are upstream
    vLLM 0.33.0 ``EPLBConfig``'s (tested equal); a config file that omits one reads them from here.

    ``model_architectures``: the model config's ``architectures`` (start-up: vLLM's
    ``model_config.architectures``; ``ascend-eplb check``: a model folder's ``config.json``), whose vLLM
    model class the ``moe-model-class`` rule judges (:func:`read_model_class`): a tuple of class names, or
    the value as written when it is not a list of them (a string: vLLM's ``ModelConfig`` refuses it, and so
    does the rule); None where no model config is read or it names none, and then that rule passes.

    ``speculative_method``, ``speculative_draft_is_moe``: the speculative config's method (None: no
    speculative decoding) and whether its draft has routed experts; ``speculative_draft_architectures``
    and ``speculative_draft_model_type``: the draft's ``architectures`` and HF ``model_type`` as vLLM
    derives them (an MTP method: ``SpeculativeConfig.hf_config_override`` of the target's config, e.g.
    DeepSeek-V3's ``DeepSeekMTPModel``), whose vLLM class the ``speculative-moe-draft`` rule judges;
    ``speculative_draft_moe_facts``: the draft config's routed-expert facts (None: not read), which must
    equal the target's (upstream balances both with one expert configuration).

    ``served_models``: the names upstream's ``EplbModelState`` gives the models EPLB balances (the
    target's ``model_config.model``, and ``eplb_draft_model_name`` of an MoE draft), which an
    ``initial_placement`` file must name each of; None where the model is not known (a config file).

    ``num_moe_layers``: L, when known before the model is built (a model folder's ``config.json`` read by
    ``ascend-eplb check``: :attr:`MoeFacts.num_moe_layers`); None at start-up, where the
    ``initial-placement`` rule compares the layers when the model registers
    (``startup_placement.attach_startup_install``).
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
    num_moe_layers: int | None = None
    quantization: str | None = "bf16"
    cudagraph_mode: str = "NONE"
    compilation_mode: str = "NONE"
    inductor_freezing: bool = False
    speculative_method: str | None = None
    speculative_draft_is_moe: bool = False
    speculative_draft_architectures: tuple[str, ...] | Any = None
    speculative_draft_model_type: str | None = None
    speculative_draft_moe_facts: MoeFacts | None = None
    served_models: tuple[str, ...] | None = None
    unknown_facts: dict[str, str] = field(default_factory=dict)
    moe_facts: MoeFacts | None = None
    model_architectures: tuple[str, ...] | Any = None

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size * self.prefill_context_parallel_size * self.data_parallel_size

    @property
    def load_collection_phase(self) -> Any:
        """``additional_config.eplb_config.load_collection_phase`` as given (not validated), ``"all"``
        when absent (every batch records load)."""
        return self.ascend_eplb_config.get("load_collection_phase", "all")

    @property
    def placement_policy(self) -> Any:
        """``additional_config.eplb_config.policy`` as given (not validated), ``"default"`` when absent
        (upstream's ``DefaultEplbPolicy``). Not upstream's ``eplb_config.policy`` (:attr:`policy`), which
        stays ``"default"``."""
        return self.ascend_eplb_config.get("policy", "default")

    @property
    def min_balancedness_gain(self) -> Any:
        """``additional_config.eplb_config.min_balancedness_gain`` as given, ``0.0`` (off) when absent."""
        return self.ascend_eplb_config.get("min_balancedness_gain", 0.0)

    @property
    def target_balancedness(self) -> Any:
        """``additional_config.eplb_config.target_balancedness`` as given, None (off) when absent."""
        return self.ascend_eplb_config.get("target_balancedness")

    @property
    def load_estimate(self) -> Any:
        """``additional_config.eplb_config.load_estimate`` as given, ``"window"`` (upstream's: the closed
        window) when absent."""
        return self.ascend_eplb_config.get("load_estimate", "window")

    def policy_settings(self) -> PolicySettings:
        """Control's :class:`~ascend_eplb.control.policy_config.PolicySettings` of the four keys.

        Raises:
            ValueError: a key breaks its rule (``placement-policy``, ``min-balancedness-gain``,
                ``target-balancedness``, ``load-estimate``; start-up validation has refused that before).
        """
        return PolicySettings(
            self.placement_policy, self.min_balancedness_gain, self.target_balancedness, self.load_estimate
        )

    @property
    def initial_placement(self) -> Any:
        """``additional_config.eplb_config.initial_placement`` as given (not validated), None when absent
        (serving starts on upstream's initial placement)."""
        return self.ascend_eplb_config.get("initial_placement")


#: vLLM 0.33.0's names of a model config's routed-expert count, in the order its ``get_num_experts``
#: reads them (``CONFIG_FIELD_ALIASES["num_experts"]``, vllm/transformers_utils/config.py; tested equal).
EXPERT_COUNT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")
#: vLLM 0.33.0's names of the experts each token selects (``CONFIG_FIELD_ALIASES["num_experts_per_token"]``,
#: read by ``get_num_experts_per_token``; tested equal).
TOP_K_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "top_k_experts",
    "moe_topk",
    "moe_top_k",
    "top_k",
)
#: DeepSeek's grouped top-k (vLLM's ``DeepseekV2MoE``: ``num_expert_group=config.n_group``,
#: ``topk_group=config.topk_group``): the routed experts split into ``n_group`` equal groups, tokens pick
#: ``topk_group`` groups, then their top-k inside those.
GROUP_KEYS = ("n_group", "topk_group")
#: The fields that say which decoder layers have routed experts, as vLLM 0.33.0's model classes read them
#: (which of them a class reads: :data:`LAYER_SCHEMES`).
LAYER_KEYS = (
    "num_hidden_layers",
    "first_k_dense_replace",
    "moe_layer_freq",
    "mlp_only_layers",
    "decoder_sparse_step",
)
#: How the model class vLLM 0.33.0 builds for an architecture (the first of the config's
#: ``architectures``) chooses its MoE decoder layers among the ``num_hidden_layers``:
#:
#: * ``"first_k_dense_replace"``: the first ``first_k_dense_replace`` layers are dense, the rest MoE, and
#:   the class counts ``num_moe_layers = num_hidden_layers - first_k_dense_replace``
#:   (``DeepseekV2DecoderLayer``, ``Glm4MoeDecoderLayer``); DeepSeek's also skips a layer whose index
#:   ``moe_layer_freq`` does not divide, while still counting it (so EPLB needs ``moe_layer_freq`` 1);
#: * ``"decoder_sparse_step"``: layer ``i`` is MoE unless listed in ``mlp_only_layers``, when
#:   ``(i + 1) % decoder_sparse_step == 0`` (``Qwen2MoeDecoderLayer``, ``Qwen3MoeDecoderLayer``);
#: * ``"every_layer"``: every layer (``MixtralDecoderLayer``).
#:
#: Another architecture's layers are not counted here (the ``moe-layers`` rule is then not judged).
LAYER_SCHEMES = {
    "DeepseekV2ForCausalLM": "first_k_dense_replace",
    "DeepseekV3ForCausalLM": "first_k_dense_replace",
    "Glm4MoeForCausalLM": "first_k_dense_replace",
    "Qwen2MoeForCausalLM": "decoder_sparse_step",
    "Qwen3MoeForCausalLM": "decoder_sparse_step",
    "MixtralForCausalLM": "every_layer",
}


def shown(value: Any) -> str:
    """``repr(value)`` for a message, shortened when very long (a 400-digit integer)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are one value (``True == 1`` and ``"8" != 8`` kept apart by their types)."""
    return type(a) is type(b) and a == b


def _count_error(key: str, value: Any, rule: str) -> str | None:
    if is_int(value) and 1 <= value <= INT32_MAX:
        return None
    return f"{key}={shown(value)} must be an integer in [1, {INT32_MAX}] ({rule})"


@dataclass(frozen=True)
class MoeFacts:
    """What a model config states about its routed experts, as vLLM reads it, and the rules it must meet.

    The one reading of these facts (:func:`read_moe_facts`): of a model folder's ``config.json`` by
    ``ascend-eplb check`` and ``ascend-eplb simulate`` before anything starts, of vLLM's
    ``model_config.hf_text_config`` by start-up validation. The rules of :data:`MOE_FACT_RULES`,
    ``routed-experts``, ``top-k``, ``expert-groups`` and ``moe-layers``, judge them (:meth:`experts_error`,
    :meth:`top_k_error`, :meth:`groups_error`, :meth:`layers_error`), so a bad value is refused with the
    field, the value and the rule before a rank starts, never met as a ``TypeError`` or an out-of-range
    index inside the model, nor as a model served without EPLB. :attr:`num_moe_layers` is the one count of
    a config's MoE layers (L), which the tools read too.

    Attributes:
        source: what was read (``/path/config.json``, ``the hf_config of MODEL``), for messages.
        stated: every field of :data:`EXPERT_COUNT_KEYS`, :data:`TOP_K_KEYS`, :data:`GROUP_KEYS` and
            :data:`LAYER_KEYS` the config has, by name, with its value as written (any type);
            ``block_configs_experts``: the largest ``n_routed_experts`` of its MoE ``block_configs``
            (vLLM's fallback for heterogeneous models; None without any). ``complete``: every field vLLM
            reads is readable (an ``hf_config``: a field the file omits has its config class's default);
            False for a ``config.json`` mapping, where an omitted field takes a default this reading does
            not know, so the rule that needs it is not judged (:meth:`unstated`). ``architectures``: the
            config's ``architectures`` as written (the top level's, as vLLM reads it), whose first entry
            selects the :data:`LAYER_SCHEMES` entry the MoE layers are counted by.
    """

    source: str
    stated: dict[str, Any]
    block_configs_experts: Any = None
    complete: bool = True
    architectures: Any = None

    @property
    def experts_key(self) -> str | None:
        """The field vLLM reads E from (the first of :data:`EXPERT_COUNT_KEYS` stated), or None."""
        return next((k for k in EXPERT_COUNT_KEYS if k in self.stated), None)

    @property
    def experts(self) -> Any:
        """E as vLLM's ``get_num_experts`` reads it (a list's first entry; 0 when absent; the MoE blocks'
        count when falsy and they state one), as written: not yet judged."""
        value = self.stated.get(self.experts_key) if self.experts_key else 0
        if isinstance(value, list):
            value = value[0] if value else 0
        if not value and self.block_configs_experts:
            value = self.block_configs_experts
        return value

    @property
    def num_logical_experts(self) -> int | None:
        """E when it meets the ``routed-experts`` rule, else None."""
        e = self.experts
        return e if is_int(e) and 1 <= e <= INT32_MAX and self.experts_error() is None else None

    @property
    def top_k_key(self) -> str | None:
        """The field vLLM reads K from (the first of :data:`TOP_K_KEYS` stated), or None."""
        return next((k for k in TOP_K_KEYS if k in self.stated), None)

    @property
    def top_k(self) -> Any:
        """K as vLLM's ``get_num_experts_per_token`` reads it (a list's largest entry; 0 when absent), as
        written: not yet judged."""
        value = self.stated.get(self.top_k_key) if self.top_k_key else 0
        if isinstance(value, list):
            value = max(value, default=0) if all(is_int(v) for v in value) else value
        return value

    def experts_error(self) -> str | None:
        """Rule ``routed-experts``: E is an integer in ``[1, INT32_MAX]`` (EPLB balances the routed experts
        of a MoE model) and every other name of it the config states says the same."""
        rule = "the routed experts of each MoE layer; EPLB balances them"
        if "experts" in self.unstated():
            return None
        if self.experts_key is None and not self.block_configs_experts:
            return (
                f"{self.source} states no routed-expert count (none of {', '.join(EXPERT_COUNT_KEYS)}, the "
                "names vLLM reads): EPLB balances the routed experts of a MoE model; fix: serve a MoE model "
                "or leave EPLB off"
            )
        problems = []
        key = self.experts_key or "block_configs n_routed_experts"
        reason = _count_error(key, self.experts, rule)
        if reason is not None:
            problems.append(reason)
        for other in EXPERT_COUNT_KEYS:
            value = self.stated.get(other)
            # An alias of the same field (transformers' attribute_map) holds the very value: said once.
            if other == self.experts_key or value is None or _same(value, self.stated[self.experts_key]):
                continue
            if (reason := _count_error(other, value, rule)) is not None:
                problems.append(reason)
            elif is_int(self.experts) and value != self.experts:
                problems.append(
                    f"{other}={value} disagrees with {self.experts_key}={self.experts} (vLLM's EPLB reads "
                    f"{self.experts_key}, a model class may read {other})"
                )
        if not problems:
            return None
        return f"{self.source}: {'; '.join(problems)}; fix: state one routed-expert count, an integer >= 1"

    def top_k_error(self) -> str | None:
        """Rule ``top-k``: K is an integer in ``[1, E]`` (each token selects K distinct routed experts)."""
        e, k = self.num_logical_experts, self.top_k
        if "top_k" in self.unstated() or (is_int(k) and k >= 1 and (e is None or k <= e)):
            return None
        key = self.top_k_key or TOP_K_KEYS[0]
        said = f"{key}={shown(k)}" if self.top_k_key else f"{key} (not stated)"
        bound, of = (f"[1, {e}]", f", of E={e}") if e is not None else ("[1, E]", "")
        return (
            f"{self.source}: {said} must be an integer in {bound} (the routed experts each token "
            f"selects{of}); fix: correct {key}"
        )

    def groups_error(self) -> str | None:
        """Rule ``expert-groups`` (configs stating ``n_group``/``topk_group``, DeepSeek's grouped top-k):
        ``n_group`` an integer >= 1 dividing E, ``topk_group`` an integer in ``[1, n_group]``, and K at
        most the ``topk_group x E / n_group`` experts the chosen groups hold."""
        groups, chosen = self.stated.get("n_group"), self.stated.get("topk_group")
        if groups is None and chosen is None:
            return None
        e, k = self.num_logical_experts, self.top_k
        problems = []
        groups_ok = is_int(groups) and groups >= 1 and (e is None or e % groups == 0)
        if groups is not None and not groups_ok:
            of = f"the {e} routed experts" if e is not None else "the routed experts"
            problems.append(
                f"n_group={shown(groups)} must be an integer >= 1 that divides {of} (grouped top-k splits "
                "them into n_group equal groups)"
            )
        if chosen is not None and not (
            is_int(chosen) and chosen >= 1 and (not groups_ok or chosen <= groups)
        ):
            bound = f"n_group={groups}" if groups_ok else "n_group"
            problems.append(f"topk_group={shown(chosen)} must be an integer in [1, {bound}]")
        if not problems and groups_ok and e is not None and is_int(chosen) and is_int(k):
            most = chosen * (e // groups)
            if k > most:
                problems.append(
                    f"{self.top_k_key}={k} exceeds the {most} experts grouped top-k can select "
                    f"(topk_group={chosen} of n_group={groups} groups of {e // groups})"
                )
        if not problems:
            return None
        return f"{self.source}: {'; '.join(problems)}; fix: correct the config"

    @property
    def layer_scheme(self) -> str | None:
        """How vLLM's model class chooses the MoE layers (:data:`LAYER_SCHEMES`), by the first of the
        ``architectures``; None when they name no architecture listed there."""
        names = self.architectures
        if isinstance(names, list | tuple) and names and isinstance(names[0], str):
            return LAYER_SCHEMES.get(names[0])
        return None

    def _layers(self) -> tuple[tuple[int, int, frozenset[int], int] | None, list[str], str | None]:
        """The MoE layers as ``(first, step, dense, count)``: layer ``i`` of ``range(first,
        num_hidden_layers)`` is MoE when ``(i + 1) % step == 0`` and ``i`` is not in ``dense``, ``count`` of
        them, counted without enumerating the layers (None: not countable); what breaks
        the ``moe-layers`` rule's field checks; why the layers are not counted (a field the scheme needs
        that a ``config.json`` leaves to its config class, or an architecture not in
        :data:`LAYER_SCHEMES`). Only the fields the architecture's class reads are judged."""
        if "num_hidden_layers" not in self.stated:
            return None, [], None
        layers, problems = self.stated["num_hidden_layers"], []
        if not (is_int(layers) and 1 <= layers <= INT32_MAX):
            problems.append(
                f"num_hidden_layers={shown(layers)} must be an integer in [1, {INT32_MAX}] (the decoder "
                "layers; EPLB balances the routed experts of their MoE layers)"
            )
        scheme = self.layer_scheme
        if scheme is None:
            names = self.architectures
            if architectures_error(names if names is not None else ()) is None:
                why = (
                    f"architecture {names[0]}: the MoE layers of its model class are not counted here (only "
                    f"those of {', '.join(LAYER_SCHEMES)}); vLLM counts them when it builds the model"
                )
            else:
                why = (
                    f"architectures={shown(names)} name no model class (rule moe-model-class), so which "
                    "decoder layers are MoE is not known"
                )
            return None, problems, why
        first, step, dense = 0, 1, frozenset()
        if scheme == "first_k_dense_replace":
            if "first_k_dense_replace" not in self.stated and not self.complete:
                why = (
                    f"{self.source} states no first_k_dense_replace, so vLLM reads its config class's "
                    "default (DeepseekV3Config's 3, Glm4MoeConfig's 1); state first_k_dense_replace in "
                    "config.json"
                )
                return None, problems, why
            first = self.stated.get("first_k_dense_replace")
            if not (is_int(first) and first >= 0):
                problems.append(
                    f"first_k_dense_replace={shown(first)} must be an integer >= 0 (the leading dense "
                    "layers: vLLM's class compares layer_idx >= first_k_dense_replace and counts "
                    "num_moe_layers = num_hidden_layers - first_k_dense_replace)"
                )
            freq = self.stated.get("moe_layer_freq", 1)
            if self.architectures[0].startswith("Deepseek") and not _same(freq, 1):
                problems.append(
                    f"moe_layer_freq={shown(freq)} must be 1 with EPLB (vLLM's DeepSeek class builds a MoE "
                    "layer only where layer_idx % moe_layer_freq == 0, yet counts num_moe_layers = "
                    "num_hidden_layers - first_k_dense_replace, which upstream's EPLB state is sized by)"
                )
        elif scheme == "decoder_sparse_step":
            mlp_only = self.stated.get("mlp_only_layers")  # transformers' Qwen-MoE configs: None -> []
            step = self.stated.get("decoder_sparse_step", 1)
            if mlp_only is not None and not (isinstance(mlp_only, list) and all(is_int(i) for i in mlp_only)):
                problems.append(
                    f"mlp_only_layers={shown(mlp_only)} must be a list of layer indices (the dense layers)"
                )
            if not (is_int(step) and step >= 1):
                problems.append(
                    f"decoder_sparse_step={shown(step)} must be an integer >= 1 (every "
                    "decoder_sparse_step-th layer is MoE; 0 is a ZeroDivisionError in vLLM's Qwen-MoE layers)"
                )
            if not problems:
                dense = frozenset(mlp_only or ())
        if problems:
            return None, problems, None
        # (i + 1) % step == 0 for i in [first, layers): the multiples of step in [first + 1, layers].
        count = max(layers // step - first // step, 0)
        count -= sum(1 for i in dense if first <= i < layers and (i + 1) % step == 0)
        return (first, step, dense, count), [], None

    @property
    def num_moe_layers(self) -> int | None:
        """L, the decoder layers with routed experts, as vLLM 0.33.0's model class builds them
        (:data:`LAYER_SCHEMES`; for DeepSeek it equals its ``num_hidden_layers - first_k_dense_replace``),
        counted without enumerating the layers; None when not counted (see :meth:`layers_error`) or 0."""
        found, _, _ = self._layers()
        return (found[3] or None) if found is not None else None

    def moe_layer_indices(self) -> range | tuple[int, ...]:
        """The decoder-layer index of each MoE layer, in order (L entries; a ``range`` unless Qwen-MoE's
        ``mlp_only_layers`` leave gaps).

        Raises:
            ValueError: the layers are not counted or none is MoE (:meth:`layers_error` says why).
        """
        found, _, _ = self._layers()
        if found is None or not found[3]:
            raise ValueError(
                self.layers_error() or self.layers_not_counted() or f"{self.source}: no MoE layer"
            )
        first, step, dense, _ = found
        first += -(first + 1) % step  # the first index with (i + 1) % step == 0
        layers = range(first, self.stated["num_hidden_layers"], step)
        return layers if not dense else tuple(i for i in layers if i not in dense)

    def layers_not_counted(self) -> str | None:
        """Why L is not counted here, though the layer fields hold (the ``moe-layers`` rule is then not
        judged): a field of the class's scheme a ``config.json`` leaves to its config class, or an
        architecture not in :data:`LAYER_SCHEMES`; None when it is counted or a field is broken."""
        return self._layers()[2]

    def layers_error(self) -> str | None:
        """Rule ``moe-layers``: the layer fields the model class reads (:data:`LAYER_SCHEMES`) are well
        formed and leave at least one MoE layer. vLLM 0.33.0 with none: DeepSeek's model class builds every
        layer dense and sets ``num_moe_layers = 0``, so ``is_mixture_of_experts`` is False and upstream's
        ``EPLBController.maybe_register_model`` registers nothing (served without EPLB); Qwen3-MoE's and
        Mixtral's raise ``RuntimeError`` ("No ... layer found") while the model is built, on every rank."""
        found, problems, _ = self._layers()
        if problems:
            fields = ", ".join(p.split("=", 1)[0] for p in problems)
            return f"{self.source}: {'; '.join(problems)}; fix: correct {fields}"
        if found is None or found[3]:
            return None
        # The fields that make layers dense (a default, such as decoder_sparse_step=1, says nothing).
        defaults = {
            "first_k_dense_replace": (0,),
            "mlp_only_layers": (None, []),
            "decoder_sparse_step": (1,),
            "moe_layer_freq": (1,),
        }
        keys = [k for k in LAYER_KEYS if k in self.stated and self.stated[k] not in defaults.get(k, ())]
        said = ", ".join(f"{k}={shown(self.stated[k])}" for k in keys)
        return (
            f"{self.source}: {said} leave no MoE layer (vLLM 0.33.0 builds the model without routed "
            "experts: DeepSeek's with num_moe_layers=0, which upstream's EPLBController.maybe_register_model "
            "does not register, so it would be served without EPLB; Qwen3-MoE's and Mixtral's raise "
            "RuntimeError 'No ... layer found' on every rank while the model is built); fix: serve it "
            f"without --enable-eplb, or correct {', '.join(keys)}"
        )

    def unstated(self) -> list[str]:
        """``"experts"``, ``"top_k"`` and ``"layers"`` when a config.json mapping (``complete=False``)
        states none of their names (``"layers"``: no ``num_hidden_layers``): vLLM then reads the config
        class's default, unknown here."""
        if self.complete:
            return []
        out = []
        if self.experts_key is None and not self.block_configs_experts:
            out.append("experts")
        if self.top_k_key is None:
            out.append("top_k")
        if "num_hidden_layers" not in self.stated:
            out.append("layers")
        return out

    def errors(self) -> list[str]:
        """Every violated rule's message of :data:`MOE_FACT_RULES`, in order: those very rule functions of
        :data:`RULES` run on these facts alone (``ascend-eplb simulate`` and the cost estimate refuse a
        model folder with them before anything starts)."""
        alone = EplbSettings(enable_eplb=True, moe_facts=self)
        found = (RULES[rule_id](alone) for rule_id in MOE_FACT_RULES)
        return [m for m in found if isinstance(m, str)]


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json`` mapping as vLLM's ``hf_text_config`` reads it: a multimodal model's ``text_config``
    (its language model) read over the top level; the mapping itself, copied, when it has none."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, Mapping) else dict(config)


def read_moe_facts(config: Any, source: str, *, architectures: Any = None) -> MoeFacts:
    """The :class:`MoeFacts` of a model config, read as vLLM reads them.

    Args:
        config: a ``config.json`` as a mapping, or vLLM's ``model_config.hf_text_config`` (a transformers
            ``PretrainedConfig``): a field is stated when the mapping has the key, or the object the
            attribute (vLLM's ``getattr_iter``). A mapping's ``text_config`` (a multimodal model's
            language model) is read over its top level, as vLLM's ``hf_text_config``.
        source: what ``config`` is, for messages.
        architectures: the model's ``architectures`` (vLLM's ``model_config.architectures``); None: a
            mapping's own top-level ``architectures``, as vLLM reads them.

    Returns:
        the facts, not judged: :meth:`MoeFacts.errors` says what breaks the rules and
        :meth:`MoeFacts.unstated` what a mapping leaves to its config class. Never raises on the values.
    """

    def get(obj: Any, key: str) -> tuple[bool, Any]:
        if isinstance(obj, Mapping):
            return key in obj, obj.get(key)
        return hasattr(obj, key), getattr(obj, key, None)

    if isinstance(config, Mapping):
        if architectures is None:
            architectures = config.get("architectures")
        config = text_config(config)
    stated = {}
    for key in (*EXPERT_COUNT_KEYS, *TOP_K_KEYS, *GROUP_KEYS, *LAYER_KEYS):
        present, value = get(config, key)
        if present:
            stated[key] = value
    block_experts = None
    _, blocks = get(config, "block_configs")
    if isinstance(blocks, list | tuple):
        counts = [get(b, "n_routed_experts")[1] for b in blocks if get(b, "block_type")[1] == "moe"]
        counts = [c for c in counts if is_int(c)]
        block_experts = max(counts) if counts else None
    return MoeFacts(
        source, stated, block_experts, complete=not isinstance(config, Mapping), architectures=architectures
    )


@dataclass(frozen=True)
class ModelClass:
    """The vLLM model class a model config's ``architectures`` resolve to, and whether EPLB can register it.

    Attributes:
        architecture: the ``architectures`` entry vLLM's registry resolved.
        name: the class's ``__qualname__`` (``Qwen2MoeForCausalLM``).
        has_moe_part: whether the class implements vLLM's ``MixtureOfExperts`` interface
            (``vllm.model_executor.models.interfaces.MixtureOfExperts`` in its MRO). Upstream's
            ``EPLBController.maybe_register_model`` registers a model only through that part
            (``get_mixture_of_experts_model``) and returns False, silently, for any other: served on, without
            EPLB. None: the class cannot tell (a multimodal class, whose language model may be the part);
            upstream decides when the model registers.
    """

    architecture: str
    name: str
    has_moe_part: bool | None


def read_model_class(architectures: Any) -> ModelClass | None:
    """The first of ``architectures`` that vLLM 0.33.0's model registry holds, resolved to its class (the
    order vLLM's ``ModelRegistry.resolve_model_cls`` tries them). Imports vLLM's registry and the model's
    module (what the loader imports anyway).

    Returns:
        None: no entry is registered (vLLM serves it through its Transformers backend, or refuses it).
    """
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import MixtureOfExperts, supports_multimodal

    for arch in [architectures] if isinstance(architectures, str) else list(architectures or ()):
        registered = ModelRegistry.models.get(arch)
        if registered is None:
            continue
        cls = registered.load_model_cls()
        has_part = True if MixtureOfExperts in cls.__mro__ else (None if supports_multimodal(cls) else False)
        return ModelClass(arch, cls.__qualname__, has_part)
    return None


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


#: What a rule function returns: None (the rule holds or does not apply), the violated rule's message
#: (naming the value and the fix), or :meth:`Violation.unjudged` (the rule lacks a fact).
Rule = Callable[[EplbSettings], "str | Violation | None"]

#: Rule id -> the function that judges it, in report order (:func:`check_settings` runs them in this
#: order). Filled by :func:`_rule` below, one function per id.
RULES: dict[str, Rule] = {}
#: The rules that judge a configuration with EPLB off (the V1 path, if any, is not ours to judge; only a
#: V2-only key without EPLB is wrong); every other rule of :data:`RULES` judges only with EPLB on.
EPLB_OFF_RULES = ("phase-without-eplb", "placement-without-eplb", "policy-without-eplb")
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


@_rule("phase-without-eplb")
def _phase_without_eplb(s: EplbSettings) -> str | None:
    phase = s.load_collection_phase
    if s.enable_eplb or phase == "all":
        return None
    return (
        f"eplb_config.load_collection_phase={phase!r} needs Model Runner V2 EPLB, but "
        "enable_eplb=False; fix: pass --enable-eplb or remove load_collection_phase"
    )


@_rule("placement-without-eplb")
def _placement_without_eplb(s: EplbSettings) -> str | None:
    if s.enable_eplb or s.initial_placement is None:
        return None
    return (
        f"eplb_config.initial_placement={s.initial_placement!r} needs Model Runner V2 EPLB, but "
        "enable_eplb=False; fix: pass --enable-eplb or remove initial_placement (vLLM Ascend's static "
        "placement without EPLB reads expert_map_path, a part of the same file)"
    )


@_rule("policy-without-eplb")
def _policy_without_eplb(s: EplbSettings) -> str | None:
    defaults = PolicySettings()
    judge = {
        "policy": policy_error,
        "min_balancedness_gain": min_balancedness_gain_error,
        "target_balancedness": target_balancedness_error,
        "load_estimate": load_estimate_error,
    }
    # A key counts as given unless it is its default, validly: `false` equals the gain's 0.0 but is no
    # number (refused with EPLB on), so it is named here too.
    given = [
        k
        for k in POLICY_KEYS
        if k in s.ascend_eplb_config
        and (judge[k](v := s.ascend_eplb_config[k]) is not None or v != getattr(defaults, k))
    ]
    if s.enable_eplb or not given:
        return None
    shown_keys = ", ".join(f"eplb_config.{k}={s.ascend_eplb_config[k]!r}" for k in given)
    return (
        f"{shown_keys}: the placement policy, the gain gate and the load estimate need Model Runner V2 "
        f"EPLB, but enable_eplb=False; fix: pass --enable-eplb or remove {', '.join(given)}"
    )


@_rule("model-runner-v2")
def _model_runner_v2(s: EplbSettings) -> str | None:
    if s.use_v2_model_runner:
        return None
    return (
        "enable_eplb=True with use_v2_model_runner=False: upstream EPLB is supported by Model "
        "Runner V2 only; fix: set VLLM_USE_V2_MODEL_RUNNER=1 (or use the V1 dynamic_eplb path "
        "without --enable-eplb)"
    )


@_rule("v1-controls")
def _v1_controls(s: EplbSettings) -> str | None:
    where = [f"additional_config.eplb_config.{k}" for k in V1_EPLB_KEYS if k in s.ascend_eplb_config]
    where += [f"additional_config.{k}" for k in V1_EPLB_KEYS if k in s.legacy_top_level_keys]
    if not where:
        return None
    static = (
        "; a static placement (expert_map_path) is eplb_config.initial_placement under V2, a file of "
        "ascend-eplb plan --export-expert-map"
        if "expert_map_path" in s.ascend_eplb_config or "expert_map_path" in s.legacy_top_level_keys
        else ""
    )
    return (
        f"Model Runner V1 EPLB controls cannot be mixed with V2 EPLB: got {', '.join(where)}; "
        "fix: remove them and use --eplb-config (window_size, step_interval, "
        f"num_redundant_experts); the Ascend V2 keys are {', '.join(ASCEND_V2_KEYS)}{static}"
    )


@_rule("v1-env")
def _v1_env(s: EplbSettings) -> str | None:
    env_on = [k for k in V1_EPLB_ENV_SWITCHES if is_true(s.environment.get(k))]
    if not env_on:
        return None
    shown = ", ".join(f"{k}={s.environment[k]!r}" for k in env_on)
    return (
        f"Model Runner V1 EPLB environment switches cannot be mixed with V2 EPLB: got {shown}; "
        f"fix: unset {' and '.join(env_on)}"
    )


@_rule("unknown-ascend-key")
def _unknown_ascend_key(s: EplbSettings) -> str | None:
    unknown = sorted(k for k in s.ascend_eplb_config if k not in ASCEND_V2_KEYS and k not in V1_EPLB_KEYS)
    if not unknown:
        return None
    return (
        f"unknown additional_config.eplb_config key(s) {unknown}; fix: the Ascend Model Runner V2 keys are "
        f"{list(ASCEND_V2_KEYS)}"
    )


@_rule("load-collection-phase")
def _load_collection_phase(s: EplbSettings) -> str | None:
    phase = s.load_collection_phase
    if phase in LOAD_COLLECTION_PHASES:
        return None
    return (
        f"eplb_config.load_collection_phase={phase!r} is not one of {list(LOAD_COLLECTION_PHASES)}; "
        "fix: use 'all', 'prefill' or 'decode'"
    )


@_rule("placement-policy")
def _placement_policy(s: EplbSettings) -> str | None:
    reason = policy_error(s.placement_policy)
    if reason is None:
        return None
    return (
        f"{reason}; fix: use 'default' (upstream's DefaultEplbPolicy) or 'migration_aware' (the fewest "
        "expert moves from the placement in force)"
    )


@_rule("min-balancedness-gain")
def _min_balancedness_gain(s: EplbSettings) -> str | None:
    reason = min_balancedness_gain_error(s.min_balancedness_gain)
    if reason is None:
        return None
    return f"{reason}; fix: set a small gain such as 0.01, or 0"


@_rule("target-balancedness")
def _target_balancedness(s: EplbSettings) -> str | None:
    reason = target_balancedness_error(s.target_balancedness)
    if reason is None:
        return None
    return f"{reason}; fix: set a target such as 0.95, or remove target_balancedness"


@_rule("load-estimate")
def _load_estimate(s: EplbSettings) -> str | None:
    reason = load_estimate_error(s.load_estimate)
    if reason is None:
        return None
    return (
        f"{reason}; fix: use 'window' (upstream's: plan on the closed window) or 'pooled' (plan on the "
        "windows since the last shift of the load)"
    )


@_rule("async-only")
def _async_only(s: EplbSettings) -> str | None:
    if s.use_async is True:
        return None
    return (
        f"eplb_config.use_async={s.use_async!r}: only asynchronous EPLB is supported (no silent "
        "switch); fix: set --eplb-config.use_async=true"
    )


@_rule("communicator")
def _communicator(s: EplbSettings) -> str | None:
    if s.communicator is None or s.communicator in SUPPORTED_COMMUNICATORS:
        return None
    return (
        f"eplb_config.communicator={s.communicator!r} is not supported on Ascend; fix: leave it "
        "unset or set 'torch_gloo' (AscendGlooEplbCommunicator, CPU staging over Gloo)"
    )


@_rule("policy")
def _policy(s: EplbSettings) -> str | None:
    if s.policy == "default":
        return None
    return (
        f"eplb_config.policy={s.policy!r}: only vLLM's 'default' policy is supported; fix: set "
        "policy='default'"
    )


@_rule("elastic-ep")
def _elastic_ep(s: EplbSettings) -> str | None:
    if not s.enable_elastic_ep:
        return None
    return "enable_elastic_ep=True is not supported with Ascend EPLB; fix: disable elastic EP"


@_rule("expert-parallel")
def _expert_parallel(s: EplbSettings) -> str | None:
    if s.enable_expert_parallel:
        return None
    return "enable_expert_parallel=False: EPLB needs expert parallelism; fix: pass --enable-expert-parallel"


def _too_large(name: str, value: Any) -> str | None:
    if is_int(value) and value > INT32_MAX:
        return (
            f"eplb_config.{name}={value!r} exceeds {INT32_MAX} (int32 device tables and load counters); "
            f"fix: set --eplb-config.{name} to at most {INT32_MAX}"
        )
    return None


def _positive(name: str, value: Any) -> str | None:
    if is_int(value) and value > 0:
        return _too_large(name, value)
    return (
        f"eplb_config.{name}={value!r} must be a positive integer; fix: set "
        f"--eplb-config.{name} to a value > 0"
    )


@_rule("window-size")
def _window_size(s: EplbSettings) -> str | None:
    return _positive("window_size", s.window_size)


@_rule("step-interval")
def _step_interval(s: EplbSettings) -> str | None:
    return _positive("step_interval", s.step_interval)


def _redundant_ok(s: EplbSettings) -> bool:
    return is_int(s.num_redundant_experts) and s.num_redundant_experts >= 0


@_rule("redundant-experts")
def _redundant_experts(s: EplbSettings) -> str | None:
    if _redundant_ok(s):
        return _too_large("num_redundant_experts", s.num_redundant_experts)
    return (
        f"eplb_config.num_redundant_experts={s.num_redundant_experts!r} must be an integer >= 0; fix: set "
        "--eplb-config.num_redundant_experts to 0 or more"
    )


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


def architectures_error(names: Any) -> str | None:
    """``architectures`` must be a list of class names: vLLM 0.33.0's ``ModelConfig`` (its pydantic
    ``ModelArchitectureConfig.architectures: list[str]``) refuses anything else before anything runs,
    though transformers' ``PretrainedConfig`` keeps a string as written; and it must name one: with none,
    vLLM's registry raises "No model architectures are specified" (``inspect_model_cls``)."""
    if isinstance(names, list | tuple) and not names:
        return (
            "architectures names no model class (vLLM's registry raises 'No model architectures are "
            'specified\'); fix: write "architectures": ["<the model class>"], e.g. '
            '["DeepseekV3ForCausalLM"]'
        )
    if isinstance(names, list | tuple) and all(isinstance(n, str) for n in names):
        return None
    if isinstance(names, list | tuple):
        why, fix = "Input should be a valid string", "write each entry as a string"
    else:
        why = "Input should be a valid list"
        fix = (
            f'write "architectures": ["{names}"]'
            if isinstance(names, str)
            else 'write "architectures" as a list of class names, e.g. ["DeepseekV3ForCausalLM"]'
        )
    return (
        f"architectures={shown(names)} must be a list of model class names (vLLM's ModelConfig refuses "
        f"anything else: '{why}'); fix: {fix}"
    )


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
    if not (_redundant_ok(s) and s.enable_expert_parallel):
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
    from ascend_eplb.integration.model_names import is_draft
    from ascend_eplb.integration.placement_file import (
        PlacementFileError,
        assign_placements,
        describe_mismatch,
        read_placements,
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
    known = s.num_logical_experts is not None and _redundant_ok(s)
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
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return None
        return (
            "float32 expert weights are accepted on a CPU host only (exact comparisons); fix: serve "
            "--dtype bfloat16 or float16"
        )
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
    return None


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
    from types import SimpleNamespace

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
    from ascend_eplb.control.layout import unplaceable_layout

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
