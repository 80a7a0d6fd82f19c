"""The plan handshake's wire format, and the text naming how two ranks' plans disagree.

Before its payload moves, each pair of ranks exchanges a fixed header of ``HEADER_WORDS`` int64
words: the sender's status (ok, or failed before the handshake), the length of its full
description of the pair's plan, and 128-bit digests of what it sends to the peer and of what it
expects from it. A description lists, per direction and in queue order, the number of experts,
then per expert its id, its number of tensors and per tensor (dtype code, element count). Only a
pair whose digests differ exchanges the full descriptions, to name the difference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from ascend_eplb.movement._plan import Queued

__all__: list[str] = []

# Gloo slots are 64-bit (prefix, tag); keep tags well inside int32 for c10d's ``int tag``. Each
# ``execute`` uses ``TAGS_PER_EXECUTE`` consecutive tags: payload, header, full descriptions.
TAG_MODULUS = 1 << 28
TAGS_PER_EXECUTE = 4
PAYLOAD, HEADER, DETAIL = 0, 1, 2
# Header, int64 words: status, description length, send digest (2), receive digest (2).
HEADER_WORDS = 6
STATUS_OK, STATUS_FAILED = 0, 1
# A stable code per torch dtype, equal on every rank running the same torch.
DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}


def base_tag(sequence: int) -> int:
    """The first of the ``TAGS_PER_EXECUTE`` Gloo tags of the ``sequence``-th ``execute``."""
    return (sequence % TAG_MODULUS) * TAGS_PER_EXECUTE


def plan_words(queue: Sequence[Queued]) -> dict[int, tuple[list[int], list[int]]]:
    """Per global peer, both directions of the pair's plan (sends to it, receives from it) as int64
    words (the description of the module docstring). One pass over the queue."""
    words: dict[int, tuple[list[int], list[int]]] = {}
    for q in queue:
        direction = words.setdefault(q.global_peer, ([0], [0]))[0 if q.is_send else 1]
        direction[0] += 1
        direction += (q.expert_id, len(q.tensors))
        for t in q.tensors:
            direction += (DTYPE_CODE.get(t.dtype, -1), t.numel())
    return words


def header(failed: bool, sends: Sequence[int], recvs: Sequence[int]) -> torch.Tensor:
    """int64 ``[HEADER_WORDS]``: this rank's header for one peer, from the pair's two directions."""
    status = STATUS_FAILED if failed else STATUS_OK
    words = [status, len(sends) + len(recvs), *_digest(sends), *_digest(recvs)]
    return torch.tensor(words, dtype=torch.int64)


def peer_failed(theirs: Sequence[int]) -> bool:
    """The peer's header says it failed before the handshake."""
    return theirs[0] != STATUS_OK


def plans_agree(mine: Sequence[int], theirs: Sequence[int]) -> bool:
    """What the peer sends is what this rank expects, and what it expects is what this rank sends.
    Symmetric: both ranks of a pair reach the same verdict from the same two headers."""
    return list(theirs[2:4]) == list(mine[4:6]) and list(theirs[4:6]) == list(mine[2:4])


def describe_disagreement(
    me: int, peer: int, mine: tuple[list[int], list[int]], theirs: Sequence[int]
) -> list[str]:
    """How the two plans of the pair (``mine``: this rank's words; ``theirs``: the peer's full
    description) disagree, one text per disagreeing direction; the same texts on both ranks."""
    their_sends = list(theirs[: _words_length(theirs)])
    their_recvs = list(theirs[len(their_sends) :])
    my_sends, my_recvs = mine
    texts = [
        _describe_mismatch(sender, receiver, sent, expected)
        for sender, receiver, sent, expected in sorted(
            [(me, peer, my_sends, their_recvs), (peer, me, their_sends, my_recvs)]
        )
    ]
    return [t for t in texts if t is not None] or [
        f"the transfer plans of global ranks {min(me, peer)} and {max(me, peer)} disagree (digests differ)"
    ]


def _digest(words: Sequence[int]) -> tuple[int, int]:
    raw = hashlib.blake2b(np.asarray(words, dtype=np.int64).tobytes(), digest_size=16).digest()
    return int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)


def _parse_words(words: Sequence[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """Inverse of :func:`plan_words`: ``[(expert_id, [(dtype code, numel), ...]), ...]``."""
    items = []
    pos = 1
    for _ in range(int(words[0])):
        expert, count = int(words[pos]), int(words[pos + 1])
        pos += 2
        items.append((expert, [(int(words[pos + 2 * j]), int(words[pos + 2 * j + 1])) for j in range(count)]))
        pos += 2 * count
    return items


def _words_length(words: Sequence[int]) -> int:
    """Length of the first direction in a full description (sends, then receives)."""
    pos = 1
    for _ in range(int(words[0])):
        pos += 2 + 2 * int(words[pos + 1])
    return pos


def _dtype_name(code: int) -> str:
    return str(DTYPES[code]).removeprefix("torch.") if 0 <= code < len(DTYPES) else f"dtype#{code}"


def _format_tensors(tensors: Sequence[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{_dtype_name(code)}[{numel}]" for code, numel in tensors) + "]"


def _describe_mismatch(
    sender: int, receiver: int, sent: Sequence[int], expected: Sequence[int]
) -> str | None:
    """How the sender's plan towards the receiver and the receiver's plan from the sender differ
    (global ranks), or None if they agree. The same text on both ranks."""
    s_items, r_items = _parse_words(sent), _parse_words(expected)
    for i, ((s_expert, s_tensors), (r_expert, r_tensors)) in enumerate(zip(s_items, r_items, strict=False)):
        if (s_expert, s_tensors) == (r_expert, r_tensors):
            continue
        if s_expert != r_expert:
            why = "expert ids differ"
        elif len(s_tensors) != len(r_tensors):
            why = f"{len(s_tensors)} tensor(s) sent, {len(r_tensors)} expected"
        else:
            j = next(j for j, (a, b) in enumerate(zip(s_tensors, r_tensors, strict=True)) if a != b)
            (s_code, s_numel), (r_code, r_numel) = s_tensors[j], r_tensors[j]
            if s_code != r_code:
                why = f"tensor {j}: {_dtype_name(s_code)} sent, {_dtype_name(r_code)} expected"
            else:
                size = DTYPES[s_code].itemsize if 0 <= s_code < len(DTYPES) else 0
                why = (
                    f"tensor {j}: {s_numel} elements ({s_numel * size} bytes) sent, "
                    f"{r_numel} elements ({r_numel * size} bytes) expected"
                )
        return (
            f"global rank {sender} sends expert {s_expert} to global rank {receiver} as "
            f"{_format_tensors(s_tensors)}, but global rank {receiver} receives expert {r_expert} from "
            f"global rank {sender} into {_format_tensors(r_tensors)} (transfer {i} between them: {why})"
        )
    if len(s_items) != len(r_items):
        return (
            f"global rank {sender} sends {len(s_items)} expert(s) {[e for e, _ in s_items]} to global "
            f"rank {receiver}, but global rank {receiver} receives {len(r_items)} expert(s) "
            f"{[e for e, _ in r_items]} from global rank {sender}"
        )
    return None
