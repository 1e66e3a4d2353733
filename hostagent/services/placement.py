"""Placement for the lease driver: filters, the learned scorer (or the cold-start rule), exploration, topology."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

from hostagent.domain.errors import Conflict
from hostagent.domain.inventory import Gpu
from hostagent.domain.lease import LeaseRequest
from hostagent.domain.placement import DeviceView, Exploration, PlacementRequest, Scorer, place
from hostagent.services.leases import Placement


class Placer:
    """A PlaceFn (see services.leases) holding the current scorer; the retraining job swaps it atomically."""

    def __init__(self, gpus: Callable[[], Sequence[Gpu]], *, quarantined: Callable[[], dict[str, str]],
                 probe_scores: Callable[[], dict[str, float]] | None = None,
                 exploration: Exploration | None = None, seed: int | None = None,
                 distance: Callable[[DeviceView, DeviceView], float] | None = None,
                 default_numa_policy: str = "preferred") -> None:
        self._gpus = gpus
        self._quarantined = quarantined
        self._probe_scores = probe_scores or (lambda: {})
        self.exploration = exploration
        self.rng = random.Random(seed)
        self.distance = distance
        self.scorer: Scorer | None = None
        self.model_version: str | None = None
        self.default_numa_policy = default_numa_policy
        self.last_decisions: list[dict[str, Any]] = []  # recent decisions for the dashboard (bounded)
        # The topology-aware set choice (same switch < root complex < NUMA node < sockets, packing); set by
        # the topology wiring. Without it the greedy choice of domain.placement decides.
        self.topology_place: Callable[[LeaseRequest, Sequence[Gpu], int, str], Placement] | None = None

    def use(self, scorer: Scorer | None, version: str | None) -> None:
        """Switch to a newly trained (or rolled back) model."""
        self.scorer, self.model_version = scorer, version

    @property
    def rule(self) -> str:
        """What decides placements now."""
        return "model" if self.scorer is not None else "cold-start"

    def __call__(self, request: LeaseRequest, candidates: Sequence[Gpu], count: int, domain_uuid: str) -> Placement:
        """Choose `count` of the candidate (free) GPUs; every other GPU appears among the dropped with a reason."""
        free = {g.id for g in candidates}
        quarantined = self._quarantined()
        scores = self._probe_scores()
        views = [DeviceView.from_gpu(g, free=g.id in free, quarantined=g.id in quarantined,
                                     probe_score=scores.get(g.id)) for g in self._gpus()]
        preq = PlacementRequest.from_lease(request, count=count)
        if request.numa_policy is None and self.default_numa_policy != preq.numa_policy:
            preq = dataclasses.replace(preq, numa_policy=self.default_numa_policy)
        decision = place(preq, views, scorer=self.scorer, exploration=self.exploration, rng=self.rng,
                         distance=self.distance)
        if not decision.chosen:
            self._remember(decision.to_dict(), request)
            raise Conflict("; ".join(decision.reasons) or "no GPU passed the placement filters", field="gpus")
        dropped = tuple({"gpu_id": d.gpu_id, "reason": d.reason} for d in decision.dropped)
        if self.topology_place is not None and decision.rule != "explore":
            # Same filters and scores; the topology placer picks the set (distance, packing) and says why.
            chosen = self.topology_place(request, candidates, count, domain_uuid)
            placement = dataclasses.replace(chosen, dropped=dropped)
        else:
            placement = Placement(
                gpu_ids=decision.chosen, reasons=decision.reasons,
                candidates=tuple({"gpu_id": g, "score": round(s, 6)} for g, s in decision.candidates),
                dropped=dropped,
                distance=None if decision.distance is None else round(float(decision.distance), 3),
                rule=decision.rule,
            )
        self._remember({"chosen": list(placement.gpu_ids), "rule": placement.rule,
                        "candidates": list(placement.candidates), "dropped": list(dropped),
                        "reasons": list(placement.reasons), "distance": placement.distance}, request)
        return placement

    def _remember(self, record: dict[str, Any], request: LeaseRequest) -> None:
        record = {**record, "model_version": self.model_version, "task_type": request.task_type}
        self.last_decisions = (self.last_decisions + [record])[-200:]
