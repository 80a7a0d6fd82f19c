"""The judging of a run through vLLM's own engine, one for every engine test module (``test_engine*.py``
here, the root ``tests/``; loaded with ``ascend_eplb.testing.load_module``).

:func:`serve` runs one engine configuration twice: EPLB off (upstream's engine exactly, under the same
compilation), then on, generating in rounds until three rearrangements have completed under a deadline
(the async worker's timing is not the test's to choose: every check holds whichever step each commit
landed on). The ``check_*`` functions judge the :class:`Served` record: outputs against the EPLB-off
engine and HF transformers, every committed slot against the checkpoint, the recorded load against the
real tokens, the compiled forward, the async worker and the shutdown. Shapes: L MoE layers, K top-k.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ascend_eplb.testing.hf import hf_logits
from ascend_eplb.world.checkpoints import checkpoint_info
from ascend_eplb.world.engine import probes
from ascend_eplb.world.engine.host import Completion, EngineWorld
from ascend_eplb.world.engine.spec import EngineSpec

#: Today's tolerance of an output against its reference: 1e-6 + 1e-5 x max |reference|.
ABS_TOL, REL_TOL = 1e-6, 1e-5
#: Rearrangements that must complete (every MoE layer committed) before the outputs are judged.
REARRANGEMENTS = 3
PROMPTS = [[(7 * i + 3 * j + 1) % 128 for j in range(6 + i)] for i in range(6)]
MAX_TOKENS = 12
ROUNDS = 4
#: The serving guardrails every EPLB-on engine runs with: the verifier on, a dead worker raises.
GUARDRAILS = {"ASCEND_EPLB_VERIFY": "1", "ASCEND_EPLB_ON_WORKER_FAILURE": "raise"}


@dataclass
class Served:
    """One configuration served off then on (engines in ``root / "off"`` and ``root / "on"``): the EPLB-on
    ``spec``, the checkpoint (``folder``, ``info``),
    the EPLB-off completions, each round's EPLB-on completions, and per worker (DP rank-major) what the
    observer saw, the EPLB state, the slots at the end, the compilation after the first round and at the
    end (``probes.compilation``), the start-up seconds of each engine and the EPLB-on engine's shutdown."""

    spec: EngineSpec
    root: Path
    folder: Path
    info: Any
    off: list[Completion] | None
    on: list[list[Completion]]
    observed: list[dict[str, Any]]
    states: list[dict[str, Any]]
    slots: list[dict[str, list[str]]]
    compiled: list[tuple[dict[str, Any], dict[str, Any]]]
    started: dict[str, float]
    shutdown: Any


def completed(observed: list[dict[str, Any]], num_layers: int) -> int:
    """Rearrangements whose every MoE layer was acknowledged on every rank (the target model)."""
    done = None
    for rank in observed:
        layers: dict[int, set[int]] = {}
        for c in rank["commits"]:
            if not c["model_name"].endswith(" (draft)"):
                layers.setdefault(c["rearrangement"], set()).add(c["layer"])
        mine = {n for n, seen in layers.items() if len(seen) == num_layers}
        done = mine if done is None else done & mine
    return len(done or ())


def serve(spec: EngineSpec, root: Path, *, deadline_s: float = 300.0, reference: bool = True) -> Served:
    """Serve :data:`PROMPTS` on ``spec`` with EPLB off (``spec`` without ``eplb``; not when ``reference``
    is False: ``Served.off`` is None and HF transformers is the outputs' one reference), then on
    (``spec``, with :data:`GUARDRAILS` and the observer), at least :data:`ROUNDS` rounds and until
    :data:`REARRANGEMENTS` have completed, within ``deadline_s`` of the first EPLB-on round."""
    folder = Path(spec.model)
    info = checkpoint_info(folder)
    off, started = None, {}
    if reference:
        with EngineWorld(dataclasses.replace(spec, eplb=None), root / "off") as engine:
            off = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
        started["off"] = engine.ready["seconds"]
    engine = EngineWorld(spec, root / "on", env=GUARDRAILS)
    with engine:
        started["on"] = engine.ready["seconds"]
        engine.run_on_workers(probes.observe, str(folder))
        on = [engine.generate(PROMPTS, max_tokens=MAX_TOKENS)]
        first = engine.run_on_workers(probes.compilation)
        deadline = time.monotonic() + deadline_s
        while (
            len(on) < ROUNDS
            or completed(engine.run_on_workers(probes.observed), info.num_moe_layers) < REARRANGEMENTS
        ):
            assert time.monotonic() < deadline, (
                f"{REARRANGEMENTS} rearrangements did not complete within {deadline_s:.0f} s"
            )
            on.append(engine.generate(PROMPTS, max_tokens=MAX_TOKENS))
        observed = engine.run_on_workers(probes.observed)
        states = engine.run_on_workers(probes.eplb_state)
        slots = engine.run_on_workers(probes.slot_mismatches, str(folder))
        last = engine.run_on_workers(probes.compilation)
    compiled = list(zip(first, last, strict=True))
    return Served(
        spec, root, folder, info, off, on, observed, states, slots, compiled, started, engine.shutdown
    )


