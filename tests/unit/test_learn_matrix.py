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
    # never together: the interaction, plus each effect's error (c's over two pairs of 30 leases, as Z's: half an
    # interaction and the noise of 60 leases each)
    assert mx.task_n["c"] == mx.model_n["Z"] == 60
    assert mx.sd("a", "X") == ax.sd < 0.1 and mx.sd("c", "Z") == cz.sd == pytest.approx(math.sqrt(
        mx.t2 + 2 * (mx.t2 / 2 + mx.s2 / 60)))
    # a GPU model never seen: the interactions' spread plus the GPU models' (how far its effect could be anywhere)
    spread = sum((v - sum(mx.model_effect.values()) / 3) ** 2 for v in mx.model_effect.values()) / 3
    assert mx.sd("a", "W") == pytest.approx(math.sqrt(mx.t2 + (mx.t2 / 3 + mx.s2 / 90) + spread))
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
    # it keeps n / (n + s2 / v) of it, v what the pair could be before its leases: an interaction, plus b's effect's
    # error and Y's (each over pairs of 20, 20 and 2 leases)
    v = mx.t2 + 2 * (mx.t2 * (20 ** 2 + 20 ** 2 + 2 ** 2) / 42 ** 2 + mx.s2 / 42)
    assert shrunk == pytest.approx(own * 2 / (2 + mx.s2 / v))
    assert by.sd == pytest.approx(math.sqrt(1 / (2 / mx.s2 + 1 / v)))
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


def _draw(rng: random.Random, tau: float, pairs: int, leases: int = 3, noise: float = 0.05,
          ) -> tuple[ThroughputMatrix, dict[tuple[str, str], float]]:
    """A host's first records: 6 task types x 5 GPU models with interactions of spread `tau`, `pairs` of them seen
    `leases` times each; the matrix fitted on them and the true log rates."""
    tasks, models = [f"t{i}" for i in range(6)], [f"m{j}" for j in range(5)]
    a = {t: rng.gauss(0, 0.5) for t in tasks}
    b = {m: rng.gauss(0, 0.5) for m in models}
    truth = {(t, m): a[t] + b[m] + rng.gauss(0, tau) for t in tasks for m in models}
    seen = rng.sample(sorted(truth), pairs)
    mx = ThroughputMatrix.fit([(t, m, truth[(t, m)] + rng.gauss(0, noise)) for t, m in seen for _ in range(leases)])
    return mx, truth


def test_the_interactions_spread_is_not_taken_for_the_effects_when_the_pairs_are_few() -> None:
    # 15 of 30 pairs: the 10 effects take 10 of the residuals' 15 degrees of freedom; their mean square alone would
    # put the interactions at a third of their spread, and an early model would trust extrapolations it cannot
    rng = random.Random(7)
    got = [_draw(rng, 0.5, 15)[0].t2 for _ in range(300)]
    assert sum(got) / len(got) == pytest.approx(0.25, rel=0.15)
    # every pair explained by the effects (one task type on three GPU models): nothing tells an interaction from a
    # GPU model's effect, so interactions are taken to vary as the pairs do around their task type
    one = ThroughputMatrix.fit([("a", "X", 0.6), ("a", "Y", 0.0), ("a", "Z", -0.6)])
    assert one.t2 == pytest.approx((0.6 ** 2 + 0.6 ** 2) / 3)
    assert one.cell("a", "X").rate == pytest.approx(math.exp(0.6))  # type: ignore[union-attr]
    # two groups the pairs do not link (a on X and Y; b on Z and W), each with its own level: the 6 effects less the
    # 2 levels take all 4 pairs, so here too the interactions vary as the pairs do around their task types
    apart = ThroughputMatrix.fit([("a", "X", 0.5), ("a", "Y", 0.0), ("b", "Z", 0.2), ("b", "W", 0.0)])
    assert apart.t2 == pytest.approx((0.25 ** 2 * 2 + 0.1 ** 2 * 2) / 4)
    # one 2 x 2 block, one lease a pair: 4 pairs less 3 effects leave one degree of freedom, and the residuals of a
    # pure interaction (+-e) are all of it
    e = 0.3
    block = [("a", "X", e), ("a", "Y", -e), ("b", "X", -e), ("b", "Y", e)]
    assert ThroughputMatrix.fit(block).t2 == pytest.approx(4 * e * e)
    # two such blocks the pairs do not link, one at another level: 8 pairs less 8 effects less 2 levels leave two. A
    # task type may share a name with a GPU model (task "X" is not GPU model X)
    other = [("X", "Z", 1.0 + e), ("X", "W", 1.0 - e), ("d", "Z", 1.0 - e), ("d", "W", 1.0 + e)]
    assert ThroughputMatrix.fit(block + other).t2 == pytest.approx((4 * e * e + 4 * e * e) / 2)


@pytest.mark.parametrize(("pairs", "within_one", "within_two"), [(12, 0.45, 0.7), (20, 0.6, 0.85)])
def test_an_early_matrix_says_how_little_it_knows_of_the_pairs_it_never_saw(pairs: int, within_one: float,
                                                                            within_two: float) -> None:
    # across many first days, a pair never seen compared with one seen for the same task type (the ratio the queue
    # reads) is off by about their combined deviation, as a normal deviation is (68 % within one, 95 % within two):
    # not by several, which would make the queue pass requests over on an extrapolation. (Before the effects' errors
    # and the residuals' degrees of freedom were counted, 17 % and 34 % were, with 12 pairs of 30 seen; 39 % and
    # 67 % with 20.) A few degrees of freedom leave the interactions' spread itself unsure: fewer than normal
    # within one then, but not many more, or every comparison would be a tie.
    rng = random.Random(11)
    z: list[float] = []
    for _ in range(200):
        mx, truth = _draw(rng, 0.5, pairs)
        cells = {(c.task, c.model): c for c in mx.table()}
        for (t, m), c in cells.items():
            for (t2, m2), seen in cells.items():
                if c.n == 0 and t2 == t and seen.n:
                    gap = math.log(c.rate / seen.rate) - (truth[(t, m)] - truth[(t2, m2)])
                    z.append(abs(gap) / math.hypot(c.sd, seen.sd))
    one, two = (sum(v <= k for v in z) / len(z) for k in (1, 2))
    assert within_one <= one <= 0.8 and two >= within_two, (one, two)


def test_an_effect_known_from_one_pair_is_as_uncertain_as_an_interaction() -> None:
    # Z ran only task a, 50 times: its speed is a's rate there, interaction included; b and c on Z are guesses
    seen = {(t, m): 20 for t in ("a", "b", "c") for m in ("X", "Y")}
    seen[("a", "Z")] = 50
    seen[("b", "X")], seen[("b", "Y")] = 30, 10
    mx = ThroughputMatrix.fit(rows(seen, noise=0.05, interaction={("a", "X"): 0.6, ("b", "Y"): -0.6}))
    bz, bx = mx.cell("b", "Z"), mx.cell("b", "X")
    assert bz is not None and bx is not None and mx.t2 > 0
    # the pair's interaction, Z's effect (one pair: a whole interaction), b's effect (pairs of 30 and 10 leases:
    # each pair's interaction weighs as its leases do, (30^2 + 10^2) / 40^2 of one)
    assert bz.sd ** 2 == pytest.approx(mx.t2 + (mx.t2 + mx.s2 / 50) + (mx.t2 * 1000 / 1600 + mx.s2 / 40))
    assert bz.sd > math.sqrt(2 * mx.t2) > bx.sd
