"""The simulator's side of queue-aware assignment: it builds `domain.assignment` candidates from the waiting jobs,
the free devices and the policy's scorer (the learned model, or the table for `matching-oracle`), exactly as the
agent's lease queue builds them from queued leases (`services.lease_queue`), and asks `domain.assignment.choose`
which job starts next. The set itself is then chosen by the real `place()`, as for every policy.

What it may know: the scorer's predictions, what finished jobs showed (their run times) and how long running jobs
have run so far, never the trace's work of a job still running or waiting. A job's expected run time at rate 1 is
the mean, over the last finished jobs of its task type and those running, of their run time times the predicted
rate of the set they ran on, a running job counted as lasting what it has run plus what it is expected to go on (a
censored observation: the finished alone are the short ones early on); before any has finished under a model, the
mean run time in the model's records (`typical_run_s`, what the agent's queue asks). A busy GPU is
expected to free when its job has run what those of its task type that lasted longer than it has so far ran on
average beyond that (run times are heavy-tailed: the longer a job has run, the longer it is expected to go on), or,
once it has outlived them all, as long again as it has run; a job that would wait for the GPUs of its best rate is
told when each of them frees, and which they are (jobs waiting for the same GPUs stand in line for them:
`domain.assignment`). Each job's efficiency carries the deviation of its two predictions (the scorer's
`uncertainty`, as the agent's placer passes it; 0 for a scorer that knows the table), so jobs the model cannot tell
apart keep serve order, and a job that would wait for a better GPU weighs the wait against a draw of its rate now
within that deviation (`QueueState.doubt`, the learned policy's: `domain.assignment`, Thompson sampling). A job of
a task type the model does not cover yet (too few records: placement picks its GPU by the cold-start rule) is
compared by the model's predictions too, with their deviations (a pair without records has a wide one: it ties), as
in the agent's queue (services.placement.Placer.relative_rates).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from hostagent.domain.assignment import RUN_HISTORY, Candidate, Fairness, Pick, choose, expected_run_s, run_left_s
from hostagent.domain.placement import DeviceView, PlacementRequest, Scorer

WINDOW = 64  # queued jobs looked at per decision (the agent's BACKFILL_DEPTH)


@dataclass
class Running:
    """A running job as the assignment may see it."""

    task_type: str
    start: float
    rate: float  # predicted rate of its set (per GPU, the slowest device's)


@dataclass
class QueueState:
    """What queue-aware assignment remembers between decisions."""

    fairness: Fairness
    passes: dict[int, tuple[int, float]] = field(default_factory=dict)  # job index -> (times passed, since)
    runs: dict[str, deque[float]] = field(default_factory=dict)  # task type -> recent run times at rate 1
    cache: dict[tuple[object, ...], list[float]] = field(default_factory=dict)  # request key -> score per device
    scorer_id: int = 0
    # request -> its draw of the model's doubt for a wait decision (`domain.placement.doubt_draw`, as the agent's
    # placer draws it); None: no draws (the prediction itself)
    doubt: Callable[[PlacementRequest], float] | None = None

    def scores(self, scorer: Scorer, request: PlacementRequest, views: Sequence[DeviceView]) -> list[float]:
        """The scorer's prediction for every device of the host (free or not), cached per scorer and request."""
        self._for(scorer)
        key = _work(request)
        got = self.cache.get(key)
        if got is None:
            plain = replace(request, count=1, priority=0, duration_s=None)
            got = [float(x) for x in scorer.score(plain, views)]
            self.cache[key] = got
        return got

    def sds(self, scorer: Scorer, request: PlacementRequest, views: Sequence[DeviceView]) -> list[float]:
        """Each device's log-space standard deviation of the scorer's prediction (0 for a scorer that knows the
        table): what the agent's queue reads from the active model (LearnedScorer.uncertainty)."""
        fn = getattr(scorer, "uncertainty", None)
        self._for(scorer)
        if fn is None:
            return [0.0] * len(views)
        key = ("sd", *_work(request))
        got = self.cache.get(key)
        if got is None:
            got = self.cache[key] = [float(x) for x in fn(request, views)]
        return got

    def _for(self, scorer: Scorer) -> None:
        """Predictions are kept per scorer: a new one (a retrained model) forgets them."""
        if id(scorer) != self.scorer_id:
            self.cache.clear()
            self.scorer_id = id(scorer)

    def finished(self, task_type: str, held_s: float, rate: float) -> None:
        """A job ended: its run time at rate 1 joins its task type's history."""
        if held_s > 0 and rate > 0:
            self.runs.setdefault(task_type, deque(maxlen=RUN_HISTORY)).append(held_s * rate)

    def run_s(self, task_type: str, running: Sequence[float] = ()) -> float | None:
        """Expected run time at rate 1 of a job of this task type, from its last finished and what each of its running
        ones has run so far at rate 1 (`domain.assignment.expected_run_s`, as the agent's queue asks it of the
        model's records and its running leases); None before any finished."""
        return expected_run_s(self.runs.get(task_type) or (), running)

    def left_s(self, task_type: str, done: float) -> float | None:
        """Expected run time left at rate 1 of a running job of this task type that has run `done` (at rate 1): the
        mean excess over `done` of its task type's last finished runs that lasted longer, or as long again once it has
        outlived them all (`domain.assignment.run_left_s`, as the agent's queue dates a lease that stated no length;
        None: none finished)."""
        return run_left_s(self.runs.get(task_type) or (), done)


