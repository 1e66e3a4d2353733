#!/usr/bin/env python3
"""Load: 200 simulated guests lease (accept_deferred), heartbeat every second and release, against a 16-GPU host.

The agent runs as a subprocess (`hostagent demo`, simulated hypervisor: attach 50 ms, detach acknowledged after
200 ms) over a prepared host with one VM per guest; all traffic goes to 127.0.0.1. Each guest loops: POST
/v1/leases (201 granted or 202 queued), polls a queued lease every second until ACTIVE, heartbeats every second
for 2-6 s, DELETEs it. Figures per endpoint (throughput, p50/p99 latency, statuses), errors (anything but the
intended 201/200 and the intended 202/409, which are counted apart), the agent's RSS sampled from /proc (first,
last, max, slope after warm-up) and its CPU use. Baselines in the same run, against the same agent: the same
number of clients each calling GET /healthz once a second (the HTTP floor on this machine), and 20 guests.

    python scripts/bench_load.py [--guests 200] [--duration 180] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import re
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostagent.bench.agentproc import AgentProcess, prepare_host, read_cpu_s, read_rss_kib  # noqa: E402
from hostagent.bench.machine import header_line  # noqa: E402
from hostagent.bench.stats import percentile, slope  # noqa: E402

LEASES = "POST /v1/leases"
POLL = "GET /v1/leases/{id}"
BEAT = "POST /v1/leases/{id}/heartbeat"
RELEASE = "DELETE /v1/leases/{id}"
HEALTH = "GET /healthz"
ENDPOINTS = (LEASES, POLL, BEAT, RELEASE, HEALTH)
ROUTES = {("POST", "/v1/leases"): LEASES, ("GET", "/v1/leases/{lease_id}"): POLL,
          ("POST", "/v1/leases/{lease_id}/heartbeat"): BEAT, ("DELETE", "/v1/leases/{lease_id}"): RELEASE,
          ("GET", "/healthz"): HEALTH}
# Statuses that are the API doing its job under contention, not failures: a queued grant, a release whose detach
# is still pending, a refusal (queue full / lease still being set up).
INTENDED = {LEASES: {202, 409}, RELEASE: {202, 409}}
SETTING_UP = ("QUEUED", "BINDING", "ATTACHING")
EXPECTED = {LEASES: {201}, POLL: {200}, BEAT: {200}, RELEASE: {200}, HEALTH: {200}}


@dataclass
class Phase:
    """Everything measured in one phase."""

    name: str
    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    statuses: dict[str, collections.Counter[int | str]] = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    server: dict[str, tuple[float, int]] = field(default_factory=dict)  # endpoint -> (seconds, count) in handlers
    granted: int = 0
    released: int = 0
    queue_waits: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    agent_cpu_s: float = 0.0
    client_cpu_s: float = 0.0

    def record(self, endpoint: str, status: int | str, seconds: float) -> None:
        """One request's outcome."""
        self.latencies[endpoint].append(seconds)
        self.statuses[endpoint][status] += 1

    def counts(self) -> tuple[int, int, int]:
        """(expected, intended, errors) over every endpoint."""
        ok = intended = errors = 0
        for ep, c in self.statuses.items():
            for status, n in c.items():
                if status in EXPECTED.get(ep, ()):
                    ok += n
                elif status in INTENDED.get(ep, ()):
                    intended += n
                else:
                    errors += n
        return ok, intended, errors


