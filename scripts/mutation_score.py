"""Mutation score per package from mutmut's results, and which mutants a package run still has to test.

mutmut 3 keeps one result per mutant in ``mutants/<source path>.meta`` (JSON, ``exit_code_by_key``: mutant name ->
the exit code of its test run, null while untested). Its own summary is one total for everything it mutated; this
helper groups the results by package (``hostagent/<package>/...``), which is what scripts/mutation.sh reports:

    python scripts/mutation_score.py score [PACKAGE ...]   # table + artifacts/mutation/survivors-<package>.txt
    python scripts/mutation_score.py generate               # make the mutants (mutmut run's first step) alone
    python scripts/mutation_score.py select PACKAGE... [--sample N]  # mutmut run arguments: what is left to test
    python scripts/mutation_score.py tested                # how many mutants have a result

Counting: "killed" is killed + timeout (+ segfault: the test process died, the mutant was noticed, + caught by
type check, which this project does not configure); "suspicious" (an exit code mutmut cannot read) is reported on
its own and kept out of the score; "no tests" counts as survived (no test covers the mutated function, so nothing
would notice the change); "skipped" (pragma: no mutate) is left out; mutants not tested yet (a run stopped by the
time cap, or interrupted) are "pending" and left out too. score = killed / (killed + survived).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from collections import Counter, defaultdict
from pathlib import Path

try:  # the installed mutmut's own reading of exit codes, where it has one
    from mutmut.stats import status_by_exit_code as _MUTMUT_STATUS
except Exception:  # pragma: no cover - mutmut missing or reorganised: the 3.x table, copied
    _MUTMUT_STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 2: "check was interrupted by user",
                      None: "not checked", 33: "no tests", 34: "skipped", 35: "suspicious", 36: "timeout",
                      37: "caught by type check", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
                      -11: "segfault", -9: "segfault"}

PACKAGES = ("domain", "services", "store", "learn", "web")
ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"
ARTIFACTS = ROOT / "artifacts" / "mutation"

# mutmut status -> the column this report puts it in
COLUMN = {"killed": "killed", "timeout": "killed", "segfault": "killed", "caught by type check": "killed",
          "survived": "survived", "no tests": "survived",
          "suspicious": "suspicious", "skipped": "skipped",
          "not checked": "pending", "check was interrupted by user": "pending"}


def status(exit_code: int | None) -> str:
    if exit_code is None:
        return "not checked"
    return _MUTMUT_STATUS.get(exit_code) or "suspicious"


def load(mutants: Path = MUTANTS) -> dict[str, dict[str, int | None]]:
    """Source path (hostagent/domain/lease.py) -> {mutant name: exit code or None}."""
    out: dict[str, dict[str, int | None]] = {}
    for meta in sorted(mutants.glob("hostagent/**/*.py.meta")):
        data = json.loads(meta.read_text())
        out[meta.relative_to(mutants).as_posix()[: -len(".meta")]] = data.get("exit_code_by_key", {})
    return out


def package_of(source: str) -> str:
    parts = source.split("/")
    return parts[1] if len(parts) > 2 else parts[-1].removesuffix(".py")


def module_of(source: str) -> str:
    return source.removesuffix(".py").replace("/", ".")


def tally(results: dict[str, dict[str, int | None]], package: str) -> tuple[Counter[str], list[tuple[str, str]]]:
    counts: Counter[str] = Counter()
    survivors: list[tuple[str, str]] = []
    for source, by_key in results.items():
        if package_of(source) != package:
            continue
        for key, code in by_key.items():
            st = status(code)
            counts[COLUMN.get(st, "suspicious")] += 1
            counts["total"] += 1
            if st in ("timeout", "segfault"):
                counts[st] += 1
            if st == "no tests":
                counts["no_tests"] += 1
            if COLUMN.get(st) in ("survived", "suspicious"):
                survivors.append((key, st))
    return counts, sorted(survivors)


def score(packages: list[str], out_dir: Path) -> int:
    results = load()
    if not results:
        print("mutation: no results under mutants/ (run scripts/mutation.sh first)", file=sys.stderr)
        return 1
    out_dir.mkdir(parents=True, exist_ok=True)
    head = f"{'package':<9} {'killed':>7} {'survived':>8} {'score':>7}   {'timeout':>7} {'no tests':>8} " \
           f"{'suspicious':>10} {'pending':>7} {'mutants':>7}"
    print(head)
    print("-" * len(head))
    summary = {}
    for pkg in packages:
        c, survivors = tally(results, pkg)
        tested = c["killed"] + c["survived"]
        pct = f"{100 * c['killed'] / tested:6.1f}%" if tested else "     -"
        print(f"{pkg:<9} {c['killed']:>7} {c['survived']:>8} {pct:>7}   {c['timeout']:>7} {c['no_tests']:>8} "
              f"{c['suspicious']:>10} {c['pending']:>7} {c['total']:>7}")
        summary[pkg] = dict(c, score=round(100 * c["killed"] / tested, 2) if tested else None)
        if not c["total"]:
            continue
        path = out_dir / f"survivors-{pkg}.txt"
        by_module: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for key, st in survivors:
            by_module[key.rsplit(".", 1)[0]].append((key, st))
        lines = [f"# {pkg}: {c['killed']} killed / {tested} tested ({pct.strip()}), {c['survived']} survived "
                 f"({c['no_tests']} with no test), {c['suspicious']} suspicious, {c['pending']} not tested yet",
                 "# each: mutant name, status; see one with `.venv/bin/mutmut show NAME`"]
        for module in sorted(by_module):
            lines.append(f"\n## {module} ({len(by_module[module])})")
            lines += [f"{key}  {st}" for key, st in by_module[module]]
        path.write_text("\n".join(lines) + "\n")
    (out_dir / "score.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nsurvivors: {out_dir.relative_to(ROOT) if out_dir.is_relative_to(ROOT) else out_dir}/survivors-<package>.txt"
          "  (killed = killed + timeout; score = killed / (killed + survived); 'no tests' counts as survived)")
    return 0


def generate(jobs: int) -> int:
    """Make (or bring up to date) the mutants and their .meta files, as the first step of `mutmut run` does.

    mutmut names its mutants only once it has made them, and a sample or a resumed package run names them on the
    command line; this is that step alone, through mutmut's own functions (an edited file is made again and the
    functions that changed lose their results, exactly as in `mutmut run`, which then finds nothing left to make).
    """
    import contextlib
    import io
    import os

    os.chdir(ROOT)
    try:
        from mutmut.__main__ import create_mutants
        from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths
    except ImportError as exc:  # a mutmut whose insides moved: the caller falls back to whole-package globs
        print(f"mutation: cannot make mutants ahead of `mutmut run` with this mutmut ({exc})", file=sys.stderr)
        return 1
    MUTANTS.mkdir(exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints every file and every path it copies
        copy_src_dir()
        copy_also_copy_files()
        setup_source_paths()
        made = create_mutants(jobs)
    print(f"mutation: mutants made for {made.mutated} file(s), {made.unmodified} unchanged", file=sys.stderr)
    return 0


def sampled(key: str, sample: int) -> bool:
    """One mutant in SAMPLE, the same ones every run (by a hash of its name, spread over every module)."""
    return sample <= 1 or zlib.crc32(key.encode()) % sample == 0


def select(packages: list[str], sample: int) -> int:
    """Print the arguments for `mutmut run` that test what PACKAGES have left, one a line (nothing: all done).

    Only mutants without a result are named, so a package run resumes where the last one stopped (mutmut re-tests
    every mutant its command line names, tested or not); a module with none tested yet is named by one glob.
    With SAMPLE > 1 only one mutant in SAMPLE is named (see `sampled`).
    """
    args: list[str] = []
    for src, keys in sorted(load().items()):
        if package_of(src) not in packages or not keys:
            continue
        mine = {k: code for k, code in keys.items() if sampled(k, sample)}
        pending = sorted(k for k, code in mine.items() if COLUMN.get(status(code)) == "pending")
        if sample <= 1 and pending and len(pending) == len(keys) and not src.endswith("__init__.py"):
            args.append(f"{module_of(src)}.*")
        else:
            args += pending
    print("\n".join(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score", help="score per package, survivors to artifacts/mutation/")
    s.add_argument("packages", nargs="*", metavar="PACKAGE", help=f"any of {', '.join(PACKAGES)} (default: all)")
    s.add_argument("--out", type=Path, default=ARTIFACTS)
    sel = sub.add_parser("select", help="mutmut run arguments for what packages have left")
    sel.add_argument("packages", nargs="+", choices=PACKAGES, metavar="PACKAGE")
    sel.add_argument("--sample", type=int, default=1, help="only one mutant in N (default 1: all)")
    gen = sub.add_parser("generate", help="make the mutants and their .meta files (mutmut run's first step)")
    gen.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    sub.add_parser("tested", help="how many mutants have a result (all packages)")
    a = p.parse_args(argv)
    if a.cmd == "tested":
        print(sum(COLUMN.get(status(c)) not in ("pending", None) for keys in load().values() for c in keys.values()))
        return 0
    if a.cmd == "score":
        unknown = set(a.packages) - set(PACKAGES)
        if unknown:
            p.error(f"unknown package(s) {sorted(unknown)}: choose from {', '.join(PACKAGES)}")
        return score(list(a.packages) or list(PACKAGES), a.out)
    if a.cmd == "generate":
        return generate(a.jobs)
    return select(list(a.packages), a.sample)


if __name__ == "__main__":
    sys.exit(main())
