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


def test_the_root_satisfies_what_the_web_layer_asks_of_it() -> None:
    """web.ports.AgentServices is the whole of what the web layer may use of the running agent; the composition root
    must provide every member, with a coroutine where the protocol names one."""
    import inspect
    from dataclasses import fields

    from hostagent.runtime import Runtime
    from hostagent.web.ports import AgentServices

    attrs = {f.name for f in fields(Runtime)}
    wanted = set(AgentServices.__annotations__)
    assert wanted <= attrs, f"Runtime lacks {sorted(wanted - attrs)}"
    methods = {n for n, v in vars(AgentServices).items() if inspect.isfunction(v)}
    assert methods, "the protocol names the operations the web layer calls"
    for name in methods:
        impl = getattr(Runtime, name, None)
        assert callable(impl), f"Runtime lacks {name}()"
        wants_coroutine = inspect.iscoroutinefunction(getattr(AgentServices, name))
        assert inspect.iscoroutinefunction(impl) == wants_coroutine, name


def test_the_web_layer_never_names_the_composition_root() -> None:
    import re

    imports_root = re.compile(r"^\s*(from\s+hostagent\.runtime\s+import|import\s+hostagent\.runtime\b|from\s+hostagent\s+import\s+runtime\b)", re.M)
    for path in (ROOT / "hostagent" / "web").glob("*.py"):
        assert not imports_root.search(path.read_text()), f"{path.name} imports the composition root"
