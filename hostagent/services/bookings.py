"""Bookings: GPUs reserved ahead for [start_at, start_at + duration_s), kept in a calendar (domain.calendar).

A lease request with `start_at` is a booking (state BOOKED). It is placed now, over the GPUs that are free for its
whole window (the running leases' expected ends and the other bookings considered), by the same placement as a
lease, and holds those GPUs in the calendar from `start_at` less the lead time (what binding and attaching take,
measured) until its end. Then:

- a lease granted now never takes a GPU it would still hold when a booking of it starts (its own length decides: a
  lease with a `duration_s` that ends in time backfills the gap), and a renewal is cut at the next booking;
- a booking that does not fit is refused with the earliest window that does (`available_in_s`, `earliest_start`);
  with `accept_deferred` it is booked at that window, with `accept_partial` it takes what fits at its start;
- a booking of higher priority displaces overlapping bookings of lower priority when that makes it fit (the
  lowest, youngest first; never a running lease): each displaced booking ends, told by whom and the earliest
  window it could have instead;
- at its start less the lead time it binds and attaches its GPUs (`convert_due`, on every queue wake); a GPU that
  is not free then (a detach still pending, a quarantine) is replaced by another free one that fits, and when too
  few are free the booking waits first in the queue among its priority.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Sequence

from hostagent.domain.calendar import INF, Hold, displace, earliest_window, free_over, next_start, utc_text
from hostagent.domain.errors import Conflict, InvalidInput
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import Lease, LeaseRequest, LeaseState, Step, new_lease
from hostagent.services.lease_types import LOGGER, LeaseCore

log = logging.getLogger(LOGGER)
S = LeaseState
MIN_LEAD_FACTOR = 2.0  # a booking starts binding this many times the slowest recent grant ahead of its start


def lead_s(m: LeaseCore) -> float:
    """How long before its start a booking binds and attaches: `leases.booking_lead_s`, or twice the slowest of
    the recent grants (binding and attaching measured) when that is longer."""
    recent = list(m.grant_seconds)
    return max(m.policy.booking_lead_s, MIN_LEAD_FACTOR * max(recent)) if recent else m.policy.booking_lead_s


def booking_end(lease: Lease) -> float:
    """The end of a booking's window."""
    assert lease.request.start_at is not None and lease.request.duration_s is not None
    return lease.request.start_at + lease.request.duration_s


def holds(m: LeaseCore, now: float, *, ignore: Sequence[str] = ()) -> list[Hold]:
    """The calendar: every GPU a lease holds now (until its expiry; a lease without one, a release under way or a
    detach pending: for ever), and every booking's GPUs from its start less the lead time until its end."""
    lead = lead_s(m)
    out = []
    for x in m.leases.values():
        if x.id in ignore:
            continue
        if x.state is S.BOOKED:
            start = (x.request.start_at or now) - lead
            out += [Hold(g, start, booking_end(x), x.id, x.request.priority, x.created_at, booking=True)
                    for g in x.booked_gpus]
        elif x.state.holds_devices:
            end = x.expires_at if (x.state is S.ACTIVE and x.expires_at is not None) else INF
            out += [Hold(g, now, max(end, now), x.id, x.request.priority, x.created_at) for g in x.gpu_ids]
    for gid, why in (*m.quarantined.items(), *m.attention.items()):
        out.append(Hold(gid, now, INF, f"unavailable:{why}"[:80]))
    return out


def has_bookings(m: LeaseCore) -> bool:
    """Whether any booking is in the calendar (the grant path's fast way past it)."""
    return any(x.state is S.BOOKED for x in m.leases.values())


def clear_for(m: LeaseCore, free: Sequence[Gpu], now: float, until: float) -> list[Gpu]:
    """Of `free`, the GPUs a lease held from now until `until` may take: none of them booked before `until`."""
    if not has_bookings(m):
        return list(free)
    cal = holds(m, now)
    return [g for g in free if next_start(cal, g.id, now) >= until]


