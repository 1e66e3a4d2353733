"""The agent's memory split: each part is read from where it lives, and moves when that holder grows."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys


from hostagent.host import memory


def test_each_part_is_read() -> None:
    m = memory.read_memory()
    assert m.rss_bytes is not None and m.rss_bytes > 1 << 20
    assert m.malloc_in_use is not None and m.malloc_in_use > 0  # glibc on every machine this runs on
    assert m.malloc_free is not None and m.malloc_free >= 0
    assert m.sqlite_bytes is not None and m.python_blocks > 0
    assert set(m.to_dict()) == {"rss_bytes", "malloc_in_use", "malloc_free", "sqlite_bytes", "python_blocks"}


def test_sqlite_counter_is_the_library_python_uses() -> None:
    before = memory.read_memory().sqlite_bytes
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t(x TEXT)")
    db.executemany("INSERT INTO t VALUES(?)", [("x" * 200,) for _ in range(5000)])
    grown = memory.read_memory().sqlite_bytes
    db.close()
    after = memory.read_memory().sqlite_bytes
    assert before is not None and grown is not None and after is not None
    assert grown - before > 500_000  # ~1 MB of rows in its page cache
    assert grown - after > 500_000  # and given back on close


def test_malloc_in_use_follows_allocations() -> None:
    before = memory.read_memory().malloc_in_use
    block = bytearray(8 << 20)  # beyond pymalloc: a malloc (mmap) allocation
    during = memory.read_memory().malloc_in_use
    del block
    assert before is not None and during is not None
    assert during - before >= 8 << 20


def test_limit_arenas_is_glibc_mallopt_and_the_environment_wins() -> None:
    code = "from hostagent.host.memory import limit_arenas; print(limit_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "MALLOC_ARENA_MAX": "4"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
