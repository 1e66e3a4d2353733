"""The booking calendar: who holds which GPU over which span of time, now and ahead (pure).

A *hold* is one GPU claimed over ``[start, end)``: by a running lease (from now until it is expected to free the
GPU: its expiry, or never when it has none) or by a booking (from its start less the lead time the agent needs to
bind and attach it, until its end). The lease service asks four questions:

- which GPUs are free over a window (`free_over`), for a new booking, and for a lease granted now: a lease never
  takes a GPU it would still hold when a booking of it starts (`clear_until`);
- the earliest window at or after a time in which enough GPUs are free for a duration (`earliest_window`), the offer
  a refused booking gets;
- which bookings a booking of higher priority may displace to fit (`displace`): strictly lower priority only, the
  lowest first, among equals the youngest, only as many as it needs, none when displacing them all would not do;
- when a GPU's next booking starts (`next_start`), which caps a renewal.

Spans are half-open: a hold ending at t and one starting at t do not overlap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True, slots=True)
class Hold:
    """One GPU claimed over [start, end) by a lease (a running one, or a booking)."""

    gpu_id: str
    start: float
    end: float
    lease_id: str
    priority: int = 0
    created_at: float = 0.0
    booking: bool = False  # a booking (displaceable by a higher priority), not a lease holding the GPU now

    def overlaps(self, start: float, end: float) -> bool:
        """Whether this hold meets [start, end)."""
        return self.start < end and start < self.end


@dataclass(frozen=True, slots=True)
class Window:
    """Where a booking fits: its start and the GPUs free over [start, start + duration)."""

    start: float
    gpus: tuple[str, ...]


def free_over(gpus: Iterable[str], holds: Iterable[Hold], start: float, end: float,
              ignore: Iterable[str] = ()) -> list[str]:
    """The GPUs (in the given order) no hold meets over [start, end); holds of the leases in `ignore` don't count."""
    skip = set(ignore)
    busy = {h.gpu_id for h in holds if h.lease_id not in skip and h.overlaps(start, end)}
    return [g for g in gpus if g not in busy]


def next_start(holds: Iterable[Hold], gpu_id: str, after: float, ignore: Iterable[str] = ()) -> float:
    """When the first booking of `gpu_id` that ends after `after` starts (INF when none)."""
    skip = set(ignore)
    return min((h.start for h in holds if h.booking and h.gpu_id == gpu_id and h.end > after
                and h.lease_id not in skip), default=INF)


def clear_until(gpus: Iterable[str], holds: Sequence[Hold], now: float, until: float) -> list[str]:
    """The GPUs a lease granted at `now` and held until `until` may take: no booking of them starts before `until`."""
    return [g for g in gpus if next_start(holds, g, now) >= until]


def earliest_window(gpus: Sequence[str], holds: Sequence[Hold], count: int, duration: float, not_before: float,
                    horizon: float) -> Window | None:
    """The earliest start in [not_before, horizon] at which `count` of `gpus` are free for `duration`; None when
    there is none. The window's GPUs are every one of `gpus` free over it, in the given order.

    Each GPU's earliest free start from a time t (the first s >= t with [s, s + duration) clear of its holds) never
    decreases as t grows; so from t = not_before, moving t to the count-th smallest of those starts never passes the
    earliest window, and stops on it once `count` GPUs are free at t itself. A step costs one pass over the holds;
    a few steps suffice where scanning every hold's end, each against every hold, cost their square (the queue's
    ETAs ask for one window per queued request)."""
    if count < 1 or count > len(gpus):
        return None
    wanted = set(gpus)
    spans: dict[str, list[tuple[float, float]]] = {g: [] for g in gpus}
    for h in holds:
        if h.gpu_id in wanted and h.end > not_before:  # one that ends by then meets no window
            spans[h.gpu_id].append((h.start, h.end))
    for v in spans.values():
        v.sort()

    def free_from(gpu: str, t: float) -> float:
        s = t
        for start, end in spans[gpu]:  # by start: once one starts at or past s + duration, so do the rest
            if end <= s:
                continue
            if start >= s + duration:
                break
            s = end  # it meets [s, s + duration): the earliest clear start is past its end
        return s

    t = not_before
    while t <= horizon:
        starts = {g: free_from(g, t) for g in gpus}
        nth = sorted(starts.values())[count - 1]
        if nth == t:
            return Window(t, tuple(g for g in gpus if starts[g] == t))
        t = nth
    return None


@dataclass(frozen=True, slots=True)
class Displacement:
    """The bookings a booking of higher priority displaces, and the GPUs that then fit it."""

    victims: tuple[str, ...]  # lease ids, in the order chosen
    gpus: tuple[str, ...]


def displace(gpus: Sequence[str], holds: Sequence[Hold], count: int, start: float, end: float,
             priority: int) -> Displacement | None:
    """The fewest bookings of strictly lower priority, the lowest first and among equals the youngest, whose
    removal leaves `count` of `gpus` free over [start, end); None when even removing all of them would not (a
    running lease is never displaced here: preemption is the queue's, by leases.preempt_min_priority)."""
    mine = [h for h in holds if h.overlaps(start, end) and h.gpu_id in set(gpus)]
    candidates: dict[str, tuple[int, float]] = {}
    for h in mine:
        if h.booking and h.priority < priority:
            candidates[h.lease_id] = (h.priority, -h.created_at)
    order = sorted(candidates, key=lambda lid: (candidates[lid], lid))
    removed: list[str] = []
    free = free_over(gpus, mine, start, end)
    for lease_id in order:
        if len(free) >= count:
            break
        removed.append(lease_id)
        free = free_over(gpus, mine, start, end, ignore=removed)
    if len(free) < count:
        return None
    # a victim the later ones made unneeded keeps its booking (the last chosen, of the highest priority, first)
    needed = list(removed)
    for v in reversed(removed):
        rest = [r for r in needed if r != v]
        if len(free_over(gpus, mine, start, end, ignore=rest)) >= count:
            needed = rest
    return Displacement(tuple(needed), tuple(free_over(gpus, mine, start, end, ignore=needed)))


def utc_text(ts: float) -> str:
    """A time as the messages give it, to the second with its zone: `2027-01-15 08:00:07 UTC`."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
