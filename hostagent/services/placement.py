"""Placement for the lease driver: filters, the learned scorer (or the cold-start rule), exploration, topology."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hostagent.domain.capabilities import Measured
from hostagent.domain.errors import Conflict
from hostagent.domain.terms import Scaling
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import LeaseRequest
from hostagent.domain.placement import (
    RULE_EXPLORE,
    RULE_MODEL,
    RULE_NONE,
    DeviceView,
    DeviceViews,
    Exploration,
    PlacementRequest,
    Scorer,
    choose_set,
    doubt_draw,
    explore,
    score_devices,
)
from hostagent.services.lease_types import Placement

if TYPE_CHECKING:
    from hostagent.services.topology import TopologyPlacer


RATES_KEPT = 512  # requests whose predicted rates the placer keeps for the queue (cleared when full)


class Placer:
    """A PlaceFn (see services.lease_types) holding the current scorer; the retraining job swaps it atomically."""

    def __init__(self, gpus: Callable[[], Sequence[Gpu]], *, quarantined: Callable[[], dict[str, str]],
                 probe_scores: Callable[[], dict[str, float]] | None = None,
                 exploration: Exploration | None = None, cold_exploration: Exploration | None = None,
                 seed: int | None = None,
                 distance: Callable[[DeviceView, DeviceView], float] | None = None,
                 default_numa_policy: str = "preferred",
                 measured: Callable[[str], Measured | None] = lambda gpu_id: None) -> None:
        self._gpus = gpus
        self._measured = measured  # what each GPU's latest probe established (capabilities, capability vector)
        self._quarantined = quarantined
        self._probe_scores = probe_scores or (lambda: {})
        self.exploration = exploration
        # before the first model (`placement.cold_explore_epsilon`); None: as `exploration`
        self.cold_exploration = cold_exploration
        self.rng = random.Random(seed)
        self.distance = distance
        self.scorer: Scorer | None = None
        self.model_version: str | None = None
        self._switches = 0  # models handed to `use` (rates_token)
        self.default_numa_policy = default_numa_policy
        self.last_decisions: list[dict[str, Any]] = []  # recent decisions for the dashboard (bounded)
        self._views = DeviceViews()
        # relative_rates' predictions: request -> gpu id -> (the Gpu, its Measured, the rate); cleared on a switch
        self._rates: dict[PlacementRequest, dict[str, tuple[Gpu, Measured | None, float]]] = {}
        self._last_rates: dict[PlacementRequest, tuple[Any, ...]] = {}  # the last answer per request (fast path)
        self._last_sds: dict[PlacementRequest, tuple[tuple[Gpu, ...], tuple[float, ...]]] = {}  # rate_uncertainty's
        # The topology-aware set choice (same switch < root complex < NUMA node < sockets, packing); set by
        # the topology wiring. Without it the greedy choice of domain.placement decides.
        self.topology_place: TopologyPlacer | None = None

    def predict_rates(self, request: LeaseRequest, gpus: Sequence[Gpu]) -> tuple[list[float], str] | None:
        """Each GPU's work rate for the request's task type as the active model predicts it (the guest's unit), and
        the model's version; None without a work-rate model that covers the task type."""
        bundle = getattr(self.scorer, "bundle", None)
        preq = PlacementRequest.from_lease(request, count=1)
        if (bundle is None or getattr(bundle, "target", None) != "work_rate" or self.scorer is None
                or not self.scorer.covers(preq) or request.task_type not in bundle.norms):
            return None
        views = [self._views.view(g, free=True, measured=self._measured(g.id)) for g in gpus]
        return [float(x) for x in bundle.predict_rates(preq, views)], self.model_version or "unnamed"

    def relative_rates(self, request: LeaseRequest, gpus: Sequence[Gpu]) -> tuple[float, ...] | None:
        """Each GPU's relative work rate for the request as the active model predicts it, busy or not (one batched
        prediction; the queue compares them: services.lease_queue); None without an active model. A request the
        model does not cover yet (too few records of its task type: placement chooses its GPU by the cold-start
        rule) is predicted too: the model's throughput matrix shares what it knows of the GPU models and task
        types, and rate_uncertainty gives a pair without records a wide deviation, so the queue compares it without
        trusting it more than that (2026-12-01). Asked again with the same GPUs and probes, it returns the very tuple
        it returned before (the queue keeps what it derived from it while it does)."""
        preq = PlacementRequest.from_lease(request, count=1)
        if self.scorer is None:
            return None
        # the queue asks again at every decision for every request shape that could start: a prediction depends
        # only on the request, the GPU (an object per scan) and its probes' figures (an object per probe), so each
        # is made once per model and kept with the objects it was made for (a rescan or a new probe misses)
        measured = tuple(map(self._measured, [g.id for g in gpus]))
        last = self._last_rates.get(preq)
        if last is not None and last[0] == tuple(gpus) and last[1] == measured:  # the same GPUs, probes: as before
            return last[2]  # type: ignore[no-any-return]
        known = self._rates.get(preq)
        if known is None:
            if len(self._rates) >= RATES_KEPT:
                for stale in list(self._rates)[:RATES_KEPT // 2]:  # the oldest half
                    del self._rates[stale]
                    self._last_rates.pop(stale, None)
            known = self._rates[preq] = {}
        out: list[float] = []
        missed: list[int] = []
        for i, g in enumerate(gpus):
            hit = known.get(g.id)
            if hit is None or hit[0] is not g or hit[1] is not measured[i]:
                missed.append(i)
                out.append(0.0)
            else:
                out.append(hit[2])
        if missed:
            views = [self._views.view(gpus[i], free=True, measured=measured[i]) for i in missed]
            for i, rate in zip(missed, self.scorer.score(preq, views)):
                known[gpus[i].id] = (gpus[i], measured[i], float(rate))
                out[i] = float(rate)
        answer = tuple(out)
        self._last_rates[preq] = (tuple(gpus), measured, answer)
        return answer

    def rate_uncertainty(self, request: LeaseRequest, gpus: Sequence[Gpu]) -> tuple[float, ...] | None:
        """Each GPU's log-space standard deviation of relative_rates' prediction for the request (the active model's
        throughput matrix: LearnedScorer.uncertainty); None without an active model or where it gives none (a
        request it does not cover yet too: relative_rates). The queue treats efficiencies it cannot tell apart as
        equal (domain.assignment). Asked again with the same GPUs, it returns the very tuple it returned before."""
        fn = getattr(self.scorer, "uncertainty", None)
        preq = PlacementRequest.from_lease(request, count=1)
        if fn is None or self.scorer is None:
            return None
        key = tuple(gpus)
        last = self._last_sds.get(preq)
        if last is not None and last[0] == key:  # it depends on the model, the task type and the GPUs' models only
            return last[1]
        views = [self._views.view(g, free=True, measured=self._measured(g.id)) for g in gpus]
        out = tuple(float(x) for x in fn(preq, views))
        if len(self._last_sds) >= RATES_KEPT:
            self._last_sds.clear()
        self._last_sds[preq] = (key, out)
        return out

    def typical_run_s(self, task_type: str, running: Sequence[float] = ()) -> float | None:
        """The task type's expected run time at rate 1 by the active model's records (None: no model, or too few), its
        leases still running counted too (`running`: how much each has run so far at rate 1; see
        LearnedScorer.typical_run_s)."""
        fn = getattr(self.scorer, "typical_run_s", None)
        if fn is None:
            return None
        return fn(task_type, running) if running else fn(task_type)

    def left_run_s(self, task_type: str, done: float) -> float | None:
        """How much more, at rate 1, a lease of the task type that has done `done` (at rate 1) is expected to run by
        the active model's records (None: no model, or no history of the type; see LearnedScorer.left_run_s)."""
        fn = getattr(self.scorer, "left_run_s", None)
        return None if fn is None else fn(task_type, done)

    def scaling(self, task_type: str) -> Scaling | None:
        """What the active model's records say of the task type's total work rate by GPU count (None without a
        model, or where they hold fewer than two counts of it)."""
        totals = getattr(getattr(self.scorer, "bundle", None), "scaling", {}).get(task_type)
        return Scaling(task_type, totals) if totals else None

    def doubt(self, request: LeaseRequest) -> float:
        """A queued request's draw of the model's doubt in one decision whether to wait for a better GPU (the queue's
        Thompson sampling: domain.assignment), from the placer's seeded generator: standard normal where the request
        may explore (`placement.explore_epsilon` above 0, its priority at or under `placement.explore_max_priority`),
        else 0."""
        return doubt_draw(self.exploration, self.rng, request.priority)

    def rates_token(self) -> tuple[object, ...]:
        """What relative_rates' and rate_uncertainty's answers depend on besides the request and the GPUs asked
        about: the model in use (a count of switches) and each GPU's latest probe figures. While it compares equal,
        so do their answers for the same request and GPUs (the queue asks once per decision, not once per request
        shape)."""
        return self._switches, tuple(map(self._measured, [g.id for g in self._gpus()]))

    def use(self, scorer: Scorer | None, version: str | None) -> None:
        """Switch to a newly trained (or rolled back) model."""
        self.scorer, self.model_version = scorer, version
        self._switches += 1
        self._rates.clear()
        self._last_rates.clear()
        self._last_sds.clear()

    @property
    def rule(self) -> str:
        """What decides placements now."""
        return "model" if self.scorer is not None else "cold-start"

    def __call__(self, request: LeaseRequest, candidates: Sequence[Gpu], count: int, domain_uuid: str) -> Placement:
        """Choose `count` of the candidate (free) GPUs; every other GPU appears among the dropped with a reason.

        Filters and scores run once, over every GPU of the host; the topology placer (when wired) or the greedy
        choice picks the set from them; exploration may then swap a single GPU for a near-best one."""
        return self._place(request, candidates, count, domain_uuid, remember=True)

    def would_place(self, request: LeaseRequest, candidates: Sequence[Gpu], count: int,
                    domain_uuid: str) -> Placement:
        """The same decision asked hypothetically (consolidation's "would it fit if these were free"): not recorded
        among the decisions the dashboard explains, no exploration."""
        return self._place(request, candidates, count, domain_uuid, remember=False)

    def _place(self, request: LeaseRequest, candidates: Sequence[Gpu], count: int, domain_uuid: str, *,
               remember: bool) -> Placement:
        topo = self.topology_place
        free = {g.id for g in candidates}
        quarantined = self._quarantined()
        if topo is not None:
            preq, probe = topo.request_for(request, count, domain_uuid), topo.probe_score
        else:
            preq = PlacementRequest.from_lease(request, count=count)
            if request.numa_policy is None and self.default_numa_policy != preq.numa_policy:
                preq = dataclasses.replace(preq, numa_policy=self.default_numa_policy)
            probe = self._probe_scores().get
        nvlinked = topo.topology.nvlinked if topo is not None else frozenset()
        views = [self._views.view(g, free=g.id in free, quarantined=g.id in quarantined, probe_score=probe(g.id),
                                  nvlink=g.id in nvlinked, measured=self._measured(g.id)) for g in self._gpus()]
        scored = score_devices(preq, views, self.scorer)
        dropped = tuple({"gpu_id": d.gpu_id, "reason": d.reason} for d in scored.dropped)
        try:
            if topo is not None:
                placement = topo.pick(preq, scored, free)
            elif scored.rule == RULE_NONE:
                raise Conflict(scored.reason, field="gpus")
            else:
                ix, spread = choose_set(scored.survivors, scored.scores, count, distance=self.distance,
                                        numa_policy=preq.numa_policy)
                placement = Placement(
                    gpu_ids=tuple(scored.survivors[i].gpu_id for i in ix), reasons=(scored.reason,),
                    candidates=tuple({"gpu_id": g, "score": round(s, 6)} for g, s in scored.ranked()),
                    dropped=dropped, distance=None if spread is None else round(float(spread), 3), rule=scored.rule)
        except Conflict as exc:
            if remember:
                self._remember({"chosen": [], "rule": RULE_NONE, "candidates": [], "dropped": list(dropped),
                                "reasons": [exc.message], "distance": None}, request)
            raise
        if not remember:
            return placement
        # before any model the cold-start rule predicts nothing: a random GPU, at the first day's own rate
        ex = self.exploration if self.scorer is not None or self.cold_exploration is None else self.cold_exploration
        alt = explore(preq, scored, placement.gpu_ids[0], ex, self.rng) if count == 1 else None
        if alt is not None:
            placement = Placement(gpu_ids=(alt[0],), reasons=(scored.reason, alt[1]), candidates=placement.candidates,
                                  dropped=dropped, distance=None, rule=RULE_EXPLORE)
        if placement.rule in (RULE_MODEL, RULE_EXPLORE):
            placement = dataclasses.replace(placement, model_version=self.model_version or "unnamed")
        self._remember({"chosen": list(placement.gpu_ids), "rule": placement.rule,
                        "candidates": list(placement.candidates), "dropped": list(dropped),
                        "reasons": list(placement.reasons), "distance": placement.distance}, request)
        return placement

    def _remember(self, record: dict[str, Any], request: LeaseRequest) -> None:
        record = {**record, "model_version": self.model_version, "task_type": request.task_type}
        self.last_decisions = (self.last_decisions + [record])[-200:]
