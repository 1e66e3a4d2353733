"""The trained models' versions (``model_versions``): ``save_model_version`` (the artifact's bytes or a path, with its
evaluation figures), ``activate_model_version`` (one active version per kind), ``list_model_versions`` and
``get_model_version``. Not spooled: written directly under the writer lock, so that an operator's action fails loudly
while the store is down."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import IntegrityError

from hostagent.domain.errors import InvalidInput, NotFound
from hostagent.store import schema as t
from hostagent.store.writes import StoreCore


class ModelRepo(StoreCore):
    """Model versions (a mixin of :class:`hostagent.store.repo.UsageStore`)."""

    def save_model_version(self, version: str, *, kind: str = "placement", artifact: bytes | None = None,
                           artifact_path: str | None = None, metrics: Mapping[str, Any] | None = None,
                           params: Mapping[str, Any] | None = None, trained_on: int | None = None,
                           activate: bool = False, fleet: bool = True, created_at: float | None = None) -> dict[str, Any]:
        """Store a trained model (bytes or a path) with its evaluation figures; optionally make it the active one."""
        if not version or len(version) > 64:
            raise InvalidInput("version must be a string of 1..64 characters", field="version")
        if artifact is None and artifact_path is None:
            raise InvalidInput("a model version needs its artifact bytes or a path", field="artifact")
        row = {"version": version, "kind": kind, "host_id": None if fleet else self.host_id,
               "created_at": self._clock() if created_at is None else created_at, "trained_on": trained_on,
               "metrics": dict(metrics) if metrics else None, "params": dict(params) if params else None,
               "artifact": artifact, "artifact_path": artifact_path,
               "sha256": hashlib.sha256(artifact).hexdigest() if artifact is not None else None, "active": False}

        def run(c: Connection) -> None:
            with c.begin():
                try:
                    c.execute(insert(t.model_versions).values(**row))
                except IntegrityError as exc:
                    raise InvalidInput(f"model version {version} exists already", field="version") from exc
                if activate:
                    self._activate(c, kind, version)
        with self._wlock:
            self._read(run)
        return self.get_model_version(version, with_artifact=False)

    def _activate(self, c: Connection, kind: str, version: str) -> None:
        m = t.model_versions.c
        c.execute(update(t.model_versions).where(m.kind == kind).values(active=False))
        n = c.execute(update(t.model_versions).where(m.kind == kind, m.version == version).values(active=True)).rowcount
        if not n:
            raise NotFound(f"no {kind} model version {version}", field="version")

    def activate_model_version(self, version: str, *, kind: str = "placement") -> None:
        """Make ``version`` the active model of its kind."""
        def run(c: Connection) -> None:
            with c.begin():
                self._activate(c, kind, version)
        with self._wlock:
            self._read(run)

    def list_model_versions(self, *, kind: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Model versions, newest first, without their artifact bytes."""
        m = t.model_versions.c
        q = select(*[col for col in t.model_versions.c if col.name != "artifact"]).order_by(
            m.created_at.desc(), m.id.desc()).limit(limit)
        if kind:
            q = q.where(m.kind == kind)
        return self._read(lambda c: [dict(r._mapping) for r in c.execute(q)])

    def get_model_version(self, version: str | None = None, *, kind: str = "placement",
                          with_artifact: bool = True) -> dict[str, Any]:
        """One model version (by name, or the active one of ``kind`` when None); NotFound when absent."""
        m = t.model_versions.c
        cols = [col for col in t.model_versions.c if with_artifact or col.name != "artifact"]
        q = select(*cols)
        q = q.where(m.version == version) if version else q.where(m.kind == kind, m.active.is_(True))

        def run(c: Connection) -> dict[str, Any]:
            r = c.execute(q).first()
            if r is None:
                raise NotFound(f"no model version {version or '(active ' + kind + ')'}", field="version")
            return dict(r._mapping)
        return self._read(run)
