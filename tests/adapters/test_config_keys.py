"""Every key of docs/configuration.md does what the document says (issue #28).

`TABLE` maps each documented key to the effect asserted for it. An `Effect` writes the agent's TOML configuration
file twice, once leaving the key out (its default) and once setting it, composes each agent from its file alone as
`hostagent serve` does (`host.kernel = "fake"` over a fake sysfs tree, the simulated hypervisor that `libvirt.uri`
names), drives both through what a user touches (the HTTP API; the server `serve()` runs, for keys of the server;
the CLI; the `hostagent serve` process itself, for the log keys) and asserts what each shows: the two must differ, as
the entry says. The world around the agent is set up as an operator or a guest would find it (a GPU bound with
`hostagent vfio bind`, a guest that ignores detaches, a VM shutting down); a service clock is injected where hours
must pass, and a background job whose period is hours (the reaper's check, the prunes, the detach retry) is run as
its timer would run it. A `Proven` entry names a test elsewhere that drives the key through the configuration; its
source (or that of the helpers and fixtures it uses) must mention the key.

The meta-tests fail when a documented key has no entry, when a setting is not documented, when an entry sets a key
to its default (nothing to tell apart), or when a named test is missing or never mentions its key.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import csv
import dataclasses
import gc
import importlib
import io
import json
import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from hostagent.cli.parser import main as cli_main
from hostagent.config import Settings, load_settings
from hostagent.domain.errors import ConfigError
from hostagent.host.fakekernel import FakeKernel
from hostagent.host.fakesysfs import FakeHost, build_tree, make_driver_dir, make_module_dir, record_interrupts
from hostagent.runtime import make_app
from hostagent.virt.sim import SimulatedHypervisor
from hostagent.web.auth import hash_token, new_token
from hostagent.web.serve import ssl_context, start_metrics_server, start_server
from tests.support.agent import RIG_HV, AgentRig, Clock, rig_config, rig_from_file, write_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([a-z0-9_]+\.[a-z0-9_]+)` \|", re.M)  # a key's row in one of the document's tables
VMS = ("vm-a", "vm-b", "vm-c")
HOUR, DAY = 3600.0, 86400.0

# The variants' trees and databases go to a tmpfs where there is one: a fake tree is ~2,000 files, directories and
# links, and the journal fsyncs each step; on the test machines' disks that is a second per agent, on tmpfs 0.1 s.
FAST_TMP = Path("/dev/shm")

Probe = Callable[["Variant"], Awaitable[Any]]
Expect = Any  # the observation itself, or a predicate over it


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()


@dataclass(frozen=True)
class Dyn:
    """A value known only once the variant's files exist (a free port, a token's hash, an address of its tree)."""

    make: Callable[[Variant], Any]
    text: str


@dataclass(frozen=True)
class Effect:
    """A key, set through the configuration file, observed through what a user touches."""

    value: Any  # what the set agent's file gives the key ("{tmp}" is the variant's directory); never the default
    says: str  # the effect asserted, in words
    probe: Probe  # the observation, the same for both agents
    default: Expect  # what the agent that leaves the key out shows
    changed: Expect  # what the agent with the key set shows
    base: dict[str, dict[str, Any]] = field(default_factory=dict)  # other keys both agents get
    against: Any = DEFAULT  # the other agent's value where the default cannot run in a test (/sys, port 8470...)
    scenario: str = "dgx8"  # the fake host's tree
    hv: dict[str, Any] = field(default_factory=dict)  # simulated hypervisor settings
    prepare: Callable[[Variant], None] | None = None  # the host, the hypervisor's state, files, before the start
    clock_behind_s: float | None = None  # a controllable service clock starting this far in the past
    together: bool = False  # observe both agents at once (probes that mostly wait)


@dataclass(frozen=True)
class Proven:
    """The key's effect is asserted by an existing test that sets it through the configuration."""

    test: str  # "tests/adapters/test_x.py::test_name"
    says: str
    # The named test is being written beside this file: until its file exists the check is skipped (only
    # leases.preempt_min_priority may say so).
    pending: bool = False


@dataclass(frozen=True)
class Refused:
    """The observation of an agent whose configuration does not load: the key the error names."""

    field: str | None


# -- one agent of a comparison -------------------------------------------------------------------------------------


@dataclass
class Variant:
    """One agent's world and configuration, and the layers a user touches, each started when a probe asks."""

    tmp: Path
    tree: FakeHost
    hv_path: Path
    operator: str
    clock: Clock | None
    config: Path = Path()
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    rig: AgentRig | None = None
    port: int = 0
    metrics_url: str | None = None
    # The agents of one test start one at a time: alembic's migration context is the process's, and two stores
    # migrating at once (both agents of a `together` entry) would run one's migration on the other's database.
    starting: asyncio.Lock = field(default_factory=asyncio.Lock)
    _client: TestClient | None = None
    _runners: list[web.AppRunner] = field(default_factory=list)

    def setting(self, key: str) -> Any:
        """The value the file gives `key` (None when it leaves the key out)."""
        section, name = key.split(".")
        return self.sections.get(section, {}).get(name)

    async def agent(self) -> AgentRig:
        """The agent behind aiohttp's test client (its lifecycle runs: reconcile, store, background jobs)."""
        if self.rig is None:
            async with self.starting:
                rig = rig_from_file(self.config, self.tree, self.operator, clock=self.clock)
                client = TestClient(TestServer(make_app(rig.runtime)))
                try:
                    await client.start_server()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await client.close()
                    raise
                self._client = client
            rig.client = self._client
            self.rig = rig
        return self.rig

    async def served(self) -> AgentRig:
        """The agent served as serve() serves it: ssl_context first (TLS, or plain HTTP on loopback unless allowed),
        start_server with the connection guard, and the metrics listener of agent.metrics_listen."""
        assert self.rig is None
        ctx = ssl_context(load_settings(self.config, environ={}))
        async with self.starting:
            rig = rig_from_file(self.config, self.tree, self.operator, clock=self.clock)
            app = make_app(rig.runtime)
            runner, url = await start_server(app, rig.settings, ctx)
        self._runners.append(runner)
        scrape = await start_metrics_server(app, rig.settings)
        if scrape is not None:
            self._runners.append(scrape[0])
            self.metrics_url = scrape[1]
        self.rig, self.port = rig, int(url.rsplit(":", 1)[1])
        return rig

    async def cli(self, *argv: str) -> tuple[int, str, str]:
        """`hostagent ARGV... --config FILE` (in a worker thread: an agent of this loop may be running)."""
        out, err = io.StringIO(), io.StringIO()

        def run() -> int:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                return cli_main([*argv, "--config", str(self.config)])

        code = await asyncio.to_thread(run)
        return code, out.getvalue(), err.getvalue()

    async def process(self) -> str:
        """Run `hostagent serve --config FILE` until it serves; its stderr (the log) until then. The process is
        killed at once: its shutdown would wait for the placement model's load (scikit-learn's import) to finish."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTAGENT_")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hostagent", "serve", "--config", str(self.config), cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        err = asyncio.create_task(proc.stderr.read())
        try:
            async with asyncio.timeout(60):
                while b"hostagent: serving on" not in (line := await proc.stdout.readline()):
                    assert line, f"`hostagent serve` ended before serving:\n{(await err).decode()[-3000:]}"
            # the log record of the same step follows the printed line at once (no await between them)
            await asyncio.sleep(0.3)
        finally:
            if proc.returncode is None:
                proc.kill()
            async with asyncio.timeout(30):
                await proc.wait()
        return (await err).decode()

    async def close(self) -> None:
        """Stop whatever was started (once)."""
        client, runners, self._client, self._runners = self._client, self._runners, None, []
        if client is not None:
            await client.close()
        for runner in reversed(runners):
            await runner.cleanup()


def _resolve(value: Any, v: Variant) -> Any:
    if isinstance(value, Dyn):
        return value.make(v)
    if isinstance(value, str):
        return value.replace("{tmp}", str(v.tmp))
    if isinstance(value, dict):
        return {k: _resolve(x, v) for k, x in value.items()}
    if isinstance(value, list):
        return [_resolve(x, v) for x in value]
    return value


def make_variant(tmp: Path, key: str, effect: Effect, *, set_key: bool) -> Variant:
    """The fake host, the hypervisor's state (VMS running) and the configuration file of one agent."""
    tmp.mkdir(parents=True)
    tree = build_tree(tmp / "host", effect.scenario)
    hv_path = tmp / "hv.json"
    hv = SimulatedHypervisor(path=hv_path, **{**RIG_HV, **effect.hv})
    for name in VMS:
        hv.define(name, running=True)
    hv.save()
    clock = Clock(time.time() - effect.clock_behind_s) if effect.clock_behind_s is not None else None
    v = Variant(tmp, tree, hv_path, new_token("op"), clock)
    sections = rig_config(tmp, tree, hv_path, v.operator)
    for name, values in effect.base.items():
        sections.setdefault(name, {}).update(values)
    section, name = key.split(".")
    if set_key:
        sections.setdefault(section, {})[name] = effect.value
    elif effect.against is not DEFAULT:
        sections.setdefault(section, {})[name] = effect.against
    else:
        sections.get(section, {}).pop(name, None)
    v.sections = _resolve(sections, v)
    v.config = write_config(tmp / "hostagent.toml", v.sections)
    if effect.prepare is not None:
        effect.prepare(v)
    return v


