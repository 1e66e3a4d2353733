"""Every `hostagent` command an operator runs against the store or the agent, through the CLI's entry point, with
its effect checked where it lands: the store's schema and rows, the model registry, the reaper's decisions, the
token book, the topology and probe reports, the doctor's verdict. Each test fails when its command stops doing its
job (prints without acting, acts on the wrong thing, or exits 0 on failure)."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect

from hostagent.domain.lease import LeaseState
from hostagent.domain.placement import GIB
from hostagent.domain.reclaim import Action
from hostagent.host.fakesysfs import build_tree
from hostagent.store.migrate import current_revision, head_revision
from hostagent.store.repo import UsageStore
from hostagent.store.schema import metadata
from hostagent.virt.sim import SimulatedHypervisor
from tests.support.agent import AgentRig, Clock, make_rig, start_rig
from tests.support.cli import acli, cli, settings_toml, write_toml
from tests.support.learn import fill_store
from tests.support.topology import ALL, FakeComputeRunner, FakeHealthRunner, topology_rig

T0 = 1_700_000_000.0
HOST = "h-cli"


@pytest.fixture(autouse=True)
def fake_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trees here are fake: commands that read sysfs drive them through the fake kernel (`host.kernel`)."""
    monkeypatch.setenv("HOSTAGENT_HOST__KERNEL", "fake")


def store_config(tmp: Path, url: str, host: str = HOST) -> Path:
    return write_toml(tmp / "store.toml", {"agent": {"state_dir": str(tmp / "state"), "host_id": host},
                                           "store": {"url": url}})


# ---- db upgrade | status | export ------------------------------------------------------------------------------


def test_db_upgrade_status_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'db' / 'usage.sqlite3'}"
    cfg = ("--config", str(store_config(tmp_path, url)))
    head = head_revision()

    # an empty store: status says so, and fails
    code, out, _ = cli(capsys, "db", "status", *cfg, "--json")
    st = json.loads(out)
    assert code == 1 and st["revision"] is None and st["head"] == head and st["up_to_date"] is False

    # upgrade creates the whole schema at head (the directory too)
    code, out, _ = cli(capsys, "db", "upgrade", *cfg, "--json")
    assert code == 0 and json.loads(out) == {"url": url, "from": None, "to": head}
    assert current_revision(url) == head
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            assert set(inspect(c).get_table_names()) == set(metadata.tables) | {"alembic_version"}
    finally:
        engine.dispose()
    code, out, _ = cli(capsys, "db", "upgrade", *cfg)  # a second run is a no-op that says so
    assert code == 0 and out.strip() == f"{url}: {head} -> {head}"

    # status names the revision, in both forms
    code, out, _ = cli(capsys, "db", "status", *cfg)
    assert code == 0 and f"revision   {head} (head {head}, up to date)" in out and "(reachable)" in out
    code, out, _ = cli(capsys, "db", "status", *cfg, "--json")
    assert code == 0 and json.loads(out)["revision"] == head and json.loads(out)["spool_depth"] == 0

    # export writes exactly the rows of the window, of this host
    store = UsageStore(url, HOST, spool_path=tmp_path / "w-spool.sqlite3", clock=lambda: T0 + 1000)
    other = UsageStore(url, "h-other", spool_path=tmp_path / "o-spool.sqlite3", clock=lambda: T0 + 1000)
    try:
        store.upsert_gpus([{"gpu_id": "g0", "address": "0000:01:00.0", "model": "X", "memory_bytes": 16 * GIB,
                            "numa_node": 0}])
        for i in range(3):
            store.insert_lease({"id": f"L{i}", "domain_uuid": "00000000-0000-4000-8000-000000000001",
                                "state": "RELEASED", "created_at": T0 + 100 * i, "granted_at": T0 + 100 * i,
                                "ended_at": T0 + 100 * i + 50, "request": {"gpus": 1, "task_type": f"job{i}"},
                                "devices": [{"gpu_id": "g0"}]})
        store.add_samples([{"gpu_id": "g0", "ts": T0 + 110 + k, "lease_id": "L1", "util_pct": 10.0 * k}
                           for k in range(4)], now=T0 + 200)
        other.insert_lease({"id": "X0", "domain_uuid": "u", "state": "ACTIVE", "created_at": T0 + 150,
                            "request": {"gpus": 1}})
    finally:
        store.close()
        other.close()
    out_csv = tmp_path / "leases.csv"
    code, _, err = cli(capsys, "db", "export", "leases", *cfg, "--since", str(T0 + 50), "-o", str(out_csv))
    assert code == 0 and f"exported 2 leases row(s) of host {HOST}" in err
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["id"], r["host_id"]) for r in rows] == [("L1", HOST), ("L2", HOST)]  # L0 before --since, X0 not ours
    code, out, err = cli(capsys, "db", "export", "samples", *cfg)  # to stdout
    samples = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and "exported 4 samples row(s)" in err
    assert [float(r["util_pct"]) for r in samples] == [0.0, 10.0, 20.0, 30.0]
    assert {r["lease_id"] for r in samples} == {"L1"}
    code, _, err = cli(capsys, "db", "export", "leases", *cfg, "--since", "next tuesday")
    assert code == 1 and "--since must be unix seconds or an ISO date" in err


