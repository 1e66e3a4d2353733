"""Dashboard sessions: operator login by credential, server-side sessions, per-session CSRF tokens, and the login
throttle with its device cookies.

The cookie carries only a random session id (HttpOnly, SameSite=Strict, Secure under TLS); the server keeps only
its SHA-256. The credential stays on the server and is resolved again on every request, so revoking or rotating
it ends the session at once. Secrets are compared in constant time (CSRF tokens) or looked up by digest (session
ids), never by a comparison that stops at the first differing byte of the secret. The throttle backs off per source
address and per device without ever refusing a browser that has logged in before because of failures from
elsewhere, and a flood of addresses cannot reset it (see LoginThrottle).
"""

from __future__ import annotations

import base64
import collections
import functools
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostagent.web.auth import Identity

SESSION_COOKIE = "hostagent_session"
LOGIN_COOKIE = "hostagent_login"  # binds the login form's CSRF token to one browser before a session exists
DEVICE_COOKIE = "hostagent_device"  # marks a browser that has logged in before (see LoginThrottle)
DEVICE_COOKIE_MAX_AGE = 400 * 24 * 3600  # the longest lifetime browsers honour
DEVICE_KEY_FILE = "dashboard-device.key"  # under the agent's state_dir
DEVICE_KEY_BYTES = 32
DASHBOARD_ROLES = ("operator", "reader")

log = logging.getLogger("hostagent.dashboard")


def session_key(sid: str) -> str:
    """The store's key for a cookie's session id: its SHA-256. The store never holds the id itself, and looking a
    cookie up hashes it first, so the dict lookup's timing depends on a digest the caller cannot steer byte by byte
    (the id is 256 random bits, so a fast hash is enough)."""
    return hashlib.sha256(sid.encode()).hexdigest()


@dataclass
class Session:
    """One logged-in browser."""

    key: str  # session_key() of the cookie's id
    token: str
    csrf: str
    created: float
    last_seen: float
    flash: list[tuple[str, str]] = field(default_factory=list)  # (level, message) shown on the next page


class SessionBook:
    """In-memory sessions with idle and absolute expiry; bounded so a flood of logins cannot grow it forever."""

    def __init__(self, *, idle_s: float = 8 * 3600, absolute_s: float = 24 * 3600, max_sessions: int = 1000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self.absolute_s = absolute_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: dict[str, Session] = {}
        self._login_key = secrets.token_bytes(32)

    def create(self, token: str) -> tuple[str, Session]:
        """A fresh session and its id for the cookie (a new id on every login: no fixation)."""
        now = self.clock()
        self._expire(now)
        while len(self._sessions) >= self.max_sessions:
            oldest = min(self._sessions.values(), key=lambda s: s.last_seen)
            del self._sessions[oldest.key]
        sid = secrets.token_urlsafe(32)
        s = Session(session_key(sid), token, secrets.token_urlsafe(32), now, now)
        self._sessions[s.key] = s
        return sid, s

    def get(self, sid: str | None) -> Session | None:
        """The live session for a cookie value, touching it; None when unknown or expired."""
        if not sid:
            return None
        s = self._sessions.get(session_key(sid))
        if s is None:
            return None
        now = self.clock()
        if now - s.last_seen > self.idle_s or now - s.created > self.absolute_s:
            del self._sessions[s.key]
            return None
        s.last_seen = now
        return s

    def drop(self, sid: str | None) -> None:
        """Log out the session of a cookie value."""
        if sid:
            self._sessions.pop(session_key(sid), None)

    def end(self, session: Session) -> None:
        """Log a session out (logout, or its credential was revoked)."""
        self._sessions.pop(session.key, None)

    def __len__(self) -> int:
        return len(self._sessions)

    def _expire(self, now: float) -> None:
        dead = [k for k, s in self._sessions.items()
                if now - s.last_seen > self.idle_s or now - s.created > self.absolute_s]
        for k in dead:
            del self._sessions[k]

    # -- login-form CSRF (before a session exists) ---------------------------------------------------------------
    def login_csrf(self, nonce: str) -> str:
        """The login form's hidden token for a browser's login nonce cookie."""
        return hmac.new(self._login_key, nonce.encode(), hashlib.sha256).hexdigest()

    def check_login_csrf(self, nonce: str | None, token: str | None) -> bool:
        """True when the form's token matches this browser's nonce."""
        if not nonce or not token:
            return False
        return hmac.compare_digest(self.login_csrf(nonce), token)


def check_csrf(session: Session, token: str | None) -> bool:
    """Constant-time comparison of a form's CSRF token with the session's."""
    return bool(token) and hmac.compare_digest(session.csrf, str(token))


def dashboard_identity(identity: Identity | None) -> Identity | None:
    """Only operators (and read-only 'reader' tokens) may use the dashboard; guests' tokens may not."""
    if identity is None or identity.role not in DASHBOARD_ROLES:
        return None
    return identity


def source_key(remote: str | None) -> str:
    """The throttle's key for a client address: an IPv4 address as is, an IPv6 address by its /64 (one subscriber
    usually holds a whole /64, so hopping between its addresses must buy no fresh attempts), anything else as
    given."""
    try:
        addr = ipaddress.ip_address(remote or "")
    except ValueError:
        return remote or "?"
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(addr) >> 64 << 64, 64)))
    return str(addr)


