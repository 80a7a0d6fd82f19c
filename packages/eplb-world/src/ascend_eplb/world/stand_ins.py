"""CPU stand-ins for the device features vLLM 0.33.0 lacks on this host, and their installation.

Six, each the narrowest for what this build lacks (no ``vllm._C``), each checked against HF transformers
(``integration/tests/test_real_models.py``): 1 expert compute (:func:`register_torch_moe_method`,
:data:`MOE_DISPATCHES`), 2 attention (:func:`install_attention_stand_ins`), 3 16-bit linear layers, 5
variable-size collectives, 6 TorchDynamo off in an eager world (:func:`stand_in_patches`); 4, the cache
release, is the integration's host adaptation. What each replaces and why: the package README. Patches
are declared on their factories (``@upstream.SURFACE.replaces``, :data:`STAND_INS`); :func:`install_stand_ins`
checks the world's upstream rows, then installs; :func:`install_model_stand_ins` those of one built
model. The module imports vLLM: the engine world's general plugin imports it once vLLM knows its platform
(:mod:`~ascend_eplb.world.engine`'s import-order rule). Shapes: p local physical experts, T tokens, K
top-k, H hidden, I intermediate.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.distributed.parallel_state import get_dp_group, get_ep_group, get_tp_group
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from ascend_eplb.control.patching import Patch, PatchSet, patches_of
from ascend_eplb.quant_views import layer_weight_views
from ascend_eplb.world import upstream
from ascend_eplb.world.kernel_logs import attach_kernel_log, kernel_log
from ascend_eplb.world.quant_method import (
    apply_layer,
    install_ascend_routed_experts,
    lay_out_experts,
    register_ascend_quantization,
)

__all__ = [
    "MOE_DISPATCHES",
    "STAND_INS",
    "TorchFusedMoEMethod",
    "cpu_all_gatherv",
    "cpu_reduce_scatterv",
    "grouped_expert_compute",
    "install_attention_stand_ins",
    "install_model_stand_ins",
    "install_stand_ins",
    "register_torch_moe_method",
    "stand_in_patches",
]


# --- stand-in 1: expert compute -------------------------------------------------------------------

#: The expert method's dispatches: ``gather`` (vLLM's gather-before-route, the runner's) and
#: ``all-to-all`` (route-first: each rank routes its own rows; the method's all-to-all over Gloo).
MOE_DISPATCHES = ("gather", "all-to-all")


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SiLU-gated MLP: ``x (n, H)``, ``w13 (2I, H)``, ``w2 (H, I)`` -> ``(n, H)``."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def grouped_expert_compute(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor
) -> torch.Tensor:
    """This rank's routed-expert output, every local slot computed on every row and weighted by the row's
    selections of it: fixed shapes, no host read (TorchDynamo traces it whole).

    Args:
        x: ``(T, H)``; w13: ``(p, 2I, H)`` gate rows then up rows per local slot; w2: ``(p, H, I)``;
        topk_weights: ``(T, K)``; local_ids: integer ``(T, K)``, each selection's local slot or -1.

    Returns:
        ``(T, H)`` in ``x``'s dtype: the sum over slots ``s`` (ascending) of ``expert_s(x_t)`` times the row's
        weight of ``s`` (a row selects a slot at most once), zero without a local selection. Each GEMM runs
        over all T rows, so it differs from a per-slot loop by float32 rounding (CPU BLAS rounds 1-3-row
        GEMMs differently; ``test_stand_ins`` bounds it).
    """
    weights = topk_weights.to(x.dtype)
    out = torch.zeros_like(x)
    for slot in range(w13.shape[0]):
        row_weight = torch.where(local_ids == slot, weights, 0).sum(dim=1, keepdim=True)  # (T, 1)
        out = out + _expert(x, w13[slot], w2[slot]) * row_weight
    return out


def _all_to_all_experts(
    layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The route-first dispatch: this rank's rows ``x (T, H)`` with their physical ids ``(T, K)`` and
    weights ``(T, K)``; every selection is sent to the rank holding its slot, computed there, sent
    back and summed into its token. Returns ``(T, H)``, the rows' whole routed output.

    Raises:
        RuntimeError: a selection reached a rank whose ``expert_map`` does not hold its slot.
    """
    group = get_ep_group()
    pg, world = group.device_group, group.world_size
    w13, w2 = layer.w13_weight, layer.w2_weight
    p_local = int(w13.shape[0])
    rows = torch.arange(ids.shape[0]).repeat_interleave(ids.shape[1])
    flat, weights = ids.reshape(-1), topk_weights.reshape(-1)
    keep = flat >= 0
    flat, rows, weights = flat[keep], rows[keep], weights[keep]
    order = torch.argsort(flat // p_local, stable=True)  # grouped by destination rank
    flat, rows, weights = flat[order], rows[order], weights[order]
    send = torch.bincount(flat // p_local, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    send_n, recv_n = send.tolist(), recv.tolist()
    hidden = x.new_empty((sum(recv_n), x.shape[1]))
    dist.all_to_all_single(hidden, x[rows].contiguous(), recv_n, send_n, group=pg)
    got = flat.new_empty(sum(recv_n))
    dist.all_to_all_single(got, flat.contiguous(), recv_n, send_n, group=pg)
    slots = got if layer.expert_map is None else layer.expert_map.long()[got]
    if bool((slots < 0).any()):
        raise RuntimeError(
            f"all-to-all dispatch: physical ids {got[slots < 0].tolist()} are not on this rank"
        )
    computed = torch.zeros_like(hidden)
    for slot in torch.unique(slots).tolist():
        mine = (slots == slot).nonzero(as_tuple=True)[0]
        computed[mine] = _expert(hidden[mine], w13[slot], w2[slot])
    back = x.new_empty((len(rows), x.shape[1]))
    dist.all_to_all_single(back, computed, send_n, recv_n, group=pg)
    out = torch.zeros_like(x)
    out.index_add_(0, rows, back * weights.to(back.dtype).unsqueeze(-1))
    return out


class TorchFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Plain-torch routed-expert compute from the layer's own ``w13_weight`` / ``w2_weight``.

    ``apply`` takes the router's ``topk_ids`` ``(T, K)`` (physical ids, global P space) and
    ``topk_weights`` ``(T, K)`` float32 and returns ``(T, H)`` in ``x``'s dtype: the weighted sum of
    SiLU-gated expert outputs of the selections whose slot is local (``layer.expert_map``), zero for
    the others (:func:`grouped_expert_compute`). Weights stay as loaded (no kernel layout, no
    prepacking). Each call is logged in the layer's :class:`KernelLog` (:func:`kernel_log`).
    """

    #: :data:`MOE_DISPATCHES` entry of this process (install_stand_ins sets it before a model is built)
    dispatch: str = "gather"
    #: the quant_views format of a bf16/fp16 layer (set after loading); None for float32
    format_name: str | None = None

    @property
    def is_monolithic(self) -> bool:
        return False

    @property
    def supports_internal_mk(self) -> bool:
        # all-to-all: the method dispatches itself, so vLLM's runner routes this rank's rows only
        return type(self).dispatch == "all-to-all"

    def process_weights_after_loading(self, layer: Any) -> None:
        # float32 (CPU host only): keep the loaded (p, 2I, H) / (p, H, I) parameters, no kernel.
        # bf16/fp16: vllm-ascend's AscendUnquantizedFusedMoEMethod layout through quant_views.
        fmt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(layer.w13_weight.dtype)
        if fmt is not None:
            self.format_name = fmt
            lay_out_experts(layer, fmt, ("w13_weight", "w2_weight", "w13_bias", "w2_bias"))
        attach_kernel_log(layer)

    def get_eplb_weight_views(self, layer: Any) -> list[Any]:
        """vllm-ascend's contract (bf16/fp16 layers): quant_views ``layer_weight_views``."""
        return layer_weight_views(layer, self.format_name)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if layer.activation != MoEActivation.SILU:
            raise NotImplementedError(f"TorchFusedMoEMethod: activation {layer.activation} (only silu)")
        if layer.apply_router_weight_on_input:
            raise NotImplementedError("TorchFusedMoEMethod: apply_router_weight_on_input")
        ids = topk_ids.long()
        kernel_log(layer).record(ids)
        if type(self).dispatch == "all-to-all":
            if self.format_name is not None:
                raise NotImplementedError(f"the all-to-all dispatch stand-in: {self.format_name} experts")
            return _all_to_all_experts(layer, x, topk_weights, ids)
        if self.format_name is not None:
            return apply_layer(layer, self.format_name, x, topk_weights, ids)
        expert_map = layer.expert_map
        local = ids if expert_map is None else torch.where(ids >= 0, expert_map.long()[ids.clamp(min=0)], -1)
        return grouped_expert_compute(x, layer.w13_weight, layer.w2_weight, topk_weights, local)


def register_torch_moe_method() -> type:
    """Register :class:`TorchFusedMoEMethod` as vLLM's ``UnquantizedFusedMoEMethod`` (idempotent).

    Must run before the model is built: vLLM's CustomOp registry then instantiates it wherever a
    ``FusedMoE`` asks for the unquantized method. Returns the class.

    Raises:
        RuntimeError: another out-of-tree ``UnquantizedFusedMoEMethod`` is registered already.
    """
    current = op_registry_oot.get("UnquantizedFusedMoEMethod")
    if current is TorchFusedMoEMethod:
        return TorchFusedMoEMethod
    if current is not None:
        raise RuntimeError(f"UnquantizedFusedMoEMethod already has an out-of-tree replacement: {current!r}")
    UnquantizedFusedMoEMethod.register_oot(TorchFusedMoEMethod)
    return TorchFusedMoEMethod


# --- stand-in 3: 16-bit linear layers ------------------------------------------------------------


def _has_packed_linear() -> bool:
    try:
        return hasattr(torch.ops._C, "convert_weight_packed")
    except (AttributeError, RuntimeError):
        return False


@upstream.SURFACE.replaces(
    "vllm.model_executor.layers.utils.check_cpu_sgl_kernel",
    "False while `torch.ops._C` lacks `convert_weight_packed` (16-bit linear layers take vLLM's `F.linear` "
    "fallback), else upstream's",
    applies="always (float32 layers and hosts with that op unaffected)",
)
def _without_absent_sgl_kernel(original: Any) -> Any:
    @functools.wraps(original)
    def check_cpu_sgl_kernel(n: int, k: int, dtype: torch.dtype) -> bool:
        return _has_packed_linear() and original(n, k, dtype)

    return check_cpu_sgl_kernel


_STAND_IN_PATCHES: PatchSet | None = None


def stand_in_patches() -> PatchSet:
    """The ``PatchSet`` of this harness's upstream replacements (stand-ins 3, 5 and 6), built once from
    :data:`STAND_INS`."""
    global _STAND_IN_PATCHES
    if _STAND_IN_PATCHES is None:
        _STAND_IN_PATCHES = PatchSet(STAND_INS)
    return _STAND_IN_PATCHES


# --- stand-in 5: variable-size collectives -----------------------------------------------------------


def _group_sizes(communicator: Any, rows: int, sizes: list[int] | None, what: str) -> list[int]:
    """``sizes`` checked against the group (one per rank, this rank's equal to ``rows``), or equal
    sizes of ``rows`` when None."""
    world = communicator.world_size
    if sizes is None:
        return [rows] * world
    sizes = [int(n) for n in sizes]
    if len(sizes) != world or min(sizes) < 0:
        raise ValueError(
            f"{what}: sizes={sizes} must hold {world} row counts >= 0, one per rank of the group"
        )
    return sizes


def cpu_all_gatherv(
    communicator: Any, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: list[int] | None = None
) -> torch.Tensor | list[torch.Tensor]:
    """``all_gatherv`` of a ``CpuCommunicator`` over ``torch.distributed`` (stand-in 5).

    Args:
        communicator: the group's ``CpuCommunicator`` (``device_group``, ``world_size``, ``rank_in_group``).
        input_: this rank's rows ``(sizes[rank], ...)``, or a list of such tensors (each gathered alike).
        dim: 0 only (as vLLM's CUDA communicator); sizes: every rank's rows in group order, None: this rank's.

    Returns:
        ``(sum(sizes), ...)`` per input, same dtype and device: rank 0's rows, then rank 1's, ...

    Raises:
        NotImplementedError: ``dim`` is not 0.
        ValueError: ``sizes`` does not hold one count per rank, or this rank's tensor has other rows.
    """
    if dim != 0:
        raise NotImplementedError(f"all_gatherv stand-in: dim={dim}, only dim 0 is supported")
    tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
    out = []
    for x in tensors:
        counts = _group_sizes(communicator, int(x.shape[0]), sizes, "all_gatherv")
        if x.shape[0] != counts[communicator.rank_in_group]:
            raise ValueError(
                f"all_gatherv: rank {communicator.rank_in_group} holds {x.shape[0]} rows, sizes={counts} "
                f"says {counts[communicator.rank_in_group]}"
            )
        padded = x.new_zeros((max(counts), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=communicator.device_group)
        out.append(torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)]))
    return out[0] if isinstance(input_, torch.Tensor) else out


