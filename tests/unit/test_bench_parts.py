"""Benchmark plumbing (not benchmarks): figures, the page generator, the `hostagent bench` command, timed ports."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hostagent.bench.rig import TimedPort
from hostagent.bench.stats import percentile, slope
from hostagent.cli import bench as cli_bench

ROOT = Path(__file__).parents[2]


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def load_bench_all() -> ModuleType:
    return load_script("bench_all")


def test_socket_spans_run_from_a_requests_first_read_to_its_last_write() -> None:
    """The overhead bench's socket-to-socket time: a request read in two pieces and answered in two writes is one
    span; the idle time between a response and the next request is in none."""
    spans = load_script("bench_overhead").socket_spans
    log = [("in", 1.0), ("in", 1.5), ("out", 3.0), ("out", 4.0), ("in", 10.0), ("out", 12.5)]
    assert spans(log) == [3.0, 2.5]
    assert spans([]) == []
    assert spans([("out", 1.0), ("in", 2.0), ("out", 3.0)]) == [1.0]  # a write before any request is no span


def test_memory_verdict_tells_a_leak_from_caches_filling() -> None:
    """The load bench's memory verdict: flat RSS; RSS rising while the agent's own objects stay flat (bounded caches,
    free memory kept); or a leak."""
    verdict = load_script("bench_load").memory_verdict
    assert verdict(0.3, 0.02) == "flat (no leak seen)"
    assert verdict(-0.3, None) == "flat (no leak seen)"
    assert verdict(0.625, 0.05).startswith("RSS rising, the agent's own objects flat (+0.050 MiB/min)")
    assert verdict(0.625, 0.3) == "GROWING: look for a leak"
    assert verdict(0.625, None) == "GROWING: look for a leak"


def test_percentile_interpolates_between_ranks() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 25) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) != percentile([], 50)  # NaN


def test_slope_of_a_line_and_of_flat_data() -> None:
    xs = [0.0, 1.0, 2.0, 3.0]
    assert slope(xs, [3.0 + 2.5 * x for x in xs]) == pytest.approx(2.5)
    assert slope(xs, [4.0, 4.0, 4.0, 4.0]) == 0.0
    assert slope([1.0], [2.0]) == 0.0
    assert slope([2.0, 2.0], [1.0, 5.0]) == 0.0


def _fake_scripts(tmp: Path) -> Path:
    scripts = tmp / "scripts"
    scripts.mkdir()
    (scripts / "ok_a.py").write_text('"""Alpha figures.\n\nMore."""\nprint("alpha 42 ms")\n')
    (scripts / "ok_b.py").write_text('"""Beta."""\nimport sys\nprint("beta 7 req/s")\nsys.exit(1)\n')
    (scripts / "crash.py").write_text('"""Crashes."""\nprint("half")\nraise RuntimeError("boom")\n')
    return scripts


def _patch(mod: ModuleType, monkeypatch: pytest.MonkeyPatch, scripts: Path, *benches: Any) -> None:
    monkeypatch.setattr(mod, "SCRIPTS", scripts)
    monkeypatch.setattr(mod, "REPO", scripts.parent)
    monkeypatch.setattr(mod, "BENCHES", benches)
    monkeypatch.setattr(mod, "SECTION_ORDER", ("Alpha", "Beta", "Gamma", "Missing"))


def test_page_is_regenerated_section_by_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    mod = load_bench_all()
    scripts = _fake_scripts(tmp_path)
    B = mod.Bench
    _patch(mod, monkeypatch, scripts, B("a", "Alpha", "ok_a.py"), B("b", "Beta", "ok_b.py"),
           B("c", "Gamma", "crash.py"), B("m", "Missing", "absent.py"))
    page = tmp_path / "benchmarks.md"
    page.write_text("# Old title\n\nold header\n\n## Alpha\n\nold alpha\n<!-- notes -->\nkeep me\n<!-- /notes -->\n\n"
                    "## Gamma\n\nold gamma figures\n\n## Someone else's\n\ntheir text\n")
    monkeypatch.setattr(sys, "argv", ["bench_all.py", "--write", str(page)])
    assert mod.main() == 1  # the crash and the missing script are problems
    text = page.read_text()
    assert text.startswith("# Benchmarks\n")
    assert "old header" not in text
    assert "| CPUs |" in text and "| memory |" in text and "load average" in text
    sections = mod.split_page(text)[1]
    assert list(sections) == ["Alpha", "Beta", "Gamma", "Someone else's"]
    assert "alpha 42 ms" in sections["Alpha"] and "Alpha figures." in sections["Alpha"]
    assert "old alpha" not in sections["Alpha"] and "keep me" in sections["Alpha"]
    assert "beta 7 req/s" in sections["Beta"] and "exited with status 1" in sections["Beta"]
    assert sections["Gamma"] == "old gamma figures"  # crashed: the previous figures stay
    assert sections["Someone else's"] == "their text"
    assert "Missing" not in sections
    err = capsys.readouterr().err
    assert "crash.py: crashed" in err and "boom" in err and "absent.py does not exist" in err


def test_only_runs_whole_sections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_bench_all()
    scripts = _fake_scripts(tmp_path)
    B = mod.Bench
    _patch(mod, monkeypatch, scripts, B("a", "Alpha", "ok_a.py"), B("a2", "Alpha", "ok_b.py"),
           B("b", "Beta", "crash.py"))
    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(sys, "argv", ["bench_all.py", "--write", str(page), "--only", "a"])
    assert mod.main() == 0
    sections = mod.split_page(page.read_text())[1]
    assert list(sections) == ["Alpha"]
    assert "alpha 42 ms" in sections["Alpha"] and "beta 7 req/s" in sections["Alpha"]  # a2 shares the section
    monkeypatch.setattr(sys, "argv", ["bench_all.py", "--only", "nope"])
    with pytest.raises(SystemExit):
        mod.main()


def test_bench_command_passes_every_argument_to_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hostagent.cli.parser import REGISTER, build_parser, main

    assert cli_bench.register in REGISTER  # wired by the CLI itself
    args = build_parser().parse_args(["bench", "load", "--duration", "5", "--help"])
    assert args.benchmark == "load" and args.script_args == ["--duration", "5", "--help"]
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    out = tmp_path / "argv.txt"
    (scripts / "bench_restart.py").write_text(f"import sys\nopen({str(out)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
                                              "sys.exit(3)\n")
    monkeypatch.setattr(cli_bench, "SCRIPTS_DIR", scripts)
    assert main(["bench", "restart", "--rounds", "2", "--quick"]) == 3
    assert out.read_text() == "--rounds 2 --quick"
    assert main(["bench", "place"]) == 1  # no such script in this tree: a clear error, not a traceback
    for name in cli_bench.BENCHMARKS:
        assert (ROOT / "scripts" / cli_bench.BENCHMARKS[name][0]).name.startswith("bench_")


class _Port:
    def sync_op(self, x: int) -> int:
        return x * 2

    async def async_op(self, x: int) -> int:
        await asyncio.sleep(0.001)
        return x + 1

    def untimed(self) -> str:
        return "u"

    value = 5


async def test_timed_port_records_calls_and_passes_results_through() -> None:
    port = TimedPort(_Port(), "p", only=frozenset({"sync_op", "async_op"}))
    mark = port.mark()
    assert port.sync_op(4) == 8
    assert await port.async_op(1) == 2
    assert await asyncio.to_thread(port.sync_op, 1) == 2
    assert port.untimed() == "u" and port.value == 5
    calls = port.since(mark)
    assert [name for name, _ in calls] == ["p.sync_op", "p.async_op", "p.sync_op"]
    assert all(s >= 0 for _, s in calls) and calls[1][1] >= 0.001


@pytest.mark.libvirtd
def test_overhead_bench_runs_end_to_end_with_its_client_in_another_process() -> None:
    """A smoke run of scripts/bench_overhead.py (a few leases per case; figures are not judged here): the client
    process leases and releases, every request is matched to the agent's own marks, the floor runs."""
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--leases", "2",
                           "--config-leases", "4", "--warmup", "1",
                           "--idle-writes", "5", "--libvirtd-attaches", "2"], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.count("wall, seen by the client (its own process)") == 4  # two paths in each of two cases
    assert "[live attach 1.3 s, detach acknowledged after 0.5 s]  2 leases" in out
    # the CONFIG case runs at the real libvirtd's p50, timed first in the same run
    assert re.search(r"\[CONFIG attach \d+\.\d ms, detach acknowledged after \d+\.\d ms \(real libvirtd p50, "
                     r"this run\)\]  4 leases", out), out[:3000]
    # attach: the BINDING write (the drivers read in its hop), the bind with the ATTACHING write, the ACTIVE write;
    # release: the DETACHING write, then REBINDING, the give-back and the final write in one hop
    assert out.count("floor: 3 journal writes + 3 thread hops alone") == 2
    assert out.count("floor: 3 journal writes + 2 thread hops alone") == 2
    assert "[the machine: one fsync'd journal write in one thread hop]" in out and "after 50 ms idle" in out
    # the real libvirtd's CONFIG attach, timed in the same run (the suite installs libvirtd: never "not measured")
    assert "attach (4 hostdevs, persistent config)" in out and "not measured" not in out, out[-3000:]
    assert "verdict:" in out and out.count(" -> ") >= 18


