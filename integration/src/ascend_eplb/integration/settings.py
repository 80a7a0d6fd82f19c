"""The settings the support-matrix rules read: :class:`EplbSettings`, from a ``VllmConfig`` (start-up) or a
config file, command line and model folder (``ascend-eplb check``), and the key and mode names they use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ascend_eplb.control.phase import LOAD_COLLECTION_PHASES as _CONTROL_PHASES
from ascend_eplb.control.policy_config import PolicySettings

if TYPE_CHECKING:
    from ascend_eplb.integration.model_facts import MoeFacts

__all__ = [
    "ASCEND_V2_KEYS",
    "COMPILATION_MODES",
    "CUDAGRAPH_MODES",
    "LOAD_COLLECTION_PHASES",
    "POLICY_KEYS",
    "SUPPORTED_COMMUNICATORS",
    "V1_EPLB_ENV_SWITCHES",
    "V1_EPLB_KEYS",
    "EplbSettings",
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
