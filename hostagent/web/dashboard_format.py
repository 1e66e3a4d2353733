"""Dashboard text formatting: the Jinja filters the templates use (`time`, `dur`, `gib`, `pct`, `iso`) as plain
functions. It owns how a timestamp, a duration, a byte count or a percentage reads on a page: ISO-8601 UTC for
machines, a <time> element with UTC fallback text (dashboard.js rewrites it in the viewer's time zone), '3d 4h',
'80 GiB', '42%', and '—' for nothing. Pure functions with no request or runtime in sight, so the CSV export and
the tests can use them too.
"""

from __future__ import annotations

import datetime as dt

from markupsafe import Markup


def iso(ts: float | None) -> str:
    """ISO-8601 UTC for a <time datetime=...>."""
    if ts is None:
        return ""
    return dt.datetime.fromtimestamp(float(ts), dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def time_tag(ts: float | None, style: str = "datetime") -> Markup:
    """A <time> element with UTC fallback text; dashboard.js rewrites it in the viewer's time zone."""
    if ts is None:
        return Markup('<span class="muted">—</span>')
    d = dt.datetime.fromtimestamp(float(ts), dt.UTC)
    text = {"time": "%H:%M:%S UTC", "hm": "%H:%M UTC"}.get(style, "%Y-%m-%d %H:%M UTC")
    text = d.strftime(text)
    return Markup('<time datetime="{}" data-style="{}">{}</time>').format(iso(ts), style, text)


def duration(seconds: float | None) -> str:
    """'3d 4h', '2h 05m', '4m 10s', '12s'."""
    if seconds is None:
        return "—"
    s = int(max(0, seconds))
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {sec:02d}s"
    return f"{sec}s"


def gib(nbytes: float | None) -> str:
    """Bytes as GiB ('80 GiB', '11.5 GiB')."""
    if not nbytes:
        return "—"
    v = float(nbytes) / 1024**3
    return f"{v:.0f} GiB" if v >= 20 or v.is_integer() else f"{v:.1f} GiB"


def pct(value: float | None) -> str:
    """'42%' or '—'."""
    return "—" if value is None else f"{value:.0f}%"


__all__ = ["duration", "gib", "iso", "pct", "time_tag"]