def clear_for_run(m: LeaseCore, free: Sequence[Gpu], request: LeaseRequest, now: float) -> list[Gpu]:
    """Of `free`, those a request starting now may hold for its whole run (its `duration_s`, else the default
    length) without reaching a booking of them: a lease that ends in time backfills the gap."""
    return clear_for(m, free, now, now + (request.duration_s or m.policy.default_duration_s))


def renewal_cap(m: LeaseCore, lease: Lease, wanted: float) -> tuple[float, str | None]:
    """A renewal's expiry: `wanted`, or cut at the start of the next booking of one of the lease's GPUs (with why)."""
    if not has_bookings(m):
        return wanted, None
    now = m.clock()
    cal = holds(m, now, ignore=[lease.id])
    first = min((next_start(cal, g, now) for g in lease.gpu_ids), default=INF)
    if first >= wanted:
        return wanted, None
    return max(now, first), f"renewed only until {utc_text(first)}: a booking of its GPU(s) starts then"


async def book(m: LeaseCore, domain_uuid: str, domain_name: str, request: LeaseRequest, candidates: Sequence[Gpu],
               actor: str, notes: Sequence[str] = ()) -> Lease:
    """Book `request` (it has start_at and duration_s) over `candidates` (the GPUs that could ever serve it); the
    caller holds the decide lock. Raises Conflict with the earliest window when it does not fit."""
    assert request.start_at is not None and request.duration_s is not None
    now = m.clock()
    if request.start_at > now + m.policy.booking_horizon_s:
        raise InvalidInput(f"start_at is more than leases.booking_horizon_s ({m.policy.booking_horizon_s:g} s) "
                           "ahead", field="start_at")
    if len(candidates) < request.gpus and not request.accept_partial:
        raise Conflict(f"this host has only {len(candidates)} GPU(s) matching the request, {request.gpus} asked",
                       field="gpus")
    start, end = request.start_at, request.start_at + request.duration_s
    cal = holds(m, now)
    ids = [g.id for g in candidates]
    lead = lead_s(m)
    free = free_over(ids, cal, start - lead, end)
    victims: tuple[str, ...] = ()
    why = f"{len(free)} matching GPU(s) free over the window"
    if len(free) < request.gpus:
        shift = displace(ids, cal, request.gpus, start - lead, end, request.priority)
        if shift is not None:
            victims, free = shift.victims, list(shift.gpus)
            why = f"displaced {len(victims)} booking(s) of lower priority ({', '.join(victims)})"
    if len(free) < request.gpus:
        want = min(request.gpus, len(candidates))
        window = earliest_window(ids, cal, want, request.duration_s + lead, start - lead,
                                 now + m.policy.booking_horizon_s)
        if request.accept_partial and free:
            why = f"only {len(free)} of {request.gpus} GPU(s) free over the window; partial booking accepted"
        elif request.accept_deferred and window is not None:
            start = window.start + lead
            end = start + request.duration_s
            free = list(window.gpus)
            why = f"moved to the earliest window that fits, {start - request.start_at:.0f} s later"
        else:
            offer = ("" if window is None else
                     f"; the earliest window that fits starts at {utc_text(window.start + lead)} "
                     f"(in {window.start + lead - now:.0f} s): book it, or set accept_deferred")
            raise Conflict(f"only {len(free)} of {request.gpus} GPU(s) are free from start_at for duration_s"
                           + offer, field="start_at",
                           available_in_s=None if window is None else round(window.start + lead - now, 1),
                           earliest_start=None if window is None else round(window.start + lead, 3))
    count = min(request.gpus, len(free))
    by_id = {g.id: g for g in candidates}
    placement = m.place(request, [by_id[i] for i in free], count, domain_uuid)
    moved = request if start == request.start_at else _moved(request, start)
    lease = new_lease(f"l-{uuid.uuid4().hex[:12]}", domain_uuid, domain_name, moved, now)
    born = (Step(None, S.REQUESTED, "requested"),)
    for victim in victims:
        await _displaced(m, victim, lease, ids)
    lease = await m._move(lease, S.BOOKED, actor, f"booked {', '.join(placement.gpu_ids)} from {utc_text(start)} to "
                          f"{utc_text(end)}", earlier=born, booked_gpus=tuple(placement.gpu_ids),
                          granted_gpus=len(placement.gpu_ids), expires_at=end,
                          reasons=(*notes, why, *placement.reasons))
    m._wake_queue.set()  # the queue's timer: the next conversion may be this one's
    return lease


