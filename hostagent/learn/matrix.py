"""The learned throughput matrix: each (task type, GPU model) pair's relative work rate with its uncertainty, from
the usage records only, sharing strength across task types and GPU models.

In log space, relative to the task type's mean (the model's `work_rate` target), a pair's rate is a task effect
plus a GPU-model effect plus the pair's own interaction:

    log r(t, m) = a_t + b_m + u_tm

`a` and `b` are fitted by backfitting over every finished lease that reported work (each GPU model's speed is
learned from every task type that ran on it, and the other way round). The interaction is the pair's mean
residual shrunk towards zero by empirical Bayes: with `s2` the variance of a lease's rate around its pair's mean
(pooled) and `t2` the variance of the interactions themselves (method of moments over the residuals' degrees of
freedom), a pair's prior variance is `v = t2` plus the two effects' own (an effect fitted over few pairs carries
their interactions: `_effect_var`), and a pair with `n` leases keeps `n / (n + s2 / v)` of its own residual, so a
pair seen twice leans on the shared effects and one seen often speaks for itself; no constant is tuned, both
variances come from the records. The uncertainty (a standard deviation in log space) is the pair's posterior
variance, `v` narrowed by its leases. A pair never seen gets `a_t + b_m` with `v` itself as its uncertainty (what
the queue's ties read: an early model, fitted on few pairs, says how little it knows); a GPU model never seen has
no `b_m` here (the placer prices it from its probes' figures: `domain.placement.capability_prior`).

The learned scorer uses the matrix where its trees have nothing to go on: for a task type and a GPU model each
seen in the records but never together, the trees would extrapolate from neighbours chosen by the split points;
the matrix gives the additive estimate instead (`ModelBundle.predict_relative`).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

ROUNDS = 20  # backfitting sweeps (each is one pass over the pairs; it converges in a few)


@dataclass(frozen=True, slots=True)
class Cell:
    """One pair's estimate: relative work rate (1 = the task type's typical device), its log-space standard
    deviation, the leases behind it and where it comes from (records | shared)."""

    task: str
    model: str
    rate: float
    sd: float
    n: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"task": self.task, "model": self.model, "rate": round(self.rate, 4), "sd": round(self.sd, 4),
                "n": self.n, "source": self.source}


@dataclass
class ThroughputMatrix:
    """Task and GPU-model effects, each pair's (mean residual, leases), and the two variances (see the module)."""

    task_effect: dict[str, float] = field(default_factory=dict)
    model_effect: dict[str, float] = field(default_factory=dict)
    # task -> model -> (residual, n): n is the pair's leases, each counted at its tenant weight (records.tenant_weights)
    pairs: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    s2: float = 0.0
    t2: float = 0.0
    task_n: dict[str, float] = field(default_factory=dict)
    model_n: dict[str, float] = field(default_factory=dict)

    @classmethod
    def fit(cls, rows: Iterable[tuple[str, str, float] | tuple[str, str, float, float]]) -> ThroughputMatrix:
        """From (task type, GPU model, log relative work rate[, weight]) per finished lease and device. A weight
        (the lease's tenant weight, default 1) counts the lease as that much of one, so that one tenant leasing all
        day cannot make the pairs' rates its own, as it cannot the trees'."""
        cells: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
        for row in rows:
            task, model, y = row[0], row[1], row[2]
            w = row[3] if len(row) > 3 else 1.0  # type: ignore[misc]
            if math.isfinite(y) and w > 0:
                cells[(task, model)].append((y, w))
        if not cells:
            return cls()
        n = {k: sum(w for _, w in v) for k, v in cells.items()}
        mean = {k: sum(w * y for y, w in v) / n[k] for k, v in cells.items()}
        a: dict[str, float] = {t: 0.0 for t, _ in cells}
        b: dict[str, float] = {m: 0.0 for _, m in cells}
        for _ in range(ROUNDS):
            a = _effect(mean, n, b, side=0)
            b = _effect(mean, n, a, side=1)
        resid = {k: mean[k] - a[k[0]] - b[k[1]] for k in cells}
        dof = sum(n.values()) - len(cells)
        s2 = sum(w * (y - mean[k]) ** 2 for k, v in cells.items() for y, w in v) / dof if dof > 0 else 0.0
        # the spread of the pairs' mean residuals, less what their own noise explains (method of moments). The
        # effects took a+b-c degrees of freedom from the pairs (c: the groups of tasks and GPU models linked by
        # pairs, each with its own level): with 12 pairs of 6 task types and 5 GPU models the residuals keep 2 of
        # 12, and their mean square alone would put the interactions at a sixth of their spread. Where the effects
        # took them all, nothing tells the interactions from the effects: they are taken to vary as much as the
        # pairs do around their task types (a GPU model could be fast for one task type only).
        dof_pairs = len(cells) - (len(a) + len(b) - _linked_groups(cells))
        if dof_pairs > 0:
            t2 = max(0.0, sum(r * r for r in resid.values()) / dof_pairs - sum(s2 / n[k] for k in cells) / len(cells))
        else:
            t2 = sum((mean[k] - a[k[0]]) ** 2 for k in cells) / len(cells)
        pairs: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
        for (t, m), r in resid.items():
            pairs[t][m] = (r, n[(t, m)])
        task_n: dict[str, float] = defaultdict(float)
        model_n: dict[str, float] = defaultdict(float)
        for (t, m), c in n.items():
            task_n[t] += c
            model_n[m] += c
        return cls(a, b, dict(pairs), s2, t2, dict(task_n), dict(model_n))

    def cell(self, task: str, model: str) -> Cell | None:
        """The pair's estimate; None where the task type or the GPU model was never seen."""
        if task not in self.task_effect or model not in self.model_effect:
            return None
        resid, n = self.pairs.get(task, {}).get(model, (0.0, 0.0))
        # before its own leases the pair is the two effects plus an interaction: as uncertain as the interactions
        # spread and the two effects are unsure; its leases then narrow it (normal prior, normal mean). A pair seen
        # often is its own mean, whatever the effects: so against it, a pair never seen carries its task type's
        # effect's error too, not only its GPU model's
        prior = self.t2 + self._task_effect_var(task) + self._effect_var(
            (ms[model][1] for ms in self.pairs.values() if model in ms), self.model_n.get(model, 0.0))
        keep = n / (n + self.s2 / prior) if n and prior > 0 else (1.0 if n and self.s2 == 0 else 0.0)
        var = (1.0 / (n / self.s2 + 1.0 / prior) if n and self.s2 > 0 and prior > 0
               else (0.0 if n and self.s2 == 0 else prior))
        log_rate = self.task_effect[task] + self.model_effect[model] + keep * resid
        return Cell(task, model, math.exp(log_rate), math.sqrt(var), round(n), "records" if n else "shared")

    def _task_effect_var(self, task: str) -> float:
        return self._effect_var((n for _, n in self.pairs.get(task, {}).values()), self.task_n.get(task, 0.0))

    def _effect_var(self, leases: Iterable[float], total: float) -> float:
        """The variance of an effect fitted as the lease-weighted mean over its pairs (`leases`: each pair's, `total`
        their sum, the effect's `task_n` or `model_n`): each pair brings its interaction (`t2`) once, however many
        leases it has, and each lease its noise (`s2`). An effect known from one pair is as uncertain as an
        interaction, whatever its leases."""
        return self.t2 * sum(x * x for x in leases) / (total * total) + self.s2 / total if total > 0 else 0.0

    def sd(self, task: str, model: str) -> float:
        """The log-space standard deviation of the pair's rate: its cell's where the task type and the GPU model were
        both seen, else the interactions' spread plus the task type's effect's error plus the GPU-model effects'
        spread (an effect never estimated is as uncertain as the effects vary); 0 for an empty matrix (an artifact
        from before it)."""
        cell = self.cell(task, model)
        if cell is not None:
            return cell.sd
        effects = list(self.model_effect.values())
        return math.sqrt(self.t2 + self._task_effect_var(task)
                         + (statistics.pvariance(effects) if len(effects) > 1 else 0.0))

    def table(self) -> list[Cell]:
        """Every pair of a seen task type and a seen GPU model, by task then model."""
        cells = (self.cell(t, m) for t in sorted(self.task_effect) for m in sorted(self.model_effect))
        return [c for c in cells if c is not None]

    def to_plain(self) -> dict[str, Any]:
        """Builtins only (the model artifact holds it; skops loads builtins without trusting code)."""
        return {"task_effect": self.task_effect, "model_effect": self.model_effect,
                "pairs": {t: {m: [r, n] for m, (r, n) in ms.items()} for t, ms in self.pairs.items()},
                "s2": self.s2, "t2": self.t2, "task_n": self.task_n, "model_n": self.model_n}

    @classmethod
    def from_plain(cls, d: dict[str, Any] | None) -> ThroughputMatrix:
        """The inverse of to_plain (an artifact from before the matrix gives an empty one)."""
        if not d:
            return cls()
        return cls({str(k): float(v) for k, v in d["task_effect"].items()},
                   {str(k): float(v) for k, v in d["model_effect"].items()},
                   {str(t): {str(m): (float(x[0]), float(x[1])) for m, x in ms.items()} for t, ms in d["pairs"].items()},
                   float(d["s2"]), float(d["t2"]), {str(k): float(v) for k, v in d["task_n"].items()},
                   {str(k): float(v) for k, v in d["model_n"].items()})


