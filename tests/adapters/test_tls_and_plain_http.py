"""The listener's transport policy, through `hostagent serve` as systemd starts it: plain HTTP only on loopback unless
`agent.allow_plain_http` (a TLS proxy in front), else TLS from `agent.tls_cert`/`agent.tls_key`.

The agent runs as a subprocess over a fake host (fake kernel, simulated hypervisor). Every connection stays on
loopback: the refusal is checked on 192.0.2.1 (TEST-NET-1, an address no host holds: the refusal comes before any
bind), and the non-loopback cases that must serve run in a network namespace of their own (`unshare -rn`), where
10.9.9.9 is an address of the namespace's own loopback device and nothing outside can reach it."""

from __future__ import annotations

import asyncio
import http.client
import json
import queue
import re
import resource
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hostagent.domain.errors import ConfigError
from hostagent.guest.client import HostClient
from hostagent.guest.client import ssl_context as ssl_context_guest
from hostagent.guest.errors import HostUnreachable
from hostagent.host.fakesysfs import build_tree
from hostagent.virt.sim import SimulatedHypervisor
from hostagent.web.auth import new_token
from hostagent.web import serve
from hostagent.web.serve import ssl_context
from tests.support.agent import VMS, rig_settings
from tests.support.cli import settings_toml

ROOT = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"hostagent: serving on (https?://\S+)")
NS_ADDRESS = "10.9.9.9"
REFUSAL = ("is not loopback and no TLS is configured: set agent.tls_cert and agent.tls_key, or "
           "agent.allow_plain_http = true if a trusted proxy terminates TLS")


def host_config(tmp: Path, name: str = "agent.toml", **agent: Any) -> tuple[Path, str]:
    """A fake dgx8 host and a simulated hypervisor under `tmp`/`name`.d, and the TOML configuration `hostagent serve`
    reads for them (the agent section overridden): its path, and the operator's token."""
    base = tmp / f"{name}.d"
    tree = build_tree(base / "host", "dgx8")
    hv = SimulatedHypervisor(path=base / "hv.json")
    hv.define(VMS[0], running=True)
    hv.save()
    operator = new_token("op")
    settings = rig_settings(base, tree, base / "hv.json", operator, agent={"listen": "127.0.0.1", "port": 0, **agent})
    return settings_toml(tmp / name, settings), operator


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) for 127.0.0.1 and the namespace's address, and its key."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=hostagent-test",
                    "-addext", f"subjectAltName=IP:127.0.0.1,IP:{NS_ADDRESS}"], check=True, capture_output=True)
    return cert, key


async def guest_gpus(url: str, token: str, tls: ssl.SSLContext | bool, slept: list[float] | None = None) -> int:
    """GPUs listed through the guest agent's client (HostClient) with these TLS settings."""
    async def sleep(s: float) -> None:
        if slept is not None:
            slept.append(s)
    async with HostClient(url, token, retries=3, ssl=tls, sleep=sleep) as client:
        return len((await client.request("GET", "/v1/gpus"))[1]["gpus"])


# ---- the decision itself ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("listen", "allowed"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("localhost", True),
    ("192.0.2.1", False), ("0.0.0.0", False), ("::", False), ("2001:db8::1", False), ("gpu-host-1.example", False),
])
def test_plain_http_only_on_loopback_unless_allowed(tmp_path: Path, listen: str, allowed: bool) -> None:
    from hostagent.config import settings_from_dict

    def ctx(**agent: Any) -> ssl.SSLContext | None:
        return ssl_context(settings_from_dict({"agent": {"listen": listen, "state_dir": str(tmp_path), **agent}}))

    if allowed:
        assert ctx() is None
    else:
        with pytest.raises(ConfigError) as exc:
            ctx()
        assert exc.value.message == f"agent.listen={listen} {REFUSAL}" and exc.value.field == "agent.listen"
    assert ctx(allow_plain_http=True) is None  # a trusted proxy terminates TLS: plain HTTP anywhere
    cert, key = self_signed(tmp_path)
    tls = ctx(tls_cert=str(cert), tls_key=str(key))  # TLS: any address
    assert isinstance(tls, ssl.SSLContext) and tls.protocol == ssl.PROTOCOL_TLS_SERVER
    with pytest.raises(ConfigError) as exc:  # a key that is not the certificate's: refused, named
        ctx(tls_cert=str(cert), tls_key=str(cert))
    assert "agent.tls_cert/tls_key: cannot load" in exc.value.message


