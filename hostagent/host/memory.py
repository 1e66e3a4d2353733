"""The agent's own memory, split by who holds it: for telling a leak from allocator fragmentation.

A long-running Python service's resident size can creep while every structure it owns is bounded: glibc's malloc
keeps freed chunks inside its arenas, SQLite fills its page caches up to their limits. So the split matters more
than the total: `malloc_in_use` (bytes handed out by malloc: Python's large objects, SQLite, lxml, numpy) and
`python_blocks` (live small objects) grow only with what the agent keeps; `malloc_free` is free memory malloc
still holds; `sqlite` is SQLite's own allocation counter (page caches included).

`limit_arenas()` caps glibc's per-thread arenas: with a dozen worker threads (journal, store, host calls) glibc
would keep up to eight arenas per core, each with its own free chunks; with two, the free memory malloc held
under the load benchmark fell from 7-10 MiB to 2-4 MiB.

Everything here degrades to None where the C library is not glibc or SQLite's counter is not reachable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any


_M_ARENA_MAX = -8  # malloc.h


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """One reading; a field is None where this platform cannot say."""

    rss_bytes: int | None
    malloc_in_use: int | None
    malloc_free: int | None
    sqlite_bytes: int | None
    python_blocks: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"rss_bytes": self.rss_bytes, "malloc_in_use": self.malloc_in_use, "malloc_free": self.malloc_free,
                "sqlite_bytes": self.sqlite_bytes, "python_blocks": self.python_blocks}


@cache
def _libc() -> Any | None:
    """glibc with mallinfo2 (glibc >= 2.33) and mallopt, or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


@cache
def _sqlite() -> Any | None:
    """The SQLite library Python's sqlite3 module uses (the same loaded copy), or None."""
    try:
        import _sqlite3  # noqa: PLC0415 - only to find which library it loaded

        lib = ctypes.CDLL(_sqlite3.__file__)  # its symbols resolve through its own libsqlite3 dependency
        lib.sqlite3_memory_used.restype = ctypes.c_int64
    except (OSError, AttributeError, ImportError):
        return None
    return lib


def limit_arenas(count: int = 2) -> bool:
    """Cap glibc's malloc arenas (mallopt M_ARENA_MAX); call it before worker threads start. False where the C
    library is not glibc or refused (MALLOC_ARENA_MAX in the environment, if set, wins: nothing is changed)."""
    libc = _libc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, count))


def read_rss_bytes(pid: int | str = "self") -> int | None:
    """VmRSS of a process (this one by default); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_memory() -> MemoryUsage:
    """The agent's memory now (cheap: a few C calls and one /proc read)."""
    libc, sq = _libc(), _sqlite()
    info = libc.mallinfo2() if libc is not None else None
    return MemoryUsage(
        rss_bytes=read_rss_bytes(),
        malloc_in_use=(info.uordblks + info.hblkhd) if info is not None else None,
        malloc_free=info.fordblks if info is not None else None,
        sqlite_bytes=int(sq.sqlite3_memory_used()) if sq is not None else None,
        python_blocks=sys.getallocatedblocks(),
    )
