"""Run the agent as a subprocess over a fake tree + persisted simulated hypervisor; kill it; check invariants."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostagent.host.discovery import discover
from hostagent.host.fakesysfs import FakeHost, build_tree
from hostagent.host.sysfs import open_sysfs
from hostagent.store.journal import Journal
from hostagent.virt.sim import SimulatedHypervisor
from hostagent.web.auth import hash_token, new_token

ROOT = Path(__file__).parents[2]
LIVE_HOLDING = {"BINDING", "ATTACHING", "ACTIVE", "RELEASING", "DETACHING", "DETACH_PENDING", "REBINDING"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class AgentProcess:
    """A hostagent serve subprocess and the world it runs in."""

    dir: Path
    tree: FakeHost
    hv_path: Path
    config: Path
    port: int
    operator: str
    vm_token: str
    vm_uuid: str
    proc: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, crash_at: str | None = None, timeout: float = 20.0) -> None:
        env = dict(os.environ)
        env.pop("HOSTAGENT_CRASH_AT", None)
        if crash_at:
            env["HOSTAGENT_CRASH_AT"] = crash_at
        log = self.dir / f"agent-{len(self.logs)}.log"
        self.logs.append(log)
        self.proc = subprocess.Popen([sys.executable, "-m", "hostagent", "serve", "--config", str(self.config)],
                                     cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited with {self.proc.returncode} at start:\n{log.read_text()[-3000:]}")
            try:
                status, body = self.call("GET", "/readyz")
                if status == 200 and body.get("ready"):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"agent not ready in {timeout} s:\n{log.read_text()[-3000:]}")

    def call(self, method: str, path: str, body: Any = None, token: str | None = None,
             timeout: float = 30.0) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def wait_killed(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the crash point was never reached:\n{self.logs[-1].read_text()[-3000:]}") from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_agent_process(tmp: Path, *, scenario: str = "dgx8", reclaim: dict[str, Any] | None = None,
                       detach_ack_delay_s: float = 0.0) -> AgentProcess:
    """Write the tree, hypervisor state, config and a VM token."""
    tree = build_tree(tmp / "host", scenario)
    hv_path = tmp / "hv.json"
    hv = SimulatedHypervisor(path=hv_path, detach_ack_delay_s=detach_ack_delay_s)
    dom = hv.define("vm-crash", running=True)
    hv.save()
    operator, vm_token = new_token("op"), new_token("vm")
    state = tmp / "state"
    j = Journal(state / "journal.sqlite3")
    j.add_token(hash_token(vm_token), role="guest", domain_uuid=dom.uuid, domain_name=dom.name)
    j.close()
    port = free_port()
    rec = {"enabled": False} if reclaim is None else {"enabled": True, **reclaim}
    lines = [
        "[agent]", f'state_dir = "{state}"', f"port = {port}", 'host_id = "crash-host"', 'log_format = "json"',
        "[host]", f'sysfs_root = "{tree.sys_root}"', "step_timeout_s = 3.0",
        "[libvirt]", f'uri = "sim://{hv_path}"', "detach_timeout_s = 2.0",
        "[auth]", f'operator_token_sha256 = "{hash_token(operator)}"',
        "[reclaim]", *[f"{k} = {json.dumps(v)}" for k, v in rec.items()],
    ]
    config = tmp / "hostagent.toml"
    config.write_text("\n".join(lines) + "\n")
    return AgentProcess(tmp, tree, hv_path, config, port, operator, vm_token, dom.uuid)


@dataclass
class Verdict:
    """What the invariant check found."""

    violations: list[str]
    leases: dict[str, str]
    repairs: int


def check_invariants(ap: AgentProcess) -> Verdict:
    """No GPU on vfio-pci without a lease; no group split; no lease claiming a device it lacks; nothing given
    back while attached. Reads the tree, the hypervisor's persisted state and the agent's API."""
    violations: list[str] = []
    inv = discover(open_sysfs(ap.tree.sys_root))
    drivers = {str(f.address): f.driver for f in inv.functions}
    status, body = ap.call("GET", "/v1/leases?limit=10000", token=ap.operator)
    assert status == 200, body
    leases = body["leases"]
    held: dict[str, str] = {}
    for x in leases:
        if x["state"] in LIVE_HOLDING:
            for d in x["devices"]:
                for f in d["functions"]:
                    held[f] = x["id"]
    hv = SimulatedHypervisor.load(ap.hv_path)
    attached: dict[str, str] = {}

    async def read_attached() -> None:
        for dom in hv.domains_sync():
            for h in await hv.attached_hostdevs(dom.uuid):
                attached[str(h.source)] = dom.name

    asyncio.run(read_attached())
    for addr, drv in drivers.items():
        if drv == "vfio-pci" and addr not in held:
            violations.append(f"{addr} on vfio-pci without a lease")
    for gpu in inv.gpus:
        if gpu.group is None:
            continue
        on = {drivers.get(str(a)) == "vfio-pci" for a in gpu.group.addresses}
        if len(on) > 1:
            violations.append(f"group {gpu.group.number} split across drivers: "
                              f"{ {str(a): drivers.get(str(a)) for a in gpu.group.addresses} }")
        for a in gpu.group.addresses:
            if drivers.get(str(a)) is None:
                violations.append(f"{a} left with no driver")
    for x in leases:
        if x["state"] == "ACTIVE":
            for d in x["devices"]:
                for f in d["functions"]:
                    if drivers.get(f) != "vfio-pci":
                        violations.append(f"ACTIVE lease {x['id']} claims {f}, which is on {drivers.get(f)}")
                    if f not in attached:
                        violations.append(f"ACTIVE lease {x['id']} claims {f}, which is not attached")
    for addr, dom in attached.items():
        if drivers.get(addr) != "vfio-pci":
            violations.append(f"{addr} attached to {dom} but on {drivers.get(addr)} (given back while attached)")
    status, ev = ap.call("GET", "/v1/events?kind=repair", token=ap.operator)
    return Verdict(violations, {x["id"]: x["state"] for x in leases}, len(ev["events"]))
