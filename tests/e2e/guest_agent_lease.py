"""Runs INSIDE the QEMU test guest (the `guest_agent` phase of guest_nested_libvirt.py): the whole lease with the
agent's own code in every role (#19).

The agent runs as it serves (``runtime.build_runtime`` + ``runtime.make_app``: the real SysfsHost over the outer
guest's kernel, the LibvirtHypervisor over the nested libvirtd, the journal, the usage store, the HTTP API with
token auth) on 127.0.0.1 of the outer guest. One thing differs from `hostagent serve`: its inventory, because the
outer guest has no GPU: the two-function e1000e group stands in for one (discovery picks display controllers
only; the lease code cares about the group).

The inner domain boots a real Linux (tests/e2e/inner_os.py) with a user-mode (SLIRP) NIC: 10.0.2.2 is the outer
guest's loopback. Its stage 2 brings the NIC up and, once the outer side has written the VM's token and the guest
agent's settings into the share, runs the guest agent itself from this checkout (standard library only, so the
inner interpreter imports it in tens of seconds, not minutes):

    python3 -m hostagent.guest.cli --config $SHARE/guest.toml --json run --gpus 1 --settle 240 -- sh check.sh

`check.sh` (the tenant's job) lists the Intel 82574L functions (8086:10d3) the inner kernel sees and stays a while,
so that heartbeats flow; the guest agent releases when it exits, the inner kernel's pciehp acknowledges the unplug,
libvirt emits DEVICE_REMOVED, and the agent gives both functions back to e1000e: RELEASED, never DETACH_PENDING.
Per-step timings are recorded; what the guest saw comes from the guest's own files in the share.

Then, in the same boot, an idle lease reclaimed through the guest agent's hooks (`_reclaim_part`), and a crash for
real (`_crash_part`): this agent stops, the agent is started as a process of its own over the same state directory
(tests/e2e/crash_agent.py) with the crash point after-attach-call armed, the guest's request kills it between the
attach and the ACTIVE write, and the agent started again reconciles the journal with the live domain XML.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hostagent.config import settings_from_dict
from hostagent.domain.hostdev import parse_domain_hostdevs
from hostagent.services.faults import CRASH_ENV
from hostagent.services.lease_types import guest_addr
from hostagent.store.journal import Journal
from hostagent.host.discovery import discover
from hostagent.host.sysfs import Sysfs
from hostagent.web.auth import hash_token, new_token
from tests.e2e.guest_nested_libvirt import drivers, gpus_at, wait_for
from tests.e2e.guest_os_lease import _active, _text
from tests.support.api import call_json
from tests.e2e.inner_os import CACHE, FIRST_PORT, STOP, URI, boot_inner, inner_os_domain_xml, pci_now, stage2_script

STATE = Path("/tmp/ga-state")  # the agent's state directory: its journal outlives the agent's process
PORT = 8471  # the agent's port on the outer guest's loopback; the inner guest reaches it as 10.0.2.2:PORT
BOOT_TIMEOUT_S = 480.0
DETACH_TIMEOUT_S = 90.0
RUN_TIMEOUT_S = 900.0  # the inner interpreter's start and import (~1-2 min nested), the lease, the job, the release
JOB_S = 40  # how long the tenant's job runs: several heartbeats at heartbeat_interval_s
HEARTBEAT_S = 5.0
# The idle detector in seconds, not hours: no strike before a lease is MIN_AGE_S old (the first lease has ended by
# then), a check every CHECK_S, strike two GRACE_S after strike one, then the cooperative notice.
MIN_AGE_S, CHECK_S, GRACE_S, NOTICE_S = 120.0, 10.0, 20.0, 240.0

# Stage 2's body: the NIC up, then (in the background, so the boot is "done" and the outer side can hand over the
# token) wait for `go` and run the guest agent; its output, exit status and timings land in the share.
GUEST_BODY = r"""
$bb modprobe virtio_net 2>/dev/null || modprobe virtio_net
$bb ip link set lo up
$bb ip link set eth0 up && $bb ip addr add 10.0.2.15/24 dev eth0 && $bb ip route add default via 10.0.2.2
$bb ip addr > "$SHARE/net.txt" 2>&1
(
  while [ ! -e "$SHARE/go" ]; do $bb sleep 1; done
  date +%s.%N > "$SHARE/run.start"
  "$PYTHON" -m hostagent.guest.cli --config "$SHARE/guest.toml" --json run --gpus 1 --settle 240 \
      -- sh "$SHARE/check.sh" > "$SHARE/run.out" 2> "$SHARE/run.err"
  echo $? > "$SHARE/run.rc.tmp"
  date +%s.%N > "$SHARE/run.end"
  $bb mv "$SHARE/run.rc.tmp" "$SHARE/run.rc"
  # the second lease: a job that leaves its GPU idle until the host reclaims it
  while [ ! -e "$SHARE/go2" ]; do $bb sleep 1; done
  date +%s.%N > "$SHARE/run2.start"
  "$PYTHON" -m hostagent.guest.cli --config "$SHARE/guest.toml" --json run --gpus 1 --settle 240 \
      -- sleep 1500 > "$SHARE/run2.out" 2> "$SHARE/run2.err"
  echo $? > "$SHARE/run2.rc.tmp"
  date +%s.%N > "$SHARE/run2.end"
  $bb mv "$SHARE/run2.rc.tmp" "$SHARE/run2.rc"
) &
"""

# The tenant's job: what the guest's own kernel lists as the two leased functions, then work for a while.
CHECK = f"""#!/bin/sh
date +%s.%N > "$SHARE/job.start"
for d in /sys/bus/pci/devices/*; do
  read -r v < "$d/vendor"; read -r i < "$d/device"
  [ "$v $i" = "0x8086 0x10d3" ] && echo "${{d##*/}}"