def logprob_error(completion: Completion, reference: Completion) -> float:
    """The worst error of ``completion``'s logprobs against ``reference``'s on the tokens both list, in
    units of the tolerance (<= 1 is within it); the token ids are not compared."""
    worst = 0.0
    for got, want in zip(completion.logprobs, reference.logprobs, strict=True):
        scale = max(abs(v) for v in want.values())
        for token, value in got.items():
            if token in want:
                worst = max(worst, abs(value - want[token]) / (ABS_TOL + REL_TOL * scale))
    return worst


def judge(completion: Completion, reference: Completion) -> float:
    """:func:`logprob_error`, after checking the greedy tokens are equal."""
    assert completion.token_ids == reference.token_ids
    return logprob_error(completion, reference)


def hf_reference(
    folder: str | Path, prompt: list[int], completion: Completion
) -> tuple[list[int], Completion]:
    """HF transformers on the checkpoint ``folder``, the prompt and ``completion``'s tokens in one forward:
    its greedy token at each generated position, and its logprobs of the tokens ``completion`` lists there
    (a :class:`Completion` with ``completion``'s token ids)."""
    ids = torch.tensor(list(prompt) + list(completion.token_ids))
    logprobs = torch.log_softmax(hf_logits(folder, ids), dim=-1)[len(prompt) - 1 : -1]
    reference = Completion(
        completion.token_ids,
        tuple(
            {t: float(row[t]) for t in step} for row, step in zip(logprobs, completion.logprobs, strict=True)
        ),
    )
    return logprobs.argmax(dim=-1).tolist(), reference


def check_outputs(served: Served) -> None:
    """>= 3 completed rearrangements; every round's greedy ids and logprobs equal the EPLB-off engine's
    (when it served), and HF transformers' on the same checkpoint (prompt and output in one forward): the
    last round's, or every round's without the EPLB-off engine."""
    assert completed(served.observed, served.info.num_moe_layers) >= REARRANGEMENTS
    if served.off is not None:
        for on in served.on:
            for got, want in zip(on, served.off, strict=True):
                assert judge(got, want) <= 1.0
    for on in served.on if served.off is None else served.on[-1:]:
        for prompt, completion in zip(PROMPTS, on, strict=True):
            greedy, reference = hf_reference(served.folder, prompt, completion)
            assert greedy == list(completion.token_ids)
            assert judge(completion, reference) <= 1.0


def check_commits(served: Served) -> None:
    """Every commit on every rank left each local slot of every model holding its logical expert's
    checkpoint weights, so do the slots at the end, and every rank holds the same placements."""
    for rank in served.observed:
        assert rank["commits"], "no layer committed on this rank"
        assert [c["mismatches"] for c in rank["commits"]] == [[] for _ in rank["commits"]]
    for rank in served.slots:
        assert rank
        assert all(mismatches == [] for mismatches in rank.values()), rank
    placements = [s["placements"] for s in served.states]
    assert all(p == placements[0] for p in placements)


