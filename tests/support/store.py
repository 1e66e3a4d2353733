"""Test support for the usage store: the real MariaDB (one database per test module), SQLite, a TCP proxy, and
the real server stopped and started again (``mariadb_server``).

Tests of the MySQL backend FAIL, never skip, when MariaDB is unreachable. Import the fixtures into a test module:
``from tests.support.store import backend_url, store  # noqa: F401``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pymysql
import pytest

from hostagent.store.repo import UsageStore
from tests.support.waits import wait_until

MYSQL_HOST = os.environ.get("HOSTAGENT_TEST_MYSQL_HOST", "127.0.0.1")
MYSQL_PORT = int(os.environ.get("HOSTAGENT_TEST_MYSQL_PORT", "3306"))
MYSQL_USER = os.environ.get("HOSTAGENT_TEST_MYSQL_USER", "root")
MYSQL_PASSWORD = os.environ.get("HOSTAGENT_TEST_MYSQL_PASSWORD", "")
START_HINT = ("MariaDB is not reachable on {host}:{port} (user {user}): {err}. Start it with\n"
              "  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd\n"
              "(as root; the tests of the MySQL backend fail rather than skip without it).")


def mysql_admin() -> pymysql.connections.Connection:
    """A root connection to the test server, or pytest.fail with how to start it."""
    try:
        return pymysql.connect(host=MYSQL_HOST, port=MYSQL_PORT, user=MYSQL_USER, password=MYSQL_PASSWORD,
                               connect_timeout=5, autocommit=True)
    except pymysql.err.OperationalError as exc:
        pytest.fail(START_HINT.format(host=MYSQL_HOST, port=MYSQL_PORT, user=MYSQL_USER, err=exc), pytrace=False)


def mysql_query(db: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Ask MariaDB directly (not through the agent's store, nor a proxy)."""
    admin = mysql_admin()
    try:
        admin.select_db(db)
        with admin.cursor() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall())
    finally:
        admin.close()


def mysql_url(database: str, *, host: str = MYSQL_HOST, port: int = MYSQL_PORT) -> str:
    """SQLAlchemy URL for a database on the test server (optionally through a proxy's host/port)."""
    auth = MYSQL_USER + (f":{MYSQL_PASSWORD}" if MYSQL_PASSWORD else "")
    return f"mysql+pymysql://{auth}@{host}:{port}/{database}"


@contextmanager
def mysql_database(prefix: str = "hatest") -> Iterator[str]:
    """Create a uniquely named empty database, yield its name, drop it afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = mysql_admin()
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    finally:
        admin.close()
    try:
        yield name
    finally:
        admin = mysql_admin()  # a new connection: the body may have restarted the server
        try:
            with admin.cursor() as cur:
                cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        finally:
            admin.close()


@pytest.fixture(scope="module", params=["sqlite", "mysql"])
def backend_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated-on-first-use store URL per module and backend (tests isolate themselves by host id)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('store') / 'usage.sqlite3'}"
        return
    with mysql_database(f"ha_{request.module.__name__.rsplit('.', 1)[-1][:20]}") as name:
        yield mysql_url(name)


@pytest.fixture
def store(backend_url: str, tmp_path: Path) -> Iterator[UsageStore]:
    """A UsageStore on the module's backend with a fresh host id (so tests never see each other's rows)."""
    s = UsageStore(backend_url, f"host-{uuid.uuid4().hex[:8]}", spool_path=tmp_path / "spool.sqlite3")
    yield s
    s.close()


def sample_rows(gpu_ids: list[str], lease_id: str, start: float, count: int, step_s: float = 10.0,
                util: Any = None) -> list[dict[str, Any]]:
    """Heartbeat-like samples: ``count`` instants per GPU from ``start``, utilization from ``util(i)`` or a ramp."""
    rows = []
    for i in range(count):
        for j, g in enumerate(gpu_ids):
            u = util(i, j) if util else float((i * 7 + j * 13) % 101)
            rows.append({"gpu_id": g, "ts": start + i * step_s, "lease_id": lease_id, "util_pct": u,
                         "mem_used_bytes": (i % 17) * 2**28, "work_rate": float(i % 5), "vfio_irq_rate": 100.0 + j})
    return rows


def lease_doc(lease_id: str, *, created_at: float, gpus: list[str], state: str = "ACTIVE",
              domain_uuid: str = "6f1e2d3c-0000-4000-8000-000000000001", **extra: Any) -> dict[str, Any]:
    """A lease in the journal's to_dict() form."""
    doc: dict[str, Any] = {
        "id": lease_id, "domain_uuid": domain_uuid, "domain_name": "vm-test", "state": state,
        "created_at": created_at, "granted_at": created_at + 1, "granted_gpus": len(gpus),
        "request": {"gpus": len(gpus), "task_type": "training", "data_scale": 3.0, "precision": "bf16",
                    "min_memory_gib": 16.0, "duration_s": 3600, "priority": 2, "accept_partial": False,
                    "accept_deferred": True, "not_after": None, "idempotency_key": f"idem-{lease_id}"},
        "devices": [{"gpu_id": g, "functions": ["0000:3b:00.0", "0000:3b:00.1"], "iommu_group": 7} for g in gpus],
        "reasons": ["free", "memory >= 16 GiB", "same NUMA node"],
    }
    doc.update(extra)
    return doc


