"""Packing scenario: does topology packing let more multi-GPU requests start without waiting than first-fit?

A host from the fake trees (`dgx8`: 8 GPUs behind 4 switches on 2 NUMA nodes; `demo16`: 16 behind 4 switches)
receives a Poisson stream of 1/2/4/8-GPU requests with log-normal hold times. A k-GPU request needs a set as close
as the host can offer for k on an empty host (2 GPUs: one switch on dgx8; 4: one root complex; 8: the host), the
way `numa_policy=required` plus a distance cap would ask for it. Requests are served strictly in arrival order,
as the lease queue does. Policies choose among the feasible sets:

- `first-fit`: the k lowest free addresses, what the agent's fallback `simple_place` does on a homogeneous host;
  when they miss the request's distance the request waits (it would not accept them).
- `block-first-fit`: topology-aware first fit: the first block (smallest kind first, then address order) with
  room, its lowest addresses.
- `random`: a random feasible block, random GPUs in it.
- `packing`: `hostagent.domain.topology.choose` (the code the agent runs): closest set, then the one that breaks
  up free blocks least.

Run: `python -m hostagent.learn.packing_sim [--scenario dgx8] [--jobs 3000] [--seeds 3] [--load 0.7] [--json]`.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hostagent.domain.topology import Level, Topology, choose, deployment_score

POLICIES = ("first-fit", "block-first-fit", "random", "packing")
DEFAULT_MIX = "1:0.55,2:0.25,4:0.12,8:0.08"


def host_topology(scenario: str) -> Topology:
    """Build the fake tree for `scenario` in a temporary directory and read its topology."""
    from hostagent.host.discovery import discover
    from hostagent.host.fakesysfs import build_tree
    from hostagent.host.sysfs import Sysfs

    with tempfile.TemporaryDirectory(prefix="packing-sim-") as tmp:
        tree = build_tree(tmp, scenario)
        inv = discover(Sysfs(tree.sys_root))  # read only: no fake kernel needed to answer writes
    return Topology.from_gpus(inv.gpus)


@dataclass(frozen=True, slots=True)
class Job:
    """One request: when it arrives, how many GPUs, how long it holds them."""

    id: int
    arrival: float
    size: int
    hold: float


def parse_mix(text: str) -> list[tuple[int, float]]:
    """'1:0.5,2:0.3' -> [(1, 0.5), (2, 0.3)] with weights normalised."""
    pairs = []
    for part in text.split(","):
        k, w = part.split(":")
        pairs.append((int(k), float(w)))
    total = sum(w for _, w in pairs)
    if total <= 0 or any(k < 1 or w < 0 for k, w in pairs):
        raise ValueError(f"bad --mix {text!r}: sizes >= 1, weights >= 0, some weight > 0")
    return [(k, w / total) for k, w in pairs]


def make_jobs(n: int, mix: Sequence[tuple[int, float]], gpus: int, load: float, seed: int,
              sigma: float = 1.0) -> list[Job]:
    """A Poisson stream whose offered load (GPU-time asked / GPU-time available) is `load`; mean hold 1.0."""
    rng = random.Random(seed)
    mean_size = sum(k * w for k, w in mix)
    rate = load * gpus / mean_size  # arrivals per unit time (mean hold is 1)
    sizes, weights = [k for k, _ in mix], [w for _, w in mix]
    t, jobs = 0.0, []
    mu = -sigma * sigma / 2  # log-normal with mean 1
    for i in range(n):
        t += rng.expovariate(rate)
        jobs.append(Job(i, t, rng.choices(sizes, weights)[0], rng.lognormvariate(mu, sigma)))
    return jobs


Chooser = Callable[[Topology, list[str], int, Level | None, random.Random], tuple[str, ...] | None]


def _feasible_blocks(topo: Topology, free: list[str], k: int, need: Level | None) -> list[list[str]]:
    """Free GPUs of every block whose members are within `need` and that has room for k, smallest kind first."""
    out = []
    fs = set(free)
    for b in topo.blocks():
        if b.kind == "nvlink" or (need is not None and b.level > need):
            continue
        members = [g for g in b.gpu_ids if g in fs]
        if len(members) >= k:
            out.append(members)
    return out


def first_fit(topo: Topology, free: list[str], k: int, need: Level | None, rng: random.Random) -> tuple[str, ...] | None:
    """The k lowest free addresses, or None when they are farther apart than the request accepts."""
    picked = tuple(sorted(free, key=lambda g: topo.place(g).address)[:k])
    if len(picked) < k:
        return None
    dist = topo.set_distance(picked)
    return picked if need is None or dist is None or dist <= need else None


def block_first_fit(topo: Topology, free: list[str], k: int, need: Level | None,
                    rng: random.Random) -> tuple[str, ...] | None:
    """The first block with room, its lowest addresses (single GPU: the lowest free address)."""
    if k == 1:
        return (min(free, key=lambda g: topo.place(g).address),) if free else None
    blocks = _feasible_blocks(topo, free, k, need)
    if not blocks:
        return None
    return tuple(sorted(blocks[0], key=lambda g: topo.place(g).address)[:k])


def random_fit(topo: Topology, free: list[str], k: int, need: Level | None, rng: random.Random) -> tuple[str, ...] | None:
    """A random feasible block, random GPUs in it."""
    if k == 1:
        return (rng.choice(free),) if free else None
    blocks = _feasible_blocks(topo, free, k, need)
    if not blocks:
        return None
    return tuple(rng.sample(rng.choice(blocks), k))


def packing(topo: Topology, free: list[str], k: int, need: Level | None, rng: random.Random) -> tuple[str, ...] | None:
    """The agent's chooser: closest set within `need`, then the one that breaks free blocks least."""
    c = choose(topo, free, k, policy="any", max_distance=need, host_free=free, objective="pack")
    return None if c is None else c.gpu_ids


