"""Nothing lost between the agent and its usage store, on the real MariaDB and on SQLite: 4- and 8-GPU leases on a
dgx8 host reach the store whole; a row the database refuses is set aside while everything after it flows, readiness,
metrics and the dashboard say so, and `hostagent db replay` stores it exactly once after the fix."""

from __future__ import annotations

import hashlib
import io
import json
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, select

from hostagent.cli.parser import main as cli_main
from hostagent.store import schema as t
from tests.adapters.test_agent_store import samples_for, settle, store_url  # noqa: F401 (a fixture)
from tests.adapters.test_store_limits import narrow_actor, widen_actor
from tests.support.agent import AgentRig, make_rig, start_rig


def stored(url: str, table: Any, host: str) -> list[dict[str, Any]]:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(select(table).where(table.c.host_id == host))]
    finally:
        engine.dispose()


def journal_uids(rig: AgentRig) -> dict[str, Any]:
    """The store uid of every journal event, as the mirror makes it."""
    host = rig.settings.agent.host_id
    out = {}
    for ev in rig.runtime.journal.events(limit=100_000):
        lease = ev.lease_id if ev.lease_id and rig.runtime.journal.get(ev.lease_id) else None
        out[hashlib.sha256(f"{host}/{lease}/{ev.seq}".encode()).hexdigest()[:32]] = ev
    return out


async def heartbeat(rig: AgentRig, vm: str, lease: dict[str, Any], start: float, n: int) -> int:
    sent = 0
    for dev in lease["devices"]:
        r = await rig.client.post(f"/v1/leases/{lease['id']}/heartbeat",
                                  json={"samples": samples_for(dev["gpu_id"], start, n)}, headers=rig.auth(vm))
        assert r.status == 200, await r.text()
        sent += n
    return sent


async def test_four_and_eight_gpu_leases_on_a_dgx8_reach_the_store_whole(tmp_path: Path, aiohttp_client: Any,
                                                                         store_url: str) -> None:  # noqa: F811
    rig = await start_rig(make_rig(tmp_path, scenario="dgx8", store={"url": store_url}), aiohttp_client)
    now = time.time()
    sent = 0
    leases = []
    for vm in ("vm-a", "vm-b"):
        r = await rig.client.post("/v1/leases", json={"gpus": 4, "task_type": "training"}, headers=rig.auth(vm))
        assert r.status == 201, await r.text()
        lease = await r.json()
        assert len(lease["devices"]) == 4
        sent += await heartbeat(rig, vm, lease, now, 25)
        leases.append((vm, lease))
    for vm, lease in leases:
        assert (await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth(vm))).status == 200
    r = await rig.client.post("/v1/leases", json={"gpus": 8, "task_type": "training"}, headers=rig.auth("vm-c"))
    big = await r.json()
    assert r.status == 201 and len(big["devices"]) == 8, big
    sent += await heartbeat(rig, "vm-c", big, now + 100, 25)
    assert (await rig.client.delete(f"/v1/leases/{big['id']}", headers=rig.auth("vm-c"))).status == 200
    await settle(rig)

    host = rig.settings.agent.host_id
    events = {e["uid"]: e for e in stored(store_url, t.lease_events, host)}
    expected = journal_uids(rig)
    assert set(events) == set(expected), "every journal event in the store, and nothing else"
    links: dict[str, set[str]] = {}
    for link in stored(store_url, t.event_gpus, host):
        links.setdefault(link["uid"], set()).add(link["gpu_id"])
    for uid, ev in expected.items():  # each event names exactly the GPUs the journal gave it
        assert links.get(uid, set()) == set(ev.gpu_id.split(",") if ev.gpu_id else ()), ev
    big_gpus = {d["gpu_id"] for d in big["devices"]}
    assert any(gpus == big_gpus for gpus in links.values())
    assert {x["id"] for x in stored(store_url, t.leases, host)} == {big["id"]} | {x["id"] for _, x in leases}
    assert len(stored(store_url, t.usage_samples, host)) == sent == 4 * 25 * 2 + 8 * 25
    assert await rig.runtime.run(rig.runtime.journal.backlog) == (0, None)
    ready = await (await rig.client.get("/readyz")).json()
    assert ready["checks"]["store"]["ok"] is True and ready["checks"]["store"]["set_aside"] == 0, ready
    assert rig.runtime.store.store.rejected() == []


