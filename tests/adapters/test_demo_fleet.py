"""`hostagent demo --hosts N --db URL` (issue #20): N demo hosts over one real MariaDB are one fleet.

The first host runs in the demo's process, the others as its children; every host publishes to the shared store,
so each one's fleet view lists all of them with their own dashboards, and stopping the demo stops them all.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.dashboard import ROOT, start_demo
from tests.support.store import mysql_database, mysql_url
from tests.support.waits import wait_until

pytestmark = pytest.mark.timeout(240)


def test_a_fleet_demo_runs_its_hosts_over_one_store_and_stops_them_all(tmp_path: Path) -> None:
    with mysql_database("hademo") as db:
        d = start_demo(tmp_path / "fleet", "--hosts", "3", "--db", mysql_url(db), "--quiet", timeout=120.0)
        children = []
        try:
            def three() -> bool:
                # a host publishes as it starts, then again with its URL once its server listens: wait for both
                status, body = d.api("GET", "/v1/fleet", d.operator)
                return status == 200 and sorted(h["id"] for h in body["hosts"] if not h["stale"] and h["url"]) == [
                    "demo-host-1", "demo-host-2", "demo-host-3"]
            assert wait_until(three, timeout=90.0, interval=1.0), d.log[-20:]
            hosts = {h["id"]: h for h in d.api("GET", "/v1/fleet", d.operator)[1]["hosts"]}
            assert all(h["gpus"] == 16 for h in hosts.values())
            assert hosts["demo-host-1"]["this"] and hosts["demo-host-1"]["url"] == d.url
            # each other host serves its own dashboard, and the fleet's one operator token opens it
            for name in ("demo-host-2", "demo-host-3"):
                url = hosts[name]["url"]
                assert url and url != d.url
                req = urllib.request.Request(url + "/v1/gpus", headers={"Authorization": f"Bearer {d.operator}"})
                with urllib.request.urlopen(req, timeout=10) as r:
                    assert r.status == 200 and len(json.load(r)["gpus"]) == 16
            children = _children(d.proc.pid)
            assert len(children) == 2, "hosts 2 and 3 are the demo's children"
        finally:
            d.proc.send_signal(signal.SIGINT)
            d.proc.wait(timeout=60)
        assert wait_until(lambda: not any(_alive(pid) for pid in children), timeout=30.0), "the fleet stops with it"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    return [int(x) for x in out.stdout.split()]


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_hosts_without_a_shared_store_is_refused(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "hostagent", "demo", "--hosts", "2", "--state-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--db" in r.stderr
    assert not any(tmp_path.iterdir()), "nothing prepared"
