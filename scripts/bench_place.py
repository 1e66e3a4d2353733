#!/usr/bin/env python3
"""Placement decision latency with a trained model, vs first-fit and the cold-start rule, in one run.

A model is trained on synthetic lease records (8 task types x 6 GPU models, 3000 leases) through the same
``fit`` the lifecycle uses, saved and reloaded with skops; then ``place()`` (filters + one batched prediction +
set choice) is timed on 16- and 64-GPU hosts, about half of the devices free, random requests. The records hold
nothing beyond each (task, GPU model) pair's rate, so the fit keeps the matrix alone (residual weight 0: no tree is
walked); "model, trees" is the same model with its trees kept (weight 1), as a fit keeps them where the devices' own
figures carry signal.
Targets: p99 <= 1 ms (16 GPUs) and <= 3 ms (64 GPUs). Prints figures; asserts nothing.

    python scripts/bench_place.py [--decisions 5000]
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostagent.domain.placement import GIB, DeviceView, PlacementRequest, place  # noqa: E402
from hostagent.learn.model import LearnedScorer, ModelBundle, fit  # noqa: E402
from hostagent.learn.records import examples_from_records  # noqa: E402

MODELS = {"T4": 16, "V100": 32, "A100": 40, "RTX6000": 24, "RTX2080Ti": 11, "L40S": 48}
TASKS = [f"task{i}" for i in range(8)]


class FirstFit:
    """Baseline: lowest index first (no prediction at all)."""

    name = "first-fit"

    def covers(self, request: PlacementRequest) -> bool:
        return True

    def score(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> list[float]:
        return [-float(i) for i in range(len(devices))]


def records(n: int, rng: random.Random, models: dict[str, int] = MODELS,
            tasks: Sequence[str] = TASKS) -> list[dict[str, object]]:
    """Finished leases with a per (task, GPU model) speed; `models`: name -> memory GiB (scripts/bench_queue.py
    passes its host's names)."""
    speed = {(t, m): math.exp(rng.gauss(0, 0.7)) for t in tasks for m in models}
    out = []
    for i in range(n):
        t, m = rng.choice(list(tasks)), rng.choice(list(models))
        out.append({"id": f"L{i}", "host_id": "h", "task_type": t, "priority": 0, "min_memory_gib": rng.choice([0, 8]),
                    "duration_s": rng.choice([600, 3600, None]), "created_at": 1.7e9 + i, "outcome": "released",
                    "devices": [{"gpu_id": f"g{i % 64}", "model": m, "memory_bytes": models[m] * GIB,
                                 "numa_node": i % 2}],
                    "usage": {"work_mean": speed[(t, m)] * math.exp(rng.gauss(0, 0.05)), "util_mean": 90.0}})
    return out


def host(n: int, rng: random.Random) -> list[DeviceView]:
    names = list(MODELS)
    return [DeviceView(f"gpu{i}", names[i % len(names)], "NVIDIA Corporation", MODELS[names[i % len(names)]] * GIB,
                       numa_node=i * 2 // n, link_gen=4, link_width=16, probe_score=rng.uniform(0.9, 1.05))
            for i in range(n)]


def bench(devices: list[DeviceView], scorer: object, decisions: int, rng: random.Random) -> tuple[float, float]:
    lat = []
    for _ in range(decisions):
        free = [DeviceView(**{**{f: getattr(d, f) for f in d.__slots__}, "free": rng.random() < 0.5})  # type: ignore[attr-defined]
                for d in devices]
        req = PlacementRequest(task_type=rng.choice(TASKS), min_memory_gib=rng.choice([0, 12, 20]),
                               count=rng.choice([1, 1, 1, 2]), numa_policy="preferred")
        t0 = time.perf_counter()
        place(req, free, scorer=scorer)  # type: ignore[arg-type]
        lat.append(time.perf_counter() - t0)
    lat.sort()
    return statistics.median(lat) * 1e3, lat[int(0.99 * (len(lat) - 1))] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=5000)
    args = ap.parse_args()
    rng = random.Random(0)
    t0 = time.perf_counter()
    bundle = fit(examples_from_records(records(3000, rng)))
    fit_s = time.perf_counter() - t0
    loaded = ModelBundle.from_bytes(bundle.to_bytes())
    trees = copy.copy(loaded)
    trees.residual_weight = 1.0
    print(f"model: {bundle.trained_on} records, {len(bundle.estimator._predictors)} trees, fit {fit_s:.2f} s, "
          f"flattened trees {'on' if loaded.forest is not None else 'OFF (estimator.predict)'}, residual weight "
          f"{loaded.residual_weight:g} ({'the trees kept' if loaded.walks_trees else 'the matrix alone predicts'})")
    print(f"{'gpus':>5} {'policy':<12} {'p50_ms':>8} {'p99_ms':>8} {'target_p99_ms':>14}")
    for n, target in ((16, 1.0), (64, 3.0)):
        devices = host(n, rng)
        for name, scorer in (("first-fit", FirstFit()), ("cold-start", None), ("model", LearnedScorer(loaded)),
                             ("model, trees", LearnedScorer(trees))):
            bench(devices, scorer, 200, rng)  # warm caches
            p50, p99 = bench(devices, scorer, args.decisions, rng)
            print(f"{n:>5} {name:<12} {p50:>8.3f} {p99:>8.3f} {target if name.startswith('model') else '':>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
