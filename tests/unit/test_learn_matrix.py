"""The learned throughput matrix (learn.matrix): shared effects, shrunk interactions, uncertainty, tenant weights,
and its use by the scorer (the base of every work-rate prediction; alone for pairs the records never saw together);
built only from the store's records."""

from __future__ import annotations

import math
import random

import pytest

from hostagent.domain.placement import PlacementRequest
from hostagent.learn import lifecycle
from hostagent.learn.matrix import ThroughputMatrix
from hostagent.learn.model import LearnedScorer, ModelBundle, fit
from hostagent.learn.records import examples_from_records
from tests.support.placement import FakeStore, OnlyThese, dev, gpu_rows, store_records

TASK = {"a": 0.5, "b": 0.0, "c": -0.5}
MODEL = {"X": 0.7, "Y": 0.0, "Z": -0.7}


def rows(pairs: dict[tuple[str, str], int], noise: float = 0.1, seed: int = 0,
         interaction: dict[tuple[str, str], float] | None = None) -> list[tuple[str, str, float]]:
    rng = random.Random(seed)
    extra = interaction or {}
    return [(t, m, TASK[t] + MODEL[m] + extra.get((t, m), 0.0) + rng.gauss(0, noise))
            for (t, m), n in pairs.items() for _ in range(n)]


def test_a_pair_never_seen_together_gets_the_shared_effects_with_an_honest_uncertainty() -> None:
    seen = {(t, m): 30 for t in TASK for m in MODEL if (t, m) != ("c", "Z")}
    mx = ThroughputMatrix.fit(rows(seen))
    cz = mx.cell("c", "Z")
    assert cz is not None and cz.n == 0 and cz.source == "shared"
    # the effects are identified up to a constant shared by tasks and models: compare differences
    ax = mx.cell("a", "X")
    assert ax is not None
    assert math.log(ax.rate) - math.log(cz.rate) == pytest.approx((TASK["a"] + MODEL["X"]) - (TASK["c"] + MODEL["Z"]),
                                                                    abs=0.1)
    assert cz.sd > ax.sd  # never seen: less certain than a pair seen 30 times
    assert mx.cell("d", "X") is None and mx.cell("a", "W") is None  # an unseen task or model: no estimate here
    assert len(mx.table()) == 9


def test_each_prediction_s_uncertainty_is_what_the_records_show_of_its_pair() -> None:
    # 30 leases of most pairs, none of ("c", "Z"), and an interaction or two: the queue reads these deviations
    seen = {(t, m): 30 for t in TASK for m in MODEL if (t, m) != ("c", "Z")}
    mx = ThroughputMatrix.fit(rows(seen, interaction={("a", "Z"): 1.0, ("b", "X"): -0.8}))
    ax, cz = mx.cell("a", "X"), mx.cell("c", "Z")
    assert ax is not None and cz is not None
    assert mx.sd("a", "X") == ax.sd < 0.1 and mx.sd("c", "Z") == cz.sd == pytest.approx(math.sqrt(
        mx.t2 + mx.s2 / mx.task_n["c"] + mx.s2 / mx.model_n["Z"]))
    # a GPU model never seen: the interactions' spread plus the GPU models' (how far its effect could be anywhere)
    spread = sum((v - sum(mx.model_effect.values()) / 3) ** 2 for v in mx.model_effect.values()) / 3
    assert mx.sd("a", "W") == pytest.approx(math.sqrt(mx.t2 + spread)) and mx.sd("a", "W") > cz.sd
    assert ThroughputMatrix().sd("a", "X") == 0.0  # no matrix (an artifact from before it): nothing to say
    # the scorer gives them per device, for a work-rate model; none for another target
    truth = {("a", "X"): 100.0, ("a", "Y"): 10.0, ("b", "X"): 50.0, ("b", "Y"): 5.0, ("c", "X"): 20.0, ("c", "Y"): 2.0}
    recs = [r for r in store_records(300, truth=truth) if not (r["task_type"] == "b" and r["devices"][0]["model"] == "Y")]
    bundle = fit(examples_from_records(recs, gpu_rows()))
    scorer = LearnedScorer(bundle)
    got = scorer.uncertainty(PlacementRequest(task_type="b"), [dev("g0", "X"), dev("g1", "Y"), dev("g9", "Q")])
    assert got == [bundle.matrix.sd("b", "X"), bundle.matrix.sd("b", "Y"), bundle.matrix.sd("b", "Q")]
    assert got[0] < got[1] < got[2]  # seen, never together, a model never seen
    bundle.target = "utilization"
    assert LearnedScorer(bundle).uncertainty(PlacementRequest(task_type="b"), [dev("g0", "X")]) == [0.0]


def test_interactions_are_kept_where_the_records_show_them_and_shrunk_where_they_are_few() -> None:
    pairs = {(t, m): 20 for t in TASK for m in MODEL}
    pairs[("b", "Y")] = 2
    interaction = {("a", "Z"): 1.5, ("b", "X"): -1.0, ("c", "Y"): 0.8, ("b", "Y"): 1.5}
    mx = ThroughputMatrix.fit(rows(pairs, interaction=interaction, seed=3))
    assert mx.t2 > 0 and mx.s2 == pytest.approx(0.01, rel=0.5)
    az, by = mx.cell("a", "Z"), mx.cell("b", "Y")
    assert az is not None and by is not None
    # 20 leases: its own mean, nearly unshrunk; 2 leases: between the additive estimate and its own mean
    assert math.log(az.rate) == pytest.approx(mx.task_effect["a"] + mx.model_effect["Z"]
                                              + mx.pairs["a"]["Z"][0], abs=0.02)
    own = mx.pairs["b"]["Y"][0]
    shrunk = math.log(by.rate) - mx.task_effect["b"] - mx.model_effect["Y"]
    assert 0 < shrunk < own
    assert by.sd > az.sd
    # no interactions at all in the records: the estimate is the additive one for every pair
    flat = ThroughputMatrix.fit(rows({(t, m): 10 for t in TASK for m in MODEL}, noise=0.05))
    for c in flat.table():
        assert math.log(c.rate) == pytest.approx(flat.task_effect[c.task] + flat.model_effect[c.model], abs=0.05)


