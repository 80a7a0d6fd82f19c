"""Model Runner V2 wiring: the calls an Ascend MRv2 runner makes, in the order it makes them.

vLLM 0.33.0's ``GPUModelRunner`` already drives its ``self.eplb`` controller at every point but one. An
Ascend runner subclassing it adopts this module with two lines: ``self.eplb =
create_eplb_controller(vllm_config, device)`` in ``__init__`` and
``self.eplb.set_batch_phase(batch_has_prefill(...))`` in ``prepare_inputs``. :class:`Mrv2EplbWiring`
makes the whole sequence (README "MRv2 call order") as methods named after the runner points, for
runners that do not inherit upstream's decorators and for tests. Every rank makes the per-step calls in
the same order every step: upstream's step runs collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.worker.gpu.eplb_utils import EPLBController

__all__ = ["Mrv2EplbWiring", "batch_has_prefill", "create_eplb_controller"]


def batch_has_prefill(num_computed_tokens: Sequence[int], num_prompt_tokens: Sequence[int]) -> bool:
    """Whether a batch contains prefill work: any request with fewer computed than prompt tokens.

    Args:
        num_computed_tokens: per request of the batch, tokens already computed before this step.
        num_prompt_tokens: per request, prompt length (same order).

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(num_computed_tokens) != len(num_prompt_tokens):
        raise ValueError(
            f"num_computed_tokens has {len(num_computed_tokens)} entries, num_prompt_tokens "
            f"{len(num_prompt_tokens)}; they must describe the same requests"
        )
    return any(int(c) < int(p) for c, p in zip(num_computed_tokens, num_prompt_tokens, strict=True))


def create_eplb_controller(vllm_config: Any, device: torch.device) -> Any:
    """The controller an Ascend MRv2 runner stores as ``self.eplb`` (runner ``__init__``).

    With ``parallel_config.enable_eplb`` False: upstream's ``EPLBController`` exactly as
    ``GPUModelRunner`` builds it; no validation, no patch, no plane imported. Otherwise: validates the
    configuration (:func:`~ascend_eplb.integration.validation.validate_eplb_config`) and reads the
    switches (:func:`~ascend_eplb.integration.serving.read_serving_setup`), applies the patches
    (idempotent) and returns control's ``AscendEPLBController`` with the configured
    ``load_collection_phase``, with the serving guardrails attached
    (:func:`~ascend_eplb.integration.serving.build_serving_controller`): the worker watchdog
    (:mod:`~ascend_eplb.integration.watchdog`, always), the runtime verifier (``ASCEND_EPLB_VERIFY=1``)
    and the events file (``ASCEND_EPLB_EVENTS=path``).

    Raises:
        EplbConfigError: the configuration violates the support matrix (every violated rule listed).
        ValueError: ``ASCEND_EPLB_WORKER_TIMEOUT_S``, ``ASCEND_EPLB_ON_WORKER_FAILURE``,
            ``ASCEND_EPLB_VERIFY``, ``ASCEND_EPLB_EVENTS`` or ``ASCEND_EPLB_METRICS`` (with
            ``PROMETHEUS_MULTIPROC_DIR``) is invalid (before anything is patched).
        RuntimeError: an upstream callable changed signature (from ``apply_patches``).
    """
    parallel_config = vllm_config.parallel_config
    if not parallel_config.enable_eplb:
        return EPLBController(parallel_config, device)
    # local: with EPLB off no plane is imported (test_plugin.py holds it); the patches and the serving
    # controller import them all
    from ascend_eplb.integration.patches import apply_patches
    from ascend_eplb.integration.serving import build_serving_controller, read_serving_setup

    # Every switch is read, and a bad value refused, on every rank before anything is patched.
    setup = read_serving_setup(vllm_config)
    apply_patches()
    return build_serving_controller(parallel_config, device, setup)


