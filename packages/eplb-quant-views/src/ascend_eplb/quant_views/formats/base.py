"""`ExpertWeightFormat`: what every format shares (storage checks, weight views, the reference kernel).

A format module (`unquantized`, `w8a8`, `w4a8`, `mx`) subclasses it with its two layouts
(``_checkpoint``: the msModelSlim tensors vllm-ascend's ``create_weights`` registers; ``_after_loading``:
what its ``process_weights_after_loading`` makes of them) and its expert math twice, tested
bit-identical: ``_forward_expert`` (per expert, `ascend_eplb.quant_views.per_expert`) and
``_forward_batched`` (every selection of a call at once, `batched_apply`).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from ascend_eplb.quant_views._batched import Selection
from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views._tensor_list import ExpertTensorList
from ascend_eplb.quant_views._validate import is_int, validate_weight_views

__all__ = [
    "CHUNK_BYTES",
    "ExpertWeightFormat",
    "UnsupportedFormatError",
    "batched_apply",
    "check_apply_inputs",
    "check_apply_metadata",
]

#: Bytes of float64 dequantized weights `batched_apply` computes at once; more go in chunks.
CHUNK_BYTES = 8 << 20


class UnsupportedFormatError(ValueError):
    """A quantization format (or format option) whose expert storage EPLB cannot move safely.

    Raised by `get_format` (registry) and by a format's ``create_storage`` for an option value EPLB
    rejects (per-group ``w4a8_dynamic``); defined here, below both, so format modules can raise it.
    """


class ExpertWeightFormat(abc.ABC):
    """One quantization format's expert storage, weight views and reference fused MoE kernel.

    Stateless; instances come from `get_format`.

    Attributes:
        name: format name (``bf16``, ``fp16``, ``w8a8_dynamic``, ``w4a8_dynamic``, ``mxfp8``, ``mxfp4``).
        supports_eplb: always True for a format `get_format` returns (rejected formats raise there).
        ascend_source: the vllm-ascend method whose post-loading layout `create_storage` reproduces.
        error_bound: bound on `apply`'s relative Frobenius error against a float64 fused MoE on the
            unquantized weights (`reference.quantization_error`; measured values in the README).
    """

    name: ClassVar[str]
    supports_eplb: ClassVar[bool] = True
    ascend_source: ClassVar[str]
    error_bound: ClassVar[float]
    #: keyword options of `create_storage` beyond ``per_expert_lists``, with their defaults.
    _options: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    #: kernel tensors stored as a transpose(1, 2) strided view of an expert-first contiguous base.
    _transposed: ClassVar[frozenset[str]] = frozenset()
    #: (H, I) divisibility rules: (GLOSSARY.md letter ``"H"`` or ``"I"``, multiple, reason).
    _size_rules: ClassVar[tuple[tuple[str, int, str], ...]] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

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
            w13: floating ``(p, 2I, H)``, gate rows ``[:I]`` then up rows ``[I:]`` (vLLM's ``w13_weight``).
            w2: floating ``(p, H, I)``, the down projection (vLLM's ``w2_weight``).
            per_expert_lists: each kernel tensor an `ExpertTensorList` of ``p`` separate tensors
                (vllm-ascend's ``*_list``, what NZ weights need) instead of one stacked ``(p, ...)``.
            **options: the subclass's options (``fused_scales``, ``w13_bias``/``w2_bias``, ...).

        Returns an `ExpertStorage` on ``w13.device``; an expert's rows depend on its weights only.

        Raises:
            ValueError: inconsistent shapes, dtypes or devices, ``H``/``I`` breaking `check_sizes`,
                non-finite weights. TypeError: an unknown option.
            UnsupportedFormatError: an option value EPLB cannot support (per-group ``w4a8_dynamic``).
        """
        p, hidden, inter = check_float_weights(w13, w2)
        self.check_sizes(hidden, inter)
        opts = self._resolved_options(options)
        kernel, unread = self._laid_out(*self._quantize(w13, w2, p, opts), per_expert_lists)
        return self._storage_record(kernel, unread, p, hidden, inter, per_expert_lists, opts)

    def quantize_checkpoint(
        self, w13: torch.Tensor, w2: torch.Tensor, **options: Any
    ) -> dict[str, torch.Tensor]:
        """Quantize float weights into the tensors a checkpoint of this format holds (msModelSlim layout).

        Stacked ``(p, ...)`` tensors by the parameter names vllm-ascend's ``create_weights`` registers
        (``w13_*``: ``experts.e.gate_proj.*`` rows ``[:I]``, ``up_proj.*`` rows ``[I:]``; ``w2_*``:
        ``down_proj.*``). `storage_from_checkpoint` of the result equals `create_storage`, bit for bit.
        Arguments and errors as `create_storage`.
        """
        p, hidden, inter = check_float_weights(w13, w2)
        self.check_sizes(hidden, inter)
        return self._checkpoint(w13, w2, p, self._resolved_options(options))

    def checkpoint_layout(
        self, num_local_experts: int, hidden_size: int, intermediate_size: int, *, with_bias: bool = False
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape ``(p, ...)`` and dtype of every checkpoint tensor `quantize_checkpoint` returns, by name,
        computed on the meta device; ``with_bias`` adds ``w13_bias`` / ``w2_bias`` (``bf16``/``fp16``).

        Raises:
            ValueError: a count or size is not a positive int or breaks `check_sizes`; ``with_bias`` for
                a format without biases.
        """
        self._check_count(num_local_experts)
        self.check_sizes(hidden_size, intermediate_size)
        opts = dict(self._options)
        if with_bias:
            if "w13_bias" not in opts:
                raise ValueError(f"{self.name}: with_bias=True, but this format has no expert biases")
            meta = torch.device("meta")
            opts["w13_bias"] = torch.empty(num_local_experts, 2 * intermediate_size, device=meta)
            opts["w2_bias"] = torch.empty(num_local_experts, hidden_size, device=meta)
        w13, w2 = self._meta_weights(num_local_experts, hidden_size, intermediate_size)
        return {
            n: (tuple(t.shape), t.dtype)
            for n, t in self._checkpoint(w13, w2, num_local_experts, opts).items()
        }

    def storage_from_checkpoint(
        self,
        tensors: Mapping[str, torch.Tensor],
        hidden_size: int,
        intermediate_size: int,
        *,
        per_expert_lists: bool = False,
        **options: Any,
    ) -> ExpertStorage:
        """Lay loaded checkpoint tensors out as the kernel reads them (vllm-ascend's
        ``process_weights_after_loading``) in a new `ExpertStorage` (fresh memory).

        Args:
            tensors: stacked ``(p, ...)`` tensors as `checkpoint_layout` names them (biases optional for
                ``bf16``/``fp16``, given here as tensors), on one device; not modified.
            hidden_size, intermediate_size: ``H``, ``I``; ``per_expert_lists``, options: as `create_storage`.

        Raises:
            ValueError: a tensor missing, unexpected, or of another shape or dtype than
                `checkpoint_layout` (naming it and both), several devices, sizes breaking `check_sizes`.
            TypeError: an unknown option or a bias given as an option.
            UnsupportedFormatError: an option value EPLB rejects.
        """
        self.check_sizes(hidden_size, intermediate_size)
        w13 = tensors.get("w13_weight")
        if not isinstance(w13, torch.Tensor) or w13.dim() < 1:
            raise ValueError(f"{self.name}: checkpoint tensors must include a stacked 'w13_weight' tensor")
        p = int(w13.shape[0])
        with_bias = "w13_bias" in tensors or "w2_bias" in tensors
        expected = self.checkpoint_layout(p, hidden_size, intermediate_size, with_bias=with_bias)
        unknown = sorted(set(tensors) - set(expected))
        missing = sorted(set(expected) - set(tensors))
        if unknown or missing:
            raise ValueError(
                f"{self.name}: checkpoint tensors {sorted(tensors)} must be exactly {sorted(expected)} "
                f"(missing {missing}, unexpected {unknown})"
            )
        devices = {t.device for t in tensors.values()}
        if len(devices) > 1:
            raise ValueError(
                f"{self.name}: checkpoint tensors are on several devices {sorted(map(str, devices))}"
            )
        for name, (shape, dtype) in expected.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"{self.name}: checkpoint tensor {name!r} must be {shape} {dtype}, "
                    f"got {tuple(t.shape)} {t.dtype}"
                )
        if any(k in options for k in ("w13_bias", "w2_bias")):
            raise TypeError(f"{self.name}.storage_from_checkpoint takes biases as tensors, not options")
        opts = self._resolved_options(options)
        kernel, unread = self._after_loading({n: t.clone() for n, t in tensors.items()}, p, opts)
        kernel, unread = self._laid_out(kernel, unread, per_expert_lists)
        return self._storage_record(kernel, unread, p, hidden_size, intermediate_size, per_expert_lists, opts)

    def _laid_out(
        self, kernel: dict[str, torch.Tensor], unread: dict[str, torch.Tensor], per_expert_lists: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Stacked kernel and unread tensors, or per-expert lists of fresh tensors of them."""
        if not per_expert_lists:
            return kernel, unread
        return (
            {n: self._to_list(n, t) for n, t in kernel.items()},
            {n: ExpertTensorList(r.clone() for r in t.unbind(0)) for n, t in unread.items()},
        )

    def _storage_record(
        self,
        kernel: Mapping[str, Any],
        unread: Mapping[str, Any],
        p: int,
        hidden: int,
        inter: int,
        per_expert_lists: bool,
        opts: Mapping[str, Any],
    ) -> ExpertStorage:
        """The `ExpertStorage` over these tensors as they are (no copy, no layout change)."""
        return ExpertStorage(
            format_name=self.name,
            num_local_experts=p,
            hidden_size=hidden,
            intermediate_size=inter,
            per_expert_lists=per_expert_lists,
            kernel_tensors=MappingProxyType(dict(kernel)),
            unread_tensors=MappingProxyType(dict(unread)),
            options=MappingProxyType({k: opts[k] for k in self._public_options(opts)}),
        )

    def check_sizes(self, hidden_size: int, intermediate_size: int) -> None:
        """Check ``H`` and ``I`` against this format's layout (`create_storage`'s rules), building nothing.

        Raises:
            ValueError: ``H`` or ``I`` is not a positive int, or not a multiple the layout needs
                (names the letter, the value, the multiple and why).
        """
        for letter, value in (("H", hidden_size), ("I", intermediate_size)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{self.name}: {letter}={value!r} must be a positive int")
        for letter, multiple, why in self._size_rules:
            value = hidden_size if letter == "H" else intermediate_size
            if value % multiple:
                raise ValueError(f"{self.name}: {letter}={value} must be a multiple of {multiple} ({why})")

    def expert_nbytes(self, hidden_size: int, intermediate_size: int, **options: Any) -> int:
        """Bytes of one expert's kernel storage at ``H``, ``I`` (what `weight_views` cover and EPLB moves),
        computed on the meta device; unread tensors (W8A8 offsets) excluded; ``options`` as `create_storage`.

        Raises:
            ValueError: ``H`` or ``I`` breaks `check_sizes`.
            TypeError: an unknown option.
        """
        self.check_sizes(hidden_size, intermediate_size)
        kernel, _ = self._meta_quantize(1, hidden_size, intermediate_size, self._resolved_options(options))
        return sum(t.numel() * t.element_size() for t in kernel.values())

    def storage_nbytes(self, num_local_experts: int, hidden_size: int, intermediate_size: int) -> int:
        """Bytes `create_storage` allocates for ``num_local_experts`` experts at ``H``, ``I`` (kernel and
        unread tensors, default options), computed on the meta device.

        Raises:
            ValueError: a count or size is not a positive int, or ``H``/``I`` breaks this layout's rules
                (as `check_sizes`).
        """
        self._check_count(num_local_experts)
        self.check_sizes(hidden_size, intermediate_size)
        kernel, unread = self._meta_quantize(
            num_local_experts, hidden_size, intermediate_size, dict(self._options)
        )
        return sum(t.numel() * t.element_size() for t in (*kernel.values(), *unread.values()))

    def _meta_quantize(
        self, num_local_experts: int, hidden_size: int, intermediate_size: int, opts: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """`_quantize` of ``(p, 2I, H)`` / ``(p, H, I)`` weights on the meta device (shapes, no data)."""
        w13, w2 = self._meta_weights(num_local_experts, hidden_size, intermediate_size)
        return self._quantize(w13, w2, num_local_experts, dict(opts))

    @staticmethod
    def _meta_weights(p: int, hidden_size: int, intermediate_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = torch.device("meta")
        return (
            torch.empty(p, 2 * intermediate_size, hidden_size, device=meta),
            torch.empty(p, hidden_size, intermediate_size, device=meta),
        )

    def _check_count(self, num_local_experts: Any) -> None:
        if not is_int(num_local_experts) or num_local_experts < 1:
            raise ValueError(f"{self.name}: num_local_experts={num_local_experts!r} must be a positive int")

    def _resolved_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The format's default options updated with ``options``; ``TypeError`` naming unknown ones."""
        unknown = sorted(set(options) - set(self._options))
        if unknown:
            raise TypeError(
                f"{self.name}.create_storage got unknown option(s) {unknown}; "
                f"known: {sorted(self._options) or 'none'}"
            )
        return {**self._options, **options}

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

    def _quantize(
        self, w13: torch.Tensor, w2: torch.Tensor, p: int, opts: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Stacked kernel tensors (kernel layout, in view order) and stacked unread tensors: the
        checkpoint of ``w13``/``w2`` laid out after loading (one path for both entry points)."""
        return self._after_loading(self._checkpoint(w13, w2, p, opts), p, opts)

    @abc.abstractmethod
    def _checkpoint(
        self, w13: torch.Tensor, w2: torch.Tensor, p: int, opts: Mapping[str, Any]
    ) -> dict[str, torch.Tensor]:
        """Stacked checkpoint tensors (msModelSlim layout, create_weights names) of float weights."""

    @abc.abstractmethod
    def _after_loading(
        self, ckpt: Mapping[str, torch.Tensor], p: int, opts: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Kernel tensors (view order) and unread tensors made from checkpoint tensors (fresh memory)."""

    def view_names(self, storage: ExpertStorage) -> list[str]:
        """vllm-ascend parameter names of `weight_views` entries (``*_list`` in per-expert-list mode)."""
        self._check_storage(storage)
        suffix = "_list" if storage.per_expert_lists else ""
        return [n + suffix for n in storage.kernel_tensors]

    def weight_views(self, storage: ExpertStorage) -> list[torch.Tensor | ExpertTensorList]:
        """Every per-expert tensor the kernel reads, expert-first, over the very same memory.

        Stacked: each entry a ``(p, -1)`` view of a kernel tensor, any internal transpose undone first
        (MXFP's ``w.transpose(1, 2)``); per-expert lists: an `ExpertTensorList` of ``p`` 1-D views.
        Order and names: `view_names`; unread tensors (W8A8 offsets) are left out.

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

    def _check_storage(self, storage: ExpertStorage) -> None:
        if not isinstance(storage, ExpertStorage):
            raise ValueError(f"expected an ExpertStorage, got {type(storage).__name__}")
        if storage.format_name != self.name:
            raise ValueError(f"storage was built by format {storage.format_name!r}, not {self.name!r}")

    def apply(
        self,
        storage: ExpertStorage,
        hidden_TH: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
        topk_weights_TK: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
        local_ids_TK: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
        *,
        comm_path: str = "standard",
    ) -> torch.Tensor:
        """CPU reference fused MoE reading only ``storage.kernel_tensors``; ``(T, H)`` in ``hidden_TH.dtype``.

        ``out[t] = sum_k topk_weights[t, k] * down(silu(gate(x_t)) * up(x_t))`` with the expert of local
        row ``local_ids[t, k]`` (``-1``: not on this rank, contributes 0). Weights are dequantized as the
        format's docstring says; activations are quantized where the kernel does (per-token int8 for
        W8A8/W4A8, MX blocks for MXFP). float64 arithmetic (integer GEMMs exact): bit-identical for the
        same inputs, and an expert's result depends only on its rows and its tokens.

        Args:
            hidden_TH: floating ``(T, H)``; topk_weights_TK: floating ``(T, K)``; local_ids_TK: integer
                ``(T, K)`` in ``[-1, p)``; storage: built by this format.
            comm_path: ``"standard"``, or ``"fused_mc2"`` for ``w8a8_dynamic`` built with
                ``fused_scales=True`` (reads ``fused_w1_scale``/``fused_w2_scale``).

        Raises:
            ValueError: wrong shapes/dtypes/devices, ids outside ``[-1, p)``, unknown ``comm_path``.
        """
        self._check_storage(storage)
        check_apply_inputs(storage, hidden_TH, topk_weights_TK, local_ids_TK)
        fused = self._fused_scales_path(storage, comm_path)
        x = hidden_TH.to(torch.float64)
        out = batched_apply(self, storage, x, Selection.of(local_ids_TK, topk_weights_TK), fused=fused)
        return out.to(hidden_TH.dtype)

    def apply_graph_safe(
        self,
        storage: ExpertStorage,
        hidden_TH: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
        topk_weights_TK: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
        local_ids_TK: torch.Tensor,  # noqa: N803 (GLOSSARY.md shape letters)
        *,
        comm_path: str = "standard",
    ) -> torch.Tensor:
        """`apply` in fixed shapes with no host read: what a captured graph or a traced forward can hold.

        Every local row computes its expert on every token (``p`` times `apply`'s GEMM rows), masked
        and added in `apply`'s order (by row, then ``k``), reading the kernel tensors through their
        fixed storage. Ids outside ``[-1, p)`` select no row (unchecked: a data read). Bit-equal to
        `apply` on the integer formats; on the float formats the float64 GEMMs of ``T`` rows may round
        differently. Arguments as `apply`; ``ValueError`` for `check_apply_metadata`'s rules, a
        storage of another format or an unknown ``comm_path``.
        """
        self._check_storage(storage)
        check_apply_metadata(storage, hidden_TH, topk_weights_TK, local_ids_TK)
        fused = self._fused_scales_path(storage, comm_path)
        x = hidden_TH.to(torch.float64)
        weights = topk_weights_TK.to(torch.float64)
        out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        for row in range(storage.num_local_experts):
            y = self._forward_expert(storage, row, x, fused)
            for k in range(local_ids_TK.shape[1]):  # apply's order: by row, then by k
                out = out + y * torch.where(local_ids_TK[:, k : k + 1] == row, weights[:, k : k + 1], 0)
        return out.to(hidden_TH.dtype)

    def _fused_scales_path(self, storage: ExpertStorage, comm_path: str) -> bool:
        """Whether ``comm_path`` reads the fused int64 scales; raises ``ValueError`` for a bad path."""
        if comm_path != "standard":
            raise ValueError(f"{self.name}: comm_path={comm_path!r} is not supported; use 'standard'")
        return False

    def _expert_row(self, storage: ExpertStorage, name: str, row: int) -> torch.Tensor:
        """Kernel tensor ``name`` of local row ``row`` with any internal transpose undone (a view)."""
        return self._row_base(name, storage.kernel_tensors[name][row])

    def _selected_rows(self, storage: ExpertStorage, name: str, sel: Selection) -> torch.Tensor:
        """Kernel tensor ``name`` of the rows present in ``sel``, ``(num_rows, ...)`` in ``sel.rows`` order.

        A fresh copy of the current bytes (transpose undone), so moves through the views are seen.
        """
        t = storage.kernel_tensors[name]
        if isinstance(t, ExpertTensorList):
            return torch.stack([self._row_base(name, t[row]) for row in sel.rows_list])
        base = t.transpose(1, 2) if name in self._transposed else t
        return base.index_select(0, sel.rows)

    @abc.abstractmethod
    def _forward_expert(self, storage: ExpertStorage, row: int, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """Plain per-expert form: local row ``row``'s output float64 ``(n, H)`` for its tokens ``x`` (n, H).

        ``x`` is float64; ``fused`` selects the W8A8 fused-scale path. Read the row with `_expert_row`.
        """

    @abc.abstractmethod
    def _forward_batched(
        self, storage: ExpertStorage, x: torch.Tensor, sel: Selection, fused: bool
    ) -> torch.Tensor:
        """Batched form: float64 ``(selections, H)`` outputs of ``x`` (T, H) for the selections of ``sel``.

        In ``sel`` order; bit-identical, selection by selection, to `_forward_expert`.
        """


def batched_apply(
    fmt: ExpertWeightFormat,
    storage: ExpertStorage,
    x: torch.Tensor,
    sel: Selection | None,
    *,
    fused: bool,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """The body of `ExpertWeightFormat.apply` once its inputs are checked: float64 ``(T, H)``.

    ``x``: float64 ``(T, H)``; ``sel``: `Selection.of` the call's ids and weights (None: zeros);
    ``fused``: the W8A8 fused-scale path. Experts go in chunks whose float64 weights (``24 * H * I``
    bytes each) stay under ``chunk_bytes``; chunking changes no bit (tested).
    """
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    if sel is not None:
        per_chunk = max(1, chunk_bytes // (24 * storage.hidden_size * storage.intermediate_size))
        y = torch.cat([fmt._forward_batched(storage, x, part, fused) for part in sel.split(per_chunk)])
        out.index_add_(0, sel.token, y * sel.weight.unsqueeze(1))
    return out


def check_float_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """``(p, H, I)`` of checkpoint weights ``w13 (p, 2I, H)``, ``w2 (p, H, I)``; ``ValueError`` otherwise."""
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


def check_apply_inputs(storage: ExpertStorage, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> None:
    """The input rules of `ExpertWeightFormat.apply`, checked before anything is computed.

    Raises:
        ValueError: ``x`` not floating (T, H), ``w`` not floating (T, K), ``ids`` not an integer tensor of
            ``w``'s shape, tensors on different devices (storage included), ids outside ``[-1, p)``.
    """
    check_apply_metadata(storage, x, w, ids)
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= storage.num_local_experts:
            raise ValueError(
                f"local_ids_TK values must be in [-1, p={storage.num_local_experts}), got min {lo} max {hi}"
            )


def check_apply_metadata(storage: ExpertStorage, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> None:
    """The rules of `check_apply_inputs` that read no tensor data (dtypes, shapes, devices): what
    `ExpertWeightFormat.apply_graph_safe` checks, since a data check is a host read.

    Raises:
        ValueError: as `check_apply_inputs`, the id range excepted.
    """
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
