"""The world's own serving loop: vLLM 0.33.0's real MoE model classes where vLLM's CPU engine cannot serve.

vLLM's own engine serves the world's models on this host (:mod:`~ascend_eplb.world.engine`); this loop
serves what it cannot (``README.md``, "What runs where"): the gathered, gathered-sp and split MoE rows
and the batch split in them, the quantized formats' kernel storage. :class:`ServingWorker` is one Model
Runner V2 worker with EPLB on beside the EPLB-off model, each built by :mod:`~ascend_eplb.world.rank_model`;
:func:`real_model_world` drives it for N steps and returns a :class:`RealModelRun`. Imports vLLM: only
the real-model tests and ``integration/benchmarks/bench_verifier.py`` import this module.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import vllm.plugins
from vllm.config import set_current_vllm_config
from vllm.distributed.parallel_state import get_ep_group

from ascend_eplb.integration.runner import Mrv2EplbWiring, batch_has_prefill
from ascend_eplb.quant_views import layer_storage, layer_view_names
from ascend_eplb.world.checkpoints import (
    checkpoint_experts,
    checkpoint_format,
    checkpoint_info,
)
from ascend_eplb.world.kernel_logs import kernel_log
from ascend_eplb.world.rank_model import (
    build_model,
    forward,
    load_model,
    parallel_layout,
    prepare_world,
    prompt,
    routed_experts,
)
from ascend_eplb.world.slots import (
    checkpoint_expert_storage,
    initial_physical_to_logical,
    local_slot_mismatches,
    slot_fingerprint_mismatches,
)

__all__ = ["RealModelRun", "RealModelSpec", "ServingWorker", "WorkerStep", "real_model_world"]


@dataclass
class WorkerStep:
    """What one :meth:`ServingWorker.forward_step` saw.

    Attributes:
        logits_on: float32 ``(T, vocab_size)`` of the EPLB-on model (every row, padding included).
        logits_off: the EPLB-off model's on the same ids, or None without an EPLB-off model.
        load: int64 ``(L, P)``: upstream's ``expert_load_pass`` after the forward (this rank's record).
        physical_ids: per MoE layer, int64 ``(T, K)``: the ids the expert kernel consumed.
        recorded: whether this forward recorded load (the device record flag).
    """

    logits_on: torch.Tensor
    logits_off: torch.Tensor | None
    load: torch.Tensor
    physical_ids: list[torch.Tensor]
    recorded: bool


class ServingWorker:
    """One Model Runner V2 worker on a real vLLM model with EPLB on, built and driven as serving does,
    beside the EPLB-off model of the same checkpoint (the oracle).

    Built in a serving worker's order: ``ASCEND_EPLB=1``, ``VLLM_USE_V2_MODEL_RUNNER=1`` (else vLLM picks V1
    without Triton), vLLM's plugins (they apply the patches), :func:`prepare_world`, the runner's controller
    from ``Mrv2EplbWiring`` (start-up validation refuses a rejected format before anything loads; set
    ``ASCEND_EPLB_VERIFY`` / ``ASCEND_EPLB_EVENTS`` before), :func:`load_model`, its registration, then the
    EPLB-off model. Per step: :meth:`forward_step` (runner points 7-8) and :meth:`end_step` (point 9,
    upstream's step, where hooks and the verifier may raise). Args: ``num_redundant_experts`` R (``E + R``
    divides by the ranks); ``window_size``, ``step_interval``, ``phase``: ``EPLBConfig``'s (``use_async``
    on); ``ascend_keys``: more ``additional_config.eplb_config`` keys, judged by start-up validation;
    ``data_parallel_size`` D, every DP rank stepping on its own batch; ``dispatch``: :func:`prepare_world`'s
    (``all-to-all`` names the rows ``split``, as vLLM Ascend's MC2). Attributes: ``experts`` /
    ``expert_storage`` (the truth slots are checked against), ``model``, ``state``, ``build_on_s`` /
    ``build_off_s`` (seconds to build each model; None without the EPLB-off one).
    """

    def __init__(
        self,
        ctx: Any,
        folder: str | os.PathLike[str],
        *,
        num_redundant_experts: int,
        window_size: int,
        step_interval: int,
        phase: str = "all",
        eplb_off: bool = True,
        data_parallel_size: int = 1,
        ascend_keys: dict[str, Any] | None = None,
        dispatch: str = "gather",
    ) -> None:
        self.layout = parallel_layout(ctx.world_size, data_parallel_size)
        self.moe_rows = "split" if dispatch == "all-to-all" else None
        self.dp_rank, self.tp_rank = self.layout.dp_rank(ctx.rank), self.layout.tp_rank(ctx.rank)
        os.environ["ASCEND_EPLB"] = "1"
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        vllm.plugins.load_general_plugins()
        self.folder = Path(folder)
        self.info = checkpoint_info(self.folder)
        self.format = checkpoint_format(self.folder)
        eplb = {
            "num_redundant_experts": num_redundant_experts,
            "window_size": window_size,
            "step_interval": step_interval,
            "use_async": True,
        }
        t0 = time.monotonic()
        # As a serving worker: the runner (its controller: start-up validation) before the model loads.
        self.vllm_config = prepare_world(
            ctx, self.folder, enable_eplb=True, eplb=eplb, data_parallel_size=data_parallel_size,
            dispatch=dispatch,
        )  # fmt: skip
        self.vllm_config.additional_config = {
            **(self.vllm_config.additional_config or {}),
            "eplb_config": {"load_collection_phase": phase, **(ascend_keys or {})},
        }
        self.ep_rank = get_ep_group().rank_in_group
        self.model_config = self.vllm_config.model_config
        with set_current_vllm_config(self.vllm_config):
            self.wiring = Mrv2EplbWiring(self.vllm_config, torch.device("cpu"))
        self.model = load_model(self.vllm_config)
        # the truth each slot is checked against: float weights, or the format's kernel storage
        self.experts = checkpoint_experts(self.folder) if self.format is None else None
        self.expert_storage = (
            None if self.format is None else checkpoint_expert_storage(self.folder, self.format)
        )
        with set_current_vllm_config(self.vllm_config):
            self.wiring.load_model(self.model, self.model_config)
        self.state = self.wiring.controller.state
        self.model_state = self.state.model_states[self.model_config.compute_hash()]
        self.build_on_s = time.monotonic() - t0
        # Under upstream's initial placement (what vLLM's loader filled).
        self.initial_slot_mismatches = self._mismatches(
            initial_physical_to_logical(self.info, num_redundant_experts)
        )
        self.model_off = self.vllm_config_off = None
        self.build_off_s: float | None = None
        if eplb_off:
            t1 = time.monotonic()
            self.model_off, self.vllm_config_off = build_model(
                ctx, self.folder, enable_eplb=False, data_parallel_size=data_parallel_size, dispatch=dispatch
            )
            self.build_off_s = time.monotonic() - t1

    @property
    def num_physical_experts(self) -> int:
        """P."""
        return int(self.model_state.physical_to_logical_map.shape[1])

    def profile_run(self, input_ids: torch.Tensor) -> None:
        """Runner point 5: a dummy forward of ``input_ids``, then upstream's profile step."""
        num_tokens = int(input_ids.shape[0])
        with set_current_vllm_config(self.vllm_config):
            self.wiring.prepare_forward(self.model_config, num_tokens, moe_rows=self.moe_rows)
            forward(self.model, self.vllm_config, input_ids, torch.arange(num_tokens))
            self.wiring.profile_run()

    def wait_for_transfer(self, deadline_s: float) -> None:
        """While a rearrangement is in flight, wait until the async worker published its next layer.

        Raises:
            AssertionError: the worker died, or published nothing within ``deadline_s`` seconds.
        """
        if not self.model_state.rebalanced:
            return
        deadline = time.monotonic() + deadline_s
        while self.model_state.pending_result is None:
            if not self.state.async_worker.is_alive():
                raise AssertionError("the async EPLB worker died")
            if time.monotonic() > deadline:
                raise AssertionError(f"no layer transferred within {deadline_s} s")
            time.sleep(0.001)

    def forward_step(
        self, input_ids: torch.Tensor, *, num_unpadded_tokens: int, batch_has_prefill: bool
    ) -> WorkerStep:
        """Runner points 7-8 and the forward: the batch phase, ``prepare_forward`` with the unpadded count,
        the EPLB-on forward (the kernel's physical ids captured), the EPLB-off forward.

        Args:
            input_ids: int64 ``(T,)``, one sequence; rows ``>= num_unpadded_tokens`` are padding (causal
                attention: they change no real row). batch_has_prefill: the phase the runner declares.
        """
        positions = torch.arange(input_ids.shape[0])
        with set_current_vllm_config(self.vllm_config):
            self.wiring.prepare_inputs(batch_has_prefill)
            self.wiring.prepare_forward(self.model_config, num_unpadded_tokens, moe_rows=self.moe_rows)
            recorded = bool(self.state.should_record_tensor)
            logs = [kernel_log(layer) for layer in routed_experts(self.model)]
            before = [int(log.calls) for log in logs]
            logits_on = forward(self.model, self.vllm_config, input_ids, positions)
            physical_ids = _called_once(logs, before, "the EPLB-on forward")
            load = self.model_state.expert_load_pass.clone().long()
        logits_off = None
        if self.model_off is not None:
            logits_off = forward(self.model_off, self.vllm_config_off, input_ids, positions)
        return WorkerStep(logits_on, logits_off, load, physical_ids, recorded)

    def end_step(self) -> list[int]:
        """Runner point 9 (upstream's step, then the controller's hooks: watchdog, verifier, events).

        Returns:
            the MoE layers whose committed placement changed in this step.

        Raises:
            whatever the hooks raise (``EplbVerificationError``, ``EplbWorkerFailureError``).
        """
        before = self.model_state.physical_to_logical_map.clone()
        with set_current_vllm_config(self.vllm_config):
            self.wiring.after_sampling()
        return _changed(before, self.model_state.physical_to_logical_map)

    def slot_mismatches(self) -> list[str]:
        """Local slots not holding their logical expert under the committed placement: the float weights
        (:func:`local_slot_mismatches`), or for a quant_views format the fingerprint over every kernel
        tensor (``quant_method.slot_fingerprint_mismatches``)."""
        return self._mismatches(self.model_state.physical_to_logical_map)

    def _mismatches(self, physical_to_logical: torch.Tensor) -> list[str]:
        if self.format is None:
            return local_slot_mismatches(self.model, self.experts, physical_to_logical, self.ep_rank)
        return slot_fingerprint_mismatches(
            self.model, self.expert_storage, physical_to_logical, self.ep_rank, self.format
        )


def _called_once(logs: list[Any], before: list[int], what: str) -> list[torch.Tensor]:
    """The physical ids each MoE layer's experts consumed in one forward (its ``KernelLog``'s last call),
    after checking that the forward called each layer's experts exactly once (``before``: their call
    counts before it)."""
    calls = [int(log.calls) - n for log, n in zip(logs, before, strict=True)]
    if calls != [1] * len(logs):
        raise RuntimeError(f"{what} called the MoE layers' experts {calls} times, not once each")
    return [log.last_ids() for log in logs]


def _changed(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    """The rows (MoE layers) of two ``(L, P)`` placements that differ."""
    return [layer for layer in range(before.shape[0]) if not torch.equal(before[layer], after[layer])]


# --- the serving-path world ------------------------------------------------------------------------


@dataclass(frozen=True)
class RealModelSpec:
    """Parameters of :func:`real_model_world` (picklable; every rank gets the same).

    ``folder`` the checkpoint, written before the world starts; ``num_redundant_experts`` R (``E + R``
    divides by the ranks); ``steps`` EPLB-on engine steps, each one forward of one prompt of ``num_tokens``
    T (seeded by ``seed``); ``phase`` ``load_collection_phase`` (even steps are declared prefill batches,
    odd steps decode); ``window_size``, ``step_interval`` upstream's ``EPLBConfig`` fields;
    ``run_eplb_off`` also run the EPLB-off model on the same prompts; ``worker_deadline_s`` how long a step
    waits for the async worker's layer; ``environ`` set in each rank before anything is built (e.g.
    ``VLLM_ASCEND_ENABLE_NZ``, ``checkpoints.FORMAT_SWITCHES``); ``data_parallel_size`` D (each DP rank
    its own prompts, DP rank 0's those of D = 1; its TP ranks the same); ``real_tokens`` per DP rank the
    unpadded rows (Model Runner V2 pads every DP rank to one T; empty: all real); ``dispatch`` ``gather``
    or ``all-to-all`` (``split`` rows, TP = 1); ``ascend_keys`` more ``additional_config.eplb_config``
    keys (``replica_split``, ...).
    """

    folder: str
    num_redundant_experts: int = 2
    steps: int = 40
    phase: str = "all"
    window_size: int = 2
    step_interval: int = 6
    num_tokens: int = 12
    seed: int = 0
    run_eplb_off: bool = True
    worker_deadline_s: float = 20.0
    environ: dict[str, str] = field(default_factory=dict)
    data_parallel_size: int = 1
    real_tokens: tuple[int, ...] = ()
    dispatch: str = "gather"
    ascend_keys: dict[str, Any] = field(default_factory=dict)

    def num_real_tokens(self, dp_rank: int) -> int:
        """The real rows of DP rank ``dp_rank``'s prompts.

        Raises:
            ValueError: ``real_tokens`` does not hold one count in ``[0, num_tokens]`` per DP rank.
        """
        if not self.real_tokens:
            return self.num_tokens
        if len(self.real_tokens) != self.data_parallel_size or not all(
            0 <= n <= self.num_tokens for n in self.real_tokens
        ):
            raise ValueError(
                f"real_tokens={self.real_tokens} must hold {self.data_parallel_size} counts in "
                f"[0, {self.num_tokens}], one per DP rank"
            )
        return self.real_tokens[dp_rank]

    def prompt_seed(self, step: int, dp_rank: int) -> int:
        """The seed of DP rank ``dp_rank``'s prompt at ``step`` (D = 1: ``seed * 1000 + step``)."""
        return (self.seed * 1000 + step) * self.data_parallel_size + dp_rank


@dataclass(frozen=True)
class RealModelRun:
    """One rank's :func:`real_model_world` run (picklable). S steps; T, V, L, P as DESIGN.

    Attributes:
        rank, dp_rank, tp_rank: the global rank, its DP rank and its TP rank.
        moe_rows: the row layout the controller last set (``RowLayout.rows``), None if none.
        num_real_tokens: the unpadded rows of this rank's prompts.
        num_physical_experts: P.
        initial_slot_mismatches: the local slots not holding their expert after loading, under upstream's
            initial placement (:func:`local_slot_mismatches`).
        worker_alive: upstream's async worker alive at the end.
        num_rearrangements: upstream's count at the end.
        build_on_s, build_off_s, steps_s: seconds to build the EPLB-on and EPLB-off models (None without
            it) and to run the S steps.
        methods, formats: per MoE layer, the expert method's class name and its quant_views format (None:
            float).
        kernel_names: layer 0's kernel tensors ([] for float experts).
        view_names: per MoE layer, the weight views' attribute names.
        prompts: S int64 ``(T,)``, each step's ids.
        logits_on, logits_off: S float32 ``(T, V)``, EPLB on and off (``logits_off`` None without
            ``run_eplb_off``).
        load: S int64 ``(L, P)``: upstream's ``expert_load_pass`` after each forward, this rank's.
        recorded: S bools, whether the step's forward recorded load.
        kernel_rows: S ints, the rows the first MoE layer's method received.
        maps: S int64 ``(L, P)``, the committed ``physical_to_logical_map`` after each step.
        commits: ``(step, layer)`` of each changed map row.
        slot_checks: ``(step, mismatches)`` after each step with commits
            (:meth:`ServingWorker.slot_mismatches`).
    """

    rank: int
    dp_rank: int
    tp_rank: int
    moe_rows: str | None
    num_real_tokens: int
    num_physical_experts: int
    initial_slot_mismatches: list[str]
    worker_alive: bool
    num_rearrangements: int
    build_on_s: float
    build_off_s: float | None
    steps_s: float
    methods: list[str]
    formats: list[str | None]
    kernel_names: list[str]
    view_names: list[list[str]]
    prompts: list[torch.Tensor]
    logits_on: list[torch.Tensor]
    logits_off: list[torch.Tensor] | None
    load: list[torch.Tensor]
    recorded: list[bool]
    kernel_rows: list[int]
    maps: list[torch.Tensor]
    commits: list[tuple[int, int]]
    slot_checks: list[tuple[int, list[str]]]


def real_model_world(ctx: Any, spec: RealModelSpec) -> RealModelRun:
    """One :class:`ServingWorker` per rank (verifier on) for ``spec.steps`` steps beside the EPLB-off logits,
    in the world's DP x TP layout. Before a step a pending layer transfer is awaited
    (:meth:`ServingWorker.wait_for_transfer`, ``worker_deadline_s``), so commits come at the same steps in
    every run; after each step with commits every local slot is checked against the checkpoint's expert
    under upstream's committed ``physical_to_logical_map``. Returns this rank's :class:`RealModelRun`.
    """
    os.environ["ASCEND_EPLB_VERIFY"] = "1"  # the serving verifier checks every commit and step
    os.environ.update(spec.environ)

    worker = ServingWorker(
        ctx,
        spec.folder,
        num_redundant_experts=spec.num_redundant_experts,
        window_size=spec.window_size,
        step_interval=spec.step_interval,
        phase=spec.phase,
        eplb_off=spec.run_eplb_off,
        data_parallel_size=spec.data_parallel_size,
        dispatch=spec.dispatch,
        ascend_keys=spec.ascend_keys or None,
    )
    real = spec.num_real_tokens(worker.dp_rank)
    prompts = [
        prompt(spec.prompt_seed(s, worker.dp_rank), spec.num_tokens, worker.info.vocab_size)
        for s in range(spec.steps)
    ]
    worker.profile_run(prompts[0])
    steps: list[WorkerStep] = []
    maps: list[torch.Tensor] = []
    commits: list[tuple[int, int]] = []
    slot_checks: list[tuple[int, list[str]]] = []
    t1 = time.monotonic()
    for step in range(spec.steps):
        worker.wait_for_transfer(spec.worker_deadline_s)
        # Even steps are declared prefill batches, odd steps decode batches (computed = prompt tokens),
        # so a "prefill" or "decode" phase records every other step.
        computed = 0 if step % 2 == 0 else spec.num_tokens
        steps.append(
            worker.forward_step(
                prompts[step],
                num_unpadded_tokens=real,
                batch_has_prefill=batch_has_prefill([computed], [spec.num_tokens]),
            )
        )
        changed = worker.end_step()
        maps.append(worker.model_state.physical_to_logical_map.clone().long())
        if changed:
            commits.extend((step, layer) for layer in changed)
            slot_checks.append((step, worker.slot_mismatches()))
    steps_s = time.monotonic() - t1
    layers = routed_experts(worker.model)
    formats = [getattr(layer.quant_method, "format_name", None) for layer in layers]
    layout = worker.wiring.controller.last_row_layout
    return RealModelRun(
        rank=ctx.rank,
        dp_rank=worker.dp_rank,
        tp_rank=worker.tp_rank,
        moe_rows=None if layout is None else layout.rows,
        num_real_tokens=real,
        num_physical_experts=worker.num_physical_experts,
        initial_slot_mismatches=worker.initial_slot_mismatches,
        worker_alive=worker.state.async_worker is not None and worker.state.async_worker.is_alive(),
        num_rearrangements=worker.state.num_rearrangements,
        build_on_s=worker.build_on_s,
        build_off_s=worker.build_off_s,
        steps_s=steps_s,
        methods=[type(layer.quant_method).__name__ for layer in layers],
        formats=formats,
        kernel_names=list(layer_storage(layers[0], formats[0]).kernel_tensors) if formats[0] else [],
        view_names=[
            layer_view_names(layer, f) if f else ["w13_weight", "w2_weight"]
            for layer, f in zip(layers, formats, strict=True)
        ],
        prompts=prompts,
        logits_on=[s.logits_on for s in steps],
        logits_off=[s.logits_off for s in steps] if spec.run_eplb_off else None,
        load=[s.load for s in steps],
        recorded=[s.recorded for s in steps],
        kernel_rows=[int(s.physical_ids[0].shape[0]) for s in steps],
        maps=maps,
        commits=commits,
        slot_checks=slot_checks,
    )
