"""The dependency rule, enforced: import-linter contracts from pyproject.toml must hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_import_contracts_hold() -> None:
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "importlinter.cli"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "broken" not in r.stdout.lower() or "0 broken" in r.stdout.lower()


def test_domain_does_no_io() -> None:
    banned = ("import asyncio", "import sqlite3", "import libvirt", "import sqlalchemy", "import aiohttp",
              "open(", "import subprocess", "import socket")
    for path in (ROOT / "hostagent" / "domain").glob("*.py"):
        text = path.read_text()
        for b in banned:
            assert b not in text, f"{path.name} uses {b!r}: the domain layer must stay pure"