def test_fleet_bench_hosts_sample_every_gpu_once_per_instant_and_mirror_through_the_agents_code(
        tmp_path: Path) -> None:
    """The fleet bench's simulated host (no database): every GPU held by a lease at every instant and sampled once
    per instant, leases ending (some reclaimed) and starting again by legal transitions, and the agent's own journal
    mirror (Runtime's methods, borrowed) writing each lease's document, its events and the reclaims."""
    from types import SimpleNamespace

    mod = load_script("bench_fleet")
    plan = mod.Plan(url="mysql+pymysql://nobody@127.0.0.1/none", hosts=1, gpus=8, lease_s=3.0)
    h = mod.SimHost(0, plan, tmp_path)
    queued: list[tuple[str, dict[str, Any]]] = []
    h.ingestor = SimpleNamespace(submit=lambda samples, lease_id, tenant: queued.extend(
        (lease_id, s) for s in samples) or len(samples))
    t0 = 1_800_000_000.0
    for k in range(60):
        h.churn(t0 + k)
        assert len(h.manager.holder) == 8  # every GPU leased again at once
        h.heartbeat([t0 + k])
    assert h.sent == len(queued) == 8 * 60
    assert len({(s["gpu_id"], s["ts"]) for _, s in queued}) == 8 * 60 and all(s["source"] == "guest" for _, s in queued)
    assert h.leases_started > 8 and h.journal.reclaim_events % 3 == 0

    mirrored: list[tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]] = []
    usage = SimpleNamespace(spool=SimpleNamespace(dead=0),
                            mirror=lambda docs, rows, reclaims, set_aside: mirrored.append((docs, rows, reclaims)),
                            write_samples=lambda samples, set_aside: len(samples))
    shim = mod.agent_shim_class()(SimpleNamespace(store=usage), h.journal, h.host_id)
    assert shim._write_samples([]) == 0  # the agent's writer: the mirror first, until the journal is drained
    assert h.journal.backlog() == (0, None)
    rows = [r for _, rs, _ in mirrored for r in rs]
    assert len(rows) == h.journal.events and [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
    docs = {d["id"]: d for ds, _, _ in mirrored for d in ds}
    assert len(docs) == h.leases_started  # every lease's document went with its events
    assert sum(len(rc) for _, _, rc in mirrored) == h.journal.reclaim_events
    assert all(r["lease_id"] in docs for r in rows)
    assert all(d["state"] != "RELEASED" for d in h.journal.docs(docs).values())  # ended and mirrored: forgotten
