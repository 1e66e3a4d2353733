#!/usr/bin/env python3
"""Dashboard page render latency over a month of history, against an empty store in the same run.

Two demo agents (simulated 16-GPU host, real agent, SQLite usage store) are served in-process on loopback:
  * baseline: nothing recorded;
  * loaded:   30 days of usage samples for every GPU (written through the store's own rollup path,
              UsageStore.write_samples), ~1 lease per GPU per 8 h in the journal, and live leases with heartbeats.
Each main page is fetched --repeat times after logging in; p50/p95 per page are printed for both, with the ratio.

    python scripts/bench_dashboard.py [--small] [--days 30] [--step 300] [--repeat 30]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402

from hostagent.demo import prepare_demo  # noqa: E402
from hostagent.domain.lease import Lease, LeaseDevice, LeaseRequest, LeaseState  # noqa: E402
from hostagent.runtime import build_runtime, make_app  # noqa: E402
from hostagent.store.samples import Sample  # noqa: E402

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
TASKS = ("training", "inference", "notebook", "batch")


def pages(gpu: str) -> list[tuple[str, str]]:
    """(label, path) of the pages timed."""
    return [("overview /", "/"), ("overview json", "/ui/api/overview"),
            ("gpu 24h", f"/ui/gpus/{gpu}?range=24h"), ("gpu 7d", f"/ui/gpus/{gpu}?range=7d"),
            ("gpu 30d", f"/ui/gpus/{gpu}?range=30d"), ("leases 7d", "/ui/leases?window=7d"),
            ("leases 30d by util", "/ui/leases?window=30d&sort=util"), ("reclaim", "/ui/reclaim"),
            ("model", "/ui/model")]


def fill(rt: Any, days: float, step_s: int, now: float) -> tuple[int, int]:
    """Journal leases and store samples for every GPU over `days`; returns (leases, samples)."""
    rng = random.Random(7)
    store = getattr(rt.store, "store", rt.store)  # the sync UsageStore behind the async facade
    gpus = sorted(rt.manager.gpus)
    start = now - days * 86400
    n_leases = n_samples = 0
    for g in gpus:
        t = start
        while t < now - 3600:
            length = rng.uniform(2, 12) * 3600
            end = min(now - 600, t + length)
            busy = rng.random() < 0.8
            lid = f"l-bench{n_leases:07d}"
            reason = rng.choice(["released by guest", "reclaimed: idle" if not busy else "ttl expired"])
            lease = Lease(id=lid, domain_uuid=f"uuid-{n_leases % 6}", domain_name=f"vm-{n_leases % 6}",
                          request=LeaseRequest(gpus=1, task_type=rng.choice(TASKS), priority=rng.randint(0, 9)),
                          state=LeaseState.RELEASED, created_at=t, granted_at=t + 2, ended_at=end, end_reason=reason,
                          devices=(LeaseDevice(g, (), (), 0),), granted_gpus=1,
                          reasons=("bench", f"chose {g}"))
            rt.journal.record(lease, from_state=None, actor="bench", detail="bench history")
            n_leases += 1
            batch = []
            ts = int(t) - int(t) % step_s + step_s
            while ts < end:
                u = rng.uniform(55, 100) if busy else rng.uniform(0, 4)
                batch.append(Sample(g, ts * 1000, lid, "guest", u, int(rng.uniform(1, 30) * 2**30), u * 3.0, None))
                ts += step_s
            for k in range(0, len(batch), 5000):
                store.write_samples(batch[k:k + 5000], check_refs=False)
            n_samples += len(batch)
            t = end + rng.uniform(0.2, 4) * 3600
    return n_leases, n_samples


async def measure(base: str, token: str, gpu: str, repeat: int) -> dict[str, list[float]]:
    """Log in and time every page `repeat` times (after one warm-up fetch each)."""
    jar = aiohttp.CookieJar(unsafe=True)
    out: dict[str, list[float]] = {}
    async with aiohttp.ClientSession(cookie_jar=jar) as http:
        text = await (await http.get(base + "/ui/login")).text()
        csrf = CSRF.search(text).group(1)  # type: ignore[union-attr]
        r = await http.post(base + "/ui/login", data={"token": token, "csrf": csrf}, allow_redirects=False)
        assert r.status == 303, r.status
        for label, path in pages(gpu):
            r = await http.get(base + path)
            assert r.status == 200, (path, r.status, (await r.text())[:300])
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                r = await http.get(base + path)
                await r.read()
                times.append(time.perf_counter() - t0)
            out[label] = times
    return out


async def run_agent(state: Path, *, days: float, step_s: int, repeat: int, load: bool) -> tuple[dict[str, list[float]], str]:
    settings, creds = prepare_demo(state)
    rt = build_runtime(settings)
    server = TestServer(make_app(rt), host="127.0.0.1")
    await server.start_server()
    try:
        gpu = sorted(rt.manager.gpus)[0]
        note = "empty store"
        if load:
            t0 = time.perf_counter()
            n_leases, n_samples = await asyncio.to_thread(fill, rt, days, step_s, time.time())
            note = (f"{len(rt.manager.gpus)} GPUs, {days:g} days, {n_leases} leases, {n_samples} samples every "
                    f"{step_s} s (generated in {time.perf_counter() - t0:.0f} s)")
            # a few live leases with heartbeats, as the dashboard sees them in production
            async with aiohttp.ClientSession() as http:
                for vm in creds["vms"][:3]:
                    h = {"Authorization": f"Bearer {vm['token']}"}
                    r = await http.post(str(server.make_url("/v1/leases")), json={"gpus": 2}, headers=h)
                    body = await r.json()
                    now = time.time()
                    samples = [{"ts": now - i * 10, "gpu": d["gpu_id"], "util_pct": 50 + i % 40,
                                "mem_used_bytes": 2**33} for i in range(300) for d in body["devices"]]
                    await http.post(str(server.make_url(f"/v1/leases/{body['id']}/heartbeat")),
                                    json={"samples": samples}, headers=h)
            await asyncio.sleep(2.0)  # let the ingestor and journal mirror catch up
        results = await measure(str(server.make_url("")).rstrip("/"), creds["operator"]["token"], gpu, repeat)
        return results, note
    finally:
        await server.close()


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs, in milliseconds."""
    s = sorted(xs)
    return 1000 * s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="3 days, 10-minute samples, 10 repeats (a quick run)")
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--step", type=int, default=300, help="seconds between samples of one GPU")
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    if args.small:
        args.days, args.step, args.repeat = 3.0, 600, 10
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        base, base_note = asyncio.run(run_agent(Path(tmp) / "empty", days=0, step_s=args.step, repeat=args.repeat,
                                                load=False))
        loaded, note = asyncio.run(run_agent(Path(tmp) / "loaded", days=args.days, step_s=args.step,
                                             repeat=args.repeat, load=True))
    print(f"dashboard render latency, {args.repeat} fetches per page over loopback (ms)")
    print(f"  baseline: {base_note}")
    print(f"  loaded:   {note}")
    print(f"{'page':<22}{'base p50':>10}{'base p95':>10}{'load p50':>10}{'load p95':>10}{'p50 x':>8}")
    for label in base:
        b50, b95, l50, l95 = pct(base[label], .5), pct(base[label], .95), pct(loaded[label], .5), pct(loaded[label], .95)
        print(f"{label:<22}{b50:>10.1f}{b95:>10.1f}{l50:>10.1f}{l95:>10.1f}{l50 / b50 if b50 else float('nan'):>8.1f}")
    allb = [x for v in base.values() for x in v]
    alll = [x for v in loaded.values() for x in v]
    print(f"{'all pages':<22}{pct(allb, .5):>10.1f}{pct(allb, .95):>10.1f}{pct(alll, .5):>10.1f}{pct(alll, .95):>10.1f}"
          f"{statistics.median(alll) / statistics.median(allb):>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
