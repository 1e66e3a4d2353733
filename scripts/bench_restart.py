#!/usr/bin/env python3
"""Restart to ready: kill -9 the agent holding 12 ACTIVE leases on a 16-GPU host, start it again, time until
GET /readyz says ready (reconcile of journal vs sysfs vs hypervisor included).

The agent runs as a subprocess (`hostagent demo` over a prepared simulated host, 16 VMs); all traffic goes to
127.0.0.1. Each round: SIGKILL, spawn, poll /readyz every 5 ms; after ready, check the 12 leases are still
ACTIVE and their GPUs LEASED (a fast restart that lost leases would not count). Baseline in the same run: the
same restart of an agent that holds no leases, and the bare interpreter + imports of the agent's modules.
Target: under 2 s. --profile runs one more restart under cProfile and prints where its time went.

    python scripts/bench_restart.py [--rounds 10] [--leases 12] [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostagent.bench.agentproc import REPO, AgentProcess, prepare_host, read_cpu_s  # noqa: E402
from hostagent.bench.machine import header_line  # noqa: E402
from hostagent.bench.stats import percentile  # noqa: E402

TARGET_S = 2.0
IMPORTS = "import hostagent.cli.parser, hostagent.demo, hostagent.runtime, hostagent.web.serve, hostagent.web.app, " \
          "hostagent.web.dashboard, hostagent.web.metrics, hostagent.store.aio, hostagent.store.ingest, " \
          "hostagent.virt.sim, hostagent.host.fakekernel, hostagent.learn.lifecycle"


def http(method: str, url: str, token: str | None = None, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    """One loopback request with the standard library (no event loop in this script)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - 127.0.0.1 only
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def wait_ready(url: str, timeout_s: float = 60.0) -> float:
    """Poll /readyz until 200; returns perf_counter() of the first ready answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status, _ = http("GET", url + "/readyz", timeout=2.0)
            if status == 200:
                return time.perf_counter()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.005)
    raise RuntimeError(f"{url} was not ready within {timeout_s} s")


class Restarter:
    """One agent state directory that is killed and restarted round after round."""

    def __init__(self, state: Path, creds: dict[str, Any], expect_active: int) -> None:
        self.state, self.creds, self.expect_active = state, creds, expect_active
        self.agent = AgentProcess(state)
        self.rounds: list[dict[str, float]] = []
        self.problems: list[str] = []

    def first_start(self) -> str:
        """Start the agent (not measured); returns its URL."""
        self.agent.start()
        wait_ready(self.agent.url)
        return self.agent.url

    def round(self) -> None:
        """kill -9, spawn, wait for ready; check the leases survived."""
        self.agent.kill()
        self.agent = AgentProcess(self.state)
        t0 = time.perf_counter()
        self.agent.start()
        ready = wait_ready(self.agent.url)
        cpu = read_cpu_s(self.agent.pid) or 0.0
        operator = self.creds["operator"]["token"]
        status, body = http("GET", self.agent.url + "/v1/leases?state=ACTIVE&limit=1000", operator)
        active = len(body["leases"]) if status == 200 else -1
        _, gpus = http("GET", self.agent.url + "/v1/gpus", operator)
        leased = sum(1 for g in gpus["gpus"] if g["state"].upper() == "LEASED")
        _, readyz = http("GET", self.agent.url + "/readyz")
        if active != self.expect_active or leased != self.expect_active:
            self.problems.append(f"round {len(self.rounds) + 1}: {active} ACTIVE leases, {leased} GPUs LEASED after "
                                 f"restart (expected {self.expect_active})")
        self.rounds.append({"serving": self.agent.serving_at - t0, "ready": ready - t0, "cpu": cpu,
                            "repairs": readyz["checks"]["reconciled"]["repairs"]})

    def stop(self) -> None:
        """Clean stop at the end."""
        self.agent.stop()


def grant(url: str, creds: dict[str, Any], n: int) -> None:
    """n VMs lease one GPU each (every one must be 201 ACTIVE)."""
    for vm in creds["vms"][:n]:
        status, body = http("POST", url + "/v1/leases", vm["token"], {"gpus": 1, "task_type": "training"})
        if status != 201 or body["state"] != "ACTIVE":
            raise RuntimeError(f"could not lease for {vm['domain']}: {status} {body}")


def import_time() -> tuple[float, float]:
    """(wall s, CPU s) for a fresh interpreter to import the agent's modules: the floor of any restart.

    The child leaves with os._exit right after importing, so tearing the modules down is not counted."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", IMPORTS + "; import os, time; print(time.process_time(), flush=True); "
                          "os._exit(0)"], cwd=REPO, env=env, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - t0, float(out.strip())


