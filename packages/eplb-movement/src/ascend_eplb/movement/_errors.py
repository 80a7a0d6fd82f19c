""":class:`EplbTransferError` and the report of a failed ``execute``."""

from __future__ import annotations

from ascend_eplb.movement._plan import Queued

__all__ = ["EplbTransferError"]

# Gloo's error for requests on a context whose wait timed out (it closes every pair of the context).
OWN_TIMEOUT_CLOSURE = "Application timeout caused pair closure"


class EplbTransferError(RuntimeError):
    """An ``execute`` failed; the communicator's queue was cleared and the next ``execute`` starts clean.

    Attributes:
        layer_idx: MoE layer given to ``set_transfer_context`` for this batch, or None.
        sequence: 1-based count of this ``execute`` (equal on all ranks: the batch's Gloo tag).
        phase: ``"staging"`` (this rank's staging failed, announced to peers; or an accelerator fault
            seen when an expert's D2H copy was waited for, its sends then not posted), ``"handshake"``
            (a plan disagreed, a peer failed, or a header never came: no payload with those peers,
            no row written), ``"gloo"`` (a payload request failed) or ``"h2d"``.
        sends: global peer rank -> logical expert ids this rank was sending it.
        recvs: global peer rank -> logical expert ids this rank was receiving from it.
        unanswered_ranks: global ranks whose requests did not complete (timed out or connection lost),
            sorted; empty when the failure was local.
        rank_errors: global rank -> the Gloo error of its first failed request.
        timeout_s: the bound that applied to the wait.
        mismatches: global peer rank -> descriptions of how the two plans disagree (one per
            direction that disagrees; the same text on both ranks of the pair).
        failed_peers: global ranks that reported, in the handshake, that they failed before it.
    """

    def __init__(
        self,
        message: str,
        *,
        layer_idx: int | None,
        sequence: int,
        phase: str,
        sends: dict[int, list[int]],
        recvs: dict[int, list[int]],
        unanswered_ranks: list[int],
        rank_errors: dict[int, str],
        timeout_s: float,
        mismatches: dict[int, list[str]] | None = None,
        failed_peers: list[int] | None = None,
    ):
        super().__init__(message)
        self.mismatches = dict(mismatches or {})
        self.failed_peers = list(failed_peers or [])
        self.layer_idx = layer_idx
        self.sequence = sequence
        self.phase = phase
        self.sends = sends
        self.recvs = recvs
        self.unanswered_ranks = unanswered_ranks
        self.rank_errors = rank_errors
        self.timeout_s = timeout_s

    @property
    def peers(self) -> list[int]:
        """Global ranks this rank was exchanging with in the failed batch, sorted."""
        return sorted(set(self.sends) | set(self.recvs))

    @property
    def expert_ids(self) -> list[int]:
        """Logical expert ids of the failed batch (sent or received), sorted."""
        return sorted({e for ids in (*self.sends.values(), *self.recvs.values()) for e in ids})


def transfer_error(
    queue: list[Queued],
    *,
    me: int,
    timeout_s: float,
    layer_idx: int | None,
    sequence: int,
    phase: str,
    rank_errors: dict[int, str],
    cause: BaseException | None,
    mismatches: dict[int, list[str]],
    failed_peers: list[int],
    copy_fault: bool = False,
) -> EplbTransferError:
    """The error of a failed ``execute`` of global rank ``me``; ``copy_fault``: a device-to-host copy
    failed after the handshake (``phase == "staging"``)."""
    sends: dict[int, list[int]] = {}
    recvs: dict[int, list[int]] = {}
    for q in queue:
        (sends if q.is_send else recvs).setdefault(q.global_peer, []).append(q.expert_id)
    sends = {r: sorted(set(ids)) for r, ids in sorted(sends.items())}
    recvs = {r: sorted(set(ids)) for r, ids in sorted(recvs.items())}
    unanswered = sorted(rank_errors)
    where = f"layer {layer_idx}" if layer_idx is not None else "a layer"
    parts = [
        f"EPLB expert transfer of {where} (execute #{sequence}, rank {me}) failed in the {phase} phase",
        f"sending experts to global ranks {sends or '{}'}",
        f"receiving experts from global ranks {recvs or '{}'}",
    ]
    if mismatches:
        parts.append(
            "the transfer plans disagree: "
            + "; ".join(t for _, texts in sorted(mismatches.items()) for t in texts)
        )
    if failed_peers:
        parts.append(f"global rank(s) {sorted(failed_peers)} failed before the handshake and sent nothing")
    if unanswered:
        timed_out = [r for r in unanswered if "Timed out" in rank_errors[r]]
        closed = [r for r in unanswered if OWN_TIMEOUT_CLOSURE in rank_errors[r]]
        lost = [r for r in unanswered if r not in timed_out and r not in closed]
        if timed_out:
            parts.append(
                f"global rank(s) {timed_out} did not answer within {timeout_s:g} s (Gloo then "
                "closes this rank's connections in the group, so later transfers over it fail at once)"
            )
        if closed:
            parts.append(
                f"requests with global rank(s) {closed} were aborted: this rank's Gloo connections "
                "in the group were closed by a timeout"
            )
        if lost:
            parts.append(
                "connection to global rank(s) "
                + ", ".join(f"{r} failed ({rank_errors[r].splitlines()[0]})" for r in lost)
            )
    if cause is not None:
        parts.append(f"cause: {type(cause).__name__}: {cause}")
    if phase == "staging" and copy_fault:
        parts.append(
            "a device-to-host copy failed after the handshake: this rank's sends from that expert on were "
            "not posted, so its peers see them unanswered, and no destination row was written"
        )
    elif phase == "staging":
        parts.append("nothing was sent or received and no destination row was written")
    elif phase == "handshake":
        excluded = sorted(set(mismatches) | set(failed_peers) | set(rank_errors))
        parts.append(
            f"no payload moved with global rank(s) {excluded} and no destination row of this "
            "execute was written"
        )
    return EplbTransferError(
        "; ".join(parts),
        layer_idx=layer_idx,
        sequence=sequence,
        phase=phase,
        sends=sends,
        recvs=recvs,
        unanswered_ranks=unanswered,
        rank_errors=dict(rank_errors),
        timeout_s=timeout_s,
        mismatches=mismatches,
        failed_peers=sorted(failed_peers),
    )
