#!/usr/bin/env python3
"""Agent overhead per lease: wall time of POST /v1/leases -> ACTIVE and DELETE -> RELEASED minus the time spent in
sysfs and hypervisor calls.

The agent runs in this process (the real runtime and web app, served on 127.0.0.1) over a 16-GPU fake sysfs tree
and the simulated hypervisor, whose host, hypervisor and journal ports are wrapped in timing proxies; a real HTTP
client in a process of its own has one VM lease one GPU and release it, N times in a row. Two hypervisor settings:
live attach 1.3 s (measured on real libvirtd live attach) with the guest acknowledging a detach after 0.5 s, and
CONFIG, whose attach and detach take what a real private libvirtd takes for a 4-function GPU's persistent-config
attach and detach, timed first in the same run through the agent's own adapter (`time_real_config_attach`; p50 about
8 ms on the 2-vCPU VMs here) and printed beside the overhead; where no libvirtd can start, 50 ms, and the run says so.
Baseline in the same run: the time inside the host and hypervisor calls (the lease driver's own step_timings
and, stricter, every port call), which is what any agent must spend. Targets: overhead under 1 % of the attach
path with realistic latencies (the live-attach case) and p99 under 5 ms in both cases. The CONFIG case's share of
its short path is reported beside it, with no target: 1 % of 8 ms is 80 µs, far less than the three fsync'd journal
writes a crash-safe lease needs. Wall time is taken three times: by the client (loopback TCP and its own HTTP
work included); in the agent's process, from the request's first bytes read off the socket to its response handed to
the kernel (all the agent does for a request: parsing, handlers, serialising); and inside the agent, from
the outermost middleware's entry to the handler's response. The targets are judged on the agent's process and, as
a stricter reading, on the client's wall.
A floor in the same run: the path's fsync'd journal writes and thread hops alone, nothing else (`run_floor`), which
is what the machine's disk and scheduler charge any agent built this way, back to back. And what an idle CPU adds: one
journal write in one hop, back to back and after IDLE_S asleep (as the path's writes after a sysfs or hypervisor wait
are): on a VM whose vCPUs idle between requests the same work runs several times slower at first (caches, the host's
scheduler), which the agent cannot change but its figures carry.

    python scripts/bench_overhead.py [--leases 100] [--config-leases 300] [--idle-writes 200] [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostagent.bench.machine import header_line  # noqa: E402
from hostagent.bench.rig import build_agent  # noqa: E402
from hostagent.bench.stats import percentile  # noqa: E402
from hostagent.domain.lease import LeaseRequest, LeaseState, new_lease  # noqa: E402
from hostagent.runtime import make_app  # noqa: E402
from hostagent.store.journal import Journal  # noqa: E402
from hostagent.web.serve import AgentRunner  # noqa: E402

ATTACH_TARGET_PCT = 1.0
P99_TARGET_S = 0.005
IDLE_S = 0.05  # the idle before each write of the idle-CPU figure: a hypervisor or sysfs wait's length
FOUR_FUNCTIONS = [f"0000:3b:00.{i}" for i in range(4)]  # GPU, audio, USB, UCSI: need not exist for a CONFIG attach


@dataclass
class PathFigures:
    """Per-lease figures of one path (attach or release)."""

    wall: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)  # sum of manager.step_timings
    ports: list[float] = field(default_factory=list)  # every host + hypervisor call
    journal: list[float] = field(default_factory=list)  # journal.record (fsync'd writes)
    handler: list[float] = field(default_factory=list)  # inside the agent: request in -> response out
    process: list[float] = field(default_factory=list)  # the agent's process: first request byte -> response written
    writes: list[int] = field(default_factory=list)
    hops: list[int] = field(default_factory=list)  # the lease driver's worker-thread hops (journal writes included)
    floor: list[float] = field(default_factory=list)  # run_floor with this path's writes and hops

    @property
    def overhead(self) -> list[float]:
        """Wall minus every host and hypervisor call."""
        return [w - p for w, p in zip(self.wall, self.ports, strict=True)]

    @property
    def overhead_in_process(self) -> list[float]:
        """Time in the agent's process for the request (bytes in to response out) minus every host and hypervisor
        call."""
        return [h - p for h, p in zip(self.process, self.ports, strict=True)]

    @property
    def overhead_in_agent(self) -> list[float]:
        """Time inside the agent's HTTP stack and handlers minus every host and hypervisor call."""
        return [h - p for h, p in zip(self.handler, self.ports, strict=True)]

    @property
    def overhead_steps(self) -> list[float]:
        """Wall minus the lease driver's step_timings (the brief's baseline)."""
        return [w - s for w, s in zip(self.wall, self.steps, strict=True)]


