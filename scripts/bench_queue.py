#!/usr/bin/env python3
"""Queue decision latency with comparative advantage (issue #21), vs strict serve order, in one run.

A model is trained on synthetic lease records (8 task types x 6 GPU models, 3000 leases) through the same ``fit``
the lifecycle uses, saved and reloaded with skops. A real ``LeaseManager`` over 16 and then 64 hand-built GPUs (six
models with pci.ids-like names, two NUMA nodes, four GPUs per PCIe switch) gets a real ``Placer`` holding that model,
wired as the running agent wires it (``place=placer``, ``manager.relative_rates = placer.relative_rates``, its run
times, and the topology placer behind the learned one, as ``runtime.make_app`` does). About half of the GPUs are held
by ACTIVE leases (half of them stated no length: dated by the model's run times); 50 QUEUED leases wait (mixed task
types, 1-2 GPUs; one queue all of one priority, one of mixed priorities).

One decision = ``lease_queue._next_grant(m)`` plus, for the lease it returns, the placer call ``claim`` makes
(``m.place(request, free, count, domain_uuid)``). Between decisions (untimed) which GPUs are held is drawn again,
the clock moves 10 s, and the lease granted leaves the queue for a new one at its tail (the queue stays at 50).
Figures: (a) ``leases.queue_order = advantage``, predictions cached (steady state); (b) the first decision after
a model switch (a new bundle and scorer handed to ``placer.use`` before each timed decision: every cache of the
model cold); (c) strict serve order (``Fairness(enabled=False)``), the baseline. The bench's records hold nothing
beyond each (task, model) pair's rate, so the fit keeps the matrix alone (residual weight 0: no tree is walked); the
"trees" rows repeat (a) and (b) with the same model's trees kept (weight 1), as a fit keeps them where the devices'
own figures carry signal.
The rows take turns in ten rounds (a slow spell of a shared machine falls on each alike), each share after
some untimed decisions. Wall time and this thread's CPU time are both printed (a loaded machine inflates the
first), with the placer's share of the wall time. Targets: p99 <= 1 ms (16 GPUs) and <= 3 ms (64 GPUs). Prints figures; asserts nothing.

    python scripts/bench_queue.py [--decisions 1000] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import math
import os
import pstats
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_place  # noqa: E402  (its training records, with this host's model names)

from hostagent.domain.assignment import Fairness  # noqa: E402
from hostagent.domain.errors import Conflict  # noqa: E402
from hostagent.domain.inventory import Gpu, IommuGroup, PciFunction, gpu_id_for  # noqa: E402
from hostagent.domain.lease import Lease, LeaseDevice, LeaseRequest, LeaseState, new_lease  # noqa: E402
from hostagent.domain.numa import VmNuma  # noqa: E402
from hostagent.domain.pci import PciAddress  # noqa: E402
from hostagent.domain.placement import GIB, Exploration  # noqa: E402
from hostagent.domain.topology import Topology  # noqa: E402
from hostagent.learn.features import FeatureEncoder  # noqa: E402
from hostagent.learn.model import LearnedScorer, ModelBundle, fit  # noqa: E402
from hostagent.learn.records import examples_from_records  # noqa: E402
from hostagent.runtime import settle_heap  # noqa: E402
from hostagent.services import lease_queue  # noqa: E402
from hostagent.services.leases import LeaseManager, LeasePolicy  # noqa: E402
from hostagent.services.placement import Placer  # noqa: E402
from hostagent.services.topology import make_topology_place  # noqa: E402

S = LeaseState
# pci.ids-like device names (what Gpu.model reads and what the records name) and memory (GiB)
MODELS = {"TU104GL [Tesla T4]": 16, "GV100GL [Tesla V100 PCIe 32GB]": 32, "GA100 [A100 PCIe 40GB]": 40,
          "TU102GL [Quadro RTX 6000/8000]": 24, "TU102 [GeForce RTX 2080 Ti Rev. A]": 11, "AD102GL [L40S]": 48}
TASKS = [f"task{i}" for i in range(8)]
QUEUE = 50
NOW0 = 1.8e9
TARGETS = {16: 1.0, 64: 3.0}
ROUNDS = 10  # the rows take turns in this many rounds
WARM_UP = 400  # untimed decisions per row (in each round its share) before the timed ones


def records(n: int, rng: random.Random) -> list[dict[str, object]]:
    """Finished leases with a per (task, model) speed: scripts/bench_place.py's, with this host's model names, each
    held a heavy-tailed time (median about 20 min): the model keeps each task type's last run times (run_hist), the
    queue's expected run time of a request that states none and of a lease that stated none."""
    out = bench_place.records(n, rng, MODELS, TASKS)
    for r in out:
        r["held_s"] = math.exp(rng.gauss(7.0, 1.2))
    return out


