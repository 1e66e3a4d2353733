"""Priority preemption as data: which running leases a waiting request of high priority may take GPUs from.

A request at or above the operator's threshold (`leases.preempt_min_priority`, 0: never) that cannot start reclaims
GPUs from leases of strictly lower priority, the lowest priority first and, among equals, the youngest (the one that
has run the shortest and loses the least work); a lease the operator opted out of reclaim is never a victim. It
takes only as many as its shortfall needs, and none at all when the victims it may take could not cover the
shortfall (a preemption that cannot start the request would end other tenants' work for nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Holder:
    """A running lease as preemption sees it: `usable` is how many of its GPUs the waiting request could use."""

    lease_id: str
    priority: int
    granted_at: float
    usable: int
    paused: bool = False


@dataclass(frozen=True, slots=True)
class Preemption:
    """The leases to reclaim (in order) and why; no victims when preemption cannot or need not help."""

    victims: tuple[str, ...]
    reason: str


def may_preempt(priority: int, threshold: int) -> bool:
    """Whether a request of this priority may preempt at all (threshold 0: preemption is off)."""
    return threshold > 0 and priority >= threshold


def choose_victims(priority: int, shortfall: int, holders: Sequence[Holder]) -> Preemption:
    """The fewest lowest-priority, youngest leases whose usable GPUs cover `shortfall` for a request of
    `priority`; never a lease of equal or higher priority, never a paused one."""
    if shortfall <= 0:
        return Preemption((), "enough GPUs are free or already being reclaimed")
    eligible = sorted((h for h in holders if h.priority < priority and h.usable > 0 and not h.paused),
                      key=lambda h: (h.priority, -h.granted_at, h.lease_id))
    victims: list[str] = []
    covered = 0
    for h in eligible:
        if covered >= shortfall:
            break
        victims.append(h.lease_id)
        covered += h.usable
    if covered < shortfall:
        return Preemption((), f"leases of lower priority hold only {covered} usable GPU(s), {shortfall} needed")
    return Preemption(tuple(victims), f"{len(victims)} lease(s) of lower priority free {covered} GPU(s)")


__all__ = ["Holder", "Preemption", "choose_victims", "may_preempt"]
