"""The bounded sample buffer: samples wait here until a heartbeat carried them; the oldest go first when full."""

from __future__ import annotations

import collections
from typing import Any


class SampleBuffer:
    """FIFO of wire-format samples with a hard bound; drops are counted, never silent."""

    def __init__(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError("max_len must be >= 1")
        self.max_len = max_len
        self._q: collections.deque[dict[str, Any]] = collections.deque()
        self.dropped = 0  # overflowed before a heartbeat could carry them
        self.rejected = 0  # refused by the host as invalid (400)
        self.added = 0

    def __len__(self) -> int:
        return len(self._q)

    def add(self, sample: dict[str, Any]) -> None:
        """Append one sample, dropping the oldest beyond the bound (recent usage matters most to the reaper)."""
        self._q.append(sample)
        self.added += 1
        while len(self._q) > self.max_len:
            self._q.popleft()
            self.dropped += 1

    def peek(self, n: int) -> list[dict[str, Any]]:
        """The oldest n samples, left in place until `commit`."""
        return [self._q[i] for i in range(min(n, len(self._q)))]

    def commit(self, batch: list[dict[str, Any]]) -> None:
        """Remove a batch the host accepted (only those still at the head: drops may have overtaken it)."""
        for s in batch:
            if self._q and self._q[0] is s:
                self._q.popleft()

    def reject(self, sample: dict[str, Any]) -> None:
        """Remove one sample the host refused as invalid, so it cannot block every later heartbeat."""
        for i, s in enumerate(self._q):
            if s is sample:
                del self._q[i]
                self.rejected += 1
                return