done > "$SHARE/seen.txt"
sleep {JOB_S}
[ "$(wc -l < "$SHARE/seen.txt")" -ge 2 ]
"""


def nic_inventory(pair_first: str) -> Any:
    """The outer guest's inventory as the agent's discovery reads it, with the two-function e1000e group (the one
    of `pair_first`) as its only GPU: the NIC pair stands in for a GPU (discovery picks display controllers only;
    the lease code cares about the group). After a crash its functions are on vfio-pci: the journal knows their
    drivers."""
    inv = discover(Sysfs("/sys"), vendors=())
    return dataclasses.replace(inv, gpus=tuple(gpus_at(inv, [pair_first])))


def agent_settings(state: Path, operator_sha256: str) -> Any:
    """The agent's settings over the outer guest's real kernel and the nested libvirtd."""
    return settings_from_dict({
        "agent": {"state_dir": str(state), "listen": "127.0.0.1", "port": PORT, "host_id": "nested",
                  "log_format": "text", "gc_freeze": False},
        "host": {"sysfs_root": "/sys", "kernel": "sysfs", "step_timeout_s": 60.0},
        "libvirt": {"uri": URI, "detach_timeout_s": DETACH_TIMEOUT_S, "guest_bus": FIRST_PORT},
        # the guest has no utilisation source (a NIC stands in for the GPU): its heartbeats carry no samples, so
        # the host's vfio interrupt counters judge (no_heartbeat = host-signal, and no posted interrupts under TCG)
        "reclaim": {"enabled": True, "check_interval_s": CHECK_S, "grace_s": GRACE_S, "min_lease_age_s": MIN_AGE_S,
                    "notice_window_s": NOTICE_S, "no_heartbeat": "host-signal", "host_signal": "trusted"},
        "auth": {"operator_token_sha256": operator_sha256},
    })


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus sample's values whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def guest_agent_phase(conn: Any, pair_first: str, vmlinux: str) -> dict[str, Any]:
    """Boot, serve, hand over the token, let the guest agent lease, work and release; the facts for the test."""
    import hostagent.runtime as runtime
    from aiohttp import web

    share = Path("/tmp/inner-ga")
    rec: dict[str, Any] = {}
    inv = await asyncio.to_thread(nic_inventory, pair_first)
    [gpu] = inv.gpus
    pair = [str(a) for a in gpu.group.addresses]  # type: ignore[union-attr]
    rec["functions"] = pair
    rec["drivers_before"] = drivers(pair)

    operator = new_token("op")
    settings = agent_settings(STATE, hash_token(operator))
    real_discover = runtime.discover_host
    runtime.discover_host = lambda s: inv
    try:
        rt = await asyncio.to_thread(runtime.build_runtime, settings)
    finally:
        runtime.discover_host = real_discover
    app = runtime.make_app(rt)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", PORT)
    await site.start()
    serving = True
    url = f"http://127.0.0.1:{PORT}"

    xml = inner_os_domain_xml("inner-ga", kernel=vmlinux, initrd=CACHE / "initramfs.cpio.gz", root_dir="/",
                              share_dir=share, memory_mib=512, vcpus=2, hotplug_ports=2, user_net=True,
                              console_path=Path("/tmp/inner-ga-console.log"))
    dom = None
    try:
        rec["boot"] = boot = await asyncio.to_thread(boot_inner, conn, "inner-ga", xml, share,
                                                     stage2_script(GUEST_BODY, keep_running=True), BOOT_TIMEOUT_S)
        if boot.get("state") != "done":
            return rec
        dom = conn.lookupByUUIDString(boot["uuid"])
        rec["inner_net"] = (share / "net.txt").read_text(errors="replace")[-600:] if (share / "net.txt").exists() else ""
        await wait_for(lambda: bool(pci_now(share)), 30)
        rec["guest_pci_before"] = before = pci_now(share)
        token = new_token("vm")  # the VM's own token, handed to the guest as an operator would (a root-only file)
        rt.journal.add_token(hash_token(token), role="guest", domain_uuid=boot["uuid"], domain_name="inner-ga")
        (share / "token").write_text(token + "\n")
        (share / "guest.toml").write_text(
            f'url = "http://10.0.2.2:{PORT}"\ntoken_file = "/run/hostagent-test/token"\n'
            f"heartbeat_interval_s = {HEARTBEAT_S}\nsample_interval_s = {HEARTBEAT_S}\nrequest_timeout_s = 120.0\n"
            'state_dir = "/tmp/hostagent-guest"\n'
            'on_warning = "date +%s.%N > /run/hostagent-test/warning.ran"\n'
            'on_reclaim = "date +%s.%N > /run/hostagent-test/reclaim.ran"\n'
            # on the notice the job (the `run` command, a GPU user) is stopped: SIGTERM, then the release
            "stop_gpu_users = true\nstop_grace_s = 10.0\n")
        (share / "check.sh").write_text(CHECK)
        t_go = time.time()
        (share / "go").write_text("")

        def leases_of_vm() -> list[Any]:
            return list(reversed(rt.journal.leases(domain_uuid=boot["uuid"])))  # oldest first

        got_active = await wait_for(lambda: any(x.state.value == "ACTIVE" for x in leases_of_vm()), RUN_TIMEOUT_S)
        rec["active_after_go_s"] = round(time.time() - t_go, 2) if got_active else None
        if got_active:
            rec["drivers_active"] = drivers(pair)
        done = await wait_for(lambda: (share / "run.rc").exists(), RUN_TIMEOUT_S)
        rec["run_rc"] = int((share / "run.rc").read_text().strip()) if done else None
        for name in ("run.out", "run.err", "seen.txt"):
            p = share / name
            rec[name] = p.read_text(errors="replace")[-3000:] if p.exists() else None
        for name in ("run.start", "job.start", "run.end"):
            p = share / name
            rec[name] = float(p.read_text().strip()) if p.exists() else None
        leases = leases_of_vm()
        rec["leases"] = [{"id": x.id, "state": x.state.value, "end_reason": x.end_reason} for x in leases]
        if leases:
            lid = leases[-1].id
            rec["finished"] = await wait_for(lambda: lid not in rt.manager.leases, 2 * DETACH_TIMEOUT_S)
            final = rt.journal.get(lid)
            rec["final_state"] = final.state.value if final is not None else None
            rec["end_reason"] = final.end_reason if final is not None else None
            rec["transitions"] = [(e.to_state, e.actor) for e in rt.journal.events(lease_id=lid) if e.to_state]
        rec["drivers_final"] = drivers(pair)
        rec["live_sources_final"] = sorted(str(h.source) for h in await rt.hypervisor.attached_hostdevs(boot["uuid"]))
        await wait_for(lambda: len(pci_now(share)) <= len(before), 30)
        rec["guest_pci_after"] = pci_now(share)
        rec["gpu_state_final"] = rt.manager.gpu_state(gpu.id).value
        # the first lease's heartbeats, through the agent's own metrics (before the second lease adds its own)
        req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {operator}"})
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=30).read().decode())
        rec["heartbeats"] = metric(text, "hostagent_http_request_duration_seconds_count", method="POST",
                                   route="/v1/leases/{lease_id}/heartbeat")
        rec["irq_lines"] = _vfio_lines()
        rec["reclaim"] = await _reclaim_part(rt, share, boot["uuid"], pair, before)
        # the crash: this agent stops and one in a child process takes over the same state directory
        await runner.cleanup()
        serving = False
        rec["crash"] = await _crash_part(conn, share, boot["uuid"], pair, before, operator, token)
    finally:
        (share / STOP).write_text("")
        if dom is not None:
            ended = await wait_for(lambda: not _active(dom), 60)
            if not ended:
                await asyncio.to_thread(dom.destroy)
        if serving:
            await runner.cleanup()
        rec["inner_dmesg_tail"] = [ln for ln in _text(share / "dmesg.txt").splitlines()
                                   if "pciehp" in ln or "virtio_net" in ln or "eth0" in ln][-12:]
    return rec


async def _reclaim_part(rt: Any, share: Path, uuid: str, pair: list[str], before: list[str]) -> dict[str, Any]:
    """The second lease: the guest agent runs a job that leaves the GPU idle; the host's idle detector strikes
    twice and sends the reclaim notice; the guest agent runs its hook and releases."""
    rec: dict[str, Any] = {}
    known = {x.id for x in rt.journal.leases(domain_uuid=uuid)}
    t_go = time.time()
    (share / "go2").write_text("")

    def second() -> Any:
        return next((x for x in rt.journal.leases(domain_uuid=uuid) if x.id not in known), None)

    active = await wait_for(lambda: (x := second()) is not None and x.state.value == "ACTIVE", RUN_TIMEOUT_S)
    rec["active_after_go_s"] = round(time.time() - t_go, 2) if active else None
    lease = second()
    if lease is None:
        return rec
    rec["lease_id"] = lid = lease.id
    rec["drivers_active"] = drivers(pair)
    rec["irq_lines_active"] = _vfio_lines()
    done = await wait_for(lambda: (share / "run2.rc").exists(), RUN_TIMEOUT_S)
    rec["run_rc"] = int((share / "run2.rc").read_text().strip()) if done else None
    rec["run_err"] = _text(share / "run2.err")[-3000:]
    for name in ("run2.start", "warning.ran", "reclaim.ran", "run2.end"):
        p = share / name
        rec[name] = float(p.read_text().strip()) if p.exists() else None
    rec["finished"] = await wait_for(lambda: lid not in rt.manager.leases, 2 * DETACH_TIMEOUT_S)
    final = rt.journal.get(lid)
    rec["final_state"] = final.state.value if final is not None else None
    rec["end_reason"] = final.end_reason if final is not None else None
    events = rt.journal.events(lease_id=lid)
    rec["events"] = [(e.kind, e.to_state, e.actor, (e.detail or "")[:160], round(e.ts - t_go, 1)) for e in events]
    rec["verdicts"] = {k: list(v) for k, v in getattr(rt.reaper, "last_verdicts", {}).items()}
    rec["drivers_final"] = drivers(pair)
    rec["live_sources_final"] = sorted(str(h.source) for h in await rt.hypervisor.attached_hostdevs(uuid))
    await wait_for(lambda: len(pci_now(share)) <= len(before), 30)
    rec["guest_pci_after"] = pci_now(share)
    return rec


def _vfio_lines() -> list[str]:
    """The outer kernel's vfio interrupt lines (the host-side activity signal the idle detector reads)."""
    return [ln.strip()[:160] for ln in _text(Path("/proc/interrupts")).splitlines() if "vfio" in ln]


