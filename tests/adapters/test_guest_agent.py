"""The guest agent against the REAL host agent (in-process, served on a loopback port), with a fake NVML."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hostagent.guest.cli import amain
from hostagent.guest.client import HostClient
from hostagent.guest.config import load_config
from hostagent.guest.errors import ApiError, HostUnreachable
from hostagent.guest.monitor import Monitor
from hostagent.guest.sampler import Sampler
from tests.support.agent import AgentRig, make_rig
from tests.support.guest import FakeNvml, LiveAgent, attached_gpus, guest_sysfs, write_guest_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def live(tmp_path: Path) -> Any:
    rig = make_rig(tmp_path)
    agent = LiveAgent(rig)
    await agent.start()
    yield agent
    await agent.stop()


def token_file(tmp: Path, rig: AgentRig, vm: str = "vm-a") -> Path:
    p = tmp / f"{vm}.token"
    p.write_text(rig.tokens[vm] + "\n")
    return p


def config(tmp: Path, live: LiveAgent, vm: str = "vm-a", **extra: Any) -> Path:
    extra.setdefault("sys_root", str(tmp / "guest-sys"))
    return write_guest_config(tmp / f"guest-{vm}.toml", live.url, token_file(tmp, live.rig, vm), **extra)


async def leases_of(live: LiveAgent, vm: str = "vm-a") -> list[Any]:
    """Every lease of a VM, oldest first, from the host's journal (ended ones included)."""
    rt = live.runtime
    return sorted(await rt.run(rt.journal.leases, domain_uuid=live.rig.uuids[vm]), key=lambda x: x.created_at)