def _linked_groups(cells: Iterable[tuple[str, str]]) -> int:
    """How many groups the pairs link the task types and GPU models into (union-find): each group's effects carry a
    level of their own."""
    parent: dict[tuple[int, str], tuple[int, str]] = {}

    def root(x: tuple[int, str]) -> tuple[int, str]:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x
    for t, m in cells:
        parent[root((0, t))] = root((1, m))
    return len({root(x) for x in list(parent)})


def _effect(mean: dict[tuple[str, str], float], n: dict[tuple[str, str], float], other: dict[str, float],
            side: int) -> dict[str, float]:
    """One backfitting step: each task's (side 0) or GPU model's (side 1) lease-weighted mean of what the other
    effect leaves; the GPU-model effects are centred (lease-weighted) so the task effects carry the level."""
    num: dict[str, float] = defaultdict(float)
    den: dict[str, float] = defaultdict(float)
    for k, y in mean.items():
        num[k[side]] += n[k] * (y - other[k[1 - side]])
        den[k[side]] += n[k]
    eff = {key: num[key] / den[key] for key in num}
    if side == 1:
        centre = sum(eff[m] * den[m] for m in eff) / sum(den.values())
        eff = {m: v - centre for m, v in eff.items()}
    return eff


__all__ = ["Cell", "ThroughputMatrix"]
