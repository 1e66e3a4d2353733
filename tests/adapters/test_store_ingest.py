"""SampleIngestor and the async facade, on the real MariaDB and SQLite (and a blocking fake writer for back-pressure)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from hostagent.domain.errors import InvalidInput, NotFound, Overloaded
from hostagent.store import schema as t
from hostagent.store.aio import AsyncUsageStore
from hostagent.store.ingest import SampleIngestor
from hostagent.store.samples import Sample
from tests.support.store import backend_url, lease_doc, sample_rows  # noqa: F401
from tests.support.waits import until

NOW = time.time()
T0 = int(NOW) - 7200


@pytest.fixture
async def facade(backend_url: str, tmp_path: Path) -> AsyncIterator[AsyncUsageStore]:  # noqa: F811
    f = await AsyncUsageStore.open(backend_url, f"ing-{uuid.uuid4().hex[:8]}",
                                   spool_path=tmp_path / "spool.sqlite3")
    await f.upsert_gpus([{"gpu_id": f"gpu-{i}", "address": f"0000:{i + 1:02x}:00.0"} for i in range(4)])
    await f.insert_lease(lease_doc("L1", created_at=T0, gpus=["gpu-0", "gpu-1", "gpu-2", "gpu-3"]))
    yield f
    await f.close()


def stored(f: AsyncUsageStore) -> int:
    with f.store.engine.connect() as c:
        return int(c.execute(select(func.count()).select_from(t.usage_samples)
                             .where(t.usage_samples.c.host_id == f.store.host_id)).scalar_one())


async def test_flush_by_size_then_close_drains(facade: AsyncUsageStore) -> None:
    ing = SampleIngestor(facade.store.add_samples, batch=50, interval_s=3600)
    ing.start()
    rows = sample_rows(["gpu-0", "gpu-1", "gpu-2", "gpu-3"], "L1", T0, 30)  # 120 samples
    for i in range(0, 120, 8):
        assert ing.submit(rows[i:i + 8]) == 8
    # the flush interval is an hour: only size can have flushed them
    await until(lambda: ing.flushed >= 100, 30.0, interval=0.01)
    await ing.close()
    assert await asyncio.to_thread(stored, facade) == 120
    fig = ing.figures()
    assert fig["flushed"] == 120 and fig["queue_depth"] == 0 and fig["dropped"] == 0


async def test_flush_by_time(facade: AsyncUsageStore) -> None:
    ing = SampleIngestor(facade.store.add_samples, batch=10_000, interval_s=0.05)
    ing.start()
    ing.submit(sample_rows(["gpu-0"], "L1", T0, 7))
    await until(lambda: ing.flushed == 7, 30.0, interval=0.01)
    await ing.close()
    assert await asyncio.to_thread(stored, facade) == 7


async def test_bad_samples_are_refused_at_submit_with_the_field(facade: AsyncUsageStore) -> None:
    ing = SampleIngestor(facade.store.add_samples)
    rows = sample_rows(["gpu-0"], "L1", T0, 3)
    rows[2]["util_pct"] = 101
    with pytest.raises(InvalidInput) as err:
        ing.submit(rows)
    assert err.value.field == "samples[2].util_pct" and ing.depth == 0


async def test_a_request_the_store_refuses_does_not_sink_the_others(facade: AsyncUsageStore) -> None:
    ing = SampleIngestor(facade.store.add_samples, batch=1000, interval_s=3600)
    ing.submit(sample_rows(["gpu-0"], "L1", T0, 5))
    ing.submit(sample_rows(["gpu-1"], "ghost-lease", T0, 5))  # valid shape, unknown lease
    ing.submit(sample_rows(["gpu-2"], "L1", T0, 5))
    assert await ing.flush() == 10
    assert ing.figures()["rejected"] == 5 and await asyncio.to_thread(stored, facade) == 10


async def test_facade_reads_writes_and_lease_mirror(facade: AsyncUsageStore) -> None:
    class Lease:
        def to_dict(self) -> dict[str, Any]:
            return lease_doc("L2", created_at=T0, gpus=["gpu-1"], state="BINDING")
    facade.lease_changed(Lease(), {"seq": 1, "from_state": "REQUESTED", "to_state": "BINDING", "actor": "agent"})
    await facade.drain_mirror()
    lease = await facade.get_lease("L2")
    assert lease["state"] == "BINDING" and [e["to_state"] for e in lease["events"]] == ["BINDING"]
    assert await facade.add_samples(sample_rows(["gpu-1"], "L2", T0, 4)) == 4
    assert (await facade.lease_usage_summary("L2"))["total"]["n"] == 4
    with pytest.raises(NotFound):
        await facade.update_lease("nope", {"state": "FAILED"})
    assert facade.status()["degraded"] is False and facade.spool_depth == 0


async def test_overloaded_only_when_full_and_nothing_dropped() -> None:
    gate = threading.Event()
    written: list[Sample] = []

    def slow_write(rows: list[Sample]) -> int:
        gate.wait(30)
        written.extend(rows)
        return len(rows)

    ing = SampleIngestor(slow_write, max_queue=100, batch=10, interval_s=0.01)
    ing.start()
    rows = sample_rows(["gpu-0"], "L1", T0, 100)
    for i in range(0, 100, 10):
        ing.submit(rows[i:i + 10])  # fills the queue exactly: no refusal yet
    await until(lambda: ing.figures()["queue_depth"] == 100 and ing._inflight > 0, 30.0, interval=0.01)
    with pytest.raises(Overloaded) as err:
        ing.submit(sample_rows(["gpu-1"], "L1", T0, 1))
    assert err.value.details["retry_after"] >= 1 and err.value.http_status == 503
    assert err.value.field == "samples" and "sample queue full (100 of 100)" in err.value.message, err.value.message
    gate.set()
    await until(lambda: ing.depth == 0, 30.0, interval=0.01)
    ing.submit(sample_rows(["gpu-1"], "L1", T0, 1))  # room again
    await ing.close()
    fig = ing.figures()
    assert len(written) == 101 and fig["flushed"] == 101 and fig["overloaded"] == 1 and fig["dropped"] == 0
    assert len({s.key for s in written}) == 101
