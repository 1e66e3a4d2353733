"""The demo agent as a subprocess over a prepared simulated host: many VMs, chosen hypervisor latencies.

`prepare_host` writes what `hostagent demo` would (fake sysfs tree, simulated hypervisor state, guest tokens,
credentials) but with as many VMs as a benchmark needs, before the agent starts; `AgentProcess` starts
`python -m hostagent demo` on it, waits for its URL, samples its RSS and CPU from /proc, and kills it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hostagent.host.memory import read_rss_bytes

REPO = Path(__file__).resolve().parents[2]
CREDENTIALS = "demo-credentials.json"


def prepare_host(state_dir: Path, *, vms: int, scenario: str = "demo16", attach_latency_s: float = 0.05,
                 detach_ack_delay_s: float = 0.2) -> dict[str, Any]:
    """Build the simulated host in state_dir with `vms` running VMs and a token each; returns the credentials."""
    from hostagent.host.fakesysfs import build_tree
    from hostagent.store.journal import Journal
    from hostagent.virt.sim import SimulatedHypervisor
    from hostagent.web.auth import hash_token, new_token

    state_dir.mkdir(parents=True, exist_ok=True)
    build_tree(state_dir / "host", scenario)
    hv = SimulatedHypervisor(path=state_dir / "hypervisor.json", attach_latency_s=attach_latency_s,
                             detach_ack_delay_s=detach_ack_delay_s)
    for i in range(vms):
        hv.define(f"vm-{i:03d}", running=True)
    hv.save()
    journal = Journal(state_dir / "journal.sqlite3")
    try:
        out = []
        for dom in hv.domains_sync():
            token = new_token("vm")
            journal.add_token(hash_token(token), role="guest", domain_uuid=dom.uuid, domain_name=dom.name)
            out.append({"domain": dom.name, "uuid": dom.uuid, "token": token})
    finally:
        journal.close()
    creds = {"operator": {"token": new_token("op")}, "vms": out}
    path = state_dir / CREDENTIALS
    path.write_text(json.dumps(creds, indent=2) + "\n")
    os.chmod(path, 0o600)
    return creds


def read_rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB (None once it is gone)."""
    rss = read_rss_bytes(pid)
    return None if rss is None else rss // 1024


def read_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds a process has used (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3 of the man page
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class AgentProcess:
    """One `hostagent demo` subprocess on a prepared state directory."""

    state_dir: Path
    scenario: str = "demo16"
    log_path: Path | None = None
    proc: subprocess.Popen[str] | None = None
    url: str = ""
    spawned_at: float = 0.0
    serving_at: float = 0.0
    _log: IO[str] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """The agent's process id."""
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 60.0) -> str:
        """Spawn the agent and wait for its `serving on URL` line; returns the URL."""
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("HOSTAGENT_CONFIG", None)
        log_path = self.log_path or self.state_dir / "agent.log"
        self._log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self.spawned_at = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hostagent", "demo", "--port", "0", "--listen", "127.0.0.1",
             "--state-dir", str(self.state_dir), "--scenario", self.scenario],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the agent exited (status {self.proc.wait()}) before serving; see {log_path}")
            if line.startswith("hostagent: serving on "):
                self.serving_at = time.perf_counter()
                self.url = line.split("serving on ", 1)[1].strip()
                return self.url
        self.kill()
        raise RuntimeError(f"the agent did not serve within {timeout_s} s; see {log_path}")

    def kill(self) -> None:
        """SIGKILL (a crash, no cleanup) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._close()

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (a clean stop) and reap; SIGKILL if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close()

    def _close(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None