# -- what the probes share ------------------------------------------------------------------------------------------


async def call(rig: AgentRig, method: str, path: str, who: str = "operator", **kw: Any) -> tuple[int, Any]:
    r = await rig.client.request(method, path, headers=rig.auth(who), **kw)
    body = await r.json() if r.content_type == "application/json" else await r.text()
    return r.status, body


async def lease(rig: AgentRig, who: str = "vm-a", **body: Any) -> tuple[int, dict[str, Any]]:
    """POST /v1/leases as a guest (who = a VM) or as the operator for body["domain"]."""
    return await call(rig, "POST", "/v1/leases", who, json={"gpus": 1, **body})


async def granted(rig: AgentRig, who: str = "vm-a", **body: Any) -> dict[str, Any]:
    status, got = await lease(rig, who, **body)
    assert status == 201, got
    return got


async def released(rig: AgentRig, lease_id: str, who: str = "vm-a", tries: int = 50) -> None:
    """DELETE the lease until its GPUs are back on the host (200). On a loaded machine the simulated guest's
    acknowledgement can outrun the rig's 0.5 s detach deadline (202: DETACH_PENDING); a release asked again detaches
    again, and one already released answers 200."""
    for _ in range(tries):
        status, body = await call(rig, "DELETE", f"/v1/leases/{lease_id}", who)
        if status == 200:
            return
        assert status == 202, body
        await asyncio.sleep(0.1)
    raise AssertionError(f"lease {lease_id} still DETACH_PENDING after {tries} releases")


async def heartbeat(rig: AgentRig, lease_body: dict[str, Any], n: int, *, ts: float | None = None,
                    util: float = 50.0, mem: int = 0, who: str = "vm-a") -> int:
    gpu = lease_body["devices"][0]["gpu_id"]
    at = time.time() if ts is None else ts
    samples = [{"ts": at - i * 0.01, "gpu": gpu, "util_pct": util, "mem_used_bytes": mem} for i in range(n)]
    status, _ = await call(rig, "POST", f"/v1/leases/{lease_body['id']}/heartbeat", who, json={"samples": samples})
    return status


async def store_check(rig: AgentRig) -> dict[str, Any]:
    r = await rig.client.get("/readyz")
    return dict((await r.json())["checks"]["store"])


async def poll(cond: Callable[[], Awaitable[Any]], seconds: float, interval: float = 0.05) -> Any:
    """cond() until it is truthy or `seconds` pass; its last answer."""
    deadline = time.monotonic() + seconds
    while not (got := await cond()) and time.monotonic() < deadline:
        await asyncio.sleep(interval)
    return got


async def raw(port: int, data: bytes, *, wait_s: float, host: str = "127.0.0.1") -> int | None:
    """Send raw bytes on a fresh connection; the status of a response within `wait_s`, else None."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        try:
            async with asyncio.timeout(wait_s):
                line = await reader.readline()
        except TimeoutError:
            return None
        return int(line.split()[1]) if line else None
    finally:
        writer.close()


def get_request(path: str, token: str | None = None, *, close: bool = True) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}{'Connection: close' if close else ''}\r\n\r\n".encode()


def edit_hypervisor(v: Variant, fn: Callable[[SimulatedHypervisor], None]) -> None:
    """Change the simulated hypervisor's persisted state before the agent loads it."""
    hv = SimulatedHypervisor.load(v.hv_path)
    fn(hv)
    hv.save()


def events(body: Any, kind: str) -> list[dict[str, Any]]:
    return [e for e in body["events"] if e["kind"] == kind]


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


# -- probes: [agent] --------------------------------------------------------------------------------------------------


async def host_id_in_store(v: Variant) -> set[str]:
    """The host id of this agent's leases in the usage store (`hostagent db export leases --all-hosts`)."""
    rig = await v.agent()
    await granted(rig)
    out = v.tmp / "leases.csv"

    async def rows() -> list[dict[str, str]]:
        code, _, err = await v.cli("db", "export", "leases", "--all-hosts", "-o", str(out))
        assert code == 0, err
        return list(csv.DictReader(out.open()))

    return {r["host_id"] for r in await poll(rows, 10, 0.1)}


async def state_files(v: Variant) -> list[str]:
    await v.agent()
    return sorted(p.name for p in (v.tmp / "elsewhere").glob("*.sqlite3"))


async def addresses_answering(v: Variant) -> tuple[bool, bool]:
    """Whether 127.0.0.1 and 127.0.0.2 take a connection on the served port, from this agent: its server has a
    socket on the address (another test's server may hold the same port number on the other address) and answers."""
    await v.served()
    bound = {a[0] for a in v._runners[0].addresses}

    async def answers(host: str) -> bool:
        if host not in bound:
            return False
        try:
            return await raw(v.port, get_request("/healthz"), wait_s=5, host=host) == 200
        except OSError:
            return False

    return await answers("127.0.0.1"), await answers("127.0.0.2")


async def bound_to_configured_port(v: Variant) -> bool:
    await v.served()
    return v.port == v.setting("agent.port")


async def scheme_served(v: Variant) -> str:
    """Which of https and http answers GET /healthz on the served port."""
    await v.served()
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
    async with aiohttp.ClientSession() as session:
        for scheme, kw in (("https", {"ssl": insecure}), ("http", {})):
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{scheme}://127.0.0.1:{v.port}/healthz", **kw) as r:
                    if r.status == 200:
                        return scheme
    return "neither"


def tls_files(v: Variant) -> None:
    d = v.tmp / "tls"
    d.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True)


async def serving_record_is_json(v: Variant) -> bool:
    """Whether `hostagent serve` logs its "serving on" record as a JSON object."""
    (line,) = [x for x in (await v.process()).splitlines() if "serving on http" in x]
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


async def info_logged(v: Variant) -> bool:
    """Whether the INFO record "serving on ..." is in the log."""
    return "serving on http" in await v.process()


async def body_too_large(v: Variant) -> int:
    rig = await v.agent()
    status, _ = await lease(rig, task_type="x" * 3000)
    return status


async def slow_body(v: Variant) -> int | None:
    """A lease request whose body never finishes arriving: the status within 1 s."""
    rig = await v.served()
    head = (f"POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {rig.tokens['vm-a']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"gpus\"").encode()
    return await raw(v.port, head, wait_s=1.0)


