"""The learned scorer: features, fitting, skops round trip, the flattened trees, and the lifecycle's decisions."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import numpy as np
import pytest
import skops.io as sio
from hypothesis import given, settings
from hypothesis import strategies as st

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.domain.placement import PlacementRequest, place
from hostagent.learn import lifecycle
from hostagent.learn.forest import CompiledForest
from hostagent.learn.model import (
    LearnedScorer,
    ModelBundle,
    at_rate_one,
    fit,
    matrix_base,
    run_history,
    target_values,
)
from hostagent.learn.records import examples_from_records, tenant_weights
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


@pytest.mark.parametrize("rows", [1, 2, 3, 40, 500])  # few walks (none set aside) to many (set aside as they end)
@pytest.mark.parametrize("missing", [0.0, 0.3])  # no NaN in X (its route skipped) or many
def test_flattened_trees_match_the_estimator_including_missing_values(rows: int, missing: float) -> None:
    bundle = _bundle()
    forest = bundle.forest
    assert forest is not None
    rng = np.random.default_rng(7)
    X = forest.probe_rows(bundle.estimator.n_features_in_, n=rows, seed=3)
    X = np.where(np.isnan(X), 0.5, X) if not missing else np.where(rng.random(X.shape) < missing, np.nan, X)
    np.testing.assert_allclose(forest.predict(X), bundle.estimator.predict(X), rtol=1e-12, atol=1e-12)
    assert forest.predict(X[:0]).shape == (0,)


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
    # a misleading stretch of records ("a" ten times as fast on Y as on X), then honest ones: the candidate, fitted
    # on the older records, lies included, must lose against the active model on the fresh honest ones, beyond the
    # records' noise
    lies = store_records(100, seed=2, start=1.7e9, truth={**TRUTH, ("a", "X"): 10.0, ("a", "Y"): 100.0})
    store.records += lies + store_records(100, seed=1, start=1.7e9 + 1e4)
    worse = lifecycle.train(store, now=1.71e9)  # type: ignore[arg-type]
    assert worse.decision == "kept-current", worse.metrics["reason"]
    gap = worse.metrics["worse_by"]
    assert gap["mean"] > lifecycle.NOISE_Z * gap["se"] > 0 and "beyond the records' noise" in worse.metrics["reason"]
    assert worse.metrics["candidate"]["error"] > worse.metrics["current"]["error"]
    assert store.get_model_version(None)["version"] == first.version
    store.records = [r for r in store.records if r not in lies]
    better = lifecycle.train(store, now=1.71e9 + 20, tolerance=0.1)  # type: ignore[arg-type]  # equal up to noise
    assert better.decision == "promoted", better.metrics["reason"]
    shown = lifecycle.show(store)  # type: ignore[arg-type]
    assert [s["decision"] for s in shown] == ["promoted", "kept-current", "promoted"]
    back = lifecycle.rollback(store)  # type: ignore[arg-type]
    assert back == {"active": first.version, "previous": better.version}
    with pytest.raises(NotFound):
        lifecycle.rollback(store)  # nothing promoted before the first model
    figures = lifecycle.evaluate(store)  # type: ignore[arg-type]
    assert figures["version"] == first.version and figures["n"] > 0


@pytest.mark.parametrize("z, decision", [(lifecycle.NOISE_Z, "promoted"), (0.0, "kept-current")])
def test_a_candidate_worse_only_by_the_records_noise_replaces_the_active_model(
        monkeypatch: pytest.MonkeyPatch, z: float, decision: str) -> None:
    # the same truth throughout: the candidate, fitted on every record the active model saw and 80 more, is higher
    # on the fresh records by less than the paired difference's standard error. Near the reported rates' own noise a
    # strict comparison would keep the model fitted on fewer records half the time (with z 0, here)
    store = FakeStore(store_records(300))
    first = lifecycle.train(store, now=1.7e9)  # type: ignore[arg-type]
    store.records += store_records(100, seed=1, start=1.7e9)
    monkeypatch.setattr(lifecycle, "NOISE_Z", z)
    again = lifecycle.train(store, now=1.7e9 + 10)  # type: ignore[arg-type]
    m = again.metrics
    assert m["candidate"]["error"] > m["current"]["error"] and 0 < m["worse_by"]["mean"] < m["worse_by"]["se"]
    assert m["worse_by"]["mean"] == pytest.approx(m["candidate"]["error"] - m["current"]["error"])
    assert again.decision == decision, m["reason"]
    active = store.get_model_version(None)["version"]
    assert active == (again.version if decision == "promoted" else first.version)
    if decision == "promoted":
        assert "within the records' noise" in m["reason"]


def test_a_young_hosts_second_model_is_judged_on_enough_fresh_records() -> None:
    # the agent's first model comes at placement.min_records (30). At 62 records, 32 of them newer than it, the
    # newest fifth (12) was too few to judge a candidate on (HOLDOUT_MIN 20): the model fitted on 30 records stayed
    # until the records doubled again. The lifecycle now holds back the 20 newest, all fresh
    store = FakeStore(store_records(30))
    first = lifecycle.train(store, now=1.7e9, min_records=30)  # type: ignore[arg-type]
    assert first.decision == "promoted" and first.metrics["holdout_n"] == 6  # no model to judge: the newest fifth
    store.records += store_records(32, seed=1, start=1.7e9)
    again = lifecycle.train(store, now=1.7e9 + 10, min_records=30)  # type: ignore[arg-type]
    m = again.metrics
    assert m["holdout_n"] == lifecycle.HOLDOUT_MIN and m["train_n"] == 62 - lifecycle.HOLDOUT_MIN, m["reason"]
    assert m["current"]["n"] == lifecycle.HOLDOUT_MIN and "nothing fresh" not in m["reason"]
    assert again.decision == "promoted" and store.get_model_version(None)["version"] == again.version
    # never more than half held back: of 30 + 8, the 19 newest hold only the 8 the first model has not seen, too few
    # to judge on, and the first model stays
    store = FakeStore(store_records(30))
    lifecycle.train(store, now=1.7e9, min_records=30)  # type: ignore[arg-type]
    store.records += store_records(8, seed=1, start=1.7e9)
    few = lifecycle.train(store, now=1.7e9 + 10, min_records=30)  # type: ignore[arg-type]
    assert few.decision == "kept-current" and "nothing fresh" in few.metrics["reason"]
    assert few.metrics["reason"].startswith("8 recent record(s)")


def test_split_recent_holds_back_a_fraction_or_at_least_a_number_but_never_more_than_half() -> None:
    examples = examples_from_records(store_records(50), gpu_rows())
    leases = {e.lease_key for e in examples}
    assert len(leases) == 50
    for fraction, at_least, held in ((0.2, 1, 10), (0.2, 20, 20), (0.2, 40, 25), (0.9, 1, 25), (0.01, 1, 1)):
        older, recent = lifecycle.split_recent(examples, fraction, at_least=at_least)
        assert len({e.lease_key for e in recent}) == held, (fraction, at_least)
        assert max(e.created_at for e in older) <= min(e.created_at for e in recent)
        assert len(older) + len(recent) == len(examples)


def test_failed_leases_count_as_slow_and_bad_target_is_refused() -> None:
    recs = store_records(200)
    for r in recs:
        if r["devices"][0]["gpu_id"] == "g2":
            r["outcome"], r["usage"] = "failed", {"n": 0, "work_mean": None}
    bundle = fit(examples_from_records(recs, gpu_rows()))
    s = LearnedScorer(bundle).score(PlacementRequest(task_type="a"), [dev("g0", "X"), dev("g2", "X")])
    assert len(s) == 2
    # the failures are the device's, not its model's: the matrix (work rates only) keeps X fast for job "a", and
    # the trees, which earn their place on the held-out failures, mark the device whose recent leases failed
    assert bundle.stacked and bundle.residual_weight == 1.0
    fast, failing = LearnedScorer(bundle).score(PlacementRequest(task_type="a"),
                                                [dev("g0", "X"), dev("g2", "X", recent_errors=3)])
    assert failing < 0.2 * fast and fast > 2.0
    with pytest.raises(InvalidInput):
        fit(examples_from_records(recs, gpu_rows()), target="happiness")


def _tenant_records(n: int, tenant: str, seed: int, **kw: Any) -> list[dict[str, Any]]:
    return [dict(r, id=f"{tenant}-{r['id']}", domain_uuid=tenant) for r in store_records(n, seed=seed, **kw)]


def _ranks_x_first_for_a(records: list[dict[str, Any]]) -> bool:
    scorer = LearnedScorer(fit(examples_from_records(records, gpu_rows())))
    scores = scorer.score(PlacementRequest(task_type="a"), DEVICES)
    return max(s for s, d in zip(scores, DEVICES) if d.model == "X") > max(
        s for s, d in zip(scores, DEVICES) if d.model == "Y")


def test_one_tenant_flooding_plausible_lies_cannot_make_the_model_its_own() -> None:
    """Four honest tenants say job "a" runs 10x faster on X; one tenant leases all day and says Y is 5x faster
    than X (a plausible figure). With its weight bounded the model still ranks X first; the same records spread
    over as many tenants as records (no bound binds) would flip it, so the bound is what holds."""
    honest = [r for i in range(4) for r in _tenant_records(60, f"vm-{i}", seed=i)]
    lies = {("a", "X"): 100.0, ("a", "Y"): 500.0, ("b", "X"): 5.0, ("b", "Y"): 50.0, ("c", "X"): 20.0,
            ("c", "Y"): 20.0}
    flood = _tenant_records(2000, "liar", seed=99, truth=lies)
    assert _ranks_x_first_for_a(honest + flood)
    churned = [dict(r, domain_uuid=f"liar-{i}") for i, r in enumerate(flood)]
    assert not _ranks_x_first_for_a(honest + churned)


def test_implausible_work_rates_are_not_learnt_from() -> None:
    honest = [r for i in range(2) for r in _tenant_records(100, f"vm-{i}", seed=i)]
    absurd = {k: v * 1e6 if k[1] == "Y" else v for k, v in TRUTH.items()}
    liar = _tenant_records(30, "liar", seed=7, truth=absurd)
    examples = examples_from_records(honest + liar, gpu_rows())
    dropped = [e for e in examples if e.tenant == "liar" and e.work_rate is None]
    assert dropped and all(e.device.model == "Y" for e in dropped)
    assert all(e.work_rate is not None for e in examples if e.tenant != "liar")
    assert _ranks_x_first_for_a(honest + liar)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=8), st.sampled_from([0.1, 0.25, 0.5]))
def test_no_tenant_carries_more_than_its_share_of_the_weight(counts: list[int], share: float) -> None:
    tenants = [f"t{i}" for i, c in enumerate(counts) for _ in range(c)]
    weights = tenant_weights(tenants, share)
    total: dict[str, float] = {}
    for t, w in zip(tenants, weights):
        total[t] = total.get(t, 0.0) + w
    bound = max(share, 1 / len(counts))
    assert max(total.values()) <= bound * sum(total.values()) + 1e-9
    assert all(0 < w <= 1 for w in weights)
    if min(weights) < 1 and len(counts) * share > 1:  # whatever is capped is capped no more than needed
        assert abs(max(total.values()) - bound * sum(total.values())) < 1e-6


def test_a_gpu_model_without_records_is_scored_from_its_probes_against_the_known_ones() -> None:
    """The capability vector is the learned scorer's prior for a GPU model it has no records of (#29): the median
    over known devices of their predicted score scaled by the figures' ratio; known devices keep their scores."""
    import statistics

    from hostagent.domain.placement import score_devices

    scorer = LearnedScorer(_bundle())
    x, y = dev("g0", "X", figures={"tflops_fp16": 100.0}), dev("g1", "Y", figures={"tflops_fp16": 40.0})
    z = dev("g9", "Z", figures={"tflops_fp16": 300.0})
    r = PlacementRequest(task_type="b")
    plain = scorer.score(r, [x, y, z])
    assert scorer.unseen([x, y, z]) == [False, False, True]
    scored = score_devices(r, [x, y, z], scorer)
    assert scored.scores[:2] == tuple(plain[:2])
    assert scored.scores[2] == pytest.approx(statistics.median([plain[0] * 3.0, plain[1] * 7.5]))
    assert scored.ranked(1)[0][0] == "g9" and scored.scores[2] != pytest.approx(plain[2])
    assert "GPU models without records (Z) scored from their fp16 speed" in scored.reason, scored.reason
    # the request's precision picks the figure; a device not measured, or nothing known measured, keeps its score
    fp64 = score_devices(PlacementRequest(task_type="b", precision="fp64"),
                         [dev("g0", "X", figures={"tflops_fp64": 10.0}), dev("g9", "Z", figures={"tflops_fp64": 5.0})],
                         scorer)
    assert "scored from their fp64 speed" in fp64.reason
    for devices in ([x, y, dev("g9", "Z")], [dev("g0", "X"), z]):
        s = score_devices(r, devices, scorer)
        assert s.scores == tuple(scorer.score(r, devices)) and "without records" not in s.reason


