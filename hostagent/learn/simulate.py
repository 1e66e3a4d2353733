"""Offline evaluation harness: replay a job trace on a simulated host under several placement policies.

Every policy goes through the real placement code (``hostagent.domain.placement.place``: the same filters and
set choice the agent uses); policies differ only in the `Scorer` they pass. The learned policy ("model") starts
with no model, writes every lease and its usage samples through the real usage store (a temporary SQLite file),
trains from ``training_records()`` with the real lifecycle once ``min_records`` jobs have finished (or the warm-up
jobs, if fewer), and retrains each time its records double, at most every ``retrain_every`` completions. It never reads the throughput table.
``model-warm`` is the same on a host with a past: its store starts with the records (and model) of a history trace
that ``model`` ran first on the same host. ``matching-oracle-cold`` is the ceiling of any learner with ``model``'s first
day: it serves the trace as ``model`` does until ``model`` would first train (serve order, the cold-start rule, the
warm-up exploration: the same decisions), then knows the table as ``matching-oracle`` does (and explores no more).

Ground truth: a job's run time on a set of n devices is ``work / (n * min_i thr(job_type, model_i) * health_i)``
(synchronous data parallel: the slowest device paces the step). Under the simple rules and the greedy `oracle`
jobs wait in arrival order and the head of the queue is placed whenever enough eligible devices are free. Before its
first model, `model` serves the queue as the agent's queue does before it has one: in serve order, and behind a head
that cannot start a job may backfill where it cannot delay it (`domain.admission.backfill_share`). Under
`model` (once trained) and `matching-oracle` the queue is the agent's: priority then age, and of the jobs that
could start (behind a head that cannot, only within the room that cannot delay it, as on the first day), the one
`domain.assignment.choose` picks (comparative advantage within the fairness bound; `learn/sim_queue.py` builds its
candidates as `services.lease_queue` does), then placed by the same `place()`.

Usage: ``python -m hostagent.learn.simulate --throughputs T.csv --host H.csv --trace R.csv [--seeds N]
[--policies a,b] [--warmup-jobs N] [--history-trace H.csv] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import heapq
import itertools
import json
import math
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hostagent.config import PlacementSettings
from hostagent.domain.admission import backfill_share, shadow
from hostagent.domain.capabilities import Capabilities
from hostagent.domain.errors import InvalidInput
from hostagent.domain.lease import DEFAULT_DURATION_S
from hostagent.domain.retraining import GrowthSchedule
from hostagent.domain.assignment import Fairness
from hostagent.learn import sim_queue
from hostagent.learn.sim_inputs import Job, SimGpu, Table, check_inputs, load_host, load_table, load_trace
from hostagent.learn.model import ModelBundle
from hostagent.domain.placement import (
    GIB,
    DeviceView,
    Exploration,
    PlacementRequest,
    Scorer,
    doubt_draw,
    place,
)

# `matching-oracle` with `model`'s first day: what the cold start costs a learner that learns the table exactly and
# at once, the moment `model` first trains
COLD_ORACLE = "matching-oracle-cold"
# the learned policy with a past: `model` run first on a history trace, then on the trace with that store and model
WARM = "model-warm"
POLICIES = ("random", "first-fit", "best-fit-memory", "fastest-model", "model", "oracle", "matching-oracle",
            "noisy-oracle", COLD_ORACLE, WARM)
# what "all policies" runs: `model-warm` runs the learned policy twice per trace (its history, then the trace), so
# it is run only when asked for
DEFAULT_POLICIES = tuple(p for p in POLICIES if p != WARM)
# the learned policy: `model` starts with an empty store, `model-warm` with the records of a history trace
LEARNED = frozenset({"model", WARM})
# the queue-aware assignment (domain.assignment) decides
QUEUE_AWARE = frozenset({"model", WARM, "matching-oracle", "noisy-oracle", COLD_ORACLE})
EPOCH = 1_600_000_000.0  # simulated clock origin (2020-09-13): the store refuses timestamps before 2000
SAMPLES_PER_LEASE = 3
WORK_RATE_NOISE = 0.03  # a guest's own throughput counter is a little noisy (log-normal sigma)
# `noisy-oracle`: `matching-oracle` with each (task type, GPU model) throughput off by a log-normal error of this sigma,
# drawn once per run: the table known as well as one heartbeat's work-rate figure tells it. How far that falls behind
# `matching-oracle` is how much of a learned policy's gap a few per cent of estimation error alone explains.
ORACLE_NOISE = WORK_RATE_NOISE


# -- scorers for the simple rules and the oracle (all go through the real place()) ---------------------------------

class _RuleScorer:
    """A fixed rule as a Scorer; it covers every request."""

    def __init__(self, name: str, fn: Callable[[PlacementRequest, Sequence[DeviceView]], list[float]]) -> None:
        self.name = name
        self._fn = fn

    def covers(self, request: PlacementRequest) -> bool:
        """Rules need no training."""
        return True

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        """Apply the rule."""
        return self._fn(request, devices)


def rule_scorers(table: Table, host: Sequence[SimGpu], rng: random.Random,
                 noise_rng: random.Random | None = None) -> dict[str, Scorer]:
    """The baseline policies and the oracles as Scorers (``noise_rng`` draws `noisy-oracle`'s errors; its own
    generator, so that the other policies' runs do not change with it)."""
    order = {g.gpu_id: i for i, g in enumerate(host)}
    health = {g.gpu_id: g.health for g in host}
    draw = noise_rng or random.Random(0)
    noisy = {key: v * math.exp(draw.gauss(0.0, ORACLE_NOISE)) for key, v in sorted(table.thr.items())}
    # "nominally best": one global ranking of models (geometric mean of their speed relative to the best model
    # for each job type), blind to which job is being placed
    rank: dict[str, float] = {}
    for m in table.models:
        rel = [table.thr[(j, m)] / max(table.thr[(j, x)] for x in table.models if (j, x) in table.thr)
               for j in table.job_types if (j, m) in table.thr]
        rank[m] = float(np.exp(np.mean(np.log(rel)))) if rel else 0.0
    return {
        "random": _RuleScorer("random", lambda r, ds: [rng.random() for _ in ds]),
        "first-fit": _RuleScorer("first-fit", lambda r, ds: [-float(order[d.gpu_id]) for d in ds]),
        "best-fit-memory": _RuleScorer("best-fit-memory", lambda r, ds: [
            -((d.memory_gib or 0.0) - r.min_memory_gib) - 1e-6 * order[d.gpu_id] for d in ds]),
        "fastest-model": _RuleScorer("fastest-model", lambda r, ds: [
            rank.get(d.model, 0.0) - 1e-9 * order[d.gpu_id] for d in ds]),
        "oracle": _RuleScorer("oracle", lambda r, ds: [
            table.thr.get((r.task_type, d.model), 0.0) * health[d.gpu_id] for d in ds]),
        "matching-oracle": _RuleScorer("matching-oracle", lambda r, ds: [
            table.thr.get((r.task_type, d.model), 0.0) * health[d.gpu_id] for d in ds]),
        "noisy-oracle": _RuleScorer("noisy-oracle", lambda r, ds: [
            noisy.get((r.task_type, d.model), 0.0) * health[d.gpu_id] for d in ds]),
    }


# -- the learned policy's link to the real store and lifecycle -----------------------------------------------------

class StoreRecorder:
    """Writes simulated leases and samples through the real UsageStore and retrains with the real lifecycle."""

    def __init__(self, host: Sequence[SimGpu], workdir: Path, *, seed: int, min_records: int) -> None:
        from hostagent.store.repo import UsageStore  # only the learned policy needs the store

        self.now = EPOCH
        self.store = UsageStore(f"sqlite:///{workdir / 'usage.db'}", "sim-host", spool_path=workdir / "spool.db",
                                clock=lambda: self.now)
        self.store.upsert_gpus([{
            "gpu_id": g.gpu_id, "address": f"0000:{0x10 + i:02x}:00.0", "vendor": "NVIDIA Corporation",
            "model": g.model, "memory_bytes": int(g.memory_gib * GIB), "numa_node": g.numa_node,
            "probe_score": g.health,
        } for i, g in enumerate(host)])
        self.rng = random.Random(seed * 7919 + 1)
        self.min_records = min_records
        self.epoch = EPOCH  # the simulated clock's origin for the trace being recorded
        self.trace_no = 0  # how many traces were recorded before this one
        self.trainings: list[dict[str, Any]] = []
        self.active: tuple[str, ModelBundle] | None = None

    def finished(self, job: Job, start: float, end: float, gpu_ids: Sequence[str], per_gpu_rate: float,
                 request: PlacementRequest, reasons: Sequence[str]) -> None:
        """Record the lease and the usage samples its guest would have sent (two writes, as the agent's mirror does)."""
        epoch = self.epoch
        self.now = epoch + end
        n = self.trace_no
        lease_id = f"sim{n or ''}-{job.index}"
        self.store.insert_lease({
            "id": lease_id, "domain_uuid": f"00000000-0000-4000-{0x8000 + n:04x}-{job.index:012d}", "state": "RELEASED",
            "created_at": epoch + job.arrival_s, "granted_at": epoch + start, "ended_at": epoch + end,
            "end_reason": "released by guest", "granted_gpus": len(gpu_ids),
            "request": {"gpus": request.count, "task_type": request.task_type, "priority": request.priority,
                        "min_memory_gib": request.min_memory_gib, "numa_policy": request.numa_policy},
            "devices": [{"gpu_id": g} for g in gpu_ids], "reasons": list(reasons)[:4],
        })
        samples = []
        for k in range(SAMPLES_PER_LEASE):
            ts = epoch + start + (end - start) * (k + 1) / (SAMPLES_PER_LEASE + 1)
            for g in gpu_ids:
                samples.append({"gpu_id": g, "ts": ts, "lease_id": lease_id, "source": "guest",
                                "util_pct": min(100.0, max(0.0, self.rng.gauss(90.0, 5.0))),
                                "work_rate": per_gpu_rate * math.exp(self.rng.gauss(0.0, WORK_RATE_NOISE))})
        self.store.add_samples(samples)

    def next_trace(self, after_s: float) -> None:
        """Record the next trace after this one: its clock starts a day after ``after_s`` (this trace's last end),
        its leases get ids of their own. The store keeps every record so far, as an agent's store does."""
        self.epoch += after_s + 86_400.0
        self.now = self.epoch
        self.trace_no += 1

    def retrain(self) -> Scorer | None:
        """Train from the store's records; return the active scorer (None while the cold-start rule must decide)."""
        from hostagent.learn import lifecycle
        from hostagent.learn.model import LearnedScorer

        if self.active is None:
            self.active = lifecycle.active_bundle(self.store)
        res = lifecycle.train(self.store, min_records=self.min_records, now=self.now, current=self.active)
        self.trainings.append({"at": self.now - self.epoch, **res.to_dict()})
        if res.decision == "promoted" and res.bundle is not None and res.version is not None:
            self.active = (res.version, res.bundle)  # the bytes just saved and activated in the store
        if self.active is None:
            return None
        return LearnedScorer(self.active[1], name=self.active[0])

    def close(self) -> None:
        """Release the database."""
        self.store.close()


# -- the event loop -----------------------------------------------------------------------------------------------

@dataclass
class RunFigures:
    """Per-job and per-decision figures of one run."""

    jct: dict[int, float] = field(default_factory=dict)
    wait: dict[int, float] = field(default_factory=dict)  # queue wait: start minus arrival
    regret: dict[int, float] = field(default_factory=dict)
    rules: dict[str, int] = field(default_factory=dict)
    memory_violations: int = 0
    first_arrival: float = 0.0
    last_end: float = 0.0
    trainings: list[dict[str, Any]] = field(default_factory=list)


def _request(table: Table, job: Job) -> PlacementRequest:
    return PlacementRequest(count=job.num_gpus, task_type=job.job_type, min_memory_gib=table.need_gib.get(job.job_type, 0.0),
                            priority=job.priority, numa_policy="preferred", requires=_needs(table, job.job_type))


# a table's hole (a job type it gives no throughput for on a GPU model) is a feature the job type requires, and every
# GPU model the table has its row for provides: the real place() filters it out as it does a GPU that lacks bf16
def _feature(job_type: str) -> str:
    return f"runs {job_type}"


def _needs(table: Table, job_type: str) -> tuple[str, ...]:
    """What a job of this type requires of a GPU: to be of a model the table has its throughput for (nothing where
    the table has it for every model)."""
    return (_feature(job_type),) if job_type in table.holed else ()


def _views(table: Table, host: Sequence[SimGpu]) -> list[DeviceView]:
    """The host's devices as the placement code sees them, each with the job types it can run as its features."""
    return [DeviceView(gpu_id=g.gpu_id, model=g.model, vendor="NVIDIA Corporation",
                       memory_bytes=int(g.memory_gib * GIB), numa_node=g.numa_node, probe_score=g.health,
                       capabilities=Capabilities(frozenset(_feature(j) for j in table.job_types if table.runs(j, g.model)),
                                                 f"the throughput table's rows for {g.model}"))
            for g in host]


def _set_rate(table: Table, job: Job, gpus: Sequence[SimGpu]) -> float:
    return len(gpus) * min(table.thr[(job.job_type, g.model)] * g.health for g in gpus)


def run_policy(policy: str, table: Table, host: Sequence[SimGpu], jobs: Sequence[Job], *, seed: int,
               warmup_jobs: int, retrain_every: int, min_records: int, workdir: Path | None = None,
               exploration: Exploration = Exploration(), warmup_epsilon: float = PlacementSettings.cold_explore_epsilon,
               fairness: Fairness = Fairness(), history: Sequence[Job] = ()) -> RunFigures:
    """Simulate one policy over the trace and return its figures.

    ``model-warm`` first runs ``model`` over ``history`` (another trace on the same host), then this trace with the
    same store: what the learned policy does on a host with a past, rather than on its first day. Only this trace's
    jobs are in the figures (and in ``trainings``, only the trainings during it)."""
    if policy not in POLICIES:
        raise InvalidInput(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}", field="policies")
    if policy == WARM and not history:
        raise InvalidInput("model-warm needs a history trace: the store starts with its records",
                           field="history_trace")
    # the first training once min_records jobs have finished (or the warm-up's, if sooner)
    first = min(warmup_jobs, min_records)
    if policy not in LEARNED:
        return _run(policy, table, host, jobs, seed=seed, retrain_every=retrain_every,
                    first_training=first if policy == COLD_ORACLE else 0,
                    exploration=exploration, warmup_epsilon=warmup_epsilon, fairness=fairness, recorder=None,
                    done_before=0)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hostagent-sim-")))
        recorder = StoreRecorder(host, workdir, seed=seed, min_records=min_records)
        stack.callback(recorder.close)
        done_before = 0
        if policy == WARM:
            past = _run("model", table, host, history, seed=seed + 1_000_003, retrain_every=retrain_every,
                        first_training=first, exploration=exploration, warmup_epsilon=warmup_epsilon,
                        fairness=fairness, recorder=recorder, done_before=0)
            recorder.next_trace(past.last_end)
            recorder.trainings.clear()
            done_before = len(history)
        return _run(policy, table, host, jobs, seed=seed, retrain_every=retrain_every, first_training=first,
                    exploration=exploration, warmup_epsilon=warmup_epsilon, fairness=fairness, recorder=recorder,
                    done_before=done_before)


def _run(policy: str, table: Table, host: Sequence[SimGpu], jobs: Sequence[Job], *, seed: int,
         retrain_every: int, first_training: int, exploration: Exploration, warmup_epsilon: float,
         fairness: Fairness, recorder: StoreRecorder | None, done_before: int) -> RunFigures:
    """One trace under one policy. With a ``recorder`` (the learned policies) every finished job is recorded and
    the model retrained: first after ``first_training`` completions, or, when the store already holds the records
    of ``done_before`` jobs, at once before the first job. `matching-oracle-cold` decides as the learned policy's
    cold start until ``first_training`` completions, then with the table."""
    rng = random.Random(seed)
    rules = rule_scorers(table, host, random.Random(seed * 31 + 7), noise_rng=random.Random(seed * 31 + 11))
    by_id = {g.gpu_id: g for g in host}
    base_views = _views(table, host)
    busy_views = [replace(v, free=False) for v in base_views]
    free = [True] * len(host)
    index = {g.gpu_id: i for i, g in enumerate(host)}
    fig = RunFigures(first_arrival=jobs[0].arrival_s if jobs else 0.0)
    cold = policy == COLD_ORACLE  # the learned policy's cold start until first_training completions, then the table
    scorer: Scorer | None = (None if policy in LEARNED or (cold and first_training > 0)
                             else rules["matching-oracle" if cold else policy])
    # the learned policy trains as the agent does (domain.retraining): as soon as it has first_training finished jobs
    # (short of the lifecycle's labelled records then, at each end until it has them), then each time its records
    # double, at most every retrain_every completions: a young model improves fast
    completed = done_before
    schedule = GrowthSchedule(first=first_training, growth=PlacementSettings.retrain_growth, most=retrain_every)
    if recorder is not None and done_before > 0:
        scorer = recorder.retrain()
        schedule.trained(done_before, in_use=scorer is not None)
    # (end, seq, job index, gpu ids, start, request, reasons)
    running: list[tuple[float, int, int, tuple[str, ...], float, PlacementRequest, tuple[str, ...]]] = []
    queue: deque[Job] = deque()
    arrivals = deque(jobs)
    qstate = sim_queue.QueueState(fairness)
    if policy in LEARNED:  # the model's doubt drawn in each wait decision, as the agent's placer draws it
        qstate.doubt = functools.partial(_doubt, exploration, random.Random(seed * 31 + 13))
    running_on: dict[int, sim_queue.Running] = {}  # device index -> the job on it (queue-aware policies)
    started = [0.0] * len(host)  # device index -> when the job on it started (the first day's backfilling)

    def fits(request: PlacementRequest, i: int) -> bool:
        return table.fits(request.task_type, host[i])  # (the request's memory need is its type's: _request)
    seq = 0
    try:
        while arrivals or queue or running:
            t_arr = arrivals[0].arrival_s if arrivals else math.inf
            t_end = running[0][0] if running else math.inf
            now = min(t_arr, t_end)
            if now == math.inf:
                break  # a queued job no free set can ever satisfy (cannot happen after check_inputs)
            while running and running[0][0] <= now:
                end, _, jidx, gpu_ids, start, req, why = heapq.heappop(running)
                was = None
                for g in gpu_ids:
                    free[index[g]] = True
                    was = running_on.pop(index[g], None)
                if was is not None:
                    qstate.finished(was.task_type, end - start, was.rate)
                completed += 1
                fig.last_end = max(fig.last_end, end)
                if cold and scorer is None and completed >= first_training:
                    scorer = rules["matching-oracle"]
                if recorder is not None:
                    job = jobs[jidx]
                    recorder.finished(job, start, end, gpu_ids,
                                      _set_rate(table, job, [by_id[g] for g in gpu_ids]) / len(gpu_ids), req, why)
                    if schedule.due(completed):
                        scorer = recorder.retrain() or scorer
                        # too few labelled records yet (a lease on a mixed set labels none): again at the next end
                        schedule.trained(completed, in_use=scorer is not None)
            while arrivals and arrivals[0].arrival_s <= now:
                queue.append(arrivals.popleft())
            if policy in QUEUE_AWARE:  # the agent's serve order: priority, then age
                queue = deque(sorted(queue, key=lambda j: (-j.priority, j.arrival_s, j.index)))
            behind = 0  # the first day: the job looked at, behind a head that must wait (a backfill candidate)
            while behind < len(queue):
                job = queue[behind]
                views = [base_views[i] if free[i] else busy_views[i] for i in range(len(host))]
                said: tuple[str, ...] = ()
                if behind:  # only the GPUs it may take without delaying the head, as the agent's queue (EASY)
                    room = _backfill_room(_request(table, queue[0]), _request(table, job), free, started, fits, now)
                    views = [base_views[i] if room[i] else busy_views[i] for i in range(len(host))]
                    said = ("queue: backfilled behind the head of the queue (it cannot start yet)",)
                if policy in QUEUE_AWARE and scorer is not None:
                    waiting = [(j.index, _request(table, j)) for j in itertools.islice(queue, sim_queue.WINDOW)]
                    head = waiting[0][1]
                    room_of: Callable[[PlacementRequest], list[bool]] | None = None
                    if sum(1 for i in range(len(host)) if free[i] and fits(head, i)) < head.count:
                        # the head cannot start: those behind it compete only for the GPUs they may take without
                        # delaying it (EASY), as in the agent's queue (services.lease_queue._next_grant)
                        # (the head's room is the same for each of them: worked out once per decision)
                        room_of = functools.partial(_fitting, _head_room(head, free, started, fits, now), fits,
                                                    len(host))
                    picked, pick = sim_queue.pick(qstate, waiting, base_views, free, fits, scorer, running_on, now,
                                                  room_of=room_of)
                    if picked is None:
                        break
                    job = jobs[picked]
                    said = (f"queue: {pick.reason}",)
                    if room_of is not None:  # (the head cannot start: the one picked is behind it)
                        room = room_of(_request(table, job))
                        views = [base_views[i] if room[i] else busy_views[i] for i in range(len(host))]
                        said += ("queue: backfilled behind the head of the queue (it cannot start yet)",)
                request = _request(table, job)
                need = request.min_memory_gib
                ex = exploration if scorer is not None else replace(exploration, epsilon=warmup_epsilon)
                explores = policy in LEARNED or (cold and scorer is None)
                decision = place(request, views, scorer=scorer, exploration=ex if explores else None, rng=rng)
                if not decision.chosen:
                    # the job to start waits for enough eligible devices to free up; before the queue-aware
                    # assignment decides (the first day), those behind it may backfill, as in the agent's queue
                    if policy in QUEUE_AWARE and scorer is None and behind + 1 < min(len(queue), sim_queue.WINDOW):
                        behind += 1
                        continue
                    break
                queue.remove(job)
                chosen = [by_id[g] for g in decision.chosen]
                for g in decision.chosen:
                    free[index[g]] = False
                    started[index[g]] = now
                fig.rules[decision.rule] = fig.rules.get(decision.rule, 0) + 1
                fig.memory_violations += sum(1 for g in chosen if g.memory_gib + 1e-9 < need)
                # regret against the best set among the devices that were free and eligible at this instant
                rate = _set_rate(table, job, chosen)
                best = _best_rate(table, job, host, free, index, decision.chosen)
                fig.regret[job.index] = max(0.0, 1.0 - rate / best) if best > 0 else 0.0
                end = now + job.work / rate
                fig.jct[job.index] = end - job.arrival_s
                fig.wait[job.index] = now - job.arrival_s
                if scorer is not None and policy in QUEUE_AWARE:
                    sc = qstate.scores(scorer, request, base_views)
                    ran = sim_queue.Running(job.job_type, now, min(sc[index[g]] for g in decision.chosen))
                    for g in decision.chosen:  # (one Running per job: the queue counts each job once)
                        running_on[index[g]] = ran
                heapq.heappush(running, (end, seq, job.index, decision.chosen, now, request,
                                         decision.reasons + said))
                seq += 1
    finally:
        if recorder is not None:
            fig.trainings = list(recorder.trainings)
    return fig


def _backfill_room(head: PlacementRequest, request: PlacementRequest, free: Sequence[bool], started: Sequence[float],
                   fits: Callable[[PlacementRequest, int], bool], now: float) -> list[bool]:
    """Which devices `request` may take behind a `head` that cannot start, as the agent's queue decides
    (`domain.admission.backfill_share`, EASY backfilling): those of :func:`_head_room` it fits."""
    return _fitting(_head_room(head, free, started, fits, now), fits, len(free), request)


def _fitting(may: set[int], fits: Callable[[PlacementRequest, int], bool], n: int,
             request: PlacementRequest) -> list[bool]:
    """Which of `n` devices `request` may take: those in `may` that it fits."""
    return [i in may and fits(request, i) for i in range(n)]


def _doubt(exploration: Exploration, rng: random.Random, request: PlacementRequest) -> float:
    """A job's draw of the model's doubt for a wait decision (`domain.placement.doubt_draw`)."""
    return doubt_draw(exploration, rng, request.priority)


def _head_room(head: PlacementRequest, free: Sequence[bool], started: Sequence[float],
               fits: Callable[[PlacementRequest, int], bool], now: float) -> set[int]:
    """The free devices a job behind a `head` that cannot start may take without delaying it, whatever the job (it
    still has to fit them). A simulated job states no duration, so, as a lease that names none, each running job is
    expected to end `DEFAULT_DURATION_S` after it started and the one behind to last as long."""
    usable = [i for i in range(len(free)) if fits(head, i)]
    sh = shadow(now, sum(1 for i in usable if free[i]), [started[i] + DEFAULT_DURATION_S for i in usable
                                                         if not free[i]], head.count)
    room, _ = backfill_share(sh, now, DEFAULT_DURATION_S, [i for i in usable if free[i]],
                             [i for i in range(len(free)) if free[i] and not fits(head, i)])
    return set(room)


def _best_rate(table: Table, job: Job, host: Sequence[SimGpu], free: Sequence[bool], index: dict[str, int],
               chosen: Sequence[str]) -> float:
    """Rate of the fastest set of ``num_gpus`` devices that were free and fitted the job at decision time."""
    rates = sorted((table.thr[(job.job_type, g.model)] * g.health for g in host
                    if (free[index[g.gpu_id]] or g.gpu_id in chosen) and table.fits(job.job_type, g)),
                   reverse=True)
    if len(rates) < job.num_gpus:
        return 0.0
    return job.num_gpus * rates[job.num_gpus - 1]


def summarise(policy: str, seed: int, fig: RunFigures, jobs: Sequence[Job], warmup_jobs: int) -> dict[str, Any]:
    """The figures of one (policy, seed), over the jobs after the warm-up (the same jobs for every policy)."""
    ids = [j.index for j in jobs if j.index >= warmup_jobs]
    jct = np.array([fig.jct[i] for i in ids]) if ids else np.array([0.0])
    reg = np.array([fig.regret[i] for i in ids]) if ids else np.array([0.0])
    wait = np.array([fig.wait.get(i, 0.0) for i in ids]) if ids else np.array([0.0])
    return {
        "policy": policy, "seed": seed, "mean_jct_s": float(jct.mean()), "p99_jct_s": float(np.percentile(jct, 99)),
        "makespan_s": float(fig.last_end - fig.first_arrival), "mean_regret": float(reg.mean()),
        "memory_violations": int(fig.memory_violations),
        # queue wait (start minus arrival): the p99 is the fairness figure, what reordering the queue costs the unlucky
        "mean_wait_s": float(wait.mean()), "p99_wait_s": float(np.percentile(wait, 99)),
        "max_wait_s": float(wait.max()),  # the longest: what the fairness bound is there to cap
    }


def simulate(table: Table, host: Sequence[SimGpu], jobs: Sequence[Job], *, seeds: int = 3,
             policies: Sequence[str] = DEFAULT_POLICIES, warmup_jobs: int = 300, retrain_every: int = 500,
             min_records: int = 100, exploration: Exploration = Exploration(),
             fairness: Fairness = Fairness(), history: Sequence[Job] = ()) -> dict[str, Any]:
    """Run every policy with every seed; return ``{"results": [...], "meta": {...}}``. ``history``: the trace
    ``model-warm`` runs first (see run_policy); ``fairness``: the queue's bound (`leases.fairness_max_passes`,
    `leases.fairness_max_delay_s`) for the queue-aware policies."""
    jobs, notes = check_inputs(table, host, jobs)
    if history:
        history, _ = check_inputs(table, host, history)
    if warmup_jobs >= len(jobs):
        raise InvalidInput(f"--warmup-jobs {warmup_jobs} leaves no job to evaluate ({len(jobs)} jobs)",
                           field="warmup_jobs")
    results, extra = [], []
    for seed in range(seeds):
        for policy in policies:
            t0 = time.perf_counter()
            fig = run_policy(policy, table, host, jobs, seed=seed, warmup_jobs=warmup_jobs,
                             retrain_every=retrain_every, min_records=min_records, exploration=exploration,
                             fairness=fairness, history=history)
            results.append(summarise(policy, seed, fig, jobs, warmup_jobs))
            extra.append({"policy": policy, "seed": seed, "rules": fig.rules, "wall_s": time.perf_counter() - t0,
                          "trainings": [{k: v for k, v in tr.items() if k != "metrics"}
                                        | {"holdout_error": (tr.get("metrics") or {}).get("candidate", {}).get("error")}
                                        for tr in fig.trainings]})
    return {"results": results, "meta": {"jobs": len(jobs), "evaluated_jobs": len(jobs) - warmup_jobs,
                                         "gpus": len(host), "notes": notes, "runs": extra,
                                         "fairness": fairness_meta(fairness)}}


def format_table(out: dict[str, Any]) -> str:
    """A plain-text table: one line per (policy, seed), then the mean over seeds per policy."""
    cols = ("policy", "seed", "mean_jct_s", "p99_jct_s", "makespan_s", "mean_regret", "memory_violations",
            "mean_wait_s", "p99_wait_s")
    lines = [(f"{'policy':<16}{'seed':>5}{'mean_jct_s':>14}{'p99_jct_s':>14}{'makespan_s':>14}"
              f"{'mean_regret':>13}{'mem_viol':>10}{'mean_wait_s':>13}{'p99_wait_s':>12}")]

    def line(r: dict[str, Any]) -> str:
        return (f"{r['policy']:<16}{r['seed']!s:>5}{r['mean_jct_s']:>14.0f}{r['p99_jct_s']:>14.0f}"
                f"{r['makespan_s']:>14.0f}{r['mean_regret']:>13.4f}{r['memory_violations']:>10}"
                f"{r.get('mean_wait_s', 0.0):>13.0f}{r.get('p99_wait_s', 0.0):>12.0f}")
    for r in out["results"]:
        lines.append(line(r))
    lines.append("-- mean over seeds --")
    by: dict[str, list[dict[str, Any]]] = {}
    for r in out["results"]:
        by.setdefault(r["policy"], []).append(r)
    oracle = by.get("oracle")
    for p, rs in by.items():
        m: dict[str, Any] = {c: float(np.mean([r[c] for r in rs])) for c in cols[2:]}
        m.update(policy=p, seed="all")
        m["memory_violations"] = int(sum(r["memory_violations"] for r in rs))
        ratio = ""
        if oracle:
            ratio = f"   jct/oracle={m['mean_jct_s'] / float(np.mean([r['mean_jct_s'] for r in oracle])):.3f}"
        lines.append(line(m) + ratio)
    meta = out.get("meta", {})
    lines.append(f"jobs={meta.get('jobs')} evaluated={meta.get('evaluated_jobs')} gpus={meta.get('gpus')} "
                 + " ".join(meta.get("notes", [])))
    return "\n".join(lines)


def add_run_options(ap: argparse.ArgumentParser, *, seeds: int, seeds_help: str,
                    trace: Callable[[], Any]) -> None:
    """The options this harness and the multi-trace evaluation (learn.evaluate) share: the table, the host, the
    trace option(s) (`trace` adds them), the policies and their seeds, the warm-up and retraining, exploration."""
    ap.add_argument("--throughputs", required=True, help="CSV job_type,gpu_model,throughput[,memory_gib]")
    ap.add_argument("--host", required=True, help="CSV gpu_id,gpu_model,memory_gib,numa_node[,health_factor]")
    trace()
    ap.add_argument("--seeds", type=int, default=seeds, help=seeds_help)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                    help=f"comma-separated, of {', '.join(POLICIES)} (default all but model-warm, which runs the "
                         "learned policy twice per trace)")
    ap.add_argument("--warmup-jobs", type=int, default=300,
                    help="jobs left out of the figures (default 300); the first training comes after "
                         "min(warmup, min-records) jobs")
    ap.add_argument("--retrain-every", type=int, default=500,
                    help="most completed jobs between retrainings (it retrains when its records double, up to this)")
    ap.add_argument("--min-records", type=int, default=100, help="records before the first model may be trained")
    ap.add_argument("--epsilon", type=float, default=Exploration().epsilon, help="exploration rate once trained")
    ap.add_argument("--fairness-max-passes", type=int, default=Fairness().max_passes,
                    help="the queue's fairness bound, as leases.fairness_max_passes: a job passed over this often is "
                         f"served in turn (default {Fairness().max_passes})")
    ap.add_argument("--fairness-max-delay-s", type=float, default=Fairness().max_delay_s,
                    help="... or once first passed over this long ago, as leases.fairness_max_delay_s "
                         f"(default {Fairness().max_delay_s:g})")
    ap.add_argument("--history-trace", help="model-warm: a trace (CSV, as --trace) that `model` runs first on the same "
                                            "host; the trace under evaluation starts with its records in the store")