async def wait_for(cond: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def active_lease(live: LiveAgent, vm: str = "vm-a") -> Any:
    live_ones = sorted(live.runtime.manager.leases.values(), key=lambda x: x.created_at)
    return next((x for x in live_ones if x.domain_uuid == live.rig.uuids[vm] and x.state.value == "ACTIVE"), None)


async def operator_get(live: LiveAgent, lease_id: str) -> dict[str, Any]:
    async with HostClient(live.url, live.rig.operator, retries=0) as c:
        return await c.get_lease(lease_id)


# ---- run -- CMD ----------------------------------------------------------------------------------------------


async def test_run_leases_reports_usage_and_releases(live: LiveAgent, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(attached_gpus(live.rig, util=55.0)).install(monkeypatch)
    out = tmp_path / "env.txt"
    cfg = config(tmp_path, live)
    rc = await amain(["--config", str(cfg), "run", "--settle", "0", "--task-type", "training", "--",
                      "sh", "-c", f'env > {out}; sleep 2'])
    assert rc == 0
    [lease] = await leases_of(live)
    assert lease.state.value == "RELEASED" and lease.end_reason == "released by guest"
    env = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert env["HOSTAGENT_LEASE_ID"] == lease.id and env["HOSTAGENT_GPU_IDS"] == lease.gpu_ids[0]
    assert env["CUDA_VISIBLE_DEVICES"] == f"GPU-{lease.id}-0"  # only the leased GPU, by NVML UUID
    body = await operator_get(live, lease.id)
    assert body["usage"]["samples"] >= 5  # 2 s of sampling every 0.1 s
    per_gpu = body["usage"]["gpus"]  # what the host's usage store recorded for the lease
    assert set(per_gpu) == set(lease.gpu_ids)
    assert all(u["util_mean"] == 55.0 and u["util_min"] == 55.0 and u["mem_max"] == 2**30 for u in per_gpu.values())
    assert nvml.inits >= 1 and nvml.reads >= 5


async def test_run_returns_the_command_status(live: LiveAgent, tmp_path: Path) -> None:
    cfg = config(tmp_path, live)
    assert await amain(["--config", str(cfg), "run", "--settle", "0", "--", "sh", "-c", "exit 7"]) == 7
    assert await amain(["--config", str(cfg), "run", "--settle", "0", "--", "/nonexistent/cmd"]) == 127
    assert [x.state.value for x in await leases_of(live)] == ["RELEASED", "RELEASED"]


async def test_run_releases_on_sigterm_as_a_real_process(live: LiveAgent, tmp_path: Path) -> None:
    """A separate process (no NVML there: it says so and still heartbeats); SIGTERM stops the command, releases."""
    cfg = config(tmp_path, live)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hostagent.guest.cli", "--config", str(cfg), "run", "--settle", "0", "--",
        "sleep", "30", stderr=asyncio.subprocess.PIPE, env=env, stdin=asyncio.subprocess.DEVNULL)
    lease = await wait_for(lambda: active_lease(live), timeout=20)
    await wait_for(lambda: live.runtime.last_heartbeat.get(lease.id), timeout=20)
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    text = err.decode()
    assert proc.returncode == 128 + signal.SIGTERM, text
    assert (await leases_of(live))[0].state.value == "RELEASED"
    assert "no GPU utilization source" in text and "lease " + lease.id in text


# ---- reclaim notices -----------------------------------------------------------------------------------------


async def released(live: LiveAgent) -> bool:
    return (await leases_of(live))[0].state.value == "RELEASED"


async def force_notice(live: LiveAgent, lease_id: str, notice: str, *, in_s: float = 30.0,
                       preempted_by: str | None = None) -> None:
    m = live.runtime.manager
    lease = m.leases[lease_id]
    now = m.clock()
    if notice == "warning":
        changes: dict[str, Any] = {"notice": "warning", "strike_at": now, "recheck_at": now + in_s}
    elif preempted_by:  # as the queue's preemption writes it
        changes = {"notice": "reclaim", "notice_deadline": now + in_s, "preempted_by": preempted_by}
    else:
        changes = {"notice": "reclaim", "strike_at": now - 60, "notice_deadline": now + in_s}
    await m._write(lease.with_changes(**changes), lease.state, "test")


@pytest.mark.parametrize("reason", ["idle", "preempted"])
async def test_reclaim_notice_runs_hook_stops_command_and_releases(live: LiveAgent, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   reason: str) -> None:
    FakeNvml(attached_gpus(live.rig)).install(monkeypatch)
    hook_out = tmp_path / "hook.txt"
    cfg = config(tmp_path, live, on_reclaim=f"env | grep ^HOSTAGENT_ > {hook_out}", stop_gpu_users=True,
                 stop_grace_s=5.0)
    task = asyncio.create_task(amain(["--config", str(cfg), "run", "--settle", "0", "--", "sleep", "30"]))
    lease = await wait_for(lambda: active_lease(live))
    await wait_for(lambda: live.runtime.last_heartbeat.get(lease.id))
    await force_notice(live, lease.id, "reclaim", preempted_by="l-higher" if reason == "preempted" else None)
    rc = await asyncio.wait_for(task, 15)
    assert rc == 128 + signal.SIGTERM  # stop_gpu_users stopped the command holding the GPU
    env = dict(line.split("=", 1) for line in hook_out.read_text().splitlines())
    assert env["HOSTAGENT_LEASE_ID"] == lease.id and env["HOSTAGENT_NOTICE"] == "reclaim"
    assert env["HOSTAGENT_NOTICE_REASON"] == reason
    assert env["HOSTAGENT_GPU_IDS"] == lease.gpu_ids[0] and float(env["HOSTAGENT_DEADLINE"]) > time.time()
    final = (await leases_of(live))[0]
    # Released by the guest (cooperatively), before the reaper's deadline, and the reason says it answered the notice
    why = "preempted by l-higher" if reason == "preempted" else "idle"
    assert final.state.value == "RELEASED" and final.end_reason == f"released by guest on the reclaim notice ({why})"


async def test_strike_one_warning_runs_the_hook_once(live: LiveAgent, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Idle samples (no utilization, no memory): a busy one would clear the strike on the host.
    FakeNvml(attached_gpus(live.rig, util=0.0, used=0)).install(monkeypatch)
    hook_out = tmp_path / "warn.txt"
    cfg = load_config(str(config(tmp_path, live, on_warning=f"echo $HOSTAGENT_NOTICE >> {hook_out}")))
    async with HostClient(live.url, cfg.token(), retries=0) as client:
        status, lease = await client.create_lease({"gpus": 1})
        mon = Monitor(client, cfg, lambda: Sampler.open(sys_root=cfg.sys_root))
        t = mon.track(lease)
        await force_notice(live, lease["id"], "warning")
        for _ in range(3):
            await mon.sample()
            reply = await mon.heartbeat(t)
            assert reply is not None and reply["warnings"][0]["code"] == "idle_strike_one"
        await mon.close()
        assert hook_out.read_text().split() == ["warning"]
        assert not t.ended and (await leases_of(live))[0].state.value == "ACTIVE"


# ---- host outage ---------------------------------------------------------------------------------------------


class StepClock:
    def __init__(self) -> None:
        self.now = time.time() - 100

    def __call__(self) -> float:
        return self.now


async def test_host_outage_loses_no_buffered_samples(live: LiveAgent, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(attached_gpus(live.rig, util=80.0)).install(monkeypatch)
    cfg = load_config(str(config(tmp_path, live, batch_max=7, buffer_max=100)))
    clock = StepClock()
    async with HostClient(live.url, cfg.token(), retries=0) as client:
        _, lease = await client.create_lease({"gpus": 1})
        mon = Monitor(client, cfg, lambda: Sampler.open(sys_root=cfg.sys_root), clock=clock)
        t = mon.track(lease)
        for _ in range(3):
            clock.now += 1
            assert await mon.sample() == 1
        assert await mon.heartbeat(t) is not None and t.sent == 3
        await live.stop()  # the host agent goes away (its runtime shuts down)
        outage = []
        for _ in range(20):
            clock.now += 1
            outage.append(clock.now)
            await mon.sample()
            assert await mon.heartbeat(t) is None  # unreachable: nothing lost, nothing raised
        assert len(t.buffer) == 20 and mon.host_down_since is not None
        await live.start(fresh_runtime=True)  # a restarted agent, same state dir, same port
        reply = await mon.heartbeat(t)
        assert reply is not None and reply["state"] == "ACTIVE"
        assert len(t.buffer) == 0 and t.sent == 23 and t.buffer.dropped == 0
        got = sorted(s["ts"] for s in live.runtime.recent_samples[lease["id"]])
        assert got == outage  # every sample of the outage, in batches of 7
        await mon.close()


async def test_buffer_bound_drops_oldest_and_counts(live: LiveAgent, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(attached_gpus(live.rig)).install(monkeypatch)
    cfg = load_config(str(config(tmp_path, live, batch_max=5, buffer_max=10)))
    clock = StepClock()
    async with HostClient(live.url, cfg.token(), retries=0) as client:
        _, lease = await client.create_lease({"gpus": 1})
        mon = Monitor(client, cfg, lambda: Sampler.open(sys_root=cfg.sys_root), clock=clock)
        t = mon.track(lease)
        await live.stop()
        stamps = []
        for _ in range(15):
            clock.now += 1
            stamps.append(clock.now)
            await mon.sample()
        assert await mon.heartbeat(t) is None
        assert len(t.buffer) == 10 and t.buffer.dropped == 5
        await live.start(fresh_runtime=True)
        await mon.heartbeat(t)
        assert sorted(s["ts"] for s in live.runtime.recent_samples[lease["id"]]) == stamps[5:]
        assert "5 dropped" in mon.summary(t)
        await mon.close()


# ---- lease / status / renew / release and the API's refusals ---------------------------------------------------


async def test_lease_waits_for_hotplug_and_lists_pci_devices(live: LiveAgent, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    sys_root = tmp_path / "guest-sys"
    guest_sysfs(sys_root, {"0000:00:02.0": ("0x030000", "0x1234", "0x1111")})  # the emulated VGA

    async def hotplug() -> None:  # the guest kernel sees the device some time after the attach
        lease = await wait_for(lambda: active_lease(live))
        await asyncio.sleep(0.3)
        guest_sysfs(sys_root, {lease.devices[0].guest_addresses[0]: ("0x030200", "0x10de", "0x2330")})

    plug = asyncio.create_task(hotplug())
    out = io.StringIO()
    cfg = config(tmp_path, live, sys_root=str(sys_root))
    rc = await amain(["--config", str(cfg), "--json", "lease", "--gpus", "1", "--settle", "5"], out=out)
    await plug
    assert rc == 0
    data = json.loads(out.getvalue())
    assert data["lease"]["state"] == "ACTIVE"
    gpus = data["guest_gpus"]
    assert gpus["source"] == "pci" and "NVML" in gpus["note"]
    leased = [d for d in gpus["devices"] if d["leased"]]
    assert [d["address"] for d in leased] == [data["lease"]["devices"][0]["guest_addresses"][0]]
    assert leased[0]["vendor_id"] == "10de" and len(gpus["devices"]) == 2

    out = io.StringIO()
    assert await amain(["--config", str(cfg), "status"], out=out) == 0
    assert f"lease {data['lease']['id']} ACTIVE for vm-a" in out.getvalue()
    out = io.StringIO()
    assert await amain(["--config", str(cfg), "--json", "renew", "--duration", "7200"], out=out) == 0
    assert json.loads(out.getvalue())["expires_at"] > time.time() + 7000
    out = io.StringIO()
    assert await amain(["--config", str(cfg), "release"], out=out) == 0
    assert "RELEASED" in out.getvalue()
    assert await amain(["--config", str(cfg), "release"]) == 2  # no live lease left: name one
    assert "holds no live lease" in capsys.readouterr().err


async def test_lease_shows_nvml_devices_mapped_by_address(live: LiveAgent, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(attached_gpus(live.rig)).install(monkeypatch)
    out = io.StringIO()
    rc = await amain(["--config", str(config(tmp_path, live)), "lease", "--gpus", "2", "--settle", "0"], out=out)
    text = out.getvalue()
    assert rc == 0
    lease = active_lease(live)
    for dev in lease.devices:
        assert f"<- {dev.gpu_id} (by pci-address)" in text
    assert "NVML: driver 550.54.15, 2 GPU(s)" in text


async def test_queued_lease_shows_progress_then_times_out_and_cancels(live: LiveAgent, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    async with HostClient(live.url, live.rig.tokens["vm-b"], retries=0) as b:
        status, _ = await b.create_lease({"gpus": 8})
        assert status == 201
    cfg = config(tmp_path, live)
    rc = await amain(["--config", str(cfg), "lease", "--wait-timeout", "0.6", "--settle", "0"])
    err = capsys.readouterr().err
    assert rc == 5 and "queued: position 1" in err and "not granted within 0.6 s" in err
    assert (await leases_of(live))[0].state.value == "RELEASED"  # the queued request was withdrawn
    rc = await amain(["--config", str(cfg), "lease", "--no-queue", "--settle", "0"])
    assert rc == 3 and "the host agent refused (409 conflict)" in capsys.readouterr().err


async def test_queued_lease_is_granted_when_gpus_free_up(live: LiveAgent, tmp_path: Path) -> None:
    async with HostClient(live.url, live.rig.tokens["vm-b"], retries=0) as b:
        _, held = await b.create_lease({"gpus": 8})
        task = asyncio.create_task(amain(["--config", str(config(tmp_path, live)), "--json", "lease",
                                          "--wait-timeout", "20", "--settle", "0"], out=io.StringIO()))
        await wait_for(lambda: any(x.state.value == "QUEUED" for x in live.runtime.manager.leases.values()))
        await b.release(held["id"])
    assert await asyncio.wait_for(task, 20) == 0
    assert active_lease(live) is not None


async def test_refusals_are_explained(live: LiveAgent, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.token"
    bad.write_text("vm_not-a-real-token\n")
    cfg = config(tmp_path, live)
    assert await amain(["--config", str(cfg), "--token-file", str(bad), "status"]) == 3
    assert "did not accept this VM's token" in capsys.readouterr().err
    assert await amain(["--config", str(cfg), "status", "l-nosuchlease"]) == 3
    assert "not found on the host agent (404 not_found)" in capsys.readouterr().err
    assert await amain(["--config", str(cfg), "--token-file", str(tmp_path / "missing"), "status"]) == 2
    assert "does not exist" in capsys.readouterr().err

    async with HostClient(live.url, live.rig.tokens["vm-a"], retries=0) as a, \
            HostClient(live.url, live.rig.tokens["vm-b"], retries=0) as b:
        _, lease = await a.create_lease({"gpus": 1})
        with pytest.raises(ApiError) as e:
            await b.release(lease["id"])
        assert e.value.status in (403, 404)
        with pytest.raises(ApiError) as e:
            await a.request("POST", f"/v1/leases/{lease['id']}/heartbeat")  # no JSON body (renew's is optional)
        assert e.value.status == 415 and "only accepts application/json" in e.value.message
        await a.release(lease["id"])
        with pytest.raises(ApiError) as e:
            await a.heartbeat(lease["id"], [])
        assert e.value.status == 409 and "has ended" in e.value.message

    port = live.port
    await live.stop()
    rc = await amain(["--config", str(cfg), "status"])
    assert rc == 4 and f"connection refused by http://127.0.0.1:{port}" in capsys.readouterr().err


async def test_request_too_large_is_413(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, agent={"max_body_bytes": 4096})
    agent = LiveAgent(rig)
    await agent.start()
    try:
        async with HostClient(agent.url, rig.tokens["vm-a"], retries=0) as a:
            _, lease = await a.create_lease({"gpus": 1})
            samples = [{"ts": time.time(), "gpu": lease["devices"][0]["gpu_id"], "util_pct": 1.0}] * 200
            with pytest.raises(ApiError) as e:
                await a.heartbeat(lease["id"], samples)
            assert e.value.status == 413 and "lower batch_max" in e.value.message
    finally:
        await agent.stop()


async def test_unreachable_host_is_retried_with_backoff(tmp_path: Path) -> None:
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    async with HostClient("http://127.0.0.1:9", "t", retries=3, backoff_max_s=1.0, sleep=sleep) as c:
        with pytest.raises(HostUnreachable) as e:
            await c.get_lease("x")
    assert len(sleeps) == 3 and "after 4 attempts" in e.value.message and all(s <= 1.0 for s in sleeps)


# ---- the daemon ------------------------------------------------------------------------------------------------


async def test_daemon_heartbeats_every_active_lease_not_owned_by_run(live: LiveAgent, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(attached_gpus(live.rig, util=40.0)).install(monkeypatch)
    cfg_path = config(tmp_path, live)
    cfg = load_config(str(cfg_path))
    async with HostClient(live.url, cfg.token(), retries=0) as a:
        _, mine = await a.create_lease({"gpus": 1})
        _, owned = await a.create_lease({"gpus": 1})
    run_dir = Path(cfg.state_dir)
    run_dir.mkdir(parents=True)
    (run_dir / f"run-{owned['id']}.pid").write_text(f"{os.getpid()}\n")  # a live `run` reports for this one
    task = asyncio.create_task(amain(["--config", str(cfg_path), "daemon"]))
    await wait_for(lambda: len(live.runtime.recent_samples.get(mine["id"], ())) >= 3)
    os.kill(os.getpid(), signal.SIGTERM)  # the daemon's handler turns it into a clean stop
    assert await asyncio.wait_for(task, 10) == 0
    assert not live.runtime.recent_samples.get(owned["id"])
    assert {s["util_pct"] for s in live.runtime.recent_samples[mine["id"]]} == {40.0}
    assert all(x.state.value == "ACTIVE" for x in await leases_of(live))  # stopping the daemon keeps the leases


async def test_daemon_honours_a_reclaim_notice(live: LiveAgent, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(attached_gpus(live.rig, util=0.0, used=0)).install(monkeypatch)
    hook_out = tmp_path / "pre-release.txt"
    cfg_path = config(tmp_path, live, on_reclaim=f"echo checkpoint $HOSTAGENT_LEASE_ID > {hook_out}")
    async with HostClient(live.url, live.rig.tokens["vm-a"], retries=0) as a:
        _, lease = await a.create_lease({"gpus": 1})
    task = asyncio.create_task(amain(["--config", str(cfg_path), "daemon"]))
    await wait_for(lambda: live.runtime.last_heartbeat.get(lease["id"]))
    await force_notice(live, lease["id"], "reclaim")
    await wait_for(lambda: released(live))
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 10) == 0
    assert hook_out.read_text().split() == ["checkpoint", lease["id"]]
    assert (await leases_of(live))[0].end_reason == "released by guest on the reclaim notice (idle)"


async def test_more_than_its_share_429_is_retried_after_retry_after(live: LiveAgent,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A VM over its share (here its share of the lease queue: TooManyRequests -> 429 + Retry-After through the
    real middleware) waits as told and asks again, with the same idempotency key."""
    from hostagent.domain.errors import TooManyRequests

    real = live.runtime.manager.request
    keys = []

    async def share_full_once(domain_uuid: str, request: Any, **kw: Any) -> Any:
        keys.append(request.idempotency_key)
        if len(keys) == 1:
            raise TooManyRequests("VM vm-a already has 32 request(s) queued", retry_after=30)
        return await real(domain_uuid, request, **kw)

    monkeypatch.setattr(live.runtime.manager, "request", share_full_once)
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    async with HostClient(live.url, live.rig.tokens["vm-a"], retries=2, sleep=sleep, backoff_max_s=60) as a:
        status, lease = await a.create_lease({"gpus": 1, "idempotency_key": "job-1"})
    assert status == 201 and sleeps == [30.0] and keys == ["job-1", "job-1"]
    async with HostClient(live.url, live.rig.tokens["vm-a"], retries=0, sleep=sleep) as a:
        keys.clear()
        with pytest.raises(ApiError) as e:
            await a.create_lease({"gpus": 1, "idempotency_key": "job-2"})
    assert e.value.status == 429 and e.value.retry_after == 30.0 and "more than its share" in e.value.message


async def test_overloaded_host_503_is_retried_after_retry_after(live: LiveAgent, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's ingestion queue is full (its own Overloaded -> 503 + Retry-After through the real middleware)."""
    from hostagent.domain.errors import Overloaded

    real = live.runtime.accept_samples
    calls = []

    async def full_once(lease: Any, samples: Any) -> int:
        calls.append(len(samples))
        if len(calls) == 1:
            raise Overloaded("ingestion queue is full", retry_after=3)
        return await real(lease, samples)

    monkeypatch.setattr(live.runtime, "accept_samples", full_once)
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    async with HostClient(live.url, live.rig.tokens["vm-a"], retries=2, sleep=sleep) as a:
        _, lease = await a.create_lease({"gpus": 1})
        sample = {"ts": time.time(), "gpu": lease["devices"][0]["gpu_id"], "util_pct": 9.0}
        reply = await a.heartbeat(lease["id"], [sample])
        assert reply["accepted"] == 1 and sleeps == [3.0]
        calls.clear()
        with pytest.raises(ApiError) as e:
            await a.heartbeat(lease["id"], [sample], retries=0)
    assert e.value.status == 503 and e.value.retry_after == 3.0
    assert "overloaded or its hypervisor is unavailable (503 overloaded)" in e.value.message
    assert "retry after 3 s" in e.value.message


# ---- bookings (issue #22) --------------------------------------------------------------------------------------


async def test_reserve_books_a_window_offers_the_earliest_and_release_cancels(live: LiveAgent, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, live)
    out = io.StringIO()
    rc = await amain(["--config", str(cfg), "--json", "reserve", "--gpus", "8", "--start", "+3600", "--duration",
                      "1800", "--task-type", "training"], out=out)
    assert rc == 0
    booked = json.loads(out.getvalue())
    assert booked["state"] == "BOOKED" and len(booked["booking"]["gpus"]) == 8
    assert abs(booked["booking"]["start_at"] - (time.time() + 3600)) < 30
    # the same window again is refused with the earliest one that fits, said in the guest's terms
    assert await amain(["--config", str(cfg), "reserve", "--gpus", "1", "--start", "+3700", "--duration",
                        "60"]) == 3
    err = capsys.readouterr().err
    assert "the earliest window that fits starts" in err and "--or-later" in err
    out = io.StringIO()
    assert await amain(["--config", str(cfg), "--json", "reserve", "--gpus", "1", "--start", "+3700", "--duration",
                        "60", "--or-later"], out=out) == 0
    later = json.loads(out.getvalue())
    assert later["booking"]["start_at"] >= booked["booking"]["end_at"]
    out = io.StringIO()
    assert await amain(["--config", str(cfg), "status", booked["id"]], out=out) == 0
    assert "booked: " in out.getvalue() and "bound and attached from" in out.getvalue()
    out = io.StringIO()
    assert await amain(["--config", str(cfg), "release", booked["id"]], out=out) == 0
    assert "booking cancelled" in out.getvalue()
    # bad input, refused before anything is sent
    assert await amain(["--config", str(cfg), "reserve", "--start", "+60"]) == 2  # no --duration
    with pytest.raises(SystemExit):
        await amain(["--config", str(cfg), "reserve", "--start", "2026-11-28T09:00", "--duration", "60"])  # no zone
    assert "has no time zone" in capsys.readouterr().err


async def test_the_monitor_learns_of_a_top_up_from_its_heartbeat_reply(live: LiveAgent, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(attached_gpus(live.rig)).install(monkeypatch)
    cfg = load_config(str(config(tmp_path, live)))
    async with HostClient(live.url, live.rig.tokens["vm-b"], retries=0) as other, \
            HostClient(live.url, cfg.token(), retries=0) as client:
        _, big = await other.create_lease({"gpus": 6})
        _, lease = await client.create_lease({"gpus": 4, "accept_partial": True})
        assert lease["partial"]["granted"] == 2
        mon = Monitor(client, cfg, lambda: Sampler.open(sys_root=cfg.sys_root))
        t = mon.track(lease)
        await other.release(big["id"])
        await wait_for(lambda: len(live.runtime.manager.leases[lease["id"]].devices) == 4
                       and not live.runtime.manager.leases[lease["id"]].adding)
        reply = await mon.heartbeat(t)
        assert reply is not None and reply["granted_gpus"] == 4
        assert len(t.gpu_ids) == 4 and set(t.gpu_ids) >= {d["gpu_id"] for d in lease["devices"]}
        await mon.release(t, "test")
        await mon.close()


async def test_the_monitor_moves_the_work_and_confirms_a_move(live: LiveAgent, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(attached_gpus(live.rig)).install(monkeypatch)
    hook_out = tmp_path / "move.txt"
    cfg = load_config(str(config(tmp_path, live, on_move=f"env | grep ^HOSTAGENT_ > {hook_out}")))
    async with HostClient(live.url, cfg.token(), retries=0) as client, \
            HostClient(live.url, live.rig.operator, retries=0) as operator:
        _, lease = await client.create_lease({"gpus": 1})
        old = lease["devices"][0]["gpu_id"]
        gpus = (await operator.request("GET", "/v1/gpus"))[1]["gpus"]
        new = next(g["id"] for g in gpus if g["state"] == "free")
        mon = Monitor(client, cfg, lambda: Sampler.open(sys_root=cfg.sys_root))
        t = mon.track(lease)
        status, _ = await operator.request("POST", f"/v1/leases/{lease['id']}/move", {"to": new})
        assert status == 202
        reply = await mon.heartbeat(t)  # the notice comes with the reply: the hook runs, the guest confirms
        assert reply is not None and any(w["code"] == "move" for w in reply["warnings"])
        env = dict(line.split("=", 1) for line in hook_out.read_text().splitlines())
        assert env["HOSTAGENT_MOVE_FROM"] == old and env["HOSTAGENT_MOVE_TO"] == new
        assert env["HOSTAGENT_NOTICE"] == "move" and env["HOSTAGENT_LEASE_ID"] == lease["id"]
        after = live.runtime.manager.leases[lease["id"]]
        assert after.gpu_ids == (new,) and not after.move
        assert t.gpu_ids == [new]  # the monitor samples the new GPU only
        await mon.release(t, "test")
        await mon.close()
