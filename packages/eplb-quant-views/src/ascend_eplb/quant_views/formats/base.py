"""Expert weight formats: storage in the Ascend kernel layout, its weight views, a CPU reference kernel.

Every supported format turns float checkpoint-layout weights ``w13 (p, 2I, H)`` (gate rows, then up rows)
and ``w2 (p, H, I)`` into the tensors vllm-ascend's fused MoE kernel reads after
``process_weights_after_loading`` (layouts and sources in each class docstring and in the README),
exposes exactly those tensors expert-first through `ExpertWeightFormat.weight_views`, and computes a fused
MoE from exactly those tensors in `ExpertWeightFormat.apply`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ascend_eplb.quant_views import _numerics as nx
from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views._tensor_list import ExpertTensorList
from ascend_eplb.quant_views._validate import validate_weight_views

__all__ = [
    "FORMAT_SUPPORT",
    "ExpertWeightFormat",
    "FormatSupport",
    "UnsupportedFormatError",
    "get_format",
    "supported_formats",
]


class UnsupportedFormatError(ValueError):
    """A quantization format (or format option) whose expert storage EPLB cannot move safely."""


@dataclass(frozen=True)
class FormatSupport:
    """One row of the EPLB weight-format support table.

    Attributes:
        name: format name as `get_format` takes it.
        supports_eplb: whether EPLB may be enabled with this format.
        reason: for a supported format, what moves; for a rejected one, why it is rejected.
        ascend_source: the vllm-ascend file and class whose layout this row describes.
    """

    name: str
    supports_eplb: bool
    reason: str
    ascend_source: str


class ExpertWeightFormat(abc.ABC):
    """One quantization format's expert storage, weight views and reference fused MoE kernel.

    Subclasses set ``name``, ``ascend_source``, ``error_bound``, the names of their kernel tensors and
    how each expert row is computed. Instances are stateless; get them with `get_format`.

    Attributes:
        name: format name (``bf16``, ``fp16``, ``w8a8_dynamic``, ``w4a8_dynamic``, ``mxfp8``, ``mxfp4``).
        supports_eplb: always True for a format `get_format` returns (rejected formats raise there).
        ascend_source: the vllm-ascend method whose post-loading layout `create_storage` reproduces.
        error_bound: documented bound on the relative Frobenius error of `apply` against a float64
            fused MoE on the unquantized weights (see `ascend_eplb.quant_views.reference.quantization_error`;
            measured values in the README).
    """

    name: ClassVar[str]
    supports_eplb: ClassVar[bool] = True
    ascend_source: ClassVar[str]
    error_bound: ClassVar[float]
    #: keyword options of `create_storage` beyond ``per_expert_lists``, with their defaults.
    _options: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    #: kernel tensors stored as a transpose(1, 2) strided view of an expert-first contiguous base.
    _transposed: ClassVar[frozenset[str]] = frozenset()
    #: (H, I) divisibility rules: list of (dimension letter, multiple, reason).
    _size_rules: ClassVar[tuple[tuple[str, int, str], ...]] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # ------------------------------------------------------------------ storage

    def create_storage(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        per_expert_lists: bool = False,
        **options: Any,
    ) -> ExpertStorage:
        """Quantize float checkpoint-layout weights into the tensors the Ascend kernel reads.

        Args:
            w13: floating ``(p, 2I, H)``: per expert the gate projection rows ``[:I]`` then the up
                projection rows ``[I:]`` (vLLM's ``w13_weight`` checkpoint layout).
            w2: floating ``(p, H, I)``: the down projection (vLLM's ``w2_weight``).
            per_expert_lists: False: each kernel tensor is one stacked ``(p, ...)`` tensor; True: each is
                an `ExpertTensorList` of ``p`` separately allocated tensors (vllm-ascend's ``*_list``
                attributes; what NZ-formatted weights need on NPU).
            **options: format options (see the subclass docstring), e.g. ``fused_scales`` for
                ``w8a8_dynamic``, ``w13_bias``/``w2_bias`` for ``bf16``/``fp16``.

        Returns:
            An `ExpertStorage` on ``w13.device``. Quantization is per expert (per channel or per block
            inside one expert), so an expert's storage rows do not depend on the other experts.

        Raises:
            ValueError: shapes, dtypes or devices inconsistent, ``H``/``I`` not a multiple the layout
                needs, non-finite weights.
            TypeError: an unknown option.
            UnsupportedFormatError: an option value EPLB cannot support (per-group ``w4a8_dynamic``).
        """
        p, hidden, inter = _check_float_weights(w13, w2)
        self.check_sizes(hidden, inter)
        unknown = sorted(set(options) - set(self._options))
        if unknown:
            raise TypeError(
                f"{self.name}.create_storage got unknown option(s) {unknown}; "
                f"known: {sorted(self._options) or 'none'}"
            )
        opts = {**self._options, **options}
        kernel, unread = self._quantize(w13, w2, p, opts)
        if per_expert_lists:
            kernel = {n: self._to_list(n, t) for n, t in kernel.items()}
            unread = {n: ExpertTensorList(r.clone() for r in t.unbind(0)) for n, t in unread.items()}
        return ExpertStorage(
            format_name=self.name,
            num_local_experts=p,
            hidden_size=hidden,
            intermediate_size=inter,
            per_expert_lists=per_expert_lists,
            kernel_tensors=MappingProxyType(kernel),
            unread_tensors=MappingProxyType(unread),
            options=MappingProxyType({k: opts[k] for k in self._public_options(opts)}),
        )

    def check_sizes(self, hidden_size: int, intermediate_size: int) -> None:
        """Check ``H`` and ``I`` against this format's layout, without building any storage.

        `create_storage` applies the same rules; callers that size weights up front (a simulator, a
        config check) call this before starting any work.

        Raises:
            ValueError: ``H`` or ``I`` is not a positive int, or not a multiple the layout needs
                (names the letter, the value, the multiple and why).
        """
        for letter, value in (("H", hidden_size), ("I", intermediate_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {letter}={value!r} must be a positive int")
        for letter, multiple, why in self._size_rules:
            value = hidden_size if letter == "H" else intermediate_size
            if value % multiple:
                raise ValueError(f"{self.name}: {letter}={value} must be a multiple of {multiple} ({why})")

    def _public_options(self, opts: Mapping[str, Any]) -> list[str]:
        return [k for k, v in opts.items() if not isinstance(v, torch.Tensor)]

    def _to_list(self, name: str, stacked: torch.Tensor) -> ExpertTensorList:
        rows = []
        for row in stacked.unbind(0):
            if name in self._transposed:
                rows.append(row.transpose(0, 1).contiguous().clone().transpose(0, 1))
            else:
                rows.append(row.contiguous().clone())
        return ExpertTensorList(rows)

    @abc.abstractmethod
    def _quantize(
        self, w13: torch.Tensor, w2: torch.Tensor, p: int, opts: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Stacked kernel tensors (kernel layout, in view order) and stacked unread tensors."""

    # ------------------------------------------------------------------ views

    def view_names(self, storage: ExpertStorage) -> list[str]:
        """vllm-ascend parameter names of `weight_views` entries (``*_list`` in per-expert-list mode)."""
        self._check_storage(storage)
        suffix = "_list" if storage.per_expert_lists else ""
        return [n + suffix for n in storage.kernel_tensors]

    def weight_views(self, storage: ExpertStorage) -> list[torch.Tensor | ExpertTensorList]:
        """Every per-expert tensor the kernel reads, expert-first, over the very same memory.

        Stacked mode: each entry is a ``(p, -1)`` view (``Tensor.view``, never a copy) of a kernel tensor,
        with any internal transpose undone first so each expert row is one contiguous block (MXFP:
        vllm-ascend ``w.transpose(1, 2)``). Per-expert-list mode: each entry is an `ExpertTensorList`
        of ``p`` 1-D views, element ``e`` over expert ``e``'s tensor. Order and names: `view_names`.
        Tensors the kernel does not read (W8A8 offsets) are not included.

        Raises:
            ValueError: ``storage`` was built by another format, or the views break the contract
                (`validate_weight_views`).
        """
        self._check_storage(storage)
        p = storage.num_local_experts
        views: list[torch.Tensor | ExpertTensorList] = []
        for name, t in storage.kernel_tensors.items():
            if isinstance(t, ExpertTensorList):
                views.append(ExpertTensorList(self._row_base(name, r).view(-1) for r in t))
            else:
                base = t.transpose(1, 2) if name in self._transposed else t
                views.append(base.view(p, -1))
        validate_weight_views(views, p, names=self.view_names(storage))
        return views

    def _row_base(self, name: str, row: torch.Tensor) -> torch.Tensor:
        """One expert's kernel tensor with its transpose undone (a view)."""
        return row.transpose(0, 1) if name in self._transposed else row

    def validate(self, storage: ExpertStorage) -> None:
        """`validate_weight_views` on `weight_views` (raises ``ValueError`` naming the tensor)."""
        self.weight_views(storage)

    def _check_storage(self, storage: ExpertStorage) -> None:
        if not isinstance(storage, ExpertStorage):
            raise ValueError(f"expected an ExpertStorage, got {type(storage).__name__}")
        if storage.format_name != self.name:
            raise ValueError(f"storage was built by format {storage.format_name!r}, not {self.name!r}")

    # ------------------------------------------------------------------ reference kernel

    def apply(
        self,
        storage: ExpertStorage,
        hidden_TH: torch.Tensor,  # noqa: N803 (DESIGN §2 shape letters)
        topk_weights_TK: torch.Tensor,  # noqa: N803 (DESIGN §2 shape letters)
        local_ids_TK: torch.Tensor,  # noqa: N803 (DESIGN §2 shape letters)
        *,
        comm_path: str = "standard",
    ) -> torch.Tensor:
        """CPU reference fused MoE reading only ``storage.kernel_tensors``.

        ``out[t] = sum_k topk_weights[t, k] * down(silu(gate(x_t)) * up(x_t))`` with the expert of local
        row ``local_ids[t, k]``; entries with ``local_ids == -1`` (expert not on this rank) contribute 0.
        Weights are dequantized from the kernel tensors exactly as the format's docstring says;
        activations are quantized at run time where the kernel does (per-token int8 for W8A8/W4A8,
        MX blocks for MXFP). Arithmetic is float64 (integer GEMMs run exactly, in float32 where every
        partial sum fits); the same inputs give bit-identical outputs, and an expert's result depends
        only on its storage rows and the tokens routed to it (not on other experts or its row index).
        All selections are computed together: kernel tensors of the experts present are read once per
        call (README "Reference kernel speed").

        Args:
            storage: built by this format.
            hidden_TH: floating ``(T, H)``.
            topk_weights_TK: floating ``(T, K)``.
            local_ids_TK: integer ``(T, K)``, values in ``[-1, p)``.
            comm_path: ``"standard"`` (grouped-matmul path) or, for ``w8a8_dynamic`` storage built with
                ``fused_scales=True``, ``"fused_mc2"`` (reads ``fused_w1_scale``/``fused_w2_scale``).

        Returns:
            ``(T, H)`` in ``hidden_TH.dtype``.

        Raises:
            ValueError: wrong shapes/dtypes/devices, ids outside ``[-1, p)``, unknown ``comm_path``.
        """
        self._check_storage(storage)
        _check_apply_inputs(storage, hidden_TH, topk_weights_TK, local_ids_TK)
        fused = self._fused_scales_path(storage, comm_path)
        x = hidden_TH.to(torch.float64)
        out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        sel = _Selection.of(local_ids_TK, topk_weights_TK)
        if sel is not None:
            # Experts in chunks whose dequantized float64 weights (3*H*I each) stay cache-sized.
            per_chunk = max(1, _CHUNK_BYTES // (24 * storage.hidden_size * storage.intermediate_size))
            y = torch.cat([self._forward_selected(storage, x, part, fused) for part in sel.split(per_chunk)])
            out.index_add_(0, sel.token, y * sel.weight.unsqueeze(1))
        return out.to(hidden_TH.dtype)

    def _fused_scales_path(self, storage: ExpertStorage, comm_path: str) -> bool:
        """Whether ``comm_path`` reads the fused int64 scales; raises ``ValueError`` for a bad path."""
        if comm_path != "standard":
            raise ValueError(f"{self.name}: comm_path={comm_path!r} is not supported; use 'standard'")
        return False

    def _selected_rows(self, storage: ExpertStorage, name: str, sel: _Selection) -> torch.Tensor:
        """Kernel tensor ``name`` of the experts present in ``sel``, ``(E, ...)`` in ``sel.rows`` order.

        Read from the kernel tensors themselves (one ``index_select`` of the stacked tensor, or one
        ``torch.stack`` of the list elements), with any internal transpose undone: a fresh copy of the
        current bytes, so moves through the views are seen by the next call.
        """
        t = storage.kernel_tensors[name]
        if isinstance(t, ExpertTensorList):
            return torch.stack([self._row_base(name, t[row]) for row in sel.rows_list])
        base = t.transpose(1, 2) if name in self._transposed else t
        return base.index_select(0, sel.rows)

    @abc.abstractmethod
    def _forward_selected(
        self, storage: ExpertStorage, x: torch.Tensor, sel: _Selection, fused: bool
    ) -> torch.Tensor:
        """Expert outputs ``(S, H)`` float64 of x (T, H) for the S selections of ``sel``, in its order."""


# ====================================================================== helpers


def _check_float_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    for label, t in (("w13", w13), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{label} must be floating point (checkpoint weights), got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"{label} must be 3-D, got shape {tuple(t.shape)}")
    p, two_i, hidden = w13.shape
    if p < 1 or hidden < 1 or two_i < 2 or two_i % 2:
        raise ValueError(f"w13 must be (p, 2I, H) with p, I, H >= 1, got shape {tuple(w13.shape)}")
    inter = two_i // 2
    if tuple(w2.shape) != (p, hidden, inter):
        raise ValueError(
            f"w2 must be (p, H, I) = {(p, hidden, inter)} to match w13 {tuple(w13.shape)}, "
            f"got {tuple(w2.shape)}"
        )
    if w13.device != w2.device:
        raise ValueError(f"w13 is on {w13.device} but w2 is on {w2.device}")
    for label, t in (("w13", w13), ("w2", w2)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{label} contains non-finite values")
    return p, hidden, inter


def _check_apply_inputs(storage: ExpertStorage, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> None:
    h = storage.hidden_size
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h or not x.is_floating_point():
        raise ValueError(f"hidden_TH must be floating (T, H={h}), got {getattr(x, 'shape', x)!r}")
    t = x.shape[0]
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] != t or not w.is_floating_point():
        raise ValueError(f"topk_weights_TK must be floating (T={t}, K), got {getattr(w, 'shape', w)!r}")
    if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != tuple(w.shape):
        raise ValueError(
            f"local_ids_TK must have the shape of topk_weights_TK {tuple(w.shape)}, "
            f"got {getattr(ids, 'shape', ids)!r}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"local_ids_TK must be an integer tensor, got {ids.dtype}")
    for label, other in (("topk_weights_TK", w), ("local_ids_TK", ids)):
        if other.device != x.device:
            raise ValueError(f"{label} is on {other.device} but hidden_TH is on {x.device}")
    if storage.device != x.device:
        raise ValueError(f"storage is on {storage.device} but hidden_TH is on {x.device}")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= storage.num_local_experts:
            raise ValueError(
                f"local_ids_TK values must be in [-1, p={storage.num_local_experts}), got min {lo} max {hi}"
            )


#: Elements below which a TensorIterator kernel runs on one thread (ATen ``internal::GRAIN_SIZE``).
_SERIAL_NUMEL = 32768
#: Dequantized weights computed at once by `ExpertWeightFormat.apply` (bytes, float64): beyond this,
#: experts go in several chunks (one Python iteration each), which keeps large layers cache-friendly.
_CHUNK_BYTES = 8 << 20


def _silu_and_mul(h: torch.Tensor, inter: int) -> torch.Tensor:
    """``SiLU(h[:, :I]) * h[:, I:]`` for h (n, 2I), each row computed alone.

    ATen's SiLU runs SIMD over whole vectors and a scalar ``std::exp`` on a loop's tail, which round
    differently. ``h[:, :I]`` cannot be coalesced, so each row is its own inner loop (same SIMD/tail
    split for every row); calls are cut into row chunks under ATen's grain size so no thread boundary
    falls inside a row. A row's result therefore never depends on the other rows.
    """
    rows = max(1, _SERIAL_NUMEL // max(inter, 1) - 1)
    if h.shape[0] <= rows:
        return F.silu(h[:, :inter]) * h[:, inter:]
    return torch.cat([F.silu(c[:, :inter]) * c[:, inter:] for c in h.split(rows)])


@dataclass(frozen=True)
class _Selection:
    """The (token, k) selections of one `ExpertWeightFormat.apply` call routed to a local row.

    Sorted by local row, then by flat index ``t * K + k`` (the order of the per-row loop this replaces),
    so each expert's selections form one contiguous segment.

    Attributes:
        token: int64 (S,) token of each selection.
        weight: float64 (S,) its top-k weight.
        group: int64 (S,) index into ``rows`` of its expert.
        rows: int64 (E,) the distinct local rows present, ascending.
        rows_list: ``rows`` as Python ints.
        counts: selections per present row (E ints), segment lengths.
    """

    token: torch.Tensor
    weight: torch.Tensor
    group: torch.Tensor
    rows: torch.Tensor
    rows_list: list[int]
    counts: list[int]

    @staticmethod
    def of(local_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> _Selection | None:  # noqa: N803
        flat = local_ids_TK.reshape(-1).to(torch.int64)
        chosen = (flat >= 0).nonzero().squeeze(1)  # ascending flat index
        if chosen.numel() == 0:
            return None
        row_sorted, perm = torch.sort(flat[chosen], stable=True)
        order = chosen[perm]
        rows, counts = torch.unique_consecutive(row_sorted, return_counts=True)
        count_list = counts.tolist()
        return _Selection(
            token=order // local_ids_TK.shape[1],
            weight=topk_weights_TK.reshape(-1)[order].to(torch.float64),
            group=torch.repeat_interleave(torch.arange(len(count_list), device=flat.device), counts),
            rows=rows,
            rows_list=rows.tolist(),
            counts=count_list,
        )

    def split(self, experts: int) -> list[_Selection]:
        """Consecutive sub-selections of at most ``experts`` present rows each (order kept)."""
        if len(self.counts) <= experts:
            return [self]
        parts, start = [], 0
        for first in range(0, len(self.counts), experts):
            counts = self.counts[first : first + experts]
            stop = start + sum(counts)
            parts.append(
                _Selection(
                    token=self.token[start:stop],
                    weight=self.weight[start:stop],
                    group=self.group[start:stop] - first,
                    rows=self.rows[first : first + experts],
                    rows_list=self.rows_list[first : first + experts],
                    counts=counts,
                )
            )
            start = stop
        return parts


def _grouped_mm(
    a: torch.Tensor, w: torch.Tensor, sel: _Selection, *, int_bound: int | None = None
) -> torch.Tensor:
    """Segment-wise ``a[seg_e] @ w[e]``: a (S, K) in ``sel`` order, w (E, K, N) -> float64 (S, N).

    Float operands (``int_bound=None``; a and w float64): one ``torch.mm`` per present expert over
    exactly its selections, the GEMM the per-expert reference always ran. CPU BLAS rounding depends
    on the row count M (MKL: measured), so batching other experts' rows into one padded GEMM would
    change the bits.

    Integer-valued operands (W8A8/W4A8; ``int_bound`` bounds ``|a_ik * w_kn|``): every partial sum is
    an integer below ``K * int_bound``, so no summation order rounds. One ``torch.bmm`` over
    zero-padded segments then gives exactly the same values, in float32 when ``K * int_bound <= 2**24``
    (every integer up to 2**24 is a float32) and in float64 (exact up to 2**53) otherwise.
    """
    num_groups = len(sel.counts)
    if int_bound is None:
        out = a.new_empty(a.shape[0], w.shape[2])
        start = 0
        for g, n in enumerate(sel.counts):
            torch.mm(a[start : start + n], w[g], out=out[start : start + n])
            start += n
        return out
    dtype = torch.float32 if a.shape[1] * int_bound <= 2**24 else torch.float64
    if a.shape[1] * int_bound > 2**53:
        raise ValueError(f"integer GEMM with K={a.shape[1]} and |a*w| <= {int_bound} is not exact in float64")
    a, w = a.to(dtype), w.to(dtype)
    if num_groups == 1:
        return torch.mm(a, w[0]).to(torch.float64)
    starts = torch.cumsum(torch.tensor([0, *sel.counts[:-1]], device=a.device), 0)
    pos = torch.arange(a.shape[0], device=a.device) - starts[sel.group]
    padded = a.new_zeros(num_groups, max(sel.counts), a.shape[1])
    padded[sel.group, pos] = a
    return torch.bmm(padded, w)[sel.group, pos].to(torch.float64)


#: ``|a * w|`` bounds of the integer GEMMs: int8 activations (|q| <= 127) times int8 / int4 weights.
_INT8_X_INT8 = 127 * 128
_INT4_X_INT4 = 8 * 8


# ====================================================================== formats


class _UnquantizedFormat(ExpertWeightFormat):
    """Unquantized experts (vllm-ascend ``routed_experts.py`` ``AscendUnquantizedFusedMoEMethod``).

    Kernel tensors (``process_weights_after_loading``: ``transpose(1, 2).contiguous()`` for the grouped
    matmul, then optionally NZ on NPU):

    ============ =========== ===========
    name         shape       dtype
    ============ =========== ===========
    w13_weight   (p, H, 2I)  bf16 / fp16
    w2_weight    (p, I, H)   bf16 / fp16
    w13_bias     (p, 2I)     bf16 / fp16, only with option ``w13_bias`` (float (p, 2I))
    w2_bias      (p, H)      bf16 / fp16, only with option ``w2_bias`` (float (p, H))
    ============ =========== ===========

    Views: all of them (``get_eplb_weight_views``: ``[w13_weight, w2_weight] (+ w13_bias, w2_bias)``).
    Reference: ``h = x @ w13_weight[e] + w13_bias[e]``, SiLU(gate) * up rounded to the weight dtype,
    ``y = a @ w2_weight[e] + w2_bias[e]``.
    """

    dtype: ClassVar[torch.dtype]
    ascend_source = "vllm_ascend/ops/fused_moe/routed_experts.py AscendUnquantizedFusedMoEMethod"
    _options = MappingProxyType({"w13_bias": None, "w2_bias": None})

    def _public_options(self, opts: Mapping[str, Any]) -> list[str]:
        return []

    def _quantize(self, w13, w2, p, opts):
        kernel = {
            "w13_weight": w13.transpose(1, 2).to(self.dtype).contiguous(),
            "w2_weight": w2.transpose(1, 2).to(self.dtype).contiguous(),
        }
        inter, hidden = w2.shape[2], w2.shape[1]
        for name, shape in (("w13_bias", (p, 2 * inter)), ("w2_bias", (p, hidden))):
            bias = opts[name]
            if bias is None:
                continue
            if (
                not isinstance(bias, torch.Tensor)
                or tuple(bias.shape) != shape
                or not bias.is_floating_point()
            ):
                raise ValueError(
                    f"{self.name}: {name} must be a floating tensor of shape {shape}, "
                    f"got {getattr(bias, 'shape', bias)!r}"
                )
            if bias.device != w13.device:
                raise ValueError(f"{self.name}: {name} is on {bias.device}, weights on {w13.device}")
            kernel[name] = bias.to(self.dtype).contiguous()
        return kernel, {}

    def _forward_selected(self, storage, x, sel, fused):
        kt = storage.kernel_tensors
        inter = storage.intermediate_size
        dt = self.dtype
        w13 = self._selected_rows(storage, "w13_weight", sel).to(torch.float64)  # (E, H, 2I)
        w2 = self._selected_rows(storage, "w2_weight", sel).to(torch.float64)  # (E, I, H)
        h = _grouped_mm(
            x.to(dt).to(torch.float64)[sel.token],
            w13,
            sel,
        )
        if "w13_bias" in kt:
            h = h + self._selected_rows(storage, "w13_bias", sel).to(torch.float64)[sel.group]
        a = _silu_and_mul(h, inter).to(dt).to(torch.float64)
        y = _grouped_mm(
            a,
            w2,
            sel,
        )
        if "w2_bias" in kt:
            y = y + self._selected_rows(storage, "w2_bias", sel).to(torch.float64)[sel.group]
        return y


class Bf16Format(_UnquantizedFormat):
    __doc__ = _UnquantizedFormat.__doc__
    name = "bf16"
    dtype = torch.bfloat16
    error_bound = 1e-2


class Fp16Format(_UnquantizedFormat):
    __doc__ = _UnquantizedFormat.__doc__
    name = "fp16"
    dtype = torch.float16
    error_bound = 2e-3


class W8A8DynamicFormat(ExpertWeightFormat):
    """W8A8 dynamic (vllm-ascend ``w8a8_dynamic.py`` ``AscendW8A8DynamicFusedMoEMethod``).

    Int8 weights, symmetric per output channel; activations quantized per token at run time
    (``npu_dynamic_quant``), also between the two GEMMs.

    ===================== =========== ========= =========================================
    name                  shape       dtype     note
    ===================== =========== ========= =========================================
    w13_weight            (p, H, 2I)  int8      transposed for the grouped matmul
    w2_weight             (p, I, H)   int8
    w13_weight_scale_fp32 (p, 2I)     float32   per output channel
    w2_weight_scale       (p, H)      float32   per output channel
    fused_w1_scale        (p, 2I)     int64     option ``fused_scales=True``: float32 bits, zero-extended
    fused_w2_scale        (p, H)      int64     (``scale_from_float_to_int64``; fused MC2 / MegaMoE path)
    ===================== =========== ========= =========================================

    Unread (not views): ``w13_weight_offset`` (p, 2I) and ``w2_weight_offset`` (p, H) float32 zeros.
    Views: ``[w13_weight, w2_weight, w13_weight_scale_fp32, w2_weight_scale] (+ fused_w1_scale,
    fused_w2_scale)``; the fused pair is both-or-neither.
    Reference: ``h = (q(x) @ w13_weight[e]) * s_x * scale13``; SiLU(gate) * up; ``y = (q(a) @ w2_weight[e])
    * s_a * scale2``; ``comm_path="fused_mc2"`` takes the scales from the fused int64 words instead.
    """

    name = "w8a8_dynamic"
    ascend_source = "vllm_ascend/quantization/methods/w8a8_dynamic.py AscendW8A8DynamicFusedMoEMethod"
    error_bound = 5e-2
    _options = MappingProxyType({"fused_scales": False})

    def _quantize(self, w13, w2, p, opts):
        if not isinstance(opts["fused_scales"], bool):
            raise ValueError(f"w8a8_dynamic: fused_scales must be a bool, got {opts['fused_scales']!r}")
        q13, s13 = nx.quantize_per_channel(w13, 127)  # (p, 2I, H), (p, 2I)
        q2, s2 = nx.quantize_per_channel(w2, 127)  # (p, H, I), (p, H)
        kernel = {
            "w13_weight": q13.transpose(1, 2).contiguous(),
            "w2_weight": q2.transpose(1, 2).contiguous(),
            "w13_weight_scale_fp32": s13.contiguous(),
            "w2_weight_scale": s2.contiguous(),
        }
        if opts["fused_scales"]:
            kernel["fused_w1_scale"] = nx.float_to_scale_word(s13)
            kernel["fused_w2_scale"] = nx.float_to_scale_word(s2)
        unread = {"w13_weight_offset": torch.zeros_like(s13), "w2_weight_offset": torch.zeros_like(s2)}
        return kernel, unread

    def _fused_scales_path(self, storage, comm_path):
        if comm_path == "standard":
            return False
        if comm_path == "fused_mc2":
            if "fused_w1_scale" not in storage.kernel_tensors:
                raise ValueError(
                    "w8a8_dynamic: comm_path='fused_mc2' needs storage built with fused_scales=True"
                )
            return True
        raise ValueError(
            f"w8a8_dynamic: comm_path={comm_path!r} is not supported; use 'standard' or 'fused_mc2'"
        )

    def _forward_selected(self, storage, x, sel, fused):
        inter = storage.intermediate_size
        w13 = self._selected_rows(storage, "w13_weight", sel)  # int8 (E, H, 2I)
        w2 = self._selected_rows(storage, "w2_weight", sel)  # int8 (E, I, H)
        if fused:
            s13 = nx.scale_word_to_float(self._selected_rows(storage, "fused_w1_scale", sel))
            s2 = nx.scale_word_to_float(self._selected_rows(storage, "fused_w2_scale", sel))
        else:
            s13 = self._selected_rows(storage, "w13_weight_scale_fp32", sel)
            s2 = self._selected_rows(storage, "w2_weight_scale", sel)
        s13, s2 = s13.to(torch.float64)[sel.group], s2.to(torch.float64)[sel.group]  # (S, 2I), (S, H)
        xq, xs = nx.quantize_per_token(x)  # per token, as npu_dynamic_quant
        xq, xs = xq[sel.token], xs[sel.token]
        h = _grouped_mm(xq, w13, sel, int_bound=_INT8_X_INT8) * xs.unsqueeze(1) * s13
        aq, as_ = nx.quantize_per_token(_silu_and_mul(h, inter))
        return _grouped_mm(aq, w2, sel, int_bound=_INT8_X_INT8) * as_.unsqueeze(1) * s2


class W4A8DynamicFormat(ExpertWeightFormat):
    """W4A8 dynamic, per-channel (vllm-ascend ``w4a8.py`` ``AscendW4A8DynamicFusedMoEMethod``).

    Int4 weights, symmetric per output channel (values -8..7), packed two per int8 along the output
    dimension N (element 2j low nibble, ``_pack_int4_to_int8``), read by the kernel as int32
    (``_pack_to_int32``; list mode keeps int8 tensors and views them as int32 per call).

    ============== ================================= ======= =================================
    name           shape (stacked)                   dtype   note
    ============== ================================= ======= =================================
    w13_weight     (p, H, I/4)  [list: (H, I) int8]  int32   packed (p, H, 2I) int4
    w2_weight      (p, I, H/8)  [list: (I, H/2)]     int32   packed (p, I, H) int4
    w13_weight_scale (p, 2I)                         int64   float32 bits zero-extended (``_process_scale``)
    w2_weight_scale  (p, 1, H)                       int64   kept unsqueezed for npu_grouped_matmul
    w13_scale_bias (p, 2I)                           float32 ``8 * sum_k w[k, n] * scale[n]``
    w2_scale_bias  (p, H)                            float32 (``update_bias_compressed_tensors``)
    ============== ================================= ======= =================================

    Views: all six (``get_eplb_weight_views``; the scale_bias pair is both-or-neither).
    Needs ``I % 4 == 0`` and ``H % 8 == 0`` (int32 view of packed int8). Per-group quantization
    (option ``group_size > 0``) raises `UnsupportedFormatError` (vllm-ascend rejects it for EPLB).
    Reference: activations int8 per token; the int8 x int4 GEMM is modelled as the split
    ``x = 16 * hi + (lo - 8) + 8`` (``hi = x >> 4``, ``lo = x & 15``) into two int4 GEMMs plus the
    constant term, which is exactly ``scale_bias``:
    ``h = s_x * (scale * (16 * hi @ w + (lo - 8) @ w) + scale_bias)``; likewise for w2. (That the kernel's
    ``weight_assist_matrix`` corrects for this offset is our reading of the bias formula; the kernel
    internals are not public.)
    """

    name = "w4a8_dynamic"
    ascend_source = "vllm_ascend/quantization/methods/w4a8.py AscendW4A8DynamicFusedMoEMethod"
    error_bound = 0.32
    _options = MappingProxyType({"group_size": 0})
    _size_rules = (
        ("I", 4, "w13_weight packs 2I int4 into I int8, read as int32"),
        ("H", 8, "w2_weight packs H int4 into H/2 int8, read as int32"),
    )

    def _quantize(self, w13, w2, p, opts):
        check_w4a8_group_size(opts["group_size"])
        q13, s13 = nx.quantize_per_channel(w13, 7)  # (p, 2I, H) int8 in [-8, 7], (p, 2I)
        q2, s2 = nx.quantize_per_channel(w2, 7)  # (p, H, I), (p, H)
        k13 = q13.transpose(1, 2).contiguous()  # (p, H, 2I)  [E, K, N]
        k2 = q2.transpose(1, 2).contiguous()  # (p, I, H)
        bias13 = 8.0 * (k13.to(torch.float64) * s13.to(torch.float64).unsqueeze(1)).sum(dim=1)
        bias2 = 8.0 * (k2.to(torch.float64) * s2.to(torch.float64).unsqueeze(1)).sum(dim=1)
        kernel = {
            "w13_weight": nx.pack_int4(k13).view(torch.int32),
            "w2_weight": nx.pack_int4(k2).view(torch.int32),
            "w13_weight_scale": nx.float_to_scale_word(s13),
            "w2_weight_scale": nx.float_to_scale_word(s2).unsqueeze(1).contiguous(),
            "w13_scale_bias": bias13.to(torch.float32),
            "w2_scale_bias": bias2.to(torch.float32),
        }
        return kernel, {}

    def _to_list(self, name, stacked):
        if name in ("w13_weight", "w2_weight"):
            # vllm-ascend keeps per-expert int8 clones and views them as int32 for each call.
            return ExpertTensorList(r.view(torch.int8).clone() for r in stacked.unbind(0))
        return super()._to_list(name, stacked)

    def _forward_selected(self, storage, x, sel, fused):
        inter = storage.intermediate_size
        num = len(sel.rows_list)

        def weight(name: str) -> torch.Tensor:  # int32 (E, K, N/8) or int8 list rows -> int8 (E, K, N)
            return nx.unpack_int4(self._selected_rows(storage, name, sel).contiguous().view(torch.int8))

        def per_selection(name: str, decode: bool) -> torch.Tensor:  # (E, ...) -> float64 (S, N)
            t = self._selected_rows(storage, name, sel)
            t = nx.scale_word_to_float(t) if decode else t
            return t.reshape(num, -1).to(torch.float64)[sel.group]

        w13, w2 = weight("w13_weight"), weight("w2_weight")  # (E, H, 2I), (E, I, H)
        s13, s2 = per_selection("w13_weight_scale", True), per_selection("w2_weight_scale", True)
        b13, b2 = per_selection("w13_scale_bias", False), per_selection("w2_scale_bias", False)

        def gemm(xq: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            hi = torch.floor(xq / 16.0)
            lo_s = xq - 16.0 * hi - 8.0
            hi_w = _grouped_mm(hi, w, sel, int_bound=_INT4_X_INT4)  # hi, lo - 8 in [-8, 7]
            lo_w = _grouped_mm(lo_s, w, sel, int_bound=_INT4_X_INT4)
            return s * (16.0 * hi_w + lo_w) + b

        xq, xs = nx.quantize_per_token(x)  # per token, as npu_dynamic_quant
        xq, xs = xq[sel.token], xs[sel.token]
        h = gemm(xq, w13, s13, b13) * xs.unsqueeze(1)
        aq, as_ = nx.quantize_per_token(_silu_and_mul(h, inter))
        return gemm(aq, w2, s2, b2) * as_.unsqueeze(1)


def check_w4a8_group_size(group_size: Any) -> None:
    """Raise `UnsupportedFormatError` unless ``group_size`` means per-channel W4A8 (None or 0)."""
    if group_size is None or (
        isinstance(group_size, int) and not isinstance(group_size, bool) and group_size == 0
    ):
        return
    raise UnsupportedFormatError(
        f"w4a8_dynamic with group_size={group_size!r} (per-group) does not support EPLB: vllm-ascend "
        "rejects per-group W4A8 (group_size > 0) for expert movement; only per-channel (group_size=0) "
        "W4A8 storage has validated weight views"
    )


class _MxFormat(ExpertWeightFormat):
    """Shared MX layout (vllm-ascend ``w8a8_mxfp8.py`` / ``w4a4_mxfp4.py``, Ascend 950).

    The checkpoint layout ``(p, N, K)`` stays in memory; ``process_weights_after_loading`` reshapes the
    e8m0 block scales ``(p, N, K/32)`` to ``(p, N, K/64, 2)`` and replaces all four parameters by
    ``transpose(1, 2)`` strided views, which the kernel reads through their strides:

    ================ ==================== ============================ ==========================
    name             kernel shape         memory (contiguous)          dtype
    ================ ==================== ============================ ==========================
    w13_weight       (p, H*, 2I)          (p, 2I, H*)                  see subclass
    w2_weight        (p, I*, H)           (p, H, I*)
    w13_weight_scale (p, H/64, 2I, 2)     (p, 2I, H/64, 2)             torch.float8_e8m0fnu
    w2_weight_scale  (p, I/64, H, 2)      (p, H, I/64, 2)
    ================ ==================== ============================ ==========================

    (``*``: halved for packed fp4.) Views: the four ``transpose(1, 2)`` (undoing the kernel transpose,
    giving contiguous expert rows), flattened to ``(p, -1)``. Needs ``H % 64 == 0`` and ``I % 64 == 0``.
    Reference: weights dequantized block-wise (value * 2 ** (byte - 127)); activations MX-quantized at
    run time in blocks of 32 along K with the same element type (``npu_dynamic_mx_quant``), also between
    the GEMMs.
    """

    _transposed = frozenset({"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"})
    _size_rules = (
        ("H", 64, "e8m0 scales per 32 elements of K=H, stored in pairs"),
        ("I", 64, "e8m0 scales per 32 elements of K=I, stored in pairs"),
    )

    @staticmethod
    @abc.abstractmethod
    def _quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @staticmethod
    @abc.abstractmethod
    def _dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor: ...

    @staticmethod
    @abc.abstractmethod
    def _fake_quantize_act(x: torch.Tensor) -> torch.Tensor: ...

    def _quantize(self, w13, w2, p, opts):
        kernel = {}
        q13, s13 = self._quantize_weight(w13)  # (p, 2I, H[/2]), (p, 2I, H/32)
        q2, s2 = self._quantize_weight(w2)
        for name, t in (
            ("w13_weight", q13),
            ("w2_weight", q2),
            ("w13_weight_scale", s13.reshape(p, s13.shape[1], -1, 2)),
            ("w2_weight_scale", s2.reshape(p, s2.shape[1], -1, 2)),
        ):
            kernel[name] = t.contiguous().transpose(1, 2)
        # view order: weights then scales, as get_eplb_weight_views returns them
        return {n: kernel[n] for n in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")}, {}

    def _forward_selected(self, storage, x, sel, fused):
        inter = storage.intermediate_size

        def weight(name: str) -> torch.Tensor:  # (E, N, K) float64, expert-first contiguous rows
            q = self._selected_rows(storage, name, sel)  # (E, N, K[/2])
            s = self._selected_rows(storage, name + "_scale", sel)  # (E, N, K/64, 2)
            return self._dequantize_weight(q, s.reshape(*s.shape[:2], -1))

        w13 = weight("w13_weight").transpose(1, 2)  # (E, H, 2I) view: w13[e].T as before
        w2 = weight("w2_weight").transpose(1, 2)  # (E, I, H)
        xa = self._fake_quantize_act(x)[sel.token]  # MX blocks along H, per token
        h = _grouped_mm(
            xa,
            w13,
            sel,
        )
        return _grouped_mm(
            self._fake_quantize_act(_silu_and_mul(h, inter)),
            w2,
            sel,
        )


class Mxfp8Format(_MxFormat):
    """MXFP8 (vllm-ascend ``w8a8_mxfp8.py`` ``AscendW8A8MXFP8DynamicFusedMoEMethod``, Ascend 950).

    Weights torch.float8_e4m3fn, one element per byte, e8m0 block scales of 32; layout in `_MxFormat`.
    """

    __doc__ = (__doc__ or "") + (_MxFormat.__doc__ or "")
    name = "mxfp8"
    ascend_source = "vllm_ascend/quantization/methods/w8a8_mxfp8.py AscendW8A8MXFP8DynamicFusedMoEMethod"
    error_bound = 0.1
    _quantize_weight = staticmethod(nx.quantize_mxfp8)
    _dequantize_weight = staticmethod(nx.dequantize_mxfp8)
    _fake_quantize_act = staticmethod(nx.fake_quantize_mxfp8)


class Mxfp4Format(_MxFormat):
    """MXFP4 (vllm-ascend ``w4a4_mxfp4.py`` ``AscendW4A4MXFP4DynamicFusedMoEMethod``, Ascend 950).

    Weights fp4 e2m1 packed two per uint8 along K (element 2j in the low nibble; the kernel's
    ``float4_e2m1fn_x2``), so weight K extents are halved; e8m0 block scales of 32; layout in `_MxFormat`.
    """

    __doc__ = (__doc__ or "") + (_MxFormat.__doc__ or "")
    name = "mxfp4"
    ascend_source = "vllm_ascend/quantization/methods/w4a4_mxfp4.py AscendW4A4MXFP4DynamicFusedMoEMethod"
    error_bound = 0.45
    _quantize_weight = staticmethod(nx.quantize_mxfp4)
    _dequantize_weight = staticmethod(nx.dequantize_mxfp4)
    _fake_quantize_act = staticmethod(nx.fake_quantize_mxfp4)


# ====================================================================== registry

_FORMATS: dict[str, ExpertWeightFormat] = {
    f.name: f
    for f in (
        Bf16Format(),
        Fp16Format(),
        W8A8DynamicFormat(),
        W4A8DynamicFormat(),
        Mxfp8Format(),
        Mxfp4Format(),
    )
}

_REJECTED: dict[str, FormatSupport] = {
    "w4a16": FormatSupport(
        "w4a16",
        False,
        "int32-packed weights (8 x int4) with per-group antiquant scale/offset and a weight_shape tensor; "
        "the layout has no validated expert-first views (vllm-ascend: supports_eplb=False)",
        "vllm_ascend/quantization/methods/w4a16.py",
    ),
    "w4a16_mxfp4": FormatSupport(
        "w4a16_mxfp4",
        False,
        "MXFP4 weights with bf16 activations: layout not validated for expert movement "
        "(vllm-ascend: supports_eplb=False; not supported with EPLB on Ascend 950)",
        "vllm_ascend/quantization/methods/w4a16_mxfp4.py",
    ),
    "w4a8_mxfp4": FormatSupport(
        "w4a8_mxfp4",
        False,
        "MXFP4 weights with fp8 activations: layout not validated for expert movement "
        "(vllm-ascend: supports_eplb=False; the V1 adaptor raises RuntimeError for W4A8MXFP)",
        "vllm_ascend/quantization/methods/w4a8_mxfp4.py",
    ),
}

_SUPPORTED_REASONS = {
    "bf16": "w13_weight, w2_weight (+ w13_bias, w2_bias) moved as they are",
    "fp16": "w13_weight, w2_weight (+ w13_bias, w2_bias) moved as they are",
    "w8a8_dynamic": "int8 weights and float32 per-channel scales (+ fused int64 scale pair) move together; "
    "unread offsets stay",
    "w4a8_dynamic": "per-channel only: packed int4 weights, int64 scale words and scale_bias move together",
    "mxfp8": "fp8 e4m3 weights and e8m0 block scales, transposed views undone",
    "mxfp4": "packed fp4 e2m1 weights and e8m0 block scales, transposed views undone",
}

FORMAT_SUPPORT: Mapping[str, FormatSupport] = MappingProxyType(
    {
        **{n: FormatSupport(n, True, _SUPPORTED_REASONS[n], f.ascend_source) for n, f in _FORMATS.items()},
        **_REJECTED,
    }
)
"""Every known format name -> `FormatSupport` (six supported, three rejected); for startup validation
and the README matrix. Per-group ``w4a8_dynamic`` is rejected through `get_format`'s ``group_size``."""


def supported_formats() -> tuple[str, ...]:
    """Names of the formats EPLB supports, in table order."""
    return tuple(n for n, s in FORMAT_SUPPORT.items() if s.supports_eplb)


def get_format(name: str, *, group_size: int | None = None) -> ExpertWeightFormat:
    """The `ExpertWeightFormat` called ``name`` (case-insensitive).

    Args:
        name: one of `supported_formats` (``bf16``, ``fp16``, ``w8a8_dynamic``, ``w4a8_dynamic``,
            ``mxfp8``, ``mxfp4``).
        group_size: quantization group size of ``w4a8_dynamic`` (None or 0: per-channel). Any other
            value is per-group W4A8 and is rejected.

    Raises:
        UnsupportedFormatError: a known format EPLB rejects (``w4a16``, ``w4a16_mxfp4``,
            ``w4a8_mxfp4``, per-group ``w4a8_dynamic``) with the reason; an unknown name, listing the
            known ones; ``group_size`` given for a format that has none.
    """
    if not isinstance(name, str):
        raise UnsupportedFormatError(f"format name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key in _REJECTED:
        raise UnsupportedFormatError(
            f"quantization format {name!r} does not support EPLB: {_REJECTED[key].reason}"
        )
    fmt = _FORMATS.get(key)
    if fmt is None:
        raise UnsupportedFormatError(
            f"unknown quantization format {name!r}; supported: {', '.join(supported_formats())}; "
            f"known but rejected: {', '.join(_REJECTED)}"
        )
    if key == "w4a8_dynamic":
        check_w4a8_group_size(group_size)
    elif group_size is not None:
        raise UnsupportedFormatError(f"format {key!r} has no group_size option (got {group_size!r})")
    return fmt