def cpu_reduce_scatterv(
    communicator: Any, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
) -> torch.Tensor:
    """``reduce_scatterv`` of a ``CpuCommunicator`` over ``torch.distributed`` (stand-in 5).

    Args:
        communicator: the group's ``CpuCommunicator``; input_: ``(sum(sizes), ...)`` along ``dim`` on every
            rank (not modified); dim: the dimension scattered (upstream passes 0); sizes: each rank's rows in
            group order, None: equal shares.

    Returns:
        the group's sum of the input's rows ``[sum(sizes[:rank]), sum(sizes[:rank + 1]))`` along ``dim``.

    Raises:
        ValueError: ``sizes`` does not hold one count per rank or add up to the input's rows, or (None) the
            rows do not divide by the group size.
    """
    dim = dim % input_.dim()
    total = int(input_.shape[dim])
    world, rank = communicator.world_size, communicator.rank_in_group
    if sizes is None and total % world:
        raise ValueError(f"reduce_scatterv: {total} rows do not divide by the group's {world} ranks")
    counts = _group_sizes(communicator, total // world, sizes, "reduce_scatterv")
    if sum(counts) != total:
        raise ValueError(
            f"reduce_scatterv: sizes={counts} add up to {sum(counts)}, the input has {total} rows"
        )
    reduced = input_.movedim(dim, 0).contiguous().clone()
    dist.all_reduce(reduced, group=communicator.device_group)
    start = sum(counts[:rank])
    return reduced[start : start + counts[rank]].movedim(0, dim).contiguous()


# The two collectives as torch custom ops of this world's namespace: a compiled forward (vLLM's CPU
# MoE runner is traced, gather-before-route dispatch included) records each as one opaque op whose
# output size is the sum of (or this rank's entry of) ``sizes``, unbacked symbols read from the forward
# context: no guard on their values. Eager forwards call the same ops.


def _group_of(group_name: str) -> Any:
    """The vLLM group (``GroupCoordinator``) of the DP, EP or TP group named ``group_name``."""
    for group in (get_dp_group(), get_ep_group(), get_tp_group()):
        if group.unique_name == group_name:
            return group
    raise RuntimeError(f"no DP, EP or TP group of vLLM is named {group_name!r}")


@torch.library.custom_op("ascend_eplb_world::all_gatherv", mutates_args=())
def _all_gatherv_op(x: torch.Tensor, sizes: list[int], group_name: str) -> torch.Tensor:
    return cpu_all_gatherv(_group_of(group_name).device_communicator, x, 0, sizes)


@_all_gatherv_op.register_fake
def _(x: torch.Tensor, sizes: list[int], group_name: str) -> torch.Tensor:
    return x.new_empty((sum(sizes), *x.shape[1:]))


@torch.library.custom_op("ascend_eplb_world::reduce_scatterv", mutates_args=())
def _reduce_scatterv_op(x: torch.Tensor, dim: int, sizes: list[int], group_name: str) -> torch.Tensor:
    return cpu_reduce_scatterv(_group_of(group_name).device_communicator, x, dim, sizes)


@_reduce_scatterv_op.register_fake
def _(x: torch.Tensor, dim: int, sizes: list[int], group_name: str) -> torch.Tensor:
    rank = _group_of(group_name).rank_in_group
    shape = list(x.shape)
    shape[dim % x.dim()] = sizes[rank]
    return x.new_empty(shape)


def _cpu_communicator_lacks(name: str) -> None:
    if name in vars(CpuCommunicator):
        raise RuntimeError(
            f"upstream CpuCommunicator now implements {name}: the harness's stand-in for it must go "
            "(ascend_eplb.world.stand_ins, stand-in 5)"
        )


def _check_cpu_communicator_lacks_all_gatherv(original: Any) -> None:
    _cpu_communicator_lacks("all_gatherv")


def _check_cpu_communicator_lacks_reduce_scatterv(original: Any) -> None:
    _cpu_communicator_lacks("reduce_scatterv")


_CPU_COMMUNICATOR_ONLY = "always (only a `CpuCommunicator` gets the stand-in; any other upstream's method)"


@upstream.SURFACE.replaces(
    "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase.all_gatherv",
    "a `CpuCommunicator`'s over `torch.distributed` (rows padded to the largest, gathered, concatenated in "
    "rank order); refused if `CpuCommunicator` defines its own",
    applies=_CPU_COMMUNICATOR_ONLY,
    check=_check_cpu_communicator_lacks_all_gatherv,
)
def _cpu_all_gatherv(original: Any) -> Any:
    @functools.wraps(original)
    def all_gatherv(self, input_, dim=0, sizes=None):
        if not isinstance(self, CpuCommunicator):
            return original(self, input_, dim, sizes)
        if dim != 0:
            raise NotImplementedError(f"all_gatherv stand-in: dim={dim}, only dim 0 is supported")
        tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
        counts = [t.shape[0] for t in tensors[:1]] * self.world_size if sizes is None else list(sizes)
        out = [_all_gatherv_op(t, counts, self.unique_name) for t in tensors]
        return out[0] if isinstance(input_, torch.Tensor) else out

    return all_gatherv


@upstream.SURFACE.replaces(
    "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase.reduce_scatterv",
    "a `CpuCommunicator`'s over `torch.distributed` (all-reduce, then this rank's rows); refused if "
    "`CpuCommunicator` defines its own",
    applies=_CPU_COMMUNICATOR_ONLY,
    check=_check_cpu_communicator_lacks_reduce_scatterv,
)
def _cpu_reduce_scatterv(original: Any) -> Any:
    @functools.wraps(original)
    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        if not isinstance(self, CpuCommunicator):
            return original(self, input_, dim, sizes)
        world, rows = self.world_size, input_.shape[dim]
        counts = [rows // world] * world if sizes is None else list(sizes)
        if sizes is None and rows % world:
            raise ValueError(f"reduce_scatterv: {rows} rows do not divide by the group's {world} ranks")
        return _reduce_scatterv_op(input_, dim, counts, self.unique_name)

    return reduce_scatterv


# --- stand-in 6: no compilation of vLLM's helper functions -------------------------------------------


#: The execution mode this process's stand-ins were installed for (None: not yet): ``True`` a compiled
#: world (TorchDynamo on), ``False`` an eager one (stand-in 6). One process serves one mode.
_COMPILED: bool | None = None


def _eager_world() -> bool:
    """``when`` of stand-in 6: the process serves eagerly (not a compiled world)."""
    return _COMPILED is not True


def _check_dynamo_switch(original: Any) -> None:
    if not isinstance(original, bool):
        raise RuntimeError(
            f"upstream torch._dynamo.config.disable is {original!r}, not a bool: the switch stand-in 6 "
            "sets is gone (ascend_eplb.world.stand_ins)"
        )


@upstream.SURFACE.replaces(
    ("torch._dynamo.config", "disable"),
    "True: TorchDynamo off for the process, so vLLM's `torch.compile`d helpers run eagerly (vLLM Ascend's "
    '`simple_compile_backend = "eager"`)',
    when=_eager_world,
    applies="in an eager world (a compiled world keeps TorchDynamo on, as vLLM's CPU platform does)",
    check=_check_dynamo_switch,
)
def _dynamo_disabled(original: bool) -> bool:
    return True  # vLLM Ascend's simple_compile_backend = "eager"


#: The module-level stand-ins (3, 5 and 6), in installation order; never serving's.
STAND_INS: tuple[Patch, ...] = patches_of(
    _without_absent_sgl_kernel, _cpu_all_gatherv, _cpu_reduce_scatterv, _dynamo_disabled
)


# --- stand-in 2: attention ------------------------------------------------------------------------


def _sdpa_attention(self: Any, query, key, value, output_shape=None, output_dtype=None):
    """Prefill-only causal SDPA, one sequence: query ``(T, heads * head_dim)``, key/value
    ``(T, kv_heads * head_dim)``."""
    t = query.shape[0]
    q = query.reshape(t, self.num_heads, self.head_size).transpose(0, 1)
    k = key.reshape(t, self.num_kv_heads, self.head_size).transpose(0, 1)
    v = value.reshape(t, self.num_kv_heads, self.head_size_v).transpose(0, 1)
    if self.num_kv_heads != self.num_heads:
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0)
        v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.impl.scale)
    o = o.transpose(0, 1).reshape(t, self.num_heads * self.head_size_v)
    return o.to(output_dtype or query.dtype)


