"""The settings the support-matrix rules read: :class:`EplbSettings`, from a ``VllmConfig`` (start-up) or a
config file, command line and model folder (``ascend-eplb check``), and the key and mode names they use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ascend_eplb.control.phase import LOAD_COLLECTION_PHASES as _CONTROL_PHASES
from ascend_eplb.control.policy_config import PolicySettings
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
#: The Ascend-specific keys of the Model Runner V2 ``eplb_config``: ``load_collection_phase``,
#: ``initial_placement`` (a placement file to start serving on, ``ascend_eplb.integration.placement_file``)
#: and ``replica_split`` (``ascend_eplb.control.split_config``).
ASCEND_V2_KEYS = ("load_collection_phase", "initial_placement", *POLICY_KEYS, "replica_split")
#: Values of ``load_collection_phase``: control's own constant (``ascend_eplb.control.phase``, no vLLM).
LOAD_COLLECTION_PHASES = _CONTROL_PHASES
#: Communicators accepted by this integration (``torch_gloo`` -> ``AscendGlooEplbCommunicator``).
SUPPORTED_COMMUNICATORS = ("torch_gloo",)
#: vLLM 0.33.0's all-to-all backends of ``ParallelConfig.use_sequence_parallel_moe``.
_SEQUENCE_PARALLEL_BACKENDS = (
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "flashinfer_nvlink_one_sided",
    "passthrough",
    "mori_high_throughput",
    "mori_low_latency",
    "nixl_ep",
)
#: vLLM 0.33.0's ``CompilationMode`` names, by value (``vllm/config/compilation.py``).
COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
#: vLLM 0.33.0's ``CUDAGraphMode`` names (``vllm/config/compilation.py``); vLLM Ascend's ACL graph modes
#: take the same names.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass
class EplbSettings:
    """The settings the rules read, extracted from a ``VllmConfig`` or a config file.

    The EPLB fields' defaults (``window_size`` to ``communicator``, ``log_balancedness``) are upstream
    vLLM 0.33.0 ``EPLBConfig``'s (tested equal); a config file that omits one reads them from here. A
    fact ``ascend-eplb check`` cannot know is None and named in ``unknown_facts``: the rule that needs it
    is reported unjudged (:meth:`Violation.unjudged`) instead of passing.
    """

    enable_eplb: bool = False
    use_v2_model_runner: bool = True
    enable_expert_parallel: bool = False
    enable_elastic_ep: bool = False
    enable_dbo: bool = False
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    data_parallel_size: int = 1
    #: vLLM's ``ParallelConfig.all2all_backend`` (its default), which with DP decides the MoE rows.
    all2all_backend: Any = "allgather_reducescatter"
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
    #: E, once it meets the ``routed-experts`` rule's facts (None otherwise).
    num_logical_experts: int | None = None
    #: L when known before the model is built (``check``: :attr:`MoeFacts.num_moe_layers`); None at
    #: start-up, where ``initial-placement`` compares the layers at registration (``startup_placement``).
    num_moe_layers: int | None = None
    quantization: str | None = "bf16"
    cudagraph_mode: str = "NONE"
    compilation_mode: str = "NONE"
    inductor_freezing: bool = False
    #: ``compilation_config.inductor_compile_config``: the options a compiled forward hands torch's
    #: inductor, each judged by ``compiled-forward`` against torch's own option table.
    inductor_compile_config: dict[str, Any] = field(default_factory=dict)
    #: The speculative config's method (None: no speculative decoding).
    speculative_method: str | None = None
    #: Whether the draft has routed experts.
    speculative_draft_is_moe: bool = False
    #: The draft's ``architectures`` and HF ``model_type`` as vLLM derives them (an MTP method:
    #: ``SpeculativeConfig.hf_config_override``, e.g. ``DeepSeekMTPModel``), judged by
    #: ``speculative-moe-draft``.
    speculative_draft_architectures: tuple[str, ...] | Any = None
    speculative_draft_model_type: str | None = None
    #: The draft config's routed-expert facts (None: not read); must equal the target's (upstream
    #: balances both with one expert configuration).
    speculative_draft_moe_facts: MoeFacts | None = None
    #: The names upstream's ``EplbModelState`` gives the balanced models (target, and
    #: ``eplb_draft_model_name`` of an MoE draft), each of which an ``initial_placement`` file must name;
    #: None where the model is not known (a config file).
    served_models: tuple[str, ...] | None = None
    #: An unknown fact's field (``num_logical_experts``, ``top_k``, ``quantization``,
    #: ``speculative_draft_is_moe``) -> why and how to give it; empty at start-up.
    unknown_facts: dict[str, str] = field(default_factory=dict)
    #: The model config's routed-expert facts as written (:func:`read_moe_facts`), judged by
    #: ``routed-experts``, ``top-k`` and ``expert-groups``; None (those rules pass) with no model config.
    moe_facts: MoeFacts | None = None
    #: The model config's ``architectures``, judged by ``moe-model-class`` (:func:`read_model_class`): a
    #: tuple of class names, or the value as written when not a list of them (a string, which vLLM's
    #: ``ModelConfig`` and the rule refuse); None (the rule passes) where no model config names one.
    model_architectures: tuple[str, ...] | Any = None

    @property
    def num_ranks(self) -> int:
        """The EP size: TP x PCP x DP (the EP group of vLLM's ``ParallelConfig``)."""
        return self.tensor_parallel_size * self.prefill_context_parallel_size * self.data_parallel_size

    @property
    def use_sequence_parallel_moe(self) -> bool:
        """vLLM 0.33.0's ``ParallelConfig.use_sequence_parallel_moe`` (restated: a sequence-parallel backend
        with EP, TP > 1 and DP > 1)."""
        return (
            self.all2all_backend in _SEQUENCE_PARALLEL_BACKENDS
            and self.enable_expert_parallel
            and self.tensor_parallel_size > 1
            and self.data_parallel_size > 1
        )

    @property
    def replica_split(self) -> Any:
        """``additional_config.eplb_config.replica_split`` as given (not validated), ``"equal"`` (today's
        rule) when absent."""
        return self.ascend_eplb_config.get("replica_split", "equal")

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
