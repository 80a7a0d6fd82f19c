"""vLLM Ascend's quantized experts on a CPU host: the ``"ascend"`` quantization, a FusedMoE method per format.

Stands in for what vLLM Ascend's ``--quantization ascend`` needs and this host lacks:
:class:`AscendQuantConfig` (registered by :func:`register_ascend_quantization` unless vLLM Ascend's is)
reads the msModelSlim description with vLLM's ``get_quant_config`` and gives each ``RoutedExperts`` a
:class:`QuantViewsFusedMoEMethod` of its format, which registers quant_views' ``checkpoint_layout``,
lays it out (:func:`lay_out_experts`, ``checkpoints.FORMAT_SWITCHES``), computes with quant_views'
reference kernel (:func:`apply_layer`) and answers ``get_eplb_weight_views``;
:func:`install_ascend_routed_experts` gives each such layer vLLM Ascend's ``get_expert_weights``. How, and
why EPLB-on logits are exact: the package README. The module imports vLLM (its classes subclass vLLM's):
the engine world's general plugin imports it once vLLM knows its platform
(:mod:`~ascend_eplb.world.engine`'s import-order rule). Shapes: E logical experts, p local physical
experts, T tokens, K top-k, H, I.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import (
    get_quantization_config,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from ascend_eplb.quant_views import FORMAT_SUPPORT, get_format, layer_storage, layer_weight_views
from ascend_eplb.world.checkpoints import DESCRIPTION_FILE, format_of_quant_type, format_switch
from ascend_eplb.world.kernel_logs import attach_kernel_log, kernel_log

__all__ = [
    "AscendQuantConfig",
    "QuantViewsFusedMoEMethod",
    "apply_layer",
    "install_ascend_routed_experts",
    "lay_out_experts",
    "register_ascend_quantization",
]

# --- the quantization config and the FusedMoE method ---------------------------------------------


class AscendQuantConfig(QuantizationConfig):
    """Stand-in for vllm-ascend's ``AscendQuantConfig`` (routed experts only).

    Attributes:
        quant_description: the msModelSlim description (name -> quant type), as vllm-ascend keeps it.
    """

    def __init__(self, quant_description: dict[str, Any]) -> None:
        super().__init__()
        self.quant_description = dict(quant_description)

    def get_name(self) -> str:
        return "ascend"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [DESCRIPTION_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AscendQuantConfig:
        return cls(config)

    def experts_format(self, prefix: str) -> str | None:
        """The quant_views format of the routed experts under ``prefix`` (None: ``FLOAT``).

        Raises:
            ValueError: the layer's experts mix quant types, or a type maps to no format.
        """
        types = {
            str(v).upper()
            for k, v in self.quant_description.items()
            if k.startswith(prefix + ".") and k.endswith(".weight")
        }
        types.discard("FLOAT")
        if len(types) > 1:
            raise ValueError(f"{prefix}: routed experts mix quant types {sorted(types)}")
        return format_of_quant_type(types.pop()) if types else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        if isinstance(layer, RoutedExperts):
            fmt = self.experts_format(prefix)
            return None if fmt is None else QuantViewsFusedMoEMethod(fmt, layer.moe_config)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None


class QuantViewsFusedMoEMethod(FusedMoEMethodBase):
    """A format's FusedMoE method: checkpoint parameters, Ascend layout, quant_views kernel.

    Args:
        fmt: a quant_views format name (``FORMAT_SUPPORT`` key).
        moe: the layer's ``FusedMoEConfig``.

    Attributes:
        format_name: ``fmt``; ``per_expert_lists``, ``fused_scales``: the layout chosen at
        ``create_weights`` from ``checkpoints.FORMAT_SWITCHES``.
    """

    def __init__(self, fmt: str, moe: Any) -> None:
        super().__init__(moe)
        if fmt not in FORMAT_SUPPORT:
            raise ValueError(f"format {fmt!r} is none of {sorted(FORMAT_SUPPORT)}")
        self.format_name = fmt
        self.per_expert_lists = format_switch("per_expert_lists")
        self.fused_scales = fmt == "w8a8_dynamic" and format_switch("fused_scales")
        self._layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    @property
    def supports_eplb(self) -> bool:
        return FORMAT_SUPPORT[self.format_name].supports_eplb

    @property
    def is_monolithic(self) -> bool:
        return False

    @property
    def format(self) -> Any:
        """The quant_views format (``UnsupportedFormatError`` with the reason for a rejected one)."""
        return get_format(self.format_name)

    def create_weights(
        self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra
    ) -> None:
        self._layout = self.format.checkpoint_layout(
            num_experts, hidden_size, intermediate_size_per_partition
        )
        for name, (shape, dtype) in self._layout.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra)
            if "scale" in name or "offset" in name:
                kind = (
                    FusedMoeWeightScaleSupported.CHANNEL
                    if shape[-1] == 1
                    else FusedMoeWeightScaleSupported.BLOCK
                )
                set_weight_attrs(param, {"quant_method": kind.value})

    def process_weights_after_loading(self, layer) -> None:
        lay_out_experts(layer, self.format_name, tuple(self._layout), fused_scales=self.fused_scales)
        attach_kernel_log(layer)

    def get_fused_moe_quant_config(self, layer) -> None:
        return None

    def get_eplb_weight_views(self, layer) -> list[Any]:
        """vllm-ascend's contract: every kernel tensor, expert-first (``layer_weight_views``)."""
        return layer_weight_views(layer, self.format)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        ids = topk_ids.long()
        kernel_log(layer).record(ids)
        path = "fused_mc2" if self.fused_scales else "standard"
        return apply_layer(layer, self.format_name, x, topk_weights, ids, path)


