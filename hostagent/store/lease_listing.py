"""Sorted, filtered pages of the journal's leases, for the dashboard's leases table and its CSV export.

It owns the SQL of such a listing (filters, sort keys, keyset conditions) and its cursors; the journal runs the
statements (`Journal.sorted_page`, `Journal.count_sorted`, ...). A page is "the `limit` rows after (or before) a
position in the order", never an offset: a position is the sort key's values, then the creation time and rowid of
the row (the journal's own order), so ties break the same way on every page, every row has exactly one place, and
leases journaled while an operator pages (or while an export streams) neither shift nor repeat the rows that were
there. Sort keys that depend on the time (duration, GPU-hours of a live lease) are computed at the cursor's
`as_of`, the time the first page was read, so that the order itself holds still between pages.

Every key is computed in SQL from the lease's columns and document (json_extract), and never NULL: SQLite would
sort NULLs first, and a NULL never equals the cursor's value. The Python mirror of each key is what the dashboard
shows (`lease_start`, `lease_duration`, `gpu_hours` in hostagent.web); the adapter tests hold the two together.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hostagent.domain.errors import InvalidInput
from hostagent.domain.lease import LeaseState

_TERMINAL = ", ".join(f"'{s.value}'" for s in LeaseState if s.terminal)  # enum values: no quoting issues
_GRANTED = "json_extract(doc, '$.granted_at')"
_START = f"COALESCE({_GRANTED}, created_at)"  # lease_start(): when it got its GPUs, or was asked for
# GPUs x hours held: from the grant to the end (to `as_of` while live; a lease that ended without an end time held
# nothing past its grant), the rule the GPU-hours quotas use (domain.admission.gpu_hours), without their window
_HELD_S = f"MAX(0.0, COALESCE(ended_at, CASE WHEN state IN ({_TERMINAL}) THEN {_GRANTED} ELSE :as_of END) - {_GRANTED})"
_GPU_HOURS = f"COALESCE(json_array_length(doc, '$.devices') * {_HELD_S} / 3600.0, 0.0)"

# sort name -> its key's SQL expressions, most significant first (the old table's keys, now in SQL)
SORTS: dict[str, tuple[str, ...]] = {
    "start": (_START,),
    "vm": ("COALESCE(json_extract(doc, '$.domain_name'), '')",),
    "gpus": ("json_array_length(doc, '$.devices')",
             "(SELECT COALESCE(group_concat(json_extract(value, '$.gpu_id'), ','), '')"
             " FROM json_each(doc, '$.devices'))"),
    "task": ("COALESCE(json_extract(doc, '$.request.task_type'), '')",),
    "priority": ("COALESCE(json_extract(doc, '$.request.priority'), 0)",),
    "state": ("state",),
    "duration": (f"MAX(0.0, COALESCE(ended_at, :as_of) - {_START})",),
    "reason": ("COALESCE(json_extract(doc, '$.end_reason'), '')",),
    "project": ("COALESCE(json_extract(doc, '$.request.project'), '')",),
    "gpu_hours": (_GPU_HOURS,),
}
_TIES = (("created_at", False), ("rowid", False))  # ties: newest first in either direction, as the journal lists


@dataclass(frozen=True, slots=True)
class LeaseFilter:
    """Which leases a listing holds. `since`: created, ended or still running at or after it (the journal's rule);
    `vm`: a part of the VM's name or UUID in any case; the rest match exactly."""

    states: tuple[str, ...] | None = None
    since: float | None = None
    vm: str = ""
    gpu: str = ""
    task: str = ""
    project: str = ""


@dataclass(frozen=True, slots=True)
class Position:
    """A row's place in a sorted listing: its sort key's values, then its creation time and rowid."""

    keys: tuple[Any, ...]
    created_at: float
    rowid: int

    def values(self) -> tuple[Any, ...]:
        """Every value the order compares, most significant first."""
        return (*self.keys, self.created_at, self.rowid)


@dataclass(frozen=True, slots=True)
class Order:
    """A listing's order: a sort name of SORTS (or another the caller sorts itself), its direction, and the time
    the keys that depend on it are computed at."""

    sort: str
    desc: bool
    as_of: float


def encode_cursor(order: Order, position: Position) -> str:
    """The opaque cursor of a position: URL-safe base64 (unpadded) of JSON naming the order it belongs to (a
    cursor of another sort means nothing here), the time its keys were computed at, and the position. Floats are
    written as repr writes them, so they come back bit for bit."""
    raw = json.dumps([order.sort, "desc" if order.desc else "asc", order.as_of, list(position.keys),
                      position.created_at, position.rowid], separators=(",", ":"), ensure_ascii=False)
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, sort: str, desc: bool, *, field: str = "cursor") -> tuple[float, Position]:
    """(as_of, position) of a cursor `encode_cursor` wrote for this sort and direction; InvalidInput otherwise."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        name, direction, as_of, keys, created_at, rowid = json.loads(raw)
        ok = (isinstance(keys, list) and all(_plain(k) for k in keys) and _number(as_of) and _number(created_at)
              and _number(rowid) and isinstance(rowid, int))
    except (ValueError, TypeError):  # bad base64 or UTF-8 or JSON, or not six items
        ok = False
    if not ok:
        raise InvalidInput(f"{field} is not one this page issued", field=field)
    if (name, direction) != (sort, "desc" if desc else "asc"):
        raise InvalidInput(f"{field} belongs to another sort order; start again from the first page", field=field)
    position = Position(tuple(keys), float(created_at), rowid)
    if encode_cursor(Order(sort, desc, as_of), position) != cursor:
        raise InvalidInput(f"{field} is not one this page issued", field=field)
    return float(as_of), position


def sqlite_integer(value: int) -> bool:
    """Whether SQLite can bind the int (a signed 64-bit INTEGER; a larger one raises OverflowError)."""
    return -2**63 <= value < 2**63


def _number(value: Any) -> bool:
    """A finite float, or an int SQLite can bind; never a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return sqlite_integer(value) if isinstance(value, int) else math.isfinite(value)


