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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostagent.domain.hostdev import parse_domain_hostdevs
from hostagent.domain.lease import LeaseState
from hostagent.host.discovery import discover
from hostagent.host.fakekernel import FakeKernel
from hostagent.host.fakesysfs import FakeHost, build_tree
from hostagent.services.lease_types import guest_addr
from hostagent.services.leases import lease_view
from hostagent.store.journal import Journal
from hostagent.virt.sim import SimulatedHypervisor
from hostagent.web.auth import hash_token, new_token
from tests.support.api import call_json
from tests.support.libvirtd import PrivateLibvirtd, tiny_domain_xml

ROOT = Path(__file__).parents[2]
LIVE_HOLDING = {"BINDING", "ATTACHING", "ACTIVE", "RELEASING", "DETACHING", "DETACH_PENDING", "REBINDING"}
VFIO = "vfio-pci"
# Holding states in which every function must be on vfio-pci: the device is, or may still be, in the guest (a
# detach not yet confirmed), or it is between its bind and its attach.
ON_VFIO = {"ATTACHING", "ACTIVE", "RELEASING", "DETACHING", "DETACH_PENDING"}
# Holding states in which no function may be in any domain: not yet attached, or the detach was confirmed.
NOT_ATTACHED = {"BINDING", "REBINDING"}


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
    libvirtd: PrivateLibvirtd | None = None  # the hypervisor is this real libvirtd, not the simulated one
    keep_on_domain_stop: bool = False

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
        return call_json(self.url, method, path, body, token, timeout)

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
                       detach_ack_delay_s: float = 0.02, refuse_detach: bool = False) -> AgentProcess:
    """Write the tree, hypervisor state, config and a VM token. `refuse_detach`: the guest never acknowledges a
    detach (it keeps the device), so a release can only end in DETACH_PENDING."""
    tree = build_tree(tmp / "host", scenario)
    hv_path = tmp / "hv.json"
    hv = SimulatedHypervisor(path=hv_path, detach_ack_delay_s=detach_ack_delay_s)
    dom = hv.define("vm-crash", running=True)
    if refuse_detach:
        hv.set_refuse_detach(dom.uuid)
    hv.save()
    rec = {"enabled": False} if reclaim is None else {"enabled": True, **reclaim}
    config, port, operator, vm_token = _write_agent(tmp, tree, f"sim://{hv_path}", dom.uuid, dom.name, reclaim=rec)
    return AgentProcess(tmp, tree, hv_path, config, port, operator, vm_token, dom.uuid)


def _write_agent(tmp: Path, tree: FakeHost, uri: str, domain_uuid: str, domain_name: str, *,
                 reclaim: dict[str, Any], leases: dict[str, Any] | None = None) -> tuple[Path, int, str, str]:
    """A journal holding the VM's token and a config for an agent over `tree` and the hypervisor at `uri`; returns
    the config file, the agent's port, the operator token and the VM's token."""
    operator, vm_token = new_token("op"), new_token("vm")
    state = tmp / "state"
    j = Journal(state / "journal.sqlite3")
    j.add_token(hash_token(vm_token), role="guest", domain_uuid=domain_uuid, domain_name=domain_name)
    j.close()
    port = free_port()
    lines = [
        "[agent]", f'state_dir = "{state}"', f"port = {port}", 'host_id = "crash-host"', 'log_format = "json"',
        "[host]", f'sysfs_root = "{tree.sys_root}"', 'kernel = "fake"', "step_timeout_s = 3.0",
        "[libvirt]", f"uri = {json.dumps(uri)}", "detach_timeout_s = 2.0",
        "[auth]", f'operator_token_sha256 = "{hash_token(operator)}"',
        "[reclaim]", *[f"{k} = {json.dumps(v)}" for k, v in reclaim.items()],
    ]
    if leases:
        lines += ["[leases]", *[f"{k} = {json.dumps(v)}" for k, v in leases.items()]]
    config = tmp / "hostagent.toml"
    config.write_text("\n".join(lines) + "\n")
    return config, port, operator, vm_token


