"""Dashboard text formatting: the Jinja filters the templates use (`time`, `dur`, `gib`, `pct`, `iso`, `countdown`)
as plain functions, and the freshness of a figure or of a guest's heartbeats. It owns how a timestamp, a duration,
a byte count, a percentage or a deadline reads on a page: ISO-8601 UTC for machines; one human format everywhere,
`2024-05-01 14:03:07 UTC` (24-hour, to the second, the zone in the text; dashboard.js rewrites it in the same shape
in the viewer's zone, e.g. `2024-05-01 10:03:07 EDT`); '3d 4h', '80 GiB', '42%', '—' for nothing; 'in 4m 10s' /
'4m 10s overdue' for a deadline; '12s ago' for an age, with 'stale' past `dashboard.stale_after_s`. dashboard.js
mirrors `duration`, `countdown_text`, `age_text` and `heartbeat_view` to keep the text ticking between refreshes,
so the two must say the same. Pure functions with no request or runtime in sight, so the CSV export and the tests
can use them too.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from markupsafe import Markup

# strftime of each <time data-style=...>: the server's UTC text, which dashboard.js replaces in the viewer's zone
TIME_STYLES = {
    "datetime": "%Y-%m-%d %H:%M:%S UTC",  # events, starts, ends: to the second, with the zone
    "time": "%H:%M:%S UTC",  # a time of today (the overview's "updated")
    "hm": "%H:%M",  # timeline ticks over a day (the zone is in the caption under the timeline)
    "short": "%m-%d %H:%M",  # timeline ticks over days
}


def iso(ts: float | None) -> str:
    """ISO-8601 UTC for a <time datetime=...>."""
    if ts is None:
        return ""
    return dt.datetime.fromtimestamp(float(ts), dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def time_text(ts: float, style: str = "datetime") -> str:
    """The server's text of a time: '2024-05-01 14:03:07 UTC' (see TIME_STYLES)."""
    return dt.datetime.fromtimestamp(float(ts), dt.UTC).strftime(TIME_STYLES.get(style, TIME_STYLES["datetime"]))


def time_tag(ts: float | None, style: str = "datetime") -> Markup:
    """A <time> element with UTC text; dashboard.js rewrites it in the viewer's time zone (the zone in the text)."""
    if ts is None:
        return Markup('<span class="muted">—</span>')
    style = style if style in TIME_STYLES else "datetime"
    return Markup('<time datetime="{}" data-style="{}">{}</time>').format(iso(ts), style, time_text(ts, style))


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


def countdown_text(deadline: float, now: float) -> str:
    """'in 4m 10s' before a deadline, 'now' within a second of it, '12s overdue' after it."""
    left = deadline - now
    if abs(left) < 1:
        return "now"
    return f"in {duration(left)}" if left > 0 else f"{duration(-left)} overdue"


def countdown_tag(deadline: float | None, now: float) -> Markup:
    """A deadline's time and its countdown, which dashboard.js keeps ticking: '14:03:07 UTC (in 4m 10s)'."""
    if deadline is None:
        return Markup('<span class="muted">—</span>')
    return Markup('{} <span class="countdown" data-countdown="{}">({})</span>').format(
        time_tag(deadline), f"{float(deadline):.3f}", countdown_text(deadline, now))


def age_text(ts: float, now: float) -> str:
    """'12s ago' (never negative: a guest's clock may run ahead)."""
    return f"{duration(now - ts)} ago"


def age_view(ts: float | None, now: float, stale_after: float) -> dict[str, Any]:
    """A figure's age: when its newest sample was taken, how long ago, and whether that is stale."""
    if ts is None:
        return {"ts": None, "age": None, "stale": False, "text": ""}
    age = max(0.0, now - ts)
    return {"ts": ts, "age": age, "stale": age > stale_after, "text": age_text(ts, now)}


def heartbeat_view(last: float | None, since: float, now: float, stale_after: float) -> dict[str, Any]:
    """What the dashboard says of a lease's guest heartbeats (`last`: when the agent last heard from it; `since`:
    when the lease got its GPUs). State `ok` (heard within stale_after), `stale` ('no heartbeat for N'), `waiting`
    (none yet, the lease younger than stale_after) or `never` (none yet, and it has waited longer: a warning)."""
    if last is None:
        waited = max(0.0, now - since)
        state = "waiting" if waited <= stale_after else "never"
        return {"last": None, "since": since, "age": None, "state": state, "text": "no heartbeat yet",
                "warn": state == "never"}
    age = max(0.0, now - last)
    if age > stale_after:
        return {"last": last, "since": since, "age": age, "state": "stale", "text": f"no heartbeat for {duration(age)}",
                "warn": True}
    return {"last": last, "since": since, "age": age, "state": "ok", "text": f"heartbeat {age_text(last, now)}",
            "warn": False}


def gib(nbytes: float | None) -> str:
    """Bytes as GiB ('80 GiB', '11.5 GiB')."""
    if not nbytes:
        return "—"
    v = float(nbytes) / 1024**3
    return f"{v:.0f} GiB" if v >= 20 or v.is_integer() else f"{v:.1f} GiB"


def pct(value: float | None) -> str:
    """'42%' or '—'."""
    return "—" if value is None else f"{value:.0f}%"


__all__ = ["TIME_STYLES", "age_text", "age_view", "countdown_tag", "countdown_text", "duration", "gib",
           "heartbeat_view", "iso", "pct", "time_tag", "time_text"]


# What a function beside the GPU in its IOMMU group is, by PCI class (base class and subclass), for one line.
FUNCTION_KINDS = {"0403": "audio", "0c03": "USB", "0c80": "USB-C controller", "0c05": "SMBus", "0200": "network",
                  "0108": "NVMe", "0604": "bridge"}


def group_note(functions: list[dict[str, Any]]) -> str | None:
    """'whole group: 4 functions (GPU, audio, USB, USB-C controller)' for a GPU whose group holds more than it; a
    lease takes every one. None for a GPU alone in its group."""
    if len(functions) < 2:
        return None
    kinds = []
    for f in functions:
        code = str(f.get("class") or "")[2:6]
        kinds.append("GPU" if code.startswith("03") else FUNCTION_KINDS.get(code, code or "function"))
    return f"whole group: {len(functions)} functions ({', '.join(kinds)})"