CHOOSERS: dict[str, Chooser] = {"first-fit": first_fit, "block-first-fit": block_first_fit, "random": random_fit,
                                 "packing": packing}


@dataclass
class Result:
    """Figures of one policy on one seed."""

    policy: str
    seed: int
    jobs: int
    multi_immediate: float  # share of multi-GPU requests granted on arrival
    immediate_by_size: dict[int, float]
    mean_wait: float  # in mean hold times
    mean_wait_multi: float
    frag_blocked: int  # times the queue head waited although enough GPUs were free (fragmentation)
    utilization: float
    mean_deploy_score: float

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"policy": self.policy, "seed": self.seed, "jobs": self.jobs,
                "multi_immediate": round(self.multi_immediate, 4),
                "immediate_by_size": {str(k): round(v, 4) for k, v in sorted(self.immediate_by_size.items())},
                "mean_wait": round(self.mean_wait, 4), "mean_wait_multi": round(self.mean_wait_multi, 4),
                "frag_blocked": self.frag_blocked, "utilization": round(self.utilization, 4),
                "mean_deploy_score": round(self.mean_deploy_score, 4)}


def need_for(topo: Topology, k: int) -> Level | None:
    """The distance an empty host offers for k GPUs: what a k-GPU request insists on."""
    c = choose(topo, list(topo.gpu_ids), k, policy="any")
    return None if c is None else c.distance


def simulate(topo: Topology, jobs: Sequence[Job], policy: str, seed: int, queue_mode: str = "backfill") -> Result:
    """Run one policy over the jobs and measure.

    `fifo`: strictly in arrival order (the head blocks everyone, as the agent's queue does); `backfill`: waiting
    requests are tried oldest first and any that fits starts, so a waiting 8-GPU request does not hide what the
    policy does for the smaller ones.
    """
    chooser = CHOOSERS[policy]
    rng = random.Random(seed * 7919 + 1)
    n = len(topo.gpu_ids)
    needs = {k: need_for(topo, k) for k in {j.size for j in jobs}}
    free = list(topo.gpu_ids)
    queue: list[Job] = []
    departures: list[tuple[float, int, tuple[str, ...]]] = []
    waits: dict[int, float] = {}
    frag = 0
    busy_area = 0.0
    last_t = 0.0
    scores: list[float] = []
    ai = 0
    order = sorted(jobs, key=lambda j: j.arrival)
    now = 0.0

    def serve(t: float) -> None:
        nonlocal frag
        i = 0
        while i < len(queue):
            head = queue[i]
            if head.size > n:
                queue.pop(i)
                continue
            picked = chooser(topo, free, head.size, needs[head.size], rng) if len(free) >= head.size else None
            if picked is None:
                if len(free) >= head.size:
                    frag += 1
                if queue_mode == "fifo":
                    return
                i += 1
                continue
            scores.append(deployment_score(topo, free, picked, head.size))
            for g in picked:
                free.remove(g)
            queue.pop(i)
            waits[head.id] = t - head.arrival
            heapq.heappush(departures, (t + head.hold, head.id, picked))

    while ai < len(order) or departures:
        next_arrival = order[ai].arrival if ai < len(order) else math.inf
        next_departure = departures[0][0] if departures else math.inf
        now = min(next_arrival, next_departure)
        busy_area += (n - len(free)) * (now - last_t)
        last_t = now
        if next_departure <= next_arrival:
            _, _, gpus = heapq.heappop(departures)
            free.extend(gpus)
        else:
            queue.append(order[ai])
            ai += 1
        serve(now)
    by_size: dict[int, list[float]] = {}
    for j in jobs:
        if j.id in waits:
            by_size.setdefault(j.size, []).append(waits[j.id])
    multi = [w for k, ws in by_size.items() if k > 1 for w in ws]
    every = [w for ws in by_size.values() for w in ws]
    return Result(
        policy=policy, seed=seed, jobs=len(jobs),
        multi_immediate=sum(1 for w in multi if w <= 1e-12) / len(multi) if multi else 0.0,
        immediate_by_size={k: sum(1 for w in ws if w <= 1e-12) / len(ws) for k, ws in by_size.items()},
        mean_wait=statistics.fmean(every) if every else 0.0,
        mean_wait_multi=statistics.fmean(multi) if multi else 0.0,
        frag_blocked=frag, utilization=busy_area / (n * now) if now > 0 else 0.0,
        mean_deploy_score=statistics.fmean(scores) if scores else 0.0,
    )