def fairness_of(args: argparse.Namespace) -> Fairness:
    """The fairness bound the run options name (an InvalidInput for one the agent's configuration would refuse)."""
    if args.fairness_max_passes < 1:
        raise InvalidInput("--fairness-max-passes must be >= 1", field="fairness_max_passes")
    if not 0 < args.fairness_max_delay_s < math.inf:
        raise InvalidInput("--fairness-max-delay-s must be a positive number of seconds", field="fairness_max_delay_s")
    return Fairness(args.fairness_max_passes, args.fairness_max_delay_s)


def fairness_meta(fairness: Fairness) -> dict[str, float]:
    """The bound a run was measured under, as both harnesses' JSON meta says it."""
    return {"max_passes": fairness.max_passes, "max_delay_s": fairness.max_delay_s}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (``hostagent model simulate`` / ``python -m hostagent.learn.simulate``)."""
    ap = argparse.ArgumentParser(prog="hostagent model simulate", description=__doc__.split("\n\n")[0])
    add_run_options(ap, seeds=3, seeds_help="runs per policy, each with its own seed (default 3)",
                    trace=lambda: ap.add_argument("--trace", required=True,
                                                  help="CSV arrival_s,job_type,work,num_gpus[,priority]"))
    ap.add_argument("--json", action="store_true", help="machine-readable JSON output")
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:
            raise InvalidInput(f"unknown policy {unknown[0]!r}; choose from {', '.join(POLICIES)}", field="policies")
        if args.seeds < 1:
            raise InvalidInput("--seeds must be >= 1", field="seeds")
        if WARM in policies and not args.history_trace:
            raise InvalidInput("model-warm needs --history-trace: the trace whose records its store starts with",
                               field="history_trace")
        out = simulate(load_table(args.throughputs), load_host(args.host), load_trace(args.trace), seeds=args.seeds,
                       policies=policies, warmup_jobs=args.warmup_jobs, retrain_every=args.retrain_every,
                       min_records=args.min_records, exploration=Exploration(epsilon=args.epsilon),
                       fairness=fairness_of(args),
                       history=load_trace(args.history_trace) if args.history_trace else ())
    except InvalidInput as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print(format_table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
