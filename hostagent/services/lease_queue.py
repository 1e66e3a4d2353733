"""The lease queue: deferred requests (QUEUED leases) in serve order, priority then age (`in_order`), every queued
lease's position and expected grant time computed once per change (`view`, `position`, `eta`), and granting from
the head while devices allow, backfilling behind a head that must wait only what cannot delay it (`drain`), run by
the background task that wakes whenever devices may have freed (`run`). A grant from the
queue goes through the grant path's `claim` and `bind_and_attach`.
"""

from __future__ import annotations

import dataclasses
import logging

from hostagent.domain.errors import Conflict
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import Lease, LeaseState
from hostagent.domain.preemption import Holder, choose_victims, may_preempt
from hostagent.services.grant_path import (
    BACKFILL_DEPTH,
    backfill_room,
    bind_and_attach,
    busy_until,
    claim,
    feasible,
    head_shadow,
    is_free,
    queued_in_order,
    quota_allows,
    quota_view,
)
from hostagent.services.lease_types import LOGGER, LeaseCore

log = logging.getLogger(LOGGER)
VIEW_MAX_AGE_S = 1.0  # queue positions and ETAs are recomputed at least this often (ETAs move with the clock)

S = LeaseState


def in_order(m: LeaseCore) -> list[Lease]:
    """Queued leases in serve order."""
    return queued_in_order(m)


def view(m: LeaseCore) -> dict[str, tuple[int, float | None]]:
    """Every queued lease's 1-based position and expected grant time, computed once per change of the leases
    (any journaled step, a quarantine) and reused by every read until the next: listing a long queue costs one
    sort and one sweep per group of leases that could use the same GPUs, not one per lease."""
    key = (m.step_count, len(m.quarantined), len(m.attention))
    cached = m.queue_cache
    if cached is not None and cached[0] == key and m.clock() - cached[1] < VIEW_MAX_AGE_S:
        return cached[2]
    now = m.clock()
    order = in_order(m)
    out: dict[str, tuple[int, float | None]] = {}
    groups: dict[frozenset[str], list[float]] = {}  # usable GPUs -> when each frees (now for a free one), sorted
    cursor: dict[frozenset[str], tuple[int, float]] = {}
    for pos, lease in enumerate(order, start=1):
        usable = frozenset(g.id for g in feasible(m, lease.request))
        if usable not in groups:
            groups[usable] = sorted(now if is_free(m, gid) else max(now, busy_until(m, gid, now)) for gid in usable)
            ahead = [x.request.gpus for x in order[:pos - 1]]
            cursor[usable] = _consume(groups[usable], (0, now), ahead)
        pool = groups[usable]
        at, t = cursor[usable]
        n = lease.request.gpus
        eta = None if at + n > len(pool) else max(t, pool[at + n - 1])
        out[lease.id] = (pos, eta)
        for other in groups:  # this lease takes its GPUs before anyone behind it, in every group
            cursor[other] = _consume(groups[other], cursor[other], [n])
    m.queue_cache = (key, now, out)
    return out


def _consume(pool: list[float], state: tuple[int, float], takes: list[int]) -> tuple[int, float]:
    """Walk a sorted pool of free-at times: each request takes the next `n` (see domain.lease.estimate_eta)."""
    at, t = state
    for n in takes:
        if at + n > len(pool):
            return len(pool) + 1, t
        t = max(t, pool[at + n - 1])
        at += n
    return at, t


def position(m: LeaseCore, lease: Lease) -> int | None:
    """1-based position in the queue."""
    got = view(m).get(lease.id)
    return got[0] if got else None


def eta(m: LeaseCore, lease: Lease) -> float | None:
    """Expected grant time of a queued lease."""
    got = view(m).get(lease.id)
    return got[1] if got else None


async def drain(m: LeaseCore) -> list[Lease]:
    """Grant queued requests while devices allow: the head of the queue first (in priority-then-age order, past
    any whose tenant is at its quota), then any request behind it that can start now without delaying the head's
    predicted start (EASY backfilling). Each grant is re-checked against the tenant's quotas, and a partial grant
    is capped to what they leave."""
    granted = []
    while True:
        async with m._decide:
            pick = _next_grant(m)
            if pick is None:
                await preempt_for_head(m)
                return granted
            head, free, count, why = pick
            async with m.lease_lock(head.id):  # a concurrent release of the queued lease wins cleanly
                current = m.leases.get(head.id)
                if current is None or current.state is not S.QUEUED:
                    continue
                waited = m.clock() - (current.queued_at or current.created_at)
                try:
                    lease = await claim(m, current, free, count, "queue",
                                        f"granted from the queue after {waited:.0f} s" + (f"; {why}" if why else ""))
                except Conflict:
                    return granted  # no acceptable set yet (e.g. numa_policy=required): it keeps waiting
        granted.append(await bind_and_attach(m, lease, "queue"))


