#!/usr/bin/env python3
"""Heartbeat ingestion throughput: the agent's path (SampleIngestor -> UsageStore) vs raw PyMySQL executemany.

Both write the same rows into the same MariaDB database in one run; prints samples/s of each and their ratio
(target >= 0.8), then counts rows to show nothing was lost. With no --db, a temporary database is created on
127.0.0.1:3306 (root) and dropped afterwards.

    python scripts/bench_ingest.py [--db mysql+pymysql://root@127.0.0.1/x] [--samples 100000] [--gpus 16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

import pymysql
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostagent.domain.errors import Overloaded  # noqa: E402
from hostagent.store.ingest import SampleIngestor  # noqa: E402
from hostagent.store.migrate import upgrade  # noqa: E402
from hostagent.store.repo import UsageStore  # noqa: E402

COLUMNS = ("host_id", "gpu_id", "ts_ms", "lease_id", "source", "util_pct", "mem_used_bytes", "work_rate",
           "vfio_irq_rate")


@contextmanager
def database(url: str | None) -> Iterator[str]:
    """The given URL, or a temporary MariaDB database dropped afterwards."""
    if url:
        yield url
        return
    name = f"bench_ingest_{uuid.uuid4().hex[:8]}"
    admin = pymysql.connect(host="127.0.0.1", port=3306, user="root", autocommit=True)
    admin.cursor().execute(f"CREATE DATABASE `{name}`")
    try:
        yield f"mysql+pymysql://root@127.0.0.1:3306/{name}"
    finally:
        admin.cursor().execute(f"DROP DATABASE `{name}`")
        admin.close()


def heartbeats(gpus: int, total: int, t0: float) -> list[list[dict[str, object]]]:
    """One heartbeat = one sample per GPU at one instant, 10 s apart."""
    out = []
    for i in range(total // gpus):
        out.append([{"gpu_id": f"gpu-{g}", "ts": t0 + i * 10, "lease_id": "bench", "util_pct": float((i + g) % 100),
                     "mem_used_bytes": (i % 40) << 28, "work_rate": 1.5, "vfio_irq_rate": 300.0} for g in range(gpus)])
    return out


def pymysql_conn(url: str) -> pymysql.connections.Connection:
    """A PyMySQL connection for the SQLAlchemy URL."""
    u = make_url(url)
    return pymysql.connect(host=u.host or "127.0.0.1", port=u.port or 3306, user=u.username or "root",
                           password=u.password or "", database=u.database, autocommit=False)


def raw_insert(url: str, beats: list[list[dict[str, object]]], batch: int) -> float:
    """Raw executemany of the same rows, committed per batch like the agent; returns seconds."""
    rows = [("bench-raw", s["gpu_id"], int(float(s["ts"]) * 1000), "bench", "guest", s["util_pct"],  # type: ignore[arg-type]
             s["mem_used_bytes"], s["work_rate"], s["vfio_irq_rate"]) for b in beats for s in b]
    sql = f"INSERT INTO usage_samples ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * len(COLUMNS))})"
    conn = pymysql_conn(url)
    start = time.perf_counter()
    with conn.cursor() as cur:
        for i in range(0, len(rows), batch):
            cur.executemany(sql, rows[i:i + batch])
            conn.commit()
    took = time.perf_counter() - start
    conn.close()
    return took


async def agent_insert(store: UsageStore, beats: list[list[dict[str, object]]], batch: int) -> tuple[float, dict[str, int]]:
    """Heartbeats submitted as the web handler would, flushed by the ingestor; returns seconds and figures."""
    ing = SampleIngestor(store.write_samples, batch=batch, interval_s=0.05, max_queue=20 * batch)
    ing.start()
    start = time.perf_counter()
    for beat in beats:
        while True:
            try:
                ing.submit(beat)
                break
            except Overloaded:  # back-pressure: what a guest does after a 503
                await asyncio.sleep(0.001)
        if ing.depth % batch == 0:
            await asyncio.sleep(0)  # let the flusher pick up a full batch
    await ing.close()
    return time.perf_counter() - start, ing.figures()


def count(url: str, host: str) -> int:
    """Rows stored for a host."""
    conn = pymysql_conn(url)
    with conn.cursor() as cur:
        cur.execute("SELECT COUNT(*) FROM usage_samples WHERE host_id = %s", (host,))
        (n,) = cur.fetchone()  # type: ignore[misc]
    conn.close()
    return int(n)


def main() -> int:
    """Run both paths and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="SQLAlchemy URL of a MariaDB database (default: a temporary one)")
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1000)
    args = ap.parse_args()
    with database(args.db) as url, tempfile.TemporaryDirectory() as tmp:
        upgrade(url)
        beats = heartbeats(args.gpus, args.samples, time.time() - 30 * 86400)
        n = len(beats) * args.gpus
        store = UsageStore(url, "bench-agent", spool_path=Path(tmp) / "spool.sqlite3")
        store.upsert_gpus([{"gpu_id": f"gpu-{g}", "address": f"0000:{g + 1:02x}:00.0"} for g in range(args.gpus)])
        store.insert_lease({"id": "bench", "domain_uuid": "bench-vm", "state": "ACTIVE", "created_at": time.time(),
                            "request": {"gpus": args.gpus}})
        raw_s = raw_insert(url, beats, args.batch)
        agent_s, fig = asyncio.run(agent_insert(store, beats, args.batch))
        store.close()
        raw_rate, agent_rate = n / raw_s, n / agent_s
        got_agent, got_raw = count(url, "bench-agent"), count(url, "bench-raw")
        print(f"samples per path     {n}")
        print(f"raw PyMySQL          {raw_rate:12.0f} samples/s  ({raw_s:.2f} s)")
        print(f"agent path           {agent_rate:12.0f} samples/s  ({agent_s:.2f} s, with rollups)")
        print(f"ratio agent/raw      {agent_rate / raw_rate:12.2f}  (target >= 0.80)")
        print(f"stored agent/raw     {got_agent} / {got_raw}; ingestor figures {fig}")
        if got_agent != n or got_raw != n or fig["dropped"] or fig["rejected"]:
            print("LOST SAMPLES", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