def _plain(value: Any) -> bool:
    """A key value a cursor may hold: text or a finite number (never a bool, None or a container)."""
    return isinstance(value, str) or _number(value)


class _Params(dict[str, Any]):
    """Named parameters of one statement, numbered as they are added."""

    def add(self, value: Any) -> str:
        name = f"p{len(self)}"
        self[name] = value
        return ":" + name


def _where(f: LeaseFilter, params: _Params) -> str:
    """The filter's SQL condition."""
    parts = ["1=1"]
    if f.states is not None:
        parts.append(f"state IN ({', '.join(params.add(s) for s in f.states) or 'NULL'})")
    if f.since is not None:
        p = params.add(f.since)
        parts.append(f"(created_at >= {p} OR ended_at IS NULL OR ended_at >= {p})")
    if f.vm:
        p = params.add(f.vm.lower())  # py_lower: Python's str.lower, registered by the journal (SQLite's is ASCII)
        parts.append(f"(instr(py_lower(json_extract(doc, '$.domain_name')), {p}) > 0"
                     f" OR instr(py_lower(domain_uuid), {p}) > 0)")
    if f.gpu:
        parts.append(f"id IN (SELECT lease_id FROM lease_gpus WHERE gpu_id = {params.add(f.gpu)})")
    if f.task:
        parts.append(f"json_extract(doc, '$.request.task_type') = {params.add(f.task)}")
    if f.project:
        parts.append(f"json_extract(doc, '$.request.project') = {params.add(f.project)}")
    return " AND ".join(parts)


def _terms(order: Order, *, backwards: bool) -> list[tuple[str, bool]]:
    """(expression, ascending) of every term of the order, each flipped when reading backwards."""
    terms = [(expr, not order.desc) for expr in SORTS[order.sort]] + list(_TIES)
    return [(expr, asc != backwards) for expr, asc in terms]


def _beyond(terms: Sequence[tuple[str, bool]], position: Position, params: _Params) -> str:
    """SQL true for the rows strictly after `position` in the order of `terms` (lexicographic)."""
    names = [params.add(v) for v in position.values()]
    alternatives = []
    for i, (expr, asc) in enumerate(terms):
        same = [f"{terms[j][0]} = {names[j]}" for j in range(i)]
        alternatives.append("(" + " AND ".join([*same, f"{expr} {'>' if asc else '<'} {names[i]}"]) + ")")
    return "(" + " OR ".join(alternatives) + ")"


def page_sql(f: LeaseFilter, order: Order, *, limit: int, after: Position | None = None,
             before: Position | None = None, from_end: bool = False) -> tuple[str, dict[str, Any]]:
    """A page of `limit` rows: the first ones, those after `after`, or (read backwards, so in reverse order) those
    just before `before` or the last ones (`from_end`). Columns: doc, id, state, created_at, rowid, then the keys."""
    params = _Params(as_of=order.as_of)
    backwards = before is not None or from_end
    terms = _terms(order, backwards=backwards)
    where = _where(f, params)
    position = before if backwards else after
    if position is not None:
        where += " AND " + _beyond(terms, position, params)
    keys = SORTS[order.sort]
    sql = (f"SELECT doc, id, state, created_at, rowid, {', '.join(keys)} FROM leases WHERE {where}"
           f" ORDER BY {', '.join(e + (' ASC' if asc else ' DESC') for e, asc in terms)}"
           f" LIMIT {params.add(max(0, limit))}")
    return sql, params


def count_sql(f: LeaseFilter, order: Order | None = None, position: Position | None = None
              ) -> tuple[str, dict[str, Any]]:
    """How many rows match, and how many of them come before `position` in `order` (0 without one)."""
    params = _Params(as_of=order.as_of if order is not None else 0.0)
    where = _where(f, params)
    ahead = "0"
    if order is not None and position is not None:
        ahead = f"total(CASE WHEN {_beyond(_terms(order, backwards=True), position, params)} THEN 1 ELSE 0 END)"
    return f"SELECT count(*), {ahead} FROM leases WHERE {where}", params


def positions_sql(f: LeaseFilter) -> tuple[str, dict[str, Any]]:
    """Every matching row's (id, created_at, rowid), for an order the caller computes itself (usage from the
    store): ids and numbers, no documents."""
    params = _Params()
    return f"SELECT id, created_at, rowid FROM leases WHERE {_where(f, params)}", params


LABELS_SQL = ("SELECT DISTINCT json_extract(doc, '$.request.task_type'), json_extract(doc, '$.request.project')"
              " FROM leases")


__all__ = ["LABELS_SQL", "SORTS", "LeaseFilter", "Order", "Position", "count_sql", "decode_cursor", "encode_cursor",
           "page_sql", "positions_sql", "sqlite_integer"]
