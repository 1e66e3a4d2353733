"""`hostagent doctor`: host preflight, one line per check (OK/WARN/FAIL with a fix hint); exit status 1 when any
check FAILs.
"""

from __future__ import annotations

import argparse
from typing import Any

from hostagent.cli.common import EXIT_FAIL, EXIT_OK, add_common_options, emit, settings_for


def cmd_doctor(args: argparse.Namespace) -> int:
    """Host preflight: one line per check."""
    from hostagent.host.doctor import run_checks
    from hostagent.adapters import discover_host, open_kernel

    settings = settings_for(args)
    inv = discover_host(settings)

    def probe_libvirt() -> str | None:
        if settings.libvirt.uri.startswith("sim://"):
            return None
        from hostagent.virt.libvirt_adapter import probe

        return probe(settings.libvirt.uri)

    checks = run_checks(open_kernel(settings), settings.proc_root, settings.dev_root, inv,
                        probe_libvirt)
    data = [{"name": c.name, "status": c.status, "detail": c.detail, "hint": c.hint} for c in checks]

    def human(data: dict[str, Any]) -> None:
        for r in data["checks"]:
            line = f"{r['status']:<4}  {r['name']}: {r['detail']}"
            if r["status"] != "OK" and r["hint"]:
                line += f"\n      fix: {r['hint']}"
            print(line)

    emit(args, {"checks": data}, human)
    return EXIT_FAIL if any(c.status == "FAIL" for c in checks) else EXIT_OK


def register(sub: Any) -> None:
    """Add `doctor`."""
    p = sub.add_parser("doctor", help="check that this host can pass GPUs through",
                       description="Host preflight: one line per check, OK/WARN/FAIL with a fix hint. "
                                   "Exit status 0 only when nothing FAILs.")
    add_common_options(p)
    p.set_defaults(func=cmd_doctor)
