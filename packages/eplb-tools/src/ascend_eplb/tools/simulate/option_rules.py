"""The rules of ``simulate``'s options that judge them as another rule set does, or against another input.

Each function returns the messages of the rules an option breaks (one per rule, naming the value and the
rule): the DP x TP layout, the output folder, start-up's policy and gain gate rules
(``ascend_eplb.control.policy_config``), ``--replica-split`` (start-up's ``replica-split`` rule), a
compilation config (the world's, then vLLM's own ``CompilationConfig`` and start-up's ``compiled-forward``
rule) and ``--initial-placement`` (start-up's ``initial-placement`` rule). ``config`` is a
:class:`~ascend_eplb.tools.simulate.config.SimulateConfig`, whose ``validate`` and ``validate_model`` list
these among its other rules, in order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ascend_eplb.control.policy_config import (
    load_estimate_error,
    min_balancedness_gain_error,
    policy_error,
    target_balancedness_error,
)
from ascend_eplb.integration.model_names import DRAFT_SUFFIX
from ascend_eplb.integration.placement_file import (
    PlacementFileError,
    assign_placements,
    describe_mismatch,
    read_placements,
)
from ascend_eplb.integration.rules import RULES
from ascend_eplb.integration.settings import EplbSettings
from ascend_eplb.integration.settings_reader import read_settings
from ascend_eplb.world.compilation import compilation_error, is_compiled

__all__ = [
    "compilation_errors",
    "layout_errors",
    "placement_errors",
    "policy_errors",
    "split_errors",
    "unwritable",
    "vllm_compilation_error",
]


def layout_errors(config: Any) -> list[str]:
    """The DP x TP layout's rules: D divides the ranks, and with ``--tp`` the ranks are D x TP."""
    dp, tp, ranks = config.data_parallel_size, config.tensor_parallel_size, config.num_ranks
    if dp < 1 or (tp is not None and tp < 1):
        return [f"dp={dp}, tp={tp}: must be >= 1"]
    if tp is not None and dp * tp != ranks:
        return [f"ranks={ranks} with dp={dp} x tp={tp}: the ranks must be dp x tp = {dp * tp}"]
    if ranks % dp:
        return [f"dp={dp}: must divide ranks={ranks} (ranks = dp x tp)"]
    return []


def unwritable(out: Path) -> str | None:
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


def vllm_compilation_error(compilation: dict[str, Any]) -> str | None:
    """What vLLM and start-up would refuse in a ``compilation_config`` the world serves (``compilation``,
    valid by ``world.compilation_error``), before any rank starts: vLLM's own ``CompilationConfig``
    (pydantic: the backend, the mode, each field), then the serving path's rule ``compiled-forward``
    (inductor freezing, ``TORCHINDUCTOR_FREEZING=1`` included; an option torch's inductor does not have),
    the very function start-up runs on every rank."""
    # local: vLLM only where a compilation config is given (the option parser and check stay off it)
    from pydantic import ValidationError
    from vllm.config import CompilationConfig

    try:
        built = CompilationConfig(**compilation)
    except ValidationError as e:
        said = "; ".join(err["msg"] for err in e.errors())
        return f"vLLM's CompilationConfig refuses {json.dumps(compilation)}: {said}"
    except (TypeError, ValueError) as e:
        return f"vLLM's CompilationConfig refuses {json.dumps(compilation)}: {e}"
    values = {  # read by start-up's one reader: its mode default and its inductor freezing
        "parallel_config.enable_eplb": True,
        "compilation_config.mode": None if built.mode is None else built.mode.name,
        "compilation_config.cudagraph_mode": "NONE",  # not judged here
        "compilation_config.inductor_compile_config": compilation.get("inductor_compile_config"),
    }
    settings, _ = read_settings(values, os.environ)  # the runner switch it may refuse: not judged here
    found = RULES["compiled-forward"](settings)
    return None if found is None else f"[compiled-forward] {found}"


def policy_errors(config: Any) -> list[str]:
    """Start-up's rules of the policy and the gain gate (``ascend_eplb.control.policy_config``, the
    functions integration's rules call), each message naming the value and the rule."""

    checks = (
        ("policy", policy_error(config.policy)),
        ("min balancedness gain", min_balancedness_gain_error(config.min_balancedness_gain)),
        ("target balancedness", target_balancedness_error(config.target_balancedness)),
        ("load estimate", load_estimate_error(config.load_estimate)),
    )
    return [f"{name}: {reason}" for name, reason in checks if reason is not None]


def split_errors(config: Any) -> list[str]:
    """Start-up's rule ``replica-split`` on ``--replica-split`` (the very function start-up runs on the
    served configuration's ``additional_config.eplb_config``), its message naming the value and the fix."""
    settings = EplbSettings(enable_eplb=True, ascend_eplb_config={"replica_split": config.replica_split})
    found = RULES["replica-split"](settings)
    return [] if found is None else [f"replica split: [replica-split] {found}"]


def compilation_errors(config: Any, fmt: str) -> list[str]:
    """The rules of ``--compile`` / ``--compilation-config`` on a real model whose experts are ``fmt``."""

    if config.compile is None and config.compilation_config is None:
        return []
    if config.compile is not None and config.compilation_config is not None:
        return ["compile and compilation-config: give one (--compile eager is mode 2 with backend eager)"]
    if config.compilation_config is not None:
        try:
            compilation = json.loads(config.compilation_config)
        except json.JSONDecodeError as e:
            return [f"compilation-config={config.compilation_config!r}: not JSON ({e})"]
        if (reason := compilation_error(compilation)) is not None:
            return [f"compilation-config: {reason}"]
    if is_compiled(config.compilation) and fmt != "float32":
        return [
            f"compile with format={fmt}: a compiled world serves float32 experts (the CPU stand-in of "
            "the 16-bit and quantized experts computes each selection on its own, with host reads)"
        ]
    return []


def placement_errors(
    config: Any, num_moe_layers: int, num_logical_experts: int, source: Any = None
) -> list[str]:
    """Start-up's judgement of ``--initial-placement`` (the serving path's rule ``initial-placement``,
    here before any rank starts): the file readable and valid, a placement for each model served (a
    real model's ``source``: the target, and its MTP draft with ``--speculative-tokens``) and, in a
    placement file, of no other (an events file's records of another model are not read), each made
    for these logical experts, physical slots (E + ``--redundant-experts``) and ranks, the target's for
    these MoE layers (the draft's: one, its MTP layer); every problem named."""
    path = config.initial_placement
    if path is None or not str(path).strip():
        return []

    target = str(source.folder) if source is not None else "the model"
    served = (target + DRAFT_SUFFIX, target) if config.speculative_tokens else (target,)
    try:
        placements = read_placements(path, served)
    except PlacementFileError as e:
        return [f"initial placement={path}: {'; '.join(e.problems)}"]
    assignment, problems = assign_placements(placements, served)
    if problems:
        return [f"initial placement={path}: {'; '.join(problems)} (the run serves {list(served)})"]
    errors = []
    for name, placement in assignment.items():
        differ = placement.mismatches(
            num_moe_layers=num_moe_layers if name == target else source.num_mtp_layers,
            num_logical_experts=num_logical_experts,
            num_physical_experts=num_logical_experts + config.num_redundant_experts,
            num_ranks=config.num_ranks,
        )
        errors += [describe_mismatch(placement, differ)] if differ else []
    return errors
