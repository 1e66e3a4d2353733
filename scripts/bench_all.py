#!/usr/bin/env python3
"""Run every benchmark script and regenerate docs/benchmarks.md from their output, in one command.

Each `## Section` of the page is replaced by its scripts' output (what ran, how long, the figures as printed);
the header is rewritten with this machine's facts (CPUs, memory, CPU model, load, date). Sections whose script
is missing, or whose run crashed (a Python traceback, a timeout), keep their previous text and are reported on
stderr; a block between `<!-- notes -->` and `<!-- /notes -->` in a section is kept across regenerations.

    python scripts/bench_all.py [--write docs/benchmarks.md] [--only load,overhead] [--quick]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostagent.bench.machine import facts, load_average  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
TITLE = "# Benchmarks"
NOTES = re.compile(r"<!-- notes -->.*?<!-- /notes -->", re.S)


@dataclass(frozen=True)
class Bench:
    """One script: its short name (for --only and `hostagent bench NAME`), the section it fills, arguments."""

    name: str
    section: str
    script: str
    quick: tuple[str, ...] = ()
    timeout_s: float = 1800.0


BENCHES = (
    Bench("load", "Load", "bench_load.py", ("--quick",), 900),
    Bench("overhead", "Agent overhead per lease", "bench_overhead.py", ("--quick",), 900),
    Bench("restart", "Restart to ready", "bench_restart.py", ("--quick",), 600),
    Bench("ingest", "Ingest", "bench_ingest.py", ("--samples", "20000"), 900),
    Bench("rollup", "Ingest", "bench_rollup_query.py", ("--small",), 1800),
    Bench("place", "Placement", "bench_place.py", ("--decisions", "500"), 900),
    Bench("dashboard", "Dashboard", "bench_dashboard.py", ("--small",), 900),
    Bench("tenants", "Tenants", "bench_tenants.py", ("--quick",), 600),
    Bench("fleet", "Fleet store", "bench_fleet.py", ("--quick",), 2700),
)
SECTION_ORDER = ("Load", "Agent overhead per lease", "Restart to ready", "Ingest", "Fleet store", "Placement",
                 "Dashboard", "Tenants")


def describe(script: Path) -> str:
    """The first paragraph of a script's docstring, joined into one line."""
    text = script.read_text(encoding="utf-8")
    m = re.search(r'"""(.*?)"""', text, re.S)
    if not m:
        return ""
    return " ".join(m.group(1).strip().split("\n\n")[0].split())


