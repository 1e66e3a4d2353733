"""scripts/install.sh into a temporary root (--root DIR --no-apt --no-systemctl), twice: the second run changes
nothing, the config is never overwritten, the kernel parameters are printed for the CPU vendor."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install.sh"

pytestmark = pytest.mark.timeout(600)


def source_copy(tmp: Path) -> Path:
    """A frozen copy of the checkout (other work may edit the tree while this test runs)."""
    dst = tmp / "src"
    if not dst.exists():
        shutil.copytree(ROOT, dst, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "artifacts", "state", "__pycache__", "*.egg-info", "build", "tests", ".pytest_cache",
            ".mypy_cache", ".hypothesis", ".cache", ".whl", ".gl"))
    return dst


def lent_env(**extra: str) -> dict[str, str]:
    """This test environment's packages for the installed venv.

    --offline installs nothing but hostagent itself; everything else (setuptools and wheel to build it, aiohttp
    and the rest to run it) must already be importable. A venv made with --system-site-packages from inside this
    test venv sees the base interpreter's site-packages, not the test venv's, so they are lent through
    PYTHONPATH (which, unlike a site dir, does not read .pth files: the test venv's editable hostagent stays out).
    """
    site = sysconfig.get_paths()
    path = os.pathsep.join(dict.fromkeys((site["purelib"], site["platlib"])))
    return dict(os.environ, PYTHONPATH=path, **extra)


def run(root: Path, tmp: Path, vendor: str = "GenuineIntel", cmdline: str = "BOOT_IMAGE=/vmlinuz ro quiet"
        ) -> subprocess.CompletedProcess[str]:
    cpu = tmp / f"cpuinfo-{vendor}"
    cpu.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\n")
    cmd = tmp / "cmdline"
    cmd.write_text(cmdline + "\n")
    env = lent_env(HOSTAGENT_CPUINFO=str(cpu), HOSTAGENT_CMDLINE=str(cmd), PYTHON=sys.executable)
    script = source_copy(tmp) / "scripts" / "install.sh"
    p = subprocess.run(["bash", str(script), "--root", str(root), "--no-apt", "--no-systemctl",
                        "--system-site-packages", "--offline"], capture_output=True, text=True, env=env, timeout=500)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def snapshot(root: Path) -> dict[str, str]:
    """Every file (content hash) and link (target) under root, except the venv's bytecode caches."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if "__pycache__" in rel:
            continue
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_install_into_a_root_twice(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first = run(root, tmp_path)
    link = root / "usr/local/bin/hostagent"
    assert os.readlink(link) == "/opt/hostagent/bin/hostagent"  # the final path, as on the real machine
    exe = root / "opt/hostagent/bin/hostagent"
    help_ = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60, env=lent_env())
    assert help_.returncode == 0 and "serve" in help_.stdout
    unit = root / "etc/systemd/system/hostagent.service"
    assert unit.read_text() == (ROOT / "systemd/hostagent.service").read_text()
    assert (root / "etc/modules-load.d/hostagent-vfio.conf").read_text().split("\n")[1:3] == ["vfio-pci", "vfio_iommu_type1"]
    conf = root / "etc/hostagent/hostagent.toml"
    token = (root / "etc/hostagent/operator.token").read_text().strip()
    assert f'operator_token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"' in conf.read_text()
    assert (root / "etc/hostagent/operator.token").stat().st_mode & 0o077 == 0
    assert (root / "var/lib/hostagent").stat().st_mode & 0o777 == 0o700
    assert "kernel parameters still needed: intel_iommu=on iommu=pt" in first.stdout
    # the installed package finds its dashboard templates and static files (package data, not the checkout)
    check = subprocess.run([str(root / "opt/hostagent/bin/python"), "-c",
                            "import hostagent.web.dashboard as d; print(d.TEMPLATES); "
                            "assert (d.TEMPLATES / 'overview.html').is_file() and (d.STATIC / 'uPlot.iife.min.js').is_file()"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path, env=lent_env())
    assert check.returncode == 0 and str(root) in check.stdout, check.stdout + check.stderr

    conf.write_text(conf.read_text() + "\n# edited by the operator\n")
    before = snapshot(root)
    second = run(root, tmp_path, vendor="AuthenticAMD", cmdline="ro amd_iommu=on iommu=pt")
    assert snapshot(root) == before  # nothing changed, the operator's edit kept
    assert "package up to date" in second.stdout and "kept existing /etc/hostagent/hostagent.toml" in second.stdout
    assert "unchanged /etc/systemd/system/hostagent.service" in second.stdout
    assert "kernel parameters already set: amd_iommu=on iommu=pt" in second.stdout


def test_install_refuses_unknown_options(tmp_path: Path) -> None:
    p = subprocess.run(["bash", str(SCRIPT), "--root", str(tmp_path), "--bogus"], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2 and "unknown option --bogus" in p.stderr