def _sdpa_mla(self: Any, q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
    """Prefill-only causal MLA for one sequence: q ``(T, heads, nope + rope)`` (rotary applied),
    kv_c ``(T, kv_lora)``, k_pe ``(T, 1, rope)``; ``kv_b_proj`` expands kv_c to ``k_nope`` and ``v``."""
    t, heads = q.shape[0], self.num_heads
    kv = F.linear(kv_c_normed, self.kv_b_proj.weight).view(t, heads, self.qk_nope_head_dim + self.v_head_dim)
    k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(t, heads, k_pe.shape[-1])], dim=-1)
    o = F.scaled_dot_product_attention(
        q.view(t, heads, -1).transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=self.scale,
    )
    return o.transpose(0, 1).reshape(t, heads * self.v_head_dim)


def install_attention_stand_ins(model: torch.nn.Module) -> dict[str, int]:
    """Give each ``Attention`` / ``MLAAttention`` instance of ``model`` the prefill SDPA ``forward``.

    Returns:
        how many instances of each class got it, e.g. ``{"Attention": 2, "MLAAttention": 0}``.

    Raises:
        RuntimeError: the model has an attention layer of another class (it would run unadapted).
    """
    counts = {"Attention": 0, "MLAAttention": 0}
    for name, module in model.named_modules():
        if type(module) is Attention:
            module.forward = types.MethodType(_sdpa_attention, module)
            counts["Attention"] += 1
        elif type(module) is MLAAttention:
            module.forward = types.MethodType(_sdpa_mla, module)
            counts["MLAAttention"] += 1
        elif isinstance(module, AttentionLayerBase):
            raise RuntimeError(f"{name}: attention class {type(module).__name__} has no stand-in")
    return counts


