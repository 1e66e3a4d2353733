"""GPU probes: when to run them, how runs combine into one score, and when a result quarantines a GPU.

A probe runs only on a GPU that is free and on its host driver; while it runs the GPU is claimed so placement
cannot lease it. Each runner runs K times; every metric's median over the K runs is compared with the same
model's peers on this host, and the geometric mean of those ratios is the GPU's score (1.0 = like its peers).
The spread is half the range of the K per-run scores. A score far below the peers, or an uncorrectable error,
quarantines the GPU with the reason. Results go to the usage store and to placement (`score_of`), and what the
probe established about the board (`learn`: compute capability, the driver's memory size, the capability vector,
wrong answers) to the lease service's `measured`, which the GPU's capabilities and its memory size follow.

Probes are scheduled after a lease ends (RELEASED / EXPIRED), on a period, and on demand (API / CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hostagent.domain.capabilities import WRONG_ANSWER, Measured
from hostagent.domain.errors import Conflict, HostAgentError, NotFound
from hostagent.domain.inventory import PROBE_CLAIM_PREFIX, Gpu
from hostagent.domain.lease import Lease, LeaseState

log = logging.getLogger("hostagent.probes")


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """How often and how hard to probe, and when a result quarantines a GPU."""

    enabled: bool = True
    runs: int = 3  # K: runs per probe, combined by the median
    run_budget_s: float = 2.0  # seconds each compute run may measure for
    timeout_s: float = 120.0  # a whole probe (all runners, all runs)
    period_s: float = 24 * 3600.0  # probe every free GPU this often
    after_lease_delay_s: float = 2.0  # wait this long after a lease ends (the host driver settles)
    quarantine_below: float = 0.7  # quarantine when the score falls below this fraction of the peers
    min_peers: int = 2  # peers of the same model needed before a low score quarantines
    quarantine_on_errors: bool = True  # quarantine on uncorrectable errors (ECC, pending retirement, AER fatal)


# -- pure scoring ------------------------------------------------------------------------------------------------

def combine_runs(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each metric's median over the runs that measured it."""
    keys = sorted({k for r in runs for k in r})
    return {k: statistics.median([r[k] for r in runs if k in r]) for k in keys}


def peer_reference(model_latest: Mapping[str, Mapping[str, float]], gpu_id: str) -> tuple[dict[str, float], int]:
    """Median of each metric over the other same-model GPUs' latest medians, and how many peers there were."""
    others = [m for g, m in model_latest.items() if g != gpu_id and m]
    return combine_runs(others), len(others)


def relative_score(values: Mapping[str, float], reference: Mapping[str, float]) -> float | None:
    """Geometric mean of value/reference over the metrics both have (None when none or a reference is 0)."""
    ratios = [values[k] / reference[k] for k in values if k in reference and reference[k] > 0 and values[k] > 0]
    if not ratios:
        return None
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def score_spread(runs: Sequence[Mapping[str, float]], reference: Mapping[str, float]) -> float | None:
    """Half the range of the per-run scores (0 with one run)."""
    per_run = [s for s in (relative_score(r, reference) for r in runs) if s is not None]
    if not per_run:
        return None
    return (max(per_run) - min(per_run)) / 2


@dataclass(frozen=True)
class Verdict:
    """Whether a probe result should quarantine its GPU, and why."""

    quarantine: bool
    reason: str | None = None


def judge(score: float | None, peers: int, problems: Sequence[str], settings: ProbeSettings) -> Verdict:
    """Quarantine on uncorrectable problems, or on a score far below enough peers of the same model."""
    if problems and settings.quarantine_on_errors:
        return Verdict(True, "probe: " + "; ".join(problems))
    if score is not None and peers >= settings.min_peers and score < settings.quarantine_below:
        return Verdict(True, f"probe: score {score:.2f} is below {settings.quarantine_below:.2f} of its model's "
                             f"{peers} peers")
    return Verdict(False)


