"""Facts about the machine a benchmark ran on (for the page header and each script's first lines)."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() as a fallback)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> float:
    """Total memory in GiB from /proc/meminfo."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return float("nan")


def load_average() -> str:
    """The 1/5/15-minute load averages: a busy shared machine makes latencies longer, so every run says it."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def facts() -> dict[str, str]:
    """Cores, memory, CPU model, load, kernel, Python and the date, as strings."""
    return {
        "cpus": str(os.cpu_count() or 0),
        "usable_cpus": str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
        "memory": f"{memory_gib():.1f} GiB",
        "cpu_model": cpu_model(),
        "load": load_average(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def header_line() -> str:
    """One line for the top of a benchmark's output."""
    f = facts()
    return (f"machine: {f['usable_cpus']} CPUs ({f['cpu_model']}), {f['memory']}, load {f['load']}, "
            f"Python {f['python']}, {f['date']}")
