"""Consolidation: when the head of the queue asks for several GPUs and waits only because the free ones are
scattered (enough of them, but no set its placement accepts, e.g. ``numa_policy = required`` with two free GPUs on
each node), find the fewest make-before-break moves (:mod:`~hostagent.services.moves`) of running leases that free
a whole block for it.

The plan, made after every queue drain that leaves such a head waiting:

- *blocks*: every block of the host's topology when the placer knows it (NVLink cliques, switches, root
  complexes, NUMA nodes, the host), else each NUMA node;
- in a block, the head's free GPUs there plus the GPUs it would vacate must be enough, and the placement must
  accept exactly those (asked through the placer itself, so every filter, the NUMA policy and the VM's node
  apply);
- only a lease whose guest said it can move its work (`movable: true` on its request: the guest agent sends it
  when it has an `on_move` hook), ACTIVE, holding one GPU, with no move, top-up or reclaim notice under way, is
  moved; each to a free GPU outside the block that meets its own request and is not booked before it ends (a
  matching: no two to one GPU);
- the fewest moves win; among equal counts the smallest block, then the lowest-priority, youngest leases.

The plan is proposed on the waiting lease (its `queue.consolidation` in the API, the journal's `consolidate`
event); with `leases.consolidate = true` the agent performs it, one move at a time, each as the operator's
`hostagent lease move` would (the guest has the move's deadline to confirm). The GPUs each move frees go to the
head of the queue in its turn (a new request never jumps a queued one).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hostagent.domain.errors import Conflict, HostAgentError
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import Lease, LeaseState
from hostagent.services import bookings, moves
from hostagent.services.grant_path import feasible, head_shadow, is_free, quota_allows
from hostagent.services.lease_types import LOGGER, LeaseCore

log = logging.getLogger(LOGGER)
S = LeaseState
ACTOR = "consolidate"
RETRY_S = 60.0  # a plan whose move failed is not performed again for this long (proposed meanwhile)


@dataclass(frozen=True)
class Move:
    """One lease's GPU to another."""

    lease_id: str
    from_gpu: str
    to_gpu: str

    def to_dict(self) -> dict[str, str]:
        return {"lease_id": self.lease_id, "from": self.from_gpu, "to": self.to_gpu}


@dataclass(frozen=True)
class Plan:
    """The fewest moves that let the head of the queue start: the block they free and the moves."""

    block: str
    frees: tuple[str, ...]  # the GPUs the moves vacate
    moves: tuple[Move, ...]

    def describe(self) -> str:
        steps = ", ".join(f"{mv.lease_id} {mv.from_gpu} -> {mv.to_gpu}" for mv in self.moves)
        return (f"the free GPUs are scattered: {len(self.moves)} move(s) would free {self.block} for it "
                f"({steps})")

    def to_dict(self) -> dict[str, Any]:
        return {"block": self.block, "frees": list(self.frees), "moves": [mv.to_dict() for mv in self.moves],
                "message": self.describe()}


def _blocks(m: LeaseCore) -> list[tuple[str, frozenset[str]]]:
    """The areas a plan may free, smallest first: the topology's blocks, else the NUMA nodes."""
    topo = getattr(m.place, "topology", None) or getattr(getattr(m.place, "topology_place", None), "topology", None)
    if topo is not None:
        out = [(f"{b.kind} {b.id}", frozenset(b.gpu_ids)) for b in topo.blocks()]
    else:
        nodes: dict[Any, set[str]] = {}
        for g in m.gpus.values():
            nodes.setdefault(g.numa_node, set()).add(g.id)
        out = [(f"NUMA node {n}", frozenset(ids)) for n, ids in nodes.items()]
    return sorted(out, key=lambda b: (len(b[1]), b[0]))


def _movable(lease: Lease) -> bool:
    return (lease.state is S.ACTIVE and lease.request.movable and len(lease.devices) == 1 and not lease.move
            and not lease.adding and lease.notice is None)


def _lease_end(m: LeaseCore, lease: Lease) -> float:
    return lease.expires_at if lease.expires_at is not None else m.clock() + m.policy.default_duration_s


def _match(occupants: Sequence[tuple[str, Lease]], dests: Sequence[Gpu], fits: dict[tuple[str, str], bool],
           k: int) -> list[tuple[str, Lease, str]] | None:
    """``k`` occupants (in preference order) each given a distinct destination it fits (augmenting paths)."""
    owner: dict[str, int] = {}  # destination -> index of the occupant it is given to

    def augment(i: int, seen: set[str]) -> bool:
        for d in dests:
            if d.id in seen or not fits[(occupants[i][0], d.id)]:
                continue
            seen.add(d.id)
            if d.id not in owner or augment(owner[d.id], seen):
                owner[d.id] = i
                return True
        return False

    chosen: list[int] = []
    for i in range(len(occupants)):
        if augment(i, set()):
            chosen.append(i)
            if len(chosen) == k:
                break
    if len(chosen) < k:
        return None
    given = {i: d for d, i in owner.items()}
    return [(occupants[i][0], occupants[i][1], given[i]) for i in chosen]


