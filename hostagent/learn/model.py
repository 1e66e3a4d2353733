"""The learned scorer: a HistGradientBoostingRegressor over (request, device) features, saved with skops.

Default target ("work_rate"): the log of the observed work rate minus the mean log work rate of the same task
type, so one model ranks devices for every task type on a common, unit-free scale; the scorer returns
``exp(prediction)``, i.e. the expected speed relative to a typical device for that task type. A failed lease that
reported no work counts as a tenth of typical speed (failure is an outcome, not a missing label). Other
targets: "utilization" (mean GPU utilisation, 0..1) and "completion" (1 unless the lease failed).

For the work rate the prediction is stacked: the throughput matrix (:mod:`hostagent.learn.matrix`, empirical Bayes
over task types and GPU models) gives each (task type, GPU model) pair's rate, and the trees are fitted to what it
leaves, the device's own figures (probe score, NUMA, memory headroom, link, errors) and the request's. Trees alone
must find every pair by splits on one-hot columns, which young models with a few hundred records do badly: on the
evaluation's traces their relative rates were 1.5-7x further off than the matrix's (docs/placement.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import skops.io as sio
from sklearn.ensemble import HistGradientBoostingRegressor

from hostagent.domain.assignment import RUN_HISTORY, expected_run_s, run_left_s
from hostagent.domain.errors import InvalidInput
from hostagent.domain.placement import DeviceView, PlacementRequest
from hostagent.learn.features import FeatureEncoder, fit_vocabulary
from hostagent.learn.forest import CompiledForest
from hostagent.learn.matrix import ThroughputMatrix
from hostagent.domain.terms import scaling_totals
from hostagent.learn.records import FAILED_OUTCOMES, Example, own_rates, tenant_weights

TARGETS = ("work_rate", "utilization", "completion")
FORMAT = 1
FAILED_RELATIVE_RATE = 0.1
DEFAULT_PARAMS: dict[str, Any] = {
    "max_iter": 100, "learning_rate": 0.15, "max_leaf_nodes": 31, "min_samples_leaf": 5, "l2_regularization": 0.0,
    "early_stopping": False, "random_state": 0,
}
# Only these may appear in a model artifact: skops refuses anything else instead of running it.
_TRUSTED_PREFIXES = ("sklearn.", "numpy.", "builtins.")
_TRUSTED_EXACT = ("functools.partial",)  # HistGradientBoosting keeps partial(check_array, ...); the target is checked too


def target_values(examples: Sequence[Example], target: str) -> tuple[list[Example], np.ndarray, dict[str, float]]:
    """The examples that have a label for ``target``, their labels and the per-task normalisers (log space). For
    the work rate, a lease on GPUs of several models reports the slowest one's rate: it labels none of them
    (`records.own_rates`), unless it failed."""
    if target not in TARGETS:
        raise InvalidInput(f"target must be one of {', '.join(TARGETS)}", field="target")
    if target == "utilization":
        kept = [e for e in examples if e.util_pct is not None]
        return kept, np.array([max(0.0, min(1.0, e.util_pct / 100.0)) for e in kept]), {}  # type: ignore[operator]
    if target == "completion":
        return list(examples), np.array([0.0 if e.outcome == "failed" else 1.0 for e in examples]), {}
    rated = own_rates(examples)  # (a mixed set's work rate is the slowest GPU model's: no pair's rate)
    logs: dict[str, list[float]] = {}
    for e, ok in zip(examples, rated):
        if ok:
            logs.setdefault(e.request.task_type, []).append(math.log(e.work_rate))  # type: ignore[arg-type]
    norms = {task: float(np.mean(v)) for task, v in logs.items()}
    kept, ys = [], []
    for e, ok in zip(examples, rated):
        task = e.request.task_type
        if task not in norms:
            continue
        if ok:
            kept.append(e)
            ys.append(math.log(e.work_rate) - norms[task])  # type: ignore[arg-type]
        elif e.outcome == "failed":
            kept.append(e)
            ys.append(math.log(FAILED_RELATIVE_RATE))
    return kept, np.array(ys), norms


@dataclass
class ModelBundle:
    """A trained estimator with everything needed to use it: vocabulary, target, normalisers, training figures."""

    estimator: HistGradientBoostingRegressor
    vocabulary: dict[str, list[str]]
    target: str = "work_rate"
    norms: dict[str, float] = field(default_factory=dict)  # task type -> mean log work rate
    task_counts: dict[str, int] = field(default_factory=dict)
    trained_on: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    trained_until: float = 0.0  # creation time of the newest record it was fitted on
    scaling: dict[str, dict[int, float]] = field(default_factory=dict)  # task -> GPUs -> median total work rate
    matrix: ThroughputMatrix = field(default_factory=ThroughputMatrix)  # (task, GPU model) rates (learn.matrix)
    run_s: dict[str, float] = field(default_factory=dict)  # task -> mean run time at rate 1 of its finished leases
    # task -> run times at rate 1 of its last finished leases (at most RUN_HISTORY, oldest first): the queue's
    # expected run times
    run_hist: dict[str, list[float]] = field(default_factory=dict)
    stacked: bool = False  # the trees predict what the matrix leaves (work rate; artifacts from before: False)
    residual_weight: float = 1.0  # how much of the trees' part a stacked model adds (0: the matrix alone; see fit)

    def __post_init__(self) -> None:
        self.encoder = FeatureEncoder(self.vocabulary)
        self.forest = CompiledForest.build(self.estimator)
        self._base: dict[tuple[str, str], float] = {}  # (task, GPU model) -> the matrix's log rate (0: no cell)

    def _stack(self, pairs: Iterable[tuple[str, str]], raw: np.ndarray) -> np.ndarray:
        """The trees' raw predictions for (task type, GPU model) pairs, on the matrix's rates when stacked."""
        if not self.stacked:
            return raw
        out: np.ndarray = self.residual_weight * raw + _bases(self.matrix, pairs, self._base)
        return out

    @property
    def walks_trees(self) -> bool:
        """Whether a prediction needs the trees: not for a stacked model whose trees did not earn their place (the
        matrix alone predicts: its pairs' rates are the whole answer, and neither rows nor trees are worked out)."""
        return not (self.stacked and self.residual_weight == 0.0)

    def _raw(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> np.ndarray:
        """The trees' raw predictions for the request on the devices (zeros where they are not used)."""
        if not self.walks_trees:
            return np.zeros(len(devices))
        return self._walk(self.encoder.matrix(request, devices))

    def _walk(self, X: np.ndarray) -> np.ndarray:
        """The trees' raw predictions for the rows of X (the flattened forest where it was checked, else sklearn)."""
        out: np.ndarray = self.forest.predict(X) if self.forest is not None else self.estimator.predict(X)
        return out

    def predict_relative(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> np.ndarray:
        """Scores for the devices (relative work rate, utilisation or completion), one batched call."""
        raw = self._raw(request, devices)
        if self.target != "work_rate":
            return raw
        task = request.task_type
        return np.exp(self._shared(task, devices, self._stack(((task, d.model) for d in devices), raw)))

    def _shared(self, task: str, devices: Sequence[DeviceView], raw: np.ndarray) -> np.ndarray:
        """Where a device's GPU model never ran the task type in the records (both seen, never together), the
        throughput matrix's estimate replaces the trees' extrapolation (log relative rate)."""
        pairs = self.matrix.pairs.get(task)
        if pairs is None:
            return raw
        out = raw
        for i, d in enumerate(devices):
            if d.model not in pairs and d.model in self.matrix.model_effect:
                cell = self.matrix.cell(task, d.model)
                if cell is not None:
                    out = out.copy() if out is raw else out
                    out[i] = math.log(cell.rate)
        return out

    def predict_rates(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> np.ndarray:
        """Each device's predicted work rate for the request's task type, in the guest's unit ("work_rate" target,
        a task type it was trained on)."""
        task = request.task_type
        raw = self._raw(request, devices)
        raw = self._shared(task, devices, self._stack(((task, d.model) for d in devices), raw))
        out: np.ndarray = np.exp(raw + self.norms[task])
        return out

    def predict_examples(self, examples: Sequence[Example]) -> np.ndarray:
        """Predictions in the target's natural unit (work rate in the guest's unit for "work_rate")."""
        if not examples:
            return np.empty(0)
        raw = (self._walk(self.encoder.rows((e.request, e.device) for e in examples)) if self.walks_trees
               else np.zeros(len(examples)))
        if self.target != "work_rate":
            return raw
        raw = self._stack(_pairs(examples), raw)
        fallback = float(np.mean(list(self.norms.values()))) if self.norms else 0.0
        offs = np.array([self.norms.get(e.request.task_type, fallback) for e in examples])
        out: np.ndarray = np.exp(raw + offs)
        return out

    def to_bytes(self) -> bytes:
        """Serialise with skops (no pickle)."""
        blob: bytes = sio.dumps({
            "format": FORMAT, "estimator": self.estimator, "vocabulary": self.vocabulary, "target": self.target,
            "norms": self.norms, "task_counts": self.task_counts, "trained_on": self.trained_on,
            "params": _jsonable(self.params), "trained_until": self.trained_until,
            "scaling": {task: {str(n): v for n, v in totals.items()} for task, totals in self.scaling.items()},
            "matrix": self.matrix.to_plain(), "run_s": self.run_s, "run_hist": self.run_hist, "stacked": self.stacked,
            "residual_weight": self.residual_weight,
        })
        return blob

    @classmethod
    def from_bytes(cls, data: bytes) -> ModelBundle:
        """Load a skops artifact, refusing any type outside scikit-learn/numpy/builtins."""
        untrusted = sio.get_untrusted_types(data=data)
        bad = [t for t in untrusted if not t.startswith(_TRUSTED_PREFIXES) and t not in _TRUSTED_EXACT]
        if bad:
            raise InvalidInput(f"model artifact holds untrusted types: {', '.join(bad[:5])}", field="artifact")
        d = sio.loads(data, trusted=untrusted)
        keys = {"format", "estimator", "vocabulary", "target", "norms", "task_counts", "trained_on", "params"}
        if not isinstance(d, dict) or d.get("format") != FORMAT or not keys <= set(d):
            raise InvalidInput("not a hostagent placement model artifact", field="artifact")
        return cls(estimator=d["estimator"], vocabulary=d["vocabulary"], target=d["target"], norms=d["norms"],
                   task_counts=d["task_counts"], trained_on=d["trained_on"], params=d["params"],
                   trained_until=float(d.get("trained_until", 0.0)),
                   scaling={str(task): {int(n): float(v) for n, v in totals.items()}
                            for task, totals in (d.get("scaling") or {}).items()},
                   matrix=ThroughputMatrix.from_plain(d.get("matrix")),
                   run_s={str(k): float(v) for k, v in (d.get("run_s") or {}).items()},
                   run_hist={str(k): [float(x) for x in v] for k, v in (d.get("run_hist") or {}).items()},
                   stacked=bool(d.get("stacked", False)), residual_weight=float(d.get("residual_weight", 1.0)))


def _jsonable(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if isinstance(v, (int, float, str, bool)) or v is None}


def fit(examples: Sequence[Example], *, target: str = "work_rate",
        params: dict[str, Any] | None = None) -> ModelBundle:
    """Train a bundle on examples; InvalidInput when none has a label for the target."""
    kept, y, norms = target_values(examples, target)
    if not kept:
        raise InvalidInput(f"no training record has a label for target {target!r}", field="target")
    vocab = fit_vocabulary((e.request for e in kept), (e.device for e in kept))
    encoder = FeatureEncoder(vocab)
    X = encoder.rows((e.request, e.device) for e in kept)
    # scikit-learn cannot bin a column with no value at all; a constant carries the same (no) information
    empty = np.isnan(X).all(axis=0)
    X[:, empty] = 0.0
    p = {**DEFAULT_PARAMS, **(params or {})}
    weights = np.array(tenant_weights([e.tenant for e in kept]))
    stacked = target == "work_rate"
    matrix = _matrix_of(kept, norms, weights) if stacked else ThroughputMatrix()
    weight = 1.0
    if stacked:  # the trees learn what the matrix's pair estimate leaves (see the module)
        weight = _residual_weight(kept, X, y, norms, weights, p)
        y = y - _bases(matrix, _pairs(kept))
    est = HistGradientBoostingRegressor(**p)
    est.fit(X, y, sample_weight=weights)
    counts: dict[str, int] = {}
    for e in kept:
        counts[e.request.task_type] = counts.get(e.request.task_type, 0) + 1
    return ModelBundle(est, vocab, target, norms, counts, len(kept), p, max(e.created_at for e in kept),
                       scaling=scaling_of(examples), matrix=matrix, run_s=run_times(examples, norms),
                       run_hist=run_history(examples, norms), stacked=stacked,
                       residual_weight=weight)


def _matrix_of(kept: Sequence[Example], norms: dict[str, float], weights: Sequence[float]) -> ThroughputMatrix:
    return ThroughputMatrix.fit((e.request.task_type, e.device.model, math.log(e.work_rate) - norms[e.request.task_type],
                                 float(w)) for e, w in zip(kept, weights) if e.work_rate is not None and e.work_rate > 0)


def _residual_weight(kept: Sequence[Example], X: np.ndarray, y: np.ndarray, norms: dict[str, float],
                     weights: np.ndarray, params: dict[str, Any]) -> float:
    """Whether the trees' part earns its place on top of the matrix: both fitted on the older 80 % of the records,
    judged on the newest 20 % (as the lifecycle judges a candidate). 1 when the trees lower the held-out error,
    else 0 (the matrix alone). With a few hundred records the trees mostly fit the noise left over by the pairs'
    means; with many, the devices' own figures (probe score, NUMA, memory headroom) carry real signal."""
    order = np.argsort([e.created_at for e in kept], kind="stable")
    cut = int(len(kept) * 0.8)
    if cut < 10 or len(kept) - cut < 5:
        return 0.0  # too few records to judge the trees: the matrix alone
    old, new = order[:cut], order[cut:]
    matrix = _matrix_of([kept[i] for i in old], norms, weights[old])
    resid = y - _bases(matrix, _pairs(kept))
    est = HistGradientBoostingRegressor(**params).fit(X[old], resid[old], sample_weight=weights[old])
    with_trees = float(np.average((resid[new] - est.predict(X[new])) ** 2, weights=weights[new]))
    without = float(np.average(resid[new] ** 2, weights=weights[new]))
    return 1.0 if with_trees < without else 0.0


def _bases(matrix: ThroughputMatrix, pairs: Iterable[tuple[str, str]],
           cache: dict[tuple[str, str], float] | None = None) -> np.ndarray:
    """`matrix_base` of each (task type, GPU model) pair, computed once per pair (and kept in `cache`, a bundle's,
    across calls)."""
    seen: dict[tuple[str, str], float] = {} if cache is None else cache
    out = []
    for key in pairs:
        got = seen.get(key)
        if got is None:
            got = seen[key] = matrix_base(matrix, *key)
        out.append(got)
    return np.array(out)


def _pairs(examples: Sequence[Example]) -> Iterable[tuple[str, str]]:
    return ((e.request.task_type, e.device.model) for e in examples)


def matrix_base(matrix: ThroughputMatrix, task: str, model: str) -> float:
    """The matrix's log relative rate of a (task type, GPU model) pair; 0 (a typical device) where the task type or
    the GPU model never reported work."""
    cell = matrix.cell(task, model)
    return math.log(cell.rate) if cell is not None and cell.rate > 0 else 0.0


def at_rate_one(e: Example, norms: dict[str, float]) -> float:
    """A finished lease's run time at rate 1, the rate the model's relative rates are relative to (its task type's
    typical work rate: the geometric mean of its records', `norms`): the time it was held times the work rate it
    reported over that typical rate. A lease that ran on a GPU twice as fast as typical took half as long as a typical
    one would. Where no work rate was reported (or the task type has no typical rate), the time held."""
    norm = norms.get(e.request.task_type)
    if norm is None or e.work_rate is None or not e.work_rate > 0:
        return e.held_s
    return e.held_s * math.exp(math.log(e.work_rate) - norm)


def run_times(examples: Sequence[Example], norms: dict[str, float] | None = None, *,
              at_least: int = 3) -> dict[str, float]:
    """Each task type's mean run time at rate 1 (:func:`at_rate_one`) over its finished leases (held, released, not
    failed), where at least `at_least` ran: what the queue expects of a request of that type that does not state its
    `duration_s`. The mean, not the median: what waiting for a better GPU gains is linear in the run time, and run
    times are heavy-tailed (the median would expect every request to be short; bundles trained before 2026-11-29
    hold the median, before 2026-11-30 the time held)."""
    held: dict[str, dict[tuple[str, str], float]] = {}
    for e in examples:
        if e.held_s > 0 and e.outcome not in FAILED_OUTCOMES:
            held.setdefault(e.request.task_type, {})[e.lease_key] = at_rate_one(e, norms or {})
    return {task: float(np.mean(list(v.values()))) for task, v in held.items() if len(v) >= at_least}


def run_history(examples: Sequence[Example], norms: dict[str, float] | None = None, *, at_least: int = 3,
                keep: int = RUN_HISTORY) -> dict[str, list[float]]:
    """Each task type's run times at rate 1 (:func:`at_rate_one`) of its last `keep` finished leases (held, released,
    not failed; in the order they ended), where at least `at_least` ran: the queue's expected run time of a request
    that does not state its `duration_s` is their mean, its running leases of the type counted as lasting what they
    have run plus what the finished that outlasted them went on for (`domain.assignment.expected_run_s`, as the
    simulator's; bundles trained before 2026-11-30 hold the times held)."""
    ended: dict[str, dict[tuple[str, str], tuple[float, float]]] = {}
    for e in examples:
        if e.held_s > 0 and e.outcome not in FAILED_OUTCOMES:
            ended.setdefault(e.request.task_type, {})[e.lease_key] = (e.created_at + e.held_s,
                                                                       at_rate_one(e, norms or {}))
    return {task: [run for _, run in sorted(v.values())[-keep:]] for task, v in ended.items() if len(v) >= at_least}


def scaling_of(examples: Sequence[Example]) -> dict[str, dict[int, float]]:
    """What the records say of each task type's total work rate by GPU count (domain.terms.scaling_totals), from
    the finished leases that reported work (one entry per lease: its examples share the per-GPU mean)."""
    leases = {e.lease_key: (e.request.task_type, e.request.count, e.work_rate) for e in examples
              if e.work_rate is not None and e.work_rate > 0 and e.outcome not in FAILED_OUTCOMES}
    return scaling_totals(list(leases.values()))


class LearnedScorer:
    """The `Scorer` the services layer calls once a model is active."""

    def __init__(self, bundle: ModelBundle, *, name: str = "model", min_task_records: int = 5) -> None:
        self.bundle = bundle
        self.name = name
        self.min_task_records = min_task_records
        self._sd: dict[tuple[str, str], float] = {}  # (task type, GPU model) -> uncertainty (the model is immutable)

    def covers(self, request: PlacementRequest) -> bool:
        """Trust the model only for task types it has seen enough of; the cold-start rule handles the rest."""
        return self.bundle.task_counts.get(request.task_type, 0) >= self.min_task_records

    def unseen(self, devices: Sequence[DeviceView]) -> list[bool]:
        """Which devices are of a GPU model this model has no records of (placement prices them from their probes'
        figures: domain.placement.capability_prior); none for a target other than the work rate."""
        known = set(self.bundle.vocabulary.get("model", ()))
        return [self.bundle.target == "work_rate" and d.model not in known for d in devices]

    def uncertainty(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        """Each device's log-space standard deviation of its predicted rate for the request: the throughput matrix's
        for the (task type, GPU model) pair (learn.matrix; small where the pair has records, the interactions'
        spread where it has none); 0 without a matrix (trees alone, or a target other than the work rate). The
        queue tells requests' efficiencies apart by it (domain.assignment)."""
        if self.bundle.target != "work_rate":
            return [0.0] * len(devices)
        out = []
        for d in devices:
            key = (request.task_type, d.model)
            sd = self._sd.get(key)
            if sd is None:
                sd = self._sd[key] = self.bundle.matrix.sd(*key)
            out.append(sd)
        return out

    def typical_run_s(self, task_type: str, running: Sequence[float] = ()) -> float | None:
        """The task type's expected run time at rate 1 (None: fewer than 3 finished leases of it in the records): the
        mean of its last finished leases' run times at rate 1 (:func:`at_rate_one`) and of those running (`running`:
        how much of that each has run so far), each running one counted as lasting what it has run plus what it is
        expected to go on (`domain.assignment.expected_run_s`). A bundle trained before 2026-11-30 keeps no history:
        its mean."""
        hist = self.bundle.run_hist.get(task_type)
        if not hist:
            return self.bundle.run_s.get(task_type)
        return expected_run_s(hist, running)

    def left_run_s(self, task_type: str, done: float) -> float | None:
        """How much more a lease of the task type that has done `done` of its run (at rate 1) is expected to run, at
        rate 1, by the records (`domain.assignment.run_left_s`: the mean excess over `done` of its last finished
        leases that lasted longer, as long again once it has outlived them all; None: no history of the type, or a
        bundle from before 2026-11-30). The queue divides it by the lease's rate (lease_queue.running_rate)."""
        return run_left_s(self.bundle.run_hist.get(task_type) or (), done)

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        """Predicted relative work rate per device (one batched predict call)."""
        if not devices:
            return []
        scores: list[float] = self.bundle.predict_relative(request, devices).tolist()
        return scores