class TcpProxy:
    """A tiny asyncio TCP proxy on 127.0.0.1, run in its own thread, that a test can cut and restore."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0

    def start(self) -> TcpProxy:
        """Listen on an ephemeral port (kept across cut/restore)."""
        self._thread.start()
        self._call(self._listen())
        return self

    def cut(self) -> None:
        """Refuse new connections and reset every open one (MySQL 'gone away' / 'can't connect')."""
        self._call(self._cut())

    def restore(self) -> None:
        """Listen again on the same port."""
        self._call(self._listen())

    def close(self) -> None:
        """Stop everything."""
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _shutdown(self) -> None:
        """Cut, and end the connections' tasks here rather than leave them pending in a loop that stops."""
        await self._cut()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:
            writer.transport.abort()
            return
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_w))

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.transport.abort()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        self._writers.discard(writer)
        self._writers.discard(up_w)


class MariaDBServer:
    """The local test server, stopped and started for real: what a TCP cut never shows (error 1053 "shutdown in
    progress" to the statements in flight, "gone away" on pooled connections, a listener that refuses, then a fresh
    server). Only outage tests use it, and the ``mariadb_server`` fixture has it running again when they end."""

    def __init__(self, mariadbd: str = "/usr/sbin/mariadbd") -> None:
        self.mariadbd = mariadbd

    def alive(self) -> bool:
        """The server answers ``mariadb-admin ping`` (over its local socket)."""
        r = subprocess.run(["mariadb-admin", "--connect-timeout=2", "ping"], capture_output=True, timeout=30)
        return r.returncode == 0

    def stop(self, timeout: float = 60.0) -> float:
        """Shut the server down; returns the ``time.monotonic()`` at which it was seen no longer answering."""
        subprocess.run(["mariadb-admin", "shutdown"], capture_output=True, timeout=timeout, check=True)
        if not wait_until(lambda: not self.alive(), timeout, interval=0.1):
            raise AssertionError(f"MariaDB still answers {timeout:g} s after mariadb-admin shutdown")
        return time.monotonic()

    def start(self, timeout: float = 60.0) -> float:
        """Start the server; returns the ``time.monotonic()`` at which it answered again."""
        subprocess.run(["start-stop-daemon", "--start", "--oknodo", "--background", "--exec", self.mariadbd],
                       capture_output=True, timeout=timeout, check=True)
        if not wait_until(self.alive, timeout, interval=0.1):
            raise AssertionError(f"MariaDB did not answer within {timeout:g} s of being started")
        return time.monotonic()

    def ensure_running(self) -> None:
        """Start the server unless it answers (the rest of the suite, and other users of it, need it)."""
        if not self.alive():
            self.start()


@pytest.fixture
def mariadb_server() -> Iterator[MariaDBServer]:
    """The real server, to stop and start in a test: running (else the test fails) and running again after it."""
    mysql_admin().close()  # fails, never skips, when the server is missing
    server = MariaDBServer()
    try:
        yield server
    finally:
        server.ensure_running()