def test_a_broken_active_artifact_does_not_block_its_replacement() -> None:
    store = FakeStore(store_records(300))
    store.save_model_version("placement-broken", artifact=b"not a model", activate=True, created_at=1.6e9)
    res = lifecycle.train(store, now=1.7e9)  # type: ignore[arg-type]
    assert res.decision == "promoted" and res.version is not None
    assert "active_unreadable" in res.metrics
    assert lifecycle.active_bundle(store) is not None  # type: ignore[arg-type]


def test_the_model_keeps_each_task_types_mean_run_time() -> None:
    recs = store_records(60)
    for i, r in enumerate(recs):
        r["held_s"] = 100.0 * 1.1 ** i  # a skewed spread of lengths: the mean is well above the median
        r["usage"]["work_mean"] = 10.0  # each at its task type's typical rate: its run time at rate 1 is its time held
    recs[0]["outcome"] = "failed"  # a failed lease says nothing of how long the work takes
    bundle = fit(examples_from_records(recs, gpu_rows()))
    for task in ("a", "b", "c"):
        held = sorted(r["held_s"] for r in recs if r["task_type"] == task and r["outcome"] != "failed")
        assert bundle.run_s[task] == pytest.approx(statistics.fmean(held))
        assert bundle.run_s[task] > statistics.median(held) * 1.2
    assert LearnedScorer(bundle).typical_run_s("a") == bundle.run_s["a"] and LearnedScorer(bundle).typical_run_s("z") is None
    assert ModelBundle.from_bytes(bundle.to_bytes()).run_s == bundle.run_s


