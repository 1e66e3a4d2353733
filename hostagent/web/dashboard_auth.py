"""Dashboard sessions: operator login by credential, server-side sessions, per-session CSRF tokens, login throttling.

The cookie carries only a random session id (HttpOnly, SameSite=Strict, Secure under TLS); the server keeps only
its SHA-256. The credential stays on the server and is resolved again on every request, so revoking or rotating
it ends the session at once. Secrets are compared in constant time (CSRF tokens) or looked up by digest (session
ids), never by a comparison that stops at the first differing byte of the secret.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hostagent.web.auth import Identity

SESSION_COOKIE = "hostagent_session"
LOGIN_COOKIE = "hostagent_login"  # binds the login form's CSRF token to one browser before a session exists
DASHBOARD_ROLES = ("operator", "reader")


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


class LoginThrottle:
    """At most `limit` failed logins per client address in a sliding window."""

    def __init__(self, *, limit: int = 10, window_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window_s = window_s
        self.clock = clock
        self._fails: dict[str, collections.deque[float]] = {}

    def blocked(self, who: str) -> float:
        """Seconds until `who` may try again (0 when allowed)."""
        q = self._fails.get(who)
        if not q:
            return 0.0
        now = self.clock()
        while q and now - q[0] > self.window_s:
            q.popleft()
        if len(q) < self.limit:
            return 0.0
        return max(1.0, self.window_s - (now - q[0]))

    def failed(self, who: str) -> None:
        """Record a failed attempt."""
        if len(self._fails) > 10_000:  # bounded memory under a spray of addresses
            self._fails.clear()
        self._fails.setdefault(who, collections.deque(maxlen=self.limit * 2)).append(self.clock())

    def succeeded(self, who: str) -> None:
        """Forget the failures of a client that logged in."""
        self._fails.pop(who, None)


def safe_next(target: Any) -> str:
    """A post-login redirect target: a local dashboard path only (no open redirect)."""
    t = str(target or "")
    if not t.startswith("/") or t.startswith("//") or "\\" in t or any(ord(c) < 32 for c in t):
        return "/"
    return t if t == "/" or t.startswith("/ui/") else "/"


__all__ = ["LOGIN_COOKIE", "SESSION_COOKIE", "LoginThrottle", "Session", "SessionBook", "check_csrf",
           "dashboard_identity", "safe_next", "session_key"]