def _sum(calls: list[tuple[str, float]], prefix: str = "") -> float:
    return sum(s for name, s in calls if name.startswith(prefix))


CLIENT = """
import asyncio, json, sys, time
import aiohttp

async def main(url, token, n):
    auth = {"Authorization": "Bearer " + token}
    walls = []
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            t0 = time.perf_counter()
            async with s.post(url + "/v1/leases", json={"gpus": 1, "task_type": "training"}, headers=auth) as r:
                body = await r.json()
                if r.status != 201 or body["state"] != "ACTIVE":
                    sys.exit(f"lease {i}: {r.status} {body}")
            t1 = time.perf_counter()
            async with s.delete(url + "/v1/leases/" + body["id"], headers=auth) as r:
                done = await r.json()
                if r.status != 200 or done["state"] != "RELEASED":
                    sys.exit(f"release {i}: {r.status} {done}")
            walls.append((t1 - t0, time.perf_counter() - t1))
    print(json.dumps(walls))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


class _SocketTimes(asyncio.Protocol):
    """Wraps the agent's HTTP protocol on one connection: notes when a request's first bytes arrive and when each
    write of its response is handed to the kernel (the send itself is the kernel's: on loopback it wakes the client,
    which may then run first on a 2-vCPU machine). The client waits for each response before it sends the next
    request, so a request runs from the first read after a write to the last write before a read."""

    def __init__(self, inner: asyncio.Protocol, log: list[tuple[str, float]]) -> None:
        self._inner = inner
        self._log = log

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(_WriteTimes(transport, self._log))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self._log.append(("in", time.perf_counter()))
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class _WriteTimes:
    """A transport that notes when each write is called; everything else goes to the real one."""

    def __init__(self, transport: asyncio.BaseTransport, log: list[tuple[str, float]]) -> None:
        self._transport = transport
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        self._log.append(("out", time.perf_counter()))
        self._transport.write(data)  # type: ignore[attr-defined]

    def writelines(self, chunks: Any) -> None:
        self._log.append(("out", time.perf_counter()))
        self._transport.writelines(chunks)  # type: ignore[attr-defined]


def socket_spans(log: list[tuple[str, float]]) -> list[float]:
    """Per request: first read after a write (or the start) to the last write before the next read."""
    spans: list[float] = []
    start = end = None
    for kind, t in log:
        if kind == "in":
            if end is not None:
                spans.append(end - start)  # type: ignore[operator]
                start = end = None
            if start is None:
                start = t
        elif start is not None:
            end = t
    if end is not None:
        spans.append(end - start)  # type: ignore[operator]
    return spans


async def run_case(leases: int, warmup: int, hv_kwargs: dict[str, float],
                   profile: cProfile.Profile | None) -> tuple[PathFigures, PathFigures]:
    """Lease and release one GPU `leases` times (after `warmup` unmeasured ones) through the HTTP API, from a
    client in its own process (its HTTP work never shares the agent's event loop or interpreter)."""
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        agent = build_agent(Path(tmp), scenario="demo16", vms=("vm-bench",), hv_kwargs=hv_kwargs,
                            libvirt={"detach_timeout_s": 10.0})
        rt = agent.runtime
        app = make_app(rt)
        hops = [0]  # every worker-thread hop of the lease driver (journal writes, sysfs steps)
        run_blocking = rt.manager._run  # noqa: SLF001

        async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            hops[0] += 1
            return await run_blocking(fn, *args, **kwargs)

        rt.manager._run = counted  # type: ignore[method-assign]  # noqa: SLF001

        def marks() -> tuple[Any, ...]:
            return (rt.manager.step_timings.total, agent.host_port.mark(), agent.hv_port.mark(),
                    agent.journal_port.mark(), hops[0], time.perf_counter())

        # per request, inside the agent (outermost middleware): marks at entry and at the response, and the seconds
        # of its step_timings (read at once: that log is bounded, the ports' call lists are not)
        served: list[tuple[tuple[Any, ...], tuple[Any, ...], float]] = []

        @web.middleware
        async def in_agent(request: web.Request, handler: Any) -> web.StreamResponse:
            if profile is not None and len(served) == 2 * warmup:
                profile.enable()  # the measured leases only (the event loop's thread: the agent alone)
            a = marks()
            try:
                return await handler(request)
            finally:
                b = marks()
                served.append((a, b, sum(sec for _, sec in rt.manager.step_timings.since(a[0], b[0]))))

        app.middlewares.insert(0, in_agent)
        runner = AgentRunner(app, rt.settings.agent)  # the served agent's connection handling (serve.py's limits)
        await runner.setup()
        sock_log: list[tuple[str, float]] = []
        server = await asyncio.get_running_loop().create_server(
            lambda: _SocketTimes(runner.server(), sock_log), "127.0.0.1", 0)  # type: ignore[misc]
        port = server.sockets[0].getsockname()[1]
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", agent.tokens["vm-bench"],
                str(warmup + leases), stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate()
            if profile is not None:
                profile.disable()
            if proc.returncode != 0:
                raise RuntimeError(f"the benchmark client failed (exit {proc.returncode})")
            walls = json.loads(out)
        finally:
            server.close()
            await runner.cleanup()
            await server.wait_closed()
        spans = socket_spans(sock_log)
        if not len(served) == len(spans) == 2 * len(walls):
            raise RuntimeError(f"{len(served)} requests served ({len(spans)} on the socket) for {len(walls)} leases")
        attach, release = PathFigures(), PathFigures()
        for i in range(warmup, len(walls)):
            for fig, (a, b, steps), wall, span in ((attach, served[2 * i], walls[i][0], spans[2 * i]),
                                                   (release, served[2 * i + 1], walls[i][1], spans[2 * i + 1])):
                fig.wall.append(wall)
                fig.process.append(span)
                fig.handler.append(b[5] - a[5])
                fig.steps.append(steps)
                fig.ports.append(_sum(agent.host_port.calls[a[1]:b[1]]) + _sum(agent.hv_port.calls[a[2]:b[2]]))
                writes = [c for c in agent.journal_port.calls[a[3]:b[3]] if c[0] == "journal.record"]
                fig.journal.append(sum(sec for _, sec in writes))
                fig.writes.append(len(writes))
                fig.hops.append(b[4] - a[4])
        return attach, release


async def run_floor(leases: int, warmup: int, writes: int, hops: int, idle_s: float = 0.0) -> list[float]:
    """The machine's floor for one grant: `writes` fsync'd journal writes spread over `hops` thread hops (a hop
    with none is empty), each from the event loop to a worker and back, nothing else (no HTTP, no placement, no
    agent running). With `idle_s` the loop sleeps that long before each hop, not counted.

    What any crash-safe agent built this way pays on this machine; its p99 against its p50 shows how much of a
    tail the disk and the scheduler add by themselves."""
    per_hop = [writes // hops + (1 if n < writes % hops else 0) for n in range(hops)] if hops else []
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
        journal = Journal(Path(tmp) / "journal.sqlite3")
        steps = (LeaseState.BINDING, LeaseState.ATTACHING, LeaseState.ACTIVE)
        out: list[float] = []

        def write(lease: Any, first: int, k: int) -> Any:  # worker thread: writes first .. first + k - 1
            for n in range(first, first + k):
                nxt = lease.transition(steps[n]) if n < len(steps) else lease
                journal.record(nxt, from_state=lease.state, actor="bench")
                lease = nxt
            return lease

        try:
            for i in range(warmup + leases):
                lease = new_lease(f"l-floor{i:06d}", "uuid-floor", "vm-floor", LeaseRequest(), time.time())
                spent = 0.0
                done = 0
                for k in per_hop:
                    if idle_s:
                        await asyncio.sleep(idle_s)
                    t0 = time.perf_counter()
                    lease = await asyncio.to_thread(write, lease, done, k)
                    spent += time.perf_counter() - t0
                    done += k
                if i >= warmup:
                    out.append(spent)
        finally:
            journal.close()
        return out


def row(name: str, values: list[float]) -> str:
    """p50 / p99 / max in ms."""
    return (f"    {name:<52} {percentile(values, 50) * 1e3:9.2f} {percentile(values, 99) * 1e3:9.2f} "
            f"{max(values) * 1e3:9.2f}")


def report(label: str, attach: PathFigures, release: PathFigures, share_target: bool
           ) -> list[tuple[str, bool | None, str]]:
    """Print one case; returns verdict lines (what, met or None for a figure with no target, figure)."""
    print(f"\n[{label}]  {len(attach.wall)} leases")
    print(f"    {'ms per lease':<52} {'p50':>9} {'p99':>9} {'max':>9}")
    for name, fig in (("attach path: POST /v1/leases -> 201 ACTIVE", attach),
                      ("release path: DELETE -> 200 RELEASED", release)):
        print(f"  {name}")
        print(row("wall, seen by the client (its own process)", fig.wall))
        print(row("wall, the agent's process (bytes in -> response out)", fig.process))
        print(row("wall, inside the agent (request in -> response out)", fig.handler))
        print(row("baseline: sysfs + hypervisor calls (all)", fig.ports))
        print(row("baseline: lease driver step_timings", fig.steps))
        print(row("agent overhead = client wall - calls", fig.overhead))
        print(row("agent overhead = client wall - step_timings", fig.overhead_steps))
        print(row("agent overhead = wall in the agent's process - calls", fig.overhead_in_process))
        print(row("agent overhead = wall inside the agent - calls", fig.overhead_in_agent))
        print(row(f"  of which journal writes ({fig.writes[0]} x fsync'd)", fig.journal))
        print(row("  of which the rest (HTTP, JSON, placement, threads)",
                  [o - j for o, j in zip(fig.overhead_in_agent, fig.journal, strict=True)]))
        print(row(f"floor: {fig.writes[0]} journal writes + {int(percentile(fig.hops, 50))} thread hops alone",
                  fig.floor))
    total = [a + r for a, r in zip(attach.overhead, release.overhead, strict=True)]
    print(row("whole lease: agent overhead (client wall)", total))
    verdicts: list[tuple[str, bool | None, str]] = [
        (f"{label}: {name} floor (journal writes + thread hops alone) p50 / p99", None,
         f"{percentile(fig.floor, 50) * 1e3:.2f} / {percentile(fig.floor, 99) * 1e3:.2f} ms")
        for name, fig in (("attach", attach), ("release", release))]
    for how, a_over, r_over in (("the agent's process", attach.overhead_in_process, release.overhead_in_process),
                                ("client wall", attach.overhead, release.overhead)):
        pct = percentile(a_over, 50) / percentile(attach.wall, 50) * 100
        pct99 = percentile(a_over, 99) / percentile(attach.wall, 50) * 100
        print(f"  attach path overhead ({how}): p50 {pct:.2f} %, p99 {pct99:.2f} % of the attach path's p50 wall time")
        verdicts += [
            (f"{label}: attach overhead ({how}) p50 < {ATTACH_TARGET_PCT:g} % of the attach path",
             pct < ATTACH_TARGET_PCT, f"{pct:.2f} %") if share_target else
            (f"{label}: attach overhead ({how}) p50 as a share of the attach path", None, f"{pct:.2f} %"),
            (f"{label}: attach overhead ({how}) p99 < {P99_TARGET_S * 1e3:g} ms",
             percentile(a_over, 99) < P99_TARGET_S, f"{percentile(a_over, 99) * 1e3:.2f} ms"),
            (f"{label}: release overhead ({how}) p99 < {P99_TARGET_S * 1e3:g} ms",
             percentile(r_over, 99) < P99_TARGET_S, f"{percentile(r_over, 99) * 1e3:.2f} ms"),
        ]
    return verdicts


async def time_real_config_attach(n: int) -> tuple[list[float], list[float]] | str:
    """Attach and detach the four hostdevs of a 4-function GPU `n` times, persistent-config only, on a real private
    libvirtd (a shut-off domain: live assignment needs an IOMMU this machine lacks), through the agent's own adapter.

    Returns the attach and detach times, or why they could not be measured (no libvirtd here: `scripts/deps.sh
    test` installs it)."""
    try:
        from hostagent.bench.libvirtd import LibvirtdUnavailable, PrivateLibvirtd, tiny_domain_xml
        from hostagent.domain.hostdev import free_guest_slots, hostdevs_for_gpu
        from hostagent.domain.pci import PciAddress
        from hostagent.virt.libvirt_adapter import LibvirtHypervisor
    except ImportError as exc:
        return f"not measured: {exc}"
    with tempfile.TemporaryDirectory(prefix="bench-libvirtd-") as tmp:
        daemon = PrivateLibvirtd(Path(tmp))
        try:
            daemon.start()
        except (LibvirtdUnavailable, OSError) as exc:
            daemon.stop()
            return f"not measured: {str(exc).splitlines()[0]}"
        try:
            xml = Path(tmp) / "bench-config.xml"
            xml.write_text(tiny_domain_xml("bench-config"))
            daemon.virsh("define", str(xml))
            uuid = daemon.virsh("domuuid", "bench-config").strip()
            hv = LibvirtHypervisor(daemon.uri)
            await hv.connect()
            try:
                (slot,) = free_guest_slots(await hv.domain_xml(uuid, live=False), 1, 1)
                hds = hostdevs_for_gpu([PciAddress.parse(a) for a in FOUR_FUNCTIONS], 1, slot, rom_bar_off=True)
                attach: list[float] = []
                detach: list[float] = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    await hv.attach_hostdevs(uuid, hds)
                    attach.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    result = await hv.detach_hostdevs(uuid, hds, timeout_s=10.0)
                    detach.append(time.perf_counter() - t0)
                    if not result.confirmed:
                        return "not measured: a CONFIG detach was not confirmed"
                return attach, detach
            finally:
                await hv.close()
        finally:
            daemon.stop()


async def main_async(args: argparse.Namespace) -> int:
    """Both cases, then verdicts (and a profile when asked)."""
    # The CONFIG case's hypervisor latency is a real private libvirtd's, measured first in this run (50 ms where none
    # can start here, an earlier machine's p50 of 47 ms rounded up).
    real = await time_real_config_attach(args.libvirtd_attaches)
    config_s = 0.05 if isinstance(real, str) else percentile(real[0], 50)
    config_detach_s = 0.05 if isinstance(real, str) else percentile(real[1], 50)
    source = "fallback, no libvirtd" if isinstance(real, str) else "real libvirtd p50, this run"
    cases = [("live attach 1.3 s, detach acknowledged after 0.5 s", args.leases,
              {"attach_latency_s": 1.3, "detach_ack_delay_s": 0.5}),
             (f"CONFIG attach {config_s * 1e3:.1f} ms, detach acknowledged after {config_detach_s * 1e3:.1f} ms "
              f"({source})", args.config_leases,
              {"attach_latency_s": config_s, "detach_ack_delay_s": config_detach_s})]
    verdicts: list[tuple[str, bool | None, str]] = []
    prof = cProfile.Profile() if args.profile else None
    config_attach: PathFigures | None = None
    for label, n, hv in cases:
        config = "CONFIG" in label
        attach, release = await run_case(n, args.warmup, hv, prof if config else None)
        for fig in (attach, release):
            fig.floor = await run_floor(n, args.warmup, int(percentile(fig.writes, 50)), int(percentile(fig.hops, 50)))
        verdicts += report(label, attach, release, share_target=not config)
        if config:
            config_attach = attach
    print(f"\n[real libvirtd: CONFIG attach of a 4-function GPU, the agent's adapter]  {args.libvirtd_attaches} "
          "attaches and detaches, timed before the cases")
    if isinstance(real, str):
        print(f"    {real}")
        verdicts.append(("real libvirtd CONFIG attach", None, real))
    else:
        print(f"    {'ms per call':<52} {'p50':>9} {'p99':>9} {'max':>9}")
        print(row("attach (4 hostdevs, persistent config)", real[0]))
        print(row("detach (4 hostdevs, persistent config)", real[1]))
        assert config_attach is not None
        over, attach_p50 = percentile(config_attach.overhead_in_process, 50), percentile(real[0], 50)
        verdicts.append(("agent overhead on the attach path (its process, CONFIG case) p50 next to a real libvirtd "
                         "CONFIG attach p50", None,
                         f"{over * 1e3:.2f} ms vs {attach_p50 * 1e3:.2f} ms ({over / attach_p50 * 100:.1f} %)"))
    hot = await run_floor(args.idle_writes, args.warmup, 1, 1)
    cold = await run_floor(args.idle_writes, args.warmup, 1, 1, IDLE_S)
    print(f"\n[the machine: one fsync'd journal write in one thread hop]  {args.idle_writes} writes each")
    print(f"    {'ms per write':<52} {'p50':>9} {'p99':>9} {'max':>9}")
    print(row("back to back", hot))
    print(row(f"after {IDLE_S * 1e3:g} ms idle", cold))
    verdicts.append((f"one journal write in one hop, back to back / after {IDLE_S * 1e3:g} ms idle, p50", None,
                     f"{percentile(hot, 50) * 1e3:.2f} / {percentile(cold, 50) * 1e3:.2f} ms "
                     f"({percentile(cold, 50) / percentile(hot, 50):.1f} x)"))
    print("\nverdict:")
    for what, met, figure in verdicts:
        print(f"  {what}: {figure} -> {'reported, no target' if met is None else 'MET' if met else 'MISSED'}")
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print("\ncProfile of the CONFIG case, event-loop thread, top 15 by own time:")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))
    return 0


def main() -> int:
    """Parse arguments and run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leases", type=int, default=100, help="measured leases with live-attach latency")
    ap.add_argument("--config-leases", type=int, default=300, help="measured leases with CONFIG-attach latency")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--idle-writes", type=int, default=200,
                    help="journal writes for the idle-CPU figure (each after IDLE_S asleep)")
    ap.add_argument("--libvirtd-attaches", type=int, default=50,
                    help="CONFIG attaches and detaches timed on a real private libvirtd (when it can start here)")
    ap.add_argument("--quick", action="store_true", help="10 + 30 leases (a smoke run)")
    ap.add_argument("--profile", action="store_true", help="cProfile the CONFIG case and print the top functions")
    args = ap.parse_args()
    if args.quick:
        args.leases, args.config_leases, args.warmup, args.idle_writes = 10, 30, 2, 20
        args.libvirtd_attaches = 5
    print(header_line())
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