def test_the_model_expects_a_run_time_from_its_last_leases_and_those_still_running() -> None:
    # 60 finished "a" leases of 100 s and 10 of 1000 s (the last to end), one failed: the model keeps the last 50
    # (RUN_HISTORY) in the order they ended, the failed one left out; with none running it expects their mean. A
    # lease of the type that has run 500 s so far counts as lasting 500 s plus what the 1000 s ones went on for
    # beyond that (500 s): 1000 s; one that has outlived them all (3000 s) as as long again
    recs = store_records(70)
    for i, r in enumerate(recs):
        r["task_type"], r["held_s"] = "a", 100.0 if i < 60 else 1000.0
        r["usage"]["work_mean"] = 10.0  # at the typical rate: run times at rate 1 are the times held
    recs[0]["outcome"] = "failed"
    bundle = fit(examples_from_records(recs, gpu_rows()))
    assert bundle.run_hist["a"] == pytest.approx([100.0] * 40 + [1000.0] * 10)
    assert bundle.run_s["a"] == pytest.approx((59 * 100 + 10 * 1000) / 69)  # the mean over every lease, as before
    scorer = LearnedScorer(bundle)
    assert scorer.typical_run_s("a") == pytest.approx(14000 / 50)
    assert scorer.typical_run_s("a", [500.0]) == pytest.approx((14000 + 1000) / 51)
    assert scorer.typical_run_s("a", [500.0, 3000.0]) == pytest.approx((14000 + 1000 + 6000) / 52)
    assert scorer.typical_run_s("z", [500.0]) is None
    # how much longer a running lease goes on (the queue dates a GPU held by a lease that stated no length by it):
    # one that has run 50 s, the mean excess of all 50 (230 s); 500 s, of the 1000 s ones (500 s); one that has
    # outlived them all, as long again; none of a type without a history
    assert scorer.left_run_s("a", 50.0) == pytest.approx((40 * 50 + 10 * 950) / 50)
    assert scorer.left_run_s("a", 500.0) == pytest.approx(500.0) and scorer.left_run_s("a", 3000.0) == 3000.0
    assert scorer.left_run_s("z", 50.0) is None
    back = ModelBundle.from_bytes(bundle.to_bytes())
    assert back.run_hist == bundle.run_hist
    # a task type with 3 finished leases has a history, one with 2 has none; a lease held 0 s is left out; the
    # history is in the order the leases ended (the first created, held 500 s, ended last), the last kept
    few = store_records(6)
    for i, r in enumerate(few):
        r["task_type"], r["held_s"] = ("b" if i < 3 else "c"), 50.0 + i
        r["usage"]["work_mean"] = 10.0
    few[0]["held_s"], few[5]["held_s"] = 500.0, 0.0
    assert run_history(examples_from_records(few, gpu_rows())) == {"b": [51.0, 52.0, 500.0]}
    assert run_history(examples_from_records(few, gpu_rows()), keep=2) == {"b": [52.0, 500.0]}
    # a bundle trained before it kept the history: its mean, the running not counted
    bundle.run_hist = {}
    assert LearnedScorer(bundle).typical_run_s("a", [500.0]) == bundle.run_s["a"]
    assert LearnedScorer(bundle).left_run_s("a", 500.0) is None  # (its GPUs are dated by their leases' expiry)