def load_device_key(path: Path) -> bytes:
    """The agent's device-cookie key, kept at `path` (32 random bytes, mode 0600) so that device cookies outlive a
    restart; made when missing or malformed. When the file can be neither read nor written the key lives in memory
    only (logged once), and device cookies then last until the agent restarts."""
    try:
        key = path.read_bytes()
        if len(key) == DEVICE_KEY_BYTES:
            return key
        log.warning("%s does not hold a %d-byte key; making a new one", path, DEVICE_KEY_BYTES)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot read the dashboard's device-cookie key %s (%s); device cookies will last until the "
                    "agent restarts", path, exc)
        return secrets.token_bytes(DEVICE_KEY_BYTES)
    key = secrets.token_bytes(DEVICE_KEY_BYTES)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)  # O_EXCL below: the key never lands in a stale file with looser permissions
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot keep the dashboard's device-cookie key at %s (%s); device cookies will last until the "
                    "agent restarts", path, exc)
    return key


@dataclass(frozen=True, slots=True)
class Device:
    """A browser that has logged in here before, as its verified device cookie says."""

    id: str
    subject: str  # the Identity.subject that logged in from it


@dataclass(slots=True)
class _Record:
    """One run of failures: how many, and the wait they imposed (its table orders records by last failure)."""

    failures: int = 0
    until: float = 0.0  # no attempt is checked before this time