def test_the_scorer_stands_on_the_matrix_and_uses_it_alone_for_pairs_never_seen_together() -> None:
    # "b" never ran on Y (and "a" runs on both): the trees would extrapolate, the matrix shares strength
    truth = {("a", "X"): 100.0, ("a", "Y"): 10.0, ("b", "X"): 50.0, ("b", "Y"): 5.0, ("c", "X"): 20.0, ("c", "Y"): 2.0}
    recs = [r for r in store_records(300, truth=truth) if not (r["task_type"] == "b" and r["devices"][0]["model"] == "Y")]
    bundle = fit(examples_from_records(recs, gpu_rows()))
    cell = bundle.matrix.cell("b", "Y")
    assert cell is not None and cell.n == 0
    got = bundle.predict_relative(PlacementRequest(task_type="b"), [dev("g0", "X"), dev("g1", "Y")])
    assert got[1] == pytest.approx(cell.rate)  # the matrix's, not the trees'
    rate = bundle.predict_rates(PlacementRequest(task_type="b"), [dev("g1", "Y")])[0]  # in the guest's unit, the same
    assert rate == pytest.approx(math.exp(math.log(cell.rate) + bundle.norms["b"]))
    assert got[0] / got[1] == pytest.approx(10.0, rel=0.2)  # Y is a tenth of X for the other task types: so here
    # a pair seen together: the matrix's rate, times the trees' part as far as it earned its place (stacked)
    seen = bundle.predict_relative(PlacementRequest(task_type="a"), [dev("g1", "Y")])
    trees = bundle._walk(bundle.encoder.matrix(PlacementRequest(task_type="a"), [dev("g1", "Y")]))[0]
    assert bundle.stacked and bundle.residual_weight in (0.0, 1.0)
    assert math.log(seen[0]) == pytest.approx(math.log(bundle.matrix.cell("a", "Y").rate)  # type: ignore[union-attr]
                                              + bundle.residual_weight * trees)
    again = ModelBundle.from_bytes(bundle.to_bytes())
    assert again.matrix.to_plain() == bundle.matrix.to_plain()
    assert (again.stacked, again.residual_weight) == (bundle.stacked, bundle.residual_weight)


def test_a_lease_counts_as_much_as_its_tenant_weight() -> None:
    # weight 2 is the same lease twice; weight 0.5 half a lease (one tenant's flood counts at its capped weight)
    twice = ThroughputMatrix.fit([("a", "X", 1.0), ("a", "X", 1.0), ("a", "X", 3.0), ("a", "Y", 0.0), ("b", "Y", 2.0),
                                  ("b", "X", 2.5)])
    weighted = ThroughputMatrix.fit([("a", "X", 1.0, 2.0), ("a", "X", 3.0, 1.0), ("a", "Y", 0.0, 1.0),
                                     ("b", "Y", 2.0, 1.0), ("b", "X", 2.5, 1.0)])
    for c, d in zip(twice.table(), weighted.table()):
        assert (c.task, c.model, c.n) == (d.task, d.model, d.n)
        assert c.rate == pytest.approx(d.rate) and c.sd == pytest.approx(d.sd)
    half = ThroughputMatrix.fit([("a", "X", 0.0, 1.0), ("a", "X", 4.0, 0.25), ("a", "Y", 0.0), ("b", "X", 0.0),
                                 ("b", "Y", 0.0)])
    assert half.pairs["a"]["X"][1] == 1.25  # the pair's leases, weighted
    assert half.cell("a", "X").n == 1  # type: ignore[union-attr]  # shown as whole leases
    # the weighted mean: (0 * 1 + 4 * 0.25) / 1.25 = 0.8 before the shared effects take their part
    assert half.task_effect["a"] + half.model_effect["X"] + half.pairs["a"]["X"][0] == pytest.approx(0.8)
    assert ThroughputMatrix.fit([("a", "X", 1.0, 0.0)]).table() == []  # a weight of nothing is no lease


def test_the_matrix_is_built_only_from_the_stores_records() -> None:
    store = FakeStore(store_records(300))
    spy = OnlyThese(store, {"training_records", "list_gpus", "get_model_version", "save_model_version"})
    res = lifecycle.train(spy, now=1.7e9)  # type: ignore[arg-type]
    assert res.decision == "promoted" and res.bundle is not None
    assert set(spy.calls) <= {"training_records", "list_gpus", "get_model_version", "save_model_version"}
    counts: dict[tuple[str, str], int] = {}
    for r in store.records:
        key = (r["task_type"], r["devices"][0]["model"])
        counts[key] = counts.get(key, 0) + 1
    cells = {(c.task, c.model): c.n for c in res.bundle.matrix.table()}
    assert cells == counts  # every pair and its leases, as the records hold them (nothing else)