def test_run_times_are_at_the_task_types_typical_rate_not_the_time_held() -> None:
    # the same work (1000 units) done by every "a" lease: on X at 20/s in 50 s, on Y at 5/s in 200 s. The model's
    # relative rates are relative to the task type's typical rate (the geometric mean of its records': 10/s), so
    # each lease ran 100 s at rate 1, whichever GPU it had: the queue expects 100 s at rate 1 (200 s on a GPU at
    # half the typical rate, 50 s at twice it), not the 125 s the times held average to
    recs = store_records(41)
    for i, r in enumerate(recs):
        fast = i % 2 == 0
        r["task_type"], r["held_s"] = "a", 50.0 if fast else 200.0
        r["devices"][0].update(gpu_id="g0" if fast else "g1", model="X" if fast else "Y")
        r["usage"]["work_mean"] = 20.0 if fast else 5.0
    recs[-1]["usage"]["work_mean"], recs[-1]["held_s"] = None, 300.0  # no work rate reported: its time held
    examples = examples_from_records(recs, gpu_rows())
    bundle = fit(examples)
    assert bundle.norms["a"] == pytest.approx(math.log(10.0))
    assert bundle.run_hist["a"] == pytest.approx([100.0] * 40 + [300.0])
    assert bundle.run_s["a"] == pytest.approx((40 * 100 + 300) / 41)
    assert at_rate_one(examples[0], bundle.norms) == pytest.approx(100.0)
    assert at_rate_one(examples[0], {}) == 50.0  # a task type with no typical rate: the time held
    # in any unit: a work rate of 0.5/s where 0.25/s is typical is twice the typical rate; a rate of 0 says nothing
    slow_unit = {"a": math.log(0.25)}
    assert at_rate_one(dataclasses.replace(examples[0], work_rate=0.5), slow_unit) == pytest.approx(100.0)
    assert at_rate_one(dataclasses.replace(examples[0], work_rate=0.0), slow_unit) == 50.0
    # one that has done 50 s at rate 1 (100 s on a GPU at half the typical rate): the mean excess of all 41
    assert LearnedScorer(bundle).left_run_s("a", 50.0) == pytest.approx((40 * 50 + 250) / 41)
    assert sorted(run_history(examples)["a"]) == [50.0] * 20 + [200.0] * 20 + [300.0]  # (without the norms: held)