def _moved(request: LeaseRequest, start: float) -> LeaseRequest:
    return dataclasses.replace(request, start_at=start)


async def _displaced(m: LeaseCore, victim_id: str, by: Lease, ids: Sequence[str]) -> None:
    """End a booking a booking of higher priority displaces, telling it by whom and what it could have instead."""
    async with m.lease_lock(victim_id):
        victim = m.leases.get(victim_id)
        if victim is None or victim.state is not S.BOOKED:
            return
        now = m.clock()
        lead = lead_s(m)
        cal = [h for h in holds(m, now, ignore=[victim_id])]
        cal += [Hold(g, (by.request.start_at or now) - lead, booking_end(by), by.id, booking=True)
                for g in ids]  # what the new booking may take: the offer stays clear of the whole of it
        assert victim.request.duration_s is not None and victim.request.start_at is not None
        window = earliest_window(list(victim.booked_gpus) + [g for g in m.gpus if g not in victim.booked_gpus],
                                 cal, len(victim.booked_gpus), victim.request.duration_s + lead,
                                 victim.request.start_at - lead, now + m.policy.booking_horizon_s)
        offer = ("no other window fits within leases.booking_horizon_s" if window is None else
                 f"the earliest window that fits starts at {utc_text(window.start + lead)}")
        why = (f"displaced by booking {by.id} of priority {by.request.priority} (this one has "
               f"{victim.request.priority}); {offer}")
        await m._move(victim, S.RELEASED, "calendar", why, ended_at=now, end_reason=why)
        log.warning("booking %s: %s", victim.id, why, extra={"lease_id": victim.id})


def due(m: LeaseCore, now: float) -> list[Lease]:
    """Bookings whose start less the lead time has come, earliest first."""
    lead = lead_s(m)
    return sorted((x for x in m.leases.values() if x.state is S.BOOKED and (x.request.start_at or 0) - lead <= now),
                  key=lambda x: (x.request.start_at or 0, -x.request.priority, x.created_at))


def next_due_in(m: LeaseCore, now: float) -> float | None:
    """Seconds until the next booking is due (None: no booking): how long the queue's loop may sleep."""
    lead = lead_s(m)
    starts = [(x.request.start_at or 0) - lead for x in m.leases.values() if x.state is S.BOOKED]
    return max(0.0, min(starts) - now) if starts else None


def conversion(m: LeaseCore, lease: Lease, free: Sequence[Gpu]) -> tuple[list[Gpu], int, str]:
    """What a due booking binds: its own GPUs where free, else free ones that fit (`free`, the caller's: feasible
    and free now); the count, and why."""
    own = [g for g in free if g.id in lease.booked_gpus]
    need = len(lease.booked_gpus)
    others = [g for g in free if g.id not in lease.booked_gpus]
    chosen = own + others[:max(0, need - len(own))]
    if len(own) == need:
        return chosen, need, "the booking's start: its GPUs, as booked"
    if len(chosen) >= need:
        return chosen, need, (f"the booking's start: {need - len(own)} booked GPU(s) not free, replaced by others "
                              "that fit")
    return chosen, len(chosen), f"the booking's start: only {len(chosen)} of {need} GPU(s) free"
