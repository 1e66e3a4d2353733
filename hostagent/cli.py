"""The `hostagent` command line. Human tables by default, `--json` for machines.

Exit status: 0 success; 1 the operation failed (a FAIL check, a refused request); 2 bad usage or configuration;
3 the agent's API could not be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hostagent import __version__
from hostagent.config import Settings, load_settings
from hostagent.domain.errors import ConfigError, HostAgentError

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


# ---- output --------------------------------------------------------------------------------------------------


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], out: Any = None) -> None:
    """Print rows as an aligned table: columns are (key, header)."""
    out = out or sys.stdout
    cells = [[("" if r.get(k) is None else str(r.get(k))) for k, _ in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(columns)]
    print("  ".join(h.ljust(w) for (_, h), w in zip(columns, widths)).rstrip(), file=out)
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip(), file=out)


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], None]) -> None:
    """JSON when --json, else the human printer."""
    if getattr(args, "json", False):
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        human(data)


def die(message: str, code: int = EXIT_FAIL) -> int:
    """Print an error the way every command does."""
    print(f"hostagent: error: {message}", file=sys.stderr)
    return code


# ---- settings ------------------------------------------------------------------------------------------------


def settings_for(args: argparse.Namespace) -> Settings:
    """Load settings, applying --sysfs-root and other per-command overrides."""
    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "sysfs_root", None):
        overrides.setdefault("host", {})["sysfs_root"] = args.sysfs_root
    if getattr(args, "state_dir", None):
        overrides.setdefault("agent", {})["state_dir"] = str(args.state_dir)
    if getattr(args, "db", None):
        overrides.setdefault("store", {})["url"] = args.db
    if getattr(args, "port", None) is not None:
        overrides.setdefault("agent", {})["port"] = args.port
    if getattr(args, "listen", None):
        overrides.setdefault("agent", {})["listen"] = args.listen
    if getattr(args, "libvirt_uri", None):
        overrides.setdefault("libvirt", {})["uri"] = args.libvirt_uri
    return load_settings(args.config, overrides=overrides)


# ---- commands: host ------------------------------------------------------------------------------------------


def gpu_row(g: Any, state: str | None = None) -> dict[str, Any]:
    """A GPU as a JSON/table row (matches GET /v1/gpus)."""
    return {**g.to_dict(), "state": state or ("free" if g.viable else "unavailable")}


def _gib(n: int | None) -> str:
    return "?" if not n else f"{n / 1024**3:.0f} GiB"


def cmd_gpus(args: argparse.Namespace) -> int:
    """List the GPUs of this host from sysfs."""
    from hostagent.runtime import discover_host

    inv = discover_host(settings_for(args))
    rows = [gpu_row(g) for g in inv.gpus]

    def human(data: dict[str, Any]) -> None:
        rows = data["gpus"]
        if not rows:
            print("no GPUs found (vendors: see host.gpu_vendors; sysfs root: %s)" % settings_for(args).host.sysfs_root)
            return
        table([dict(r, memory=_gib(r["memory_bytes"]), functions_n=len(r["functions"]),
                    drivers=",".join(sorted({f["driver"] or "-" for f in r["functions"]})),
                    viable_s="yes" if r["viable"] else f"no: {r['unviable_reason']}") for r in rows],
              [("id", "ID"), ("address", "ADDRESS"), ("model", "MODEL"), ("memory", "MEMORY"), ("numa_node", "NUMA"),
               ("iommu_group", "GROUP"), ("functions_n", "FUNCS"), ("drivers", "DRIVERS"), ("viable_s", "LEASABLE")])

    emit(args, {"gpus": rows}, human)
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    """Host preflight: one line per check."""
    from hostagent.host.doctor import run_checks
    from hostagent.host.sysfs import open_sysfs
    from hostagent.runtime import discover_host

    settings = settings_for(args)
    inv = discover_host(settings)

    def probe_libvirt() -> str | None:
        if settings.libvirt.uri.startswith("sim://"):
            return None
        from hostagent.virt.libvirt_adapter import probe

        return probe(settings.libvirt.uri)

    checks = run_checks(open_sysfs(settings.host.sysfs_root), settings.proc_root, settings.dev_root, inv,
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


# ---- commands: serve / demo ----------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the agent (systemd starts this)."""
    from hostagent.web.serve import serve

    return serve(settings_for(args))


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the agent on a simulated host and serve until interrupted."""
    from hostagent.demo import run_demo

    return run_demo(args)


# ---- API client commands -------------------------------------------------------------------------------------


def api_call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """Call the local agent's API with the operator token."""
    url = (args.url or os.environ.get("HOSTAGENT_URL") or "http://127.0.0.1:8470").rstrip("/") + path
    token = args.token or os.environ.get("HOSTAGENT_TOKEN")
    if not token and args.token_file:
        token = Path(args.token_file).read_text().strip()
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:  # noqa: S310 - URL is the operator's
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, {"error": {"code": "http_error", "message": exc.reason}}