def check_load(served: Served) -> None:
    """The recorded load of every step is each DP rank's scheduled real tokens x K x L, counted once over
    the ranks (the TP ranks of a DP rank agree on the step; a step outside the window records nothing);
    some steps recorded. A dummy batch (a DP rank's while another serves: one padding token, routed and
    recorded like any batch) is upstream's to drop: its step (``is_dummy``) zeroes the pass before the
    window takes it."""
    info, tp = served.info, served.spec.tensor_parallel_size
    per_rank = [rank["steps"] for rank in sorted(served.observed, key=lambda rank: rank["ep_rank"])]
    assert len({len(steps) for steps in per_rank}) == 1
    recorded_steps = 0
    for step in zip(*per_rank, strict=True):
        expected = 0
        for dp_rank in range(served.spec.data_parallel_size):
            group = step[dp_rank * tp : (dp_rank + 1) * tp]
            assert len({(s["is_dummy"], s["num_unpadded_tokens"], s["recorded"]) for s in group}) == 1
            if not group[0]["is_dummy"] and group[0]["recorded"]:
                expected += group[0]["num_unpadded_tokens"] * info.top_k * info.num_moe_layers
        recorded_steps += expected > 0
        served_ranks = [s for s in step if not s["is_dummy"]]
        seen = [(s["is_dummy"], s["num_unpadded_tokens"], s["recorded"], s["selections"]) for s in step]
        assert sum(s["selections"][str(served.folder)] for s in served_ranks) == expected, seen
    assert recorded_steps > 0


def check_compiled(served: Served) -> None:
    """Compiled (``spec.compilation``): vLLM traced the target and every model EPLB balances on every rank,
    without a graph break, and compiled nothing after the first round (no recompilation after any
    commit). Eager: nothing was traced or compiled."""
    for first, last in served.compiled:
        assert set(last["traced"]) == {"target", *served.states[0]["placements"]}
        if served.spec.eager:
            assert (last["unique_graphs"], last["graph_breaks"]) == (0, {})
            assert all(traced == [] for traced in last["traced"].values()), last["traced"]
            continue
        assert all(last["traced"].values()), last["traced"]
        assert last["unique_graphs"] > 0
        assert last["graph_breaks"] == {}
        assert first == last


def check_worker_and_shutdown(served: Served) -> None:
    """The async worker is alive on every rank at the end, the controller is the project's, and the
    engine shut down leaving no process, shared memory segment or scratch file."""
    assert [s["async_worker_alive"] for s in served.states] == [True] * served.spec.num_ranks
    assert {s["controller"] for s in served.states} == {"AscendEPLBController"}
    assert served.shutdown.status == 0
    assert served.shutdown.lingering == ()  # every vLLM process exited within 10 s of the engine's end
    assert served.shutdown.shared_memory == ()  # every segment vLLM's processes had mapped is gone
    # vLLM leaves its IPC sockets and file store in TMPDIR; the world's own TMPDIR held them and is gone.
    assert not (served.root / "on" / "tmp").exists()


def recorded_steps(observed: list[dict[str, Any]], model: str) -> list[tuple[dict[str, Any], int]]:
    """Every step the ranks' observers saw, as (rank 0's step record, the selections ``model`` recorded
    over all ranks), after checking every rank saw the same steps: the same count, and per step the same
    dummy flag, real tokens, record flag and batch."""
    per_rank = [rank["steps"] for rank in observed]
    assert len({len(steps) for steps in per_rank}) == 1
    same = ("is_dummy", "num_unpadded_tokens", "recorded", "scheduled_tokens", "new_requests", "has_prefill")
    out = []
    for step in zip(*per_rank, strict=True):
        assert len({tuple(repr(s[k]) for k in same) for s in step}) == 1
        out.append((step[0], sum(s["selections"][model] for s in step)))
    return out


def check_recorded_load(observed: list[dict[str, Any]], model: str, top_k: int, num_layers: int) -> int:
    """Every step's recorded load over all ranks: real tokens x K x L when the step recorded (a dummy run
    never does), else 0, each selection counted once. Returns the number of steps that recorded."""
    recorded = 0
    for step, total in recorded_steps(observed, model):
        if step["is_dummy"] or not step["recorded"]:
            assert total == 0
        else:
            recorded += 1
            assert total == step["num_unpadded_tokens"] * top_k * num_layers
    return recorded
