"""Options of ``ascend-eplb simulate`` and their rules (checked before any rank process starts).

The rules that judge an option as another rule set does, or against another input (the layout, the
output folder, the policy, a compilation config, ``--initial-placement``), are
:mod:`~ascend_eplb.tools.simulate.option_rules`'.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ascend_eplb.control.phase import LOAD_COLLECTION_PHASES as PHASES
from ascend_eplb.integration.model_facts import MAX_REDUNDANT_EXPERTS, experts_divisibility_error
from ascend_eplb.quant_views import get_format
from ascend_eplb.tools.costs import read_model_size
from ascend_eplb.tools.options import MAX_INPUT_MIB_HELP, non_negative_int, number, path_text, positive_int
from ascend_eplb.tools.simulate import resources
from ascend_eplb.tools.simulate.checks import OUTPUT_RTOL, output_rtol
from ascend_eplb.tools.simulate.faults import FAULT_DESCRIPTIONS, FAULTS
from ascend_eplb.tools.simulate.models import PRESET_FORMAT, REPLAY, REPLAY_FORMAT
from ascend_eplb.tools.simulate.option_rules import (
    compilation_errors,
    layout_errors,
    placement_errors,
    policy_errors,
    split_errors,
    unwritable,
    vllm_compilation_error,
)
from ascend_eplb.world.compilation import COMPILE_BACKENDS, compilation_of

__all__ = [
    "LINK_GBPS_DEFAULT",
    "PHASES",
    "PROMPT_TOKENS",
    "REPLAY_ONLY",
    "ROUND_TOKENS",
    "RUN_OUTPUTS",
    "SimulateConfig",
    "add_simulate_arguments",
    "ascend_policy_keys",
    "config_from_args",
    "non_negative_int",
    "positive_int",
]

#: Default link speed (Gbit/s) for the rearrangement-time estimate of ``simulate`` and ``plan``:
#: 25 Gbit/s, one 25GE port per rank. Movement stages every expert through host memory over Gloo (TCP),
#: so the host NIC, not HCCS or RoCE at 200 Gbit/s, bounds a rearrangement; pass your own.
LINK_GBPS_DEFAULT = 25.0
LINK_GBPS_HELP = (
    "link speed in Gbit/s for the time a rearrangement's transfer takes; default %(default)s (one 25GE "
    "host port per rank: the Gloo-staged movement goes through host memory and TCP)"
)


#: A real model's workload (:func:`~ascend_eplb.tools.simulate.engine_run.workload`): each request's prompt
#: tokens, and the tokens it generates at most (a longer run serves its ``--steps`` in rounds of requests:
#: the presets' context is 256 positions).
PROMPT_TOKENS = 16
ROUND_TOKENS = 128

#: What a run writes into ``--out`` (and removes, an earlier run's, before its ranks start): the driver's
#: outputs, which no input of the run may be (:meth:`SimulateConfig._inputs_among_outputs`).
RUN_OUTPUTS = ("report.json", "balancedness.png", "events.jsonl", "metrics.prom")


#: vLLM 0.33.0's ``SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS`` (vllm/config/scheduler.py), which the
#: world's ``VllmConfig`` keeps: vLLM refuses ``num_speculative_tokens`` at or above it.
MAX_NUM_BATCHED_TOKENS = 2048


def _option(default: Any, flag: str, help: str, **argparse_kwargs: Any) -> Any:
    """A :class:`SimulateConfig` field that is also a command-line option: the one place an option is
    spelled. ``flag`` and ``help`` (and any ``argparse`` keyword: ``type``, ``choices``, ``action``,
    ``metavar``) build the ``simulate`` parser (:func:`add_simulate_arguments`)."""
    return field(default=default, metadata={"flag": flag, "help": help, **argparse_kwargs})


@dataclass(frozen=True)
class SimulateConfig:
    """One simulator run. Defaults are the README's main-job command.

    Every field with a ``flag`` in its metadata is a ``simulate`` option (the parser is generated from
    these fields, :func:`add_simulate_arguments`); adding an option is one field here.
    ``num_moe_layers=None`` takes every loaded layer of the trace; ``padded_size=None`` rounds
    ``batch_size`` up to a multiple of 16 (plus 16 when already a multiple, so every batch carries
    padding rows, as a graph-captured runner's fixed batch does). ``trace=None`` is the embedded ESFT
    trace. ``sample_top_k=None``: the trace's own top-k for a routing trace (.npz), 6 (the embedded
    trace's) when sampling a load matrix.
    """

    model: str = _option(
        "deepseek-v3", "--model",
        "the model served: a local folder (config.json + safetensors of Qwen3-MoE, DeepSeek-V3 or "
        "Mixtral), a preset (deepseek-v3, qwen3-moe, mixtral: a tiny checkpoint written once into the "
        "cache; deepseek-v3's routing fitted to the embedded ESFT trace), or 'replay': the trace-replay "
        "world (synthetic experts in --format's kernel storage, routing from --trace); default "
        "%(default)s",
        metavar="DIR|PRESET|replay",
        type=path_text,
    )  # fmt: skip
    num_ranks: int = _option(
        2, "--ranks", "EP ranks (vLLM's workers): --dp x --tp; default 2, or --dp x --tp when --tp is given",
        type=positive_int,
    )  # fmt: skip
    data_parallel_size: int = _option(
        1, "--dp",
        "data-parallel ranks of a real model (vLLM's data-parallel engine, data_parallel_size, each DP "
        "rank serving its own requests; the MoE rows are vLLM's dispatch's, report.json's moe_rows: "
        "split on this host's CPU experts); default %(default)s",
        metavar="N",
        type=positive_int,
    )  # fmt: skip
    tensor_parallel_size: int | None = _option(
        None, "--tp",
        "tensor-parallel ranks of each DP rank of a real model (ranks = --dp x --tp); default --ranks / --dp",
        metavar="M",
        type=positive_int,
    )  # fmt: skip
    num_redundant_experts: int = _option(
        4, "--redundant-experts", "redundant physical experts per layer, default %(default)s",
        type=non_negative_int,
    )  # fmt: skip
    speculative_tokens: int = _option(
        0, "--speculative-tokens",
        "MTP speculative decoding with N draft tokens: vLLM's DeepSeekMTP draft (the checkpoint's MTP "
        "layer; the deepseek-v3 preset has one) is served beside the target and balanced by EPLB in the "
        "same state; each step runs the target, then the draft N times on the previous hidden states, as "
        "Model Runner V2 does; default 0 (no draft)",
        metavar="N",
        type=non_negative_int,
    )  # fmt: skip
    quant_format: str | None = _option(
        None, "--format",
        "the routed experts' format: a real model's is float32 (the default, exact on a CPU host), bf16 "
        "or fp16 (a preset is written in it; a model folder says its own, its dtype, which --format must "
        "match); --model replay: w8a8_dynamic (its default), w4a8_dynamic, mxfp8, mxfp4 or those, in "
        "the kernels' storage",
        metavar="FORMAT",
    )  # fmt: skip
    num_moe_layers: int | None = _option(
        None, "--layers", "MoE layers (a prefix of the trace's loaded layers), default all", type=positive_int
    )
    batch_size: int = _option(
        32,
        "--batch-size",
        "requests of a real model served together (vLLM's max_num_seqs); --model replay: real tokens per "
        "step; default %(default)s",
        type=positive_int,
    )
    padded_size: int | None = _option(
        None, "--padded-size",
        "padded batch size (graph size), default the next multiple of 16 above the batch size",
        type=positive_int,
    )  # fmt: skip
    steps: int = _option(
        48, "--steps",
        "tokens each request of a real model generates (vLLM's engine steps count its prefill too); "
        "--model replay: forward steps; default %(default)s",
        type=positive_int,
    )  # fmt: skip
    window_size: int = _option(8, "--window-size", "EPLB load window, default %(default)s", type=positive_int)
    step_interval: int = _option(
        16, "--step-interval", "EPLB step interval, default %(default)s", type=positive_int
    )
    load_collection_phase: str = _option(
        "all", "--phase", "load collection phase, default %(default)s", choices=PHASES
    )
    initial_placement: str | None = _option(
        None, "--initial-placement",
        "start serving on a placement (additional_config.eplb_config.initial_placement): a file of "
        "ascend-eplb plan --export-expert-map, or a serving events file (its last committed placement); "
        "default upstream's initial placement",
        metavar="PATH",
        type=path_text,
    )  # fmt: skip
    policy: str = _option(
        "default", "--policy",
        "placement policy (additional_config.eplb_config.policy): default (upstream's DefaultEplbPolicy), "
        "migration_aware (the fewest expert moves from the placement in force) or split_aware (the same, "
        "its replicas then linking ranks for the batch split); default %(default)s",
        metavar="default|migration_aware|split_aware",
    )  # fmt: skip
    min_balancedness_gain: float = _option(
        0.0, "--min-balancedness-gain",
        "the gain gate (additional_config.eplb_config.min_balancedness_gain): skip a rearrangement whose "
        "placement would gain less balancedness than this, in [0, 1); default 0 (off)",
        metavar="X",
        type=number,
    )  # fmt: skip
    target_balancedness: float | None = _option(
        None, "--target-balancedness",
        "the gain gate (additional_config.eplb_config.target_balancedness): skip a rearrangement whose "
        "window the placement in force already serves at least this balanced, in (0, 1]; default off",
        metavar="X",
        type=number,
    )  # fmt: skip
    load_estimate: str = _option(
        "window", "--load-estimate",
        "what the policy plans on and the gain gate judges (additional_config.eplb_config.load_estimate): "
        "window (the closed window, upstream's) or pooled (the windows since the load's last shift); "
        "default %(default)s",
        metavar="window|pooled",
    )  # fmt: skip
    replica_split: str = _option(
        "equal", "--replica-split",
        "which replica a replicated expert's selection goes to "
        "(additional_config.eplb_config.replica_split): equal (each replica an equal share, today's rule), "
        "batch (each batch's selections split among the replicas by the batch's own load) or batch_local "
        "(on split rows each rank splits its own rows); with batch or batch_local the summary, report and "
        "plot show each step's executed balancedness beside the equal split's on the same counts; default "
        "%(default)s",
        metavar="equal|batch|batch_local",
    )  # fmt: skip
    trace: str | None = _option(
        None, "--trace",
        "routing: a compact trace (.npz), or load to sample from: a serving events file (.jsonl), a "
        "[L, E] load matrix (.json/.npy/.csv), ESFT expert_weights_*.txt (a folder or one file); "
        "default the embedded ESFT trace",
        metavar="PATH",
        type=path_text,
    )  # fmt: skip
    sample_top_k: int | None = _option(
        None, "--top-k",
        "experts per token when sampling a load matrix (DeepSeek-V3: 8); default 6 (the embedded "
        "trace's); a routing trace keeps its own",
        type=positive_int,
    )  # fmt: skip
    sample_tokens: int = _option(
        8192, "--sample-tokens", "tokens drawn when sampling a load matrix, default %(default)s",
        type=positive_int,
    )  # fmt: skip
    hidden_size: int = _option(64, "--hidden-size", "H of the simulated experts, default %(default)s",
                               type=positive_int)  # fmt: skip
    intermediate_size: int = _option(
        32, "--intermediate-size", "I of the simulated experts, default %(default)s", type=positive_int
    )
    seed: int = _option(0, "--seed", "default %(default)s", type=int)
    out_dir: str = _option(
        "eplb-simulate", "--out", "output folder, default %(default)s", metavar="DIR", type=path_text
    )
    timeout_s: float = _option(
        900.0, "--timeout", "deadline of the whole run in seconds, default %(default)s", type=float
    )
    progress: bool = _option(True, "--no-progress", "no progress bar", action="store_false")
    fault: str | None = _option(
        None, "--fault",
        "inject a fault to see the check that catches it: "
        + "; ".join(f"{name}: {what}" for name, what in FAULT_DESCRIPTIONS.items()),
        choices=FAULTS,
    )  # fmt: skip
    worker_timeout_s: float = _option(
        600.0, "--worker-timeout",
        "seconds a rearrangement may go without progress before the watchdog stops EPLB "
        "(ASCEND_EPLB_WORKER_TIMEOUT_S), default %(default)s",
        type=float,
    )  # fmt: skip
    on_worker_failure: str = _option(
        "stop", "--on-worker-failure",
        "what the watchdog does on a dead or stalled worker (ASCEND_EPLB_ON_WORKER_FAILURE): stop "
        "EPLB and keep serving, or raise; default %(default)s",
        choices=("stop", "raise"),
    )  # fmt: skip
    model_config: str | None = _option(
        None, "--model-config",
        "a model's config.json (hidden_size, moe_intermediate_size, routed experts, MoE layers): "
        "report expert bytes, redundancy memory and rearrangement traffic at that size in --format",
        metavar="PATH",
        type=path_text,
    )  # fmt: skip
    link_gbps: float = _option(LINK_GBPS_DEFAULT, "--link-gbps", LINK_GBPS_HELP, type=float)
    compile: str | None = _option(
        None, "--compile",
        "serve the model compiled as vLLM's CPU platform compiles it (DYNAMO_TRACE_ONCE: one TorchDynamo "
        "trace at the first forward, every guard dropped) with this backend: eager (the platform's CI "
        "setting) or inductor (its default); default: eager execution (enforce_eager)",
        choices=COMPILE_BACKENDS,
    )  # fmt: skip
    compilation_config: str | None = _option(
        None, "--compilation-config",
        "vLLM's compilation_config as JSON (what vllm serve --compilation-config takes): mode (0 NONE, 2 "
        "DYNAMO_TRACE_ONCE, 3 VLLM_COMPILE: DYNAMO_TRACE_ONCE on this CPU platform), backend, "
        "inductor_compile_config; instead of --compile",
        metavar="JSON",
    )  # fmt: skip
    max_input_mib: int | None = _option(
        None, "--max-input-mib", MAX_INPUT_MIB_HELP, metavar="N", type=positive_int
    )
    metrics: bool = _option(
        False, "--metrics",
        "also export the serving Prometheus metrics (ASCEND_EPLB_METRICS=1, multiprocess mode) and write "
        "their scrape, metrics.prom, beside report.json",
        action="store_true",
    )  # fmt: skip

    def __post_init__(self) -> None:

        # The replay world's format default; a real model's comes from its checkpoint (models.resolve_model).
        if self.model == REPLAY and self.quant_format is None:
            object.__setattr__(self, "quant_format", REPLAY_FORMAT)

    @property
    def replays(self) -> bool:
        """Whether this run is the trace-replay world (``--model replay``), not a real model."""

        return self.model == REPLAY

    @property
    def outputs_rtol(self) -> float:
        """The outputs check's relative tolerance in this run: :data:`OUTPUT_RTOL` in the replay world
        (both worlds run the same quant_views kernel in float32), else :func:`output_rtol` of the real
        model's experts' format."""
        return OUTPUT_RTOL if self.replays else output_rtol(self.quant_format)

    @property
    def compilation(self) -> dict[str, Any] | None:
        """vLLM's ``compilation_config`` of the served model: ``--compile``'s (``world.compilation_of``),
        else ``--compilation-config``'s JSON, else None (eager). Valid options are assumed
        (:meth:`validate_model` judges them)."""

        if self.compile is not None:
            return compilation_of(self.compile)
        if self.compilation_config is not None:
            return json.loads(self.compilation_config)
        return None

    @property
    def engine_max_model_len(self) -> int:
        """vLLM's ``max_model_len`` for a real model's requests: :data:`PROMPT_TOKENS`, at most
        :data:`ROUND_TOKENS` generated, the draft tokens, 16 spare."""
        return PROMPT_TOKENS + min(self.steps, ROUND_TOKENS) + self.speculative_tokens + 16

    @property
    def effective_padded_size(self) -> int:
        if self.padded_size is not None:
            return self.padded_size
        return (self.batch_size // 16 + 1) * 16

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def tp_size(self) -> int:
        """TP of each DP rank: ``--tp``, else ``--ranks / --dp``."""
        if self.tensor_parallel_size is not None:
            return self.tensor_parallel_size
        return max(self.num_ranks // max(self.data_parallel_size, 1), 1)

    @property
    def first_rearrangement_step(self) -> int:
        """The step (1-based) at which upstream starts the first rearrangement: ``EplbState`` starts its
        counter at ``step_interval - step_interval // 4`` and rearranges once a step brings it to
        ``step_interval``."""
        return max(self.step_interval // 4, 1)

    def min_steps(self, num_moe_layers: int) -> int:
        """The fewest steps in which a rearrangement can complete: the first starts at
        :attr:`first_rearrangement_step`, then upstream's async mode commits at most one MoE layer per
        step (``EplbState.step``'s ``_move_to_workspace`` of the one pending layer)."""
        return self.first_rearrangement_step + num_moe_layers

    def _steps_error(self, num_moe_layers: int, num_draft_layers: int = 0) -> str | None:
        """``num_draft_layers``: an MoE draft's (``--speculative-tokens``), moved in the same cycle."""
        need = self.min_steps(num_moe_layers + num_draft_layers)
        if self.steps >= need or self.steps < 1 or self.step_interval < 1:
            return None
        layers = (
            f"{num_moe_layers} MoE layers"
            if not num_draft_layers
            else f"{num_moe_layers + num_draft_layers} MoE layers (the target's {num_moe_layers} and its "
            f"draft's {num_draft_layers}: one cycle moves both)"
        )
        return (
            f"steps={self.steps}: too few to complete a rearrangement: the first starts at step "
            f"{self.first_rearrangement_step} (upstream starts its counter at 3/4 of step interval "
            f"{self.step_interval}) and upstream commits at most one of the {layers} per step, so at least "
            f"{need} steps"
        )

    def validate(
        self,
        *,
        num_trace_moe_layers: int,
        num_logical_experts: int,
        top_k: int,
        num_trace_tokens: int | None = None,
        sampled: bool = False,
    ) -> None:
        """Raise ``ValueError`` listing every violated rule. Needs the trace's ``L``, ``E``, ``K`` and
        token count (default ``sample_tokens``; ``sampled``: routing is still to be sampled from a load
        matrix). Last, when every other rule holds, the memory the run needs against the memory the
        host has available (:mod:`ascend_eplb.tools.simulate.resources`)."""

        errors = self._common_errors(num_logical_experts)
        for option in ("compile", "compilation_config"):
            if getattr(self, option) is not None:
                errors.append(
                    f"{option.replace('_', '-')}={getattr(self, option)}: applies to a real model only (the "
                    "replay world runs the toy MoE model eagerly, no vLLM model class to compile)"
                )
        if self.speculative_tokens:
            errors.append(
                f"speculative tokens={self.speculative_tokens}: the MTP draft is a real model's (--model "
                "deepseek-v3 or a DeepSeek-V3 folder with its MTP layer); --model replay has none"
            )
        if self.data_parallel_size != 1 or self.tensor_parallel_size is not None:
            errors.append(
                f"dp={self.data_parallel_size}, tp={self.tensor_parallel_size}: apply to a real model; "
                "--model replay runs the split layout (each rank routes rows of its own, vLLM Ascend's MC2)"
            )
        if self.replica_split == "batch":
            errors.append(
                "replica split='batch': --model replay routes split rows (each rank its own, vLLM Ascend's "
                "MC2) on a TP-only configuration, from whose rows (replicated) the controller takes the "
                "split's scope ('rows', no all-gather): each rank would split only its own rows, which is "
                "'batch_local'; use --replica-split batch_local, or a real model"
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
        if self.num_moe_layers is not None and not 1 <= self.num_moe_layers <= num_trace_moe_layers:
            errors.append(
                f"layers={self.num_moe_layers}: must be in [1, {num_trace_moe_layers}] "
                "(the trace's MoE layers)"
            )
        if self.trace is not None and str(self.trace).strip() and not Path(self.trace).is_file():
            errors.append(f"trace={self.trace}: no such file")
        if self.hidden_size < 1 or self.intermediate_size < 1:
            errors.append(
                f"hidden size={self.hidden_size}, intermediate size={self.intermediate_size}: must be >= 1"
            )
        if top_k > num_logical_experts:
            errors.append(f"trace top-k={top_k}: must be <= E={num_logical_experts}")
        if self.sample_top_k is not None and not sampled:
            errors.append(
                f"top-k={self.sample_top_k}: the routing trace routes top-{top_k}; --top-k is for "
                "sampling a load matrix"
            )
        if self.model_config is not None:
            try:  # read at validation, so a bad file is refused before anything runs
                model = read_model_size(self.model_config)
                get_format(self.quant_format).check_sizes(model.hidden_size, model.moe_intermediate_size)
            except ValueError as e:
                errors.append(f"model config={self.model_config}: {e}")
        num_moe_layers = self.num_moe_layers if self.num_moe_layers is not None else num_trace_moe_layers
        if 1 <= num_moe_layers <= num_trace_moe_layers and (reason := self._steps_error(num_moe_layers)):
            errors.append(reason)
        errors += placement_errors(self, num_moe_layers, num_logical_experts)
        sizes = dict(num_moe_layers=num_moe_layers, num_logical_experts=num_logical_experts, top_k=top_k)
        errors += resources.integer_rules(self, **sizes)
        if not errors:
            tokens = self.sample_tokens if num_trace_tokens is None else num_trace_tokens
            errors += resources.memory_rule(self, **sizes, num_trace_tokens=tokens, sampled=sampled)
        if errors:
            raise ValueError("invalid simulate options:\n  - " + "\n  - ".join(errors))

    def _common_errors(self, num_logical_experts: int) -> list[str]:
        """The rules of both worlds (ranks, redundancy, batch, steps, window, phase, output, timeouts,
        fault), as one message each."""
        errors: list[str] = []
        if not 1 <= self.num_ranks <= 8:
            errors.append(f"ranks={self.num_ranks}: must be in [1, 8] (one CPU process per rank)")
        errors += layout_errors(self)
        if self.num_ranks == 1:
            errors.append("ranks=1: EPLB needs an expert-parallel world of at least 2 ranks")
        if self.num_redundant_experts < 0:
            errors.append(f"redundant experts={self.num_redundant_experts}: must be >= 0")
        elif self.num_redundant_experts > MAX_REDUNDANT_EXPERTS:
            errors.append(
                f"redundant experts={self.num_redundant_experts}: must be <= {MAX_REDUNDANT_EXPERTS} "
                f"(upstream's EplbState.add_model asserts num_redundant_experts <= {MAX_REDUNDANT_EXPERTS})"
            )
        reason = experts_divisibility_error(num_logical_experts, self.num_redundant_experts, self.num_ranks)
        if self.num_redundant_experts >= 0 and reason is not None:
            errors.append(f"redundant experts={self.num_redundant_experts}: {reason}")
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
        for name, flag in (
            ("model", "model"),
            ("out_dir", "out"),
            ("trace", "trace"),
            ("model_config", "model config"),
            ("initial_placement", "initial placement"),
        ):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                # Path("") is the current folder: --out= cleared the outputs of wherever it ran.
                errors.append(f"{flag}={value!r}: an empty path; name the file or folder")
        out_error = unwritable(Path(self.out_dir)) if str(self.out_dir).strip() else None
        if out_error:
            errors.append(f"out={self.out_dir}: {out_error}")
        errors += self._inputs_among_outputs()
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):
            errors.append(f"timeout={self.timeout_s}: must be a finite number of seconds > 0")
        if not (0 < self.worker_timeout_s < float("inf")):
            errors.append(f"worker timeout={self.worker_timeout_s}: must be a finite number of seconds > 0")
        if not (0 < self.link_gbps < float("inf")):
            errors.append(f"link gbps={self.link_gbps}: must be a finite number > 0 (Gbit/s)")
        if self.on_worker_failure not in ("stop", "raise"):
            errors.append(f"on worker failure={self.on_worker_failure!r}: must be 'stop' or 'raise'")
        if self.fault is not None and self.fault not in FAULTS:
            errors.append(f"fault={self.fault!r}: must be one of {FAULTS}")
        errors += policy_errors(self)
        errors += split_errors(self)
        return errors

    def _inputs_among_outputs(self) -> list[str]:
        """An input file that is one of the run's outputs (:data:`RUN_OUTPUTS` in ``--out``, or a link to
        one): the run removes those before its ranks start and writes its own, so the input would be lost
        before the ranks read it (``--initial-placement OUT/events.jsonl --out OUT``: starting from the
        last run's recording deleted it). Refused: an input is never replaced or deleted."""
        if not str(self.out_dir).strip():
            return []
        out = Path(os.path.realpath(self.out_dir))
        errors = []
        for name, flag in (
            ("initial_placement", "initial placement"),
            ("trace", "trace"),
            ("model_config", "model config"),
        ):
            given = getattr(self, name)
            if given is None or not str(given).strip():
                continue
            read = Path(os.path.realpath(given))  # a link to an output is that output
            output = next((out / o for o in RUN_OUTPUTS if read == out / o), None)
            if output is not None:
                errors.append(
                    f"{flag}={given}: is {output}, an output of this run, which removes it before its ranks "
                    f"start and writes its own; fix: copy it out of --out first (e.g. cp {output} "
                    f"{out.parent / ('last-' + output.name)}) and name the copy, or give another --out"
                )
        return errors

    def validate_model(self, source: Any) -> None:
        """The rules of a run on a real model (``source``: a resolved ``ModelSource``); ``ValueError``
        listing every violated rule, as :meth:`validate`.

        Options of the trace-replay world must keep their defaults; the padded batch must fit the
        model's positions; once every other rule holds, a compilation config as vLLM's
        ``CompilationConfig`` and start-up's ``compiled-forward`` rule judge it; and, last, the memory of
        the run (per rank the EPLB-on and EPLB-off models' weights, at most the whole checkpoint each,
        plus a process with vLLM imported) against the host's available memory.
        """

        errors = self._common_errors(source.num_logical_experts)
        errors += compilation_errors(self, source.format)
        defaults = {f.name: f.default for f in fields(SimulateConfig)}
        for name in REPLAY_ONLY:
            if getattr(self, name) != defaults[name]:
                flag = next(f.metadata["flag"] for f in fields(SimulateConfig) if f.name == name)
                errors.append(
                    f"{flag[2:]}={getattr(self, name)}: applies to --model replay only (a real model's "
                    "experts, sizes and routing are its checkpoint's, its batches vLLM's scheduler's)"
                )
        if self.fault == "view-skips-scale":
            errors.append(
                "fault=view-skips-scale: a quantized format's view list; applies to --model replay only"
            )
        if reason := self._steps_error(
            source.num_moe_layers, source.num_mtp_layers if self.speculative_tokens else 0
        ):
            errors.append(reason)
        if self.speculative_tokens >= MAX_NUM_BATCHED_TOKENS:
            errors.append(
                f"speculative tokens={self.speculative_tokens}: must be below vLLM's max_num_batched_tokens "
                f"({MAX_NUM_BATCHED_TOKENS}, its scheduler's default, which the world serves with): a step "
                "schedules each token with its N draft tokens"
            )
        if self.speculative_tokens and (source.num_mtp_layers < 1 or source.format != PRESET_FORMAT):
            errors.append(
                f"speculative tokens={self.speculative_tokens}: the MTP draft needs a {PRESET_FORMAT} "
                f"DeepSeek-V3 checkpoint with its MTP layer; model {source.name} is {source.architecture} in "
                f"{source.format} with {source.num_mtp_layers} MTP layer(s)"
            )
        errors += placement_errors(self, source.num_moe_layers, source.num_logical_experts, source)
        if self.engine_max_model_len > source.max_positions:
            errors.append(
                f"steps={self.steps}"
                + (f" with speculative tokens={self.speculative_tokens}" if self.speculative_tokens else "")
                + f": each request needs {self.engine_max_model_len} positions ("
                f"{PROMPT_TOKENS} prompt tokens, {min(self.steps, ROUND_TOKENS)} generated in a round, "
                f"{self.speculative_tokens} draft, 16 spare), the model has {source.max_positions} "
                "(max_position_embeddings)"
            )
        errors += resources.integer_rules(
            self, num_moe_layers=source.num_moe_layers, num_logical_experts=source.num_logical_experts,
            top_k=source.top_k,
        )  # fmt: skip
        if not errors and self.compilation is not None:
            # Last, once every other rule holds: these import vLLM (the other refusals come without it).
            reason = vllm_compilation_error(self.compilation)
            flag = "compile" if self.compile is not None else "compilation-config"
            errors += [] if reason is None else [f"{flag}: {reason}"]
        if not errors:
            errors += resources.model_memory_rule(self.num_ranks, source.folder)
        if errors:
            raise ValueError("invalid simulate options:\n  - " + "\n  - ".join(errors))


def ascend_policy_keys(config: SimulateConfig) -> dict[str, Any]:
    """The Ascend keys of ``additional_config.eplb_config`` a run sets for its policy, gain gate, load
    estimate and replica split (``policy``, ``min_balancedness_gain``, ``target_balancedness``,
    ``load_estimate``, ``replica_split``), each only when it differs from its default, so that a run with
    the defaults serves the configuration of a server that sets none."""
    defaults = {
        "policy": "default",
        "min_balancedness_gain": 0.0,
        "target_balancedness": None,
        "load_estimate": "window",
        "replica_split": "equal",
    }
    return {k: getattr(config, k) for k, default in defaults.items() if getattr(config, k) != default}


#: Options of the trace-replay world only (``--model replay``).
REPLAY_ONLY = (
    "padded_size",
    "num_moe_layers",
    "trace",
    "sample_top_k",
    "sample_tokens",
    "hidden_size",
    "intermediate_size",
    "model_config",
)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one option per :class:`SimulateConfig` field that has a ``flag`` (its metadata: flag, help,
    argparse keywords; the default is the field's). ``dest`` is the field name; the help of an option of
    :data:`REPLAY_ONLY` starts with ``--model replay only:``."""
    for f in fields(SimulateConfig):
        meta = dict(f.metadata)
        if "flag" not in meta:
            continue
        flag = meta.pop("flag")
        if f.name in REPLAY_ONLY:
            meta["help"] = f"--model replay only: {meta['help']}"
        # --ranks: None until config_from_args, which makes it --dp x --tp when --tp is given
        default = None if f.name == "num_ranks" else f.default
        parser.add_argument(flag, dest=f.name, default=default, **meta)


def config_from_args(args: argparse.Namespace) -> SimulateConfig:
    """The :class:`SimulateConfig` of parsed ``simulate`` arguments (fields without a flag keep their
    defaults; ``--ranks`` not given: ``--dp x --tp`` when ``--tp`` is, else its default)."""
    values = {f.name: getattr(args, f.name) for f in fields(SimulateConfig) if "flag" in f.metadata}
    if values["num_ranks"] is None:
        tp = values["tensor_parallel_size"]
        values["num_ranks"] = SimulateConfig.num_ranks if tp is None else values["data_parallel_size"] * tp
    return SimulateConfig(**values)
