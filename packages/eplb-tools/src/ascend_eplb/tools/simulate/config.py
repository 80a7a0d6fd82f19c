"""Options of ``ascend-eplb simulate`` and their rules (checked before any rank process starts)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ascend_eplb.control.phase import LOAD_COLLECTION_PHASES as PHASES
from ascend_eplb.integration.verify import CHECKS as VERIFIER_CHECKS
from ascend_eplb.integration.watchdog import CHECK as WATCHDOG_CHECK

__all__ = ["CHECKS", "FAULTS", "OUTPUT_ATOL", "OUTPUT_RTOL", "PHASES", "SIMULATOR_CHECKS", "SimulateConfig"]

FAULTS = ("wrong-lookup-refresh", "view-skips-scale", "worker-dies", "worker-stalls")
#: The simulator's own checks; the others are the serving verifier's (ASCEND_EPLB_VERIFY=1) and the
#: serving watchdog's (always on).
SIMULATOR_CHECKS = ("outputs", "load")
CHECKS = (*SIMULATOR_CHECKS, *VERIFIER_CHECKS, WATCHDOG_CHECK)
#: Output tolerance against the EPLB-off reference. Moved weights are bit-identical, so the only
#: difference is float32 summation order (per-rank partial sums, then all_reduce): a few ulps of the
#: largest value.
OUTPUT_RTOL = 1e-5
OUTPUT_ATOL = 1e-6


@dataclass(frozen=True)
class SimulateConfig:
    """One simulator run. Defaults are the README's main-job command.

    ``num_layers=None`` takes every layer of the trace; ``padded_size=None`` rounds ``batch_size`` up to a
    multiple of 16 (plus 16 when already a multiple, so every batch carries padding rows, as a
    graph-captured runner's fixed batch does). ``trace=None`` is the embedded ESFT trace.
    """

    num_ranks: int = 4
    num_redundant_experts: int = 4
    quant_format: str = "w8a8_dynamic"
    num_layers: int | None = None
    batch_size: int = 32
    padded_size: int | None = None
    steps: int = 96
    window_size: int = 8
    step_interval: int = 16
    load_collection_phase: str = "all"
    trace: str | None = None
    hidden_size: int = 64
    intermediate_size: int = 32
    seed: int = 0
    out_dir: str = "eplb-simulate"
    timeout_s: float = 300.0
    progress: bool = True
    fault: str | None = None
    worker_timeout_s: float = 600.0  # ASCEND_EPLB_WORKER_TIMEOUT_S of the ranks
    on_worker_failure: str = "stop"  # ASCEND_EPLB_ON_WORKER_FAILURE of the ranks
    sample_tokens: int = 8192  # tokens drawn when ``trace`` is a load matrix
    sample_top_k: int = 6

    @property
    def effective_padded_size(self) -> int:
        if self.padded_size is not None:
            return self.padded_size
        return (self.batch_size // 16 + 1) * 16

    def to_json(self) -> dict:
        return asdict(self)

    def with_layers(self, num_layers: int) -> SimulateConfig:
        return replace(self, num_layers=num_layers)

    def validate(
        self,
        *,
        num_trace_layers: int,
        num_logical_experts: int,
        top_k: int,
        num_trace_tokens: int | None = None,
        sampled: bool = False,
    ) -> None:
        """Raise ``ValueError`` listing every violated rule. Needs the trace's ``L``, ``E``, ``K`` and
        token count (default ``sample_tokens``; ``sampled``: routing is still to be sampled from a load
        matrix). Last, when every other rule holds, the memory the run needs against the memory the
        host has available (:mod:`ascend_eplb.tools.simulate.resources`)."""
        from ascend_eplb.quant_views import get_format
        from ascend_eplb.tools.simulate import resources

        errors: list[str] = []
        if not 1 <= self.num_ranks <= 8:
            errors.append(f"ranks={self.num_ranks}: must be in [1, 8] (one CPU process per rank)")
        if self.num_ranks == 1:
            errors.append("ranks=1: EPLB needs an expert-parallel world of at least 2 ranks")
        if self.num_redundant_experts < 0:
            errors.append(f"redundant experts={self.num_redundant_experts}: must be >= 0")
        num_physical = num_logical_experts + self.num_redundant_experts
        if self.num_ranks >= 1 and num_physical % self.num_ranks:
            errors.append(
                f"redundant experts={self.num_redundant_experts}: E + redundant = {num_physical} physical "
                f"experts must divide evenly over ranks={self.num_ranks}"
            )
        try:
            fmt = get_format(self.quant_format)
        except ValueError as e:
            errors.append(f"format={self.quant_format!r}: {e}")
        else:
            if not fmt.supports_eplb:
                errors.append(f"format={self.quant_format!r}: does not support EPLB")
            elif self.hidden_size >= 1 and self.intermediate_size >= 1:
                try:
                    fmt.check_sizes(self.hidden_size, self.intermediate_size)
                except ValueError as e:
                    errors.append(
                        f"format={self.quant_format!r} with hidden size={self.hidden_size}, intermediate "
                        f"size={self.intermediate_size}: {e}"
                    )
        if self.num_layers is not None and not 1 <= self.num_layers <= num_trace_layers:
            errors.append(
                f"layers={self.num_layers}: must be in [1, {num_trace_layers}] (the trace's MoE layers)"
            )
        if self.batch_size < 1:
            errors.append(f"batch size={self.batch_size}: must be >= 1")
        if self.padded_size is not None and self.padded_size < self.batch_size:
            errors.append(f"padded size={self.padded_size}: must be >= batch size={self.batch_size}")
        if self.steps < 1:
            errors.append(f"steps={self.steps}: must be >= 1")
        if self.window_size < 1 or self.step_interval < 1:
            errors.append(f"window size={self.window_size}, step interval={self.step_interval}: must be >= 1")
        elif self.window_size > self.step_interval:
            errors.append(
                f"window size={self.window_size}: must be <= step interval={self.step_interval} "
                "(upstream records only the last window-size steps of an interval)"
            )
        if self.load_collection_phase not in PHASES:
            errors.append(f"phase={self.load_collection_phase!r}: must be one of {PHASES}")
        if self.trace is not None and not Path(self.trace).is_file():
            errors.append(f"trace={self.trace}: no such file")
        if self.hidden_size < 1 or self.intermediate_size < 1:
            errors.append(
                f"hidden size={self.hidden_size}, intermediate size={self.intermediate_size}: must be >= 1"
            )
        out_error = _unwritable(Path(self.out_dir))
        if out_error:
            errors.append(f"out={self.out_dir}: {out_error}")
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):
            errors.append(f"timeout={self.timeout_s}: must be a finite number of seconds > 0")
        if not (0 < self.worker_timeout_s < float("inf")):
            errors.append(f"worker timeout={self.worker_timeout_s}: must be a finite number of seconds > 0")
        if self.on_worker_failure not in ("stop", "raise"):
            errors.append(f"on worker failure={self.on_worker_failure!r}: must be 'stop' or 'raise'")
        if self.fault is not None and self.fault not in FAULTS:
            errors.append(f"fault={self.fault!r}: must be one of {FAULTS}")
        if top_k > num_logical_experts:
            errors.append(f"trace top-k={top_k}: must be <= E={num_logical_experts}")
        num_layers = self.num_layers if self.num_layers is not None else num_trace_layers
        sizes = dict(num_layers=num_layers, num_logical_experts=num_logical_experts, top_k=top_k)
        errors += resources.integer_rules(self, **sizes)
        if not errors:
            tokens = self.sample_tokens if num_trace_tokens is None else num_trace_tokens
            errors += resources.memory_rule(self, **sizes, num_trace_tokens=tokens, sampled=sampled)
        if errors:
            raise ValueError("invalid simulate options:\n  - " + "\n  - ".join(errors))


def _unwritable(out: Path) -> str | None:
    """Why the output folder ``out`` cannot be created or written, or None when it can."""
    if out.exists():
        if not out.is_dir():
            return "exists and is not a folder"
        return None if os.access(out, os.W_OK | os.X_OK) else "folder is not writable"
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None
