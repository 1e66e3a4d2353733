"""`hostagent db upgrade|status|export|rejected|replay|discard`: the usage store, directly (no agent needed): migrate
its schema to the newest revision, report revision, reachability and spool lag, export leases or samples as CSV, and
see, replay or discard the writes the store refused (set aside in the agent's spool).

Rows are the host's whose spool this is (the agent sharing ``agent.state_dir``), else ``agent.host_id``; ``--host``
names another, ``export --all-hosts`` takes every host of a fleet store.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hostagent.cli.common import add_common_options, emit, fmt_time, settings_for
from hostagent.domain.errors import InvalidInput
from hostagent.store import EXPORT_KINDS


def _store(args: argparse.Namespace) -> Any:
    from hostagent.store.repo import UsageStore

    s = settings_for(args)
    return s, UsageStore(s.store_url, host_of(args, s), spool_path=s.spool_path, auto_upgrade=False)


def host_of(args: argparse.Namespace, settings: Any) -> str:
    """--host, else the host whose writes the agent's spool holds (the agent of this state directory), else
    agent.host_id: the configured host, even where the agent was configured by the demo rather than a file."""
    from hostagent.store.spool import Spool

    if getattr(args, "host", None):
        return str(args.host)
    if settings.spool_path.exists():
        spool = Spool(settings.spool_path)
        try:
            owner = spool.owner()
        finally:
            spool.close()
        if owner:
            return owner
    return str(settings.agent.host_id)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Run migrations to head."""
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
    """CSV of leases or samples for a time range, of this host (or --host, or --all-hosts)."""
    s, store = _store(args)
    hint = ""
    try:
        since = _parse_time(args.since, "since")
        until = _parse_time(args.until, "until")
        out = args.output or sys.stdout
        n = store.export_csv(args.kind, since, until, out, all_hosts=args.all_hosts)
        if n == 0 and not args.all_hosts:
            others = {h: c for h, c in store.host_ids().items() if h != store.host_id}
            if others:
                hint = ("; this store holds leases of " + ", ".join(f"{h} ({c})" for h, c in others.items())
                        + ": name one with --host ID, or use --all-hosts")
    finally:
        store.close()
    whose = "every host" if args.all_hosts else f"host {store.host_id}"
    print(f"exported {n} {args.kind} row(s) of {whose}{hint}", file=sys.stderr)
    return 0


def cmd_db_rejected(args: argparse.Namespace) -> int:
    """The writes the store refused, set aside with its error."""
    _, store = _store(args)
    try:
        items = store.rejected()
    finally:
        store.close()
    if not args.payload:
        items = [{k: v for k, v in x.items() if k != "payload"} for x in items]

    def human(rows: list[dict[str, Any]]) -> None:
        if not rows:
            print("no writes set aside: the store took everything")
            return
        for x in rows:
            print(f"#{x['seq']:<6} {fmt_time(x['ts'])}  {x['op']:<12} {x['rows']:>5} row(s)  {x['error']}")
            if args.payload:
                print(f"        {x['payload']}")
        print(f"{len(rows)} write(s) set aside; fix the cause, then `hostagent db replay`")

    emit(args, items, human)
    return 0


def cmd_db_replay(args: argparse.Namespace) -> int:
    """Write the set-aside writes again (all, or the numbered ones)."""
    _, store = _store(args)
    try:
        result = store.replay_rejected(args.seq or None)
    finally:
        store.close()

    def human(r: dict[str, Any]) -> None:
        print(f"stored {r['stored']} write(s), {r['failed']} refused again, {r['left']} left set aside")
        for e in r["errors"]:
            print(f"  #{e['seq']} {e['op']}: {e['error']}")

    emit(args, result, human)
    return 0 if result["failed"] == 0 else 1


def cmd_db_discard(args: argparse.Namespace) -> int:
    """Forget set-aside writes for good."""
    _, store = _store(args)
    try:
        n = store.discard_rejected(args.seq)
    finally:
        store.close()
    emit(args, {"discarded": n}, lambda d: print(f"discarded {d['discarded']} write(s)"))
    return 0 if n == len(set(args.seq)) else 1


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url


def register(sub: Any) -> None:
    """Add `db upgrade`, `status`, `export`, `rejected`, `replay` and `discard`."""
    p = sub.add_parser("db", help="the usage store: migrations, status, CSV export, refused writes")
    dsub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)

    def action(name: str, help: str, func: Any, *, host: bool = True) -> argparse.ArgumentParser:
        q = dsub.add_parser(name, help=help)
        add_common_options(q, host=False)
        q.add_argument("--db", help="store URL (default from config)")
        q.add_argument("--state-dir", type=Path, help="the agent's state directory (default from config): its "
                       "SQLite store and spool")
        if host:
            q.add_argument("--host", help="host id whose rows these are (default: the agent's of this state "
                           "directory, else agent.host_id)")
        q.set_defaults(func=func)
        return q

    action("upgrade", "migrate the store's schema to the newest revision", cmd_db_upgrade, host=False)
    action("status", "schema revision, reachability, spool lag", cmd_db_status, host=False)
    q = action("export", "CSV of leases or samples for a time range", cmd_db_export)
    q.add_argument("kind", choices=EXPORT_KINDS, help="what to export")
    q.add_argument("--since", help="unix seconds or ISO date")
    q.add_argument("--until", help="unix seconds or ISO date")
    q.add_argument("--all-hosts", action="store_true", help="every host's rows (a fleet store)")
    q.add_argument("-o", "--output", type=Path, help="file to write (default stdout)")
    q = action("rejected", "writes the store refused, set aside with its error", cmd_db_rejected)
    q.add_argument("--payload", action="store_true", help="show what each write holds")
    q = action("replay", "write the set-aside writes again (after fixing the cause)", cmd_db_replay)
    q.add_argument("seq", type=int, nargs="*", help="only these (numbers from `db rejected`)")
    q = action("discard", "forget set-aside writes for good", cmd_db_discard)
    q.add_argument("seq", type=int, nargs="+", help="numbers from `db rejected`")
