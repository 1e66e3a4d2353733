"""Queue-aware assignment as data: which of the queued requests that could start now gets the free GPUs first.

A policy that gives the free GPUs to the head of the queue ("the best free GPU for the job in front") spends a fast
GPU on a job that gains little from it while a job that gains a lot waits behind, and on a heterogeneous host that,
not the per-decision choice, sets completion time (Gavel, OSDI'20: comparative advantage). So when several queued
requests of the same priority could start now, the one whose best free set is closest to the best it could ever
have on this host goes first: its **efficiency**, the predicted work rate of that set over its best predicted rate on
any GPU of the host it may use (free or not). Requests ahead of it in serve order are *passed over*.

Uncertainty: a request is preferred to one ahead of it only where the predictions tell their efficiencies apart.
Each candidate may carry the standard deviation of its log efficiency (`sd`, from the learned throughput matrix: a
few per cent for pairs with records, the interactions' spread for a pair never seen together); where the gap between
the most efficient request and another is within their combined deviation, they count as equal and serve order
decides. Comparative advantage acts on what the records show, not on an extrapolation (with `sd` 0, as for a known
table, only exact ties keep serve order).

Bounded fairness: a request passed over `max_passes` times, or first passed over `max_delay_s` ago, is *due*: the
earliest due request that can start goes first, whatever its efficiency. Priorities are never inverted: only the
highest priority among the requests that can start is compared (lower ones start only where the caller's
backfilling lets them, as before).

Waiting for a better GPU: a request that knows its expected run time (on a typical device) and when a GPU of its
best rate is expected to free waits when that wait plus the run there is predicted to end sooner than running now
on the free set, and another request can use the free GPUs now (a GPU is never left idle for a wait). A due request
waits so too: being served in turn is a claim to go first, not an obligation to take a GPU on which it would end
later (an `ncf` job served in turn on a V100 would run at an eighteenth of its A100 rate); still due, it goes first
when that GPU frees. Its reason says so, with the figures.

Pure: no I/O, no clock (the caller passes `now`). The agent's lease queue and the offline simulator both call it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Fairness:
    """How far comparative advantage may reorder a queue: at most `max_passes` times or `max_delay_s` seconds of
    being passed over per request (`leases.fairness_max_passes`, `leases.fairness_max_delay_s`)."""

    max_passes: int = 32
    max_delay_s: float = 14400.0  # 4 h: long enough to wait out a run of the GPU a request gains most from
    enabled: bool = True  # False: strict serve order (the head first), as before comparative advantage


@dataclass(slots=True)  # not frozen: a frozen dataclass costs 1.1 us to build against 0.2 (50 per decision)
class Candidate:
    """A queued request as assignment sees it.

    `order`: its place in serve order (priority, then age); `now`: the predicted rate of the set it would take now
    (None: it cannot start now); `best`: its best predicted rate on any GPU of the host it may use, free or not (the
    same unit as `now`); `passes` and `passed_since`: how often and since when it has been passed over;
    `run_s`: its expected run time at rate 1 (None: unknown, so it never waits for a better GPU); `better_in_s`:
    seconds until a GPU of its best rate is expected to free (None: unknown or none); `sd`: the standard deviation
    of its log efficiency (0: known exactly)."""

    id: str
    order: int
    priority: int
    now: float | None
    best: float
    passes: int = 0
    passed_since: float | None = None
    run_s: float | None = None
    better_in_s: float | None = None
    sd: float = 0.0

    @property
    def efficiency(self) -> float:
        """The share of its best predicted rate the set it could take now gives it (0 when it cannot start)."""
        now, best = self.now, self.best
        if now is None or best <= 0 or not now > 0:
            return 0.0
        return 1.0 if now >= best else now / best

    def due(self, fairness: Fairness, now: float) -> bool:
        """Passed over as often or as long as the operator allows."""
        if self.passes >= fairness.max_passes:
            return True
        return self.passed_since is not None and now - self.passed_since >= fairness.max_delay_s

    def gains_by_waiting(self) -> tuple[float, float] | None:
        """(predicted end if it waits, predicted end if it starts now), in seconds from now, when waiting for a GPU
        of its best rate is predicted to end sooner; else None."""
        if self.now is None or self.run_s is None or self.better_in_s is None or self.now <= 0 or self.best <= 0:
            return None
        start_now = self.run_s / self.now
        wait = max(0.0, self.better_in_s) + self.run_s / self.best
        return (wait, start_now) if wait < start_now else None


@dataclass(frozen=True, slots=True)
class Pick:
    """The request to start now (None: none of the candidates), why, the requests it passed over, and the requests
    that wait for a better GPU with their reason."""

    chosen: str | None
    reason: str
    passed: tuple[str, ...] = ()
    waiting: dict[str, str] = field(default_factory=dict)
    unsure: bool = False  # a more efficient request was within the predictions' uncertainty: serve order decided


def choose(candidates: Sequence[Candidate], fairness: Fairness, now: float) -> Pick:
    """The candidate to start now (see the module's doc)."""
    ready = [c for c in candidates if c.now is not None]
    if not ready:
        return Pick(None, "no queued request can start now")
    top = max(c.priority for c in ready)
    cls = sorted((c for c in ready if c.priority == top), key=lambda c: c.order)
    if not fairness.enabled:
        return Pick(cls[0].id, "first in serve order (strict order)")
    blocked = next((c for c in sorted((c for c in candidates if c.now is None and c.priority >= top),
                                      key=lambda c: c.order) if c.due(fairness, now)), None)
    if blocked is not None:  # its turn has come and it cannot start: nobody passes it again
        return Pick(None, f"{blocked.id} is due (passed over {blocked.passes} time(s)) and waits for its GPUs")
    if len(cls) == 1:
        return Pick(cls[0].id, "first in serve order")
    waiting: dict[str, str] = {}
    for c in cls:
        gain = c.gains_by_waiting()
        if gain is not None:
            waiting[c.id] = (f"waiting for a better GPU: predicted to end in {gain[0]:.0f} s there "
                             f"(free in {c.better_in_s:.0f} s) against {gain[1]:.0f} s on the GPUs free now "
                             f"({c.efficiency:.0%} of its best rate)")
    pool = [c for c in cls if c.id not in waiting]
    if not pool:  # every one of them would rather wait: a free GPU is never left idle for a wait
        pool, waiting = cls, {}
    # served in turn: the earliest due request, unless it would rather wait for a better GPU (it ends sooner there
    # than on the GPUs free now; still due, it goes first when that GPU frees)
    due = next((c for c in pool if c.due(fairness, now)), None)
    if due is not None:
        return Pick(due.id, f"served in turn: passed over {due.passes} time(s)"
                            + (f" for {now - due.passed_since:.0f} s" if due.passed_since is not None else "")
                            + f" (fairness bound: {fairness.max_passes} times or {fairness.max_delay_s:g} s)",
                    passed=tuple(x.id for x in cls if x.order < due.order and x.id not in waiting), waiting=waiting)
    best, top = _first_of_the_most_efficient(pool)
    # (top is the first of the most efficient in serve order: any other chosen is less efficient, within the deviation)
    unsure = f"; {top.id}'s {top.efficiency:.0%} is within the model's uncertainty of it" if top is not best else ""
    passed = tuple(x.id for x in cls if x.order < best.order and x.id not in waiting)
    if not passed:
        return Pick(best.id, f"first in serve order ({best.efficiency:.0%} of its best rate on the GPUs free now"
                             f"{unsure})", waiting=waiting, unsure=bool(unsure))
    ahead = min((x for x in cls if x.id in passed), key=lambda x: x.order)
    return Pick(best.id, f"comparative advantage: {best.efficiency:.0%} of its best rate on the GPUs free now, "
                         f"against {ahead.efficiency:.0%} for the request ahead of it ({ahead.id}); "
                         f"started ahead of {len(passed)} request(s) of the same priority{unsure}",
                passed=passed, waiting=waiting, unsure=bool(unsure))


def _first_of_the_most_efficient(pool: Sequence[Candidate]) -> tuple[Candidate, Candidate]:
    """Of a pool in serve order: (the earliest among the candidates whose efficiency the predictions cannot tell apart
    from the highest: a log-efficiency gap within the two candidates' combined standard deviation, exact ties when it
    is 0; the most efficient, the earliest of them)."""
    eff = [(c, c.efficiency) for c in pool]  # each worked out once
    top, most = eff[0]
    level = round(most, 9)  # the highest efficiency (to 9 places): the first in the pool (serve order) among equals
    for c, e in eff:
        r = round(e, 9)
        if r > level:
            top, most, level = c, e, r
    if most <= 0:
        return pool[0], top
    close = [c for c, e in eff if e > 0 and math.log(most / e) <= math.hypot(top.sd, c.sd) + 1e-9]
    return close[0], top  # (top is among them: the pool's order is serve order)


__all__ = ["Candidate", "Fairness", "Pick", "choose"]