def _work(request: PlacementRequest) -> tuple[object, ...]:
    """What a prediction depends on: as the agent's queue does (services.lease_queue._Usable.ranked), GPUs are compared
    by the model's figure for what the work is, not its size, length or priority, which move every GPU's prediction
    alike."""
    return (request.task_type, request.min_memory_gib, request.precision, request.data_scale)


def pick(state: QueueState, waiting: Sequence[tuple[int, PlacementRequest]], views_free: Sequence[DeviceView],
         free: Sequence[bool], fits: Callable[[PlacementRequest, int], bool], scorer: Scorer,
         running_on: dict[int, Running], now: float,
         room_of: Callable[[PlacementRequest], Sequence[bool]] | None = None) -> tuple[int | None, Pick]:
    """The job (index) to start now among the first `WINDOW` waiting ones (in serve order), or None. Only the jobs
    that can start now are candidates, as in the agent's queue. `room_of`: where the head (the first) cannot start,
    the GPUs each job behind it may take without delaying it (EASY backfilling, `simulate._head_room`)."""
    cands: list[Candidate] = []
    running: dict[str, list[float]] = {}  # task type -> what each of its running jobs has run so far, at rate 1
    for job in {id(j): j for j in running_on.values()}.values():  # (a job on several GPUs: once)
        if job.rate > 0:
            running.setdefault(job.task_type, []).append((now - job.start) * job.rate)
    for order, (jidx, req) in enumerate(waiting[:WINDOW]):
        usable = [i for i in range(len(views_free)) if fits(req, i)]
        if len(usable) < req.count:
            continue
        may = free if room_of is None or order == 0 else room_of(req)  # the free GPUs it may take now
        if sum(1 for i in usable if may[i]) < req.count:
            continue  # it cannot start now: not a candidate (the head is kept its GPUs by `room_of`)
        sc = state.scores(scorer, req, views_free)
        ranked = sorted(usable, key=lambda i: -sc[i])
        open_ = [i for i in ranked if may[i]]
        at_best, at_now = ranked[req.count - 1], open_[req.count - 1]
        best, now_rate = sc[at_best], sc[at_now]
        sd = 0.0
        if now_rate < best:  # its efficiency: the ratio of two predictions, each uncertain
            sds = state.sds(scorer, req, views_free)
            sd = math.hypot(sds[at_now], sds[at_best])
        passes, since = state.passes.get(jidx, (0, None))
        run_s = state.run_s(req.task_type, running.get(req.task_type, ()))
        if run_s is None:  # none finished under a model yet: what the model's records show, as the agent's queue asks
            typical = getattr(scorer, "typical_run_s", None)
            run_s = typical(req.task_type) if typical is not None else None
        cand = Candidate(str(jidx), order, req.priority, now_rate, best, passes, since, run_s, sd=sd, count=req.count)
        if run_s is not None and best > now_rate:
            if sd and state.doubt is not None:  # a draw only where it may decide: a wait weighed, a doubt to draw in
                cand.doubt = state.doubt(req)
            # it may wait for the GPUs of its best rate (a set: for `count` of them), in line with every job whose
            # best they are too: when each is expected to free (0 for a free one)
            ends = []
            at_best_rate = tuple(i for i in usable if sc[i] >= best * 0.999)
            for i in at_best_rate:
                if free[i]:
                    ends.append(0.0)
                    continue
                job = running_on.get(i)
                if job is None:
                    continue  # busy with a job started before the first model: no estimate of its end
                elapsed = now - job.start
                left = state.left_s(job.task_type, elapsed * job.rate) if job.rate > 0 else None
                ends.append(left / job.rate if left is not None else elapsed)
            cand.stand_in_line(ends, at_best_rate)
        cands.append(cand)
    decision = choose(cands, state.fairness, now)
    if decision.chosen is None:
        return None, decision
    for p in decision.passed:
        n, since = state.passes.get(int(p), (0, None))
        state.passes[int(p)] = (n + 1, now if since is None else since)
    chosen = int(decision.chosen)
    state.passes.pop(chosen, None)
    return chosen, decision


__all__ = ["QueueState", "Running", "WINDOW", "pick"]
