"""The learned scorer: features, fitting, skops round trip, the flattened trees, and the lifecycle's decisions."""

from __future__ import annotations

import numpy as np
import pytest
import skops.io as sio

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.domain.placement import PlacementRequest, place
from hostagent.learn import lifecycle
from hostagent.learn.forest import CompiledForest
from hostagent.learn.model import LearnedScorer, ModelBundle, fit
from hostagent.learn.records import examples_from_records
from tests.support.placement import TRUTH, FakeStore, OnlyThese, dev, gpu_rows, store_records

DEVICES = [dev("g0", "X"), dev("g1", "Y"), dev("g2", "X"), dev("g3", "Y")]


def _bundle(n: int = 400, seed: int = 0) -> ModelBundle:
    return fit(examples_from_records(store_records(n, seed=seed), gpu_rows()))


def test_scorer_ranks_devices_as_the_records_say() -> None:
    scorer = LearnedScorer(_bundle())
    for job, best in (("a", "X"), ("b", "Y")):
        scores = scorer.score(PlacementRequest(task_type=job), DEVICES)
        ranked = [d.model for _, d in sorted(zip(scores, DEVICES), key=lambda p: -p[0])]
        assert ranked[:2] == [best, best]
        # relative speeds are learned, not just the order: X/Y is 10 for "a" in the truth
        ratio = scores[0] / scores[1]
        expected = TRUTH[(job, "X")] / TRUTH[(job, "Y")]
        assert abs(np.log(ratio) - np.log(expected)) < 0.3
    d = place(PlacementRequest(task_type="b"), DEVICES, scorer=scorer)
    assert d.rule == "model" and d.chosen[0] in ("g1", "g3")


def test_unseen_task_type_falls_back_to_cold_start() -> None:
    scorer = LearnedScorer(_bundle())
    assert not scorer.covers(PlacementRequest(task_type="never-seen"))
    assert place(PlacementRequest(task_type="never-seen"), DEVICES, scorer=scorer).rule == "cold-start"


def test_saved_model_loads_and_predicts_identically() -> None:
    bundle = _bundle()
    loaded = ModelBundle.from_bytes(bundle.to_bytes())
    rng = np.random.default_rng(1)
    for job in ("a", "b", "c", "unknown"):
        r = PlacementRequest(task_type=job, min_memory_gib=float(rng.uniform(0, 16)), duration_s=3600)
        assert LearnedScorer(loaded).score(r, DEVICES) == LearnedScorer(bundle).score(r, DEVICES)
    X = bundle.encoder.matrix(PlacementRequest(task_type="a"), DEVICES)
    assert np.array_equal(loaded.estimator.predict(X), bundle.estimator.predict(X))
    assert loaded.vocabulary == bundle.vocabulary and loaded.norms == bundle.norms


def test_artifact_with_untrusted_types_is_refused() -> None:
    from fractions import Fraction

    blob = sio.dumps({"format": 1, "estimator": Fraction(1, 3)})
    with pytest.raises(InvalidInput, match="untrusted"):
        ModelBundle.from_bytes(blob)
    with pytest.raises(InvalidInput, match="not a hostagent"):
        ModelBundle.from_bytes(sio.dumps({"format": 99}))


def test_flattened_trees_match_the_estimator_including_missing_values() -> None:
    bundle = _bundle()
    forest = bundle.forest
    assert forest is not None
    rng = np.random.default_rng(7)
    X = forest.probe_rows(bundle.estimator.n_features_in_, n=500, seed=3)
    X[rng.random(X.shape) < 0.3] = np.nan
    np.testing.assert_allclose(forest.predict(X), bundle.estimator.predict(X), rtol=1e-12, atol=1e-12)


def test_flattening_refuses_what_it_cannot_reproduce() -> None:
    class Odd:
        _preprocessor = object()
    assert CompiledForest.build(Odd()) is None


def test_training_reads_only_the_stores_records() -> None:
    store = FakeStore(store_records(300))
    spy = OnlyThese(store, {"training_records", "list_gpus", "get_model_version", "save_model_version"})
    res = lifecycle.train(spy, now=1.7e9)  # type: ignore[arg-type]
    assert res.decision == "promoted"
    assert set(spy.calls) <= {"training_records", "list_gpus", "get_model_version", "save_model_version"}
    assert "training_records" in spy.calls
    # the model learned what the records (and nothing else) say: empty records -> no model
    empty = lifecycle.train(FakeStore([]), now=1.7e9)  # type: ignore[arg-type]
    assert empty.decision == "insufficient-records" and empty.version is None


def test_lifecycle_promotes_only_a_model_at_least_as_good_and_rolls_back() -> None:
    store = FakeStore(store_records(300))
    first = lifecycle.train(store, now=1.7e9)  # type: ignore[arg-type]
    assert first.decision == "promoted" and first.metrics["candidate"]["rank_accuracy"] > 0.8  # job "c" ties: noise orders it
    scorer = lifecycle.load_active(store)  # type: ignore[arg-type]
    assert scorer is not None and scorer.name == first.version
    same = lifecycle.train(store, now=1.7e9 + 5)  # type: ignore[arg-type]
    assert same.decision == "kept-current" and same.version is None  # nothing newer than the active model
    store.records += store_records(100, seed=1, start=1.7e9)
    # a crippled candidate (one shallow tree) must lose against the active model on the fresh records
    worse = lifecycle.train(store, now=1.7e9 + 10, params={"max_iter": 1, "learning_rate": 0.01})  # type: ignore[arg-type]
    assert worse.decision == "kept-current"
    assert worse.metrics["candidate"]["error"] > worse.metrics["current"]["error"]
    assert store.get_model_version(None)["version"] == first.version
    better = lifecycle.train(store, now=1.7e9 + 20, tolerance=0.1)  # type: ignore[arg-type]  # equal up to noise
    assert better.decision == "promoted", better.metrics["reason"]
    shown = lifecycle.show(store)  # type: ignore[arg-type]
    assert [s["decision"] for s in shown] == ["promoted", "kept-current", "promoted"]
    back = lifecycle.rollback(store)  # type: ignore[arg-type]
    assert back == {"active": first.version, "previous": better.version}
    with pytest.raises(NotFound):
        lifecycle.rollback(store)  # nothing promoted before the first model
    figures = lifecycle.evaluate(store)  # type: ignore[arg-type]
    assert figures["version"] == first.version and figures["n"] > 0


def test_failed_leases_count_as_slow_and_bad_target_is_refused() -> None:
    recs = store_records(200)
    for r in recs:
        if r["devices"][0]["gpu_id"] == "g2":
            r["outcome"], r["usage"] = "failed", {"n": 0, "work_mean": None}
    bundle = fit(examples_from_records(recs, gpu_rows()))
    s = LearnedScorer(bundle).score(PlacementRequest(task_type="a"), [dev("g0", "X"), dev("g2", "X")])
    assert len(s) == 2
    with pytest.raises(InvalidInput):
        fit(examples_from_records(recs, gpu_rows()), target="happiness")