class _Table:
    """Failure records by key with exponential backoff: at most `limit` records plus one shared overflow record.

    Records are kept in the order of their last failure. When the table is full, a new key takes the place of the
    record with the oldest last failure that is not waiting; when every record is waiting, the new key's failures go
    to the overflow record instead, and the key is remembered (up to `limit` keys) as sharing that record's wait.
    So churning through keys makes the overflow wait longer; it never frees a waiting record.
    """

    def __init__(self, name: str, *, limit: int, free_failures: int, max_wait_s: float, window_s: float) -> None:
        self.name = name
        self.limit = limit
        self.free_failures = free_failures
        self.max_wait_s = max_wait_s
        self.window_s = window_s
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()
        self._overflow = _Record()
        self._overflowed: collections.OrderedDict[str, None] = collections.OrderedDict()  # keys sharing _overflow
        self._full_until = 0.0  # every record waits at least until then: no room can be made before it

    def __len__(self) -> int:
        return len(self._records) + len(self._overflowed)

    def delay(self, failures: int) -> float:
        """The wait after the `failures`-th failure of a run: none for the free ones, then 1 s, 2 s, 4 s ... capped."""
        extra = failures - self.free_failures
        if extra <= 0:
            return 0.0
        return min(self.max_wait_s, 2.0 ** min(extra - 1, 62))

    def wait(self, key: str, now: float) -> float:
        """Seconds before `key` may try again (0: now)."""
        rec = self._governing(key, now)
        return max(0.0, rec.until - now) if rec is not None else 0.0

    def failed(self, key: str, now: float) -> str | None:
        """Count a failure of `key`. Returns a line for the log when this failure started a wait or made it longer,
        so a waiting key is logged once per backoff step, not once per attempt."""
        rec = self._governing(key, now)
        if rec is None:
            if len(self._records) < self.limit or self._make_room(now):
                rec = self._records[key] = _Record()
            else:
                rec = self._live_overflow(now)
                self._overflowed[key] = None
                if len(self._overflowed) > self.limit:  # the longest-standing key gets one more attempt, then rejoins
                    self._overflowed.popitem(last=False)
        elif rec is not self._overflow:
            self._records.move_to_end(key)
        was_waiting, old_delay = rec.until > now, self.delay(rec.failures)
        rec.failures += 1
        delay = self.delay(rec.failures)
        rec.until = max(rec.until, now + delay)
        if not delay or (was_waiting and delay <= old_delay):
            return None
        who = (f"{self.name} {key}" if rec is not self._overflow
               else f"{self.name} overflow ({len(self._overflowed)} {self.name}s, {len(self._records)} tracked)")
        return f"{who} waits {delay:.0f} s after {rec.failures} failed logins"

    def forget(self, key: str) -> None:
        """Drop `key`'s own record and its share of the overflow (the overflow record itself stays)."""
        self._records.pop(key, None)
        self._overflowed.pop(key, None)
        self._full_until = 0.0

    def _governing(self, key: str, now: float) -> _Record | None:
        """The record that holds `key` back: its own, the overflow it shares, or None. A record quiet for a whole
        window after its wait ran out is forgotten here."""
        rec = self._records.get(key)
        if rec is not None:
            if now < rec.until + self.window_s:
                return rec
            del self._records[key]
            return None
        if key in self._overflowed and self._live_overflow(now).failures:
            return self._overflow
        return None

    def _live_overflow(self, now: float) -> _Record:
        """The overflow record, started afresh (with no keys sharing it) once it has been quiet for a window."""
        if self._overflow.failures and now >= self._overflow.until + self.window_s:
            self._overflow = _Record()
            self._overflowed = collections.OrderedDict()  # they shared only the record just forgotten
        return self._overflow

    def _make_room(self, now: float) -> bool:
        """Evict the record with the oldest last failure that is not waiting; False when every record is waiting."""
        if now < self._full_until:
            return False
        soonest = math.inf
        for key, rec in self._records.items():
            if rec.until <= now:
                del self._records[key]
                return True
            soonest = min(soonest, rec.until)
        # Waits only grow and forget() resets this, so no record stops waiting before `soonest`: until then churn
        # past a table full of waiting records costs O(1) per failure instead of a scan of every record.
        self._full_until = soonest
        return False