def import_breakdown(state: Path, top: int = 6) -> list[tuple[str, float]]:
    """One more start with -X importtime: the agent's top-level imports by cumulative seconds, largest first."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", PYTHONPROFILEIMPORTTIME="1")
    err = state.parent / "importtime.txt"
    with open(err, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hostagent", "demo", "--port", "0", "--state-dir", str(state), "--quiet"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("hostagent: serving on "):
                wait_ready(line.split("serving on ", 1)[1].strip())
                break
        proc.terminate()
        proc.wait(30)
    rows = []
    for line in err.read_text(encoding="utf-8").splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit() and not name.startswith("  "):  # top level: no indent after the bar
                rows.append((name.strip(), int(cumulative) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def profile_restart(state: Path) -> None:
    """One restart under cProfile (stopped cleanly once ready, so the profile is written); print the top."""
    prof = state.parent / "restart.prof"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with open(state / "agent.log", "a", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "hostagent", "demo",
                                 "--port", "0", "--state-dir", str(state), "--quiet"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True)
        assert proc.stdout is not None
        url = ""
        for line in proc.stdout:
            if line.startswith("hostagent: serving on "):
                url = line.split("serving on ", 1)[1].strip()
                break
        wait_ready(url)
        proc.terminate()
        proc.wait(30)
    buf = io.StringIO()
    pstats.Stats(str(prof), stream=buf).sort_stats("cumulative").print_stats(20)
    print("\ncProfile of one restart with leases (start to ready to clean stop), top 20 by cumulative time:")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip()))


def summary(name: str, rounds: list[dict[str, float]]) -> str:
    """One table row."""
    ready = [r["ready"] for r in rounds]
    serving = [r["serving"] for r in rounds] if "serving" in rounds[0] else []
    cpu = [r["cpu"] for r in rounds]
    return (f"  {name:<34} {len(rounds):>6} {percentile(serving, 50) if serving else float('nan'):>11.3f} "
            f"{percentile(ready, 50):>10.3f} {max(ready):>10.3f} {percentile(cpu, 50):>10.3f}")


def main() -> int:
    """Set up, restart with and without leases (interleaved, so a busy machine weighs on both alike), print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--leases", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="3 rounds each (a smoke run)")
    ap.add_argument("--profile", action="store_true", help="cProfile one restart with leases")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 3
    print(header_line())
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        empty_state, busy_state = Path(tmp) / "empty", Path(tmp) / "busy"
        empty = Restarter(empty_state, prepare_host(empty_state, vms=16, scenario="demo16"), 0)
        creds = prepare_host(busy_state, vms=16, scenario="demo16")
        busy = Restarter(busy_state, creds, args.leases)
        empty.first_start()
        grant(busy.first_start(), creds, args.leases)
        imports: list[dict[str, float]] = []
        try:
            for _ in range(args.rounds):
                wall, cpu = import_time()
                imports.append({"ready": wall, "cpu": cpu})
                empty.round()
                busy.round()
        finally:
            empty.stop()
            busy.stop()
        print(f"\nrestart to ready, seconds from spawn ({args.rounds} rounds each, interleaved; kill -9 before every start)")
        print(f"  {'case':<34} {'rounds':>6} {'serving p50':>11} {'ready p50':>10} {'ready max':>10} {'CPU s p50':>10}")
        print(summary("baseline: interpreter + imports", imports))
        print(summary("baseline: no leases", empty.rounds))
        print(summary(f"{args.leases} ACTIVE leases, 16 GPUs", busy.rounds))
        print("  (serving = the agent printed its URL, after reconcile; ready = first 200 from /readyz;")
        print("   CPU = the agent's user+system seconds when ready, which a busy machine does not inflate)")
        print(f"  repairs made by reconcile per restart: {sorted({int(r['repairs']) for r in busy.rounds})}")
        problems = empty.problems + busy.problems
        for p in problems:
            print(f"  PROBLEM: {p}")
        ready = [r["ready"] for r in busy.rounds]
        extra = percentile(ready, 50) - percentile([r["ready"] for r in empty.rounds], 50)
        imp = percentile([r["ready"] for r in imports], 50)
        print("\nverdict:")
        print(f"  restart to ready with {args.leases} leases: p50 {percentile(ready, 50):.3f} s, max {max(ready):.3f} s "
              f"(target < {TARGET_S:g} s) -> {'MET' if max(ready) < TARGET_S else 'MISSED'}")
        print(f"  the leases add {extra * 1e3:+.0f} ms (p50) over an agent without leases; interpreter + imports alone "
              f"take {imp:.3f} s ({imp / percentile(ready, 50) * 100:.0f} % of ready p50)")
        if not problems:
            print(f"  every restart kept its {args.leases} ACTIVE leases and their GPUs LEASED")
        biggest = import_breakdown(busy_state)
        print("  largest top-level imports of one start (python -X importtime, cumulative): "
              + ", ".join(f"{name} {sec:.2f} s" for name, sec in biggest))
        if args.profile:
            profile_restart(busy_state)
        return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