def make_libvirtd_agent_process(tmp: Path, libvirtd: PrivateLibvirtd, *, scenario: str = "dgx8") -> AgentProcess:
    """The agent over the fake tree and a real, private libvirtd, leasing to a defined, shut-off domain.

    A real libvirtd refuses live PCI assignment without an IOMMU, but takes a persistent (CONFIG) hostdev on a
    shut-off domain, whatever its source: the agent attaches and detaches exactly that way for a domain that is
    not running. The lease must outlive the domain being off, so keep_on_domain_stop is on."""
    name = f"vm-crash-{tmp.name[-20:]}"
    xml = tmp / "domain.xml"
    xml.parent.mkdir(parents=True, exist_ok=True)
    xml.write_text(tiny_domain_xml(name))
    libvirtd.virsh("define", str(xml))
    uuid = libvirtd.virsh("domuuid", name).strip()
    tree = build_tree(tmp / "host", scenario)
    config, port, operator, vm_token = _write_agent(tmp, tree, libvirtd.uri, uuid, name, reclaim={"enabled": False},
                                                    leases={"keep_on_domain_stop": True})
    return AgentProcess(tmp, tree, tmp / "no-sim.json", config, port, operator, vm_token, uuid, libvirtd=libvirtd,
                        keep_on_domain_stop=True)


@dataclass
class World:
    """What sysfs and the hypervisor say, independent of the agent: the ground truth the leases are held to."""

    drivers: dict[str, str | None]  # function -> bound driver
    groups: dict[int, tuple[str, ...]]  # IOMMU group of a GPU -> its functions
    gpu_functions: dict[str, tuple[str, ...]]  # gpu id -> its functions
    viable: frozenset[str]  # GPUs placement may use
    attached: dict[str, str]  # function -> domain name it is attached to (live, or persistent when shut off)
    guest: dict[str, str]  # function -> its guest PCI address in that domain's XML ("" when it has none)
    domains: dict[str, tuple[str, str]]  # domain uuid -> (name, state)
    unacked: int  # detaches asked for and not acknowledged, in the hypervisor's persisted state


def read_world(ap: AgentProcess) -> World:
    """Read sysfs and the hypervisor's persisted state, as the agent would find them on a restart now.

    The simulated hypervisor's own loader is used on purpose: a detach the guest would acknowledge counts as done
    (the guest ran on while the agent was dead), one it refuses stays attached."""
    inv = discover(FakeKernel(ap.tree.sys_root))
    attached: dict[str, str] = {}
    guest: dict[str, str] = {}
    if ap.libvirtd is not None:
        domains, unacked = _read_libvirtd(ap.libvirtd, attached, guest, ap.vm_uuid)
    else:
        hv = SimulatedHypervisor.load(ap.hv_path)

        async def read_attached() -> None:
            for dom in hv.domains_sync():
                for h in await hv.attached_hostdevs(dom.uuid):
                    attached[str(h.source)] = dom.name
                    guest[str(h.source)] = guest_addr(h)

        asyncio.run(read_attached())
        raw = json.loads(ap.hv_path.read_text())  # the loader completes acknowledgeable detaches: count them first
        domains = {d.uuid: (d.name, str(d.state)) for d in hv.domains_sync()}
        unacked = sum(len(d["pending"]) for d in raw["domains"])
    return World(
        drivers={str(f.address): f.driver for f in inv.functions},
        groups={g.group.number: tuple(str(a) for a in g.group.addresses) for g in inv.gpus if g.group is not None},
        gpu_functions={g.id: tuple(str(f.address) for f in g.functions) for g in inv.gpus},
        viable=frozenset(g.id for g in inv.gpus if g.viable),
        attached=attached,
        guest=guest,
        domains=domains,
        unacked=unacked,
    )


def _read_libvirtd(libvirtd: PrivateLibvirtd, attached: dict[str, str], guest: dict[str, str],
                   only: str) -> tuple[dict[str, tuple[str, str]], int]:
    """The agent's domain and its hostdevs, from libvirtd itself (virsh): the live XML of a running domain, else the
    persistent one (what the domain takes when it starts). The daemon is shared by the matrix's rows, each with its
    own domain over the same fake addresses: the others belong to other worlds."""
    domains: dict[str, tuple[str, str]] = {}
    for uuid in [u for u in libvirtd.virsh("list", "--all", "--uuid").split() if u == only]:
        name = libvirtd.virsh("domname", uuid).strip()
        state = libvirtd.virsh("domstate", uuid).strip()
        domains[uuid] = (name, "running" if state == "running" else state.replace(" ", "-"))
        for h in parse_domain_hostdevs(libvirtd.virsh("dumpxml", uuid)):
            attached[str(h.source)] = name
            guest[str(h.source)] = guest_addr(h)
    return domains, 0


