"""Lease views encoded once: the JSON of a lease (`lease_view`) kept while the lease does not change, so a listing
of a thousand leases is a join of bytes already made, not a thousand views built and encoded again on the event
loop while other tenants wait.

A lease is immutable (each change is a new object), so a live lease's bytes are reused while the manager holds the
same object and, for a queued one, the same queue position and ETA; an ended lease never changes again, and its
bytes are kept in a bounded LRU by id.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from hostagent.domain.lease import Lease, LeaseState
from hostagent.services.leases import LeaseManager, lease_view

ENDED_KEPT = 4096  # ended leases' encoded views kept (the newest pages of a history)


class LeaseJson:
    """Encoded lease views, reused while the lease is unchanged."""

    def __init__(self, ended_kept: int = ENDED_KEPT) -> None:
        self.ended_kept = ended_kept
        self._live: dict[str, tuple[Lease, Any, bytes]] = {}  # id -> (the lease object, its queue view, bytes)
        self._ended: OrderedDict[str, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def encode(self, lease: Lease, manager: LeaseManager) -> bytes:
        """`lease_view(lease, manager)` as JSON bytes, from the cache when the lease has not changed."""
        if lease.state.terminal:
            hit = self._ended.get(lease.id)
            if hit is not None:
                self._ended.move_to_end(lease.id)
                self.hits += 1
                return hit
            data = _dumps(lease_view(lease, manager))
            self._ended[lease.id] = data
            if len(self._ended) > self.ended_kept:
                self._ended.popitem(last=False)
            self._live.pop(lease.id, None)
            self.misses += 1
            return data
        queue = ((manager.queue_position(lease), manager.eta(lease), manager.queue_notes.get(lease.id))
                 if lease.state is LeaseState.QUEUED else None)
        cached = self._live.get(lease.id)
        if cached is not None and cached[0] is lease and cached[1] == queue:
            self.hits += 1
            return cached[2]
        data = _dumps(lease_view(lease, manager))
        if len(self._live) > 2 * len(manager.leases) + 64:  # leases that ended or left the manager
            self._live = {k: v for k, v in self._live.items() if k in manager.leases}
        self._live[lease.id] = (lease, queue, data)
        self.misses += 1
        return data


def _dumps(body: Any) -> bytes:
    return json.dumps(body).encode()


def listing_body(parts: list[bytes], next_cursor: str | None) -> bytes:
    """`{"leases": [...], "next_cursor": ...}` from encoded views."""
    return b'{"leases": [' + b", ".join(parts) + b'], "next_cursor": ' + _dumps(next_cursor) + b"}"


__all__ = ["ENDED_KEPT", "LeaseJson", "listing_body"]
