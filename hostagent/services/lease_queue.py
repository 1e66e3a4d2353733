"""The lease queue: deferred requests (QUEUED leases) in serve order, priority then age (`in_order`, `position`), the
expected grant time of one (`eta`), and granting from the head while devices allow, nothing jumping a head that
must wait (`drain`), run by the background task that wakes whenever devices may have freed (`run`). A grant from the
queue goes through the grant path's `claim` and `bind_and_attach`.
"""

from __future__ import annotations

import logging

from hostagent.domain.errors import Conflict
from hostagent.domain.lease import Lease, LeaseState, Waiting, estimate_eta, queue_order
from hostagent.services.grant_path import bind_and_attach, claim, feasible, is_free
from hostagent.services.lease_types import LOGGER, LeaseCore

log = logging.getLogger(LOGGER)

S = LeaseState


def in_order(m: LeaseCore) -> list[Lease]:
    """Queued leases in serve order."""
    waiting = {x.id: x for x in m.leases.values() if x.state is S.QUEUED}
    order = queue_order(Waiting(x.id, x.request.priority, x.queued_at or x.created_at, x.request.gpus)
                        for x in waiting.values())
    return [waiting[w.lease_id] for w in order]


def position(m: LeaseCore, lease: Lease) -> int | None:
    """1-based position in the queue."""
    for i, x in enumerate(in_order(m), start=1):
        if x.id == lease.id:
            return i
    return None


def eta(m: LeaseCore, lease: Lease) -> float | None:
    """Expected grant time of a queued lease."""
    q = in_order(m)
    ahead: list[int] = []
    for x in q:
        if x.id == lease.id:
            break
        ahead.append(x.request.gpus)
    candidates = feasible(m, lease.request)
    free = sum(1 for g in candidates if is_free(m, g.id))
    ends = [x.expected_end or m.clock() + m.policy.default_duration_s
            for x in m.leases.values() if x.state.holds_devices
            for gid in x.gpu_ids if gid in {g.id for g in candidates}]
    return estimate_eta(m.clock(), free, ends, ahead, lease.request.gpus)


async def drain(m: LeaseCore) -> list[Lease]:
    """Grant queued requests, in priority-then-age order, while devices allow."""
    granted = []
    while True:
        async with m._decide:
            head = next(iter(in_order(m)), None)
            if head is None:
                return granted
            free = [g for g in feasible(m, head.request) if is_free(m, g.id)]
            need = head.request.gpus
            if len(free) < need and not (head.request.accept_partial and free):
                return granted  # the head waits; nothing jumps it
            count = min(need, len(free))
            async with m.lease_lock(head.id):  # a concurrent release of the queued lease wins cleanly
                current = m.leases.get(head.id)
                if current is None or current.state is not S.QUEUED:
                    continue
                try:
                    lease = await claim(m, current, free, count, "queue",
                                        f"granted from the queue after {m.clock() - (current.queued_at or current.created_at):.0f} s")
                except Conflict:
                    return granted  # no acceptable set yet (e.g. numa_policy=required): the head keeps waiting
        granted.append(await bind_and_attach(m, lease, "queue"))


async def run(m: LeaseCore) -> None:
    """Background task: drain the queue whenever devices may have freed."""
    while True:
        await m._wake_queue.wait()
        m._wake_queue.clear()
        try:
            await m.drain_queue()
        except Exception:
            log.exception("queue drain failed")