# ---- model train | evaluate | show | matrix | rollback ------------------------------------------------------------------


def fill(url: str, tmp: Path, n: int, start: float, seed: int) -> None:
    fill_store(url, HOST, tmp / f"fill-{seed}.sqlite3", n, start, seed)


def test_model_train_show_evaluate_rollback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'usage.sqlite3'}"
    cfg = ("--config", str(store_config(tmp_path, url)))
    code, out, _ = cli(capsys, "model", "show", *cfg, "--json")
    assert code == 0 and json.loads(out) == {"versions": []}
    code, out, _ = cli(capsys, "model", "show", *cfg)
    assert code == 0 and "(none yet)" in out

    # too few records: nothing saved, the cold-start rule stays
    fill(url, tmp_path, 40, T0, seed=0)
    code, out, _ = cli(capsys, "model", "train", *cfg, "--min-records", "100", "--json")
    assert code == 0 and json.loads(out)["decision"] == "insufficient-records"
    assert json.loads(cli(capsys, "model", "show", *cfg, "--json")[1])["versions"] == []

    fill(url, tmp_path, 110, T0 + 10_000, seed=1)
    code, out, _ = cli(capsys, "model", "train", *cfg, "--min-records", "100", "--json")
    first = json.loads(out)
    assert code == 0 and first["decision"] == "promoted" and first["version"].startswith("placement-")
    assert first["metrics"]["labelled"] == 150 and first["metrics"]["holdout_n"] == 30
    code, out, _ = cli(capsys, "model", "show", *cfg, "--json")
    assert code == 0 and [(v["version"], v["active"], v["decision"], v["trained_on"])
                          for v in json.loads(out)["versions"]] == [(first["version"], True, "promoted", 150)]
    code, out, _ = cli(capsys, "model", "show", *cfg)
    assert code == 0 and any(line.startswith("*") and first["version"] in line for line in out.splitlines())

    # evaluate prints the active version's figures on recent records
    code, out, _ = cli(capsys, "model", "evaluate", *cfg, "--json")
    figures = json.loads(out)
    assert code == 0 and figures["version"] == first["version"] and figures["active"] is True
    assert figures["target"] == "work_rate" and figures["n"] == 30  # the newest 20 % of 150 records
    assert 0 <= figures["error"] < 0.5 and figures["rank_accuracy"] >= 0.9  # the truth is learnable, and learnt
    code, out, _ = cli(capsys, "model", "evaluate", *cfg)
    assert code == 0 and f"version: {first['version']}" in out and "rank_accuracy:" in out

    # matrix: each task type's rate on each GPU model the records hold, with its uncertainty and its leases
    code, out, _ = cli(capsys, "model", "matrix", *cfg, "--json")
    grid = json.loads(out)
    assert code == 0 and grid["version"] == first["version"] and grid["cells"]
    assert sum(c["n"] for c in grid["cells"]) == 150 and all(c["sd"] > 0 and c["rate"] > 0 for c in grid["cells"])
    code, out, _ = cli(capsys, "model", "matrix", *cfg, first["version"])
    assert code == 0 and "TASK" in out and "+-1 SD" in out and f"version {first['version']}" in out
    code, _, err = cli(capsys, "model", "matrix", *cfg, "placement-nonesuch")
    assert code == 1 and "placement-nonesuch" in err

    # fresh records and another target: a second version, promoted (the active one predicts something else);
    # the human form names the decision, the version and the figures behind it
    fill(url, tmp_path, 60, T0 + 30_000, seed=2)
    code, out, _ = cli(capsys, "model", "train", *cfg, "--target", "utilization", "--min-records", "100")
    head, *figure_lines = out.splitlines()
    assert code == 0 and head.startswith("promoted: version placement-")
    second = {"version": head.split()[-1]}
    assert second["version"] != first["version"]
    assert "  labelled: 210" in figure_lines and "  target: utilization" in figure_lines
    assert any(line.startswith("  reason: active model predicts 'work_rate'") for line in figure_lines)
    shown = json.loads(cli(capsys, "model", "show", *cfg, "--json")[1])["versions"]
    assert [(v["version"], v["active"]) for v in shown] == [(second["version"], True), (first["version"], False)]

    # rollback goes back one: the first is active again, and evaluate judges it
    code, out, _ = cli(capsys, "model", "rollback", *cfg, "--json")
    assert code == 0 and json.loads(out) == {"active": first["version"], "previous": second["version"]}
    shown = json.loads(cli(capsys, "model", "show", *cfg, "--json")[1])["versions"]
    assert [(v["version"], v["active"]) for v in shown] == [(second["version"], False), (first["version"], True)]
    assert json.loads(cli(capsys, "model", "evaluate", *cfg, "--json")[1])["version"] == first["version"]
    code, _, err = cli(capsys, "model", "rollback", *cfg)  # nothing promoted before the first
    assert code == 1 and "no promoted model older than" in err