class LoginThrottle:
    """Exponential backoff on failed dashboard logins, per source and per device, that never locks the right
    credential out of a browser that has logged in before.

    An attempt without a valid device cookie answers for its source (see source_key): after `free_failures`
    failures each further one doubles the source's wait, up to `max_wait_s`. A device cookie (OWASP's "device
    cookies") is minted on each successful login: a random device id and the subject that logged in, under an HMAC
    with the agent's key. An attempt that carries a valid one answers only for that device's failures and its
    account's (the subject's, so that minting many devices with one credential buys no extra guesses): never for
    its source's nor for the overflow, so failures from elsewhere or from the same address cannot lock it out.
    Each table holds at most `max_sources` records; see _Table for how a full table degrades.
    """

    def __init__(self, *, free_failures: int = 5, max_wait_s: float = 300.0, window_s: float = 300.0,
                 max_sources: int = 10_000, key: bytes | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._key = key or secrets.token_bytes(DEVICE_KEY_BYTES)
        table = functools.partial(_Table, limit=max_sources, free_failures=free_failures, max_wait_s=max_wait_s,
                                  window_s=window_s)
        self._sources = table("source")
        self._devices = table("device")
        self._accounts = table("account")

    def __len__(self) -> int:
        """Keys remembered across the tables (each at most twice `max_sources`: records plus overflow sharers)."""
        return len(self._sources) + len(self._devices) + len(self._accounts)

    def wait(self, source: str, device: Device | None = None) -> float:
        """Seconds before an attempt from `source` (with `device`'s cookie, when valid) may be checked; 0 for now."""
        now = self.clock()
        if device is not None:
            return max(self._devices.wait(device.id, now), self._accounts.wait(device.subject, now))
        return self._sources.wait(source, now)

    def failed(self, source: str, device: Device | None = None) -> None:
        """Count a failed login: against the device and its account when it had a valid cookie, else its source."""
        now = self.clock()
        if device is not None:
            steps = [self._devices.failed(device.id, now), self._accounts.failed(device.subject, now)]
        else:
            steps = [self._sources.failed(source, now)]
        for step in steps:
            if step:
                log.warning("dashboard login throttle: %s", step)

    def succeeded(self, source: str, device: Device | None = None) -> None:
        """Forget the failures of what just logged in: the device's when it had a valid cookie, else the source's.
        The account's record stays (one credential holder must not wipe failures made with the account's other
        devices), and so does the source's after a device login (others behind that address keep their wait)."""
        if device is not None:
            self._devices.forget(device.id)
        else:
            self._sources.forget(source)

    def device(self, cookie: str | None) -> Device | None:
        """The device a cookie names when its HMAC is this agent's; None for a missing, malformed or forged one."""
        if not cookie or not cookie.isascii():
            return None
        device_id, _, rest = cookie.partition(".")
        subject_b64, _, mac = rest.partition(".")
        if not device_id or not hmac.compare_digest(self._mac(device_id, subject_b64).encode(), mac.encode()):
            return None
        subject = base64.urlsafe_b64decode(subject_b64 + "=" * (-len(subject_b64) % 4)).decode()
        return Device(device_id, subject)

    def device_cookie(self, subject: str, device: Device | None = None) -> str:
        """The device cookie for a browser that has just logged in as `subject`: it keeps its device id when its
        cookie already named that subject, and gets a fresh random one otherwise."""
        device_id = device.id if device is not None and device.subject == subject else secrets.token_urlsafe(16)
        subject_b64 = base64.urlsafe_b64encode(subject.encode()).decode().rstrip("=")
        return f"{device_id}.{subject_b64}.{self._mac(device_id, subject_b64)}"

    def _mac(self, device_id: str, subject_b64: str) -> str:
        return hmac.new(self._key, f"{device_id}.{subject_b64}".encode(), hashlib.sha256).hexdigest()


def safe_next(target: Any) -> str:
    """A post-login redirect target: a local dashboard path only (no open redirect)."""
    t = str(target or "")
    if not t.startswith("/") or t.startswith("//") or "\\" in t or any(ord(c) < 32 for c in t):
        return "/"
    return t if t == "/" or t.startswith("/ui/") else "/"


__all__ = ["DEVICE_COOKIE", "DEVICE_COOKIE_MAX_AGE", "DEVICE_KEY_FILE", "LOGIN_COOKIE", "SESSION_COOKIE", "Device",
           "LoginThrottle", "Session", "SessionBook", "check_csrf", "dashboard_identity", "load_device_key",
           "safe_next", "session_key", "source_key"]
