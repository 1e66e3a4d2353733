"""Model lifecycle: train | evaluate | show | rollback, over the usage store (library functions the CLI wires).

A candidate is fitted on all but the most recent records and scored on those recent, held-out records next to
the active model. It replaces the active model unless it does worse there beyond the records' noise (`NOISE_Z`
standard errors of the paired per-record difference); either way the version
is saved with its figures and the decision, so ``show`` tells the whole story. The promoted artifact is refitted
on every record (the held-out ones are the freshest: leaving them out of the model in service would throw away
exactly what changed most recently).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

import numpy as np

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.learn import MODEL_KIND
from hostagent.learn.model import TARGETS, LearnedScorer, ModelBundle, fit, target_values
from hostagent.learn.records import Example, TrainingSource, load_examples, own_rates

log = logging.getLogger("hostagent.learn")

KIND = MODEL_KIND
MIN_RECORDS = 100  # below this the cold-start rule keeps deciding
HOLDOUT_FRACTION = 0.2
HOLDOUT_MIN = 20  # fewer fresh records than this cannot judge a candidate against the active model
# A candidate whose held-out error is higher than the active model's is still promoted unless the difference, paired
# record by record, exceeds this many standard errors (a one-sided test at 95 %): it was fitted on every record the
# active model saw and more, and near the reported rates' own noise a difference of 1e-5 would otherwise decide
NOISE_Z = 1.645
MAX_RANK_PAIRS = 20000


class ModelRegistry(Protocol):
    """Where model versions live (``hostagent.store.repo.UsageStore`` implements it)."""

    def save_model_version(self, version: str, *, kind: str = ..., artifact: bytes | None = ...,
                           metrics: Any = ..., params: Any = ..., trained_on: int | None = ...,
                           activate: bool = ..., created_at: float | None = ...) -> dict[str, Any]:
        """Store a version (optionally activating it)."""

    def activate_model_version(self, version: str, *, kind: str = ...) -> None:
        """Make a version the active one."""

    def list_model_versions(self, *, kind: str | None = ..., limit: int = ...) -> list[dict[str, Any]]:
        """Versions, newest first, without artifacts."""

    def get_model_version(self, version: str | None = ..., *, kind: str = ...,
                          with_artifact: bool = ...) -> dict[str, Any]:
        """One version, or the active one; NotFound when absent."""


class ModelStore(TrainingSource, ModelRegistry, Protocol):
    """The usage store as the lifecycle sees it."""


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What ``train`` did and why."""

    decision: str  # promoted | kept-current | insufficient-records
    version: str | None
    metrics: dict[str, Any] = field(default_factory=dict)
    bundle: ModelBundle | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the CLI."""
        return {"decision": self.decision, "version": self.version, "metrics": self.metrics}


def split_recent(examples: Sequence[Example], fraction: float, *,
                 at_least: int = 1) -> tuple[list[Example], list[Example]]:
    """Older part and most recent part, split on lease boundaries (all devices of a lease fall on one side): the
    newest `fraction` of the leases, or `at_least` of them where that is more, but never more than half (what is
    judged is fitted on at least as many)."""
    leases = sorted({(e.created_at, e.lease_key) for e in examples})
    n_hold = min(max(1, int(round(len(leases) * fraction)), at_least), max(1, len(leases) // 2)) if leases else 0
    recent = set(key for _, key in leases[len(leases) - n_hold:])
    return [e for e in examples if e.lease_key not in recent], [e for e in examples if e.lease_key in recent]


def hosts_of(examples: Sequence[Example]) -> dict[str, int]:
    """Leases per host among the examples: whose records a model learns from (every host of a fleet store)."""
    leases: dict[str, set[str]] = {}
    for e in examples:
        leases.setdefault(e.host, set()).add(e.lease_id)
    return {host: len(ids) for host, ids in sorted(leases.items())}


def evaluate_bundle(bundle: ModelBundle, examples: Sequence[Example], *, seed: int = 0) -> dict[str, Any]:
    """Figures of one model on labelled examples: error (log-space for work rate, else absolute) and rank accuracy."""
    return _figures(_scored(bundle, examples), seed)


Scored = tuple[list[Example], np.ndarray, np.ndarray, np.ndarray]  # examples judged, labels, predictions, errors


def _figures(scored: Scored, seed: int = 0) -> dict[str, Any]:
    """evaluate_bundle's figures from one model's scores."""
    ex, y, pred, errors = scored
    if not ex:
        return {"n": 0, "error": None, "rank_accuracy": None}
    return {"n": len(ex), "error": float(np.mean(errors)), "rank_accuracy": _rank_accuracy(ex, y, pred, seed)}


def _scored(bundle: ModelBundle, examples: Sequence[Example]) -> Scored:
    """The examples labelled for the model's target, their labels, its predictions and its error on each (log-space
    for work rate, else absolute)."""
    if bundle.target == "work_rate":  # (a mixed set's rate is the slowest model's: no pair's, as in training)
        ex = [e for e, own in zip(examples, own_rates(examples)) if own]
        y = np.array([e.work_rate for e in ex], dtype=float)
    else:
        ex, y, _ = target_values(examples, bundle.target)
    if not ex:
        return [], y, y, y
    pred = bundle.predict_examples(ex)
    if bundle.target == "work_rate":
        return ex, y, pred, np.abs(np.log(np.maximum(pred, 1e-12)) - np.log(y))
    return ex, y, pred, np.abs(pred - y)


def worse_by(mine: np.ndarray, theirs: np.ndarray) -> tuple[float, float] | None:
    """How much larger one model's errors (`mine`) are than another's (`theirs`) on the same held-out examples of
    one target (`_scored`): the mean of the per-example differences and its standard error (None: fewer than
    two)."""
    if len(mine) < 2:
        return None
    d = mine - theirs
    return float(np.mean(d)), float(np.std(d, ddof=1)) / math.sqrt(len(d))


def _rank_accuracy(ex: Sequence[Example], y: np.ndarray, pred: np.ndarray, seed: int) -> float | None:
    """How often the model orders two records of one task type on different GPU models as they really were."""
    by_task: dict[str, list[int]] = {}
    for i, e in enumerate(ex):
        by_task.setdefault(e.request.task_type, []).append(i)
    pairs = [(a, b) for ix in by_task.values() for k, a in enumerate(ix) for b in ix[k + 1:]
             if ex[a].device.model != ex[b].device.model and y[a] != y[b]]
    if not pairs:
        return None
    if len(pairs) > MAX_RANK_PAIRS:
        pairs = random.Random(seed).sample(pairs, MAX_RANK_PAIRS)
    good = sum(1 for a, b in pairs if (pred[a] - pred[b]) * (y[a] - y[b]) > 0)
    return good / len(pairs)


def _baseline_error(train: Sequence[Example], hold: Sequence[Example], target: str) -> float | None:
    """Error of predicting each task type's mean: the floor a model must beat to be worth anything."""
    if target != "work_rate":
        return None
    _, _, norms = target_values(train, target)
    ex = [e for e, own in zip(hold, own_rates(hold)) if own and e.request.task_type in norms]
    if not ex:
        return None
    return float(np.mean([abs(norms[e.request.task_type] - math.log(e.work_rate)) for e in ex]))  # type: ignore[arg-type]