async def test_a_row_made_unwritable_is_set_aside_while_later_rows_flow(tmp_path: Path, aiohttp_client: Any,
                                                                        store_url: str) -> None:  # noqa: F811
    rig = await start_rig(make_rig(tmp_path, store={"url": store_url}), aiohttp_client)
    host = rig.settings.agent.host_id
    rt = rig.runtime
    await settle(rig)
    narrow_actor(store_url, 8)  # "agent", "mirror", "reaper" fit; "guest:vm-a" no longer does
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    lease = await r.json()
    sent = await heartbeat(rig, "vm-a", lease, time.time(), 30)
    await settle(rig)
    # the lease and its samples are in; the guest's own transition is set aside with the database's error
    assert [x["id"] for x in stored(store_url, t.leases, host)] == [lease["id"]]
    assert len(stored(store_url, t.usage_samples, host)) == sent
    aside = rt.store.store.rejected()
    assert aside and all("actor" in x["error"] for x in aside)
    health = (await (await rig.client.get("/readyz")).json())["checks"]["store"]
    assert health["ok"] is False and health["set_aside"] == len(aside), health
    assert any("set aside" in p for p in health["problems"])
    assert (await rig.client.get("/readyz")).status == 200  # the store is not required for readiness
    metrics = await (await rig.client.get("/metrics", headers=rig.auth("operator"))).text()
    assert "hostagent_store_healthy 0.0" in metrics and f"hostagent_store_set_aside_writes {len(aside)}.0" in metrics
    # the agent journaled it, and that note reached the store
    notes = [e for e in rt.journal.events(kinds=["store-set-aside"])]
    assert notes and "actor" in (notes[0].detail or "")
    # later rows keep flowing while the refused ones wait
    assert (await rig.client.delete(f"/v1/leases/{lease['id']}", headers=rig.auth("operator"))).status == 200
    await settle(rig)
    assert [x["state"] for x in stored(store_url, t.leases, host)] == ["RELEASED"]

    # the operator fixes the column and replays, with the CLI the docs name
    widen_actor(store_url)
    waiting = len(rt.store.store.rejected())
    cli = ["--config", str(write_config(tmp_path, rig)), "--json"]
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["db", "replay", *cli]) == 0
    result = json.loads(out.getvalue())
    assert result["stored"] == waiting and result["failed"] == 0 and result["left"] == 0
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["db", "replay", *cli]) == 0
    assert json.loads(out.getvalue())["stored"] == 0
    await settle(rig)
    events = stored(store_url, t.lease_events, host)
    assert len({e["uid"] for e in events}) == len(events)
    assert set(journal_uids(rig)) == {e["uid"] for e in events}, "every journal event stored exactly once"
    health = (await (await rig.client.get("/readyz")).json())["checks"]["store"]
    assert health["ok"] is True and health["set_aside"] == 0, health


def write_config(tmp: Path, rig: AgentRig) -> Path:
    """The agent's settings that the CLI needs, as a TOML file."""
    s = rig.settings
    path = tmp / "cli.toml"
    path.write_text(f'[agent]\nstate_dir = "{s.state_dir}"\nhost_id = "{s.agent.host_id}"\n'
                    f'[store]\nurl = "{s.store_url}"\n')
    return path


async def test_db_export_defaults_to_the_agents_host_and_names_the_others(tmp_path: Path, aiohttp_client: Any,
                                                                          capsys: Any) -> None:
    """`hostagent db export` as documented, with only the agent's state directory: the agent's own rows (its host
    id from the spool, whatever the CLI's hostname), --host for another, --all-hosts for a fleet store."""
    url = f"sqlite:///{tmp_path / 'usage.sqlite3'}"
    rig = await start_rig(make_rig(tmp_path, store={"url": url}, agent={"host_id": "rack7-node3"}), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    assert r.status == 201
    await settle(rig)
    from hostagent.store.repo import UsageStore

    other = UsageStore(url, "rack9-node1", spool_path=tmp_path / "other-spool.sqlite3")
    other.insert_lease({"id": "l-other", "domain_uuid": "u", "state": "ACTIVE", "created_at": time.time(),
                        "request": {"gpus": 1}})
    other.close()
    base = ["db", "export", "leases", "--state-dir", str(rig.settings.state_dir), "--db", url]
    capsys.readouterr()
    assert cli_main(base + ["-o", str(tmp_path / "mine.csv")]) == 0
    assert "exported 1 leases row(s) of host rack7-node3" in capsys.readouterr().err
    assert (tmp_path / "mine.csv").read_text().count("\n") == 2
    assert cli_main(base + ["--all-hosts", "-o", str(tmp_path / "all.csv")]) == 0
    assert "exported 2 leases row(s) of every host" in capsys.readouterr().err
    assert cli_main(base + ["--host", "nobody", "-o", str(tmp_path / "none.csv")]) == 0
    err = capsys.readouterr().err
    assert "exported 0 leases row(s) of host nobody" in err and "rack7-node3 (1)" in err and "rack9-node1 (1)" in err