# -- the report --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeReport:
    """One probe of one GPU: combined metrics, score and spread, health, and what was done about it."""

    gpu_id: str
    model: str
    ts: float
    ok: bool
    score: float | None
    spread: float | None
    metrics: dict[str, float] = field(default_factory=dict)  # medians over the K runs
    runs: list[dict[str, float]] = field(default_factory=list)
    peers: int = 0
    reference: dict[str, float] = field(default_factory=dict)
    score_basis: str = "none"  # peers | own-history | first | none
    health: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    runners: list[dict[str, Any]] = field(default_factory=list)
    note: str | None = None  # why there is no score, for example
    quarantined: str | None = None
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the API's body and the store's details)."""
        return {"gpu_id": self.gpu_id, "model": self.model, "ts": self.ts, "ok": self.ok, "score": self.score,
                "spread": self.spread, "metrics": self.metrics, "runs": self.runs, "peers": self.peers,
                "reference": self.reference, "score_basis": self.score_basis, "health": self.health,
                "problems": self.problems, "warnings": self.warnings, "runners": self.runners, "note": self.note,
                "quarantined": self.quarantined, "duration_s": round(self.duration_s, 3)}


# -- the service -------------------------------------------------------------------------------------------------

RunBlocking = Callable[..., Awaitable[Any]]


class ProbeService:
    """Runs probes at the right moments and acts on their results."""

    def __init__(self, manager: Any, runners: Sequence[Any], *, settings: ProbeSettings = ProbeSettings(),
                 runner_status: Sequence[Any] = (), store: Any = None,
                 gpu_row: Callable[..., Mapping[str, Any]] | None = None,
                 clock: Callable[[], float] = time.time, run_blocking: RunBlocking | None = None) -> None:
        self.manager = manager
        self.runners = list(runners)
        self.runner_status = list(runner_status)
        self.settings = settings
        self.store = store
        self.gpu_row = gpu_row  # builds the store's GPU row with probe_score (hostagent.store.repo.gpu_record)
        self.clock = clock
        self._run = run_blocking or asyncio.to_thread
        self.scores: dict[str, float] = {}
        self.latest: dict[str, dict[str, float]] = {}  # gpu_id -> metric medians of its last probe
        self.history_best: dict[str, dict[str, float]] = {}  # gpu_id -> best medians seen (own baseline)
        self.last_probe: dict[str, float] = {}
        self.reports: dict[str, ProbeReport] = {}
        self._one_at_a_time = asyncio.Lock()  # probes share the host's CPU and PCIe; one at a time is plenty
        self._pending: dict[str, asyncio.Task[Any]] = {}  # gpu_id -> its scheduled probe's task (one at most)
        self._due: dict[str, tuple[float, str]] = {}  # gpu_id -> (loop time the probe is due, actor)
        self._periodic: asyncio.Task[Any] | None = None
        # figures measured for a GPU model by other probes (services.task_probes), kept in each GPU's `measured`
        self.extra_figures: Callable[[str], Mapping[str, float]] = lambda model: {}

    # -- placement feature ----------------------------------------------------------------------------------------
    def score_of(self, gpu_id: str) -> float | None:
        """The GPU's latest probe score (1.0 = like its peers), for DeviceView.probe_score."""
        return self.scores.get(gpu_id)

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Subscribe to lease changes and start the periodic sweep (inside the running loop)."""
        self.manager.listeners.append(self.on_lease_change)
        if self.settings.enabled and self.settings.period_s > 0:
            self._periodic = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def stop(self) -> None:
        """Unsubscribe and cancel scheduled probes."""
        with contextlib.suppress(ValueError):
            self.manager.listeners.remove(self.on_lease_change)
        self._due.clear()
        tasks = list(self._pending.values()) + ([self._periodic] if self._periodic else [])
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def load_history(self) -> int:
        """Restore the latest medians and scores from the store (best effort); returns how many GPUs."""
        if self.store is None:
            return 0
        try:
            rows = await self.store.list_probe_results(limit=1000)
        except HostAgentError as exc:
            log.warning("probe history not loaded: %s", exc.message)
            return 0
        for row in sorted(rows, key=lambda r: r["ts"]):  # oldest first: the newest wins
            details = row.get("details") or {}
            gid = row["gpu_id"]
            if gid not in self.manager.gpus or details.get("kind") == "task":  # a task probe's: services.task_probes
                continue
            if details.get("metrics") and not any(str(p).startswith(WRONG_ANSWER) for p in details.get("problems", [])):
                self.latest[gid] = dict(details["metrics"])
                self._remember_best(gid, self.latest[gid])
            self.learn(gid, details.get("health") or {})
            if row.get("score") is not None:
                self.scores[gid] = float(row["score"])
            self.last_probe[gid] = float(row["ts"])
        return len(self.last_probe)

    # -- scheduling ------------------------------------------------------------------------------------------------
    def on_lease_change(self, lease: Lease | None, detail: str | None) -> None:
        """Lease listener: a GPU that came back from a lease gets probed shortly after."""
        if not self.settings.enabled or lease is None or lease.state not in (LeaseState.RELEASED, LeaseState.EXPIRED):
            return
        for gid in lease.gpu_ids:
            self.schedule(gid, delay_s=self.settings.after_lease_delay_s, actor="after-lease")

    def schedule(self, gpu_id: str, *, delay_s: float = 0.0, actor: str = "agent") -> asyncio.Task[Any]:
        """Probe a GPU in the background (skipped quietly if it is leased again by then).

        One task per GPU at most: scheduling a GPU that already waits for its probe moves the probe to the later
        due time instead of queueing another (a busy host ends leases faster than probes run; without this the
        waiting tasks would pile up without bound). A GPU scheduled while its probe runs is probed once more.
        """
        loop = asyncio.get_running_loop()
        due = loop.time() + delay_s
        earlier = self._due.get(gpu_id)
        self._due[gpu_id] = (max(due, earlier[0]) if earlier else due, actor)
        task = self._pending.get(gpu_id)
        if task is not None and not task.done():
            return task

        async def later() -> None:
            while gpu_id in self._due:
                when, who = self._due[gpu_id]
                if when > loop.time():
                    await asyncio.sleep(when - loop.time())
                    continue
                del self._due[gpu_id]
                try:
                    await self.probe(gpu_id, actor=who)
                except Conflict as exc:
                    log.info("probe of %s skipped: %s", gpu_id, exc.message)
                except HostAgentError as exc:
                    log.warning("probe of %s failed: %s", gpu_id, exc.message)

        task = loop.create_task(later())
        self._pending[gpu_id] = task
        task.add_done_callback(lambda t: self._pending.pop(gpu_id, None) if self._pending.get(gpu_id) is t else None)
        return task

    async def _sweep_loop(self) -> None:
        every = min(self.settings.period_s, 600.0)
        while True:
            await asyncio.sleep(every)
            await self.sweep()

    async def sweep(self) -> list[ProbeReport]:
        """Probe every free GPU whose last probe is older than the period."""
        now = self.clock()
        done = []
        for gid in list(self.manager.gpus):
            if now - self.last_probe.get(gid, -math.inf) < self.settings.period_s:
                continue
            if gid in self.manager.claims or gid in self.manager.quarantined or gid in self.manager.attention:
                continue
            try:
                done.append(await self.probe(gid, actor="periodic"))
            except HostAgentError as exc:
                log.info("periodic probe of %s skipped: %s", gid, exc.message)
        return done

    # -- one probe -------------------------------------------------------------------------------------------------
    async def _claim(self, gpu: Gpu) -> str:
        """Hold the GPU away from placement while it is probed; Conflict when it is leased or not on its host driver."""
        m = self.manager
        claim = f"{PROBE_CLAIM_PREFIX}{gpu.id}"
        async with m._decide:  # the lease driver's decision lock: no grant can pick the GPU meanwhile
            holder = m.claims.get(gpu.id)
            if holder is not None:
                what = "being probed" if holder.startswith(PROBE_CLAIM_PREFIX) else f"held by lease {holder}"
                raise Conflict(f"GPU {gpu.id} is {what}; probes run only between leases", field="gpu_id")
            if gpu.id in m.attention:
                raise Conflict(f"GPU {gpu.id} needs an operator's attention: {m.attention[gpu.id]}", field="gpu_id")
            if not gpu.viable:
                raise Conflict(f"GPU {gpu.id} is not leasable: {gpu.unviable_reason}", field="gpu_id")
            m.claims[gpu.id] = claim
        try:
            drivers = await self._run(m.host.current_drivers, gpu)
        except BaseException:
            self._unclaim(gpu.id, claim)
            raise
        drv = drivers.get(str(gpu.address))
        if drv in (None, "vfio-pci"):
            self._unclaim(gpu.id, claim)
            raise Conflict(f"GPU {gpu.id} is on {drv or 'no driver'}, not its host driver; probes need the host "
                           "driver", field="gpu_id")
        return claim

    def _unclaim(self, gpu_id: str, claim: str) -> None:
        if self.manager.claims.get(gpu_id) == claim:
            del self.manager.claims[gpu_id]
            self.manager._wake_queue.set()  # a queued request may have waited for this GPU

    async def probe(self, gpu_id: str, *, actor: str = "operator") -> ProbeReport:
        """Probe one GPU now: K runs of every runner, combine, score, store, maybe quarantine."""
        gpu = self.manager.gpus.get(gpu_id)
        if gpu is None:
            raise NotFound(f"no GPU {gpu_id!r}", field="gpu_id")
        async with self._one_at_a_time:
            claim = await self._claim(gpu)
            try:
                t0 = time.perf_counter()
                try:
                    results = await asyncio.wait_for(self._measure(gpu), self.settings.timeout_s)
                except asyncio.TimeoutError:
                    results = [_timeout_result(self.settings.timeout_s)]
                report = self._report(gpu, results, time.perf_counter() - t0)
                self.learn(gpu_id, report.health)
                verdict = judge(report.score, report.peers, report.problems, self.settings)
                if verdict.quarantine and verdict.reason:
                    # quarantined while still claimed, so no grant can slip in between the verdict and the quarantine
                    if gpu_id not in self.manager.quarantined:
                        await self.manager._quarantine(gpu_id, verdict.reason, actor)
                    report = _with(report, quarantined=verdict.reason, ok=False)
            finally:
                self._unclaim(gpu_id, claim)
        self.reports[gpu_id] = report
        await self._record(gpu, report, actor)
        return report

    async def _measure(self, gpu: Gpu) -> list[Any]:
        out = []
        for runner in self.runners:
            times = self.settings.runs if runner.kind == "compute" else 1  # health signals do not need K reads
            for _ in range(max(1, times)):
                try:
                    out.append(await self._run(runner.run, gpu, self.settings.run_budget_s))
                except Exception as exc:  # a runner's library failing must not take the agent down
                    log.warning("probe runner %s failed on %s: %s", runner.name, gpu.id, exc)
                    out.append(_error_result(runner.name, f"{type(exc).__name__}: {exc}"))
                    break
        return out

    def learn(self, gpu_id: str, health: Mapping[str, Any]) -> Measured:
        """What a probe established about the board becomes the lease service's `measured[gpu_id]` (capabilities
        follow it); a memory size the driver reports replaces discovery's where that was only the largest BAR or
        unknown (pci.ids older than the card)."""
        gpu = self.manager.gpus[gpu_id]
        measured = Measured.from_probe(health, {**self.latest.get(gpu_id, {}), **self.extra_figures(gpu.model)})
        before = self.manager.measured.get(gpu_id)
        if before is not None:  # a probe whose runners said less (one failed) forgets nothing the board is
            measured = dataclasses.replace(
                measured, compute_capability=measured.compute_capability or before.compute_capability,
                name=measured.name or before.name, memory_bytes=measured.memory_bytes or before.memory_bytes)
        self.manager.measured[gpu_id] = measured
        if (measured.memory_bytes and measured.memory_bytes != gpu.memory_bytes
                and gpu.memory_source in ("bar", "unknown", "probe")):
            self.manager.gpus[gpu_id] = dataclasses.replace(gpu, memory_bytes=measured.memory_bytes,
                                                            memory_source="probe")
        return measured

    def _remember_best(self, gpu_id: str, medians: Mapping[str, float]) -> None:
        best = self.history_best.setdefault(gpu_id, {})
        for k, v in medians.items():
            best[k] = max(best.get(k, v), v)

    def _report(self, gpu: Gpu, results: Sequence[Any], duration: float) -> ProbeReport:
        runs = [dict(r.metrics) for r in results if r.metrics]
        problems = list(dict.fromkeys(p for r in results for p in r.problems))  # each once, however many runs saw it
        warnings = list(dict.fromkeys(w for r in results for w in r.warnings))
        errors = [f"{r.runner}: {r.error}" for r in results if r.error]
        health: dict[str, Any] = {}
        for r in results:
            if r.health:
                health.setdefault(r.runner, r.health)
        medians = combine_runs(runs)
        score = spread = None
        basis, peers = "none", 0
        reference: dict[str, float] = {}
        note = None
        if any(p.startswith(WRONG_ANSWER) for p in problems):
            # fast and wrong: its figures are nobody's reference (never averaged into peers or its own history)
            note = "a known-answer check failed: no score, and these figures count towards no reference"
        elif medians:
            prior = dict(self.history_best.get(gpu.id, {}))
            self.latest[gpu.id] = medians
            self._remember_best(gpu.id, medians)
            same_model = {g: self.latest.get(g, {}) for g, other in self.manager.gpus.items() if other.model == gpu.model}
            reference, peers = peer_reference(same_model, gpu.id)
            basis = "peers"
            if not peers:
                # no peer of this model measured yet: compare with this GPU's own best, or call it the baseline
                reference, basis = (prior, "own-history") if prior else (dict(medians), "first")
            score = relative_score(medians, reference)
            spread = score_spread(runs, reference)
            if score is not None:
                self.scores[gpu.id] = round(score, 4)
        if not medians:
            compute = [s for s in self.runner_status if getattr(s, "kind", "") == "compute"]
            why = "; ".join(f"{s.name}: {s.reason}" for s in compute if not s.available) or "no compute runner"
            note = f"no throughput measured, so no score: {why}"
        if errors:
            note = "; ".join(([note] if note else []) + errors)
        self.last_probe[gpu.id] = self.clock()
        return ProbeReport(
            gpu_id=gpu.id, model=gpu.model, ts=self.clock(), ok=not problems,
            score=None if score is None else round(score, 4), spread=None if spread is None else round(spread, 4),
            metrics=medians, runs=runs, peers=peers, reference=reference, score_basis=basis, health=health,
            problems=problems, warnings=warnings, runners=[s.to_dict() for s in self.runner_status], note=note,
            duration_s=duration,
        )

    async def _record(self, gpu: Gpu, report: ProbeReport, actor: str) -> None:
        """Journal event, usage store row, and the store's GPU probe_score (best effort: probes never fail on it)."""
        summary = (f"score {report.score:.2f} ± {report.spread or 0:.2f} ({report.score_basis})"
                   if report.score is not None else (report.note or "no score"))
        if report.problems:
            summary += "; problems: " + "; ".join(report.problems)
        with contextlib.suppress(Exception):
            await self._run(self.manager.journal.event, "probe", actor=actor, gpu_id=gpu.id, detail=summary[:1000])
        if self.store is None:
            return
        try:
            await self.store.add_probe_result(gpu.id, score=report.score, spread=report.spread, ok=report.ok,
                                              details=report.to_dict(), ts=report.ts)
            if self.gpu_row is not None and report.score is not None:  # the GPU as learned (its memory, say)
                await self.store.upsert_gpus([self.gpu_row(self.manager.gpus[gpu.id], probe_score=report.score)])
        except HostAgentError as exc:
            log.warning("probe result of %s not stored: %s", gpu.id, exc.message)

    def status(self) -> dict[str, Any]:
        """Runners, settings and every GPU's latest score, for the API."""
        return {
            "runners": [s.to_dict() for s in self.runner_status],
            "settings": {"enabled": self.settings.enabled, "runs": self.settings.runs,
                         "period_s": self.settings.period_s, "quarantine_below": self.settings.quarantine_below,
                         "min_peers": self.settings.min_peers},
            "gpus": {g: {"score": self.scores.get(g), "last_probe": self.last_probe.get(g),
                         "ok": self.reports[g].ok if g in self.reports else None} for g in self.manager.gpus},
        }


def _with(report: ProbeReport, **changes: Any) -> ProbeReport:
    import dataclasses

    return dataclasses.replace(report, **changes)


@dataclass(frozen=True)
class _Result:
    """A stand-in runner result for failures outside a runner (same fields the report reads)."""

    runner: str
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    health: dict[str, Any] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def _timeout_result(timeout_s: float) -> _Result:
    return _Result("probe", error=f"the probe did not finish within {timeout_s:g} s")


def _error_result(runner: str, error: str) -> _Result:
    return _Result(runner, error=error)
