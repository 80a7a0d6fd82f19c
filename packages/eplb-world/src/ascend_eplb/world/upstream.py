"""The CPU world's upstream surface: every point where this world meets vLLM 0.33.0 and torch 2.13.0 that
serving does not, declared once in :data:`SURFACE` (:class:`~ascend_eplb.control.surface.Surface`).

:data:`SIGNATURES` (the stand-ins' targets, the methods replaced on single instances, the registrations
called), the module-level stand-ins (each
declared on its factory in :mod:`~ascend_eplb.world.stand_ins` with ``SURFACE.replaces``),
:data:`INSTANCE_BINDINGS` and :data:`ATTRIBUTES` (what the stand-ins and the serving worker read).
Serving neither installs nor checks them (a vLLM change here must not stop a serving process):
``install_stand_ins`` checks them all (``SURFACE.check()``) before it installs anything;
:mod:`~ascend_eplb.world.surface` renders them in ``UPSTREAM.md``. Imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

from ascend_eplb.control.patching import Attribute, InstanceBinding, Signature
from ascend_eplb.control.surface import Surface, table

__all__ = [
    "ATTRIBUTES",
    "INSTANCE_BINDINGS",
    "SIGNATURES",
    "SURFACE",
    "USERS",
]

# The users (modules of this package that rely on a row).
WORLD_STAND_INS = "world.stand_ins"
WORLD_QUANT = "world.quant_method"
WORLD_OWN_LOOP = "world.own_loop"
WORLD_RANK_MODEL = "world.rank_model"
ENGINE_KERNELS = "world.engine.kernels"
ENGINE_PATCHES = "world.engine.patches"
ENGINE_PLATFORM = "world.engine.platform_patches"
#: Every user id a row of this surface names.
USERS = (
    WORLD_STAND_INS,
    WORLD_QUANT,
    WORLD_RANK_MODEL,
    WORLD_OWN_LOOP,
    ENGINE_KERNELS,
    ENGINE_PATCHES,
    ENGINE_PLATFORM,
)

_STATE = "vllm.distributed.eplb.eplb_state"
_CONTROLLER = "vllm.v1.worker.gpu.eplb_utils"
_INTERFACES = "vllm.model_executor.models.interfaces"
_LAYER_UTILS = "vllm.model_executor.layers.utils"
_DEVICE_COMMUNICATOR = "vllm.distributed.device_communicators.base_device_communicator"
_CPU_COMMUNICATOR = "vllm.distributed.device_communicators.cpu_communicator"
_ATTENTION = "vllm.model_executor.layers.attention.attention"
_MLA = "vllm.model_executor.layers.attention.mla_attention"
_UNQUANTIZED = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
_ROUTED_EXPERTS = "vllm.model_executor.layers.fused_moe.routed_experts"
_QUANTIZATION = "vllm.model_executor.layers.quantization"
_PARALLEL_STATE = "vllm.distributed.parallel_state"
_MODEL_STATE = "EplbModelState"
_CUSTOM_OPS = "vllm._custom_ops"
_CPU_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


#: Every upstream signature the world relies on, by ``module.qualname``.
SIGNATURES: Mapping[str, Signature] = table(
    Signature(_LAYER_UTILS, "check_cpu_sgl_kernel", ("n", "k", "dtype"), (WORLD_STAND_INS,)),
    Signature(
        _DEVICE_COMMUNICATOR,
        "DeviceCommunicatorBase.all_gatherv",
        ("self", "input_", "dim=0", "sizes=None"),
        (WORLD_STAND_INS,),
    ),
    Signature(
        _DEVICE_COMMUNICATOR,
        "DeviceCommunicatorBase.reduce_scatterv",
        ("self", "input_", "dim=-1", "sizes=None"),
        (WORLD_STAND_INS,),
    ),
    Signature(
        _ATTENTION,
        "Attention.forward",
        ("self", "query", "key", "value", "output_shape=None", "output_dtype=None"),
        (WORLD_STAND_INS,),
    ),
    Signature(
        _MLA,
        "MLAAttention.forward",
        ("self", "q", "kv_c_normed", "k_pe", "output_shape=None", "q_dcp_replicated=None"),
        (WORLD_STAND_INS,),
    ),
    Signature(
        _UNQUANTIZED,
        "UnquantizedFusedMoEMethod.register_oot",
        ("_decorated_op_cls=None", "name=None"),
        (WORLD_STAND_INS,),
    ),
    Signature(_ROUTED_EXPERTS, "RoutedExperts.get_expert_weights", ("self",), (WORLD_QUANT,)),
    Signature(_QUANTIZATION, "get_quantization_config", ("quantization",), (WORLD_QUANT,)),
    Signature(_QUANTIZATION, "register_quantization_config", ("quantization",), (WORLD_QUANT,)),
    # The engine world: the callers of each `_C` op it defines (engine.kernels.KERNELS), which pass the
    # arguments in the order of its schema, and what its platform plugin and patches replace. (The caller
    # of init_cpu_memory_env, CPUWorker.__init__, is not a row: importing its module replaces
    # torch.accelerator.empty_cache, which only an engine process may do.)
    Signature(_CUSTOM_OPS, "cpu_prepack_moe_weight", ("weight", "isa"), (ENGINE_KERNELS,)),
    Signature(
        _CUSTOM_OPS,
        "cpu_fused_moe",
        (
            "out",
            "input",
            "w13",
            "w2",
            "w13_bias",
            "w2_bias",
            "topk_weights",
            "topk_ids",
            "act",
            "isa",
            "skip_weighted=False",
        ),
        (ENGINE_KERNELS,),
    ),
    Signature(
        _CUSTOM_OPS,
        "cpu_attn_get_scheduler_metadata",
        (
            "num_reqs",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "seq_lens",
            "dtype",
            "query_start_loc",
            "causal",
            "sliding_window_size",
            "isa",
            "enable_kv_split",
            "dynamic_causal=None",
            "kv_cache_dtype='auto'",
        ),
        (ENGINE_KERNELS,),
    ),
    Signature(
        _CUSTOM_OPS,
        "cpu_attn_reshape_and_cache",
        (
            "key",
            "value",
            "key_cache",
            "value_cache",
            "slot_mapping",
            "isa",
            "k_scale=1.0",
            "v_scale=1.0",
            "kv_cache_dtype='auto'",
        ),
        (ENGINE_KERNELS,),
    ),
    Signature(
        _CUSTOM_OPS,
        "cpu_attention_with_kv_cache",
        (
            "query",
            "key_cache",
            "value_cache",
            "output",
            "query_start_loc",
            "seq_lens",
            "scale",
            "causal",
            "alibi_slopes",
            "sliding_window",
            "block_table",
            "softcap",
            "scheduler_metadata",
            "s_aux",
            "dynamic_causal=None",
            "k_scale=1.0",
            "v_scale=1.0",
            "kv_cache_dtype='auto'",
        ),
        (ENGINE_KERNELS,),
    ),
    Signature(
        _CUSTOM_OPS,
        "mla_decode_kvcache_cpu",
        ("out", "query", "kv_cache", "scale", "block_tables", "seq_lens"),
        (ENGINE_KERNELS,),
    ),
    Signature("vllm.platforms", "vllm_version_matches_substr", ("substr",), (ENGINE_PLATFORM,)),
    Signature(
        _CPU_MOE,
        "CPUUnquantizedExperts.apply",
        (
            "self",
            "output",
            "hidden_states",
            "w1",
            "w2",
            "topk_weights",
            "topk_ids",
            "activation",
            "global_num_experts",
            "expert_map",
            "a1q_scale",
            "a2_scale",
            "workspace13",
            "workspace2",
            "expert_tokens_meta",
            "apply_router_weight_on_input",
        ),
        (ENGINE_PATCHES,),
    ),
)


#: The upstream methods the CPU world replaces on single instances of a model it built.
INSTANCE_BINDINGS: tuple[InstanceBinding, ...] = (
    InstanceBinding(
        SIGNATURES[f"{_ATTENTION}.Attention.forward"],
        "ascend_eplb.world.stand_ins",
        "install_attention_stand_ins, on each Attention of a model the CPU world built: prefill-only causal "
        "SDPA",
    ),
    InstanceBinding(
        SIGNATURES[f"{_MLA}.MLAAttention.forward"],
        "ascend_eplb.world.stand_ins",
        "install_attention_stand_ins, on each MLAAttention of a model the CPU world built: prefill-only "
        "causal SDPA over kv_b_proj's expansion",
    ),
    InstanceBinding(
        SIGNATURES[f"{_ROUTED_EXPERTS}.RoutedExperts.get_expert_weights"],
        "ascend_eplb.world.quant_method",
        "install_ascend_routed_experts, on each RoutedExperts of a model the CPU world built whose method "
        "has a quant_views format: vllm-ascend's AscendRoutedExperts.get_expert_weights (the method's views)",
    ),
)

#: The attributes of upstream objects the stand-ins and the serving worker read.
ATTRIBUTES: tuple[Attribute, ...] = (
    *(
        Attribute(_ATTENTION, "Attention", attr, "reads", (WORLD_STAND_INS,), "the SDPA stand-in's shapes")
        for attr in ("num_heads", "num_kv_heads", "head_size", "head_size_v")
    ),
    Attribute(_ATTENTION, "Attention", "impl", "reads", (WORLD_STAND_INS,), "`impl.scale`, the SDPA scale"),
    *(
        Attribute(_MLA, "MLAAttention", attr, "reads", (WORLD_STAND_INS,), why)
        for attr, why in (
            ("num_heads", "the MLA stand-in's heads"),
            ("qk_nope_head_dim", "the split of `kv_b_proj`'s expansion"),
            ("v_head_dim", "the same"),
            ("kv_b_proj", "its weight expands `kv_c` into `k_nope` and `v`"),
            ("scale", "the SDPA scale"),
        )
    ),
    Attribute(
        _ROUTED_EXPERTS,
        "RoutedExperts",
        "expert_map",
        "reads",
        (WORLD_STAND_INS,),
        "`TorchFusedMoEMethod.apply`: global physical id -> local slot",
    ),
    Attribute(
        _ROUTED_EXPERTS,
        "RoutedExperts",
        "top_k",
        "reads",
        (WORLD_STAND_INS,),
        "the K of the layer's `KernelLog` (the ids its expert method consumed)",
    ),
    *(
        Attribute(_CPU_COMMUNICATOR, "CpuCommunicator", attr, "reads", (WORLD_STAND_INS,), why)
        for attr, why in (
            ("world_size", "the group of `all_gatherv` / `reduce_scatterv`"),
            ("rank_in_group", "this rank's rows"),
            ("device_group", "the `torch.distributed` group the stand-ins run on"),
            ("unique_name", "names the group to the stand-ins' custom ops"),
        )
    ),
    *(
        Attribute(_PARALLEL_STATE, "GroupCoordinator", attr, "reads", (WORLD_STAND_INS,), why)
        for attr, why in (
            ("unique_name", "the custom ops find their DP, EP or TP group by it"),
            ("device_communicator", "the group's `CpuCommunicator` the collectives run on"),
            ("rank_in_group", "the rows `reduce_scatterv` keeps (its fake's shape)"),
        )
    ),
    Attribute(
        _ROUTED_EXPERTS,
        "RoutedExperts",
        "quant_method",
        "reads",
        (WORLD_QUANT,),
        "`install_ascend_routed_experts`: the layers whose method has a quant_views format",
    ),
    Attribute(_CONTROLLER, "EPLBController", "state", "reads", (WORLD_OWN_LOOP,), "the world's EPLB state"),
    *(
        Attribute(_STATE, "EplbState", attr, "reads", (WORLD_OWN_LOOP,), why)
        for attr, why in (
            ("model_states", "the world's model"),
            ("async_worker", "`wait_for_transfer`: the worker is alive"),
            ("should_record_tensor", "whether a forward recorded load"),
        )
    ),
    *(
        Attribute(_STATE, _MODEL_STATE, attr, "reads", (WORLD_OWN_LOOP,), why)
        for attr, why in (
            ("physical_to_logical_map", "the placement in force: P, the committed layers, slot checks"),
            ("rebalanced", "`wait_for_transfer`: a cycle in flight"),
            ("pending_result", "`wait_for_transfer`: a layer published"),
            ("expert_load_pass", "the load a forward recorded"),
        )
    ),
    Attribute(
        _INTERFACES, "MixtureOfExperts", "moe_layers", "reads", (WORLD_RANK_MODEL,), "the model's MoE layers"
    ),
)

#: The CPU world's surface: its rows, checked (``SURFACE.check()``), replaced (``SURFACE.replaces``) and
#: rendered (:mod:`~ascend_eplb.world.surface`).
SURFACE = Surface(
    __name__,
    "the CPU world's upstream table",
    USERS,
    SIGNATURES,
    instance_bindings=INSTANCE_BINDINGS,
    attributes=ATTRIBUTES,
)
