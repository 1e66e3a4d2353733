"""Bearer-token identities: operators, and guests bound to one domain UUID. Tokens are stored as SHA-256 only."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from hostagent.domain.errors import Forbidden, Unauthorized


def hash_token(token: str) -> str:
    """SHA-256 hex of a token (tokens are long random strings, so a fast hash is the right tool)."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(prefix: str = "ha") -> str:
    """A fresh random bearer token."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling: an operator, or the guest of one domain."""

    role: str  # "operator" | "guest"
    domain_uuid: str | None = None
    domain_name: str | None = None
    subject: str = ""

    @property
    def is_operator(self) -> bool:
        """Operators see and act on everything."""
        return self.role == "operator"

    @property
    def scope(self) -> str | None:
        """Domain UUID a guest is confined to; None for operators."""
        return None if self.is_operator else self.domain_uuid


class TokenBook:
    """Resolves bearer tokens; the operator hash from config plus issued tokens from the journal database."""

    def __init__(self, operator_sha256: str, lookup: Callable[[str], tuple[str, str | None, str | None] | None]) -> None:
        self._operator = operator_sha256.lower()
        self._lookup = lookup

    def resolve(self, token: str) -> Identity | None:
        """Identity for a token, None when unknown.

        The operator's digest is compared with hmac.compare_digest (constant time). Issued tokens are looked up by
        their SHA-256 in an indexed SQL column: the index walk compares digests, not the token, and the attacker
        cannot choose digest bytes one at a time, so the lookup's timing tells nothing about a valid token.
        """
        digest = hash_token(token)
        if self._operator and hmac.compare_digest(digest, self._operator):
            return Identity("operator", subject="operator(config)")
        row = self._lookup(digest)
        if row is None:
            return None
        role, domain_uuid, domain_name = row
        return Identity(role, domain_uuid, domain_name, subject=f"{role}:{domain_name or domain_uuid or ''}")


def bearer(request: web.Request) -> str | None:
    """The bearer token of a request (header) or the session cookie's token (dashboard)."""
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise Unauthorized("Authorization header must be 'Bearer <token>'", field="Authorization")
        return value.strip()
    return None


def require(identity: Identity | None, *, operator: bool = False) -> Identity:
    """Raise 401 without a credential, 403 when an operator is required."""
    if identity is None:
        raise Unauthorized("a bearer token is required (Authorization: Bearer <token>)", field="Authorization")
    if operator and not identity.is_operator:
        raise Forbidden("this endpoint needs the operator credential", field="Authorization")
    return identity
