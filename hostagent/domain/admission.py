"""Admission rules, pure: how many GPUs a tenant's quota lets a request take (counting what the tenant holds,
what it has queued and what it used in the last day), and whether a queued request may start now without delaying
the head of the queue (EASY backfilling, as Slurm and Maui do it: the head's predicted start is its "shadow time";
a later request may start now if it ends before then, or if it takes only GPUs the head will not need then)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hostagent.domain.errors import Conflict
from hostagent.domain.lease import Lease, LeaseRequest, Quota

T = TypeVar("T")
DAY_S = 86400.0
LEDGER_MAX = 200_000  # ended leases remembered for the GPU-hours window (a day of short leases fits many times)


@dataclass(frozen=True, slots=True)
class TenantUse:
    """What a VM or a project has: GPUs held by its live leases (granted or being granted), GPUs its queued
    requests may still take, and GPU-hours used in the last day by live and ended leases."""

    held: int = 0
    queued: int = 0
    gpu_hours: float = 0.0


def gpu_hours(spans: Sequence[tuple[float, float | None, int]], now: float, window_s: float = DAY_S) -> float:
    """GPU-hours inside the sliding window [now - window_s, now] of (granted_at, ended_at or None while live,
    GPUs) spans."""
    start = now - window_s
    total = 0.0
    for granted, ended, n in spans:
        lo, hi = max(granted, start), min(ended if ended is not None else now, now)
        if hi > lo:
            total += n * (hi - lo)
    return total / 3600.0


def quota_cap(who: str, quota: Quota, use: TenantUse, request: LeaseRequest) -> int:
    """How many of the request's GPUs the quota lets it take: all of them, or fewer for a request that accepts a
    partial grant. Raise Conflict (nothing changes) when it may take none, when a whole request does not fit what
    the quota leaves, or when the request could never fit the quota at all."""
    if quota.max_gpu_hours_per_day and use.gpu_hours >= quota.max_gpu_hours_per_day:
        raise Conflict(f"quota: {who} used {use.gpu_hours:.1f} of {quota.max_gpu_hours_per_day:g} GPU-hours in the "
                       "last 24 h", field="gpus")
    if not quota.max_gpus:
        return request.gpus
    if request.gpus > quota.max_gpus and not request.accept_partial:
        raise Conflict(f"quota: {who} may hold at most {quota.max_gpus} GPU(s); a request for {request.gpus} can "
                       "never be granted", field="gpus")
    room = quota.max_gpus - use.held - use.queued
    if room >= request.gpus:
        return request.gpus
    if request.accept_partial and room > 0:
        return room
    raise Conflict(f"quota: {who} may hold at most {quota.max_gpus} GPU(s) and holds {use.held}"
                   + (f" with {use.queued} more queued" if use.queued else ""), field="gpus")


class Ledger:
    """Ended leases of the last day, as (domain uuid, domain name, granted_at, ended_at, GPUs): the part of the
    sliding GPU-hours window that live leases no longer show."""

    def __init__(self) -> None:
        self._spans: collections.deque[tuple[str, str, float, float, int]] = collections.deque(maxlen=LEDGER_MAX)

    def add(self, lease: Lease) -> None:
        """Remember an ended lease that was granted (one that never held a GPU used none)."""
        if lease.granted_at is not None and lease.devices:
            ended = lease.ended_at if lease.ended_at is not None else lease.granted_at
            self._spans.append((lease.domain_uuid, lease.domain_name, lease.granted_at, ended, len(lease.devices)))

    def spans(self, match: Callable[[str, str], bool], now: float) -> list[tuple[float, float | None, int]]:
        """The spans of the tenant `match` picks that overlap the last day; older ones are forgotten."""
        while self._spans and self._spans[0][3] < now - DAY_S:  # ends arrive in order, give or take a step
            self._spans.popleft()
        return [(g, e, n) for u, name, g, e, n in self._spans if match(u, name) and e >= now - DAY_S]


    def load(self, ended: Iterable[Lease]) -> None:
        """Fill the ledger from leases that ended (the journal's, at start), oldest first."""
        for x in sorted(ended, key=lambda x: x.ended_at or 0.0):
            self.add(x)


@dataclass(frozen=True, slots=True)
class Shadow:
    """The head of the queue's reservation: when it is predicted to start (None: not predictable from the leases'
    ends), and how many of the GPUs it could use will still be spare then (`extra`)."""

    start: float | None
    extra: int


def shadow(now: float, free: int, busy_until: Sequence[float], need: int) -> Shadow:
    """The head's shadow time over the GPUs it could use: `free` of them free now, the others free at
    `busy_until` (their leases' expected ends). `extra` counts those free by then beyond the head's `need`."""
    pool = sorted([now] * free + [max(now, t) for t in busy_until])
    if need > len(pool):
        return Shadow(None, 0)
    start = pool[need - 1] if need > 0 else now
    return Shadow(start, sum(1 for t in pool if t <= start) - need)


def may_backfill(sh: Shadow, now: float, duration_s: float) -> bool:
    """Whether a request that would hold the head's GPUs for `duration_s` from now ends before the head's shadow
    time (and so cannot delay it)."""
    return sh.start is not None and now + duration_s <= sh.start


def backfill_share(sh: Shadow, now: float, duration_s: float, inside: Sequence[T],
                   outside: Sequence[T]) -> tuple[list[T], bool]:
    """The free GPUs a request behind the head may take now without delaying it, and whether it ends before the
    head's shadow time: every free GPU the head could never use (`outside`), and of the free ones it could use
    (`inside`, in the order to take them), all when the request (held `duration_s` from now) ends before the
    head's shadow time, else only the `extra` the head will not need then. The agent's queue and the simulator's
    first day both decide by it."""
    ends_first = may_backfill(sh, now, duration_s)
    return [*outside, *(inside if ends_first else inside[:max(0, sh.extra)])], ends_first


class TokenBucket:
    """A rate with bursts: `rate` per second sustained, at most `capacity` at once (it starts full)."""

    __slots__ = ("capacity", "rate", "refused_until", "stamp", "tokens")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.stamp = now
        self.refused_until = now  # a taker told to wait is refused until then without its work being looked at

    def take(self, n: float, now: float) -> float:
        """Take `n` now and return 0.0, or take nothing and return the seconds until `n` would be there (and
        remember it: see :meth:`refused_for`)."""
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)
        if n <= self.tokens:
            self.tokens -= n
            return 0.0
        wait = (n - self.tokens) / self.rate
        self.refused_until = now + wait
        return wait

    def charge(self, n: float, now: float) -> None:
        """Take `n` more for work already done, even into debt: the taker waits it off before its next `take`."""
        self.take(0.0, now)
        self.tokens -= n

    def refused_for(self, now: float) -> float:
        """Seconds left of the wait the last refusal named (0.0 when none is left): a taker that comes back sooner
        is refused at once, before the cost of counting what it brings."""
        return max(0.0, self.refused_until - now)

    def give_back(self, n: float) -> None:
        """Return what was taken for work that did not happen after all."""
        self.tokens = min(self.capacity, self.tokens + n)


__all__ = ["DAY_S", "Ledger", "Shadow", "TenantUse", "TokenBucket", "backfill_share", "gpu_hours", "may_backfill",
           "quota_cap", "shadow"]
