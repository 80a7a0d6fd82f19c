"""Runtime verifier of a serving worker: invariants 3 and 5 checked at every commit (README "Verifier").

Switched on by ``ASCEND_EPLB_VERIFY=1`` (the switch and the checks' names: :mod:`.guardrail_facts`);
off, nothing is allocated or hooked. On, :class:`EplbVerifier` fingerprints every slot's kernel storage
at registration, checks at each layer commit that every local slot holds its committed logical expert
(``fingerprints``) and that the lookup equals the committed maps (``lookups``), and after a step with
commits checks on every rank that the maps' checksums and a probe batch's replicas agree (one
``all_gather`` on the EP CPU group). A violation is published as :class:`VerifierViolation`, then raised
at the next step boundary on every rank alike as :class:`EplbVerificationError` naming the check, step,
layer, rank and slot.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.parallel_state import get_ep_group
from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

from ascend_eplb.control.bus import CommitEvent, Event, EventBus, RegistrationEvent, StepEvent
from ascend_eplb.dataplane import build_replica_table, map_to_physical_and_record, table_checksum
from ascend_eplb.quant_views import expert_fingerprint

__all__ = [
    "EplbVerificationError",
    "EplbVerifier",
    "VerifierViolation",
]

#: Rows of the replica-agreement probe batch (each routes every logical expert once).
PROBE_ROWS = 8
#: The gathered probe entry of a rank without a fresh probe this step (no layer committed).
_NO_PROBE = -1


@dataclass(frozen=True)
class VerifierViolation(Event):
    """One failed serving check: where, and what was seen; published on the controller's event bus just
    before :class:`EplbVerificationError` is raised. (Not start-up validation's ``Violation``, a support
    matrix rule's finding: this one has a step, a rank, a layer and a slot.)"""

    check: str
    step: int
    rank: int
    layer: int | None
    slot: int | None
    detail: str
    model: str | None = None
    """upstream ``EplbModelState.model_name`` of the model checked (not part of the message)."""

    def message(self) -> str:
        where = [f"step {self.step}", f"rank {self.rank}"]
        if self.layer is not None:
            where.insert(1, f"layer {self.layer}")
        if self.slot is not None:
            where.append(f"slot {self.slot}")
        return f"EPLB verifier: {self.check} check failed at {', '.join(where)}: {self.detail}"

    @classmethod
    def lookups(cls, step: int, rank: int, layer: int | None, detail: str, model: str) -> VerifierViolation:
        """A failed ``lookups`` check (no slot: a lookup or the committed maps, not one slot, differ)."""
        return cls("lookups", step, rank, layer, None, detail, model)


class EplbVerificationError(RuntimeError):
    """A verifier check failed (raised on every EP rank at the same step boundary).

    Attributes:
        check: ``"fingerprints"`` or ``"lookups"``.
        step: the verifier's step count (EPLB steps since registration) when the violation was found.
        rank: the EP rank that found it.
        layer: the MoE layer, or None for a whole-model check.
        slot: the physical slot (global id in ``[0, P)``), or None.
    """

    def __init__(self, violation: VerifierViolation) -> None:
        super().__init__(violation.message())
        self.check = violation.check
        self.step = violation.step
        self.rank = violation.rank
        self.layer = violation.layer
        self.slot = violation.slot


def slot_fingerprints(layer: Any, num_rows: int) -> list[str]:
    """BLAKE2b-128 hex digest of each local row ``0 .. num_rows - 1`` of a MoE layer's expert storage.

    Uses ``layer.expert_storage`` (a quant_views ``ExpertStorage``: every kernel tensor, so a weight
    view list that forgets a tensor is caught) when the layer has one, else every tensor of
    ``layer.get_expert_weights()`` (what upstream moves; read once for all rows).
    """
    storage = getattr(layer, "expert_storage", None)
    if storage is not None:
        return [expert_fingerprint(storage, row) for row in range(num_rows)]
    # Stacked (p, ...) tensors or per-expert lists (quant_views' ExpertTensorList): ``view[row]`` either way.
    views = list(layer.get_expert_weights())
    out = []
    for row in range(num_rows):
        digest = hashlib.blake2b(digest_size=16)
        for view in views:
            data = view[row].to("cpu").contiguous().view(-1).view(torch.uint8)
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(ctypes.string_at(data.data_ptr(), data.numel()))  # the row's bytes, one copy
        out.append(digest.hexdigest())
    return out


class EplbVerifier:
    """The checks of the module docstring for every model registered with one controller.

    Use :meth:`attach` (``create_eplb_controller`` does when
    :func:`~ascend_eplb.integration.guardrail_facts.verify_requested`).

    Attributes:
        steps: the controller's ``steps_run`` (the step in progress; after the run, the steps EPLB ran,
            profile runs not counted): the step a violation names, as the events file's records do.
        commits_checked: layer commits checked on this rank.
        boundaries_checked: step boundaries that ran the collective checks (those after a commit).
        bus: the event bus attached to (None before :meth:`attach`); each :class:`VerifierViolation` is
            published there just before it is raised, on every rank that raises it.
    """

    def __init__(self) -> None:
        self.commits_checked = 0
        self.boundaries_checked = 0
        self.bus: EventBus | None = None
        self._models: dict[str, dict[str, Any]] = {}
        self._pending: VerifierViolation | None = None
        self._committed_layers: dict[str, set[int]] = {}  # per model: layers committed since last step
        self._controller: Any = None

    @property
    def steps(self) -> int:
        return 0 if self._controller is None else self._controller.steps_run

    def attach(self, bus: EventBus) -> None:
        """Subscribe to a controller's event bus (control's ``AscendEPLBController.bus``, once, when the
        controller is built): model registration, each commit event, step."""
        self.bus = bus
        bus.subscribe(RegistrationEvent, self.on_model_registered)
        bus.subscribe(CommitEvent, self.on_commit)
        bus.subscribe(StepEvent, self.on_step)

    # ------------------------------------------------------------------ registration
    def on_model_registered(self, event: RegistrationEvent) -> None:
        """Fingerprint every logical expert from the ranks' initial slots (one gather, every rank)."""
        model_config = event.model_config
        self._controller = event.controller
        state = event.controller.state
        key = model_config.compute_hash()
        model_state = state.model_states[key]
        layers = list(get_mixture_of_experts_model(event.model).moe_layers)
        group = get_ep_group()
        rank, num_ranks = group.rank_in_group, group.world_size
        p2l = model_state.physical_to_logical_map.cpu()
        p = p2l.shape[1] // num_ranks
        local = [slot_fingerprints(layer, p) for layer in layers]
        gathered: list[Any] = [None] * num_ranks
        dist.all_gather_object(gathered, local, group=group.cpu_group)
        logical: list[dict[int, str]] = []
        for layer_idx in range(len(layers)):
            fps: dict[int, str] = {}
            for other, per_layer in enumerate(gathered):
                for row, fp in enumerate(per_layer[layer_idx]):
                    slot = other * p + row
                    expert = int(p2l[layer_idx, slot])
                    if fps.setdefault(expert, fp) != fp:
                        self._raise(
                            VerifierViolation(
                                "fingerprints",
                                0,
                                other,
                                layer_idx,
                                slot,
                                f"at load, slot {slot} holds logical expert {expert} with weights that "
                                "differ from another replica of it",
                                model_state.model_name,
                            )
                        )
            logical.append(fps)
        self._models[key] = {
            "key": key,
            "model_state": model_state,
            "layers": layers,
            "logical": logical,
            "rank": rank,
            "num_ranks": num_ranks,
            "p": p,
            "table_ptrs": {
                i: [ls.replica_lookup.table.data_ptr() for ls in states]
                for i, states in state.layer_states(model_config).items()
            },
            "layer_states": state.layer_states(model_config),
            "group": group,
        }

    # ------------------------------------------------------------------ per commit
    def _model_of(self, model_state: Any) -> dict[str, Any] | None:
        for entry in self._models.values():
            if entry["model_state"] is model_state:
                return entry
        return None

    def on_commit(self, event: CommitEvent) -> None:
        """At a layer's ``refresh`` (its lookups follow the commit): the per-layer checks, once per step
        boundary until a violation is pending."""
        if event.kind != "refresh":
            return
        entry = self._model_of(event.model_state)
        if entry is None:
            return
        self._committed_layers.setdefault(entry["key"], set()).add(event.layer)
        if self._pending is None:
            self.commits_checked += 1
            self._pending = self._check_layer(entry, event.layer)

    def _check_layer(self, entry: dict[str, Any], layer_idx: int) -> VerifierViolation | None:
        ms, rank, p = entry["model_state"], entry["rank"], entry["p"]
        p2l = ms.physical_to_logical_map[layer_idx].cpu()
        layer = entry["layers"][layer_idx]
        local = p2l[rank * p : (rank + 1) * p].tolist()
        for row, (fingerprint, expert) in enumerate(zip(slot_fingerprints(layer, p), local, strict=True)):
            slot = rank * p + row
            if fingerprint != entry["logical"][layer_idx].get(expert):
                return VerifierViolation(
                    "fingerprints", self.steps, rank, layer_idx, slot,
                    f"after the commit the slot's weights are not logical expert {expert}'s", ms.model_name,
                )  # fmt: skip
        l2p = ms.logical_to_physical_map[layer_idx].cpu()
        counts = ms.logical_replica_count[layer_idx].cpu()
        for ls, ptr in zip(entry["layer_states"][layer_idx], entry["table_ptrs"][layer_idx], strict=True):
            lookup = ls.replica_lookup
            if lookup.table.data_ptr() != ptr:
                return VerifierViolation.lookups(
                    self.steps, rank, layer_idx, "the lookup table's storage changed", ms.model_name
                )
            expected = build_replica_table(
                l2p, counts, rows=lookup.rows, num_physical_experts=int(p2l.shape[0])
            ).to(lookup.table.device)
            if not torch.equal(lookup.table, expected):
                bad = (lookup.table != expected).nonzero()[0].tolist()
                return VerifierViolation.lookups(
                    self.steps, rank, layer_idx,
                    f"lookup row {bad[0]} expert {bad[1]} holds {int(lookup.table[bad[0], bad[1]])}, the "
                    f"committed maps give {int(expected[bad[0], bad[1]])}", ms.model_name,
                )  # fmt: skip
        return None

    def _probe_checksum(self, entry: dict[str, Any], layers: set[int]) -> int:
        """The physical ids the probe batch gets through each of ``layers``' lookups with the layer's
        row layout (what the next forward reads), stacked in layer order, as one digest
        (:func:`~ascend_eplb.dataplane.table_checksum`; no load is recorded)."""
        physical = []
        for layer_idx in sorted(layers):
            ls = entry["layer_states"][layer_idx][0]
            table = ls.replica_lookup.table
            ids = torch.arange(table.shape[1], device=table.device).repeat(PROBE_ROWS, 1)
            off = torch.zeros((), dtype=torch.bool, device=table.device)
            physical.append(
                map_to_physical_and_record(
                    ids, table, ls.expert_load_view, off, ls.num_unpadded_tokens_tensors[0], ls.row_layout
                )
            )
        return table_checksum(torch.cat(physical))

    # ------------------------------------------------------------------ per step
    def _raise(self, violation: VerifierViolation) -> None:
        if self.bus is not None:
            self.bus.publish(violation)
        raise EplbVerificationError(violation)

    def on_step(self, event: StepEvent) -> None:
        """The step boundary: after a step in which layers committed, the collective checks and any
        violation found at those commits; otherwise nothing (no collective, O(1)).

        Raises:
            EplbVerificationError: on every rank, when any rank found a violation.
        """
        if not self._committed_layers:
            return
        committed, self._committed_layers = self._committed_layers, {}
        self._check_boundary(event.controller, committed)

    def _check_boundary(self, controller: Any, committed: dict[str, set[int]]) -> None:
        self.boundaries_checked += 1
        entries = list(self._models.values())
        group = entries[0]["group"]
        rank = entries[0]["rank"]
        sums = [table_checksum(e["model_state"].physical_to_logical_map.cpu()) for e in entries]
        layout = getattr(controller, "last_row_layout", None)
        probes = [
            self._probe_checksum(e, committed[e["key"]])
            if layout is not None and committed.get(e["key"])
            else _NO_PROBE
            for e in entries
        ]
        # Which layers each probe covers (a bit per layer, folded past 62): ranks compare like with like.
        masks = [sum(1 << (layer % 62) for layer in committed.get(e["key"], ())) for e in entries]
        sharing = _NO_PROBE if layout is None else layout.sharing_group
        mine = torch.tensor(
            [0 if self._pending is None else 1, *sums, *probes, *masks, sharing], dtype=torch.int64
        )
        gathered = [torch.empty_like(mine) for _ in range(group.world_size)]
        dist.all_gather(gathered, mine, group=group.cpu_group)
        if any(int(t[0]) for t in gathered):
            violations: list[Any] = [None] * group.world_size
            dist.all_gather_object(violations, self._pending, group=group.cpu_group)
            self._raise(next(v for v in violations if v is not None))
        n = len(sums)
        for other, theirs in enumerate(gathered):
            if not torch.equal(theirs[: 1 + n], mine[: 1 + n]):
                model = next(i for i in range(n) if int(theirs[1 + i]) != sums[i])
                self._raise(
                    VerifierViolation.lookups(
                        self.steps,
                        rank,
                        None,
                        f"the committed placement of model {entries[model]['model_state'].model_name} "
                        f"differs between rank {other} and rank {rank} (checksums {int(theirs[1 + model])} "
                        f"!= {sums[model]})",
                        entries[model]["model_state"].model_name,
                    )
                )
        if layout is None:
            return
        for other, theirs in enumerate(gathered):
            if other == rank or int(theirs[-1]) != sharing:
                continue
            for i, probe in enumerate(probes):
                same_layers = int(theirs[1 + 2 * n + i]) == masks[i]
                if probe != _NO_PROBE and same_layers and int(theirs[1 + n + i]) not in (_NO_PROBE, probe):
                    self._raise(
                        VerifierViolation.lookups(
                            self.steps,
                            rank,
                            None,
                            f"replica agreement: ranks {min(rank, other)} and {max(rank, other)} route the "
                            f"same rows ({layout.rows} row layout) but chose different replicas for the "
                            f"probe batch of model {entries[i]['model_state'].model_name}'s layer(s) "
                            f"{sorted(committed[entries[i]['key']])}",
                            entries[i]["model_state"].model_name,
                        )
                    )
