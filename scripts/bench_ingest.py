#!/usr/bin/env python3
"""Heartbeat ingestion throughput: the agent's path (SampleIngestor -> UsageStore) vs raw PyMySQL executemany.

Both write the same rows into the same MariaDB database in one run, ``--repeat`` times (alternating which path
goes first); prints samples/s of each run, the medians and the ratio (target >= 0.8), and counts rows (raw and
rolled up) to show nothing was lost or counted twice. The agent's time includes its rollups: it ends when the
ingestor's ``close()`` returns, which waits for them. With no --db, a temporary database is created on
127.0.0.1:3306 (root; --port for another server) and dropped afterwards.

    python scripts/bench_ingest.py [--db mysql+pymysql://root@127.0.0.1/x] [--samples 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
def database(url: str | None, port: int = 3306, *, prefix: str = "bench_ingest",
             keep: bool = False) -> Iterator[str]:
    """The given URL, or a temporary MariaDB database on 127.0.0.1:``port``, dropped afterwards unless ``keep``
    (its name then goes to stderr). The admin connection is pinged before the drop: a long run outlives its idle
    timeout."""
    if url:
        yield url
        return
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = pymysql.connect(host="127.0.0.1", port=port, user="root", autocommit=True)
    admin.cursor().execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    try:
        yield f"mysql+pymysql://root@127.0.0.1:{port}/{name}"
    finally:
        if keep:
            print(f"kept database {name}", file=sys.stderr)
        else:
            admin.ping()
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


def raw_insert(url: str, beats: list[list[dict[str, object]]], batch: int, host: str = "bench-raw") -> float:
    """Raw executemany of the same rows, committed per batch like the agent; returns seconds."""
    rows = [(host, s["gpu_id"], int(float(s["ts"]) * 1000), "bench", "guest", s["util_pct"],  # type: ignore[arg-type]
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
    """Heartbeats submitted as the web handler would, flushed by the ingestor; returns seconds and figures.

    The time ends when ``close()`` has drained the queue and the store's rollups include every sample."""
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


def count(url: str, host: str, table: str = "usage_samples", column: str = "COUNT(*)", where: str = "") -> int:
    """Rows stored for a host (or another aggregate of ``column``)."""
    conn = pymysql_conn(url)
    with conn.cursor() as cur:
        cur.execute(f"SELECT {column} FROM {table} WHERE host_id = %s {where}", (host,))
        (n,) = cur.fetchone()
    conn.close()
    return int(n or 0)


def trial(url: str, beats: list[list[dict[str, object]]], gpus: int, batch: int, k: int, tmp: Path) -> dict[str, Any]:
    """One raw run and one agent run (alternating which goes first, so drift in the machine's load evens out)."""
    n = sum(len(b) for b in beats)
    raw_host, agent_host = f"bench-raw-{k}", f"bench-agent-{k}"
    store = UsageStore(url, agent_host, spool_path=tmp / f"spool-{k}.sqlite3")
    store.upsert_gpus([{"gpu_id": f"gpu-{g}", "address": f"0000:{g + 1:02x}:00.0"} for g in range(gpus)])
    store.insert_lease({"id": "bench", "domain_uuid": "bench-vm", "state": "ACTIVE", "created_at": time.time(),
                        "request": {"gpus": gpus}})
    if k % 2 == 0:
        raw_s = raw_insert(url, beats, batch, raw_host)
        agent_s, fig = asyncio.run(agent_insert(store, beats, batch))
    else:
        agent_s, fig = asyncio.run(agent_insert(store, beats, batch))
        raw_s = raw_insert(url, beats, batch, raw_host)
    store.close()
    stored = {"raw": count(url, raw_host), "agent": count(url, agent_host)}
    rolled = [count(url, agent_host, "usage_rollups", "SUM(n)", f"AND resolution = {res}") for res in (60, 3600)]
    lost = stored["raw"] != n or stored["agent"] != n or rolled != [n, n] or fig["dropped"] or fig["rejected"]
    return {"raw_rate": n / raw_s, "agent_rate": n / agent_s, "raw_s": raw_s, "agent_s": agent_s,
            "ratio": raw_s / agent_s, "stored": stored, "rolled": rolled, "figures": fig, "lost": bool(lost)}


def main() -> int:
    """Run both paths ``--repeat`` times and print the figures of each run and their medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="SQLAlchemy URL of a MariaDB database (default: a temporary one)")
    ap.add_argument("--port", type=int, default=3306, help="port of the MariaDB server for the temporary database")
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3, help="runs of both paths (the machine's load varies)")
    args = ap.parse_args()
    lost = False
    with database(args.db, args.port) as url, tempfile.TemporaryDirectory() as tmp:
        upgrade(url)
        beats = heartbeats(args.gpus, args.samples, time.time() - 30 * 86400)
        n = len(beats) * args.gpus
        print(f"samples per path     {n} ({args.gpus} GPUs, batches of {args.batch}, {args.repeat} runs)")
        runs = []
        for k in range(args.repeat):
            r = trial(url, beats, args.gpus, args.batch, k, Path(tmp))
            runs.append(r)
            lost = lost or r["lost"]
            print(f"run {k + 1}: raw {r['raw_rate']:8.0f}/s ({r['raw_s']:.2f} s)  agent {r['agent_rate']:8.0f}/s "
                  f"({r['agent_s']:.2f} s)  ratio {r['ratio']:.2f}  stored raw/agent {r['stored']['raw']}/"
                  f"{r['stored']['agent']}  rolled up (minute, hour) {r['rolled'][0]}/{r['rolled'][1]}  "
                  f"overloaded {r['figures']['overloaded']}")
        raw_rate = statistics.median(r["raw_rate"] for r in runs)
        agent_rate = statistics.median(r["agent_rate"] for r in runs)
        print(f"raw PyMySQL          {raw_rate:12.0f} samples/s  (median)")
        print(f"agent path           {agent_rate:12.0f} samples/s  (median; ingestor + store, with rollups)")
        print(f"ratio agent/raw      {statistics.median(r['ratio'] for r in runs):12.2f}  (median of the runs' "
              f"ratios; target >= 0.80)")
        if lost:
            print("LOST SAMPLES", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