# ---- reaper pause | resume ------------------------------------------------------------------------------------


RECLAIM = {"enabled": True, "check_interval_s": 3600.0, "grace_s": 120.0, "min_lease_age_s": 0.0,
           "notice_window_s": 30.0, "idle_util_pct": 5.0}


async def idle_check(rig: AgentRig, lease_id: str, advance: float) -> Action | None:
    """Advance the rig's clock; the guest reports idle samples over that time; then one reaper check."""
    clock: Clock = rig.extra["clock"]
    clock.advance(advance)
    lz = rig.runtime.manager.leases[lease_id]
    await rig.runtime.accept_samples(lz, [{"ts": clock.now - i * advance / 4, "gpu_id": lz.devices[0].gpu_id,
                                           "util_pct": 0.0, "mem_used_bytes": 0, "work_rate": None}
                                          for i in range(3)])
    return await rig.runtime.reaper.check(lease_id, clock.now, rig.runtime.host.vfio_interrupts())


async def test_reaper_pause_and_resume(tmp_path: Path, aiohttp_client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock(time.time())
    r = make_rig(tmp_path, clock=clock, reclaim=RECLAIM)
    r.extra["clock"] = clock
    r.runtime.use_store = False  # samples carry the test clock's times
    rig = await start_rig(r, aiohttp_client)
    resp = await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))
    lid = (await resp.json())["id"]
    api = ("--url", str(rig.client.make_url("")).rstrip("/"), "--token", rig.operator)

    code, out, _ = await acli(capsys, "reaper", "pause", lid, *api)
    assert code == 0 and out.strip() == f"lease {lid}: reclaim paused"
    code, out, _ = await acli(capsys, "reaper", "status", *api, "--json")
    assert code == 0 and [(x["lease_id"], x["paused"]) for x in json.loads(out)["leases"]] == [(lid, True)]
    code, out, _ = await acli(capsys, "reaper", "status", *api)
    assert code == 0 and "(paused)" in next(line for line in out.splitlines() if lid in line)
    for _ in range(3):  # idle well past two strikes and the notice window: a paused lease is never struck
        assert await idle_check(rig, lid, 200) is Action.NONE
    lz = rig.runtime.manager.leases[lid]
    assert lz.state is LeaseState.ACTIVE and lz.strike_at is None and lz.notice is None

    code, out, _ = await acli(capsys, "reaper", "resume", lid, *api)
    assert code == 0 and out.strip() == f"lease {lid}: reclaim resumed"
    code, out, _ = await acli(capsys, "reaper", "status", *api, "--json")
    assert [x["paused"] for x in json.loads(out)["leases"]] == [False]
    assert await idle_check(rig, lid, 200) is Action.STRIKE_ONE  # judged again, and idle
    assert rig.runtime.manager.leases[lid].strike_at is not None

    # operator only: a VM's token is refused and changes nothing; an unknown lease is a 404
    code, _, err = await acli(capsys, "reaper", "pause", lid, "--url", api[1], "--token", rig.tokens["vm-a"])
    assert code == 1 and "403" in err and rig.runtime.manager.leases[lid].reclaim_paused is False
    code, _, err = await acli(capsys, "reaper", "pause", "l-nope", *api)
    assert code == 1 and "404" in err


