"""Guest agent settings: defaults < /etc/hostagent/guest.toml < environment < command line."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hostagent.guest.errors import GuestConfigError

DEFAULT_CONFIG = "/etc/hostagent/guest.toml"
ENV_URL = "HOSTAGENT_URL"
ENV_TOKEN_FILE = "HOSTAGENT_TOKEN_FILE"
ENV_CONFIG = "HOSTAGENT_GUEST_CONFIG"


@dataclass(frozen=True, slots=True)
class GuestConfig:
    """Everything the guest agent is told; see docs/guest.md for each key."""

    url: str = ""
    token_file: str = "/etc/hostagent/guest.token"
    ca_file: str | None = None  # CA bundle for an https URL with a private CA
    insecure: bool = False  # skip TLS verification (never in production)
    request_timeout_s: float = 10.0
    retries: int = 4  # per request, on connection errors and 502/503/504
    backoff_max_s: float = 30.0
    sample_interval_s: float = 5.0
    heartbeat_interval_s: float = 30.0
    batch_max: int = 1000  # the API takes at most 1000 samples per heartbeat
    buffer_max: int = 20000  # samples kept while the host is unreachable; the oldest go first beyond it
    work_rate: str | None = None  # a file path, or unix:/path for a datagram socket, where the job reports throughput
    on_warning: str | None = None  # shell command run on an idle strike-one warning
    on_reclaim: str | None = None  # shell command run before a cooperative release (e.g. checkpoint)
    on_move: str | None = None  # shell command run when the host attached a new GPU to move to (then confirmed)
    hook_timeout_s: float = 300.0
    stop_gpu_users: bool = False  # on reclaim, SIGTERM (then SIGKILL) the processes using the leased GPUs
    stop_grace_s: float = 10.0
    sys_root: str = "/sys"
    state_dir: str = "/run/hostagent-guest"  # pid files of `run` (the daemon leaves those leases alone)

    def token(self) -> str:
        """The per-VM bearer token from token_file."""
        path = Path(self.token_file)
        try:
            token = path.read_text().strip()
        except FileNotFoundError:
            raise GuestConfigError(f"token file {path} does not exist; pass --token-file or set {ENV_TOKEN_FILE}") from None
        except OSError as exc:
            raise GuestConfigError(f"cannot read token file {path}: {exc.strerror}") from None
        if not token:
            raise GuestConfigError(f"token file {path} is empty")
        return token


_KEYS = {f.name: f for f in fields(GuestConfig)}


def _coerce(name: str, value: Any) -> Any:
    """Check a config-file value against the field's type (TOML gives ints where floats are meant)."""
    default = _KEYS[name].default
    kind = type(default) if default is not None else str
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GuestConfigError(f"{name} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def load_config(path: str | None = None, *, env: dict[str, str] | None = None, **overrides: Any) -> GuestConfig:
    """Merge the config file (missing is fine unless named explicitly), environment and non-None overrides."""
    env = dict(os.environ) if env is None else env
    explicit = path is not None or ENV_CONFIG in env
    cfg_path = Path(path or env.get(ENV_CONFIG) or DEFAULT_CONFIG)
    values: dict[str, Any] = {}
    if cfg_path.exists() or explicit:
        try:
            raw = tomllib.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise GuestConfigError(f"config file {cfg_path} does not exist") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise GuestConfigError(f"cannot read config file {cfg_path}: {exc}") from None
        raw = raw.get("guest", raw)  # accept both a [guest] table and top-level keys
        for key, value in raw.items():
            if key not in _KEYS:
                raise GuestConfigError(f"{cfg_path}: unknown key {key!r} (known: {', '.join(sorted(_KEYS))})")
            values[key] = _coerce(key, value)
    if env.get(ENV_URL):
        values["url"] = env[ENV_URL]
    if env.get(ENV_TOKEN_FILE):
        values["token_file"] = env[ENV_TOKEN_FILE]
    for key, value in overrides.items():
        if key not in _KEYS:
            raise GuestConfigError(f"unknown setting {key!r}")
        if value is not None:
            values[key] = value
    cfg = GuestConfig(**values)
    return validate(cfg)


def validate(cfg: GuestConfig) -> GuestConfig:
    """Reject settings that cannot work, naming the key."""
    if cfg.url and not cfg.url.startswith(("http://", "https://")):
        raise GuestConfigError(f"url must start with http:// or https://, not {cfg.url!r}")
    if not 1 <= cfg.batch_max <= 1000:
        raise GuestConfigError("batch_max must be 1..1000 (the API's limit per heartbeat)")
    if cfg.buffer_max < cfg.batch_max:
        raise GuestConfigError("buffer_max must be at least batch_max")
    for key in ("sample_interval_s", "heartbeat_interval_s", "request_timeout_s"):
        if getattr(cfg, key) <= 0:
            raise GuestConfigError(f"{key} must be positive")
    if cfg.retries < 0:
        raise GuestConfigError("retries must be >= 0")
    return cfg


def require_url(cfg: GuestConfig) -> str:
    """The host agent's URL, or a clear error saying how to give it."""
    if not cfg.url:
        raise GuestConfigError(f"no host agent URL: pass --url, set {ENV_URL}, or put url = \"...\" in {DEFAULT_CONFIG}")
    return cfg.url.rstrip("/")