def _api_or_die(args: argparse.Namespace, method: str, path: str, body: Any = None) -> tuple[int, Any] | int:
    try:
        return api_call(args, method, path, body)
    except (urllib.error.URLError, OSError) as exc:
        return die(f"cannot reach the agent's API ({exc}); is `hostagent serve` running? (--url, HOSTAGENT_URL)",
                   EXIT_UNREACHABLE)


def _api_error(status: int, body: Any) -> int:
    err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
    field = f" (field: {err['field']})" if err.get("field") else ""
    return die(f"{status} {err.get('code', '')}: {err.get('message', body)}{field}")


def lease_rows(leases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flatten lease JSON for a table."""
    return [{"id": x["id"], "state": x["state"], "vm": x["domain"]["name"],
             "gpus": ",".join(d["gpu_id"] for d in x["devices"]) or "-", "task": x["request"]["task_type"],
             "prio": x["request"]["priority"], "expires": _ts(x.get("expires_at")),
             "note": (x["warnings"][0]["code"] if x.get("warnings") else x.get("end_reason") or "")}
            for x in leases]


def _ts(t: float | None) -> str:
    if not t:
        return "-"
    import datetime as dt

    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def cmd_leases(args: argparse.Namespace) -> int:
    """List leases through the API."""
    q = []
    if args.state:
        q.append(f"state={args.state}")
    if args.since is not None:
        q.append(f"since={args.since}")
    r = _api_or_die(args, "GET", "/v1/leases" + ("?" + "&".join(q) if q else ""))
    if isinstance(r, int):
        return r
    status, body = r
    if status != 200:
        return _api_error(status, body)
    emit(args, body, lambda b: table(lease_rows(b["leases"]), [("id", "ID"), ("state", "STATE"), ("vm", "VM"),
         ("gpus", "GPUS"), ("task", "TASK"), ("prio", "PRIO"), ("expires", "EXPIRES"), ("note", "NOTE")]))
    return EXIT_OK


def cmd_release(args: argparse.Namespace) -> int:
    """Release a lease through the API."""
    r = _api_or_die(args, "DELETE", f"/v1/leases/{args.lease_id}")
    if isinstance(r, int):
        return r
    status, body = r
    if status not in (200, 202):
        return _api_error(status, body)
    emit(args, body, lambda b: print(f"lease {b['id']}: {b['state']}"
                                     + (" (detach not acknowledged yet; GPU stays on vfio-pci)" if status == 202 else "")))
    return EXIT_OK


def cmd_gpu_clear(args: argparse.Namespace) -> int:
    """Clear a GPU's quarantine through the API."""
    r = _api_or_die(args, "POST", f"/v1/gpus/{args.gpu_id}/clear-quarantine", {})
    if isinstance(r, int):
        return r
    status, body = r
    if status != 200:
        return _api_error(status, body)
    emit(args, body, lambda b: print(f"{b['id']}: {b['state']}"))
    return EXIT_OK


def cmd_token_issue(args: argparse.Namespace) -> int:
    """Issue a bearer token for one VM (bound to its domain UUID) or for an operator."""
    from hostagent.runtime import open_hypervisor
    from hostagent.store.journal import Journal
    from hostagent.web.auth import hash_token, new_token

    settings = settings_for(args)
    journal = Journal(settings.state_dir / "journal.sqlite3")
    try:
        if args.operator:
            token = new_token("op")
            journal.add_token(hash_token(token), role="operator", domain_uuid=None, domain_name=None)
            data = {"role": "operator", "token": token}
        else:
            if not args.domain:
                return die("name the VM with --domain NAME|UUID (or pass --operator)", EXIT_USAGE)
            hv = open_hypervisor(settings)

            async def lookup() -> Any:
                try:
                    return await hv.get_domain(args.domain)
                finally:
                    await hv.close()

            dom = asyncio.run(lookup())
            token = new_token("vm")
            journal.add_token(hash_token(token), role="guest", domain_uuid=dom.uuid, domain_name=dom.name)
            data = {"role": "guest", "domain": dom.name, "uuid": dom.uuid, "token": token}
    finally:
        journal.close()
    emit(args, data, lambda d: print(d["token"]))
    return EXIT_OK


# ---- parser --------------------------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser, *, host: bool = True) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration (default /etc/hostagent/hostagent.toml)")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    if host:
        p.add_argument("--sysfs-root", metavar="DIR", help="sysfs root to read (default /sys; a fake tree in tests)")


def _client(p: argparse.ArgumentParser) -> None:
    _common(p, host=False)
    p.add_argument("--url", help="agent API base URL (default $HOSTAGENT_URL or http://127.0.0.1:8470)")
    p.add_argument("--token", help="operator bearer token (default $HOSTAGENT_TOKEN)")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the API")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = argparse.ArgumentParser(
        prog="hostagent",
        description="Lease whole GPUs to KVM/libvirt VMs over VFIO passthrough.",
        epilog="Exit status: 0 ok, 1 failed, 2 bad usage or configuration, 3 agent unreachable.",
    )
    parser.add_argument("--version", action="version", version=f"hostagent {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="run the agent (what systemd starts)",
                       description="Run the agent: API, dashboard, reaper, on this host.")
    _common(p)
    p.add_argument("--port", type=int, help="override agent.port")
    p.add_argument("--listen", help="override agent.listen")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="run the agent on a simulated host with GPUs (try it here)",
                       description="Start the agent on a simulated host (fake sysfs, simulated hypervisor, SQLite) "
                                   "and serve the API and dashboard until interrupted.")
    _common(p, host=False)
    p.add_argument("--port", type=int, default=8470, help="port to listen on (0 picks a free one; default 8470)")
    p.add_argument("--listen", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--state-dir", type=Path, help="where to keep state (default: a new temporary directory)")
    p.add_argument("--db", help="usage store URL (default SQLite in the state directory)")
    p.add_argument("--scenario", default="demo16", help="simulated host: demo16, dgx8, workstation (default demo16)")
    p.add_argument("--fast-reclaim", action="store_true",
                   help="idle reclaim in seconds instead of an hour, to watch it happen")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("doctor", help="check that this host can pass GPUs through",
                       description="Host preflight: one line per check, OK/WARN/FAIL with a fix hint. "
                                   "Exit status 0 only when nothing FAILs.")
    _common(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("gpus", help="list this host's GPUs and their IOMMU groups (from sysfs)",
                       description="Discover GPUs from sysfs (read-only) with every function of their IOMMU group.")
    _common(p)
    p.set_defaults(func=cmd_gpus)

    p = sub.add_parser("leases", help="list leases (through the agent's API)")
    _client(p)
    p.add_argument("--state", help="comma-separated states, e.g. ACTIVE,QUEUED")
    p.add_argument("--since", type=float, help="unix seconds")
    p.set_defaults(func=cmd_leases)

    p = sub.add_parser("release", help="end a lease (through the agent's API)")
    _client(p)
    p.add_argument("lease_id")
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("gpu", help="operator actions on one GPU")
    gsub = p.add_subparsers(dest="gpu_command", metavar="ACTION")
    q = gsub.add_parser("clear", help="clear a GPU's quarantine so placement may use it again")
    _client(q)
    q.add_argument("gpu_id")
    q.set_defaults(func=cmd_gpu_clear)

    p = sub.add_parser("token", help="bearer tokens")
    tsub = p.add_subparsers(dest="token_command", metavar="ACTION")
    q = tsub.add_parser("issue", help="issue a token bound to one VM (or an operator token)")
    _common(q, host=False)
    q.add_argument("--domain", help="VM name or UUID the token is bound to")
    q.add_argument("--operator", action="store_true", help="issue an operator token instead")
    q.add_argument("--state-dir", type=Path, help="override agent.state_dir")
    q.set_defaults(func=cmd_token_issue)

    from hostagent import cli_more

    cli_more.register(sub, _common, _client)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hostagent` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["model", "simulate"]:  # the simulator parses its own arguments (argparse cannot forward them)
        from hostagent.learn.simulate import main as simulate

        return simulate(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        return die(f"configuration: {exc.message}", EXIT_USAGE)
    except HostAgentError as exc:
        field = f" (field: {exc.field})" if exc.field else ""
        return die(f"{exc.message}{field}")
    except KeyboardInterrupt:
        return 130