CRASH_AT = "after-attach-call"  # the attach call returned; ACTIVE not yet written (hostagent.services.grant_path)
AGENT_START_S = 300.0  # the agent process's import and start under TCG in the outer guest
ROOT = Path(__file__).resolve().parents[2]  # the checkout: the child agent runs `-m tests.e2e.crash_agent` from it


def _call(method: str, path: str, token: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """One API call to the agent on PORT as a client makes it: (status, JSON body)."""
    return call_json(f"http://127.0.0.1:{PORT}", method, path, body, token, timeout)


def _healthy() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/healthz", timeout=1.0) as r:
            return r.status == 200
    except OSError:
        return False


def _start_agent(pair_first: str, operator: str, log: Path, crash_at: str | None) -> subprocess.Popen[bytes]:
    """The agent as a process of its own (tests/e2e/crash_agent.py) over STATE; `crash_at` arms a crash point."""
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    if crash_at:
        env[CRASH_ENV] = crash_at
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "tests.e2e.crash_agent", str(STATE), pair_first,
                                 hash_token(operator)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _live_hostdevs(conn: Any, uuid: str) -> dict[str, str]:
    """What the live domain XML holds: host source -> guest address, from libvirt itself."""
    xml = conn.lookupByUUIDString(uuid).XMLDesc(0)
    return {str(h.source): guest_addr(h) for h in parse_domain_hostdevs(xml)}


@contextlib.contextmanager
def _journal() -> Iterator[Journal]:
    """The journal on disk, as the agent processes leave it (opened while none of them runs)."""
    j = Journal(STATE / "journal.sqlite3")
    try:
        yield j
    finally:
        j.close()


def _journal_lease(lid: str | None, uuid: str, known: set[str]) -> tuple[Any, list[Any]]:
    """The lease (`lid`, or this domain's one not in `known`) and its events, as the journal on disk holds them."""
    with _journal() as j:
        lease = j.get(lid) if lid else next((x for x in j.leases(domain_uuid=uuid) if x.id not in known), None)
        return lease, (j.events(lease_id=lease.id) if lease is not None else [])


async def _crash_part(conn: Any, share: Path, uuid: str, pair: list[str], before: list[str], operator: str,
                      token: str) -> dict[str, Any]:
    """The agent, in a process of its own, is killed with SIGKILL between the attach call and the ACTIVE write;
    started again over the same state directory it reconciles the journal with the live domain XML; then the lease
    is released through the API as the guest would. Each step's facts come from the outer kernel (sysfs), libvirt
    (the live XML), the journal on disk and the inner guest's own PCI listing."""
    rec: dict[str, Any] = {"crash_at": CRASH_AT}
    logs = [Path("/tmp/crash-agent-1.log"), Path("/tmp/crash-agent-2.log")]
    with _journal() as j:
        known = {x.id for x in j.leases(domain_uuid=uuid)}
    t0 = time.monotonic()
    first = _start_agent(pair[0], operator, logs[0], CRASH_AT)
    agent = first
    try:
        rec["first_up"] = await wait_for(_healthy, AGENT_START_S)
        rec["first_up_s"] = round(time.monotonic() - t0, 2)
        t_req = time.monotonic()
        try:  # the guest's request: the agent dies while serving it
            rec["request_reply"] = await asyncio.to_thread(_call, "POST", "/v1/leases", token, {"gpus": 1}, 300.0)
        except OSError as exc:  # the connection the guest sent it on dies with the agent (RemoteDisconnected...)
            rec["request_error"] = f"{type(exc).__name__}: {exc}"[:200]
        rec["first_rc"] = await asyncio.to_thread(first.wait, 60)
        rec["killed_after_s"] = round(time.monotonic() - t_req, 2)
        rec["first_log_tail"] = _text(logs[0])[-1500:]
        # at the crash: what the journal, the outer kernel, libvirt and the inner guest say
        lease, _ = _journal_lease(None, uuid, known)
        rec["lease_id"] = lid = lease.id if lease is not None else None
        rec["journal_state_at_crash"] = lease.state.value if lease is not None else None
        rec["drivers_at_crash"] = drivers(pair)
        rec["live_at_crash"] = _live_hostdevs(conn, uuid)
        rec["guest_sees_at_crash"] = await wait_for(lambda: len(pci_now(share)) >= len(before) + 2, 60)
        rec["guest_pci_at_crash"] = pci_now(share)
        if lid is None:
            return rec
        # the restart: the agent as it starts after a crash, nothing else done by hand
        t_restart = time.monotonic()
        agent = _start_agent(pair[0], operator, logs[1], None)
        rec["second_up"] = await wait_for(_healthy, AGENT_START_S)
        rec["restart_to_serving_s"] = round(time.monotonic() - t_restart, 2)
        _, body = await asyncio.to_thread(_call, "GET", f"/v1/leases/{lid}", operator)
        rec["state_after_restart"] = body.get("state")
        rec["devices_after_restart"] = {a: g for d in body.get("devices", [])
                                        for a, g in zip(d["functions"], d["guest_addresses"], strict=True)}
        rec["live_after_restart"] = _live_hostdevs(conn, uuid)
        rec["drivers_after_restart"] = drivers(pair)
        _, gpus = await asyncio.to_thread(_call, "GET", "/v1/gpus", operator)
        rec["gpu_after_restart"] = [(g.get("state"), (g.get("lease") or {}).get("id")) for g in gpus.get("gpus", [])]
        # the guest gives it back as the guest agent does
        t_rel = time.monotonic()
        rec["release_reply"] = (await asyncio.to_thread(_call, "DELETE", f"/v1/leases/{lid}", token, None, 120.0))[0]

        def ended() -> bool:
            return _call("GET", f"/v1/leases/{lid}", operator, timeout=5.0)[1].get("state") in ("RELEASED", "FAILED")

        rec["released"] = await wait_for(ended, 2 * DETACH_TIMEOUT_S)
        rec["release_s"] = round(time.monotonic() - t_rel, 2)
        rec["drivers_final"] = drivers(pair)
        rec["live_final"] = _live_hostdevs(conn, uuid)
        await wait_for(lambda: len(pci_now(share)) <= len(before), 30)
        rec["guest_pci_after"] = pci_now(share)
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            rec["second_rc"] = await asyncio.to_thread(agent.wait, 60)
        for p in (first, agent):
            if p.poll() is None:
                p.kill()
        rec["second_log_tail"] = _text(logs[1])[-1500:]
    final, events = _journal_lease(rec.get("lease_id"), uuid, known)
    rec["final_state"] = final.state.value if final is not None else None
    rec["events"] = [(e.kind, e.to_state, e.actor, (e.detail or "")[:200]) for e in events]
    return rec