def _paced_by_the_slowest(recs: list[dict[str, Any]], n: int, devices: list[tuple[str, str]]) -> None:
    """Append `n` finished two-GPU leases of task "a" on `devices`: each device reports the set's pace, the slowest
    model's rate (one step waits for both)."""
    slowest = min(TRUTH[("a", m)] for _, m in devices)
    for i in range(n):
        t = recs[-1]["created_at"] + 60.0
        recs.append({**recs[0], "id": f"M{len(recs)}", "task_type": "a", "request": {"task_type": "a", "gpus": 2},
                     "created_at": t, "granted_at": t, "ended_at": t + 30.0,
                     "devices": [{"gpu_id": g, "model": m, "memory_bytes": recs[0]["devices"][0]["memory_bytes"],
                                  "numa_node": 0} for g, m in devices],
                     "usage": {"n": 3, "work_mean": slowest * (1.0 + 0.01 * (i % 3)), "util_mean": 90.0}})


def test_a_set_of_mixed_gpu_models_teaches_no_pairs_rate() -> None:
    # "a" runs ten times as fast on X as on Y. Two-GPU leases on an X and a Y run at Y's pace and report it for both
    # devices: read as the X's rate, sixty of them would pull X towards Y's. They label neither, nor count in the
    # held-out figures; a set of one model (two X) is its own rate and is learnt from
    recs = store_records(120, seed=5)
    _paced_by_the_slowest(recs, 60, [("g0", "X"), ("g1", "Y")])
    _paced_by_the_slowest(recs, 10, [("g0", "X"), ("g2", "X")])
    examples = examples_from_records(recs, gpu_rows())
    scorer = LearnedScorer(fit(examples))
    got = scorer.score(PlacementRequest(task_type="a"), [dev("g0", "X"), dev("g1", "Y")])
    assert math.log(got[0] / got[1]) == pytest.approx(math.log(10.0), abs=0.1)
    labelled, _, _ = target_values(examples, "work_rate")
    sets = [e for e in labelled if e.lease_id.startswith("M")]
    assert {e.lease_id for e in sets} == {f"M{i}" for i in range(180, 190)}  # the ten sets of two X
    assert len(sets) == 20 and {e.device.model for e in sets} == {"X"}  # both devices of each
    figures = lifecycle.evaluate_bundle(scorer.bundle, examples)
    assert figures["n"] == len(examples) - 120
    # the mixed sets still count for the task type's run time (they did the work at that pace)
    assert len(fit(examples).run_hist["a"]) == 50  # the last 50 of task type "a": the sets of two


