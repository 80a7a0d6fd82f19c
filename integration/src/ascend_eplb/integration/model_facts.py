"""What a model config states about its routed experts and MoE layers, read as vLLM 0.33.0 reads them
(:class:`MoeFacts`, :func:`read_moe_facts`), and the vLLM model class its ``architectures`` resolve to
(:func:`read_model_class`). The rules of ``rules.MOE_FACT_RULES`` judge these facts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ascend_eplb.control.values import INT32_MAX, is_int

__all__ = [
    "EXPERT_COUNT_KEYS",
    "GROUP_KEYS",
    "LAYER_KEYS",
    "LAYER_SCHEMES",
    "MAX_REDUNDANT_EXPERTS",
    "TOP_K_KEYS",
    "ModelClass",
    "MoeFacts",
    "architectures_error",
    "experts_divisibility_error",
    "read_model_class",
    "read_moe_facts",
    "shown",
    "text_config",
]

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

    The one reading of these facts (:func:`read_moe_facts`: a ``config.json`` for ``check`` and
    ``simulate``, vLLM's ``hf_text_config`` at start-up). The rules of :data:`MOE_FACT_RULES` judge them
    (:meth:`experts_error`, :meth:`top_k_error`, :meth:`groups_error`, :meth:`layers_error`), so a bad
    value is refused with field, value and rule before a rank starts. :attr:`num_moe_layers` is the one
    count of a config's MoE layers (L).
    """

    #: What was read (``/path/config.json``, ``the hf_config of MODEL``), for messages.
    source: str
    #: Every field of :data:`EXPERT_COUNT_KEYS`, :data:`TOP_K_KEYS`, :data:`GROUP_KEYS` and
    #: :data:`LAYER_KEYS` the config has, with its value as written (any type).
    stated: dict[str, Any]
    #: The largest ``n_routed_experts`` of the MoE ``block_configs`` (vLLM's fallback for heterogeneous
    #: models; None without any).
    block_configs_experts: Any = None
    #: Every field vLLM reads is readable (an ``hf_config``); False for a ``config.json`` mapping, where an
    #: omitted field's default is unknown here, so the rule that needs it is not judged (:meth:`unstated`).
    complete: bool = True
    #: The top level's ``architectures`` as written; the first entry selects the :data:`LAYER_SCHEMES`
    #: entry the MoE layers are counted by.
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
    # local: the plugin and the tools' readers import this module before (or without) vLLM's models
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


#: The most redundant experts upstream's ``EplbState.add_model`` takes (its ``MAX_EXPERT_REDUNDANCY``,
#: vLLM 0.33.0 ``vllm/distributed/eplb/eplb_state.py``; it asserts ``num_redundant_experts <=`` it): P is
#: at most E + 1023.
MAX_REDUNDANT_EXPERTS = 1023


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
