"""Usage samples as values: validation of a heartbeat batch and the rollup deltas of the rows actually inserted."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from hostagent.domain.errors import InvalidInput

RESOLUTIONS = (60, 3600)
IDLE_UTIL_PCT = 5.0  # a sample under this counts as idle in the rollups' idle_n
MAX_SKEW_S = 300.0  # samples from further in the future than this are refused (guest clock gone wrong)
MIN_TS = 946684800.0  # 2000-01-01: anything older is a unit mistake (ms sent as s, or zero)
SOURCES = ("guest", "host", "probe", "import")
_FIELDS = {"gpu_id", "ts", "lease_id", "source", "util_pct", "mem_used_bytes", "work_rate", "vfio_irq_rate"}


class Sample(NamedTuple):
    """One usage observation of one GPU at one instant (immutable and hashable).

    A named tuple rather than a frozen dataclass: heartbeats arrive by the thousand per second, and building a
    frozen dataclass (one ``object.__setattr__`` per field) cost 1.5 µs a sample against 0.4 µs for this, a third of
    what validating a sample costs (``hostagent bench fleet``). Its fields are in ``usage_samples``' column order
    after ``host_id``, so a row is ``(host_id, *sample)``.
    """

    gpu_id: str
    ts_ms: int
    lease_id: str = ""  # '' outside any lease
    source: str = "guest"
    util_pct: float | None = None
    mem_used_bytes: int | None = None
    work_rate: float | None = None
    vfio_irq_rate: float | None = None

    @property
    def key(self) -> tuple[str, int, str, str]:
        """What makes a sample unique for its host (a replay of it is the same row)."""
        return self[:4]  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (also the spool's JSON form)."""
        return {"gpu_id": self.gpu_id, "ts_ms": self.ts_ms, "lease_id": self.lease_id, "source": self.source,
                "util_pct": self.util_pct, "mem_used_bytes": self.mem_used_bytes, "work_rate": self.work_rate,
                "vfio_irq_rate": self.vfio_irq_rate}

    def to_api(self) -> dict[str, Any]:
        """The form callers send and get back: ``ts`` in unix seconds."""
        d = self._asdict()
        d["ts"] = d.pop("ts_ms") / 1000.0
        return d


def validate_samples(raw: Iterable[Mapping[str, Any] | Sample], *, now: float, max_skew_s: float = MAX_SKEW_S,
                     default_lease_id: str = "", default_source: str = "guest") -> list[Sample]:
    """Check a whole batch and return it as Samples (duplicates inside the batch dropped); InvalidInput names the field."""
    out: list[Sample] = []
    seen: set[tuple[str, int, str, str]] = set()
    ts_max = now + max_skew_s
    for i, item in enumerate(raw):
        if isinstance(item, Sample):
            s = item
            _check_sample(s, i, now, max_skew_s)
        else:
            # the slow path below re-checks what the fast one would not take, and names the field that is wrong
            s = _fast(item, ts_max, default_lease_id, default_source) or _one(
                item, i, now, max_skew_s, default_lease_id, default_source)
        key = s[:4]  # Sample.key: (gpu_id, ts_ms, lease_id, source)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _fast(d: Any, ts_max: float, lease: str, source: str) -> Sample | None:
    """The Sample for a well-formed heartbeat sample (plain types, every value in range), else None.

    Heartbeats arrive by the thousand per second and are nearly always well formed: exact type checks and chained
    comparisons (NaN and infinities fail them) accept those several times faster than the general path.
    """
    if type(d) is not dict or not d.keys() <= _FIELDS:
        return None
    g = d.get("gpu_id")
    ts = d.get("ts")
    if type(g) is not str or not 0 < len(g) <= 64 or not g.isprintable():
        return None
    if (type(ts) is not float and type(ts) is not int) or not MIN_TS <= ts <= ts_max:
        return None
    lid = d.get("lease_id")
    if lid is None or lid == "":
        lid = lease
    elif type(lid) is not str or len(lid) > 64 or not lid.isprintable():
        return None
    src = d.get("source", source)
    if type(src) is not str or src not in SOURCES:
        return None
    u = d.get("util_pct")
    m = d.get("mem_used_bytes")
    w = d.get("work_rate")
    q = d.get("vfio_irq_rate")
    if u is not None and ((type(u) is not float and type(u) is not int) or not 0.0 <= u <= 100.0):
        return None
    if m is not None and (type(m) is not int or not 0 <= m <= 2**53):
        return None
    if w is not None and ((type(w) is not float and type(w) is not int) or not 0.0 <= w <= 1e15):
        return None
    if q is not None and ((type(q) is not float and type(q) is not int) or not 0.0 <= q <= 1e12):
        return None
    return Sample(g, int(round(float(ts) * 1000)), lid, src, None if u is None else float(u), m,
                  None if w is None else float(w), None if q is None else float(q))