# --- the installers ---------------------------------------------------------------------------------


def install_stand_ins(*, quantized: bool = False, dispatch: str = "gather", compiled: bool = False) -> None:
    """Install every process-wide stand-in, before a model is built (idempotent).

    Checks the world's upstream rows first (``ascend_eplb.world.upstream.SURFACE.check()``), then applies
    :func:`stand_in_patches` (3, 5 and 6; 6 not when ``compiled``: vLLM's TorchDynamo trace), registers the
    torch expert method with ``dispatch`` (:data:`MOE_DISPATCHES`) for every model built afterwards and, with
    ``quantized`` (an msModelSlim description), the ``"ascend"`` quantization stand-in.

    Raises:
        ValueError: an unknown ``dispatch``; ``all-to-all`` with ``quantized`` or ``compiled`` (its counts go
            to the host); ``compiled`` with ``quantized`` (that method reads the host: eager only).
        RuntimeError: an upstream row drifted (named; nothing installed), another out-of-tree method or
            ``"ascend"`` quantization is registered, or the stand-ins serve the other execution mode.
    """
    global _COMPILED
    if dispatch not in MOE_DISPATCHES:
        raise ValueError(f"dispatch={dispatch!r} must be one of {list(MOE_DISPATCHES)}")
    if dispatch == "all-to-all" and quantized:
        raise ValueError(
            "dispatch='all-to-all' stands in for float32 experts only, not a quantized checkpoint"
        )
    if compiled and (quantized or dispatch == "all-to-all"):
        what = "a quantized checkpoint" if quantized else "dispatch='all-to-all'"
        raise ValueError(
            f"a compiled world serves float32 experts with the gather dispatch, not {what} (that expert "
            "stand-in reads routing to the host: eager only)"
        )
    if _COMPILED is not None and compiled != _COMPILED:
        raise RuntimeError(
            f"this process's CPU stand-ins serve {'compiled' if _COMPILED else 'eager'} models; one process "
            "serves one execution mode (TorchDynamo's switch is process-wide)"
        )
    upstream.SURFACE.check()
    _COMPILED = compiled
    stand_in_patches().apply()
    register_torch_moe_method().dispatch = dispatch
    if quantized:
        register_ascend_quantization()


def install_model_stand_ins(model: torch.nn.Module) -> None:
    """The stand-ins of one built model: the attention ``forward`` s (:func:`install_attention_stand_ins`)
    and, for quantized experts, vllm-ascend's ``get_expert_weights``
    (``quant_method.install_ascend_routed_experts``).

    Raises:
        RuntimeError: the model has an attention layer of a class without a stand-in.
    """
    install_attention_stand_ins(model)
    install_ascend_routed_experts(model)