def host(n: int) -> list[Gpu]:
    """n GPUs, models in turn, half on each NUMA node (root buses 00 and 80), four behind each PCIe switch."""
    names = list(MODELS)
    out = []
    for i in range(n):
        node = i * 2 // n
        k = i - node * (n // 2)  # index on its node
        root_bus = 0x00 if node == 0 else 0x80
        sw = k // 4
        up_bus = root_bus + 1 + sw * 6  # switch upstream port, then its downstream ports, then the GPUs' buses
        root_port = PciAddress(0, root_bus, 1 + sw, 0)
        upstream = PciAddress(0, up_bus, 0, 0)
        downstream = PciAddress(0, up_bus + 1, k % 4, 0)
        addr = PciAddress(0, up_bus + 2 + k % 4, 0, 0)
        name = names[i % len(names)]
        fn = PciFunction(address=addr, vendor_id=0x10DE, device_id=0x1EB8 + i % len(names), class_code=0x030200,
                         vendor_name="NVIDIA Corporation", device_name=name, driver="nvidia", numa_node=node,
                         iommu_group=i, link_speed="16.0 GT/s PCIe", link_width=16, max_link_speed="16.0 GT/s PCIe",
                         max_link_width=16, parent_chain=(downstream, upstream, root_port))
        out.append(Gpu(id=gpu_id_for(addr), primary=fn, functions=(fn,), group=IommuGroup(i, (fn,)),
                       memory_bytes=MODELS[name] * GIB, memory_source="name"))
    return out


class Bench:
    """One host: the manager, the placer (learned, through the topology placer), the active leases, the queue."""

    def __init__(self, gpus: list[Gpu], bundle: ModelBundle, mixed: bool, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = NOW0
        self.mixed = mixed
        self.bundle = bundle
        self.serial = 0
        m = LeaseManager(gpus=gpus, host=None, hypervisor=None, journal=None,  # type: ignore[arg-type]
                         policy=LeasePolicy(), clock=lambda: self.now)
        # as runtime.build_runtime and runtime.make_app wire it (the host and the journal are never touched by a
        # decision: _next_grant reads the leases, claims and policy; the placer reads the inventory)
        placer = Placer(lambda: list(m.gpus.values()), quarantined=lambda: m.quarantined,
                        exploration=Exploration(epsilon=0.05, max_priority=5), default_numa_policy="preferred",
                        measured=lambda g: m.measured.get(g))
        m.place = placer
        m.scaling, m.predict_rates = placer.scaling, placer.predict_rates
        m.relative_rates = placer.relative_rates
        m.rate_uncertainty, m.rates_token = placer.rate_uncertainty, placer.rates_token
        m.typical_run_s, m.left_run_s = placer.typical_run_s, placer.left_run_s
        m.doubt = placer.doubt  # the draws of the model's doubt in the wait (exploration on, as by default)
        probe = {g.id: self.rng.uniform(0.9, 1.05) for g in gpus}
        placer.topology_place = make_topology_place(
            m, Topology.from_gpus(gpus), scorer=lambda: placer.scorer, probe_score=probe.get,
            probe_measured=m.measured.get, default_policy="preferred", objective="pack")
        placer.use(LearnedScorer(bundle), "v1")
        self.m, self.placer = m, placer
        self.active = {}
        for i, g in enumerate(gpus):  # one lease per GPU, ACTIVE while it holds it (drawn again at every decision)
            lease = new_lease(f"a-{i}", f"uuid-a{i}", f"vm-a{i}", LeaseRequest(gpus=1, task_type=self.rng.choice(TASKS),
                              duration_s=self.rng.choice([3600, None])), NOW0 - 7200)
            dev = LeaseDevice(g.id, (str(g.address),), ("nvidia",), i)
            lease = lease.transition(S.BINDING, devices=(dev,), granted_gpus=1, expires_at=NOW0 + 3600)
            lease = lease.transition(S.ATTACHING).transition(S.ACTIVE, granted_at=NOW0 - 7000)
            self.active[g.id] = lease
        for k in range(QUEUE):
            self.enqueue(NOW0 - (QUEUE - k) * 60.0)
        self.flip()

    def enqueue(self, at: float) -> None:
        """A new QUEUED lease (REQUESTED -> QUEUED, as grant_path._enqueue does); two per VM on average."""
        rng = self.rng
        self.serial += 1
        vm = rng.randrange(QUEUE // 2)
        req = LeaseRequest(gpus=rng.choice([1, 1, 1, 2]), task_type=rng.choice(TASKS),
                           min_memory_gib=rng.choice([0, 0, 12, 20]), duration_s=rng.choice([600, 3600, 14400, None]),
                           priority=rng.choice([0, 0, 0, 1, 2]) if self.mixed else 0, accept_deferred=True)
        lease = new_lease(f"q-{self.serial}", f"uuid-q{vm}", f"vm-q{vm}", req, at)
        self.m.leases[lease.id] = lease.transition(S.QUEUED, queued_at=at)
        self.m.vm_numa[lease.domain_uuid] = VmNuma(vm % 2, "bench")

    def flip(self) -> None:
        """Draw again which GPUs are held (each with probability 1/2), and when each holder is expected to end."""
        m, rng = self.m, self.rng
        m.claims.clear()
        for gid, lease in self.active.items():
            if rng.random() < 0.5:
                self.active[gid] = lease = lease.with_changes(expires_at=self.now + rng.uniform(300, 8 * 3600))
                m.leases[lease.id] = lease
                m.claims[gid] = lease.id
            else:
                m.leases.pop(lease.id, None)
        m.step_count += 1

    def step(self, granted: Lease | None) -> None:
        """Between decisions: the lease granted leaves the queue for a new one, time moves, holders change."""
        self.now += 10.0
        if granted is not None:
            self.m.leases.pop(granted.id, None)
            self.enqueue(self.now)
        self.flip()

    def fresh_model(self, of: ModelBundle) -> None:
        """A model switch as services.model_follow makes it: a new bundle (its own feature encoder, so its device
        rows are cold too) and scorer handed to placer.use, which clears the placer's predictions."""
        bundle = copy.copy(of)
        bundle.encoder = FeatureEncoder(of.vocabulary)
        self.placer.use(LearnedScorer(bundle), f"v{self.serial}")

    def using(self, bundle: ModelBundle) -> None:
        """The placer decides with this model from now on (a switch, as fresh_model, when it is another)."""
        if getattr(self.placer.scorer, "bundle", None) is not bundle:
            self.placer.use(LearnedScorer(bundle), f"v{self.serial}")


def decide(m: LeaseManager) -> Lease | None:
    """One queue decision: the lease to grant and the GPUs the placer picks for it (as drain + claim do)."""
    pick = lease_queue._next_grant(m)
    if pick is None:
        return None
    lease, free, count, _ = pick
    try:
        m.place(lease.request, free, count, lease.domain_uuid)
    except Conflict:  # no acceptable set (claim's Conflict): it keeps waiting
        pass
    return lease


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of sorted xs, in ms."""
    return xs[int(q * (len(xs) - 1))] * 1e3


class Samples:
    """One row's timed decisions, gathered over the rounds."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.place_s = 0.0
        self.idle = 0

    def figures(self) -> dict[str, float]:
        """p50/p99 wall and CPU (this thread's) ms, the placer's share of the wall time, how many granted nothing."""
        total = sum(self.wall)
        wall, cpu = sorted(self.wall), sorted(self.cpu)
        return {"p50": pct(wall, 0.5), "p99": pct(wall, 0.99), "cpu50": pct(cpu, 0.5), "cpu99": pct(cpu, 0.99),
                "place": self.place_s / total if total else 0.0, "idle": self.idle}


def run(b: Bench, decisions: int, before: Callable[[], None] | None = None,
        into: Samples | None = None) -> Samples:
    """`decisions` timed decisions, added to `into` (a new Samples when None)."""
    got = into if into is not None else Samples()
    gc.collect()
    for _ in range(decisions):
        if before is not None:
            before()
        c0, t0 = time.thread_time(), time.perf_counter()
        pick = lease_queue._next_grant(b.m)
        t1 = time.perf_counter()
        if pick is not None:
            lease, free, count, _ = pick
            try:
                b.m.place(lease.request, free, count, lease.domain_uuid)
            except Conflict:  # no acceptable set (claim's Conflict): it keeps waiting
                pass
        t2, c2 = time.perf_counter(), time.thread_time()
        got.wall.append(t2 - t0)
        got.cpu.append(c2 - c0)
        got.place_s += t2 - t1
        got.idle += pick is None
        b.step(pick[0] if pick else None)
    return got


def census(b: Bench, decisions: int) -> tuple[float, float, float]:
    """(untimed) per decision: the mean number of queued leases compared (domain.assignment.choose's candidates),
    of request shapes the placer was asked to predict, and the share of decisions that started a lease ahead of
    another of its priority (comparative advantage)."""
    compared, asked, ahead = 0, 0, 0
    real_rates, real_choose = b.m.relative_rates, lease_queue.choose

    def counting(request: LeaseRequest, gpus: object) -> object:
        nonlocal asked
        asked += bool(gpus)
        return real_rates(request, gpus)  # type: ignore[arg-type]

    def candidates(cands: list[object], *args: object) -> object:
        nonlocal compared
        compared += len(cands)
        return real_choose(cands, *args)  # type: ignore[arg-type]

    b.m.relative_rates = counting  # type: ignore[assignment]
    lease_queue.choose = candidates  # type: ignore[assignment]
    try:
        for _ in range(decisions):
            pick = lease_queue._next_grant(b.m)
            ahead += bool(pick and pick[3] and "comparative advantage" in pick[3])
            b.step(pick[0] if pick else None)
    finally:
        b.m.relative_rates = real_rates
        lease_queue.choose = real_choose
    return compared / decisions, asked / decisions, ahead / decisions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=1000, help="timed decisions per row (default 1000; a quarter for the cold rows)")
    ap.add_argument("--profile", action="store_true", help="then profile (a) at 64 GPUs, one priority")
    args = ap.parse_args()
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    rng = random.Random(0)
    t0 = time.perf_counter()
    bundle = fit(examples_from_records(records(3000, rng)))
    fit_s = time.perf_counter() - t0
    loaded = ModelBundle.from_bytes(bundle.to_bytes())
    # the same model with its trees kept: where the devices' own figures carry signal (probe score, NUMA, memory
    # headroom) the fit keeps them (residual weight 1) and every prediction walks them; this bench's records have
    # none beyond the (task, model) pairs, so its fit keeps the matrix alone
    trees = copy.copy(loaded)
    trees.residual_weight = 1.0
    n = args.decisions
    cold_n = max(100, n // 4)
    print(f"model: {bundle.trained_on} records, {len(bundle.estimator._predictors)} trees, fit {fit_s:.2f} s, "
          f"flattened trees {'on' if loaded.forest is not None else 'OFF (estimator.predict)'}; queue of {QUEUE}; "
          f"{n} timed decisions per row ({cold_n} for the cold rows), the rows in turn over {ROUNDS} rounds; "
          f"residual weight {loaded.residual_weight:g} "
          f"({'the trees kept' if loaded.walks_trees else 'the matrix alone predicts'}), "
          f"'trees' rows: the same model with its trees kept")
    print(f"{'gpus':>4} {'queue':<5} {'policy':<24} {'p50_ms':>7} {'p99_ms':>7} {'cpu_p50':>7} {'cpu_p99':>7} "
          f"{'place':>5} {'target_p99':>10}")
    notes = []
    for size in (16, 64):
        gpus = host(size)
        for mixed in (False, True):
            qname = "mixed" if mixed else "same"
            b = Bench(gpus, loaded, mixed, seed=size * 10 + mixed)
            rows: list[tuple[str, Callable[[], None] | None, LeasePolicy, int, ModelBundle]] = [
                ("strict (baseline)", None, LeasePolicy(fairness=Fairness(enabled=False)), n, loaded),
                ("advantage, warm", None, LeasePolicy(), n, loaded),
                ("advantage, cold model", lambda: b.fresh_model(loaded), LeasePolicy(), cold_n, loaded),
                ("advantage, warm, trees", None, LeasePolicy(), n, trees),
                ("advantage, cold, trees", lambda: b.fresh_model(trees), LeasePolicy(), cold_n, trees),
            ]
            # the rows take turns, ROUNDS rounds of a share each, so that a slow spell of a shared machine falls on
            # every row alike; before each share some untimed decisions (after a cold share, the model in use is
            # the last cold one: its predictions are made there, untimed, before a warm share is timed)
            samples = {name: Samples() for name, *_ in rows}
            settle_heap()  # as the agent does once started (agent.gc_freeze, on by default)
            for _ in range(ROUNDS):
                for name, before, policy, count, model in rows:
                    b.m.policy = policy
                    b.using(model)  # a switch when the row before used another (its untimed decisions warm it)
                    run(b, WARM_UP // ROUNDS if before is None else 2, before)
                    run(b, count // ROUNDS, before, into=samples[name])
                    if before is not None:
                        settle_heap()  # and after each model switch (services.model_follow's after_switch)
            for name, *_ in rows:
                r = samples[name].figures()
                tgt = f"{TARGETS[size]:.1f}" if name.startswith("advantage") else ""
                print(f"{size:>4} {qname:<5} {name:<24} {r['p50']:>7.3f} {r['p99']:>7.3f} {r['cpu50']:>7.3f} "
                      f"{r['cpu99']:>7.3f} {r['place']:>5.0%} {tgt:>10}" + (f"  ({r['idle']} granted nothing)"
                                                                           if r["idle"] else ""))
            compared, asked, ahead = census(b, 300)
            notes.append(f"{size} GPUs, {qname} priority: {compared:.1f} queued leases compared per decision, "
                         f"{asked:.1f} request shapes asked of the placer, {ahead:.0%} of decisions started a lease "
                         f"ahead of its turn; {len(b.placer._rates)} predictions cached")
    for line in notes:
        print(line)
    print(f"targets: p99 <= 1 ms at 16 GPUs, <= 3 ms at 64 GPUs (advantage rows); wall {time.perf_counter() - t_start:.0f} s")
    load1 = os.getloadavg()
    print("load average (1/5/15 min): " + " ".join(f"{x:.2f}" for x in load0) + " before, "
          + " ".join(f"{x:.2f}" for x in load1) + f" after ({os.cpu_count()} CPUs)")
    if args.profile:
        b = Bench(host(64), loaded, False, seed=7)
        run(b, 200)
        prof = cProfile.Profile()
        for _ in range(min(n, 500)):
            prof.enable()
            got = decide(b.m)
            prof.disable()
            b.step(got)
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(15)
        stats.sort_stats("cumulative").print_stats(25)
        print(f"profile of (a) at 64 GPUs, one priority, {min(n, 500)} decisions (the decisions only):")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