class Client:
    """A timed HTTP call that never raises: transport failures are recorded as errors."""

    def __init__(self, session: aiohttp.ClientSession, url: str, phase: Phase) -> None:
        self.session, self.url, self.phase = session, url, phase

    async def call(self, endpoint: str, method: str, path: str, token: str | None = None,
                   body: Any = None) -> tuple[int | str, Any]:
        """Send one request; returns (status or error name, JSON body or None)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        t0 = time.perf_counter()
        try:
            async with self.session.request(method, self.url + path, json=body, headers=headers) as r:
                data = await r.json(content_type=None) if r.content_length != 0 else None
                status: int | str = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            status, data = type(exc).__name__, None
        self.phase.record(endpoint, status, time.perf_counter() - t0)
        return status, data


async def guest(c: Client, token: str, rng: random.Random, deadline: float) -> None:
    """One guest: lease (queued or not), heartbeat every second for 2-6 s, release; until the deadline."""
    while time.monotonic() < deadline:
        asked = time.monotonic()
        status, lease = await c.call(LEASES, "POST", "/v1/leases", token,
                                     {"gpus": 1, "accept_deferred": True, "task_type": "training", "duration_s": 3600})
        if status not in (201, 202) or not isinstance(lease, dict):
            await asyncio.sleep(1.0)  # refused (409) or failed: try again in a second
            continue
        lid = lease["id"]
        state = lease["state"]
        gpu_ids = [d["gpu_id"] for d in lease["devices"]]
        # Poll a queued lease once a second; one granted from the queue passes through BINDING/ATTACHING briefly.
        while state in SETTING_UP and (state != "QUEUED" or time.monotonic() < deadline):
            await asyncio.sleep(1.0 if state == "QUEUED" else 0.05)
            status, body = await c.call(POLL, "GET", f"/v1/leases/{lid}", token)
            if status == 200 and isinstance(body, dict):
                state = body["state"]
                gpu_ids = [d["gpu_id"] for d in body["devices"]]
        if state == "ACTIVE":
            c.phase.granted += 1
            c.phase.queue_waits.append(time.monotonic() - asked)
            beats = rng.randint(2, 6)
            start = time.monotonic()
            for k in range(1, beats + 1):
                # Fixed rate: a slow reply does not make the guest send fewer heartbeats.
                await asyncio.sleep(max(0.0, start + k - time.monotonic()))
                samples = [{"ts": time.time(), "gpu": g, "util_pct": 70.0, "mem_used_bytes": 8 << 30} for g in gpu_ids]
                await c.call(BEAT, "POST", f"/v1/leases/{lid}/heartbeat", token, {"samples": samples})
        elif state != "QUEUED":
            continue  # ended while queued (expired?): counted through its statuses; ask again
        for _ in range(50):
            status, _body = await c.call(RELEASE, "DELETE", f"/v1/leases/{lid}", token)
            if status != 409:  # 409: still being set up; ask again shortly
                break
            await asyncio.sleep(0.1)
        if status in (200, 202):
            c.phase.released += 1


async def health_client(c: Client, deadline: float, offset: float) -> None:
    """Baseline client: GET /healthz once a second."""
    await asyncio.sleep(offset)
    start = time.monotonic()
    k = 0
    while time.monotonic() < deadline:
        await c.call(HEALTH, "GET", "/healthz")
        k += 1
        await asyncio.sleep(max(0.0, start + k - time.monotonic()))


def client_cpu() -> float:
    """CPU seconds this (client) process has used."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, tuple[float, int]]:
    """The agent's own request-duration histogram (time inside its middleware): endpoint -> (sum s, count)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, tuple[float, int]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "hostagent_http_request_duration_seconds":
            continue
        for smp in fam.samples:
            ep = ROUTES.get((smp.labels.get("method", ""), smp.labels.get("route", "")))
            if ep is None or smp.name.endswith("_bucket") or smp.name.endswith("_created"):
                continue
            total, count = out.get(ep, (0.0, 0))
            if smp.name.endswith("_sum"):
                out[ep] = (total + smp.value, count)
            elif smp.name.endswith("_count"):
                out[ep] = (total, count + int(smp.value))
    return out


async def run_phase(name: str, url: str, agent_pid: int, seconds: float, make: Any) -> Phase:
    """Run `make(client, i, deadline)` for i < make.count until `seconds` have passed (guests then finish their lease)."""
    phase = Phase(name)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    cpu0, ccpu0, t0 = read_cpu_s(agent_pid) or 0.0, client_cpu(), time.perf_counter()
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        before = await scrape(session, url)
        c = Client(session, url, phase)
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(make(c, i, deadline) for i in range(make.count)))
        after = await scrape(session, url)
        phase.server = {ep: (after[ep][0] - before.get(ep, (0.0, 0))[0], after[ep][1] - before.get(ep, (0.0, 0))[1])
                        for ep in after}
    phase.wall_s = time.perf_counter() - t0
    phase.agent_cpu_s = (read_cpu_s(agent_pid) or 0.0) - cpu0
    phase.client_cpu_s = client_cpu() - ccpu0
    return phase


class GuestsFactory:
    """Builds one guest coroutine per VM token, with a seeded RNG each."""

    def __init__(self, tokens: list[str], seed: int) -> None:
        self.tokens, self.seed, self.count = tokens, seed, len(tokens)

    def __call__(self, c: Client, i: int, deadline: float) -> Any:
        # Spread the start over the first second like guests booting, not one burst.
        async def go() -> None:
            await asyncio.sleep(i / self.count)
            await guest(c, self.tokens[i], random.Random(self.seed + i), deadline)
        return go()


class HealthFactory:
    """N clients on GET /healthz, starts spread over one second."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self, c: Client, i: int, deadline: float) -> Any:
        return health_client(c, deadline, i / self.count)