def run(scenario: str, n_jobs: int, seeds: int, load: float, mix: str, policies: Sequence[str],
        queue_mode: str = "backfill") -> list[Result]:
    """Every policy on the same jobs for each seed."""
    topo = host_topology(scenario)
    parsed = parse_mix(mix)
    out = []
    for seed in range(seeds):
        jobs = make_jobs(n_jobs, parsed, len(topo.gpu_ids), load, seed)
        for p in policies:
            out.append(simulate(topo, jobs, p, seed, queue_mode))
    return out


def table(results: Sequence[Result], out: Any = None) -> None:
    """Per-policy means over seeds (and the per-seed spread of the headline figure)."""
    out = out or sys.stdout
    sizes = sorted({k for r in results for k in r.immediate_by_size})
    head = (f"{'policy':<15} {'multi-GPU granted at once':>26} " + " ".join(f"{f'k={k}':>7}" for k in sizes)
            + f" {'mean wait':>10} {'wait k>1':>9} {'frag-blocked':>12} {'util':>6} {'deploy':>7}")
    print(head, file=out)
    for p in dict.fromkeys(r.policy for r in results):
        rs = [r for r in results if r.policy == p]
        mi = [r.multi_immediate for r in rs]
        spread = f" (min {min(mi):.3f} max {max(mi):.3f})" if len(rs) > 1 else ""
        cells = " ".join(f"{statistics.fmean(r.immediate_by_size.get(k, 0.0) for r in rs):7.3f}" for k in sizes)
        print(f"{p:<15} {statistics.fmean(mi):>8.3f}{spread:<18} {cells} "
              f"{statistics.fmean(r.mean_wait for r in rs):10.3f} {statistics.fmean(r.mean_wait_multi for r in rs):9.3f} "
              f"{statistics.fmean(r.frag_blocked for r in rs):12.1f} {statistics.fmean(r.utilization for r in rs):6.3f} "
              f"{statistics.fmean(r.mean_deploy_score for r in rs):7.3f}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(prog="python -m hostagent.learn.packing_sim", description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="dgx8", help="fake host: dgx8 (default) or demo16")
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--load", type=float, default=0.7, help="offered load, GPU-time asked / available (default 0.7)")
    ap.add_argument("--mix", default=DEFAULT_MIX, help=f"size:weight,... (default {DEFAULT_MIX})")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--queue", choices=("backfill", "fifo"), default="backfill",
                    help="backfill (default): any waiting request that fits starts; fifo: strictly in arrival order")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in CHOOSERS]
    if unknown:
        ap.error(f"unknown policy {unknown[0]!r}; known: {', '.join(CHOOSERS)}")
    results = run(args.scenario, args.jobs, args.seeds, args.load, args.mix, policies, args.queue)
    if args.json:
        print(json.dumps({"scenario": args.scenario, "load": args.load, "mix": args.mix, "queue": args.queue,
                          "results": [r.to_dict() for r in results]}, indent=2))
    else:
        print(f"scenario {args.scenario}, {args.jobs} jobs x {args.seeds} seeds, load {args.load}, mix {args.mix}, "
              f"queue {args.queue}")
        table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
