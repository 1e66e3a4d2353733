"""Operator subcommands over the API (reaper) and over the store directly (db)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hostagent.domain.errors import InvalidInput


def cmd_reaper_status(args: argparse.Namespace) -> int:
    """Every lease's strike state and next check."""
    from hostagent.cli import _api_error, _api_or_die, _ts, emit, table

    r = _api_or_die(args, "GET", "/v1/reaper")
    if isinstance(r, int):
        return r
    status, body = r
    if status != 200:
        return _api_error(status, body)

    def human(b: dict[str, Any]) -> None:
        print(f"reaper {'on' if b['enabled'] else 'OFF'}: check every {b['check_interval_s']:g} s, "
              f"grace {b['grace_s']:g} s, notice window {b['notice_window_s']:g} s")
        rows = [{"lease": x["lease_id"], "vm": x["domain"], "gpus": ",".join(x["gpus"]), "state": x["state"],
                 "strike": x["strike"] + (" (paused)" if x["paused"] else ""), "recheck": _ts(x["recheck_at"]),
                 "next": _ts(x["next_check"]),
                 "verdict": (x["last_verdict"] or {}).get("reason", "-")} for x in b["leases"]]
        if rows:
            table(rows, [("lease", "LEASE"), ("vm", "VM"), ("gpus", "GPUS"), ("state", "STATE"), ("strike", "STRIKE"),
                         ("recheck", "RECHECK"), ("next", "NEXT CHECK"), ("verdict", "LAST VERDICT")])
        else:
            print("no active leases")

    emit(args, body, human)
    return 0


def cmd_reaper_pause(args: argparse.Namespace) -> int:
    """Pause or resume idle reclaim on one lease."""
    from hostagent.cli import _api_error, _api_or_die, emit

    r = _api_or_die(args, "POST", f"/v1/leases/{args.lease_id}/reclaim", {"paused": args.reaper_command == "pause"})
    if isinstance(r, int):
        return r
    status, body = r
    if status != 200:
        return _api_error(status, body)
    emit(args, body, lambda b: print(f"lease {b['id']}: reclaim {'paused' if b['reclaim']['paused'] else 'resumed'}"))
    return 0


def _store(args: argparse.Namespace) -> Any:
    from hostagent.cli import settings_for
    from hostagent.store.repo import UsageStore

    s = settings_for(args)
    return s, UsageStore(s.store_url, s.agent.host_id, spool_path=s.spool_path, auto_upgrade=False)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Run migrations to head."""
    from hostagent.cli import emit, settings_for
    from hostagent.store.migrate import current_revision, head_revision, upgrade

    s = settings_for(args)
    if s.store_url.startswith("sqlite:///"):
        Path(s.store_url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    before = current_revision(s.store_url)
    upgrade(s.store_url)
    data = {"url": _redact(s.store_url), "from": before, "to": head_revision()}
    emit(args, data, lambda d: print(f"{d['url']}: {d['from'] or 'empty'} -> {d['to']}"))
    return 0


def cmd_db_status(args: argparse.Namespace) -> int:
    """Schema revision, reachability and spool lag."""
    from hostagent.cli import emit
    from hostagent.store.migrate import current_revision, head_revision
    from hostagent.store.spool import Spool

    s, _ = _settings_only(args)
    data: dict[str, Any] = {"url": _redact(s.store_url), "head": head_revision()}
    try:
        data["revision"] = current_revision(s.store_url)
        data["reachable"] = True
    except Exception as exc:  # an unreachable database is a status, not a crash
        data["revision"], data["reachable"], data["error"] = None, False, str(exc).splitlines()[0]
    spool = Spool(s.spool_path) if s.spool_path.exists() else None
    data["spool_depth"] = spool.depth if spool else 0
    data["spool_path"] = str(s.spool_path)
    if spool:
        spool.close()
    data["up_to_date"] = data["revision"] == data["head"]

    def human(d: dict[str, Any]) -> None:
        print(f"store      {d['url']} ({'reachable' if d['reachable'] else 'UNREACHABLE: ' + d.get('error', '')})")
        print(f"revision   {d['revision'] or 'none'} (head {d['head']}{', up to date' if d['up_to_date'] else ', run `hostagent db upgrade`'})")
        print(f"spool      {d['spool_depth']} write(s) waiting in {d['spool_path']}")

    emit(args, data, human)
    return 0 if data["reachable"] and data["up_to_date"] else 1


def _settings_only(args: argparse.Namespace) -> tuple[Any, None]:
    from hostagent.cli import settings_for

    return settings_for(args), None


def _parse_time(text: str | None, field: str) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    import datetime as dt

    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise InvalidInput(f"--{field} must be unix seconds or an ISO date (2026-11-01 or 2026-11-01T12:00)",
                           field=field) from None


def cmd_db_export(args: argparse.Namespace) -> int:
    """CSV of leases or samples for a time range."""
    s, store = _store(args)
    try:
        since = _parse_time(args.since, "since")
        until = _parse_time(args.until, "until")
        out = args.output or sys.stdout
        n = store.export_csv(args.kind, since, until, out)
    finally:
        store.close()
    print(f"exported {n} {args.kind} row(s)", file=sys.stderr)
    return 0


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url


def register(sub: Any, common: Any, client: Any) -> None:
    """Add `reaper` and `db` subcommands."""
    p = sub.add_parser("reaper", help="idle reclaim: strike state of every lease; pause/resume a lease")
    rsub = p.add_subparsers(dest="reaper_command", metavar="ACTION", required=True)
    q = rsub.add_parser("status", help="every lease's strike state and next check")
    client(q)
    q.set_defaults(func=cmd_reaper_status)
    for name in ("pause", "resume"):
        q = rsub.add_parser(name, help=f"{name} idle reclaim on one lease (operator)")
        client(q)
        q.add_argument("lease_id")
        q.set_defaults(func=cmd_reaper_pause)

    p = sub.add_parser("db", help="the usage store: migrations, status, CSV export")
    dsub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    q = dsub.add_parser("upgrade", help="migrate the store's schema to the newest revision")
    common(q, host=False)
    q.add_argument("--db", help="store URL (default from config)")
    q.set_defaults(func=cmd_db_upgrade)
    q = dsub.add_parser("status", help="schema revision, reachability, spool lag")
    common(q, host=False)
    q.add_argument("--db", help="store URL (default from config)")
    q.set_defaults(func=cmd_db_status)
    q = dsub.add_parser("export", help="CSV of leases or samples for a time range")
    common(q, host=False)
    q.add_argument("--db", help="store URL (default from config)")
    from hostagent.store.repo import EXPORT_KINDS

    q.add_argument("kind", choices=EXPORT_KINDS, help="what to export")
    q.add_argument("--since", help="unix seconds or ISO date")
    q.add_argument("--until", help="unix seconds or ISO date")
    q.add_argument("-o", "--output", type=Path, help="file to write (default stdout)")
    q.set_defaults(func=cmd_db_export)