# ---- token issue --operator -----------------------------------------------------------------------------------


async def test_token_issue_operator_is_accepted_on_operator_routes(tmp_path: Path, aiohttp_client: Any,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    cfg = ("--config", str(settings_toml(tmp_path / "agent.toml", rig.settings)))
    code, out, _ = await acli(capsys, "token", "issue", "--operator", *cfg, "--json")
    issued = json.loads(out)
    assert code == 0 and issued["role"] == "operator" and issued["token"].startswith("op_")
    token = issued["token"]
    assert token != rig.operator

    def h(tok: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {tok}"}

    # the running agent takes it at once on an operator-only route; a VM's token is refused there
    assert (await rig.client.get("/v1/reaper", headers=h(token))).status == 200
    assert (await rig.client.get("/v1/reaper", headers=rig.auth("vm-a"))).status == 403
    assert (await rig.client.get("/v1/reaper", headers=h("op_" + "0" * 43))).status == 401
    lease = await (await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-b"))).json()
    r = await rig.client.post(f"/v1/leases/{lease['id']}/reclaim", json={"paused": True}, headers=h(token))
    assert r.status == 200 and (await r.json())["reclaim"]["paused"] is True
    # ... and through the CLI, as --token
    code, out, _ = await acli(capsys, "leases", "--url", str(rig.client.make_url("")).rstrip("/"), "--token", token)
    assert code == 0 and lease["id"] in out
    # plain output is the token alone, a new one each time
    code, out, _ = await acli(capsys, "token", "issue", "--operator", *cfg)
    assert code == 0 and out.strip().startswith("op_") and out.strip() != token
    assert (await rig.client.get("/v1/reaper", headers=h(out.strip()))).status == 200
    code, _, err = await acli(capsys, "token", "issue", *cfg)  # neither --operator nor --domain
    assert code == 2 and "--domain" in err


# ---- topology -------------------------------------------------------------------------------------------------


async def test_topology_prints_every_gpu_and_what_is_free(tmp_path: Path, aiohttp_client: Any,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    rig = await start_rig(make_rig(tmp_path, scenario="dgx8"), aiohttp_client)
    api = ("--url", str(rig.client.make_url("")).rstrip("/"), "--token", rig.operator)
    code, out, _ = await acli(capsys, "topology", *api)
    assert code == 0 and all(f"{g}[.]" in out for g in ALL) and "free: 8 GPU(s), block capacity 100%" in out
    assert "NUMA" in out and "switch" in out
    lease = await (await rig.client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))).json()
    taken = {d["gpu_id"] for d in lease["devices"]}
    code, out, _ = await acli(capsys, "topology", *api)
    assert code == 0 and all(f"{g}[L]" in out for g in taken) and all(f"{g}[.]" in out for g in set(ALL) - taken)
    assert "free: 6 GPU(s)" in out
    code, out, _ = await acli(capsys, "topology", *api, "--json")
    body = json.loads(out)
    assert {g["id"]: g["state"] for g in body["gpus"]} == {g: "leased" if g in taken else "free" for g in ALL}
    # --local reads sysfs without the agent: the leased GPUs are on vfio-pci there
    code, out, _ = await acli(capsys, "topology", "--local", "--sysfs-root", str(rig.tree.sys_root))
    assert code == 0 and all(f"{g}[L]" in out for g in taken) and "free: 6 GPU(s)" in out


# ---- probe ----------------------------------------------------------------------------------------------------


async def test_probe_runs_the_runners_and_reports(tmp_path: Path, aiohttp_client: Any,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from hostagent.services.probes import ProbeSettings

    compute = FakeComputeRunner(noise=[1.0, 0.9, 1.1])
    health = FakeHealthRunner(problems={ALL[3]: ("2 uncorrectable ECC error(s) since the driver loaded",)})
    rig, app, _ = topology_rig(tmp_path, runners=[health, compute],
                               probe_settings=ProbeSettings(enabled=False, period_s=0, runs=3))
    client = await aiohttp_client(app)
    api = ("--url", str(client.make_url("")).rstrip("/"), "--token", rig.operator)
    code, out, _ = await acli(capsys, "probe", ALL[0], *api)
    assert code == 0 and compute.calls == [ALL[0]] * 3  # the runners ran, K times
    first = out.splitlines()[0]
    assert first.startswith(f"{ALL[0]} (") and ": OK, score 1.000" in first
    assert "matmul_tflops          100" in out and "fake-health: temperature_c=40" in out  # the median of 90/100/110
    code, out, _ = await acli(capsys, "probe", ALL[1], *api, "--json")
    body = json.loads(out)
    assert code == 0 and body["gpu_id"] == ALL[1] and body["ok"] and len(body["runs"]) == 3
    # a GPU with a hard problem: exit status 1, the problem named, and quarantined
    code, out, _ = await acli(capsys, "probe", ALL[3], *api)
    assert code == 1 and "NOT OK" in out and "PROBLEM: 2 uncorrectable ECC" in out and "QUARANTINED" in out
    gpu = await (await client.get(f"/v1/gpus/{ALL[3]}", headers=rig.auth("operator"))).json()
    assert gpu["state"] == "quarantined"
    # a leased GPU is not probed
    lease = await (await client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))).json()
    held = lease["devices"][0]["gpu_id"]
    calls = len(compute.calls)
    code, _, err = await acli(capsys, "probe", held, *api)
    assert code == 1 and "409" in err and len(compute.calls) == calls


# ---- doctor ---------------------------------------------------------------------------------------------------


def doctor_config(tmp: Path) -> tuple[str, str]:
    hv = tmp / "hv.json"
    SimulatedHypervisor(path=hv).save()
    return "--config", str(write_toml(tmp / "doctor.toml", {"libvirt": {"uri": f"sim://{hv}"}}))


def test_doctor_passes_a_good_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys_root = build_tree(tmp_path / "dgx8", "dgx8").sys_root
    code, out, _ = cli(capsys, "doctor", "--sysfs-root", str(sys_root), *doctor_config(tmp_path))
    lines = out.splitlines()
    assert code == 0 and lines[0] == "OK    iommu: 30 IOMMU groups"
    assert sum(line.startswith("OK    gpu ") for line in lines) == 8
    assert all(line.startswith("OK") for line in lines) and "fix:" not in out
    code, out, _ = cli(capsys, "doctor", "--sysfs-root", str(sys_root), *doctor_config(tmp_path), "--json")
    checks = json.loads(out)["checks"]
    assert code == 0 and {c["status"] for c in checks} == {"OK"} and len(checks) == len(lines)


def test_doctor_fails_a_bad_host_and_names_the_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys_root = build_tree(tmp_path / "off", "iommu-off").sys_root
    code, out, _ = cli(capsys, "doctor", "--sysfs-root", str(sys_root), *doctor_config(tmp_path))
    assert code == 1
    assert "FAIL  iommu: no IOMMU groups: the IOMMU is off" in out.splitlines()
    assert "FAIL  kernel-cmdline: no intel_iommu=on / amd_iommu=on" in out.splitlines()
    assert out.count("      fix: ") == sum(not line.startswith(("OK", "      fix:")) for line in out.splitlines())
    # a host that only warns still passes: the workstation's WARN lines, exit status 0
    ws = build_tree(tmp_path / "ws", "workstation").sys_root
    code, out, _ = cli(capsys, "doctor", "--sysfs-root", str(ws), *doctor_config(tmp_path), "--json")
    statuses = {c["name"]: c["status"] for c in json.loads(out)["checks"]}
    assert code == 0 and statuses["kernel-cmdline"] == "WARN" and "FAIL" not in statuses.values()
