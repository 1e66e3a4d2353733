"""The usage store's public face: :class:`UsageStore`, plain dicts in and out, synchronous on an Engine, spooling
writes during outages; one repository per aggregate, composed here.

Callers on the event loop use :class:`hostagent.store.aio.AsyncUsageStore`, which runs these methods in threads.
``UsageStore`` is the write core (:mod:`hostagent.store.writes`: engine, spool, write path, replay, health) with one
mixin per aggregate on top, each in its own module and each adding the ``_apply_<op>`` of its writes:

- :mod:`~hostagent.store.host_repo`: this host and its GPUs (``gpu_record``);
- :mod:`~hostagent.store.lease_repo`: leases, their devices, the journal's mirror (``outcome_of``), built on
  :mod:`~hostagent.store.event_repo`: lease and reclaim events with their GPUs (``gpu_ids``);
- :mod:`~hostagent.store.probe_repo`: GPU probe results;
- :mod:`~hostagent.store.sample_repo`: usage samples, the rollup thread, the reads over rollups, retention;
- :mod:`~hostagent.store.model_repo`: trained model versions;
- :mod:`~hostagent.store.export`: CSV export (``EXPORT_KINDS``);
- :mod:`~hostagent.store.token_repo`: bearer tokens (``TokenRepo``, ``hash_token``), reached as ``UsageStore.tokens``.

Writes that describe what happened (host, GPUs, leases, events, samples, reclaims, probes) go through
``UsageStore._write``: applied at once when the database answers, else appended to the local spool and replayed in
order, idempotently, by :meth:`UsageStore.replay_spool`. Reads raise ``StoreUnavailable`` during an outage. Tokens
and model versions are not spooled: an operator action fails loudly instead.

Samples are inserted with INSERT IGNORE alone; a background thread then folds them into the rollups past a
per-host watermark (:mod:`hostagent.store.rollup`), overlapping the next insert. Methods that read rollups wait for
it first, as does an empty ``write_samples([])`` (the ingestor's flush), so reads after a write are exact.

Every name callers imported from this module before the split is still importable from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from hostagent.store.event_repo import EventRepo, gpu_ids
from hostagent.store.export import EXPORT_KINDS, ExportRepo
from hostagent.store.host_repo import GPU_COLUMNS, HostRepo, gpu_record
from hostagent.store.lease_repo import LEASE_MUTABLE, REQUEST_FIELDS, TERMINAL_OUTCOMES, LeaseRepo, outcome_of
from hostagent.store.model_repo import ModelRepo
from hostagent.store.probe_repo import ProbeRepo
from hostagent.store.sample_repo import ROLL_AFTER_S, ROLL_EVERY_WRITES, SAMPLE_COLUMNS, SampleRepo
from hostagent.store.sample_repo import _resolution as _resolution  # private, re-exported: the tests import it here
from hostagent.store.samples import MAX_SKEW_S
from hostagent.store.token_repo import TOKEN_ROLES, TokenRepo, hash_token
from hostagent.store.writes import StoreCore, new_uid
from hostagent.store.writes import _refused as _refused  # private, re-exported: the tests import it here

__all__ = [
    "EXPORT_KINDS", "GPU_COLUMNS", "LEASE_MUTABLE", "REQUEST_FIELDS", "ROLL_AFTER_S", "ROLL_EVERY_WRITES",
    "SAMPLE_COLUMNS", "TERMINAL_OUTCOMES", "TOKEN_ROLES", "TokenRepo", "UsageStore", "gpu_ids", "gpu_record",
    "hash_token", "new_uid", "outcome_of",
]


class UsageStore(HostRepo, LeaseRepo, EventRepo, ProbeRepo, SampleRepo, ModelRepo, ExportRepo, StoreCore):
    """Repository over the usage store for one host (``host_id``), with an outage spool."""

    def __init__(self, url: str, host_id: str | None = None, *, spool_path: Path | str, auto_upgrade: bool = True,
                 hostname: str | None = None, agent_version: str | None = None, max_skew_s: float = MAX_SKEW_S,
                 connect_timeout: float = 3.0, io_timeout: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(url, host_id, spool_path=spool_path, auto_upgrade=auto_upgrade, hostname=hostname,
                         agent_version=agent_version, max_skew_s=max_skew_s, connect_timeout=connect_timeout,
                         io_timeout=io_timeout, clock=clock)  # the write core: engine, spool, writer, figures
        self._init_hosts()
        self._init_leases()
        self._init_rollups()
        self._ensure_schema()
        self.upsert_host()
        if not self.degraded:
            self.roll_up()  # rows that a crash left between their insert and their rollup step

    def close(self) -> None:
        """Stop the roller, dispose of the engine and the spool (spooled writes stay on disk for the next start)."""
        self._stop_roller()
        with self._wlock:
            self._writer.close()
        with self._rlock:
            self._roller_conn.close()
        self.engine.dispose()
        self.spool.close()

    @property
    def tokens(self) -> TokenRepo:
        """Bearer tokens (hashed), bound to a domain UUID and a role."""
        return TokenRepo(self)
