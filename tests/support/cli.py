"""Test support for the command line: run `hostagent ...` in-process (from a test or from a worker thread while an
agent rig serves on the test's event loop) and capture what it prints, and write an agent's settings as the TOML
file a command reads with --config."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from hostagent.cli.parser import main
from hostagent.config import Settings, settings_to_dict


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `hostagent ARGV` through its entry point; return (exit status, stdout, stderr)."""
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


async def acli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`cli` from a worker thread, so that an agent served on this event loop can answer the command."""
    code = await asyncio.to_thread(main, list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _toml_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, (bool, int, float, str)):
        return json.dumps(value)  # JSON's strings, numbers and booleans are TOML's
    raise TypeError(f"no TOML for {value!r}")


def write_toml(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write `{section: {key: value}}` as TOML (scalars and lists; a dict value becomes a [section.key] table,
    None and empty dicts are left out)."""
    lines: list[str] = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        tables = []
        for key, value in values.items():
            if value is None or (isinstance(value, dict) and not value):
                continue
            if isinstance(value, dict):
                tables.append((f"{name}.{key}", value))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        for tname, table in tables:
            lines.append(f"[{tname}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in table.items())
    path.write_text("\n".join(lines) + "\n")
    return path


def settings_toml(path: Path, settings: Settings, **sections: Mapping[str, Any]) -> Path:
    """Every setting of `settings` (an agent rig's, say) as a TOML file, with `sections` laid over it."""
    raw = settings_to_dict(settings)
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return write_toml(path, raw)
