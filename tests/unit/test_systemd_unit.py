"""systemd/hostagent.service: `systemd-analyze verify` finds nothing to say, and the hardening holds.

Needs the `systemd` package's systemd-analyze (no running systemd); FAILS when it is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "hostagent.service"
MAX_EXPOSURE = 4.0  # "OK" in systemd-analyze security's scale; docs/operations.md reports the figure


def analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd", pytrace=False)
    return path


def installed_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The unit as install.sh would place it, with ExecStart pointing at an executable that exists here."""
    exe = tmp_path / "bin" / "hostagent"
    exe.parent.mkdir(exist_ok=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    body = (text if text is not None else UNIT.read_text()).replace("/usr/local/bin/hostagent", str(exe))
    out = tmp_path / "hostagent.service"
    out.write_text(body)
    return out


def verify(unit: Path) -> tuple[int, str]:
    p = subprocess.run([analyze(), "verify", str(unit)], capture_output=True, text=True, timeout=60)
    return p.returncode, (p.stdout + p.stderr).strip()


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_unit_verifies_cleanly(tmp_path: Path) -> None:
    rc, out = verify(installed_copy(tmp_path))
    assert rc == 0 and out == "", out


def test_verification_catches_mistakes(tmp_path: Path) -> None:
    broken = UNIT.read_text().replace("Type=notify", "Type=notfy").replace("ProtectHome=yes", "ProtectHome=maybe")
    rc, out = verify(installed_copy(tmp_path, broken))
    assert "Failed to parse service type" in out and "protect home" in out  # the check above would fail on these


def test_lifecycle_and_hardening_directives() -> None:
    d = directives(UNIT.read_text())
    assert d["Type"] == ["notify"] and d["Restart"] == ["on-failure"] and d["ExecStart"] == ["/usr/local/bin/hostagent serve"]
    assert "libvirtd.service" in " ".join(d["After"]) and "libvirtd.service" in " ".join(d["Wants"])
    assert re.fullmatch(r"\d+s", d["WatchdogSec"][0])
    for key, value in {"ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
                       "ProtectKernelLogs": "yes", "ProtectKernelModules": "yes", "LockPersonality": "yes",
                       "MemoryDenyWriteExecute": "yes", "SystemCallArchitectures": "native"}.items():
        assert d[key] == [value], key
    assert set(d["RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    rw = d["ReadWritePaths"][0].split()
    assert {"/sys/bus/pci", "/sys/devices", "/var/lib/hostagent", "/run/libvirt"} <= set(rw)
    assert d["ProtectKernelTunables"] == ["no"]  # else /sys is read-only and nothing can be bound
    assert d.get("PrivateDevices", ["no"]) == ["no"]  # /dev/vfio must stay visible


def test_security_exposure_is_low(tmp_path: Path) -> None:
    p = subprocess.run([analyze(), "security", "--offline=yes", str(installed_copy(tmp_path))],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", p.stdout + p.stderr)
    assert m, p.stdout[-2000:] + p.stderr[-2000:]
    assert float(m.group(1)) <= MAX_EXPOSURE, m.group(0)
