"""What every command group shares: the exit statuses, output (`table`, `emit`, `die`), settings with per-command
overrides (`settings_for`), the common and API-client options, the agent API client (`api_call`, `api`,
`api_error`), and the mapping of the project's errors to exit statuses (`run`). Group modules import from here and
from the rest of hostagent, never from `hostagent.cli.parser` or from each other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


def fmt_time(t: float | None) -> str:
    """Unix seconds as local time for a table cell; "-" when unset."""
    if not t:
        return "-"
    import datetime as dt

    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


# ---- settings and options ------------------------------------------------------------------------------------


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


def add_common_options(p: argparse.ArgumentParser, *, host: bool = True) -> None:
    """--config and --json on every command; --sysfs-root on those that read this host."""
    p.add_argument("--config", metavar="FILE", help="TOML configuration (default /etc/hostagent/hostagent.toml)")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    if host:
        p.add_argument("--sysfs-root", metavar="DIR", help="sysfs root to read (default /sys; a fake tree in tests)")


def add_client_options(p: argparse.ArgumentParser) -> None:
    """The options of a command that goes through the agent's API."""
    add_common_options(p, host=False)
    p.add_argument("--url", help="agent API base URL (default $HOSTAGENT_URL or http://127.0.0.1:8470)")
    p.add_argument("--token", help="operator bearer token (default $HOSTAGENT_TOKEN)")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the API")


# ---- the agent's API -----------------------------------------------------------------------------------------


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


class CommandExit(Exception):
    """Stop the command with this exit status; the line saying why is already printed (`run` returns `code`)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def api(args: argparse.Namespace, method: str, path: str, body: Any = None, *,
        ok: tuple[int, ...] = (200,)) -> tuple[int, Any]:
    """`api_call` for a command: the status and body of an answer in `ok`. An unreachable agent (exit status 3)
    or any other answer (its error printed in one line; exit status 1) ends the command through `run`."""
    try:
        status, answer = api_call(args, method, path, body)
    except (urllib.error.URLError, OSError) as exc:
        raise CommandExit(die(f"cannot reach the agent's API ({exc}); is `hostagent serve` running? "
                              "(--url, HOSTAGENT_URL)", EXIT_UNREACHABLE)) from None
    if status not in ok:
        raise CommandExit(api_error(status, answer))
    return status, answer


def api_error(status: int, body: Any) -> int:
    """Report an API error answer; exit status 1."""
    err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
    field = f" (field: {err['field']})" if err.get("field") else ""
    return die(f"{status} {err.get('code', '')}: {err.get('message', body)}{field}")


# ---- errors to exit statuses ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; the project's errors become one line and an exit status."""
    try:
        return int(args.func(args) or 0)
    except CommandExit as exc:
        return exc.code
    except ConfigError as exc:
        return die(f"configuration: {exc.message}", EXIT_USAGE)
    except HostAgentError as exc:
        field = f" (field: {exc.field})" if exc.field else ""
        return die(f"{exc.message}{field}")
    except KeyboardInterrupt:
        return 130