def _young_bundle(n: int, seed: int, slow: float | None = None) -> ModelBundle:
    """`n` records; with `slow`, the X device g2 has that probe score and runs at that fraction of the others."""
    recs = store_records(n, seed=seed)
    gpus = gpu_rows()
    if slow is not None:
        for r in recs:
            if r["devices"][0]["gpu_id"] == "g2":
                r["usage"] = dict(r["usage"], work_mean=r["usage"]["work_mean"] * slow)
        gpus = [dict(g, probe_score=slow) if g["gpu_id"] == "g2" else g for g in gpus]
    return fit(examples_from_records(recs, gpus))


@pytest.mark.parametrize("n", [40, 60, 100])
def test_a_young_model_already_knows_each_pairs_rate(n: int) -> None:
    """A few dozen records: the matrix's pair means carry the prediction (trees alone must find every pair by splits
    and were 1.5-7x further off on the evaluation's traces); both task types' tenfold differences are there."""
    bundle = _young_bundle(n, seed=3)
    assert bundle.stacked
    scorer = LearnedScorer(bundle)
    for job in ("a", "b", "c"):
        got = scorer.score(PlacementRequest(task_type=job), [dev("g0", "X"), dev("g1", "Y")])
        assert abs(np.log(got[0] / got[1]) - np.log(TRUTH[(job, "X")] / TRUTH[(job, "Y")])) < 0.1


def test_the_trees_are_kept_only_where_they_lower_the_held_out_error() -> None:
    # pure noise around the pairs' rates: the trees would fit the noise, so the matrix alone predicts
    assert _young_bundle(400, seed=0).residual_weight == 0.0
    # one X device runs at half speed and its probes say so: only the trees can see a device's own figures
    bundle = _young_bundle(400, seed=0, slow=0.5)
    assert bundle.residual_weight == 1.0
    views = [dev("g0", "X", probe_score=1.0), dev("g2", "X", probe_score=0.5)]
    got = LearnedScorer(bundle).score(PlacementRequest(task_type="a"), views)
    assert got[1] / got[0] == pytest.approx(0.5, rel=0.15)