def plan(m: LeaseCore, head: Lease, free: Collection[Gpu], count: int) -> Plan | None:
    """The fewest moves that free a block for ``head`` (``count`` GPUs, ``free``: its free feasible GPUs), or None
    when no block can be freed by moving leases that said they can move."""
    now = m.clock()
    usable = {g.id for g in feasible(m, head.request)}
    free_ids = {g.id for g in free}
    holder = {gid: x for x in m.leases.values() if x.state.holds_devices for gid in x.gpu_ids}
    open_gpus = [g for g in m.gpus.values() if is_free(m, g.id)]
    fits: dict[tuple[str, str], bool] = {}
    best: tuple[tuple[int, int], Plan] | None = None
    for name, ids in _blocks(m):
        here = [g for g in free if g.id in ids]
        k = count - len(here)
        if k <= 0 or (best is not None and k > best[0][0]):
            continue
        occupants = sorted(((gid, holder[gid]) for gid in ids if gid in usable and gid in holder
                            and holder[gid].id != head.id and _movable(holder[gid])),
                           key=lambda o: (o[1].request.priority, -(o[1].granted_at or o[1].created_at), o[0]))
        if len(occupants) < k:
            continue
        dests = [g for g in open_gpus if g.id not in ids or g.id not in free_ids]
        for gid, lease in occupants:
            ok = {g.id for g in feasible(m, lease.request)}
            for d in dests:
                if (gid, d.id) not in fits:
                    fits[(gid, d.id)] = d.id in ok and bool(
                        bookings.clear_for(m, [d], now, _lease_end(m, lease)))
        matched = _match(occupants, dests, fits, k)
        if matched is None:
            continue
        vacated = [m.gpus[gid] for gid, _, _ in matched]
        if not _would_place(m, head, [*here, *vacated], count):
            continue
        candidate = Plan(name, tuple(gid for gid, _, _ in matched),
                         tuple(Move(lease.id, gid, dest) for gid, lease, dest in matched))
        rank = (k, len(ids))
        if best is None or rank < best[0]:
            best = (rank, candidate)
    return None if best is None else best[1]


def _would_place(m: LeaseCore, head: Lease, candidates: Sequence[Gpu], count: int) -> bool:
    """Whether the placement accepts ``count`` of exactly ``candidates`` for the head (without recording a
    decision: the placer's `would_place` where it has one)."""
    ask = getattr(m.place, "would_place", m.place)
    try:
        ask(head.request, list(candidates), count, head.domain_uuid)
    except Conflict:
        return False
    return True


def _waits_scattered(m: LeaseCore) -> tuple[Lease, list[Gpu], int] | None:
    """The head of the queue when it asks for several GPUs, enough of them are free, and the placement still has
    no set for it: it waits only for where they are."""
    hs = head_shadow(m, m.clock())
    if hs is None:
        return None
    head = hs[0]
    count = min(head.request.gpus, quota_allows(m, head))
    if count < 2:
        return None
    now = m.clock()
    free = [g for g in feasible(m, head.request) if is_free(m, g.id)]
    free = bookings.clear_for_run(m, free, head.request, now)
    if len(free) < count or _would_place(m, head, free, count):
        return None
    return head, free, count


def _in_flight(m: LeaseCore, lease_ids: Iterable[str]) -> bool:
    return any((x := m.leases.get(i)) is not None and x.move for i in lease_ids)


async def consider(m: LeaseCore) -> Plan | None:
    """After a drain: propose (and with `leases.consolidate`, perform) the plan for a head that waits only because
    the free GPUs are scattered. Returns the plan proposed now, if any."""
    async with m._decide:
        live = {x.id for x in m.leases.values() if x.state is S.QUEUED}
        for gone in [k for k in m.consolidation if k not in live]:
            del m.consolidation[gone]
        waiting = _waits_scattered(m)
        if waiting is None:
            return None
        head, free, count = waiting
        before = m.consolidation.get(head.id)
        if before is not None and _in_flight(m, (mv["lease_id"] for mv in before["moves"])):
            return None  # its moves are under way: the drain after they finish grants it
        if before is not None and m.clock() - before.get("failed_at", -RETRY_S) < RETRY_S:
            return None  # a move of it failed a moment ago: not again at every wake of the queue
        found = plan(m, head, free, count)
        if found is None:
            if before is not None:
                del m.consolidation[head.id]
            return None
        perform = m.policy.consolidate
        entry = {**found.to_dict(), "performed": perform, "proposed_at": m.clock()}
        if before is None or before["moves"] != entry["moves"]:
            m.consolidation[head.id] = entry
            detail = f"{found.describe()}; {'performing it' if perform else 'proposed (leases.consolidate is off)'}"
            await m._run(m.journal.event, "consolidate", actor=ACTOR, lease_id=head.id,
                         gpu_id=",".join(found.frees), detail=detail)
            log.info("lease %s: %s", head.id, detail, extra={"lease_id": head.id})
        elif not perform:
            return found
    if perform:
        for mv in found.moves:
            try:
                await moves.start(m, mv.lease_id, mv.to_gpu, mv.from_gpu, actor=ACTOR)
            except HostAgentError as exc:  # the lease ended, the GPU went: the next drain plans again
                log.warning("lease %s: the consolidating move %s -> %s failed: %s", mv.lease_id, mv.from_gpu,
                            mv.to_gpu, exc.message, extra={"lease_id": mv.lease_id})
                entry["failed_at"] = m.clock()
                entry["failed"] = f"{mv.lease_id} {mv.from_gpu} -> {mv.to_gpu}: {exc.message}"
                break
    return found


__all__ = ["ACTOR", "Move", "Plan", "consider", "plan"]
