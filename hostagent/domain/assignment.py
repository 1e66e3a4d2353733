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

Bounded fairness: a request passed over `max_passes` times, or first passed over `max_delay_s` ago, is *due*: a
due request that can start goes first, whatever its efficiency. Of several due at once, the one closest to its best
rate goes first (serve order among those the predictions cannot tell apart): every due request but one is passed
over again whichever goes, and on a saturated host serving the oldest first on whatever GPU frees would put a job on
a GPU that runs it at a tenth of its best rate, taking that GPU ten times as long from everyone (Sia's trace 28 at
load 0.95: mean completion time 1.8x the matching oracle's). Priorities are never inverted: only the highest
priority among the requests that can start is compared; a lower one starts only on GPUs that every request of a
higher priority would rather leave for a better one (and where the caller's backfilling lets it).

A request that cannot start now is not compared, and holds nobody back here: the caller keeps the head of the queue
its GPUs (EASY backfilling: those behind it are offered only what cannot delay it). Until 2026-11-30 a due request
that could not start stopped every other, even on GPUs it could never use (too little memory for it): in the
simulator, where it applied (the agent's queue offers only requests that can start), it left GPUs idle while jobs
that could use them waited.

Waiting for a better GPU: a request that knows its expected run time (on a typical device) and when the GPUs of its
best rate are expected to free waits when its wait plus the run there is predicted to end sooner than running now on
the free set. Requests waiting for the same GPUs stand in line for them (`best_on`): the due first, then in serve
order; the k-th in line waits for the k-th of those GPUs to free, and a GPU taken by one ahead in line frees again
after that one's predicted run (a set of n GPUs takes the next n). So a wait counts the requests ahead, not only the
first GPU to free: a wait that ignored them would have every request wait for the same GPU. When every request that
could start would rather wait, nobody starts: the free GPUs stay free for a request that gains from them (a GPU that
runs a job at a tenth of its rate is worth more idle until then than busy ten times as long). A due request waits so
too: being served in turn is a claim to go first, not an obligation to take a GPU on which it would end later (an
`ncf` job served in turn on a V100 would run at an eighteenth of its A100 rate); still due, it goes first when that
GPU frees. Its reason says so, with the figures.

The model's doubt in that decision (Thompson sampling): a request may carry a draw (`doubt`, standard normal, made
by the caller afresh at each decision) of where, within the model's deviation for its efficiency (`sd`), the rate of
the set free now lies; the wait is weighed against running now at `now * exp(doubt * sd)`, not at the prediction.
A ratio the model is sure of (a deviation of a few hundredths) decides as before; a pair it has never seen run (the
interactions' spread) is now and then drawn fast enough to start, so it gets records and its deviation, and the
draws, shrink. Without the draws a request whose free set the model underrates (a rare GPU nobody has run its kind
on) waits for a better GPU at every decision and the model never learns otherwise: on the synthetic table the
single G3 sat idle 52 GPU-hours of trace 26 at load 0.95 while jobs waited (32 under the table). A draw of 0 (the
default, and what the callers pass where the operator turned exploration off) is the prediction itself. Its reason
says when a draw decided (`Pick.drawn`: the requests a draw started rather than kept waiting).

Pure: no I/O, no clock (the caller passes `now`). The agent's lease queue and the offline simulator both call it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace


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
    of its log efficiency (0: known exactly); `later_s`: seconds until each other GPU of its best rate is expected
    to free (0 for a free one); `best_on`: which GPUs those are (requests with the same `best_on` stand in line for
    them; None: in a line of its own); `count`: how many GPUs it takes (a set of `count` waits for that many of them:
    `better_in_s` is when the `count`-th is expected to free); `doubt`: a standard-normal draw of where, within `sd`,
    the rate of the set free now lies when weighing a wait for a better GPU (0: the prediction itself)."""

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
    later_s: tuple[float, ...] = ()
    best_on: Hashable | None = None
    count: int = 1
    doubt: float = 0.0

    @property
    def efficiency(self) -> float:
        """The share of its best predicted rate the set it could take now gives it (0 when it cannot start)."""
        now, best = self.now, self.best
        if now is None or best <= 0 or not now > 0:
            return 0.0
        return 1.0 if now >= best else now / best

    def stand_in_line(self, frees_in: Sequence[float], gpus: Hashable) -> None:
        """Its place for the GPUs of its best rate (`gpus`), which are expected to free in `frees_in` seconds (0 for a
        free one, any order): `better_in_s` is when the `count`-th of them frees, `later_s` the others. Fewer than
        `count` of them: it cannot wait for them (nothing is set)."""
        if len(frees_in) < self.count:
            return
        ends, k = sorted(frees_in), self.count - 1
        self.better_in_s, self.later_s, self.best_on = ends[k], (*ends[:k], *ends[k + 1:]), gpus

    def due(self, fairness: Fairness, now: float) -> bool:
        """Passed over as often or as long as the operator allows."""
        if self.passes >= fairness.max_passes:
            return True
        return self.passed_since is not None and now - self.passed_since >= fairness.max_delay_s

    def gains_by_waiting(self, free_in_s: float | None = None, *, drawn: bool = True) -> tuple[float, float] | None:
        """(predicted end if it waits, predicted end if it starts now), in seconds from now, when waiting for a GPU
        of its best rate (free in `free_in_s`, by default `better_in_s`) is predicted to end sooner; else None. The
        rate now is the prediction moved by the draw (`doubt` deviations of `sd`), or, with `drawn` False, the
        prediction itself."""
        at = self.better_in_s if free_in_s is None else free_in_s
        if self.now is None or self.run_s is None or at is None or self.now <= 0 or self.best <= 0:
            return None
        start_now = self.run_s / self.now
        if drawn:  # run time over the drawn rate, now * exp(doubt * sd) (exp(0) is exactly 1: no draw, no change)
            start_now *= math.exp(-self.doubt * self.sd)
        wait = max(0.0, at) + self.run_s / self.best
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
    free_in: dict[str, float] = field(default_factory=dict)  # a waiting request -> seconds until its place's GPU frees
    # a request that would have waited for a better GPU by its prediction but whose draw (`doubt`) made starting now
    # end sooner -> why, with the figures (whether or not it is the one chosen)
    drawn: dict[str, str] = field(default_factory=dict)


def choose(candidates: Sequence[Candidate], fairness: Fairness, now: float) -> Pick:
    """The candidate to start now (see the module's doc); for each request that waits for a better GPU, also when
    the GPU of its place in line is expected to free (`Pick.free_in`: its expected start, the queue's ETA)."""
    free_in: dict[str, float] = {}  # filled with `waiting`, level by level: the same requests
    drawn: dict[str, str] = {}  # filled with `waiting` too: those a draw kept from waiting
    pick = _choose(candidates, fairness, now, free_in, drawn)
    return replace(pick, free_in=free_in, drawn=drawn) if free_in or drawn else pick


def _choose(candidates: Sequence[Candidate], fairness: Fairness, now: float, free_in: dict[str, float],
            drawn: dict[str, str]) -> Pick:
    ready = [c for c in candidates if c.now is not None]
    if not ready:
        return Pick(None, "no queued request can start now")
    levels = sorted({c.priority for c in ready}, reverse=True)
    if not fairness.enabled:
        return Pick(min((c for c in ready if c.priority == levels[0]), key=lambda c: c.order).id,
                    "first in serve order (strict order)")
    declined: dict[str, str] = {}  # requests of a higher priority that would rather wait for a better GPU
    for top in levels:
        cls = sorted((c for c in ready if c.priority == top), key=lambda c: c.order)
        waiting = _waiting(cls, fairness, now, free_in, drawn)
        declined.update(waiting)
        pool = [c for c in cls if c.id not in waiting]
        if pool:
            pick = _pick(pool, cls, declined, fairness, now)
            if top != levels[0]:
                return Pick(pick.chosen, pick.reason + "; every request of a higher priority that could start would "
                            "rather wait for a better GPU", pick.passed, pick.waiting, pick.unsure)
            return pick
    return Pick(None, "every request that could start would rather wait for a better GPU", waiting=declined)


def _waiting(cls: Sequence[Candidate], fairness: Fairness, now: float, free_in: dict[str, float],
             drawn: dict[str, str]) -> dict[str, str]:
    """Which requests of one priority (in serve order) would rather wait for a better GPU, with why: each stands in
    line for the GPUs of its best rate (the due first, then in serve order) and waits for its place's GPU to free
    (in `free_in[id]` seconds). A request its draw kept from waiting is in `drawn`, with why."""
    waiting: dict[str, str] = {}
    lines: dict[Hashable, list[float]] = {}  # the GPUs a line is for -> when each is next free for it (a heap)
    ahead: dict[Hashable, int] = {}  # how many stand in that line
    for c in sorted((c for c in cls if c.better_in_s is not None), key=lambda c: not c.due(fairness, now)):
        key = ("alone", c.id) if c.best_on is None else c.best_on
        line = lines.get(key)
        if line is None:
            line = lines[key] = sorted((c.better_in_s or 0.0, *c.later_s))  # a sorted list is a heap
        if len(line) < c.count:
            continue
        taken = [heapq.heappop(line) for _ in range(c.count)]  # its place: the next `count` to free
        at = taken[-1]
        gain = c.gains_by_waiting(at)
        if gain is None:
            for t in taken:
                heapq.heappush(line, t)
            if (plain := c.gains_by_waiting(at, drawn=False)) is not None:  # it would wait but for its draw
                drawn[c.id] = (f"started rather than wait for a better GPU by a draw within the model's doubt of its "
                               f"rate on the GPUs free now (deviation {c.sd:.2f}, drawn {c.doubt:+.2f}): "
                               f"{plain[1] * math.exp(-c.doubt * c.sd):.0f} s here against {plain[0]:.0f} s there "
                               f"(free in {at:.0f} s); by the prediction alone {plain[1]:.0f} s here")
            continue
        free_in[c.id] = start = max(0.0, at)
        for _ in taken:  # its run there, then the next in line
            heapq.heappush(line, start + (c.run_s or 0.0) / c.best)
        n = ahead[key] = ahead.get(key, 0) + 1
        waiting[c.id] = (f"waiting for a better GPU: predicted to end in {gain[0]:.0f} s there (free in {at:.0f} s"
                         + (f", {_nth(n)} in line for it" if n > 1 else "")
                         + f") against {gain[1]:.0f} s on the GPUs free now ({c.efficiency:.0%} of its best rate"
                         + (f"; {_drawn_note(c, gain)}" if c.doubt and c.sd else "") + ")")
    return waiting


def _drawn_note(c: Candidate, gain: tuple[float, float]) -> str:
    """How the draw moved a waiting request's end on the GPUs free now (`gain`: its ends there and here, as drawn),
    and whether it decided the wait (by the prediction alone, not waiting ends no later)."""
    predicted = gain[1] * math.exp(c.doubt * c.sd)  # the end here by the prediction alone
    if predicted <= gain[0]:
        return (f"drawn {c.doubt:+.2f} deviations of {c.sd:.2f} within the model's doubt, which decided: by the "
                f"prediction alone it would start now, {predicted:.0f} s here")
    return f"drawn {c.doubt:+.2f} deviations of {c.sd:.2f} within the model's doubt; {predicted:.0f} s as predicted"


def _nth(n: int) -> str:
    """1st, 2nd, 3rd, 4th ... 11th, 12th, 13th ... 21st."""
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _pick(pool: Sequence[Candidate], cls: Sequence[Candidate], waiting: dict[str, str], fairness: Fairness,
          now: float) -> Pick:
    """Of the requests of one priority that would start now (`pool`, of `cls` in serve order): the due one closest
    to its best rate, else the most efficient (see the module's doc)."""
    due_ones = [c for c in pool if c.due(fairness, now)]
    if due_ones:
        due = _first_of_the_most_efficient(due_ones)[0]
        return Pick(due.id, f"served in turn: passed over {due.passes} time(s)"
                            + (f" for {now - due.passed_since:.0f} s" if due.passed_since is not None else "")
                            + f" (fairness bound: {fairness.max_passes} times or {fairness.max_delay_s:g} s)",
                    passed=tuple(x.id for x in cls if x.order < due.order and x.id not in waiting), waiting=waiting)
    if len(cls) == 1:
        return Pick(cls[0].id, "first in serve order", waiting=waiting)
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
    highest = max(e for _, e in eff)
    level = round(highest, 9)  # the highest efficiency (to 9 places): the first in the pool (serve order) among equals
    top, most = next((c, e) for c, e in eff if round(e, 9) == level)
    if most <= 0:
        return pool[0], top
    # the first in serve order within the deviation (top is: the scan ends there at the latest)
    close = next(c for c, e in eff if e > 0 and math.log(most / e) <= math.hypot(top.sd, c.sd) + 1e-9)
    return close, top


RUN_HISTORY = 50  # finished runs per task type behind its expected run time (the agent's model and the simulator)


def expected_left_s(finished: Sequence[float], done: float) -> float | None:
    """Expected run time left of a run that has lasted `done` so far: the mean excess over `done` of the finished runs
    that lasted longer (None: none did). Run times are heavy-tailed: the longer a run has gone on, the longer it is
    expected to go on."""
    longer = [r - done for r in finished if r > done]
    return math.fsum(longer) / len(longer) if longer else None


def run_left_s(finished: Sequence[float], done: float) -> float | None:
    """What a run that has lasted `done` so far is expected to go on for: :func:`expected_left_s`, or as long again
    once it has outlived every finished one (None before any finished). The agent's queue dates a busy GPU by it
    where the lease on it stated no length, the simulator every busy GPU."""
    return _run_left(finished, done) if finished else None


def _run_left(finished: Sequence[float], done: float) -> float:
    """:func:`run_left_s` of a kind with runs finished (`finished` not empty)."""
    left = expected_left_s(finished, done)
    return done if left is None else left


def expected_run_s(finished: Sequence[float], running: Sequence[float] = ()) -> float | None:
    """Expected run time of a new run of a kind, from its finished runs and how long each of its running ones has
    lasted so far (`running`): the mean over both, a running one counted as lasting what it has run plus what it is
    expected to go on (:func:`expected_left_s`; as long again once it has outlived every finished one). None before
    any finished. The running count because short runs finish first: the finished alone would price every wait for
    a better GPU as if runs were short. The mean, not the median: what waiting gains is linear in the run time."""
    if not finished:
        return None
    censored = [done + _run_left(finished, done) for done in running]
    return (math.fsum(finished) + math.fsum(censored)) / (len(finished) + len(censored))


__all__ = ["Candidate", "Fairness", "Pick", "RUN_HISTORY", "choose", "expected_left_s", "expected_run_s", "run_left_s"]