async def slow_head(v: Variant) -> int | None:
    """A connection whose request line comes and its headers never do: the status within 1 s."""
    await v.served()
    return await raw(v.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n", wait_s=1.0)


async def idle_connection_closed(v: Variant) -> bool:
    """After one keep-alive request, whether the server closes the idle connection within 1 s."""
    await v.served()
    reader, writer = await asyncio.open_connection("127.0.0.1", v.port)
    try:
        writer.write(get_request("/healthz", close=False))
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
        await reader.readexactly(length)
        try:
            async with asyncio.timeout(1.0):
                return await reader.read() == b""
        except TimeoutError:
            return False
    finally:
        writer.close()


async def third_connection(v: Variant) -> int | None:
    """Two connections held open from 127.0.0.1; the status a third one's request gets."""
    await v.served()
    held = [await asyncio.open_connection("127.0.0.1", v.port) for _ in range(2)]
    try:
        await asyncio.sleep(0.1)
        return await raw(v.port, get_request("/healthz"), wait_s=5)
    finally:
        for _, w in held:
            w.close()


async def second_request_in_flight(v: Variant) -> int | None:
    """vm-a has a lease request in flight (its body still arriving); the status of its next request."""
    rig = await v.served()
    token = rig.tokens["vm-a"]
    reader, writer = await asyncio.open_connection("127.0.0.1", v.port)
    try:
        writer.write((f"POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode())
        await writer.drain()
        await asyncio.sleep(0.2)
        return await raw(v.port, get_request("/v1/gpus", token), wait_s=5)
    finally:
        writer.close()


async def refused_of_a_burst(v: Variant) -> int:
    """How many of 7 requests vm-a sends at once are refused 429."""
    rig = await v.agent()
    got = await asyncio.gather(*(call(rig, "GET", "/v1/gpus", "vm-a") for _ in range(7)))
    return sum(1 for status, _ in got if status == 429)


async def where_metrics_are(v: Variant) -> tuple[int, int | None]:
    """/metrics on the API's port (with the operator's token), and on the metrics listener (no token)."""
    rig = await v.served()
    on_api = await raw(v.port, get_request("/metrics", rig.operator), wait_s=5)
    own = None
    if v.metrics_url is not None:
        async with aiohttp.ClientSession() as session, session.get(v.metrics_url) as r:
            own = r.status
    return on_api or 0, own


async def heap_frozen(v: Variant) -> bool:
    """Whether the heap is frozen once the agent has started and loaded its placement model."""
    gc.unfreeze()
    try:
        rig = await v.agent()
        loads = [t for t in rig.runtime.tasks if getattr(t.get_coro(), "__name__", "") == "_load_model"]
        assert loads, "no model load task"
        await poll(lambda: _true(all(t.done() for t in loads)), 60)
        return gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


async def _true(x: Any) -> Any:
    return x


# -- probes: [host] ---------------------------------------------------------------------------------------------------


async def gpu_count(v: Variant) -> int:
    rig = await v.agent()
    _, body = await call(rig, "GET", "/v1/gpus")
    return len(body["gpus"])


def other_tree(v: Variant) -> None:
    build_tree(v.tmp / "other", "workstation")


async def grant_and_driver(v: Variant) -> tuple[int, int]:
    """A one-GPU lease: its status, and how many GPU functions of the tree are bound to vfio-pci afterwards."""
    # A safety net: whatever the composition, this test never loads a module into the running kernel.
    with mock.patch("hostagent.host.binding.modprobe", side_effect=AssertionError("modprobe in a test")):
        rig = await v.agent()
    status, _ = await lease(rig)
    return status, sum(1 for a in v.tree.gpus if rig.sysfs_driver(a) == "vfio-pci")


def vfio_registered(v: Variant) -> None:
    """vfio-pci registered in the tree (as on a host that loaded it), so that no composition tries to load it."""
    make_driver_dir(v.tree.sys_root, "vfio-pci")
    for mod in ("vfio", "vfio_pci", "vfio_pci_core", "vfio_iommu_type1"):
        make_module_dir(v.tree.sys_root, mod)


async def grant_status(v: Variant) -> int:
    rig = await v.agent()
    status, _ = await lease(rig)
    return status


def empty_dev(v: Variant) -> None:
    (v.tmp / "otherdev" / "vfio").mkdir(parents=True)


def proc_without_iommu_flags(v: Variant) -> None:
    shutil.copytree(v.tree.proc_root, v.tmp / "otherproc", symlinks=True)
    cmdline = v.tmp / "otherproc" / "cmdline"
    cmdline.write_text(cmdline.read_text().replace(" intel_iommu=on", "").replace(" iommu=pt", ""))


async def doctor_cmdline(v: Variant) -> str:
    """`hostagent doctor`'s verdict on the kernel command line (read under host.proc_root)."""
    _, out, _ = await v.cli("doctor", "--json")
    (check,) = [c for c in json.loads(out)["checks"] if c["name"] == "kernel-cmdline"]
    return str(check["status"])


def pci_ids_file(v: Variant) -> None:
    device = (v.tree.sys_root / "bus/pci/devices" / v.tree.gpus[0] / "device").read_text().strip()[2:]
    (v.tmp / "pci.ids").write_text(f"10de  Configured Vendor\n\t{device}  Configured Model Name\n")


async def first_gpu_model(v: Variant) -> str:
    rig = await v.agent()
    _, body = await call(rig, "GET", "/v1/gpus")
    return str(body["gpus"][0]["model"])


async def gpu_vendor_ids(v: Variant) -> set[str]:
    rig = await v.agent()
    _, body = await call(rig, "GET", "/v1/gpus")
    return {g["vendor_id"] for g in body["gpus"]}


async def a10_viable(v: Variant) -> bool:
    """Whether the A10 that shares its IOMMU group with a ConnectX NIC may be leased."""
    rig = await v.agent()
    _, body = await call(rig, "GET", "/v1/gpus")
    (a10,) = [g for g in body["gpus"] if g["address"] == "0000:03:00.0"]
    return bool(a10["viable"])


def hang_unbinds(v: Variant) -> None:
    """Every GPU's unbind from its host driver hangs 1 s in the fake kernel."""
    kernel = FakeKernel(v.tree.sys_root)
    for addr in v.tree.gpus:
        kernel.set_fault("hang_unbind", addr, "1.0")


async def grant_status_then_hangs_over(v: Variant) -> int:
    """A one-GPU lease's status; then the wait until the fake kernel's hung unbinds have all returned."""
    status = await grant_status(v)
    kernel = FakeKernel(v.tree.sys_root)
    assert await poll(lambda: _true(not kernel.hanging()), 10)
    return status


async def domain_xml_after_grant(v: Variant) -> str:
    rig = await v.agent()
    await granted(rig)
    return str(await rig.hv.domain_xml(rig.uuids["vm-a"]))


async def rom_bar_off(v: Variant) -> bool:
    return "<rom bar=\"off\"/>" in (await domain_xml_after_grant(v)).replace("'", "\"")


async def driver_vfio(v: Variant) -> bool:
    return "<driver name=\"vfio\"/>" in (await domain_xml_after_grant(v)).replace("'", "\"")


async def guest_slots_of_4090(v: Variant) -> list[str]:
    """The guest addresses of the RTX 4090's two functions."""
    rig = await v.agent()
    body = await granted(rig, model="4090")
    return list(body["devices"][0]["guest_addresses"])


def bind_first_gpu_with_cli(v: Variant) -> None:
    """`hostagent vfio bind ADDR`: an operator puts a GPU on vfio-pci outside any lease, before the agent starts."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["vfio", "bind", v.tree.gpus[0], "--config", str(v.config)]) == 0, out.getvalue()


async def driver_of_first_gpu_after_start(v: Variant) -> str | None:
    rig = await v.agent()
    return rig.sysfs_driver(v.tree.gpus[0])


def nvlink_file(v: Variant) -> None:
    (v.tmp / "nvlink.txt").write_text(f"# NVLink peers\n{v.tree.gpus[0]} {v.tree.gpus[1]}\n")


async def nvlink_cliques(v: Variant) -> list[list[str]]:
    rig = await v.agent()
    _, body = await call(rig, "GET", "/v1/topology")
    return list(body["nvlink"])


# -- probes: [libvirt] ------------------------------------------------------------------------------------------------


async def operator_lease_for_vm_a(v: Variant) -> int:
    rig = await v.agent()
    status, _ = await lease(rig, "operator", domain="vm-a")
    return status


async def state_after_release(v: Variant) -> str:
    rig = await v.agent()
    body = await granted(rig)
    _, done = await call(rig, "DELETE", f"/v1/leases/{body['id']}", "vm-a")
    return str(done["state"])


def first_gpu_is_boot_vga(v: Variant) -> None:
    """The firmware booted on the host's first GPU (its boot_vga attribute reads 1)."""
    (v.tree.sys_root / "bus/pci/devices" / v.tree.gpus[0] / "boot_vga").write_text("1\n")


def first_gpu_has_no_reset(v: Variant) -> None:
    """The host's first GPU has no reset method (reset_method reads empty)."""
    (v.tree.sys_root / "bus/pci/devices" / v.tree.gpus[0] / "reset_method").write_text("\n")


async def lease_of_every_gpu(v: Variant) -> tuple[int, int]:
    """A lease of all eight GPUs: its status, and how many host-warning events the agent journaled."""
    rig = await v.agent()
    status, body = await lease(rig, gpus=8)
    _, evs = await call(rig, "GET", "/v1/events")
    return status, len(events(evs, "host-warning"))


def vm_a_refuses_detach(v: Variant) -> None:
    edit_hypervisor(v, lambda hv: hv.set_refuse_detach("vm-a"))


async def detach_retries_and_alert(v: Variant) -> tuple[int, int, float | None, int]:
    """vm-a's guest ignores detaches: a release leaves DETACH_PENDING; the agent's periodic retry job runs twice.
    The detach retries journaled, the detach-alert events, the hostagent_detach_alerts gauge, and whether the
    lease's view warns detach_alert."""
    rig = await v.agent()
    body = await granted(rig)
    status, pending = await call(rig, "DELETE", f"/v1/leases/{body['id']}", "vm-a")
    assert status == 202 and pending["state"] == "DETACH_PENDING", pending
    for _ in range(2):
        await rig.runtime.manager.retry_pending()  # the job `_periodic(max(5 s, detach_timeout_s))` runs
    _, evs = await call(rig, "GET", f"/v1/events?lease_id={body['id']}")
    retries = [e for e in evs["events"] if (e.get("detail") or "").startswith("detach retry")]
    _, text = await call(rig, "GET", "/metrics")
    still = rig.runtime.manager.leases[body["id"]]
    assert still.state.value == "DETACH_PENDING" and rig.sysfs_driver(body["devices"][0]["functions"][0]) == "vfio-pci"
    _, view = await call(rig, "GET", f"/v1/leases/{body['id']}", "vm-a")
    warned = int(any(w["code"] == "detach_alert" for w in view["warnings"]))
    return len(retries), len(events(evs, "detach-alert")), metric(text, "hostagent_detach_alerts"), warned


def pci_bridge_in_vm_a(v: Variant) -> None:
    """vm-a's domain has a PCI bridge (guest bus 1), as `virsh edit` would add it."""
    doc = json.loads(v.hv_path.read_text())
    (dom,) = [d for d in doc["domains"] if d["name"] == "vm-a"]
    root = '<controller type="pci" index="0" model="pci-root"/>'
    for part in ("config", "live"):
        assert root in dom[part]
        dom[part] = dom[part].replace(root, root + '<controller type="pci" index="1" model="pci-bridge"/>')
    v.hv_path.write_text(json.dumps(doc))


async def guest_bus_of_grant(v: Variant) -> str:
    rig = await v.agent()
    body = await granted(rig)
    return str(body["devices"][0]["guest_addresses"][0]).split(":")[1]


# -- probes: [store] --------------------------------------------------------------------------------------------------


async def store_files(v: Variant) -> tuple[bool, bool]:
    """Whether the default SQLite file (in the state directory) and the configured one exist after the start."""
    await v.agent()
    return (v.tmp / "state" / "usage.sqlite3").exists(), (v.tmp / "elsewhere" / "usage.db").exists()


async def start_and_revision(v: Variant) -> tuple[bool, str | None, str]:
    """Whether the agent starts on a fresh database, the schema revision `hostagent db status` finds then, and why
    it did not start."""
    why = ""
    try:
        await v.agent()
        started = True
    except Exception as exc:  # noqa: BLE001 - an agent that does not start is what this observes
        started, why = False, str(exc)
    _, out, _ = await v.cli("db", "status", "--json")
    return started, json.loads(out)["revision"], why


async def spool_files(v: Variant) -> tuple[bool, bool]:
    await v.agent()
    return (v.tmp / "state" / "spool.sqlite3").exists(), (v.tmp / "spool-here.db").exists()


async def second_vm_heartbeat(v: Variant) -> int:
    """vm-a and vm-b each send 12 samples at once: the status of vm-b's heartbeat."""
    rig = await v.agent()
    a, b = await granted(rig, "vm-a"), await granted(rig, "vm-b")
    assert await heartbeat(rig, a, 12) == 200
    return await heartbeat(rig, b, 12, who="vm-b")


def heartbeat_of(n: int) -> Probe:
    async def probe(v: Variant) -> int:
        rig = await v.agent()
        return await heartbeat(rig, await granted(rig), n)
    probe.__name__ = f"heartbeat_of_{n}_samples"
    return probe


def samples_written_within(seconds: float, n: int) -> Probe:
    async def probe(v: Variant) -> bool:
        rig = await v.agent()
        assert await heartbeat(rig, await granted(rig), n) == 200
        return bool(await poll(lambda: _written(rig), seconds))
    probe.__name__ = f"{n}_samples_written_within_{seconds:g}_s"
    return probe


async def _written(rig: AgentRig) -> bool:
    return (await store_check(rig))["samples_waiting"] == 0


async def store_healthy_after_wait(v: Variant) -> bool:
    """/readyz's store check 0.8 s after a heartbeat whose samples still wait to be written."""
    rig = await v.agent()
    assert await heartbeat(rig, await granted(rig), 5) == 200
    await asyncio.sleep(0.8)
    check = await store_check(rig)
    assert check["samples_waiting"] == 5
    return bool(check["ok"])


async def store_rows_after_prune(v: Variant) -> tuple[int, int]:
    """Samples two days old (the lease began three days ago, by the service clock), written, then the hourly prune:
    the raw samples and the per-minute rollups `hostagent db export` still finds."""
    rig = await v.agent()
    body = await granted(rig)
    assert await heartbeat(rig, body, 10, ts=time.time() - 2 * DAY) == 200
    assert await poll(lambda: _written(rig), 10)
    await rig.runtime._prune()  # the job `_periodic(3600 s, _prune)` runs
    counts = []
    for kind in ("samples", "rollups_minute"):
        out = v.tmp / f"{kind}.csv"
        code, _, err = await v.cli("db", "export", kind, "--all-hosts", "-o", str(out))
        assert code == 0, err
        counts.append(len(list(csv.DictReader(out.open()))))
    return counts[0], counts[1]


# -- probes: [leases] -------------------------------------------------------------------------------------------------


async def ttl_of_grant(v: Variant) -> float:
    rig = await v.agent()
    body = await granted(rig)
    return float(body["expires_at"]) - float(body["created_at"])


async def two_hour_request(v: Variant) -> int:
    rig = await v.agent()
    status, _ = await lease(rig, duration_s=7200)
    return status


async def all_gpus_to_vm_a(rig: AgentRig) -> None:
    await granted(rig, gpus=len(rig.runtime.manager.gpus))


async def second_queued_request(v: Variant, who: str) -> int:
    """Every GPU held by vm-a; vm-b queues a request; the status of `who`'s request to queue."""
    rig = await v.agent()
    await all_gpus_to_vm_a(rig)
    assert (await lease(rig, "vm-b", accept_deferred=True))[0] == 202
    status, _ = await lease(rig, who, accept_deferred=True)
    return status


async def queue_wait(v: Variant) -> float:
    rig = await v.agent()
    await all_gpus_to_vm_a(rig)
    status, body = await lease(rig, "vm-b", accept_deferred=True)
    assert status == 202, body
    return float(body["queue"]["deadline"]) - float(body["created_at"])


async def priority_kept(v: Variant) -> int:
    rig = await v.agent()
    return int((await granted(rig, priority=10))["request"]["priority"])


async def lease_state_after_vm_shutdown(v: Variant) -> str:
    rig = await v.agent()
    body = await granted(rig)
    rig.hv.shutdown("vm-a")

    async def ended() -> bool:
        return body["id"] not in rig.runtime.manager.leases

    await poll(ended, 1.0)
    _, now = await call(rig, "GET", f"/v1/leases/{body['id']}")
    return str(now["state"])


async def second_gpu_of_vm_a(v: Variant) -> int:
    rig = await v.agent()
    await granted(rig)
    status, _ = await lease(rig)
    return status


async def request_after_two_hours(v: Variant) -> int:
    rig = await v.agent()
    await granted(rig)
    assert v.clock is not None
    v.clock.advance(2 * HOUR)
    status, _ = await lease(rig)
    return status


async def two_gpus_for_vm_a_and_vm_b(v: Variant) -> tuple[int, int]:
    rig = await v.agent()
    return (await lease(rig, "vm-a", gpus=2))[0], (await lease(rig, "vm-b", gpus=2))[0]


async def five_gpu_request(v: Variant) -> int:
    """Five GPUs of the eight on two NUMA nodes of four."""
    rig = await v.agent()
    status, _ = await lease(rig, gpus=5)
    return status


# exploration would try a random GPU now and then (these agents have no model: the first day's rate)
NO_EXPLORING = {"placement": {"explore_epsilon": 0.0, "cold_explore_epsilon": 0.0}}


def second_gpu_distance(task_type: str = "training") -> Callable[[Variant], Awaitable[int]]:
    """Two one-GPU leases one after the other (the second for `task_type`): how far the second's GPU is from the
    first's, as GET /v1/topology measures it (1: behind the same switch; 4: across the sockets)."""
    async def probe(v: Variant) -> int:
        rig = await v.agent()
        first = (await granted(rig, "vm-a"))["devices"][0]["gpu_id"]
        second = (await granted(rig, "vm-b", task_type=task_type))["devices"][0]["gpu_id"]
        status, topo = await call(rig, "GET", "/v1/topology")
        assert status == 200, topo
        return int(topo["distances"][first][second])
    return probe


async def ended_lease_listed_after_two_days(v: Variant) -> bool:
    """A lease released, mirrored to the store; two days later (service clock) the hourly journal prune runs."""
    rig = await v.agent()
    body = await granted(rig)
    await released(rig, body["id"])

    async def mirrored() -> bool:
        return (await rig.runtime.run(rig.runtime.journal.backlog))[0] == 0

    assert await poll(mirrored, 10)
    assert v.clock is not None
    v.clock.advance(2 * DAY)
    await rig.runtime.prune_journal()  # the job `_periodic(3600 s, prune_journal)` runs
    _, listed = await call(rig, "GET", "/v1/leases")
    return body["id"] in {x["id"] for x in listed["leases"]}


# -- probes: [reclaim] ------------------------------------------------------------------------------------------------
# The service clock starts six hours back, so that guest samples can carry its times (a heartbeat's samples may be up
# to 7 days old, never in the future); each check is the reaper's job (`tick`) after the clock passes a lease's due
# time, as its scheduler would run it.

RECLAIM_ON = {"reclaim": {"enabled": True, "min_lease_age_s": 0.0}}


async def reaper_row(rig: AgentRig, lease_id: str) -> dict[str, Any]:
    _, body = await call(rig, "GET", "/v1/reaper")
    (row,) = [x for x in body["leases"] if x["lease_id"] == lease_id]
    return dict(row)


async def check_after(v: Variant, rig: AgentRig, body: dict[str, Any], advance: float, *,
                      util: float | None = None, mem: int = 0) -> dict[str, Any]:
    """Advance the clock; with `util`, a heartbeat of 3 samples just before; then the reaper's job; the lease's row."""
    assert v.clock is not None
    v.clock.advance(advance)
    if util is not None:
        assert await heartbeat(rig, body, 3, ts=v.clock.now - 1, util=util, mem=mem) == 200
    await rig.runtime.reaper.tick()
    return await reaper_row(rig, body["id"])


def strike_after_one_check(util: float, mem: int = 0) -> Probe:
    async def probe(v: Variant) -> str:
        rig = await v.agent()
        body = await granted(rig)
        return str((await check_after(v, rig, body, HOUR + 1, util=util, mem=mem))["strike"])
    probe.__name__ = f"strike_after_a_check_of_util_{util:g}_mem_{mem}"
    return probe


async def checked_by_the_scheduler(v: Variant) -> bool:
    """Whether the reaper's own scheduler checks a lease that is due (the clock past its check): up to 8 s of
    waiting, ten of its 0.8 s periods, so a loaded machine still sees it (a scheduler that is off never does)."""
    rig = await v.agent()
    body = await granted(rig)
    assert v.clock is not None
    v.clock.advance(60)

    async def checked() -> bool:
        return (await reaper_row(rig, body["id"]))["last_verdict"] is not None

    return bool(await poll(checked, 8.0))


async def check_interval(v: Variant) -> float:
    rig = await v.agent()
    body = await granted(rig)
    return float((await reaper_row(rig, body["id"]))["next_check"]) - float(body["granted_at"])


async def priority_10_check_interval(v: Variant) -> float:
    rig = await v.agent()
    body = await granted(rig, "operator", domain="vm-a", priority=10)
    return float((await reaper_row(rig, body["id"]))["next_check"]) - float(body["granted_at"])


async def grace(v: Variant) -> float:
    rig = await v.agent()
    body = await granted(rig)
    row = await check_after(v, rig, body, HOUR + 1, util=0.0)
    assert row["strike"] == "one", row
    return float(row["recheck_at"]) - float(row["strike_at"])


async def notice_window(v: Variant) -> float:
    rig = await v.agent()
    body = await granted(rig)
    row = await check_after(v, rig, body, HOUR + 1, util=0.0)
    row = await check_after(v, rig, body, float(row["recheck_at"]) - v.clock.now + 1, util=0.0)  # type: ignore[union-attr]
    assert row["strike"] == "two (reclaiming)", row
    return float(row["notice_deadline"]) - v.clock.now  # type: ignore[union-attr]


def quiet_vfio_counters(v: Variant, rig: AgentRig, body: dict[str, Any]) -> None:
    """The host's vfio interrupt counters of the lease's function exist and do not move."""
    record_interrupts(rig.settings.proc_root, body["devices"][0]["functions"][0], 5)


async def strike_without_heartbeats(v: Variant) -> str:
    """No guest heartbeats, the host's vfio counters flat: two checks (the first only reads the counters)."""
    rig = await v.agent()
    body = await granted(rig)
    quiet_vfio_counters(v, rig, body)
    await check_after(v, rig, body, HOUR + 1)
    return str((await check_after(v, rig, body, HOUR + 1))["strike"])


async def strike_without_heartbeats_and_signal(v: Variant) -> tuple[str, bool]:
    """As strike_without_heartbeats, and whether GET /v1/reaper says the host's counters are trusted."""
    strike = await strike_without_heartbeats(v)
    rig = await v.agent()
    _, reaper = await call(rig, "GET", "/v1/reaper")
    return strike, bool(reaper["host_signal"]["trusted"])


async def strike_when_guest_busy_host_quiet(v: Variant) -> tuple[str, bool]:
    """The guest reports 80 % while the host's vfio counters stay flat, over two checks: strike and dispute."""
    rig = await v.agent()
    body = await granted(rig)
    quiet_vfio_counters(v, rig, body)
    await check_after(v, rig, body, HOUR + 1, util=80.0)
    row = await check_after(v, rig, body, HOUR + 1, util=80.0)
    return str(row["strike"]), row["disputed"] is not None


# -- probes: [placement] ----------------------------------------------------------------------------------------------


async def train_figures(v: Variant) -> tuple[str, int, str]:
    """`hostagent model train` on this agent's (empty) store: the outcome it trains for, the records it needs."""
    code, out, err = await v.cli("model", "train", "--json")
    assert code == 0, err
    m = json.loads(out)["metrics"]
    return str(m["target"]), int(m["min_records"]), str(json.loads(out)["decision"])


def explored_of(n: int, **request: Any) -> Probe:
    """How many of n one-GPU requests (each released before the next) placement explored with; the placer's random
    source is seeded the same for both agents, so the comparison is exact."""
    async def probe(v: Variant) -> int:
        import random

        rig = await v.agent()
        rig.runtime.placer.rng = random.Random(20240528)
        explored = 0
        for _ in range(n):
            who = "operator" if "domain" in request else "vm-a"
            body = await granted(rig, who, **request)
            explored += body["placement"]["rule"] == "explore"
            await released(rig, body["id"], who)
        return explored
    probe.__name__ = f"explored_of_{n}"
    return probe


async def retrainings_within(v: Variant) -> int:
    """"retraining:" records the agent logs within 1.5 s of its start (the retraining job's result)."""
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("retraining:"):
                seen.append(record.getMessage())

    # scikit-learn imported first (the job imports it): the window then measures the job, not a cold import
    await asyncio.to_thread(importlib.import_module, "hostagent.learn.lifecycle")
    handler, logger = Catch(), logging.getLogger("hostagent.placement")  # services.retraining's
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        await v.agent()
        await poll(lambda: _true(len(seen) >= 1), 1.5)
        return len(seen)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


# -- probes: [auth] ---------------------------------------------------------------------------------------------------


async def operator_token_status(v: Variant) -> int:
    rig = await v.agent()
    status, _ = await call(rig, "GET", "/v1/events")
    return status


# -- the table --------------------------------------------------------------------------------------------------------

SLOW_FLUSH = {"store": {"flush_interval_s": 30.0}}  # heartbeat samples wait in the queue
FLUSH_AT_ONCE = {"store": {"flush_batch": 1}}  # ... or are written as they come

TABLE: dict[str, Effect | Proven] = {
    # [agent]
    "agent.host_id": Effect(
        "rack9-node4", "the agent's leases reach the usage store under this host id (`db export --all-hosts`)",
        host_id_in_store, default={socket.gethostname()}, changed={"rack9-node4"}),
    "agent.state_dir": Effect(
        "{tmp}/elsewhere", "the journal, the SQLite store and the spool are made in this directory",
        state_files, against="{tmp}/state", default=[],
        changed=["journal.sqlite3", "spool.sqlite3", "usage.sqlite3"]),
    "agent.listen": Effect(
        "127.0.0.2", "the server listens on this address, not on 127.0.0.1", addresses_answering,
        default=(True, False), changed=(False, True)),
    "agent.port": Effect(
        Dyn(lambda v: _free_port(), "a free port"), "the server listens on this port", bound_to_configured_port,
        against=0, default=False, changed=True),
    "agent.tls_cert": Effect(
        "{tmp}/tls/cert.pem", "with tls_key: the API is served over HTTPS (without it: refused, they go together)",
        scheme_served, base={"agent": {"tls_key": "{tmp}/tls/key.pem"}}, prepare=tls_files,
        default=Refused("agent.tls_cert"), changed="https"),
    "agent.tls_key": Effect(
        "{tmp}/tls/key.pem", "with tls_cert: the API is served over HTTPS (without it: refused, they go together)",
        scheme_served, base={"agent": {"tls_cert": "{tmp}/tls/cert.pem"}}, prepare=tls_files,
        default=Refused("agent.tls_cert"), changed="https"),
    "agent.allow_plain_http": Effect(
        True, "plain HTTP on a non-loopback address (0.0.0.0) is served instead of refused", scheme_served,
        base={"agent": {"listen": "0.0.0.0"}}, default=Refused("agent.listen"), changed="http"),
    "agent.log_format": Effect(
        "text", "`hostagent serve` logs text lines (by default, its stderr not a TTY, one JSON object a line)",
        serving_record_is_json, default=True, changed=False, together=True),
    "agent.log_level": Effect(
        "WARNING", "`hostagent serve` leaves out INFO records (its \"serving on\" line)", info_logged,
        default=True, changed=False, together=True),
    "agent.max_body_bytes": Effect(
        2048, "a 3 kB request body is refused 413", body_too_large,
        default=lambda s: s != 413, changed=413),
    "agent.body_timeout_s": Effect(
        0.3, "a body that stops arriving is answered 408 after this long", slow_body,
        default=None, changed=408, together=True),
    "agent.header_timeout_s": Effect(
        0.3, "headers that never finish arriving are answered 408 after this long", slow_head,
        default=None, changed=408, together=True),
    "agent.idle_timeout_s": Effect(
        0.4, "an idle keep-alive connection is closed after this long", idle_connection_closed,
        base={"agent": {"header_timeout_s": 0.2}}, default=False, changed=True, together=True),
    "agent.max_connections": Effect(
        2, "past this many open connections, a new one is answered 503", third_connection,
        default=200, changed=503),
    "agent.max_connections_per_source": Effect(
        2, "past this many open connections from one address, its new one is answered 429", third_connection,
        default=200, changed=429),
    "agent.max_inflight_per_token": Effect(
        1, "a VM's request past this many in flight is answered 429", second_request_in_flight,
        default=200, changed=429, together=True),
    "agent.guest_requests_per_s": Effect(
        0.5, "a VM's burst past 10 s of this rate is answered 429", refused_of_a_burst,
        default=0, changed=lambda n: n >= 1, together=True),
    "agent.metrics_listen": Effect(
        "127.0.0.1:0", "/metrics moves off the API's port to a listener of its own, without a token",
        where_metrics_are, default=(200, None), changed=(404, 200)),
    "agent.gc_freeze": Effect(
        False, "the heap is not frozen after the start and the model load (by default it is)", heap_frozen,
        default=True, changed=False),
    "agent.public_url": Proven(
        "tests/adapters/test_fleet.py::test_public_url_is_the_link_other_hosts_follow",
        "the fleet page of every agent on the store links to this host there; left out, the address it serves on"),
    # [host]
    "host.sysfs_root": Effect(
        "{tmp}/other/sys", "the GPUs are those of this tree (a workstation's 3, not a DGX's 8)", gpu_count,
        prepare=other_tree, against="{tmp}/host/sys", default=8, changed=3),
    "host.kernel": Effect(
        "fake", "writes under sysfs_root go to the fake kernel, which binds the GPU to vfio-pci; the running "
        "kernel's plain sysfs writes change nothing in a fake tree, and the grant fails", grant_and_driver,
        prepare=vfio_registered, default=lambda s: s[0] >= 400 and s[1] == 0, changed=(201, 1)),
    "host.dev_root": Effect(
        "{tmp}/otherdev", "the grant waits for /dev/vfio/<group> here (where the fake kernel makes none)",
        grant_status, prepare=empty_dev, default=201, changed=lambda s: s >= 400),
    "host.proc_root": Effect(
        "{tmp}/otherproc", "`hostagent doctor` reads the kernel command line here (one without iommu flags)",
        doctor_cmdline, prepare=proc_without_iommu_flags, default="OK", changed="WARN"),
    "host.pci_ids_path": Effect(
        "{tmp}/pci.ids", "GPU names come from this pci.ids file", first_gpu_model, prepare=pci_ids_file,
        default=lambda m: "Configured" not in m, changed=lambda m: "Configured Model Name" in m),
    "host.gpu_vendors": Effect(
        ["1002"], "only display controllers of these vendors are GPUs (the workstation's AMD card alone)",
        gpu_vendor_ids, scenario="workstation", default={"10de", "1002"}, changed={"1002"}),
    "host.group_allow_list": Effect(
        ["15b3:101d"], "a GPU sharing its IOMMU group with an allowed device (a ConnectX NIC) becomes leasable",
        a10_viable, scenario="shared-rootport", default=False, changed=True),
    "host.step_timeout_s": Effect(
        0.3, "a bind whose unbind hangs (1 s) fails after this long instead of finishing",
        grant_status_then_hangs_over,
        prepare=hang_unbinds, default=201, changed=lambda s: s >= 400, together=True),
    "host.rom_bar_off": Effect(
        True, "the hostdev XML attached to the domain carries <rom bar='off'/>", rom_bar_off,
        default=False, changed=True),
    "host.driver_vfio": Effect(
        False, "the hostdev XML attached to the domain leaves out <driver name='vfio'/>", driver_vfio,
        default=True, changed=False),
    "host.guest_layout": Effect(
        "multifunction", "a GPU's functions share one guest slot (libvirt's choice: a slot each); for a shut-off VM, "
        "as libvirt hot-plugs function 0 only", guest_slots_of_4090, scenario="workstation-vfio",
        prepare=lambda v: edit_hypervisor(v, lambda hv: hv.shutdown("vm-a")),
        default=lambda a: len({x.rsplit(".", 1)[0] for x in a}) == 2,
        changed=lambda a: len({x.rsplit(".", 1)[0] for x in a}) == 1),
    "host.pinned": Effect(
        Dyn(lambda v: [v.tree.gpus[0]], "[the first GPU's address]"),
        "a GPU an operator bound with `hostagent vfio bind` stays on vfio-pci through the start's reconcile (by "
        "default it is given back)", driver_of_first_gpu_after_start, prepare=bind_first_gpu_with_cli,
        default="nvidia", changed="vfio-pci"),
    "host.allow_boot_vga": Effect(
        True, "the boot VGA device may be leased (by default a lease that needs it fails and the GPU waits for the "
        "operator)", lease_of_every_gpu, prepare=first_gpu_is_boot_vga, default=(500, 0), changed=(201, 0)),
    "host.no_reset": Effect(
        "refuse", "a GPU without a reset method is refused (by default leased, with a host-warning event)",
        lease_of_every_gpu, prepare=first_gpu_has_no_reset, default=(201, 1), changed=(500, 0)),
    "host.nvlink_hints": Effect(
        "{tmp}/nvlink.txt", "GET /v1/topology shows the NVLink clique this file names", nvlink_cliques,
        prepare=nvlink_file, default=[], changed=lambda c: len(c) == 1 and len(c[0]) == 2),
    # [libvirt]
    "libvirt.uri": Effect(
        "sim://{tmp}/hv.json", "the agent drives this hypervisor (its VMs can be leased to)",
        operator_lease_for_vm_a, against="sim://{tmp}/elsewhere.json", default=404, changed=201),
    "libvirt.detach_timeout_s": Effect(
        0.2, "a detach the guest acknowledges after 1 s outlasts this timeout: the lease is DETACH_PENDING",
        state_after_release, hv={"detach_ack_delay_s": 1.0}, default="RELEASED", changed="DETACH_PENDING",
        together=True),
    "libvirt.detach_retries": Effect(
        1, "an unacknowledged detach is retried this many times, then the operator is alerted (a detach-alert "
        "event, the hostagent_detach_alerts gauge) and the retries stop", detach_retries_and_alert,
        base={"libvirt": {"detach_timeout_s": 0.1}}, prepare=vm_a_refuses_detach,
        default=(2, 0, 0.0, 0), changed=(1, 1, 1.0, 1)),
    "libvirt.guest_bus": Effect(
        1, "per-function hostdevs go on this guest bus (a PCI bridge the domain has)", guest_bus_of_grant,
        base={"host": {"guest_layout": "per-function"}}, prepare=pci_bridge_in_vm_a, default="00", changed="01"),
    # [store]
    "store.url": Effect(
        "sqlite:///{tmp}/elsewhere/usage.db", "the usage store is this database, not <state_dir>/usage.sqlite3",
        store_files, prepare=lambda v: (v.tmp / "elsewhere").mkdir(), default=(True, False), changed=(False, True)),
    "store.auto_upgrade": Effect(
        False, "the agent does not migrate the store's schema at start (`hostagent db status`: no revision; on a "
        "fresh database the agent then refuses to start, saying to run `hostagent db upgrade`)",
        start_and_revision, default=lambda o: o[0] is True and bool(o[1]),
        changed=lambda o: o[0] is False and o[1] is None and "hostagent db upgrade" in o[2]),
    "store.spool_path": Effect(
        "{tmp}/spool-here.db", "the spool is this file, not <state_dir>/spool.sqlite3", spool_files,
        default=(True, False), changed=(False, True)),
    "store.queue_max": Effect(
        20, "heartbeat samples past this many queued are refused 503", second_vm_heartbeat,
        base={"store": {"flush_interval_s": 30.0, "ingest_share": 0.75}}, default=200, changed=503),
    "store.samples_per_lease_per_s": Effect(
        1.0, "a heartbeat larger than 60 s of this rate is refused 400", heartbeat_of(100),
        default=200, changed=400),
    "store.ingest_share": Effect(
        0.01, "a VM's samples past this part of the queue are refused 429", heartbeat_of(300), base=SLOW_FLUSH,
        default=200, changed=429),
    "store.flush_interval_s": Effect(
        30.0, "queued samples wait this long to be written (by default a second)", samples_written_within(2.0, 5),
        default=True, changed=False, together=True),
    "store.flush_batch": Effect(
        5, "this many queued samples are written at once, without waiting for the flush interval",
        samples_written_within(1.0, 10), base=SLOW_FLUSH, default=False, changed=True, together=True),
    "store.raw_retention_days": Effect(
        1, "the hourly prune deletes raw samples older than this (two days old here)", store_rows_after_prune,
        base=FLUSH_AT_ONCE, clock_behind_s=3 * DAY, default=lambda c: c[0] == 10, changed=lambda c: c[0] == 0),
    "store.minute_retention_days": Effect(
        1, "the hourly prune deletes per-minute rollups older than this (two days old here)",
        store_rows_after_prune, base=FLUSH_AT_ONCE, clock_behind_s=3 * DAY, default=lambda c: c[1] > 0, changed=lambda c: c[1] == 0),
    "store.max_lag_s": Effect(
        0.3, "/readyz reports the store degraded when samples have waited longer than this",
        store_healthy_after_wait, base=SLOW_FLUSH, default=True, changed=False, together=True),
    "store.fleet_publish_interval_s": Proven(
        "tests/adapters/test_fleet.py::test_the_publish_interval_is_store_fleet_publish_interval_s",
        "the agent writes its live state to the store this often: at 0.2 s a new lease shows in the fleet within a "
        "few intervals, at an hour the store still holds the start's snapshot"),
    # [leases]
    "leases.default_duration_s": Effect(
        600, "a request without duration_s expires this long after it was made", ttl_of_grant,
        clock_behind_s=0.0, default=8 * HOUR, changed=600.0),
    "leases.max_duration_s": Effect(
        3600, "a request for a longer duration_s is refused 400", two_hour_request,
        base={"leases": {"default_duration_s": 600}}, default=201, changed=400),
    "leases.queue_max": Effect(
        1, "a request to queue past this many queued is refused 409", lambda v: second_queued_request(v, "vm-c"),
        default=202, changed=409),
    "leases.queue_max_per_vm": Effect(
        1, "a VM's request to queue past its share is refused 429", lambda v: second_queued_request(v, "vm-b"),
        default=202, changed=429),
    "leases.queue_max_wait_s": Effect(
        600.0, "a queued request's queue.deadline is this long after it was queued", queue_wait,
        clock_behind_s=0.0, default=DAY, changed=600.0),
    "leases.guest_max_priority": Effect(
        10, "a guest's request keeps priority 10 (by default it is capped to 0)", priority_kept,
        default=0, changed=10),
    "leases.keep_on_domain_stop": Effect(
        True, "a lease outlives its VM shutting down", lease_state_after_vm_shutdown,
        default="RELEASED", changed="ACTIVE", together=True),
    "leases.queue_order": Proven(
        "tests/adapters/test_queue_advantage.py::test_the_operator_bounds_it_or_turns_it_off",
        "strict: a freed T4 goes to the head of the queue, not to the request behind it that gains most from it"),
    "leases.fairness_max_passes": Proven(
        "tests/adapters/test_queue_advantage.py::test_the_operator_bounds_it_or_turns_it_off",
        "a request passed over this often by comparative advantage is served in turn"),
    "leases.fairness_max_delay_s": Proven(
        "tests/adapters/test_queue_advantage.py::test_the_operator_bounds_it_or_turns_it_off",
        "a request first passed over this long ago is served in turn"),
    "leases.priority_rules": Proven(
        "tests/adapters/test_priority_rules.py::test_a_request_that_states_no_priority_gets_the_first_rule_it_matches",
        "a request stating no priority gets the first matching rule's (a 600 s request 5, a notebook -5, a research "
        "VM 3), named in its reasons"),
    "leases.booking_horizon_s": Proven(
        "tests/adapters/test_bookings.py::test_bad_bookings_get_a_clear_400_and_change_nothing",
        "a booking starting further ahead than this is refused 400 (a day here: two days ahead is too far)"),
    "leases.booking_lead_s": Proven(
        "tests/adapters/test_bookings.py::test_at_its_start_a_booking_binds_its_gpus_ready_on_time",
        "a booking binds this long before its start (60 s here: not at 61 s before it, at 59 s), and its offers "
        "start this long after the GPUs free"),
    "leases.preempt_min_priority": Proven(
        "tests/adapters/test_preemption.py::test_preempt_min_priority_from_config",
        "a queued request of at least this priority reclaims a lower one's GPU", pending=True),
    "leases.consolidate": Proven(
        "tests/adapters/test_consolidate.py::"
        "test_with_consolidate_on_the_moves_run_and_the_request_gets_the_freed_block",
        "the moves that free a block for a request waiting on scattered GPUs are performed (off: only proposed, "
        "test_a_request_waiting_on_scattered_gpus_is_proposed_the_fewest_moves)"),
    "leases.max_gpus_per_vm": Effect(
        1, "a VM's request past this many GPUs is refused 4xx", second_gpu_of_vm_a,
        default=201, changed=lambda s: 400 <= s < 500),
    "leases.max_gpu_hours_per_day_per_vm": Effect(
        1.0, "a VM that used this many GPU-hours in the last 24 h is refused 4xx", request_after_two_hours,
        clock_behind_s=0.0, default=201, changed=lambda s: 400 <= s < 500),
    "leases.projects": Effect(
        {"lab": {"domains": ["vm-a"], "max_gpus": 1}}, "a project's quota refuses its VM (vm-a) a second GPU, not "
        "another VM (vm-b)", two_gpus_for_vm_a_and_vm_b, default=(201, 201),
        changed=lambda s: 400 <= s[0] < 500 and s[1] == 201),
    "leases.numa_policy": Effect(
        "required", "a multi-GPU request that no NUMA node can hold is refused (by default it spans two)",
        five_gpu_request, default=201, changed=409),
    "leases.journal_retention_days": Effect(
        1, "the hourly prune forgets ended leases older than this (two days here)", ended_lease_listed_after_two_days,
        clock_behind_s=0.0, default=True, changed=False),
    # [reclaim]
    "reclaim.enabled": Effect(
        False, "the reaper's scheduler never checks a due lease", checked_by_the_scheduler,
        base={"reclaim": {"check_interval_s": 0.8}}, clock_behind_s=0.0, default=True, changed=False,
        together=True),
    "reclaim.check_interval_s": Effect(
        600.0, "an ACTIVE lease is next checked this long after its grant", check_interval,
        base={"reclaim": {"enabled": True}}, clock_behind_s=0.0, default=HOUR, changed=600.0),
    "reclaim.grace_s": Effect(
        300.0, "strike one's recheck comes this long after it", grace, base=RECLAIM_ON,
        clock_behind_s=6 * HOUR, default=1200.0, changed=300.0),
    "reclaim.idle_util_pct": Effect(
        20.0, "a lease at 10 % counts as idle (strike one)", strike_after_one_check(10.0), base=RECLAIM_ON,
        clock_behind_s=6 * HOUR, default="none", changed="one"),
    "reclaim.memory_counts_busy": Effect(
        False, "a lease at 0 % holding 1 GiB of GPU memory counts as idle (strike one)",
        strike_after_one_check(0.0, 2**30), base=RECLAIM_ON, clock_behind_s=6 * HOUR, default="none", changed="one"),
    "reclaim.min_lease_age_s": Effect(
        7200.0, "a lease an hour old gets no strike", strike_after_one_check(0.0),
        base={"reclaim": {"enabled": True}}, clock_behind_s=6 * HOUR, default="one", changed="none"),
    "reclaim.no_heartbeat": Effect(
        "never-idle", "a lease without heartbeats, its host counters flat, is never judged idle",
        strike_without_heartbeats, base=RECLAIM_ON, clock_behind_s=6 * HOUR, default="one", changed="none"),
    "reclaim.host_signal": Effect(
        "untrusted", "flat vfio counters prove nothing (posted interrupts): a lease without heartbeats is never "
        "judged idle, and GET /v1/reaper says the counters are not trusted", strike_without_heartbeats_and_signal,
        base=RECLAIM_ON, clock_behind_s=6 * HOUR, default=("one", True), changed=("none", False)),
    "reclaim.guest_busy_host_idle": Effect(
        "reclaim", "the host's flat vfio counters win over a guest reporting busy (strike one; both flagged)",
        strike_when_guest_busy_host_quiet, base=RECLAIM_ON, clock_behind_s=6 * HOUR,
        default=("none", True), changed=("one", True)),
    "reclaim.notice_window_s": Effect(
        600.0, "strike two's reclaim notice gives the guest this long", notice_window,
        base={"reclaim": {"enabled": True, "min_lease_age_s": 0.0, "grace_s": 100.0}}, clock_behind_s=6 * HOUR,
        default=60.0, changed=600.0),
    "reclaim.per_priority": Effect(
        {"10": {"check_interval_s": 7200.0}}, "a priority-10 lease is next checked after its class's interval",
        priority_10_check_interval, base={"reclaim": {"enabled": True}}, clock_behind_s=0.0,
        default=HOUR, changed=7200.0),
    # [placement]
    "placement.outcome": Effect(
        "utilization", "`hostagent model train` trains for this outcome", train_figures,
        default=lambda f: f[0] == "work_rate", changed=lambda f: f[0] == "utilization"),
    "placement.min_records": Effect(
        5, "training needs this many labelled records before a model replaces the cold-start rule",
        train_figures, default=lambda f: f[1:] == (30, "insufficient-records"),
        changed=lambda f: f[1:] == (5, "insufficient-records")),
    "placement.train_threads": Proven(
        "tests/adapters/test_train_threads.py::test_the_scheduled_retraining_fits_on_placement_train_threads",
        "the scheduled retraining fits with its OpenMP pool at this many threads (left out: one; 0: a worker thread's "
        "default, a thread per CPU)"),
    "placement.explore_epsilon": Proven(
        "tests/adapters/test_placer.py::test_before_its_first_model_placement_explores_at_its_own_rate",
        "once a model is in use, placement explores on this share of one-GPU requests (0.5: 5 to 15 of 20; 0: none)"),
    "placement.cold_explore_epsilon": Effect(
        0.0, "before the first model, placement explores on this share of one-GPU requests (by default 0.3)",
        explored_of(8), default=lambda n: 1 <= n <= 5, changed=0),
    "placement.explore_max_priority": Effect(
        10, "requests of priority 6 explore too (by default none above 5 does)",
        explored_of(8, domain="vm-a", priority=6), base={"placement": {"cold_explore_epsilon": 0.5}},
        default=0, changed=lambda n: n >= 3),
    "placement.retrain_interval_s": Effect(
        0.3, "the agent retrains this often (its log's \"retraining:\" lines)", retrainings_within,
        default=0, changed=lambda n: n >= 1),
    "placement.retrain_growth": Proven(
        "tests/adapters/test_retraining.py::test_a_fresh_agent_trains_its_first_model_once_it_has_min_records_then_as_"
        "they_grow",
        "a fresh agent trains its first model once placement.min_records leases have finished (not at the first "
        "interval), then when they reach this multiple of those (1.5: at 60 after 40, not at 55); 0: the interval "
        "alone (test_placement_retrain_growth_0_leaves_the_interval_alone)"),
    "placement.model_check_interval_s": Proven(
        "tests/adapters/test_model_follow.py::test_the_check_interval_is_placement_model_check_interval_s",
        "the running agent reads the store's active model this often: at 0.1 s it follows a model trained beside it, "
        "at an hour (its start check done) it is still on the cold-start rule after the other has checked ten times"),
    "placement.objective": Effect(
        "spread", "a second one-GPU lease goes across the sockets from the first (packing puts it beside it)",
        second_gpu_distance(), default=1, changed=4, base=NO_EXPLORING),
    "placement.objective_per_task": Effect(
        {"inference": "spread"}, "an inference lease spreads away from a running one (others still pack)",
        second_gpu_distance("inference"), default=1, changed=4, base=NO_EXPLORING),
    "probes.task_probes": Proven(
        "tests/adapters/test_task_probes.py::test_a_new_task_type_is_probed_first_and_its_figure_places_the_next_request",
        "the command runs on a free GPU of each model when its task type is new, and its work rate places the "
        "task type's next request"),
    "placement.cap_at_scaling_limit": Proven(
        "tests/adapters/test_scaling_limit.py::test_a_request_past_the_limit_is_told_and_cut_when_the_operator_caps",
        "a request for more GPUs than its task type's records show it gaining from is cut to that count"),
    # [auth]
    "auth.operator_token_sha256": Effect(
        Dyn(lambda v: hash_token(v.operator), "the operator token's SHA-256"),
        "the token with this SHA-256 is the operator's", operator_token_status, default=401, changed=200),
    "dashboard.refresh_s": Proven(
        "tests/browser/test_dashboard_live.py::test_charts_gain_points_and_slide_without_reload",
        "open pages fetch fresh data this often: a chart gains the points sent after it loaded, without a reload"),
    "dashboard.stale_after_s": Proven(
        "tests/adapters/test_dashboard_live.py::test_a_dead_guest_looks_dead_and_a_silent_one_is_flagged",
        "a guest silent for longer is shown stale ('no heartbeat for N'); a shorter silence is not"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _matches(expect: Expect, seen: Any) -> bool:
    return bool(expect(seen)) if callable(expect) else bool(expect == seen)


async def _observe(v: Variant, effect: Effect) -> Any:
    try:
        return await effect.probe(v)
    except ConfigError as exc:
        return Refused(exc.field)


@pytest.mark.parametrize("key", [k for k, e in TABLE.items() if isinstance(e, Effect)])
async def test_the_key_does_what_the_document_says(key: str, tmp_path: Path) -> None:
    effect = TABLE[key]
    assert isinstance(effect, Effect)
    fast = FAST_TMP.is_dir() and os.access(FAST_TMP, os.W_OK)
    where = Path(tempfile.mkdtemp(prefix="hostagent-config-keys-", dir=FAST_TMP)) if fast else tmp_path
    default = make_variant(where / "default", key, effect, set_key=False)
    changed = make_variant(where / "set", key, effect, set_key=True)
    changed.starting = default.starting
    try:
        if effect.together:
            seen_default, seen_set = await asyncio.gather(_observe(default, effect), _observe(changed, effect))
        else:
            seen_default = await _observe(default, effect)
            await default.close()
            seen_set = await _observe(changed, effect)
    finally:
        await default.close()
        await changed.close()
        if fast:
            shutil.rmtree(where, ignore_errors=True)
    value = changed.setting(key)
    assert _matches(effect.default, seen_default), f"{key} left out: saw {seen_default!r}; the entry expects " \
        f"{effect.default!r} for: {effect.says}"
    assert _matches(effect.changed, seen_set), f"{key} = {value!r}: saw {seen_set!r}, default showed " \
        f"{seen_default!r}; expected: {effect.says}"
    assert seen_default != seen_set, f"{key} = {value!r} changes nothing that a user sees ({seen_set!r})"


# -- the meta-tests ---------------------------------------------------------------------------------------------------


def documented_keys() -> list[str]:
    """The keys of the document's tables, in order."""
    return ROW.findall(DOC.read_text())


def setting_keys() -> list[str]:
    return [f"{name}.{f.name}" for name, cls in typing.get_type_hints(Settings).items()
            for f in dataclasses.fields(cls)]


def test_every_setting_is_documented() -> None:
    documented = set(documented_keys())
    missing = [k for k in setting_keys() if k not in documented]
    assert not missing, f"settings without a row in docs/configuration.md: {missing}"
    unknown = sorted(documented - set(setting_keys()))
    assert not unknown, f"docs/configuration.md documents keys that are not settings: {unknown}"
    keys = documented_keys()
    assert len(keys) == len(set(keys)), "a key has two rows in docs/configuration.md"


def test_every_documented_key_has_an_entry() -> None:
    documented = documented_keys()
    missing = [k for k in documented if k not in TABLE]
    assert not missing, f"documented keys whose effect nothing asserts (add them to TABLE): {missing}"
    stale = sorted(set(TABLE) - set(documented))
    assert not stale, f"TABLE entries for keys the document no longer has: {stale}"


def test_every_entry_sets_its_key_to_something_else_than_the_default() -> None:
    defaults = {f"{name}.{f.name}": getattr(getattr(Settings(), name), f.name)
                for name, cls in typing.get_type_hints(Settings).items() for f in dataclasses.fields(cls)}
    for key, entry in TABLE.items():
        if not isinstance(entry, Effect) or isinstance(entry.value, Dyn) or "{tmp}" in str(entry.value):
            continue
        value = tuple(entry.value) if isinstance(entry.value, list) else entry.value
        assert value != defaults[key], f"{key}: the entry sets the default ({value!r}): nothing to tell apart"
        assert entry.default != entry.changed or callable(entry.default), f"{key}: both expectations are the same"


def _test_source(path: Path, name: str) -> str | None:
    """The body of test `name` in `path` (its name and signature left out), with the bodies of the module's own
    functions it calls or takes as fixtures (one level): where a test sets a key through a helper that builds its
    agent. None when the module has no such test."""
    text = path.read_text()
    tree = ast.parse(text)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    test = functions.get(name)
    if test is None:
        return None

    def body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
        return "\n".join(ast.get_source_segment(text, stmt) or "" for stmt in fn.body)

    used = {n.func.id for n in ast.walk(test) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    used |= {a.arg for a in test.args.args}
    parts = [body(test)] + [body(functions[u]) for u in sorted(used) if u in functions and u != name]
    return "\n".join(parts)


@pytest.mark.parametrize("key", [k for k, e in TABLE.items() if isinstance(e, Proven)])
def test_a_named_test_exists_and_sets_its_key(key: str) -> None:
    entry = TABLE[key]
    assert isinstance(entry, Proven)
    file, _, name = entry.test.partition("::")
    path = ROOT / file
    if entry.pending and not path.exists():
        # Only leases.preempt_min_priority may wait for its test, which is being written beside this file.
        assert key == "leases.preempt_min_priority", f"{key}: only preempt_min_priority may name a pending test"
        pytest.skip(f"{entry.test} is not written yet")
    assert path.exists(), f"{key}: {file} does not exist"
    source = _test_source(path, name)
    assert source is not None, f"{key}: {file} has no test {name}"
    assert key.split(".")[1] in source, f"{key}: {entry.test} never sets {key.split('.')[1]} (in its body or the " \
        "helpers and fixtures it uses)"