def run(bench: Bench, quick: bool) -> tuple[str | None, str]:
    """Run one script; (markdown block, problem). The block is None when the run crashed."""
    script = SCRIPTS / bench.script
    args = [*bench.quick] if quick else []
    cmd = [sys.executable, str(script), *args]
    shown = " ".join(["python", f"scripts/{bench.script}", *args])
    print(f"bench_all: {shown} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=bench.timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"{shown}: no result within {bench.timeout_s:.0f} s"
    took = time.perf_counter() - t0
    out = proc.stdout.rstrip()
    if "Traceback (most recent call last)" in proc.stderr + proc.stdout or not out:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        return None, f"{shown}: crashed (exit {proc.returncode}):\n{tail}"
    status = "" if proc.returncode == 0 else f" It exited with status {proc.returncode} (see its output)."
    block = (f"`{shown}` (`hostagent bench {bench.name}`{' ' + ' '.join(args) if args else ''}), "
             f"{took:.0f} s, {time.strftime('%Y-%m-%d %H:%M %Z')}.{status}\n\n"
             f"{describe(script)}\n\n```text\n{out}\n```")
    return block, ""


def split_page(text: str) -> tuple[str, dict[str, str], list[str]]:
    """(header, {section title: body}, section order) of an existing page."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    header, sections, order = parts[0], {}, []
    for title, body in zip(parts[1::2], parts[2::2], strict=True):
        sections[title.strip()] = body.strip("\n")
        order.append(title.strip())
    return header, sections, order


def header(quick: bool, load_before: str) -> str:
    """The page header: machine, how to regenerate, how to read the figures."""
    f = facts()
    return "\n".join([
        TITLE, "",
        "Figures printed by the scripts in `scripts/` (each compares against a baseline measured in the same run);"
        " this page is generated from their output, section by section.",
        "",
        "| machine | |", "|---|---|",
        f"| CPUs | {f['usable_cpus']} usable of {f['cpus']} ({f['cpu_model']}) |",
        f"| memory | {f['memory']} |",
        f"| kernel / Python | {f['kernel']} / {f['python']} |",
        f"| load average (1/5/15 min) | {load_before} before, {load_average()} after |",
        f"| generated | {f['date']}{' (quick runs: smoke figures, not for comparison)' if quick else ''} |",
        "",
        "The machine is a shared virtual machine: other work ran beside the benchmarks, so latencies carry its"
        " load (above). Where a script prints CPU seconds as well as wall time, the CPU figure is the one a busy"
        " machine does not inflate.",
        "",
        "Regenerate the whole page (about 30 minutes; needs MariaDB on 127.0.0.1:3306 for the ingest and fleet"
        " sections):",
        "",
        "    hostagent bench all --write docs/benchmarks.md        # or: python scripts/bench_all.py --write ...",
        "    hostagent bench all --write docs/benchmarks.md --only load,restart   # some sections only",
        "",
        "One benchmark alone: `hostagent bench load|overhead|restart|ingest|rollup|place|dashboard|tenants|fleet"
        " [script args]`"
        " (`--quick` for a smoke run where a script has it). Benchmarks are not tests: they print figures and"
        " verdicts, and stop by themselves; all traffic stays on loopback (127.0.0.0/8).",
        "",
    ])


def main() -> int:
    """Run, assemble, write (or print)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", metavar="PAGE", help="markdown page to rewrite (default: print to stdout)")
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(b.name for b in BENCHES)}")
    ap.add_argument("--quick", action="store_true", help="smoke-run arguments for every script")
    args = ap.parse_args()
    wanted = {b.name for b in BENCHES} if not args.only else {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = wanted - {b.name for b in BENCHES}
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    # Scripts that share a section run together, so a partial run never leaves half a section.
    sections_wanted = {b.section for b in BENCHES if b.name in wanted}
    wanted = {b.name for b in BENCHES if b.section in sections_wanted}
    page = Path(args.write) if args.write else None
    load_before = load_average()
    produced: dict[str, list[str]] = {}
    problems: list[str] = []
    for bench in BENCHES:
        if bench.name not in wanted:
            continue
        if not (SCRIPTS / bench.script).exists():
            problems.append(f"scripts/{bench.script} does not exist (yet): section '{bench.section}' kept as it was")
            continue
        block, problem = run(bench, args.quick)
        if block is None:
            problems.append(problem + f"\n  section '{bench.section}' kept as it was")
            produced.setdefault(bench.section, []).append("")  # the section's other scripts may still succeed
            continue
        produced.setdefault(bench.section, []).append(block)
    # Read the page only now: other sections may have been edited while the benchmarks ran.
    _, old, old_order = split_page(page.read_text(encoding="utf-8")) if page and page.exists() else ("", {}, [])
    sections = dict(old)
    for title, blocks in produced.items():
        good = [b for b in blocks if b]
        if not good or len(good) < len(blocks):
            continue  # a crashed script: keep the whole section as it was rather than half of it
        body = "\n\n".join(good)
        notes = NOTES.search(old.get(title, ""))
        sections[title] = body + ("\n\n" + notes.group(0) if notes else "")
    order = [t for t in SECTION_ORDER if t in sections] + [t for t in old_order if t not in SECTION_ORDER]
    text = header(args.quick, load_before) + "\n".join(f"\n## {t}\n\n{sections[t]}\n" for t in order)
    if page:
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(text, encoding="utf-8")
        print(f"bench_all: wrote {page} ({len(order)} sections)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    for p in problems:
        print(f"bench_all: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