class _Counting:
    """Stands in for the flattened trees and the feature encoder: counts the walks and the rows asked for."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.real, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return fn(*args, **kwargs)
        return counted


@pytest.mark.parametrize("slow", [None, 0.5])
def test_trees_that_did_not_earn_their_place_are_not_walked(slow: float | None) -> None:
    # the matrix alone predicts (residual weight 0): the same figures as 0 x the trees' part, without encoding a
    # row or walking a tree (a decision's placer call and the queue's predictions cost a fraction); kept trees are
    bundle = _young_bundle(400, seed=0, slow=slow)
    r, views = PlacementRequest(task_type="a"), [dev("g0", "X", probe_score=1.0), dev("g2", "X", probe_score=0.5),
                                                 dev("g1", "Y")]
    X = bundle.encoder.matrix(r, views)
    expected = np.exp(bundle._shared("a", views, bundle.residual_weight * bundle._walk(X)
                                     + np.array([matrix_base(bundle.matrix, "a", v.model) for v in views])))
    examples = examples_from_records(store_records(20, seed=5), gpu_rows())
    expected_ex = bundle.predict_examples(examples)
    bundle.forest, bundle.encoder = _Counting(bundle.forest), _Counting(bundle.encoder)
    got = bundle.predict_relative(r, views)
    assert np.array_equal(got, expected) and np.array_equal(bundle.predict_examples(examples), expected_ex)
    rates = bundle.predict_rates(r, views)
    assert np.allclose(rates / rates[0], got / got[0])
    walked = slow is not None
    assert bundle.walks_trees is walked and bundle.residual_weight == float(walked)
    assert (bundle.forest.calls, bundle.encoder.calls) == ((3, 3) if walked else (0, 0))


def test_without_the_flattened_trees_the_estimator_predicts_the_same() -> None:
    # a forest that fails its check at load is dropped (bundle.forest None): scikit-learn's predict stands in
    bundle = _young_bundle(400, seed=0, slow=0.5)
    r = PlacementRequest(task_type="a")
    flat = bundle.predict_relative(r, DEVICES)
    bundle.forest = None
    assert np.allclose(bundle.predict_relative(r, DEVICES), flat)
    assert len(bundle.predict_examples([])) == 0
    # an example of a task type the model never saw is priced at the mean of the task types' levels
    seen = examples_from_records(store_records(3, seed=4), gpu_rows())
    odd = [dataclasses.replace(e, request=dataclasses.replace(e.request, task_type="never-seen")) for e in seen]
    mean = float(np.mean(list(bundle.norms.values())))
    e = odd[0]
    part = bundle._stack([(e.request.task_type, e.device.model)], bundle._walk(bundle.encoder.rows([(e.request, e.device)])))
    assert bundle.predict_examples(odd[:1])[0] == pytest.approx(math.exp(part[0] + mean)) and abs(mean) > 0.1


def test_an_artifact_from_before_the_stacking_predicts_as_it_did() -> None:
    bundle = _young_bundle(300, seed=1)
    d = sio.loads(bundle.to_bytes(), trusted=sio.get_untrusted_types(data=bundle.to_bytes()))
    del d["stacked"], d["residual_weight"]
    old = ModelBundle.from_bytes(sio.dumps(d))
    assert not old.stacked
    r = PlacementRequest(task_type="a")
    trees = old._walk(old.encoder.matrix(r, DEVICES))
    assert np.allclose(old.predict_relative(r, DEVICES), np.exp(trees))  # the trees alone, as then
    assert (ModelBundle.from_bytes(bundle.to_bytes()).residual_weight, bundle.stacked) == (bundle.residual_weight, True)
    util = fit(examples_from_records(store_records(100), gpu_rows()), target="utilization")
    assert not util.stacked  # only the work rate has a matrix to stand on


@pytest.mark.parametrize("slow", [None, 0.5])
def test_held_out_figures_judge_the_model_that_places(slow: float | None) -> None:
    # the lifecycle scores a candidate with predict_examples: it must be the very prediction placement uses
    bundle = _young_bundle(300, seed=2, slow=slow)
    examples = examples_from_records(store_records(40, seed=9), gpu_rows())
    rates = [bundle.predict_rates(e.request, [e.device])[0] for e in examples]
    assert np.allclose(bundle.predict_examples(examples), rates)