def _next_grant(m: LeaseCore) -> tuple[Lease, list[Gpu], int, str | None] | None:
    """The queued lease to grant now, the GPUs it may use, how many, and why it may start ahead of the head."""
    now = m.clock()
    order = in_order(m)
    allows = quota_view(m)
    hs = head_shadow(m, now, order, allows)
    if hs is None:
        return None
    head = hs[0]
    at = order.index(head)
    for x in order[at:at + BACKFILL_DEPTH]:  # the head, then backfill candidates: bounded work per decision
        allowed = allows(x)
        if not allowed:
            continue
        free = [g for g in feasible(m, x.request) if is_free(m, g.id)]
        need = min(x.request.gpus, allowed)
        if x is head:
            if len(free) >= need or (x.request.accept_partial and free):
                return x, free, min(need, len(free)), None
            continue  # the head waits; only what cannot delay it may start
        room = backfill_room(m, dataclasses.replace(x.request, gpus=need), free, now, hs)
        if room is not None:
            return x, room[0], min(need, len(room[0])), room[1]
    return None


async def preempt_for_head(m: LeaseCore) -> tuple[str, ...]:
    """When the head of the queue waits and its priority is at `leases.preempt_min_priority` or above, give the
    fewest lowest-priority, youngest running leases it needs a reclaim notice for it (the cooperative path of idle
    reclaim: the guest is told, may checkpoint and release; the reaper detaches at the notice's deadline).
    GPUs already being freed (a notice out, a release under way) count towards it, so a head is never given more
    victims than it needs however often the queue drains. Runs under the decide lock; returns the victims."""
    threshold = m.policy.preempt_min_priority
    if threshold <= 0:  # preemption is off (see may_preempt): no head to find, no leases to scan at every drain
        return ()
    hs = head_shadow(m, m.clock())
    if hs is None or not may_preempt(hs[0].request.priority, threshold):
        return ()
    head, usable, _ = hs
    need = min(head.request.gpus, quota_allows(m, head))
    free = sum(1 for gid in usable if is_free(m, gid))
    freeing = 0
    holders = []
    for x in m.leases.values():
        mine = sum(1 for gid in x.gpu_ids if gid in usable)
        if not mine or not x.state.holds_devices:
            continue
        if x.state in (S.RELEASING, S.DETACHING, S.DETACH_PENDING, S.REBINDING) or x.notice == "reclaim":
            freeing += mine
        elif x.state is S.ACTIVE:
            holders.append(Holder(x.id, x.request.priority, x.granted_at or x.created_at, mine, x.reclaim_paused))
    decision = choose_victims(head.request.priority, need - free - freeing, holders)
    if not decision.victims:
        return ()
    now = m.clock()
    for victim_id in decision.victims:
        async with m.lease_lock(victim_id):
            victim = m.leases.get(victim_id)
            if victim is None or victim.state is not S.ACTIVE or victim.notice == "reclaim":
                continue
            why = (f"preempted by {head.id} (priority {head.request.priority}, at or above "
                   f"leases.preempt_min_priority {threshold}; this lease has {victim.request.priority})")
            await m._write(victim.with_changes(notice="reclaim", notice_deadline=now + m.policy.preempt_notice_s,
                                               preempted_by=head.id),
                           victim.state, "queue", f"reclaim notice: {why}")
            await m._run(m.journal.event, "preempt", actor="queue", lease_id=victim.id,
                         gpu_id=",".join(victim.gpu_ids), detail=why)
            log.warning("lease %s: %s", victim.id, why, extra={"lease_id": victim.id})
    return decision.victims


async def run(m: LeaseCore) -> None:
    """Background task: drain the queue whenever devices may have freed."""
    while True:
        await m._wake_queue.wait()
        m._wake_queue.clear()
        try:
            await m.drain_queue()
        except Exception:
            log.exception("queue drain failed")
