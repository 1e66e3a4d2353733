"""Test support for the dashboard: the demo agent as a subprocess, a tiny loopback API client, and Chromium.

Browser tests FAIL (never skip) when Debian's Chromium is missing: `apt-get install chromium`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("HOSTAGENT_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
SERVING = re.compile(r"hostagent: serving on (http://127\.0\.0\.1:\d+)")
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"


@dataclass
class Demo:
    """A running `hostagent demo` and its credentials."""

    proc: subprocess.Popen[str]
    url: str
    state_dir: Path
    creds: dict[str, Any]
    log: list[str] = field(default_factory=list)

    @property
    def operator(self) -> str:
        """The operator token."""
        return str(self.creds["operator"]["token"])

    def vm_token(self, name: str) -> str:
        """The token of a demo VM by name."""
        return next(str(v["token"]) for v in self.creds["vms"] if v["domain"] == name)

    @property
    def vm_names(self) -> list[str]:
        """Demo VM names."""
        return [str(v["domain"]) for v in self.creds["vms"]]

    def api(self, method: str, path: str, token: str | None = None, body: Any = None) -> tuple[int, Any]:
        """Call the agent's JSON API (loopback only); returns (status, parsed body)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback URL from our own server
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            status = exc.code
        return status, (json.loads(raw) if raw else None)

    def lease(self, vm: str, **body: Any) -> dict[str, Any]:
        """Create a lease as a VM; asserts it was granted."""
        status, data = self.api("POST", "/v1/leases", self.vm_token(vm), body)
        assert status == 201, data
        return dict(data)

    def heartbeat(self, vm: str, lease: dict[str, Any], utils: list[float], *, step_s: float = 60.0) -> None:
        """Send one sample per value for every GPU of a lease, ending now. The agent refuses samples from before its
        lease had the GPU (beyond 300 s of clock skew), so a fresh lease's history is squeezed into those 300 s."""
        now = time.time()
        step_s = min(step_s, 290.0 / max(1, len(utils) - 1))
        samples = []
        for i, u in enumerate(utils):
            ts = now - (len(utils) - 1 - i) * step_s
            for d in lease["devices"]:
                samples.append({"ts": ts, "gpu": d["gpu_id"], "util_pct": u, "mem_used_bytes": int(2**30 * (1 + u / 10))})
        status, data = self.api("POST", f"/v1/leases/{lease['id']}/heartbeat", self.vm_token(vm), {"samples": samples})
        assert status == 200, data

    def stop(self) -> None:
        """SIGTERM, then wait (kill after 20 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_demo(state_dir: Path, *extra: str, timeout: float = 60.0, living: bool = False) -> Demo:
    """Run `python -m hostagent demo --port 0 --state-dir DIR` and wait for the URL it prints. Unless `living`, the
    demo is quiet (no simulated guests, no history) on the demo16 host, so a test's own leases are all there is."""
    quiet = () if living else ("--quiet", "--scenario", "demo16")
    proc = subprocess.Popen([sys.executable, "-m", "hostagent", "demo", "--port", "0", "--state-dir", str(state_dir),
                             *quiet, *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            pytest.fail("the demo exited before serving:\n" + "".join(lines[-40:]))
        lines.append(line)
        m = SERVING.search(line)
        if m:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the demo did not print its URL in time:\n" + "".join(lines[-40:]))
    # keep draining its output so the pipe never fills and blocks the agent
    import threading

    creds = state_dir / "demo-credentials.json"
    if not creds.exists():  # a fleet demo (--hosts N): the first host's, in its own directory
        creds = state_dir / "demo-host-1" / "demo-credentials.json"
    try:
        demo = Demo(proc, m.group(1), state_dir, json.loads(creds.read_text()), lines)
    except BaseException:  # never leave the demo (and a fleet's children) running behind a failed start
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    threading.Thread(target=lambda: [demo.log.append(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    return demo


def chromium_path() -> str:
    """Debian's Chromium, or a test failure that says how to install it."""
    path = shutil.which(CHROMIUM) or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if not path:
        pytest.fail(f"Chromium is missing at {CHROMIUM}: apt-get install chromium (browser tests fail, never skip)",
                    pytrace=False)
    return path


def screenshot(page: Any, name: str) -> Path:
    """Save a full-page screenshot under artifacts/screenshots/."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def login(browser: Any, demo: Demo, *, path: str = "/", width: int = 1440, javascript: bool = True,
          downloads: bool = True, timezone: str | None = "America/New_York") -> Any:
    """A new browser context logged in as the operator, on `path` (asked for before the login, as a bookmarked page
    is: the login sends the browser back there)."""
    from playwright.sync_api import expect

    ctx = browser.new_context(viewport={"width": width, "height": 900}, java_script_enabled=javascript,
                              accept_downloads=downloads, **({"timezone_id": timezone} if timezone else {}))
    page = ctx.new_page()
    page.goto(demo.url + path)
    expect(page).to_have_url(re.compile(rf"/ui/login\?next={re.escape(path)}$"))
    page.fill("input[type=password]", demo.operator)
    page.click("button[type=submit]")
    expect(page).to_have_url(demo.url + path)
    return page
