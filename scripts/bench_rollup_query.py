#!/usr/bin/env python3
"""Dashboard query latency over 30 days of 10-second samples for 16 GPUs (~4.1 million raw rows), from rollups.

Raw rows are bulk-inserted (PyMySQL executemany); rollups are made by the store's own path (``rollup_rows`` and
the upsert helper), so the buckets are what ingestion would have produced. Then dashboard queries (a GPU's month
by hour, a day by minute, a week by 6 h, a lease's usage summary) run repeatedly and p50/p95 are printed.
With no --db, a temporary MariaDB database on 127.0.0.1:3306 is created and dropped afterwards.

    python scripts/bench_rollup_query.py [--small] [--db URL] [--repeat 50]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ingest import COLUMNS, database, pymysql_conn  # noqa: E402
from hostagent.store import schema as t  # noqa: E402
from hostagent.store.migrate import upgrade  # noqa: E402
from hostagent.store.repo import UsageStore  # noqa: E402
from hostagent.store.samples import ROLLUP_ADD, ROLLUP_GREATEST, ROLLUP_KEYS, ROLLUP_LEAST, Sample, rollup_rows  # noqa: E402
from hostagent.store.upsert import upsert  # noqa: E402

HOST = "bench-host"


def generate(store: UsageStore, url: str, days: float, gpus: int, step_s: int, start: int) -> int:
    """Insert ``days`` of samples for ``gpus`` GPUs, one day at a time; returns the raw row count."""
    rng = random.Random(1)
    conn = pymysql_conn(url)
    sql = f"INSERT INTO usage_samples ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * len(COLUMNS))})"
    total = 0
    per_day = int(86400 // step_s)
    for day in range(int(days * 86400 // 86400) or 1):
        samples = []
        for i in range(per_day if days >= 1 else int(days * 86400 // step_s)):
            ts = start + day * 86400 + i * step_s
            busy = (ts // 3600) % 24 not in (2, 3, 4)  # a nightly idle window
            for g in range(gpus):
                samples.append(Sample(f"gpu-{g}", ts * 1000, f"L{g}", "guest",
                                      rng.uniform(60, 100) if busy else rng.uniform(0, 3),
                                      rng.randrange(1 << 30, 40 << 30), rng.uniform(0, 50), rng.uniform(100, 900)))
        with conn.cursor() as cur:
            rows = [(HOST, s.gpu_id, s.ts_ms, s.lease_id, s.source, s.util_pct, s.mem_used_bytes, s.work_rate,
                     s.vfio_irq_rate) for s in samples]
            for k in range(0, len(rows), 5000):
                cur.executemany(sql, rows[k:k + 5000])
        conn.commit()
        with store.engine.begin() as c:
            ru = rollup_rows(HOST, samples)
            for k in range(0, len(ru), 5000):
                upsert(c, t.usage_rollups, ru[k:k + 5000], keys=ROLLUP_KEYS, add=ROLLUP_ADD, least=ROLLUP_LEAST,
                       greatest=ROLLUP_GREATEST)
        total += len(samples)
        print(f"  day {day + 1}: {total} raw rows", file=sys.stderr)
    conn.close()
    return total


def timed(fn: object, repeat: int) -> tuple[float, float]:
    """p50 and p95 of ``fn()`` in milliseconds."""
    took = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        took.append((time.perf_counter() - t0) * 1000)
    took.sort()
    return statistics.median(took), took[min(len(took) - 1, int(round(0.95 * (len(took) - 1))))]


def main() -> int:
    """Generate, query, print."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="SQLAlchemy URL of a MariaDB database (default: a temporary one)")
    ap.add_argument("--small", action="store_true", help="2 days instead of 30 (a fast run)")
    ap.add_argument("--days", type=float, default=None)
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--step", type=int, default=10, help="seconds between samples")
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    days = args.days or (2 if args.small else 30)
    with database(args.db) as url, tempfile.TemporaryDirectory() as tmp:
        upgrade(url)
        store = UsageStore(url, HOST, spool_path=Path(tmp) / "spool.sqlite3")
        end = int(time.time()) // 86400 * 86400
        start = end - int(days * 86400)
        store.upsert_gpus([{"gpu_id": f"gpu-{g}", "address": f"0000:{g + 1:02x}:00.0"} for g in range(args.gpus)])
        for g in range(args.gpus):
            store.insert_lease({"id": f"L{g}", "domain_uuid": f"vm-{g}", "state": "ACTIVE", "created_at": start,
                                "request": {"gpus": 1}})
        t0 = time.perf_counter()
        raw = generate(store, url, days, args.gpus, args.step, start)
        gen_s = time.perf_counter() - t0
        with store.engine.connect() as c:
            from sqlalchemy import func, select
            r = t.usage_rollups.c
            minute = c.execute(select(func.count()).where(r.resolution == 60)).scalar_one()
            hour = c.execute(select(func.count()).where(r.resolution == 3600)).scalar_one()
        rng = random.Random(2)
        gpu = lambda: f"gpu-{rng.randrange(args.gpus)}"  # noqa: E731
        queries = {
            f"{days:g} days by hour, one GPU": lambda: store.gpu_history(gpu(), start, end, "hour"),
            "1 day by minute, one GPU": lambda: store.gpu_history(
                gpu(), (d := start + rng.randrange(max(1, int(days) - 1)) * 86400), d + 86400, "minute"),
            "7 days by 6 h, one GPU": lambda: store.gpu_history(gpu(), max(start, end - 7 * 86400), end, 21600),
            f"lease usage summary ({days:g} days)": lambda: store.lease_usage_summary(f"L{rng.randrange(args.gpus)}"),
        }
        print(f"raw samples          {raw}  (generated in {gen_s:.1f} s)")
        print(f"rollup rows          {minute} minute, {hour} hour")
        print(f"{'query':40s} {'p50 ms':>9s} {'p95 ms':>9s}   ({args.repeat} runs each)")
        for name, fn in queries.items():
            fn()  # warm the cache the way a dashboard does after its first view
            p50, p95 = timed(fn, args.repeat)
            print(f"{name:40s} {p50:9.2f} {p95:9.2f}")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
