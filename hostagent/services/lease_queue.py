"""The lease queue: deferred requests (QUEUED leases) in serve order, priority then age (`in_order`), every queued
lease's position and expected grant time computed once per change (`view`, `position`, `eta`), and granting from
the head while devices allow, backfilling behind a head that must wait only what cannot delay it (`drain`), run by
the background task that wakes whenever devices may have freed (`run`). A grant from the
queue goes through the grant path's `claim` and `bind_and_attach`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Container, Iterable, Sequence
from typing import NamedTuple

from hostagent.domain.assignment import Candidate, choose
from hostagent.domain.calendar import INF, Hold, earliest_window
from hostagent.domain.errors import Conflict
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import Lease, LeaseRequest, LeaseState
from hostagent.domain.preemption import Holder, choose_victims, may_preempt
from hostagent.services import bookings, top_up
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
ETA_HORIZON_S = 365 * 86400.0  # with bookings, no ETA is given past a year (a request that cannot fit before)

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
    out = _view_with_bookings(m, order, now) if bookings.has_bookings(m) else _view_by_pools(m, order, now)
    for lease_id, at in m.queue_waits.items():  # it waits for a better GPU: it starts when that one frees
        got = out.get(lease_id)
        if got is not None and got[1] is not None and at > got[1]:
            out[lease_id] = (got[0], at)
    m.queue_cache = (key, now, out)
    return out


def _view_by_pools(m: LeaseCore, order: list[Lease], now: float) -> dict[str, tuple[int, float | None]]:
    """The queue's positions and ETAs without bookings: one sorted pool of free-at times per group of leases that
    could use the same GPUs, each lease taking the next GPUs of every pool in serve order."""
    out: dict[str, tuple[int, float | None]] = {}
    groups: dict[frozenset[str], list[float]] = {}  # usable GPUs -> when each frees (now for a free one), sorted
    cursor: dict[frozenset[str], tuple[int, float]] = {}
    memo = _Usable(m)
    frees = functools.cache(lambda gid: expected_free_at(m, gid, now, memo))  # (each GPU once)
    for pos, lease in enumerate(order, start=1):
        usable = frozenset(g.id for g in feasible(m, lease.request))
        if usable not in groups:
            groups[usable] = sorted(now if is_free(m, gid) else max(now, frees(gid)) for gid in usable)
            ahead = [x.request.gpus for x in order[:pos - 1]]
            cursor[usable] = _consume(groups[usable], (0, now), ahead)
        pool = groups[usable]
        at, t = cursor[usable]
        n = lease.request.gpus
        eta = None if at + n > len(pool) else max(t, pool[at + n - 1])
        out[lease.id] = (pos, eta)
        for other in groups:  # this lease takes its GPUs before anyone behind it, in every group
            cursor[other] = _consume(groups[other], cursor[other], [n])
    return out


def _view_with_bookings(m: LeaseCore, order: list[Lease], now: float) -> dict[str, tuple[int, float | None]]:
    """The queue's positions and ETAs when bookings are in the calendar: a GPU that frees before a booking of it
    starts serves a queued lease only if the lease ends before the booking's lead time (the grant path keeps leases
    clear of bookings), so each lease's ETA is the earliest window in which enough of its usable GPUs are free for
    its whole duration, past the leases holding them now (until `expected_free_at`), the bookings, and the leases queued
    ahead of it (each in its own window, holding its GPUs from then on, as :func:`_view_by_pools` assumes)."""
    cal = [h for h in bookings.holds(m, now) if h.booking]
    memo = _Usable(m)
    cal += [Hold(gid, now, max(now, expected_free_at(m, gid, now, memo)), m.claims.get(gid, "")) for gid in m.gpus
            if not is_free(m, gid)]
    out: dict[str, tuple[int, float | None]] = {}
    for pos, lease in enumerate(order, start=1):
        usable = [g.id for g in feasible(m, lease.request)]
        duration = lease.request.duration_s or m.policy.default_duration_s
        w = earliest_window(usable, cal, lease.request.gpus, duration, now, now + ETA_HORIZON_S)
        out[lease.id] = (pos, None if w is None else w.start)
        if w is not None:
            cal += [Hold(g, w.start, INF, lease.id) for g in w.gpus[:lease.request.gpus]]
    return out


def expected_free_at(m: LeaseCore, gpu_id: str, now: float, usable: _Usable) -> float:
    """When a claimed GPU is expected to free, for the queue (a request weighing a wait for it, every queued
    request's ETA): `busy_until` (its lease's expiry, or its reclaim deadline), or sooner where its lease is ACTIVE and
    stated no length (its expiry is then only `leases.default_duration_s`): having run as long as it has, what the
    model's records of its task type say it goes on for (`domain.assignment.run_left_s`, as the simulator dates a
    busy GPU), at the rate its GPUs run it (:func:`running_rate`, from `usable`: the caller's memo of predictions). The
    grant path's backfilling keeps to `busy_until`: a backfill must not delay the head past it."""
    end = busy_until(m, gpu_id, now)
    lease = m.leases.get(m.claims.get(gpu_id, ""))
    if lease is None or lease.state is not S.ACTIVE or lease.granted_at is None or lease.request.duration_s:
        return end
    rate = running_rate(lease, usable)  # the records' run times are at rate 1: its run so far, and what is left
    left = m.left_run_s(lease.request.task_type, max(0.0, now - lease.granted_at) * rate)
    return end if left is None else min(end, now + left / rate)


def running_rate(lease: Lease, usable: _Usable) -> float:
    """The relative rate a granted lease runs at as the active model predicts it: its slowest GPU's (a set runs at
    the pace of its slowest); 1.0 without an active model. The model's run times are at rate 1 (the task
    type's typical rate), so a lease that has run `t` seconds has done `t * rate` of it and takes `left / rate`
    seconds for what is left (as the simulator counts a running job). Asked of the decision's memo: one prediction
    per request shape, as for the queued."""
    ranked = usable.ranked(lease.request)
    rates = [] if ranked is None else [ranked.by_id.get(d.gpu_id, 0.0) for d in lease.devices]
    low = min(rates) if rates else 0.0
    return low if low > 0 else 1.0


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
        booked = await _convert_due(m)  # bookings whose start has come go first: their time was promised
        if booked is not None:
            granted.append(await bind_and_attach(m, booked, "calendar"))
            continue
        async with m._decide:
            pick = _next_grant(m)
            if pick is None:
                more = top_up.next_top_up(m)  # nothing queued can start: a partial grant may take a free GPU
                if more is not None:
                    done = await top_up.top_up(m, more[0].id, more[1])
                    if done is not None and done.gpu_ids != more[0].gpu_ids:
                        granted.append(done)
                        continue
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
    """The queued lease to grant now, the GPUs it may use, how many, and why it starts ahead of others (None: in
    its turn); None when none should start now (none can, or each that could would rather wait for a better GPU).
    Every lease that could start now is a candidate: the head when enough GPUs are free, and those behind it that
    cannot delay it (EASY backfilling); of those, comparative advantage decides (:func:`_by_advantage`), else the
    first in serve order."""
    now = m.clock()
    order = in_order(m)
    allows = quota_view(m)
    hs = head_shadow(m, now, order, allows)
    if hs is None:
        return None
    head = hs[0]
    at = order.index(head)
    usable = _Usable(m)
    calendar = bookings.has_bookings(m)
    ready: list[tuple[Lease, list[Gpu], int, str | None]] = []
    for x in order[at:at + BACKFILL_DEPTH]:  # the head, then backfill candidates: bounded work per decision
        allowed = allows(x)
        if not allowed:
            continue
        free = usable.free(x.request)
        if calendar:  # never a GPU it would still hold when a booking of it starts
            free = bookings.clear_for_run(m, free, x.request, now)
        need = min(x.request.gpus, allowed)
        if x is head or (ready and ready[0][0] is head):
            # the head can start: every request that can start too competes with it for the free GPUs (comparative
            # advantage among the head's priority, bounded by the fairness bound; a lower priority only for GPUs
            # every request above it would rather leave for a better one: domain.assignment)
            if len(free) >= need or (x.request.accept_partial and free):
                ready.append((x, free, min(need, len(free)), None))
        else:
            # (a copy only where its quota cuts it: dataclasses.replace costs 3 us, a decision asks dozens)
            asked = x.request if need == x.request.gpus else dataclasses.replace(x.request, gpus=need)
            room = backfill_room(m, asked, free, now, hs)
            if room is not None:
                ready.append((x, room[0], min(need, len(room[0])), room[1]))
        if len(ready) == 1 and ready[0][0] is x and _strict(m, x):
            return ready[0]  # the first that can start goes, as in strict serve order
    if not ready:
        return None
    # (one lease alone too: it may rather wait for a better GPU about to free)
    return _by_advantage(m, ready, order, now, usable)


class _Usable:
    """One decision's memo of which GPUs could serve a request, which of them are free, and their predicted rates:
    queued requests come in few shapes, so each shape is filtered and predicted once per decision, not once per
    queued lease. Across decisions the manager keeps each shape's predictions ranked (`m.queue_shapes`): used as
    they are while the placer's token (`m.rates_token`: the model, every GPU's probe figures) is unchanged, asked
    for again otherwise, and ranked again only when the placer answers anew (Placer.relative_rates returns the very
    tuple it returned before when neither the model, the GPUs nor their probes changed)."""

    def __init__(self, m: LeaseCore) -> None:
        self.m = m
        self._feasible: dict[tuple[object, ...], list[Gpu]] = {}
        self._free_of: dict[tuple[object, ...], list[Gpu]] = {}
        self._rates: dict[tuple[object, ...], Ranked | None] = {}
        self._figures: dict[tuple[object, ...], tuple[str, str | None, dict[str, float]] | None] = {}
        self._sds: dict[tuple[object, ...], dict[str, float]] = {}
        self._better: dict[tuple[object, ...], Line | None] = {}
        self._ends: dict[str, float] = {}  # claimed GPU -> when it is expected to free (frees_at)
        self._terms: dict[tuple[object, ...], tuple[float, float | None, float, Line | None] | None] = {}
        self._free = {gid for gid in m.gpus if is_free(m, gid)}
        token = m.rates_token()  # once per decision: what every shape's predictions depend on
        self._token = None if token is None else (m.relative_rates, m.rate_uncertainty, token)

    def feasible(self, request: LeaseRequest) -> list[Gpu]:
        key = (request.min_memory_gib, request.vendor, request.model, request.requires)
        got = self._feasible.get(key)
        if got is None:
            got = self._feasible[key] = feasible(self.m, request)
        return got

    def free(self, request: LeaseRequest) -> list[Gpu]:
        key = (request.min_memory_gib, request.vendor, request.model, request.requires)
        got = self._free_of.get(key)
        if got is None:
            got = self._free_of[key] = [g for g in self.feasible(request) if g.id in self._free]
        return list(got)

    def ranked(self, request: LeaseRequest) -> Ranked | None:
        """The request shape's predicted relative rate on each usable GPU, best first (None: no active model)."""
        key = _shape(request)
        if key in self._rates:
            return self._rates[key]
        gpus = tuple(self.feasible(request))
        kept = self.m.queue_shapes.get(key)
        # a request's length and priority move every GPU's prediction alike: the queue compares GPUs by the
        # model's figure for what the work is (task type, precision, data scale, memory), so the queued
        # requests fall into few shapes and each is predicted once per model (Placer.relative_rates keeps them)
        # (its size and terms do not matter: the placer predicts each GPU for a request of one)
        if kept is not None and self._token is not None and kept.token == self._token and kept.gpus == gpus:
            self._rates[key] = kept  # nothing they depend on changed: as they were
            return kept
        plain = kept.plain if kept is not None else dataclasses.replace(request, duration_s=None, priority=0)
        rates = self.m.relative_rates(plain, gpus)
        if rates is None:
            got = None
        elif kept is not None and rates is kept.rates and kept.gpus == gpus:
            got = kept  # the same predictions for the same GPUs: ranked as before
        else:
            if len(self.m.queue_shapes) >= SHAPES_KEPT:
                self.m.queue_shapes.clear()
            got = self.m.queue_shapes[key] = Ranked(plain, gpus, rates)
        if got is not None:
            got.token = self._token
        self._rates[key] = got
        return got

    def sds(self, request: LeaseRequest) -> dict[str, float]:
        """Each usable GPU's log-space standard deviation of its predicted rate for the request ({}: none given, or
        no active model); asked of the placer once per shape while its token is unchanged."""
        key = _shape(request)
        if key in self._sds:
            return self._sds[key]
        got = self.ranked(request)
        if got is None:
            out: dict[str, float] = {}
        elif got.sds_of is not None and got.sds_token == self._token is not None:
            out = got.sds  # asked under the same token: as it was
        else:
            sds = self.m.rate_uncertainty(got.plain, got.gpus)
            if sds is None:
                out = {}
            else:
                if sds is not got.sds_of:  # a new answer (the same one: as it was)
                    got.sds, got.sds_of = dict(zip((g.id for g in got.gpus), sds)), sds
                out, got.sds_token = got.sds, self._token
        self._sds[key] = out
        return out

    def frees_at(self, gpu_id: str, now: float) -> float:
        """When a claimed GPU is expected to free (:func:`expected_free_at`), once per GPU and decision."""
        got = self._ends.get(gpu_id)
        if got is None:
            got = self._ends[gpu_id] = expected_free_at(self.m, gpu_id, now, self)
        return got

    def better_in(self, request: LeaseRequest, by_id: dict[str, float], best: float, now: float) -> Line | None:
        """The line for the GPUs of the request's best predicted rate (`best`, of its rates `by_id`): in how many
        seconds each is expected to free (0 for a free one), soonest first, and which GPUs they are (None: none is
        busy); one answer per request shape, best rate and decision (a set's best is its count-th best GPU's)."""
        key = (_shape(request), best)
        if key not in self._better:
            at_best = frozenset(gid for gid, rate in by_id.items() if rate >= best * 0.999)
            ends = sorted(0.0 if gid in self._free else self.frees_at(gid, now) - now for gid in at_best)
            self._better[key] = Line(tuple(ends), at_best) if ends and ends[-1] > 0 else None
        return self._better[key]

    def kth_of(self, request: LeaseRequest, gpus: Iterable[Gpu], count: int) -> str | None:
        """Of these GPUs (a backfill's room), the one whose predicted rate for the request is the `count`-th best:
        a set of `count` of them runs at its rate (None: fewer, or no active model)."""
        got = self.ranked(request)
        return None if got is None else _kth_free(got.order, {g.id for g in gpus}, count)

    def terms(self, request: LeaseRequest, count: int, room: list[Gpu] | None,
              now: float) -> tuple[float, float | None, float, Line | None] | None:
        """What comparative advantage weighs for `count` GPUs of the request (None: no active model): its best
        predicted rate on the host, the rate of the best set it could take now (of `room` for a backfill, else of
        the GPUs free; None: too few), the standard deviation of their ratio, and when the GPUs of its best rate
        are expected to free (None: none busy, or nothing slower to start on).
        Worked out once per request shape, size and decision (a backfill's room is its own)."""
        key = (_shape(request), count)
        if room is None and key in self._terms:
            return self._terms[key]
        got = self.figures(request, count)
        if got is None:
            out = None
        else:
            at_best, at_now, by_id = got
            if room is not None:
                at_now = self.kth_of(request, room, count)
            best = by_id[at_best]
            now_rate = by_id[at_now] if at_now is not None else None  # (every GPU ranked has a rate)
            sd = 0.0
            if now_rate is not None and at_now is not None and now_rate < best:  # a ratio of two predictions
                sds = self.sds(request)
                sd = math.hypot(sds.get(at_now, 0.0), sds.get(at_best, 0.0))
            better = None
            if now_rate is not None and best > now_rate:  # (a set waits for `count` of them)
                better = self.better_in(request, by_id, best, now)
            out = (best, now_rate, sd, better)
        if room is None:
            self._terms[key] = out
        return out

    def figures(self, request: LeaseRequest, count: int) -> tuple[str, str | None, dict[str, float]] | None:
        """For `count` GPUs of the request: the GPU whose rate is its best on the host (the count-th best of every
        GPU it may use), the one whose rate is that of the best set free now (None: too few free) and the rates by
        GPU; None without an active model. Asked only of a request that could start now: it has a usable GPU,
        and `count` is at least one."""
        key = (_shape(request), count)
        if key not in self._figures:
            got = self.ranked(request)
            if got is None:
                self._figures[key] = None
            else:
                at_best = got.order[min(count, len(got.order)) - 1]
                self._figures[key] = (at_best, _kth_free(got.order, self._free, count), got.by_id)
        return self._figures[key]


class Line(NamedTuple):
    """The GPUs of a request's best predicted rate, as it would stand in line for them: in how many seconds each is
    expected to free (0 for a free one; soonest first), and which GPUs of the host are at that rate (requests whose
    best are the same GPUs share the line: `domain.assignment`)."""

    frees_in: tuple[float, ...]
    gpus: frozenset[str]


SHAPES_KEPT = 512  # request shapes whose ranked predictions the queue keeps across decisions (cleared when full)


class Ranked:
    """A request shape's predictions as the queue keeps them across decisions: the request asked for (its length and
    priority cleared), the GPUs asked about, the placer's answer as it came (compared by identity) and the rates
    by GPU, best first (ties in the GPUs' order); the uncertainties likewise, once asked for; the placer's token
    each was last asked under."""

    __slots__ = ("plain", "gpus", "rates", "by_id", "order", "sds_of", "sds", "token", "sds_token")

    def __init__(self, plain: LeaseRequest, gpus: tuple[Gpu, ...], rates: Sequence[float]) -> None:
        self.plain, self.gpus, self.rates = plain, gpus, rates
        self.by_id = dict(zip((g.id for g in gpus), rates))
        by_id = self.by_id
        self.order = sorted(by_id, key=lambda gid: -by_id[gid])  # best first; a stable sort: ties in the GPUs' order
        self.sds_of: Sequence[float] | None = None
        self.sds: dict[str, float] = {}
        self.token: object = None
        self.sds_token: object = None


def _kth_free(order: Sequence[str], free: Container[str], count: int) -> str | None:
    """Of the GPUs ranked best first, the `count`-th free one: a set of `count` runs at the rate of its slowest
    (None: fewer are free)."""
    seen = 0
    for gid in order:
        if gid in free:
            seen += 1
            if seen == count:
                return gid
    return None


def _shape(request: LeaseRequest) -> tuple[object, ...]:
    """What the GPUs a request may use and their predicted rates depend on (not its VM, size or deadline)."""
    return (request.min_memory_gib, request.vendor, request.model, request.requires, request.task_type,
            request.data_scale, request.precision, request.numa_policy)


def _running_by_task(m: LeaseCore, now: float, usable: _Usable) -> dict[str, list[float]]:
    """How much each ACTIVE lease on the host's GPUs has run so far at rate 1 (its time so far times its predicted
    rate: :func:`running_rate`), by task type: the queue counts them in a task type's expected run time
    (`domain.assignment.expected_run_s`: short leases end first, so the ended alone would price every wait for a
    better GPU as if leases were short)."""
    out: dict[str, list[float]] = {}
    for lease_id in set(m.claims.values()):  # (a lease on several GPUs: once)
        lease = m.leases.get(lease_id)
        if lease is not None and lease.state is S.ACTIVE and lease.granted_at is not None:
            done = max(0.0, now - lease.granted_at) * running_rate(lease, usable)
            out.setdefault(lease.request.task_type, []).append(done)
    return out


def _strict(m: LeaseCore, first: Lease) -> bool:
    """Whether the queue keeps strict serve order for this decision: the operator turned comparative advantage
    off, or no model is active (nothing to compare by). A request of a task type the model does not cover yet is
    compared by the model's predictions too, with their deviations (Placer.relative_rates)."""
    return not m.policy.fairness.enabled or m.relative_rates(first.request, []) is None


def _by_advantage(m: LeaseCore, ready: list[tuple[Lease, list[Gpu], int, str | None]], order: list[Lease],
                  now: float, usable: _Usable) -> tuple[Lease, list[Gpu], int, str | None] | None:
    """Of the queued leases that could start now, the one `domain.assignment.choose` picks: the highest
    priority among them, then the one closest to its best predicted rate on this host (comparative advantage),
    within the operator's fairness bound; strict serve order without an active model. None: every one would rather
    wait for a better GPU (and a lower priority may not take the free GPUs either). Leases passed over are counted
    (and told), a lease that chooses to wait for a better GPU is told why."""
    rank = {x.id: i for i, x in enumerate(order)}
    live = {x.id for x in order}
    for kept in (m.queue_passes, m.queue_notes, m.queue_waits):  # what the queue remembers of leases gone from it
        for gone in [k for k in kept if k not in live]:
            del kept[gone]
    cands: list[Candidate] = []
    run_of: dict[str, float | None] = {}
    running: dict[str, list[float]] | None = None  # asked for once, by the first request that states no duration
    for x, free, count, backfill in ready:
        request = x.request
        # (every priority: a lower one starts only on GPUs every request above it would rather leave for better)
        # a backfill may take only its room, not every free GPU: its terms are rated on that room
        got = usable.terms(request, count, free if backfill is not None else None, now)
        if got is None:  # no active model (the placer then answers no request): strict order
            return ready[0]
        best, now_rate, sd, better = got
        # its expected run time on a typical GPU: what it states, else what the records show of its task type
        if request.duration_s:
            run_s: float | None = float(request.duration_s)
        else:
            task = request.task_type
            if task not in run_of:
                if running is None:
                    running = _running_by_task(m, now, usable)
                run_of[task] = m.typical_run_s(task, running.get(task, ()))
            run_s = run_of[task]
        n, since = m.queue_passes.get(x.id, (0, None))
        # (`better` counts only with a run time: Candidate.gains_by_waiting)
        cand = Candidate(x.id, rank[x.id], request.priority, now_rate, best, n, since, run_s, sd=sd, count=count)
        if better is not None:  # it may stand in line for the GPUs of its best rate
            cand.stand_in_line(better.frees_in, better.gpus)
            if sd and run_s is not None:  # a draw only where it may decide: a wait to weigh, a doubt to draw in
                cand.doubt = m.doubt(request)
        cands.append(cand)
    pick = choose(cands, m.policy.fairness, now)
    for lease_id, why in pick.waiting.items():
        m.queue_notes[lease_id] = why
        at = now + pick.free_in[lease_id]
        if m.queue_waits.get(lease_id) != at:
            m.queue_waits[lease_id] = at
            m.queue_cache = None  # its ETA is when that GPU frees, not now
    by_lease = {x.id: (x, free, count, why) for x, free, count, why in ready}
    if pick.chosen is None:
        return None  # every lease that could start would rather wait for a better GPU: the free ones stay free
    fb = m.policy.fairness
    for lease_id in pick.passed:
        n, since = m.queue_passes.get(lease_id, (0, None))
        m.queue_passes[lease_id] = (n + 1, now if since is None else since)
        if lease_id not in pick.waiting:
            m.queue_waits.pop(lease_id, None)
            m.queue_notes[lease_id] = (f"passed over {n + 1} time(s) by requests that gain more from the GPUs free "
                                       f"then (comparative advantage); served in turn after {fb.max_passes} times or "
                                       f"{fb.max_delay_s:g} s")
    was_passed = m.queue_passes.pop(pick.chosen, None)
    m.queue_notes.pop(pick.chosen, None)
    m.queue_waits.pop(pick.chosen, None)
    x, free, count, why = by_lease[pick.chosen]
    drawn = pick.drawn.get(pick.chosen)
    if not pick.passed and not pick.waiting and was_passed is None and not pick.unsure and drawn is None:
        return x, free, count, why  # in its turn, nobody passed, nothing in doubt: nothing to explain
    return x, free, count, "; ".join(w for w in (why, pick.reason, drawn) if w)


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


async def _convert_due(m: LeaseCore) -> Lease | None:
    """The first booking whose start (less the lead time) has come, bound as BINDING on its GPUs (or on others that
    fit where its own are not free); too few free: it waits first among its priority in the queue; its window
    over: EXPIRED. None when no booking is due."""
    async with m._decide:
        now = m.clock()
        for lease in bookings.due(m, now):
            async with m.lease_lock(lease.id):
                current = m.leases.get(lease.id)
                if current is None or current.state is not S.BOOKED:
                    continue
                end = bookings.booking_end(current)
                if end <= now:
                    await m._move(current, S.EXPIRED, "calendar", "its window passed before it could start",
                                  ended_at=now, end_reason="booking window passed")
                    continue
                others = bookings.holds(m, now, ignore=[current.id])
                free = [g for g in feasible(m, current.request) if is_free(m, g.id)
                        and bookings.next_start(others, g.id, now) >= end]
                chosen, count, why = bookings.conversion(m, current, free)
                if count < len(current.booked_gpus) and now < (current.request.start_at or 0):
                    continue  # a GPU still on its way back (an expiry, a detach): try again until its start
                if count < len(current.booked_gpus) and not (current.request.accept_partial and count):
                    await m._move(current, S.QUEUED, "calendar", f"{why}: waits first among its priority",
                                  queued_at=current.created_at, reasons=(*current.reasons, why))
                    m._wake_queue.set()
                    continue
                try:
                    return await claim(m, current, chosen, count, "calendar", why, until=end)
                except Conflict as exc:
                    await m._move(current, S.QUEUED, "calendar", f"placement: {exc.message}",
                                  queued_at=current.created_at)
    return None


async def run(m: LeaseCore) -> None:
    """Background task: drain the queue whenever devices may have freed, and when the next booking is due."""
    while True:
        wait = bookings.next_due_in(m, m.clock())
        if wait is None:
            await m._wake_queue.wait()
        else:
            with contextlib.suppress(TimeoutError):  # a due booking waiting for its GPUs: tried twice a second
                async with asyncio.timeout(min(max(wait, 0.5), 60.0)):
                    await m._wake_queue.wait()
        m._wake_queue.clear()
        try:
            await m.drain_queue()
        except Exception:
            log.exception("queue drain failed")
