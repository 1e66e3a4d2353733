"""kill -9 the agent (a subprocess) at every step of grant, release and reclaim; restart; check invariants.

Crash points are chosen by a hook (HOSTAGENT_CRASH_AT, `point@N` for its Nth occurrence), never by sleeps. Grant
and give-back points run on dgx8 (one function per IOMMU group) and on the workstation (groups of 2 and 4
functions, points on a later function, so a kill lands between two functions of one group). Every row works out
from the journal and the world at the kill which leases and GPUs the restart must repair, and asserts exactly those
got a repair event. The matrix is printed and saved to artifacts/crash-matrix.txt.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.crash import (
    AgentProcess,
    KillSnapshot,
    check_invariants,
    find_violations,
    make_agent_process,
    make_libvirtd_agent_process,
    read_world,
    repairs_needed,
    snapshot_at_kill,
)
from tests.support.libvirtd import PrivateLibvirtd, libvirtd  # noqa: F401  (the fixture)

ROOT = Path(__file__).parents[2]

GRANT_POINTS = [
    "bind:unbind", "bind:override", "bind:probe", "bind:read-back", "bind-device-done",
    "after-binding", "after-attaching", "before-attach", "after-attach-call", "after-active",
]
RELEASE_POINTS = [
    "after-detaching", "detach:sent", "after-detach-confirmed", "after-rebinding", "give-back:unbind-vfio",
    "give-back:clear-override", "give-back:probe", "give-back:read-back", "after-released",
]
# The workstation's three GPUs (groups of 2, 2 and 4 functions), all in one lease. `@2` is the group's second
# function; the second GPU's functions are @3 and @4.
WORKSTATION_GRANT_POINTS = ["bind:unbind@2", "bind:override@2", "bind:probe@2", "bind:read-back@2", "bind:vfio-node",
                            "bind:probe@4"]
WORKSTATION_RELEASE_POINTS = ["give-back:unbind-vfio@2", "give-back:clear-override@2", "give-back:probe@2",
                              "give-back:unbind-vfio@3"]
# Where the kill leaves one group with a function on vfio-pci and another off it: the split the restart must mend.
SPLIT_AT_KILL = {"bind:unbind@2", "bind:override@2", "bind:probe@2", "bind:probe@4", "give-back:unbind-vfio@2"}
RECLAIM_POINTS = ["reaper:strike-one", "reaper:strike-two", "reaper:reclaim"]
# Kills inside the reclaim's own release: its detach (sent, unacknowledged) and its give-back.
MID_RECLAIM_POINTS = ["after-detaching", "detach:sent", "give-back:unbind-vfio", "give-back:read-back@2"]
FAST_RECLAIM = {"check_interval_s": 0.3, "grace_s": 0.6, "min_lease_age_s": 0.0, "notice_window_s": 0.3,
                "no_heartbeat": "host-signal"}
# Against a real libvirtd (CONFIG attach/detach on a shut-off domain). detach:sent is left out there: the adapter's
# first wait is its domain lookup, before the request, and a persistent detach is confirmed at once anyway.
LIBVIRTD_GRANT_POINTS = ["after-attaching", "after-attach-call", "after-active"]
LIBVIRTD_RELEASE_POINTS = ["after-detaching", "after-detach-confirmed", "give-back:unbind-vfio"]
# A partial lease topped up when GPUs free (services.top_up): each of its journaled steps.
TOP_UP_POINTS = ["top-up:journaled", "top-up:bound", "top-up:attached"]
# A make-before-break move (services.moves): each journaled step of the make (the guest confirms the move in between)
# and of the break.
MOVE_POINTS = ["move:making", "move:bound", "move:attached", "move:breaking", "move:detached"]
RECLAIM_REASON = "reclaimed: idle"  # the end_reason the reaper's release gives the lease
ACK_DELAY_S = 0.2  # the guest acknowledges a detach this long after it is asked (the agent waits up to 2 s)

MATRIX: list[tuple[str, ...]] = []


@pytest.fixture(scope="module", autouse=True)
def print_matrix() -> object:
    yield
    if not MATRIX:
        return
    cols = ("crash point", "world", "phase", "at the kill", "lease after restart", "repairs", "invariants")
    widths = [max(len(c), *(len(r[i]) for r in MATRIX)) for i, c in enumerate(cols[:-1])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    lines = [fmt.format(*cols), "-" * (sum(widths) + 2 * len(widths) + 10)] + [fmt.format(*r) for r in MATRIX]
    text = "\n".join(lines)
    out = ROOT / "artifacts"
    out.mkdir(exist_ok=True)
    (out / "crash-matrix.txt").write_text(text + "\n")
    print("\n" + text)


@dataclass(frozen=True)
class Row:
    """One crash: where it is, in which world, and what the lease must end as after the restart."""

    point: str
    phase: str  # grant | release | reclaim | top-up | move
    scenario: str = "dgx8"
    gpus: int = 2
    refuse_detach: bool = False  # the guest never lets go of a detached device
    libvirtd: bool = False  # a real libvirtd, the domain shut off

    @property
    def world(self) -> str:
        hv = "libvirtd (shut off)" if self.libvirtd else "sim"
        return f"{self.scenario}/{hv}" + (" refuse" if self.refuse_detach else "")


def _lease(ap: AgentProcess, gpus: int) -> tuple[int, Any]:
    return ap.call("POST", "/v1/leases", {"gpus": gpus, "task_type": "training"}, token=ap.vm_token)


def _at_kill(snap: KillSnapshot, lease_id: str | None) -> str:
    """The matrix's view of the kill: the lease's journaled state and what was broken then."""
    mine = [x for x in snap.leases if x["id"] == lease_id] if lease_id else snap.leases
    state = mine[0]["state"] if mine else "-"
    broken = snap.violations
    tags = [t for t, key in (("split", "split across"), ("driverless", "no driver"), ("orphan", "without a lease"))
            if any(key in v for v in broken)]
    if snap.world.unacked:  # as persisted: the simulator writes an acknowledgement a moment after it happens
        tags.append(f"{snap.world.unacked} detach pending in hv")
    return state + (f" ({', '.join(tags)})" if tags else "")


def _run_point(ap: AgentProcess, row: Row) -> str:
    host_drivers = read_world(ap).drivers  # before anything was bound
    ap.start(crash_at=row.point)
    lease_id = None
    try:
        if row.phase == "grant":
            try:
                _lease(ap, row.gpus)
            except OSError:
                pass  # the connection dies with the agent
        elif row.phase == "top-up":  # a partial lease of 1 of 2 GPUs, topped up when the other lease ends
            total = len(read_world(ap).viable)
            status, hold = _lease(ap, total - 1)
            assert status == 201, hold
            status, body = ap.call("POST", "/v1/leases", {"gpus": 2, "accept_partial": True}, token=ap.vm_token)
            assert status == 201 and len(body["devices"]) == 1, body
            lease_id = body["id"]
            with contextlib.suppress(OSError):
                ap.call("DELETE", f"/v1/leases/{hold['id']}", token=ap.vm_token)
        elif row.phase == "move":  # a one-GPU lease moved to a free GPU, the guest confirming at once
            status, body = _lease(ap, 1)
            assert status == 201 and body["state"] == "ACTIVE", body
            lease_id = body["id"]
            _, gpus = ap.call("GET", "/v1/gpus", token=ap.operator)
            to = next(g["id"] for g in gpus["gpus"] if g["state"] == "free")
            with contextlib.suppress(OSError):
                status, moving = ap.call("POST", f"/v1/leases/{lease_id}/move", {"to": to}, token=ap.operator)
                assert status == 202, moving
                ap.call("POST", f"/v1/leases/{lease_id}/move/done", token=ap.vm_token)
        else:
            status, body = _lease(ap, row.gpus)
            assert status == 201 and body["state"] == "ACTIVE", body
            lease_id = body["id"]
            if row.phase == "release":
                try:
                    ap.call("DELETE", f"/v1/leases/{lease_id}", token=ap.vm_token)
                except OSError:
                    pass
        rc = ap.wait_killed(timeout=30)
        assert rc == -signal.SIGKILL, f"agent exited with {rc}, not by the crash point"
    finally:
        if ap.proc is not None and ap.proc.poll() is None:
            ap.proc.kill()
    snap = snapshot_at_kill(ap)
    need = repairs_needed(snap)
    if row.point in SPLIT_AT_KILL:  # the kill landed between two functions of a group, and the check sees it
        assert any("split across drivers" in v for v in snap.violations), snap.violations
    ap.start()
    try:
        if row.phase == "reclaim":
            _check_reclaim_survives_restart(ap, lease_id)
        if row.phase == "top-up":  # the restarted agent settles the top-up, then tops it up again: let it finish
            _wait_topped_up(ap, lease_id)
        if row.phase == "move":
            _wait_moved(ap, lease_id)
        verdict = check_invariants(ap, since_seq=snap.last_seq)
        lease = verdict.leases.get(lease_id) if lease_id else next(iter(verdict.leases.values()), None)
        state = lease["state"] if lease else "none"
        MATRIX.append((row.point, row.world, row.phase, _at_kill(snap, lease_id), state,
                       f"{len(need)} needed, {len(verdict.repaired & set(need))} done, {len(verdict.repairs)} events",
                       "OK" if not verdict.violations else "; ".join(verdict.violations)))
        assert not verdict.violations, verdict.violations
        # Every repair recorded: each lease or GPU the kill left broken has a repair event naming it, and nothing
        # else was "repaired" (a row that needed no repair has no repair event).
        assert verdict.repaired == set(need), (need, verdict.repairs)
        if row.phase in ("release", "reclaim"):
            want = "DETACH_PENDING" if row.refuse_detach else "RELEASED"
            assert state == want, f"release did not end as {want} after restart: {lease}"
        functions = [f for d in lease["devices"] for f in d["functions"]] if lease else []
        world = read_world(ap)
        if state == "RELEASED":  # every function back on the driver it had before the lease
            assert all(world.drivers[f] == host_drivers[f] for f in functions), (lease, world.drivers)
        if row.refuse_detach:  # the guest still holds the devices: not one was given back
            assert all(world.drivers[f] == "vfio-pci" and world.attached.get(f) == "vm-crash" for f in functions), lease
        if row.libvirtd and state == "ACTIVE":  # in the domain's persistent XML, as libvirtd itself reports it
            assert functions and all(world.attached.get(f) == lease["domain"]["name"] for f in functions), lease
        if row.phase == "reclaim":  # a reclaim cut short still ends as a reclaim
            assert lease and lease["end_reason"] == RECLAIM_REASON, lease
        _follow_up(ap, verdict.free_gpus(world), row)
        return state
    finally:
        ap.stop()


def _follow_up(ap: AgentProcess, free: int, row: Row) -> None:
    """The agent keeps working after the repair: a new lease asking for every GPU gets exactly the free ones (all
    viable GPUs minus those live leases hold or the agent set aside), and releases them."""
    assert free > 0
    total = len(read_world(ap).viable)
    status, body = ap.call("POST", "/v1/leases", {"gpus": total, "accept_partial": True}, token=ap.vm_token)
    assert status == 201 and body["state"] == "ACTIVE", body
    assert body["granted_gpus"] == len(body["devices"]) == free, (free, body)
    status, body = ap.call("DELETE", f"/v1/leases/{body['id']}", token=ap.vm_token)
    assert (status, body["state"]) == ((202, "DETACH_PENDING") if row.refuse_detach else (200, "RELEASED")), body
    assert not check_invariants(ap).violations


def _wait_topped_up(ap: AgentProcess, lease_id: str | None) -> None:
    """The partial lease ends with both its GPUs and no top-up under way."""
    deadline = time.monotonic() + 30
    body: Any = None
    while time.monotonic() < deadline:
        _, body = ap.call("GET", f"/v1/leases/{lease_id}", token=ap.operator)
        if body["state"] == "ACTIVE" and len(body["devices"]) == 2 and "partial" not in body:
            return
        time.sleep(0.1)
    raise AssertionError(f"the top-up did not finish after the restart: {body}")


def _wait_moved(ap: AgentProcess, lease_id: str | None) -> None:
    """The moved lease ends ACTIVE with one GPU and no move under way: a make the restart found attached is
    confirmed by the guest again (it waits for it), an undone one left the old GPU, a break resumed finishes."""
    deadline = time.monotonic() + 30
    body: Any = None
    while time.monotonic() < deadline:
        _, body = ap.call("GET", f"/v1/leases/{lease_id}", token=ap.operator)
        phase = (body.get("move") or {}).get("phase")
        if body["state"] == "ACTIVE" and phase is None and len(body["devices"]) == 1:
            return
        if phase == "waiting":
            ap.call("POST", f"/v1/leases/{lease_id}/move/done", token=ap.vm_token)
        time.sleep(0.1)
    raise AssertionError(f"the move did not settle after the restart: {body}")


def _check_reclaim_survives_restart(ap: AgentProcess, lease_id: str | None) -> None:
    """Wait for the reclaim to finish; strike one was not forgotten (one strike-one event) nor acted on early."""
    assert lease_id
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, body = ap.call("GET", f"/v1/leases/{lease_id}", token=ap.operator)
        if body["state"] == "RELEASED":
            break
        time.sleep(0.1)
    status, ev = ap.call("GET", f"/v1/events?lease_id={lease_id}", token=ap.operator)
    kinds = [(e["kind"], e["ts"]) for e in ev["events"]]
    strikes = [t for k, t in kinds if k == "strike-one"]
    reclaims = [t for k, t in kinds if k == "reclaim"]
    assert len(strikes) == 1, kinds
    assert reclaims and reclaims[0] - strikes[0] >= FAST_RECLAIM["grace_s"], kinds


@pytest.mark.parametrize("point", GRANT_POINTS)
def test_crash_during_grant(tmp_path: Path, point: str) -> None:
    _run_point(make_agent_process(tmp_path), Row(point, "grant"))


@pytest.mark.parametrize("point", RELEASE_POINTS)
def test_crash_during_release(tmp_path: Path, point: str) -> None:
    _run_point(make_agent_process(tmp_path, detach_ack_delay_s=ACK_DELAY_S), Row(point, "release"))


@pytest.mark.parametrize("point", WORKSTATION_GRANT_POINTS)
def test_crash_mid_group_during_grant(tmp_path: Path, point: str) -> None:
    _run_point(make_agent_process(tmp_path, scenario="workstation-vfio"), Row(point, "grant", "workstation", gpus=3))


@pytest.mark.parametrize("point", WORKSTATION_RELEASE_POINTS)
def test_crash_mid_group_during_give_back(tmp_path: Path, point: str) -> None:
    _run_point(make_agent_process(tmp_path, scenario="workstation-vfio"), Row(point, "release", "workstation", gpus=3))


@pytest.mark.parametrize("point", ["detach:sent", "after-detach_pending"])
def test_crash_while_the_guest_holds_a_detached_device(tmp_path: Path, point: str) -> None:
    """The guest never acknowledges the detach: after the restart the lease is DETACH_PENDING, its devices still
    on vfio-pci and in the domain (never given back while the domain may hold them)."""
    _run_point(make_agent_process(tmp_path, refuse_detach=True), Row(point, "release", refuse_detach=True))


@pytest.mark.parametrize("point", TOP_UP_POINTS)
def test_crash_during_top_up(tmp_path: Path, point: str) -> None:
    _run_point(make_agent_process(tmp_path), Row(point, "top-up"))


@pytest.mark.parametrize("point", MOVE_POINTS)
def test_crash_during_a_move(tmp_path: Path, point: str) -> None:
    state = _run_point(make_agent_process(tmp_path, detach_ack_delay_s=ACK_DELAY_S), Row(point, "move"))
    assert state == "ACTIVE"


@pytest.mark.parametrize("point", RECLAIM_POINTS + MID_RECLAIM_POINTS)
def test_crash_during_reclaim(tmp_path: Path, point: str) -> None:
    ap = make_agent_process(tmp_path, reclaim=FAST_RECLAIM, detach_ack_delay_s=ACK_DELAY_S)
    t0 = time.monotonic()
    _run_point(ap, Row(point, "reclaim"))
    assert time.monotonic() - t0 < 120


def _run_libvirtd_point(tmp_path: Path, libvirtd: PrivateLibvirtd, row: Row) -> None:
    ap = make_libvirtd_agent_process(tmp_path, libvirtd)
    try:
        _run_point(ap, row)
    finally:  # the daemon is shared by the rows: the next row's agent must not find this domain's hostdevs
        with contextlib.suppress(RuntimeError):
            libvirtd.virsh("undefine", ap.vm_uuid)


@pytest.mark.libvirtd
@pytest.mark.parametrize("point", LIBVIRTD_GRANT_POINTS)
def test_crash_during_grant_on_libvirtd(tmp_path: Path, libvirtd: PrivateLibvirtd, point: str) -> None:
    _run_libvirtd_point(tmp_path, libvirtd, Row(point, "grant", libvirtd=True))


@pytest.mark.libvirtd
@pytest.mark.parametrize("point", LIBVIRTD_RELEASE_POINTS)
def test_crash_during_release_on_libvirtd(tmp_path: Path, libvirtd: PrivateLibvirtd, point: str) -> None:
    _run_libvirtd_point(tmp_path, libvirtd, Row(point, "release", libvirtd=True))


def test_the_checks_see_a_split_group_and_a_lease_without_its_device(tmp_path: Path) -> None:
    """The invariants are not vacuous: a workstation group half on vfio-pci, a lease claiming a device that is not
    attached, and a GPU claimed twice are each reported (the matrix rows then prove the restart mends them)."""
    ap = make_agent_process(tmp_path, scenario="workstation-vfio")
    world = read_world(ap)
    assert not find_violations(world, [])
    group = next(a for a in world.groups.values() if len(a) == 4)
    world.drivers[group[1]] = "vfio-pci"
    gpu = next(g for g, f in world.gpu_functions.items() if f == group)
    lease = {"id": "l-x", "state": "ACTIVE", "domain": {"uuid": ap.vm_uuid, "name": "vm-crash"},
             "devices": [{"gpu_id": gpu, "functions": list(group)}]}
    found = find_violations(world, [lease, {**lease, "id": "l-y", "state": "DETACH_PENDING"}])
    assert any("split across drivers" in v for v in found), found
    assert any(f"ACTIVE lease l-x claims {group[0]}, which is on" in v for v in found), found
    assert any("attached to None" in v for v in found), found
    assert any(f"{gpu} claimed by two leases" in v for v in found), found
    # the journal and the domain XML disagree on where the guest sees a function
    pair = next(a for a in world.groups.values() if len(a) == 2)
    for f, at in zip(pair, ("0000:01:00.0", "0000:02:00.0")):
        world.drivers[f], world.attached[f], world.guest[f] = "vfio-pci", "vm-crash", at
    gpu = next(g for g, f in world.gpu_functions.items() if f == pair)
    moved = {**lease, "id": "l-z", "devices": [{"gpu_id": gpu, "functions": list(pair),
                                                "guest_addresses": ["0000:01:00.0", "0000:03:00.0"]}]}
    assert [v for v in find_violations(world, [moved]) if "l-z" in v] == [
        f"ACTIVE lease l-z records {pair[1]} at guest address 0000:03:00.0, the domain has it at 0000:02:00.0"]