def find_violations(world: World, leases: list[dict[str, Any]]) -> list[str]:
    """Every invariant the crash matrix holds the agent to, over `leases` (the API's JSON, every lease).

    No GPU on vfio-pci without a lease; no IOMMU group split across drivers, none left driverless; no lease claiming
    a device it does not hold (every holding state checked against sysfs and the hypervisor, and no GPU claimed by
    two leases); an ACTIVE lease records each function at the guest address the domain's XML has it at; nothing
    given back to the host, or attached anywhere, without a lease that holds it on vfio-pci."""
    violations: list[str] = []
    drivers, attached = world.drivers, world.attached
    held: dict[str, str] = {}  # function -> lease id
    claimed: dict[str, str] = {}  # gpu id -> lease id
    for x in leases:
        if x["state"] not in LIVE_HOLDING:
            continue
        lid, state, dom = x["id"], x["state"], x["domain"]["name"]
        for d in x["devices"]:
            if d["gpu_id"] in claimed:
                violations.append(f"{d['gpu_id']} claimed by two leases: {claimed[d['gpu_id']]} and {lid}")
            claimed[d["gpu_id"]] = lid
            if tuple(d["functions"]) != world.gpu_functions.get(d["gpu_id"]):
                violations.append(f"{state} lease {lid} claims functions {d['functions']} for {d['gpu_id']}, "
                                  f"which has {world.gpu_functions.get(d['gpu_id'])}")
            for f, at in zip(d["functions"], d.get("guest_addresses") or [""] * len(d["functions"]), strict=True):
                held[f] = lid
                if state == "ACTIVE" and attached.get(f) == dom and at != world.guest.get(f):
                    # the journal and the domain XML agree on where the guest sees it (a restart that finished
                    # an attach must record the addresses libvirt chose, as the grant does)
                    violations.append(f"ACTIVE lease {lid} records {f} at guest address {at or 'none'}, the domain "
                                      f"has it at {world.guest.get(f) or 'none'}")
                if state in ON_VFIO and drivers.get(f) != VFIO:
                    violations.append(f"{state} lease {lid} claims {f}, which is on {drivers.get(f)}")
                if state == "ACTIVE" and attached.get(f) != dom:
                    violations.append(f"ACTIVE lease {lid} claims {f}, which is attached to {attached.get(f)}, "
                                      f"not {dom}")
                if state in NOT_ATTACHED and f in attached:
                    violations.append(f"{state} lease {lid} has {f} attached to {attached[f]}")
                if f in attached and attached[f] != dom:
                    violations.append(f"{state} lease {lid} of {dom} claims {f}, attached to {attached[f]}")
    for addr, drv in drivers.items():
        if drv == VFIO and addr not in held:
            violations.append(f"{addr} on vfio-pci without a lease")
    for number, addrs in world.groups.items():
        on = {drivers.get(a) == VFIO for a in addrs}
        if len(on) > 1:
            violations.append(f"group {number} split across drivers: { {a: drivers.get(a) for a in addrs} }")
        for a in addrs:
            if drivers.get(a) is None:
                violations.append(f"{a} left with no driver")
    for addr, dom in attached.items():
        if drivers.get(addr) != VFIO:
            violations.append(f"{addr} attached to {dom} but on {drivers.get(addr)} (given back while attached)")
        if addr not in held:
            violations.append(f"{addr} attached to {dom} without a lease holding it")
    return violations


@dataclass
class Verdict:
    """What the invariant check found after the restart."""

    violations: list[str]
    leases: dict[str, dict[str, Any]]  # lease id -> the API's JSON
    repairs: list[dict[str, Any]]  # repair events since `since_seq`
    gpus: dict[str, dict[str, Any]]  # gpu id -> the API's JSON

    @property
    def repaired(self) -> set[str]:
        """Subjects of the repairs: the lease each names, else the GPU."""
        return {e["lease_id"] or e["gpu_id"] for e in self.repairs}

    def free_gpus(self, world: World) -> int:
        """GPUs a new lease can have: viable, not held by a live lease, not quarantined nor set aside."""
        held = {d["gpu_id"] for x in self.leases.values() if x["state"] in LIVE_HOLDING for d in x["devices"]}
        aside = {g for g, v in self.gpus.items() if v["state"] in ("quarantined", "unavailable")}
        return len(world.viable - held - aside)


