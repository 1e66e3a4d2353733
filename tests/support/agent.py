"""An in-process agent over a fake sysfs tree (fake kernel) and the simulated hypervisor, for API tests."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostagent.config import Settings, load_settings, settings_from_dict
from hostagent.host.fakesysfs import FakeHost, build_tree
from hostagent.runtime import Runtime, build_runtime, make_app
from hostagent.virt.sim import SimulatedHypervisor
from hostagent.web.auth import hash_token, new_token

VMS = ("vm-a", "vm-b", "vm-c", "vm-d")


@dataclass
class Clock:
    """A controllable clock for services (the event loop keeps real time)."""

    now: float = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class AgentRig:
    """Everything a test needs to drive the agent."""

    settings: Settings
    tree: FakeHost
    hv: SimulatedHypervisor
    runtime: Runtime
    operator: str
    tokens: dict[str, str]  # vm name -> token
    uuids: dict[str, str]  # vm name -> uuid
    client: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def auth(self, who: str) -> dict[str, str]:
        """Authorization header for 'operator' or a VM name."""
        token = self.operator if who == "operator" else self.tokens[who]
        return {"Authorization": f"Bearer {token}"}

    def sysfs_driver(self, address: str) -> str | None:
        """The driver of a function in the fake tree, read back from the filesystem."""
        return sysfs_driver(self.tree.sys_root, address)


def sysfs_driver(sys_root: Path, address: str) -> str | None:
    """The driver of a function in a fake sysfs tree, read back from the filesystem."""
    link = sys_root / "bus/pci/devices" / address / "driver"
    return link.resolve().name if link.is_symlink() else None


def rig_settings(tmp: Path, tree: FakeHost, hv_path: Path, operator: str, **sections: dict[str, Any]) -> Settings:
    """Settings for an agent over a fake tree and a simulated hypervisor file."""
    raw: dict[str, Any] = {
        # step_timeout_s 5: a fake-kernel step (a probe) took over 2 s once on a loaded 2-CPU CI machine and failed an
        # 8-GPU grant; the tests of hung steps set their own. gc_freeze off: a full collection at each test agent's start costs ~0.1 s (test_runtime_heap.py covers it)
        "agent": {"state_dir": str(tmp / "state"), "port": 0, "host_id": "test-host", "log_format": "text",
                  "gc_freeze": False},
        "host": {"sysfs_root": str(tree.sys_root), "kernel": "fake", "step_timeout_s": 5.0},
        "libvirt": {"uri": f"sim://{hv_path}", "detach_timeout_s": 0.5},
        "reclaim": {"enabled": False},
        "auth": {"operator_token_sha256": hash_token(operator)},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return settings_from_dict(raw)


# The rig's guests acknowledge an unplug after 20 ms, not the simulator's realistic second: the tests' detach
# deadlines are short (libvirt.detach_timeout_s 0.5). A test of a slow or silent guest says so in hv_kwargs.
RIG_HV: dict[str, Any] = {"detach_ack_delay_s": 0.02}


def make_rig(tmp: Path, *, scenario: str = "dgx8", vms: tuple[str, ...] = VMS, clock: Callable[[], float] | None = None,
             hv_kwargs: dict[str, Any] | None = None, **sections: dict[str, Any]) -> AgentRig:
    """Build tree, hypervisor, runtime and tokens (not started)."""
    tree = build_tree(tmp / "host", scenario)
    hv_path = tmp / "hv.json"
    hv = SimulatedHypervisor(path=hv_path, **{**RIG_HV, "sysfs_root": tree.sys_root, **(hv_kwargs or {})})
    for name in vms:
        hv.define(name, running=True)
    hv.save()
    operator = new_token("op")
    settings = rig_settings(tmp, tree, hv_path, operator, **sections)
    kwargs: dict[str, Any] = {"hypervisor": hv}
    if clock is not None:
        kwargs["clock"] = clock
    runtime = build_runtime(settings, **kwargs)
    tokens, uuids = {}, {}
    for dom in hv.domains_sync():
        tok = new_token("vm")
        runtime.journal.add_token(hash_token(tok), role="guest", domain_uuid=dom.uuid, domain_name=dom.name)
        tokens[dom.name] = tok
        uuids[dom.name] = dom.uuid
    return AgentRig(settings, tree, hv, runtime, operator, tokens, uuids)


async def start_rig(rig: AgentRig, aiohttp_client: Any) -> AgentRig:
    """Serve the rig's app through aiohttp's test client (runs the runtime's lifecycle)."""
    rig.client = await aiohttp_client(make_app(rig.runtime))
    return rig


CSRF = re.compile(r'name="csrf" value="([^"]+)"')


async def operator_login(rig: AgentRig) -> Any:
    """Log the rig's client in to the dashboard as the operator (the login form and its CSRF token); the response
    (its cookies hold the session)."""
    page = await (await rig.client.get("/ui/login")).text()
    csrf = CSRF.search(page).group(1)  # type: ignore[union-attr]
    resp = await rig.client.post("/ui/login", data={"token": rig.operator, "csrf": csrf}, allow_redirects=False)
    assert resp.status == 303, await resp.text()
    return resp


# -- an agent configured by a TOML file and composed as `hostagent serve` composes it ------------------------------


def toml_value(value: Any) -> str:
    """A TOML value for a str, bool, number, list or table (inline); JSON's escapes are TOML's for these."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def write_config(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write `sections` ({"agent": {"port": 0}, ...}) as the agent's TOML configuration file."""
    lines: list[str] = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def rig_config(tmp: Path, tree: FakeHost, hv_path: Path, operator: str) -> dict[str, dict[str, Any]]:
    """The sections of an agent over a fake tree (fake kernel) and a simulated hypervisor file, as `rig_settings`
    sets them, less the host id (the hostname, as by default)."""
    return {
        "agent": {"state_dir": str(tmp / "state"), "port": 0, "log_format": "text", "gc_freeze": False},
        "host": {"sysfs_root": str(tree.sys_root), "kernel": "fake", "step_timeout_s": 5.0},
        "libvirt": {"uri": f"sim://{hv_path}", "detach_timeout_s": 0.5},
        "reclaim": {"enabled": False},
        "auth": {"operator_token_sha256": hash_token(operator)},
    }


def rig_from_file(config: Path, tree: FakeHost, operator: str, *, clock: Callable[[], float] | None = None) -> AgentRig:
    """Settings loaded from the file (no environment), the runtime composed from them alone (the hypervisor is the
    one `libvirt.uri` names), a token for each VM that hypervisor knows; not started."""
    settings = load_settings(config, environ={})
    runtime = build_runtime(settings, **({"clock": clock} if clock is not None else {}))
    hv = runtime.hypervisor
    tokens, uuids = {}, {}
    for dom in (hv.domains_sync() if isinstance(hv, SimulatedHypervisor) else ()):
        tok = new_token("vm")
        runtime.journal.add_token(hash_token(tok), role="guest", domain_uuid=dom.uuid, domain_name=dom.name)
        tokens[dom.name] = tok
        uuids[dom.name] = dom.uuid
    return AgentRig(settings, tree, hv, runtime, operator, tokens, uuids)