def _version_name(now: float, bundle_bytes: bytes) -> str:
    stamp = datetime.fromtimestamp(now, timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{KIND}-{stamp}-{hashlib.sha256(bundle_bytes).hexdigest()[:10]}"


def active_bundle(registry: ModelRegistry) -> tuple[str, ModelBundle] | None:
    """The active version and its loaded model, or None when no model is active."""
    try:
        row = registry.get_model_version(None, kind=KIND, with_artifact=True)
    except NotFound:
        return None
    if not row.get("artifact"):
        return None
    return str(row["version"]), ModelBundle.from_bytes(bytes(row["artifact"]))


def load_active(registry: ModelRegistry, *, min_task_records: int = 5) -> LearnedScorer | None:
    """The scorer the services layer should use now (None: keep the cold-start rule)."""
    found = active_bundle(registry)
    if found is None:
        return None
    version, bundle = found
    return LearnedScorer(bundle, name=version, min_task_records=min_task_records)


def train(store: ModelStore, *, target: str = "work_rate", since: float | None = None,
          min_records: int = MIN_RECORDS, holdout_fraction: float = HOLDOUT_FRACTION, tolerance: float = 0.0,
          params: dict[str, Any] | None = None, now: float | None = None, refit_all: bool = True,
          current: tuple[str, ModelBundle] | None = None) -> TrainResult:
    """Fit a candidate on the store's records, compare it with the active model on recent records, save, maybe promote.

    ``current``: the active (version, model) when the caller holds it already (saves reloading the artifact).
    """
    if target not in TARGETS:
        raise InvalidInput(f"target must be one of {', '.join(TARGETS)}", field="target")
    if not 0 < holdout_fraction < 1:
        raise InvalidInput("holdout_fraction must be between 0 and 1", field="holdout_fraction")
    now = time.time() if now is None else now
    examples = load_examples(store, since=since)
    labelled, _, _ = target_values(examples, target)
    figures: dict[str, Any] = {"records": len(examples), "labelled": len(labelled), "target": target,
                               "min_records": min_records, "hosts": hosts_of(labelled)}
    if len(labelled) < min_records:
        figures["reason"] = f"{len(labelled)} labelled records < {min_records}: the cold-start rule stays in charge"
        return TrainResult("insufficient-records", None, figures)
    if current is None:
        try:
            current = active_bundle(store)
        except Exception as exc:  # noqa: BLE001 - an artifact that cannot be read must not block its replacement
            log.warning("the active model cannot be loaded (%s): training as if there were none", exc)
            figures["active_unreadable"] = str(exc)[:200]
    # with an active model, hold back enough records to judge a candidate on: on a young host the newest fifth of a
    # few dozen is too few, and the first model, fitted on the fewest records, would stay until records doubled again
    older, recent = split_recent(labelled, holdout_fraction, at_least=HOLDOUT_MIN if current is not None else 1)
    if current is not None:
        # judge on records the active model has not seen, or the comparison favours it unfairly
        cutoff = current[1].trained_until
        recent = [e for e in recent if e.created_at > cutoff]
        fresh = {id(e) for e in recent}
        older = [e for e in labelled if id(e) not in fresh] if recent else older
        if len(recent) < HOLDOUT_MIN:
            figures["decision"] = "kept-current"
            figures["reason"] = (f"{len(recent)} recent record(s) newer than active model {current[0]} "
                                 f"(< {HOLDOUT_MIN}): nothing fresh to judge a candidate on")
            return TrainResult("kept-current", None, figures)
    candidate = fit(older, target=target, params=params)
    cand_scored = _scored(candidate, recent)  # (each model's held-out predictions are made once)
    cand = _figures(cand_scored)
    figures.update({"train_n": len(older), "holdout_n": len(recent), "candidate": cand,
                    "baseline_error": _baseline_error(older, recent, target)})
    if current is None:
        decision, why = "promoted", "no active model"
    else:
        cur_version, cur_bundle = current
        cur_scored = _scored(cur_bundle, recent) if cur_bundle.target == target else None
        cur = _figures(cur_scored) if cur_scored is not None else {"n": 0, "error": None}
        figures["current"] = {"version": cur_version, **cur}
        if cur_bundle.target != target:
            decision, why = "promoted", f"active model predicts {cur_bundle.target!r}, the operator asked for {target!r}"
        elif cur["error"] is None or cand["error"] is None:
            decision, why = ("promoted", "active model cannot be scored on recent records") if cand["error"] is not None \
                else ("kept-current", "candidate cannot be scored on recent records")
        elif cand["error"] <= cur["error"] * (1.0 + tolerance):
            decision, why = "promoted", f"held-out error {cand['error']:.4f} <= active {cur['error']:.4f}"
        else:
            gap = worse_by(cand_scored[3], cur_scored[3]) if cur_scored is not None else None
            said = f"held-out error {cand['error']:.4f} > active {cur['error']:.4f}"
            if gap is None:
                decision, why = "kept-current", said
            else:
                figures["worse_by"] = {"mean": gap[0], "se": gap[1]}
                by = f"higher by {gap[0]:.4f} +- {gap[1]:.4f} per record"
                decision, why = (("promoted", f"{said}: {by}, within the records' noise") if gap[0] <= NOISE_Z * gap[1]
                                 else ("kept-current", f"{said} ({by}, beyond the records' noise)"))
    figures["decision"] = decision
    figures["reason"] = why
    final = fit(labelled, target=target, params=params) if refit_all and decision == "promoted" else candidate
    figures["artifact_trained_on"] = final.trained_on
    blob = final.to_bytes()
    version = _version_name(now, blob)
    store.save_model_version(version, kind=KIND, artifact=blob, metrics=figures, params=final.params,
                             trained_on=final.trained_on, activate=decision == "promoted", created_at=now)
    log.info("model %s: %s (%s)", version, decision, why)
    return TrainResult(decision, version, figures, final)


def evaluate(store: ModelStore, version: str | None = None, *, since: float | None = None,
             holdout_fraction: float = HOLDOUT_FRACTION) -> dict[str, Any]:
    """Figures of a version (default: the active one) on the most recent records (or on all since ``since``)."""
    row = store.get_model_version(version, kind=KIND, with_artifact=True)
    bundle = ModelBundle.from_bytes(bytes(row["artifact"]))
    examples = load_examples(store, since=since)
    labelled, _, _ = target_values(examples, bundle.target)
    held = labelled if since is not None else split_recent(labelled, holdout_fraction)[1]
    return {"version": row["version"], "active": bool(row.get("active")), "target": bundle.target,
            **evaluate_bundle(bundle, held)}


def show(store: ModelRegistry, *, limit: int = 20) -> list[dict[str, Any]]:
    """Versions, newest first, with their figures and decision."""
    out = []
    for row in store.list_model_versions(kind=KIND, limit=limit):
        metrics = row.get("metrics") or {}
        out.append({"version": row["version"], "active": bool(row.get("active")), "created_at": row.get("created_at"),
                    "trained_on": row.get("trained_on"), "decision": metrics.get("decision"),
                    "reason": metrics.get("reason"), "error": (metrics.get("candidate") or {}).get("error"),
                    "rank_accuracy": (metrics.get("candidate") or {}).get("rank_accuracy"),
                    "hosts": metrics.get("hosts")})
    return out


def matrix(store: ModelRegistry, version: str | None = None) -> dict[str, Any]:
    """The learned throughput matrix of a version (default: the active one): each (task type, GPU model) pair's
    relative work rate, its uncertainty and the leases behind it (learn.matrix)."""
    row = store.get_model_version(version, kind=KIND, with_artifact=True)
    if not row.get("artifact"):
        raise NotFound(f"model version {row['version']} has no artifact", field="version")
    bundle = ModelBundle.from_bytes(bytes(row["artifact"]))
    return {"version": row["version"], "cells": [c.to_dict() for c in bundle.matrix.table()],
            "noise_sd": round(math.sqrt(bundle.matrix.s2), 4), "interaction_sd": round(math.sqrt(bundle.matrix.t2), 4)}


def rollback(store: ModelRegistry, version: str | None = None) -> dict[str, Any]:
    """Activate ``version``, or the version that was promoted before the active one."""
    rows = store.list_model_versions(kind=KIND, limit=1000)
    active = next((r for r in rows if r.get("active")), None)
    if version is None:
        if active is None:
            raise NotFound("no active model to roll back from", field="version")
        older = [r for r in rows if r["created_at"] < active["created_at"]
                 and (r.get("metrics") or {}).get("decision") == "promoted"]
        if not older:
            raise NotFound(f"no promoted model older than {active['version']}", field="version")
        version = str(older[0]["version"])  # newest first
    store.activate_model_version(version, kind=KIND)
    log.info("model rollback: %s -> %s", active["version"] if active else None, version)
    return {"active": version, "previous": active["version"] if active else None}
