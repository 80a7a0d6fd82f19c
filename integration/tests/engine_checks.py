"""The judging the engine tests share (``test_engine*.py`` here, the root ``tests/`` through ``load_module``):
outputs against a reference within today's tolerance, HF transformers' reference for a completion,
completed rearrangements and each step's recorded load from the observer's records
(``ascend_eplb.world.engine.probes``). Shapes: L MoE layers, K experts selected per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ascend_eplb.testing.hf import hf_logits
from ascend_eplb.world.engine.host import Completion

#: Today's tolerance of an output against its reference: 1e-6 + 1e-5 x max |reference|.
ABS_TOL, REL_TOL = 1e-6, 1e-5


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
