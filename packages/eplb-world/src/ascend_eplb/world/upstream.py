"""The CPU world's upstream surface: every point where this world meets vLLM 0.33.0 and torch 2.13.0 that
serving does not, declared once, with :mod:`ascend_eplb.control.patching`'s row types.

* :data:`SIGNATURES`: the targets of the stand-in patches, the methods replaced on single instances,
  the registrations called (vLLM's out-of-tree method and quantization registries) and Model Runner V2's
  draft calls the serving worker makes (``init_speculator``, the speculator's ``load_model`` and
  ``_prepare_eplb_forward``), with their parameters.
* :data:`STAND_INS`: the module-level replacements (:mod:`~ascend_eplb.world.stand_ins` builds its
  ``PatchSet`` of them with :func:`patches_of`), in installation order.
* :data:`INSTANCE_BINDINGS`: the upstream methods replaced on single instances of a built model.
* :data:`ATTRIBUTES`: the attributes of upstream objects the stand-ins and the serving worker read.

Serving neither installs nor checks these rows (a vLLM change here must not stop a serving process):
``stand_ins.install_stand_ins`` checks them all (:func:`check`) before it installs anything.
:func:`render` writes their tables (``UPSTREAM.md`` of this package; a test keeps them equal:
``python -m ascend_eplb.world.upstream`` prints it). Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ascend_eplb.control.patching import (
    Attribute,
    InstanceBinding,
    Patch,
    PatchEntry,
    Signature,
    attribute_table,
    check_signatures,
    instance_binding_table,
    patch_table,
    signature_table,
)

__all__ = [
    "ATTRIBUTES",
    "INSTANCE_BINDINGS",
    "SIGNATURES",
    "STAND_INS",
    "USERS",
    "check",
    "patches_of",
    "render",
    "signature",
]

# The users (modules of this package that rely on a row).
WORLD_STAND_INS = "world.stand_ins"
WORLD_QUANT = "world.quant_method"
WORLD_SERVING = "world.serving"
WORLD_COMPILED = "world.compiled"
#: Every user id a row of this surface names.
USERS = (WORLD_STAND_INS, WORLD_QUANT, WORLD_SERVING, WORLD_COMPILED)

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
_COMPILATION = "vllm.config.compilation"
_PARALLEL_STATE = "vllm.distributed.parallel_state"
_MODEL_STATE = "EplbModelState"
_SPEC_DECODE = "vllm.v1.worker.gpu.spec_decode"
_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.speculator"


def _table(*entries: Signature) -> Mapping[str, Signature]:
    table: dict[str, Signature] = {}
    for entry in entries:
        if entry.name in table:
            raise ValueError(f"upstream signature {entry.name} is listed twice")
        table[entry.name] = entry
    return table


#: Every upstream signature the world relies on, by ``module.qualname``.
SIGNATURES: Mapping[str, Signature] = _table(
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
    Signature(
        _COMPILATION,
        "CompilationConfig.init_backend",
        ("self", "vllm_config", "prefix=''", "is_encoder=False", "use_aot_compile=True"),
        (WORLD_COMPILED,),
    ),
    # The MTP draft as Model Runner V2 loads and runs it (serving.load_draft, ServingWorker.forward_step).
    Signature(_SPEC_DECODE, "init_speculator", ("vllm_config", "device", "req_states"), (WORLD_SERVING,)),
    Signature(_SPECULATOR, "DraftModelSpeculator.load_model", ("self", "target_model"), (WORLD_SERVING,)),
    Signature(
        _SPECULATOR,
        "DraftModelSpeculator._prepare_eplb_forward",
        ("self", "num_unpadded_tokens"),
        (WORLD_SERVING,),
    ),
)


def signature(name: str) -> Signature:
    """The entry ``module.qualname`` of :data:`SIGNATURES`.

    Raises:
        KeyError: ``name`` is not in the table (the message says where to add it).
    """
    try:
        return SIGNATURES[name]
    except KeyError:
        raise KeyError(f"{name} is not in ascend_eplb.world.upstream.SIGNATURES; list it there") from None


def _function(name: str, replace: str, does: str, **options: Any) -> PatchEntry:
    entry = signature(name)
    return PatchEntry(entry.module, entry.qualname, entry, WORLD_STAND_INS, replace, does, **options)


_CPU_COMMUNICATOR_ONLY = "always (only a `CpuCommunicator` gets the stand-in; any other upstream's method)"

#: The module-level replacements of the CPU world, in installation order (never serving's).
STAND_INS: tuple[PatchEntry, ...] = (
    _function(
        f"{_LAYER_UTILS}.check_cpu_sgl_kernel",
        "_without_absent_sgl_kernel",
        "False while `torch.ops._C` lacks `convert_weight_packed` (16-bit linear layers take vLLM's "
        "`F.linear` fallback), else upstream's",
        applies="always (float32 layers and hosts with that op unaffected)",
    ),
    _function(
        f"{_DEVICE_COMMUNICATOR}.DeviceCommunicatorBase.all_gatherv",
        "_cpu_all_gatherv",
        "a `CpuCommunicator`'s over `torch.distributed` (rows padded to the largest, gathered, concatenated "
        "in rank order); refused if `CpuCommunicator` defines its own",
        applies=_CPU_COMMUNICATOR_ONLY,
        check="_check_cpu_communicator_lacks_all_gatherv",
    ),
    _function(
        f"{_DEVICE_COMMUNICATOR}.DeviceCommunicatorBase.reduce_scatterv",
        "_cpu_reduce_scatterv",
        "a `CpuCommunicator`'s over `torch.distributed` (all-reduce, then this rank's rows); refused if "
        "`CpuCommunicator` defines its own",
        applies=_CPU_COMMUNICATOR_ONLY,
        check="_check_cpu_communicator_lacks_reduce_scatterv",
    ),
    PatchEntry(
        "torch._dynamo.config",
        "disable",
        None,
        WORLD_STAND_INS,
        "_dynamo_disabled",
        "True: TorchDynamo off for the process, so vLLM's `torch.compile`d helpers run eagerly (vLLM "
        'Ascend\'s `simple_compile_backend = "eager"`)',
        when="_eager_world",
        applies="in an eager world (a compiled world keeps TorchDynamo on, as vLLM's CPU platform does)",
        check="_check_dynamo_switch",
    ),
)

#: The upstream methods the CPU world replaces on single instances of a model it built.
INSTANCE_BINDINGS: tuple[InstanceBinding, ...] = (
    InstanceBinding(
        signature(f"{_ATTENTION}.Attention.forward"),
        "ascend_eplb.world.stand_ins",
        "install_attention_stand_ins, on each Attention of a model the CPU world built: prefill-only causal "
        "SDPA",
    ),
    InstanceBinding(
        signature(f"{_MLA}.MLAAttention.forward"),
        "ascend_eplb.world.stand_ins",
        "install_attention_stand_ins, on each MLAAttention of a model the CPU world built: prefill-only "
        "causal SDPA over kv_b_proj's expansion",
    ),
    InstanceBinding(
        signature(f"{_ROUTED_EXPERTS}.RoutedExperts.get_expert_weights"),
        "ascend_eplb.world.quant_method",
        "install_ascend_routed_experts, on each RoutedExperts of a model the CPU world built whose method "
        "has a quant_views format: vllm-ascend's AscendRoutedExperts.get_expert_weights (the method's views)",
    ),
    InstanceBinding(
        signature(f"{_COMPILATION}.CompilationConfig.init_backend"),
        "ascend_eplb.world.compiled",
        "observe_compilation, on the CompilationConfig of a compiled world's model with the eager backend: "
        "TorchDynamo's eager backend that records each graph's inputs (dataplane's GraphObserver)",
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
    *(
        Attribute(_COMPILATION, "CompilationConfig", attr, "reads", (WORLD_COMPILED,), why)
        for attr, why in (
            ("mode", "only DYNAMO_TRACE_ONCE is observed"),
            ("backend", "only the eager backend is observed"),
        )
    ),
    Attribute(_CONTROLLER, "EPLBController", "state", "reads", (WORLD_SERVING,), "the world's EPLB state"),
    *(
        Attribute(_STATE, "EplbState", attr, "reads", (WORLD_SERVING,), why)
        for attr, why in (
            ("model_states", "the world's model"),
            ("async_worker", "`wait_for_transfer`: the worker is alive"),
            ("should_record_tensor", "whether a forward recorded load"),
        )
    ),
    *(
        Attribute(_STATE, _MODEL_STATE, attr, "reads", (WORLD_SERVING,), why)
        for attr, why in (
            ("physical_to_logical_map", "the placement in force: P, the committed layers, slot checks"),
            ("rebalanced", "`wait_for_transfer`: a cycle in flight"),
            ("pending_result", "`wait_for_transfer`: a layer published"),
            ("expert_load_pass", "the load a forward recorded"),
        )
    ),
    Attribute(
        _INTERFACES, "MixtureOfExperts", "moe_layers", "reads", (WORLD_SERVING,), "the model's MoE layers"
    ),
)


def patches_of(namespace: Mapping[str, Any]) -> tuple[Patch, ...]:
    """The :class:`~ascend_eplb.control.patching.Patch` es of :data:`STAND_INS`, in order, their functions
    taken from ``namespace`` (``stand_ins``' ``globals()``).

    Raises:
        KeyError: a function a row names is not in ``namespace``.
    """
    return tuple(entry.patch(namespace) for entry in STAND_INS)


def check() -> None:
    """Check every row of the CPU world: the signatures (in table order), then the attributes.

    Raises:
        RuntimeError: the first row that is missing, changed signature or lost an attribute the world
            reads since vLLM 0.33.0 / torch 2.13.0; the message names it.
    """
    check_signatures(SIGNATURES.values())
    for row in ATTRIBUTES:
        row.check()


def render() -> str:
    """The tables of every row, as Markdown (what ``UPSTREAM.md`` of this package holds)."""
    lines = [
        "# The CPU world's upstream surface",
        "",
        "What the CPU world (`ascend_eplb.world`) meets of upstream vLLM 0.33.0 and torch 2.13.0 where this "
        "CPU build of vLLM lacks a device kernel or collective, and what its serving worker reads. Generated "
        "from the rows of `ascend_eplb.world.upstream` (`python -m ascend_eplb.world.upstream > "
        "packages/eplb-world/UPSTREAM.md`); a test keeps this file equal to them. Never installed or checked "
        "by serving: `world.stand_ins.install_stand_ins` checks every row before it installs anything.",
        "",
        "## Module-level stand-ins (`STAND_INS`, in installation order)",
        "",
    ]
    lines += patch_table(STAND_INS)
    lines += ["", "## Methods replaced on single instances (`INSTANCE_BINDINGS`)", ""]
    lines += instance_binding_table(INSTANCE_BINDINGS)
    lines += ["", "## Attributes of upstream objects (`ATTRIBUTES`)", ""]
    lines += attribute_table(ATTRIBUTES)
    lines += ["", "## Signatures relied on (`SIGNATURES`: names, kinds, defaults)", ""]
    lines += signature_table(SIGNATURES.values())
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
