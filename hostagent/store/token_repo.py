"""The bearer tokens: :class:`TokenRepo` issues, looks up and revokes tokens, each bound to a role (and a guest's to a
domain UUID); only their SHA-256 hashes (:func:`hash_token`) are stored, and records leave with a hash prefix only.
Not spooled: an operator's action fails loudly while the store is down. ``UsageStore.tokens`` hands one out."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from sqlalchemy import Connection, Select, and_, insert, or_, select, update

from hostagent.domain.errors import InvalidInput
from hostagent.store import schema as t
from hostagent.store.writes import StoreCore

TOKEN_ROLES = ("guest", "operator", "reader")


def hash_token(token: str) -> str:
    """SHA-256 hex of a bearer token: only this is stored."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenRepo:
    """Issue, look up and revoke bearer tokens; only SHA-256 hashes are stored."""

    def __init__(self, store: StoreCore) -> None:
        self._s = store

    def issue(self, *, role: str, domain_uuid: str | None = None, domain_name: str | None = None,
              expires_at: float | None = None, note: str | None = None) -> tuple[str, dict[str, Any]]:
        """Make a new token; returns (the token, shown once; its record)."""
        token = secrets.token_urlsafe(32)
        return token, self.add_hash(hash_token(token), role=role, domain_uuid=domain_uuid, domain_name=domain_name,
                                    expires_at=expires_at, note=note)

    def add_hash(self, sha256: str, *, role: str, domain_uuid: str | None = None, domain_name: str | None = None,
                 expires_at: float | None = None, note: str | None = None) -> dict[str, Any]:
        """Store a token given by its hash (the caller made the token)."""
        if role not in TOKEN_ROLES:
            raise InvalidInput(f"role must be one of {', '.join(TOKEN_ROLES)}", field="role")
        if role == "guest" and not domain_uuid:
            raise InvalidInput("a guest token must be bound to a domain uuid", field="domain_uuid")
        if len(sha256) != 64 or any(ch not in "0123456789abcdef" for ch in sha256):
            raise InvalidInput("sha256 must be 64 lowercase hex digits", field="sha256")
        row = {"sha256": sha256, "host_id": self._s.host_id, "role": role, "domain_uuid": domain_uuid,
               "domain_name": domain_name, "created_at": self._s._clock(), "expires_at": expires_at,
               "revoked_at": None, "note": note}

        def run(c: Connection) -> None:
            with c.begin():
                c.execute(insert(t.tokens).values(**row))
        self._s._read(run)
        return _public_token(row)

    def lookup(self, token: str) -> dict[str, Any] | None:
        """The live record for a presented token, or None (unknown, revoked or expired)."""
        return self.lookup_hash(hash_token(token))

    def lookup_hash(self, sha256: str) -> dict[str, Any] | None:
        """The live record for a token hash, or None."""
        k = t.tokens.c
        now = self._s._clock()
        q = select(t.tokens).where(k.sha256 == sha256, k.revoked_at.is_(None),
                                   or_(k.expires_at.is_(None), k.expires_at > now))
        row = self._s._read(lambda c: c.execute(q).first())
        return _public_token(dict(row._mapping)) if row else None

    def revoke(self, sha256: str) -> bool:
        """Revoke one token by hash (or by its 12-character prefix as listed); False when none was live."""
        k = t.tokens.c
        cond = k.sha256 == sha256 if len(sha256) == 64 else k.sha256.startswith(sha256, autoescape=True)
        if len(sha256) < 12:
            raise InvalidInput("give the token hash or at least its 12-character prefix", field="sha256")
        return self._revoke(and_(cond, k.revoked_at.is_(None))) > 0

    def revoke_domain(self, domain_uuid: str) -> int:
        """Revoke every live token of a domain; returns how many."""
        k = t.tokens.c
        return self._revoke(and_(k.domain_uuid == domain_uuid, k.revoked_at.is_(None)))

    def _revoke(self, cond: Any) -> int:
        now = self._s._clock()

        def run(c: Connection) -> int:
            with c.begin():
                return int(c.execute(update(t.tokens).where(cond).values(revoked_at=now)).rowcount)
        return self._s._read(run)

    def list(self, *, domain_uuid: str | None = None, include_revoked: bool = False) -> list[dict[str, Any]]:
        """Token records (hash prefix only), oldest first."""
        k = t.tokens.c
        q: Select[Any] = select(t.tokens).order_by(k.created_at)
        if domain_uuid:
            q = q.where(k.domain_uuid == domain_uuid)
        if not include_revoked:
            q = q.where(k.revoked_at.is_(None))
        return self._s._read(lambda c: [_public_token(dict(r._mapping)) for r in c.execute(q)])


def _public_token(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k != "sha256"}
    out["hash_prefix"] = row["sha256"][:12]
    return out