class Mrv2EplbWiring:
    """The MRv2 EPLB call sequence of one runner, as methods named after the runner points.

    Args:
        vllm_config: the runner's ``VllmConfig``.
        device: the runner's device.

    Attributes:
        controller: the controller from :func:`create_eplb_controller` (``self.eplb`` of a runner).
        calls: the controller calls made so far, in order, as ``(name, args)`` (for logs and tests).
    """

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.controller = create_eplb_controller(vllm_config, device)
        self._eplb_enabled = bool(vllm_config.parallel_config.enable_eplb)  # what create_eplb_controller read
        self.calls: list[tuple[str, tuple[Any, ...]]] = [("create_eplb_controller", ())]

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((name, (*args, *kwargs.values())))
        return getattr(self.controller, name)(*args, **kwargs)

    def load_model(
        self,
        model: Any,
        model_config: Any,
        *,
        speculator: Any | None = None,
        speculative_config: Any | None = None,
        load_dummy_weights: bool = False,
    ) -> bool:
        """Points 2-4: prepare the state, register the draft and the model, start the async worker.

        Returns:
            whether a model was registered with EPLB.
        """
        self._call("prepare_load")
        added = bool(
            self._call("maybe_register_speculator", speculator, speculative_config, load_dummy_weights)
        )
        if not load_dummy_weights:
            added |= bool(self._call("maybe_register_model", model, model_config))
        self._call("maybe_start_async_loop", added, load_dummy_weights)
        return added

    def profile_run(self) -> None:
        """Point 5, after the runner's profile ``_dummy_run``: upstream's profile rearrangement."""
        self._call("step", is_dummy=True, is_profile=True)

    def dummy_run(self, *, skip_eplb: bool = False) -> None:
        """Point 6, after a warm-up or idle-rank ``_dummy_run``: a dummy step (no load counted)."""
        if not skip_eplb:
            self._call("step", is_dummy=True, is_profile=False)

    def prepare_inputs(self, batch_has_prefill: bool) -> None:
        """Point 7: declare the batch phase (only Ascend's controller has phases; upstream's ignores it)."""
        if hasattr(self.controller, "set_batch_phase"):
            self._call("set_batch_phase", batch_has_prefill)

    def prepare_forward(
        self,
        model_config: Any,
        num_unpadded_tokens: int,
        ubatch_slices: list | None = None,
        *,
        moe_rows: str | None = None,
    ) -> None:
        """Point 8: before the forward, with the batch's unpadded token count.

        ``moe_rows`` names the rows this forward's MoE routes when the runner's dispatch differs per
        batch (``AscendEPLBController.prepare_forward``); None: the configuration's. Upstream's
        controller (EPLB off) takes no such argument and is called without it.

        Raises:
            ValueError: ``num_unpadded_tokens`` is negative or not an int (a bool is not); ``moe_rows`` is
                unknown.
        """
        # Not control.values.is_int: with EPLB off this module must not import the control package.
        if (
            isinstance(num_unpadded_tokens, bool)
            or not isinstance(num_unpadded_tokens, int)
            or num_unpadded_tokens < 0
        ):
            raise ValueError(f"num_unpadded_tokens={num_unpadded_tokens!r} must be an int >= 0")
        if moe_rows is not None and self._eplb_enabled:
            # Validated by AscendEPLBController.prepare_forward; upstream's (EPLB off) has no such argument.
            self._call("prepare_forward", model_config, num_unpadded_tokens, ubatch_slices, moe_rows=moe_rows)
        else:
            self._call("prepare_forward", model_config, num_unpadded_tokens, ubatch_slices)

    def after_sampling(self) -> None:
        """Point 9: one EPLB step per engine step, after sampling (every rank, every step)."""
        self._call("step")

    def shutdown(self) -> None:
        """Point 10, the runner's ``shutdown``: the controller's end of life (rank-local, once); nothing
        for upstream's controller (EPLB off), which has none."""
        if hasattr(self.controller, "shutdown"):
            self._call("shutdown")