def lay_out_experts(
    layer: torch.nn.Module, fmt: str, names: tuple[str, ...], *, fused_scales: bool = False
) -> None:
    """``process_weights_after_loading`` of vllm-ascend's method for ``fmt``: the loaded checkpoint
    parameters ``names`` (absent ones skipped) replaced by the kernel tensors of quant_views
    ``storage_from_checkpoint``, as parameters (stacked) or ``<name>_list`` attributes (per-expert
    lists, when ``VLLM_ASCEND_ENABLE_NZ`` is on).

    Raises:
        ValueError: the loaded tensors do not match the format's checkpoint layout (quant_views' message).
    """
    loaded = {n: getattr(layer, n).data for n in names if getattr(layer, n, None) is not None}
    storage = get_format(fmt).storage_from_checkpoint(
        loaded,
        layer.hidden_size,
        layer.intermediate_size_per_partition,
        per_expert_lists=format_switch("per_expert_lists"),
        **({"fused_scales": True} if fused_scales else {}),
    )
    for name in loaded:
        delattr(layer, name)
    for name, t in {**storage.kernel_tensors, **storage.unread_tensors}.items():
        if storage.per_expert_lists:
            setattr(layer, name + "_list", t)
        else:
            layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    _keep_layer_storage(layer, fmt)


#: Attribute of a laid-out layer holding ``(format name, ExpertStorage, what it reads)``.
_STORAGE_ATTR = "_ascend_eplb_layer_storage"


def _keep_layer_storage(layer: torch.nn.Module, fmt: str) -> None:
    """Validate the layer's kernel tensors once (quant_views ``layer_storage``) and keep the storage,
    with the attribute objects it reads (and, for per-expert lists, their elements), for
    :func:`apply_layer`."""
    storage = layer_storage(layer, fmt)
    suffix = "_list" if storage.per_expert_lists else ""
    held = []
    for name in (*storage.kernel_tensors, *storage.unread_tensors):
        obj = getattr(layer, name + suffix)
        held.append((name + suffix, obj, tuple(obj) if storage.per_expert_lists else None))
    layer.__dict__[_STORAGE_ATTR] = (fmt, storage, tuple(held))