def _one(d: Mapping[str, Any], i: int, now: float, skew: float, lease: str, source: str) -> Sample:
    where = f"samples[{i}]"
    if not isinstance(d, Mapping):
        raise InvalidInput(f"{where} must be an object", field=where)
    unknown = set(d) - _FIELDS
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidInput(f"{where}.{name} is not a sample field", field=f"{where}.{name}")
    if "gpu_id" not in d:
        raise InvalidInput(f"{where}.gpu_id is required", field=f"{where}.gpu_id")
    if "ts" not in d:
        raise InvalidInput(f"{where}.ts is required", field=f"{where}.ts")
    ts = _number(d["ts"], f"{where}.ts", MIN_TS, now + skew, hint=f"must not be more than {skew:g} s in the future")
    s = Sample(
        gpu_id=_ident(d["gpu_id"], f"{where}.gpu_id"),
        ts_ms=int(round(ts * 1000)),
        lease_id="" if d.get("lease_id") in (None, "") else _ident(d["lease_id"], f"{where}.lease_id"),
        source=_source(d.get("source", source), f"{where}.source"),
        util_pct=_opt(d, "util_pct", where, 0.0, 100.0),
        mem_used_bytes=_opt_int(d, "mem_used_bytes", where, 0, 2**53),
        work_rate=_opt(d, "work_rate", where, 0.0, 1e15),
        vfio_irq_rate=_opt(d, "vfio_irq_rate", where, 0.0, 1e12),
    )
    if not s.lease_id and lease:
        s = s._replace(lease_id=lease)
    return s


def _check_sample(s: Sample, i: int, now: float, skew: float) -> None:
    where = f"samples[{i}]"
    _ident(s.gpu_id, f"{where}.gpu_id")
    _number(s.ts_ms / 1000.0, f"{where}.ts", MIN_TS, now + skew, hint=f"must not be more than {skew:g} s in the future")
    if s.lease_id:
        _ident(s.lease_id, f"{where}.lease_id")
    _source(s.source, f"{where}.source")
    for name, lo, hi in (("util_pct", 0.0, 100.0), ("mem_used_bytes", 0, 2**53), ("work_rate", 0.0, 1e15),
                         ("vfio_irq_rate", 0.0, 1e12)):
        v = getattr(s, name)
        if v is not None:
            _number(v, f"{where}.{name}", lo, hi)


def _ident(v: Any, field: str) -> str:
    if not isinstance(v, str) or not v or len(v) > 64 or not v.isprintable():
        raise InvalidInput(f"{field} must be a printable string of 1..64 characters", field=field)
    return v


def _source(v: Any, field: str) -> str:
    if v not in SOURCES:
        raise InvalidInput(f"{field} must be one of {', '.join(SOURCES)}", field=field)
    return str(v)