MEMORY_PARTS = re.compile(r'^hostagent_memory_bytes\{part="(\w+)"\} (\S+)$', re.M)


async def sample_memory(pid: int, url: str, every_s: float, rss: list[tuple[float, int]],
                        parts: list[tuple[float, dict[str, float]]], stop: asyncio.Event) -> None:
    """Every `every_s` until stopped: (seconds since start, VmRSS KiB) from /proc, and the agent's own split of its
    memory (malloc in use, malloc free, SQLite: `hostagent_memory_bytes` in /metrics, bytes)."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            kib = read_rss_kib(pid)
            if kib is not None:
                rss.append((time.monotonic() - t0, kib))
            try:
                async with s.get(url + "/metrics") as r:
                    text = await r.text()
                parts.append((time.monotonic() - t0, {k: float(v) for k, v in MEMORY_PARTS.findall(text)}))
            except aiohttp.ClientError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass


def print_memory(rss: list[tuple[float, int]], parts: list[tuple[float, dict[str, float]]], main_from: float,
                 every_s: float) -> tuple[float, float | None]:
    """RSS over the run and, after the load phase's first fifth (start-up, the queue filling up), the slope of RSS
    and of each part the agent reports; returns the slopes in MiB/min of RSS and of the agent's own objects (malloc
    in use less SQLite's page caches; None when the agent did not report its parts)."""
    t_all = [t for t, _ in rss]
    k_all = [k for _, k in rss]
    print(f"agent RSS (VmRSS every {every_s:g} s, {len(rss)} samples): first "
          f"{k_all[0] / 1024:.1f} MiB, last {k_all[-1] / 1024:.1f} MiB, max {max(k_all) / 1024:.1f} MiB over "
          f"{t_all[-1]:.0f} s")
    body = [(t, k) for t, k in rss if t >= main_from]
    warm = body[len(body) // 5:]
    if len(warm) < 2:
        return 0.0, None
    sl = slope([t for t, _ in warm], [k for _, k in warm]) * 60 / 1024  # MiB per minute
    print(f"  load phase after warm-up: {warm[0][1] / 1024:.1f} -> {warm[-1][1] / 1024:.1f} MiB, "
          f"slope {sl:+.3f} MiB/min over {warm[-1][0] - warm[0][0]:.0f} s")
    held = [(t, p) for t, p in parts if t >= warm[0][0]]
    slopes: dict[str, float] = {}
    for name, what in (("malloc_in_use", "malloc in use (grows with a leak)"),
                       ("malloc_free", "malloc free, kept (fragmentation)"), ("sqlite", "SQLite (page caches)")):
        pts = [(t, p[name]) for t, p in held if name in p]
        if len(pts) >= 2:
            ps = slopes[name] = slope([t for t, _ in pts], [v for _, v in pts]) * 60 / 2**20
            print(f"    {what:<36} {pts[0][1] / 2**20:6.1f} -> {pts[-1][1] / 2**20:6.1f} MiB, slope {ps:+.3f} MiB/min")
    own = slopes["malloc_in_use"] - slopes["sqlite"] if {"malloc_in_use", "sqlite"} <= slopes.keys() else None
    if own is not None:
        label = "own objects (in use less SQLite)"
        print(f"    {label:<36} {'':22}slope {own:+.3f} MiB/min")
    print("  rss trace (s: MiB): " + ", ".join(f"{t:.0f}: {k / 1024:.1f}" for t, k in rss[:: max(1, len(rss) // 12)]))
    return sl, own


RSS_FLAT_MIB_MIN = 0.5  # RSS slope under which memory is flat
OWN_FLAT_MIB_MIN = 0.1  # the agent's own objects' slope under which a rising RSS is caches and free memory, no leak


def memory_verdict(rss_slope: float, own_slope: float | None) -> str:
    """Flat RSS; or RSS rising while the agent's own objects stay flat (SQLite's page caches, at most 2000 KiB per
    connection by SQLite's default, filling as the files grow, and free memory malloc keeps): no leak seen; or a
    leak to look for."""
    if abs(rss_slope) < RSS_FLAT_MIB_MIN:
        return "flat (no leak seen)"
    if own_slope is not None and own_slope < OWN_FLAT_MIB_MIN:
        return (f"RSS rising, the agent's own objects flat ({own_slope:+.3f} MiB/min): SQLite page caches and "
                "malloc's free memory, no leak seen")
    return "GROWING: look for a leak"


async def end_state(url: str, operator: str) -> tuple[int, int, list[str]]:
    """(GPUs FREE, GPUs total, live leases as 'id state domain') once the run is over."""
    h = {"Authorization": f"Bearer {operator}"}
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/gpus", headers=h) as r:
            gpus = (await r.json())["gpus"]
        live = "QUEUED,BINDING,ATTACHING,ACTIVE,RELEASING,DETACHING,DETACH_PENDING,REBINDING"
        leases: list[dict[str, Any]] = []
        page = f"/v1/leases?state={live}&limit=1000"
        while page:
            async with s.get(url + page, headers=h) as r:
                body = await r.json()
            leases += body["leases"]
            page = f"/v1/leases?state={live}&limit=1000&cursor={body['next_cursor']}" if body["next_cursor"] else ""
    return (sum(1 for g in gpus if g["state"].upper() == "FREE"), len(gpus),
            [f"{x['id']} {x['state']} {x['domain']['name']} ({x['end_reason'] or 'no end reason'})" for x in leases])


def server_mean(p: Phase, ep: str) -> str:
    """Mean time inside the agent's handlers (its own histogram), in ms."""
    total, count = p.server.get(ep, (0.0, 0))
    return f"{total / count * 1e3:.2f}" if count else "-"


def print_phase(p: Phase) -> None:
    """Per-endpoint table of one phase."""
    ok, intended, errors = p.counts()
    total = ok + intended + errors
    print(f"\n[{p.name}]  {total} requests in {p.wall_s:.1f} s = {total / p.wall_s:.0f} req/s; "
          f"errors {errors}, intended 202/409 {intended}; leases granted {p.granted}, released {p.released}; "
          f"agent CPU {p.agent_cpu_s / p.wall_s * 100:.0f} % of one core "
          f"({p.agent_cpu_s / max(total, 1) * 1e3:.2f} ms CPU per request), load client {p.client_cpu_s / p.wall_s * 100:.0f} %")
    print(f"  {'endpoint':<32} {'count':>7} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8} "
          f"{'in agent':>8}  statuses")
    for ep in ENDPOINTS:
        lat = p.latencies.get(ep)
        if not lat:
            continue
        st = ", ".join(f"{k}: {v}" for k, v in sorted(p.statuses[ep].items(), key=lambda kv: str(kv[0])))
        print(f"  {ep:<32} {len(lat):>7} {len(lat) / p.wall_s:>7.1f} {percentile(lat, 50) * 1e3:>8.2f} "
              f"{percentile(lat, 99) * 1e3:>8.2f} {max(lat) * 1e3:>8.1f} {sum(lat) / len(lat) * 1e3:>8.2f} "
              f"{server_mean(p, ep):>8}  {st}")
    if p.queue_waits:
        print(f"  time from POST to ACTIVE (queue wait included): p50 {percentile(p.queue_waits, 50):.1f} s, "
              f"p99 {percentile(p.queue_waits, 99):.1f} s")


async def main_async(args: argparse.Namespace) -> int:
    """Prepare, start the agent, run the three phases, print."""
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        state = Path(tmp) / "state"
        creds = prepare_host(state, vms=args.guests, scenario="demo16", attach_latency_s=0.05, detach_ack_delay_s=0.2)
        tokens = [v["token"] for v in creds["vms"]]
        agent = AgentProcess(state)
        url = agent.start()
        rss: list[tuple[float, int]] = []
        parts: list[tuple[float, dict[str, float]]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_memory(agent.pid, url, args.rss_every, rss, parts, stop))
        try:
            base = args.baseline_duration
            print(f"agent pid {agent.pid} at {url}; {args.guests} VMs, 16 simulated GPUs; phases: healthz x{args.guests} "
                  f"{base:.0f} s, 20 guests {base:.0f} s, {args.guests} guests {args.duration:.0f} s")
            health = await run_phase(f"baseline: {args.guests} clients on GET /healthz, 1/s each", url, agent.pid, base,
                                     HealthFactory(args.guests))
            small = await run_phase("baseline: 20 guests", url, agent.pid, base, GuestsFactory(tokens[:20], args.seed))
            main_from = rss[-1][0] if rss else 0.0
            main = await run_phase(f"load: {args.guests} guests", url, agent.pid, args.duration,
                                   GuestsFactory(tokens, args.seed))
            free, total, live = await end_state(url, creds["operator"]["token"])
        finally:
            stop.set()
            await sampler
            agent.stop()
        for p in (health, small, main):
            print_phase(p)
        print("\n(p50/p99/max/mean: seen by the client; in agent: mean time inside the agent's handlers, from its own "
              "request histogram;\n the difference is waiting before a handler runs: event loop, HTTP parsing, CPU "
              "contention, the client)")
        print(f"\nend state: {free}/{total} GPUs FREE, {len(live)} live leases (expected {total}/{total}, 0): "
              f"{'clean' if free == total and not live else 'NOT CLEAN: every guest had its release answered 200/202'}")
        for x in live:
            print(f"  still live: {x}")
        sl, own = print_memory(rss, parts, main_from, args.rss_every)
        _, _, errors = main.counts()
        h50 = percentile(health.latencies[HEALTH], 50)
        print("\nverdict:")
        print(f"  errors under load: {errors} (target 0) -> {'MET' if errors == 0 else 'MISSED'}")
        for ep in (LEASES, POLL, BEAT, RELEASE):
            if main.latencies.get(ep):
                print(f"  {ep:<32} p50 {percentile(main.latencies[ep], 50) * 1e3:7.2f} ms = "
                      f"{percentile(main.latencies[ep], 50) / h50:5.1f} x the /healthz floor ({h50 * 1e3:.2f} ms); "
                      f"with 20 guests {percentile(small.latencies.get(ep, []), 50) * 1e3:.2f} ms")
        print(f"  memory: RSS {sl:+.3f} MiB/min after warm-up -> {memory_verdict(sl, own)}")
        return 0 if errors == 0 and free == total and not live else 1


def main() -> int:
    """Parse arguments and run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guests", type=int, default=200)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of the main load phase")
    ap.add_argument("--baseline-duration", type=float, default=30.0, help="seconds of each baseline phase")
    ap.add_argument("--rss-every", type=float, default=3.0, help="seconds between RSS samples")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="20 s of load, 5 s baselines (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.baseline_duration, args.rss_every = 20.0, 5.0, 1.0
    print(header_line())
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