def check_invariants(ap: AgentProcess, since_seq: int = 0) -> Verdict:
    """The invariants over the running agent's leases (its API), the tree and the hypervisor's persisted state;
    with the repair events journaled after `since_seq`."""
    leases: list[dict[str, Any]] = []
    page: str | None = "/v1/leases?limit=1000"
    while page:  # every lease, page by page
        status, body = ap.call("GET", page, token=ap.operator)
        assert status == 200, body
        leases += body["leases"]
        page = f"/v1/leases?limit=1000&cursor={body['next_cursor']}" if body["next_cursor"] else None
    violations = find_violations(read_world(ap), leases)
    status, ev = ap.call("GET", "/v1/events?kind=repair", token=ap.operator)
    assert status == 200, ev
    status, gpus = ap.call("GET", "/v1/gpus", token=ap.operator)
    assert status == 200, gpus
    return Verdict(violations, {x["id"]: x for x in leases}, [e for e in ev["events"] if e["seq"] > since_seq],
                   {g["id"]: g for g in gpus["gpus"]})


@dataclass
class KillSnapshot:
    """The world and the journal as the killed agent left them (read before the restart, the agent dead)."""

    world: World
    leases: list[dict[str, Any]]  # live leases from the journal, the API's JSON
    last_seq: int  # the journal's last event
    keep_on_domain_stop: bool = False

    @property
    def violations(self) -> list[str]:
        """What a restart must repair (a kill mid-bind of a group leaves it split, for one)."""
        return find_violations(self.world, self.leases)


def snapshot_at_kill(ap: AgentProcess) -> KillSnapshot:
    """Read the journal (directly: the agent is dead), sysfs and the hypervisor's state."""
    j = Journal(ap.dir / "state" / "journal.sqlite3")
    try:
        live = j.live_leases()
        last = j.events(limit=1)
    finally:
        j.close()
    return KillSnapshot(read_world(ap), [lease_view(x) for x in live], last[-1].seq if last else 0,
                        ap.keep_on_domain_stop)


def repairs_needed(snap: KillSnapshot) -> dict[str, str]:
    """Subject (lease id, or GPU id for an orphan) -> why the restart must repair it, worked out from the journal
    and the world at the kill, not from the agent's repair code.

    A live lease in any state but QUEUED or ACTIVE was stopped mid-step; an ACTIVE lease needs repair when its
    domain is gone, or not running (unless leases are kept when a domain stops), or a function is not on vfio-pci
    or not attached to its domain; a GPU with a function on vfio-pci that no live lease holds is an orphan."""
    w = snap.world
    need: dict[str, str] = {}
    owned: set[str] = set()
    for x in snap.leases:
        st = LeaseState(x["state"])
        if st.holds_devices:
            owned.update(d["gpu_id"] for d in x["devices"])
        if st in (LeaseState.QUEUED, LeaseState.BOOKED):  # nothing bound: nothing to repair
            continue
        if st is not LeaseState.ACTIVE:
            need[x["id"]] = f"stopped in {st.value}"
            continue
        if (x.get("partial") or {}).get("adding"):  # the API's view of a lease stopped mid top-up
            need[x["id"]] = "ACTIVE, stopped in a top-up"
            continue
        if (x.get("move") or {}).get("phase") in ("making", "breaking"):  # stopped mid-move: finished or undone
            need[x["id"]] = f"ACTIVE, stopped {x['move']['phase']} a move"
            continue
        dom = w.domains.get(x["domain"]["uuid"])
        funcs = [f for d in x["devices"] for f in d["functions"]]
        if dom is None or (dom[1] != "running" and not snap.keep_on_domain_stop):
            need[x["id"]] = f"ACTIVE, domain {dom and dom[1]}"
        elif any(w.drivers.get(f) != VFIO for f in funcs):
            need[x["id"]] = "ACTIVE with a function off vfio-pci"
        elif any(w.attached.get(f) != dom[0] for f in funcs):
            need[x["id"]] = "ACTIVE with a function not attached"
    for gid, funcs in w.gpu_functions.items():
        if gid in w.viable and gid not in owned and any(w.drivers.get(f) == VFIO for f in funcs):
            need[gid] = "on vfio-pci without a live lease"
    return need