def _number(v: Any, field: str, lo: float, hi: float, hint: str | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidInput(f"{field} must be a finite number", field=field)
    if not lo <= v <= hi:
        raise InvalidInput(f"{field} {hint or f'must be between {lo:g} and {hi:g}'}, got {v}", field=field)
    return float(v)


def _opt(d: Mapping[str, Any], name: str, where: str, lo: float, hi: float) -> float | None:
    v = d.get(name)
    return None if v is None else _number(v, f"{where}.{name}", lo, hi)


def _opt_int(d: Mapping[str, Any], name: str, where: str, lo: int, hi: int) -> int | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidInput(f"{where}.{name} must be an integer", field=f"{where}.{name}")
    return int(_number(v, f"{where}.{name}", lo, hi))


def rollup_rows(host_id: str, samples: Sequence[Sample], *, resolutions: Sequence[int] = RESOLUTIONS,
                idle_util_pct: float = IDLE_UTIL_PCT) -> list[dict[str, Any]]:
    """Per-bucket deltas (count, sums, min/max) of freshly inserted samples, ready to add into usage_rollups: the same
    figures as the rollup step's SQL fold makes on the server.

    Each sample is added once, into its bucket of the finest resolution; a coarser resolution that the finest divides
    is summed from those buckets (an hour from its minutes), which halves the work per sample.
    """
    if not samples or not resolutions:
        return []
    fine = min(resolutions)
    # [n, util_n, util_sum, util_min, util_max, idle_n, mem_n, mem_sum, mem_max, work_n, work_sum, irq_n, irq_sum,
    #  first_ms, last_ms] per (gpu, bucket, lease)
    acc: dict[tuple[str, int, str], list[Any]] = {}
    span = fine * 1000
    for s in samples:
        ts = s.ts_ms
        k = (s.gpu_id, (ts - ts % span) // 1000, s.lease_id)
        b = acc.get(k)
        if b is None:
            b = acc[k] = [0, 0, 0.0, None, None, 0, 0, 0.0, None, 0, 0.0, 0, 0.0, ts, ts]
        b[0] += 1
        if ts < b[13]:
            b[13] = ts
        elif ts > b[14]:
            b[14] = ts
        u = s.util_pct
        if u is not None:
            b[1] += 1
            b[2] += u
            if b[3] is None or u < b[3]:
                b[3] = u
            if b[4] is None or u > b[4]:
                b[4] = u
            if u < idle_util_pct:
                b[5] += 1
        m = s.mem_used_bytes
        if m is not None:
            b[6] += 1
            b[7] += m
            if b[8] is None or m > b[8]:
                b[8] = m
        if s.work_rate is not None:
            b[9] += 1
            b[10] += s.work_rate
        if s.vfio_irq_rate is not None:
            b[11] += 1
            b[12] += s.vfio_irq_rate
    out = [_rollup_row(host_id, fine, k, b) for k, b in acc.items()]
    for res in resolutions:
        if res == fine:
            continue
        if res % fine:  # not a whole number of fine buckets: add the samples themselves
            out.extend(rollup_rows(host_id, samples, resolutions=(res,), idle_util_pct=idle_util_pct))
            continue
        coarse: dict[tuple[str, int, str], list[Any]] = {}
        for (gpu, bucket, lease), b in acc.items():
            k = (gpu, bucket - bucket % res, lease)
            c = coarse.get(k)
            if c is None:
                coarse[k] = list(b)
                continue
            for i in (0, 1, 2, 5, 6, 7, 9, 10, 11, 12):
                c[i] += b[i]
            for i, smaller in ((3, True), (4, False), (8, False), (13, True), (14, False)):
                if c[i] is None or (b[i] is not None and (b[i] < c[i] if smaller else b[i] > c[i])):
                    c[i] = b[i]
        out.extend(_rollup_row(host_id, res, k, c) for k, c in coarse.items())
    return out


def _rollup_row(host_id: str, res: int, key: tuple[str, int, str], b: list[Any]) -> dict[str, Any]:
    return {"host_id": host_id, "gpu_id": key[0], "resolution": res, "bucket": key[1], "lease_id": key[2],
            "n": b[0], "util_n": b[1], "util_sum": b[2], "util_min": b[3], "util_max": b[4], "idle_n": b[5],
            "mem_n": b[6], "mem_sum": float(b[7]), "mem_max": b[8], "work_n": b[9], "work_sum": b[10], "irq_n": b[11],
            "irq_sum": b[12], "first_ms": b[13], "last_ms": b[14]}


ROLLUP_ADD = ("n", "util_n", "util_sum", "idle_n", "mem_n", "mem_sum", "work_n", "work_sum", "irq_n", "irq_sum")
ROLLUP_LEAST = ("util_min", "first_ms")
ROLLUP_GREATEST = ("util_max", "mem_max", "last_ms")
ROLLUP_KEYS = ("host_id", "gpu_id", "resolution", "bucket", "lease_id")