# ---- `hostagent serve` -----------------------------------------------------------------------------------------


def serve_cmd(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hostagent", "serve", "--config", str(config), *extra]


def test_serve_refuses_plain_http_off_loopback_at_start(tmp_path: Path) -> None:
    config, _ = host_config(tmp_path, listen="192.0.2.1")
    for argv in (serve_cmd(config), serve_cmd(host_config(tmp_path, "lo.toml")[0], "--listen", "192.0.2.1")):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 2, (r.returncode, r.stderr[-2000:])  # bad configuration
        assert r.stderr.strip().splitlines()[-1] == f"hostagent: error: configuration: agent.listen=192.0.2.1 {REFUSAL}"
        assert "Traceback" not in r.stderr and "serving on" not in r.stdout


@contextmanager
def agent(argv: list[str], log: Path, timeout: float = 60.0, *,
          preexec: Callable[[], None] | None = None, procs: list[subprocess.Popen[str]] | None = None) -> Iterator[str]:
    """Run `hostagent serve` (`preexec` run in the child before it; the process appended to `procs`); yield the URL it
    serves on; SIGTERM it at the end (it must exit 0)."""
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, preexec_fn=preexec)
    if procs is not None:
        procs.append(proc)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            assert proc.poll() is None, f"the agent exited {proc.returncode}: {log.read_text()[-3000:]}"
            try:
                m = SERVING.search(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"the agent did not serve within {timeout:g} s: {log.read_text()[-3000:]}") \
                    from None
            url = m.group(1) if m else None
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def get(url: str, *, ctx: ssl.SSLContext | None = None, token: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:  # noqa: S310 - loopback only
        return resp.status, json.loads(resp.read())


def test_serve_with_tls_answers_https_only(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    config, operator = host_config(tmp_path, tls_cert=str(cert), tls_key=str(key))
    with agent(serve_cmd(config), tmp_path / "agent.log") as url:
        assert url.startswith("https://127.0.0.1:")
        port = int(url.rsplit(":", 1)[1])
        trusting = ssl.create_default_context(cafile=str(cert))
        status, body = get(url + "/healthz", ctx=trusting)
        assert status == 200 and body.get("ok", True) is not False
        status, body = get(url + "/v1/gpus", ctx=trusting, token=operator)  # the API itself, over TLS
        assert status == 200 and len(body["gpus"]) == 8
        # a client that does not trust this certificate stops at the handshake
        with pytest.raises(urllib.error.URLError) as exc:
            get(url + "/healthz", ctx=ssl.create_default_context())
        assert isinstance(exc.value.reason, ssl.SSLCertVerificationError)
        # the guest agent's client: trusts the CA it is given, refuses an unknown certificate at once (no
        # retry heals it), and skips verification only when told to (--insecure)
        assert asyncio.run(guest_gpus(url, operator, ssl_context_guest(str(cert), False))) == 8
        assert asyncio.run(guest_gpus(url, operator, ssl_context_guest(None, True))) == 8
        slept: list[float] = []
        with pytest.raises(HostUnreachable, match=r"TLS handshake with https://127\.0\.0\.1:\d+ failed: .*certificate"):
            asyncio.run(guest_gpus(url, operator, ssl_context_guest(None, False), slept))
        assert slept == []
        # plain HTTP to the same port gets no answer: the server speaks TLS only
        with pytest.raises((http.client.HTTPException, ConnectionError, urllib.error.URLError)):
            get(f"http://127.0.0.1:{port}/healthz")
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            with pytest.raises((http.client.HTTPException, ConnectionError)):
                plain.request("GET", "/healthz")
                plain.getresponse()
        finally:
            plain.close()


def test_serve_raises_its_open_file_limit_for_the_tarpit(tmp_path: Path) -> None:
    """Started with the usual soft limit of 1024 open files, `hostagent serve` raises it towards FD_LIMIT_WANTED (at
    most the hard limit), so its tarpit can hold thousands of refused connections."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard open-file limit here is {hard}: nothing to raise")
    wanted = serve.FD_LIMIT_WANTED if hard == resource.RLIM_INFINITY else min(serve.FD_LIMIT_WANTED, hard)
    config, _ = host_config(tmp_path)
    procs: list[subprocess.Popen[str]] = []
    with agent(serve_cmd(config), tmp_path / "agent.log", procs=procs,
               preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))) as url:
        assert get(url + "/healthz")[0] == 200
        limits = Path(f"/proc/{procs[0].pid}/limits").read_text()
        soft = int(next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3])
        assert soft == wanted, limits
    assert f"open-file limit {wanted}" in (tmp_path / "agent.log").read_text()


# ---- off loopback, in a network namespace ----------------------------------------------------------------------

NAMESPACE_HELPER = r'''
"""Runs inside `unshare -rn`: the namespace's loopback device up with a second, non-loopback address; then each
`hostagent serve` case, printing one JSON line of results."""
import json, re, signal, ssl, subprocess, sys, time, urllib.request

py, root, address, cert = sys.argv[1:5]
cases = json.loads(sys.argv[5])
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True)
out = {}
for name, config in cases.items():
    proc = subprocess.Popen([py, "-m", "hostagent", "serve", "--config", config], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=root)
    url, deadline = None, time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"hostagent: serving on (\S+)", line)
        url = m.group(1) if m else None
    res = {"url": url}
    if url:
        ctx = ssl.create_default_context(cafile=cert) if url.startswith("https") else None
        with urllib.request.urlopen(url + "/healthz", timeout=10, context=ctx) as r:
            res["healthz"] = r.status
        proc.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    res.update(rc=proc.returncode, stderr=stderr[-2000:])
    out[name] = res
print(json.dumps(out))
'''


def test_off_loopback_plain_http_needs_allow_plain_http_and_tls_needs_nothing(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-rn", "true"], capture_output=True, text=True) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"no network namespace here (unshare -rn: {probe.stderr.strip() if probe else 'not installed'})")
    cert, key = self_signed(tmp_path)
    cases = {
        "plain": host_config(tmp_path, "plain.toml", listen=NS_ADDRESS)[0],
        "allowed": host_config(tmp_path, "allowed.toml", listen=NS_ADDRESS, allow_plain_http=True)[0],
        "tls": host_config(tmp_path, "tls.toml", listen=NS_ADDRESS, tls_cert=str(cert), tls_key=str(key))[0],
    }
    helper = tmp_path / "ns_helper.py"
    helper.write_text(NAMESPACE_HELPER)
    r = subprocess.run([unshare, "-rn", sys.executable, str(helper), sys.executable, str(ROOT), NS_ADDRESS, str(cert),
                        json.dumps({k: str(v) for k, v in cases.items()})],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # the address is bindable there: the refusal is the policy's, before any bind
    assert res["plain"]["url"] is None and res["plain"]["rc"] == 2, res["plain"]
    assert f"hostagent: error: configuration: agent.listen={NS_ADDRESS} {REFUSAL}" in res["plain"]["stderr"]
    assert res["allowed"]["url"] == f"http://{NS_ADDRESS}:" + res["allowed"]["url"].rsplit(":", 1)[1]
    assert res["allowed"]["healthz"] == 200 and res["allowed"]["rc"] == 0, res["allowed"]
    assert res["tls"]["url"].startswith(f"https://{NS_ADDRESS}:") and res["tls"]["healthz"] == 200, res["tls"]
    assert res["tls"]["rc"] == 0, res["tls"]
