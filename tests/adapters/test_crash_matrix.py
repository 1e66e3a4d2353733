"""kill -9 the agent (a subprocess) at every step of grant, release and reclaim; restart; check invariants.

Crash points are chosen by a hook (HOSTAGENT_CRASH_AT), never by sleeps. The matrix is printed and saved to
artifacts/crash-matrix.txt.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.support.crash import AgentProcess, check_invariants, make_agent_process

ROOT = Path(__file__).parents[2]

GRANT_POINTS = [
    "bind:unbind", "bind:override", "bind:probe", "bind:read-back", "bind-device-done",
    "after-binding", "after-attaching", "before-attach", "after-attach-call", "after-active",
]
RELEASE_POINTS = [
    "after-detaching", "after-detach-confirmed", "after-rebinding", "give-back:unbind-vfio",
    "give-back:clear-override", "give-back:probe", "give-back:read-back", "after-released",
]
RECLAIM_POINTS = ["reaper:strike-one", "reaper:strike-two", "reaper:reclaim"]
FAST_RECLAIM = {"check_interval_s": 0.3, "grace_s": 0.6, "min_lease_age_s": 0.0, "notice_window_s": 0.3,
                "no_heartbeat": "host-signal"}

MATRIX: list[tuple[str, str, str, int, str]] = []


@pytest.fixture(scope="module", autouse=True)
def print_matrix() -> object:
    yield
    if not MATRIX:
        return
    lines = [f"{'crash point':<26} {'phase':<8} {'lease after restart':<20} {'repairs':>7}  invariants",
             "-" * 80]
    lines += [f"{p:<26} {ph:<8} {st:<20} {r:>7}  {ok}" for p, ph, st, r, ok in MATRIX]
    text = "\n".join(lines)
    out = ROOT / "artifacts"
    out.mkdir(exist_ok=True)
    (out / "crash-matrix.txt").write_text(text + "\n")
    print("\n" + text)


def _lease(ap: AgentProcess) -> tuple[int, dict]:
    return ap.call("POST", "/v1/leases", {"gpus": 2, "task_type": "training"}, token=ap.vm_token)


def _run_point(ap: AgentProcess, point: str, phase: str) -> str:
    ap.start(crash_at=point)
    lease_id = None
    try:
        if phase == "grant":
            try:
                _lease(ap)
            except OSError:
                pass  # the connection dies with the agent
        else:
            status, body = _lease(ap)
            assert status == 201, body
            lease_id = body["id"]
            if phase == "release":
                try:
                    ap.call("DELETE", f"/v1/leases/{lease_id}", token=ap.vm_token)
                except OSError:
                    pass
        rc = ap.wait_killed(timeout=30)
        assert rc == -signal.SIGKILL, f"agent exited with {rc}, not by the crash point"
    finally:
        if ap.proc is not None and ap.proc.poll() is None:
            ap.proc.kill()
    ap.start()
    try:
        if phase == "reclaim":
            _check_reclaim_survives_restart(ap, lease_id)
        verdict = check_invariants(ap)
        state = verdict.leases.get(lease_id, "") if lease_id else next(iter(verdict.leases.values()), "none")
        MATRIX.append((point, phase, state, verdict.repairs, "OK" if not verdict.violations else
                       "; ".join(verdict.violations)))
        assert not verdict.violations, verdict.violations
        if phase != "reclaim" and point not in ("after-active", "after-released"):  # completed before the kill
            assert verdict.repairs >= 1, f"a crash at {point} left work half done, but no repair was recorded"
        if phase in ("release", "reclaim"):
            assert state == "RELEASED", f"release did not finish after restart: {state}"
        # The agent keeps working after the repair: lease and release all 8 GPUs.
        status, body = ap.call("POST", "/v1/leases", {"gpus": 8, "accept_partial": True}, token=ap.vm_token)
        assert status == 201, body
        status, body = ap.call("DELETE", f"/v1/leases/{body['id']}", token=ap.vm_token)
        assert status == 200 and body["state"] == "RELEASED", body
        assert not check_invariants(ap).violations
        return state
    finally:
        ap.stop()


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
    _run_point(make_agent_process(tmp_path), point, "grant")


@pytest.mark.parametrize("point", RELEASE_POINTS)
def test_crash_during_release(tmp_path: Path, point: str) -> None:
    _run_point(make_agent_process(tmp_path), point, "release")


@pytest.mark.parametrize("point", RECLAIM_POINTS)
def test_crash_during_reclaim(tmp_path: Path, point: str) -> None:
    ap = make_agent_process(tmp_path, reclaim=FAST_RECLAIM)
    t0 = time.monotonic()
    _run_point(ap, point, "reclaim")
    assert time.monotonic() - t0 < 120