def _kept_layer_storage(layer: torch.nn.Module, fmt: str) -> Any:
    """The storage :func:`_keep_layer_storage` validated, after an identity check (no tensor data
    read): every attribute it reads still holds the very object (and list elements) it held then.

    Raises:
        RuntimeError: the layer was not laid out by :func:`lay_out_experts` for ``fmt``, or one of its
            kernel tensors was replaced since (EPLB moves expert weights in place, never by rebinding).
    """
    kept = layer.__dict__.get(_STORAGE_ATTR)
    if kept is None or kept[0] != fmt:
        raise RuntimeError(
            f"{type(layer).__name__} was not laid out for format {fmt!r} by lay_out_experts "
            f"(process_weights_after_loading); laid out for: {None if kept is None else kept[0]!r}"
        )
    _, storage, held = kept
    for attr, obj, items in held:
        now = getattr(layer, attr, None)
        if now is not obj or (
            items is not None
            and (len(now) != len(items) or any(a is not b for a, b in zip(now, items, strict=True)))
        ):
            raise RuntimeError(
                f"{type(layer).__name__}.{attr} was replaced after process_weights_after_loading: the kernel "
                "storage validated then no longer reads the layer's tensors (expert weights must be "
                "written in place)"
            )
    return storage


def apply_layer(
    layer: torch.nn.Module,
    fmt: str,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    comm_path: str = "standard",
) -> torch.Tensor:
    """The routed experts' output of this rank from the layer's own kernel tensors, each (token, k)
    selection computed on its own. The ``layer_storage`` over those tensors was validated when
    :func:`lay_out_experts` laid the layer out; a call only checks the layer still holds those very tensor
    objects (identity, no data read).

    Args:
        layer: a ``RoutedExperts`` laid out by :func:`lay_out_experts` (``expert_map``: int ``(P,)`` global
            physical id -> local row, -1 elsewhere, or None when every expert is local).
        fmt: its quant_views format name; comm_path: passed to ``apply``.
        x: ``(T, H)``; topk_weights: float32 ``(T, K)``; topk_ids: int64 ``(T, K)`` physical ids.

    Returns:
        ``(T, H)`` in ``x``'s dtype: per token its local selections' outputs added in ``k`` order (zero
        if none).

    Raises:
        RuntimeError: the layer was not laid out for ``fmt``, or a kernel tensor of it was rebound since.
    """
    fmt_ = get_format(fmt)
    storage = _kept_layer_storage(layer, fmt)
    expert_map = layer.expert_map
    local = (
        topk_ids
        if expert_map is None
        else torch.where(topk_ids >= 0, expert_map.long()[topk_ids.clamp(min=0)], -1)
    )
    out = torch.zeros_like(x)
    for k in range(local.shape[1]):
        for t in (local[:, k] >= 0).nonzero().flatten().tolist():
            y = fmt_.apply(
                storage,
                x[t : t + 1],
                topk_weights[t : t + 1, k : k + 1],
                local[t : t + 1, k : k + 1],
                comm_path=comm_path,
            )
            out[t] += y[0]
    return out


def register_ascend_quantization() -> type:
    """Register :class:`AscendQuantConfig` as vLLM quantization ``"ascend"`` (idempotent); return it.

    Raises:
        RuntimeError: another ``"ascend"`` quantization (vLLM Ascend's own) is registered already: then
            that one is what a model gets, and this stand-in must not be used.
    """
    try:
        current = get_quantization_config("ascend")
    except ValueError:
        current = None
    if current is AscendQuantConfig:
        return AscendQuantConfig
    if current is not None:
        raise RuntimeError(f"vLLM quantization 'ascend' is registered already: {current!r}")
    register_quantization_config("ascend")(AscendQuantConfig)
    return AscendQuantConfig


def install_ascend_routed_experts(model: torch.nn.Module) -> int:
    """Give each ``RoutedExperts`` whose method answers ``get_eplb_weight_views`` vllm-ascend's
    ``AscendRoutedExperts.get_expert_weights`` (the method's views), per instance. Returns how many."""
    count = 0
    for module in model.modules():
        if (
            isinstance(module, RoutedExperts)
            and getattr(module.quant_method, "format_name", None) is not None
        ):
            method = module.quant_method
            module.get_expert_weights = lambda m=module, q=method: q.get_eplb_weight_views(m)
            count += 1
    return count
