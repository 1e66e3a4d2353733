"""`hostagent-guest`: lease, release, status, renew, run -- CMD, daemon. Talks to the host agent with this VM's token."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from hostagent.guest.client import HostClient, ssl_context
from hostagent.guest.config import GuestConfig, load_config, require_url
from hostagent.guest.errors import ApiError, GuestError, HostUnreachable, LeaseFailed, WaitTimeout
from hostagent.guest.mapping import map_devices
from hostagent.guest.monitor import TERMINAL, Monitor
from hostagent.guest.sampler import PciDisplay, Sampler, normalize_bus_id, scan_display_devices

log = logging.getLogger("hostagent.guest")

LIVE_STATES = ["REQUESTED", "BOOKED", "QUEUED", "BINDING", "ATTACHING", "ACTIVE", "RELEASING", "DETACHING",
               "DETACH_PENDING", "REBINDING"]
# CLI flag -> API field of POST /v1/leases (the request fields of the lease API)
REQUEST_FIELDS = {"gpus": "gpus", "task_type": "task_type", "data_scale": "data_scale", "precision": "precision",
                  "min_memory_gib": "min_memory_gib", "duration": "duration_s", "priority": "priority",
                  "not_after": "not_after", "idempotency_key": "idempotency_key", "vendor": "vendor",
                  "model": "model", "numa_policy": "numa_policy", "project": "project", "requires": "requires",
                  "total_memory_gib": "total_memory_gib", "target_work_rate": "target_work_rate"}


# ---- argument parsing ------------------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser, suppress: bool) -> None:
    """Connection options, accepted before or after the subcommand."""
    d = argparse.SUPPRESS if suppress else None
    p.add_argument("--url", default=d, help="host agent URL (env HOSTAGENT_URL)")
    p.add_argument("--token-file", default=d, help="file holding this VM's token (env HOSTAGENT_TOKEN_FILE)")
    p.add_argument("--config", default=d, help="config file (default /etc/hostagent/guest.toml)")
    p.add_argument("--ca-file", default=d, help="CA bundle for an https URL")
    p.add_argument("--insecure", action="store_true", default=d, help="do not verify the TLS certificate")
    p.add_argument("--json", action="store_true", default=d, help="print JSON")
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS if suppress else 0)


def _request_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("lease request (fields of POST /v1/leases)")
    g.add_argument("--gpus", type=int, default=None, help="how many GPUs (default 1)")
    g.add_argument("--total-memory-gib", type=float, default=None,
                   help="instead of --gpus: the fewest GPUs that hold this much GPU memory, sharded evenly")
    g.add_argument("--target-work-rate", type=float, default=None, metavar="PER_S",
                   help="instead of --gpus: the fewest GPUs the host's model predicts reach this work rate of "
                        "--task-type (the unit the guest agent's work-rate source reports)")
    g.add_argument("--requires", type=lambda v: [f for f in v.split(",") if f], default=None, metavar="F1,F2",
                   help="features every GPU must have: fp16 bf16 tf32 fp64 int8 fp8 nvlink")
    g.add_argument("--task-type", default=None, help="e.g. training, inference")
    g.add_argument("--data-scale", type=float, default=None)
    g.add_argument("--precision", default=None, help="fp32 fp16 bf16 int8 fp8 fp64 tf32")
    g.add_argument("--min-memory-gib", type=float, default=None)
    g.add_argument("--duration", type=int, default=None, metavar="SECONDS", help="lease TTL in seconds")
    g.add_argument("--priority", type=int, default=None, help="-1000..1000")
    g.add_argument("--accept-partial", action="store_true", help="take fewer GPUs than asked when that is all")
    g.add_argument("--no-top-up", action="store_true",
                   help="with --accept-partial: keep what is granted (by default the host adds the rest as GPUs free)")
    g.add_argument("--no-queue", action="store_true", help="refuse rather than wait in the host's queue")
    g.add_argument("--not-after", type=float, default=None, metavar="UNIX_TS", help="give up queueing after this")
    g.add_argument("--idempotency-key", default=None, help="default: a fresh one per invocation (safe retries)")
    g.add_argument("--vendor", default=None)
    g.add_argument("--model", default=None)
    g.add_argument("--numa-policy", default=None, help="required, preferred or any")
    g.add_argument("--project", default=None)
    w = p.add_argument_group("waiting")
    w.add_argument("--wait-timeout", type=float, default=600.0, help="seconds to wait for a grant (default 600)")
    w.add_argument("--settle", type=float, default=5.0, help="seconds to wait for the GPUs to appear in the guest")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    ap = argparse.ArgumentParser(prog="hostagent-guest", description=__doc__)
    _common(ap, suppress=False)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("lease", help="ask for GPUs and wait for the grant")
    _common(p, True)
    _request_args(p)
    for name, text in (("release", "give a lease back"), ("status", "show a lease (default: this VM's live one)")):
        p = sub.add_parser(name, help=text)
        _common(p, True)
        p.add_argument("lease_id", nargs="?")
    p = sub.add_parser("renew", help="extend a lease")
    _common(p, True)
    p.add_argument("lease_id", nargs="?")
    p.add_argument("--duration", type=int, default=None, metavar="SECONDS")
    p = sub.add_parser("run", help="lease, run CMD with the GPUs, report usage, release when it exits")
    _common(p, True)
    _request_args(p)
    p.add_argument("--auto-renew", action="store_true", help="renew the lease while the command runs")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    p = sub.add_parser("reserve", help="book GPUs ahead for a time window: the host binds and attaches them at its "
                                       "start (state BOOKED until then; `release` cancels)")
    _common(p, True)
    _request_args(p)
    p.add_argument("--start", required=True, type=parse_start, metavar="WHEN",
                   help="when the window starts: unix seconds, +SECONDS from now, or ISO 8601 with a zone "
                        "(2026-11-28T09:00+01:00); --duration gives its length (required)")
    p.add_argument("--or-later", action="store_true",
                   help="when the window is taken, book the earliest one that fits instead of refusing")
    p = sub.add_parser("daemon", help="the long-running monitor: heartbeats with usage for this VM's leases")
    _common(p, True)
    return ap


def parse_start(text: str) -> float:
    """A booking's start: unix seconds, +SECONDS from now, or an ISO 8601 time with its zone."""
    import datetime as dt

    try:
        if text.startswith("+"):
            return time.time() + float(text[1:])
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not unix seconds, +SECONDS or an ISO 8601 time") from None
    if when.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone: add one (e.g. +01:00 or Z)")
    return when.timestamp()


def request_body(args: argparse.Namespace, cfg: GuestConfig | None = None) -> dict[str, Any]:
    """POST /v1/leases body from the flags (only what was given; the host fills defaults). With an `on_move` hook
    the request says `movable`: the work can follow a move notice, so the host may move it to free a block."""
    body: dict[str, Any] = {}
    for flag, key in REQUEST_FIELDS.items():
        value = getattr(args, flag, None)
        if value is not None:
            body[key] = value
    if args.accept_partial:
        body["accept_partial"] = True
    if getattr(args, "no_top_up", False):
        body["top_up"] = False
    if cfg is not None and cfg.on_move:
        body["movable"] = True
    body["accept_deferred"] = not args.no_queue
    # A key per invocation makes the POST safe to retry after a lost reply: the host answers with the same lease.
    body.setdefault("idempotency_key", f"guest-{uuid.uuid4().hex}")
    return body


# ---- output ----------------------------------------------------------------------------------------------------


def _when(ts: float | None) -> str:
    if ts is None:
        return "never"
    delta = ts - time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    return f"{stamp} (in {delta:.0f} s)" if delta >= 0 else f"{stamp} ({-delta:.0f} s ago)"


def queued_line(q: dict[str, Any]) -> str:
    """A queued request's place, expected grant and, where the host says, why it waits (passed over, or waiting for
    a better GPU)."""
    note = q.get("note")
    return f"queued: position {q.get('position')}, eta {_when(q.get('eta'))}" + (f"; {note}" if note else "")


def describe_lease(lease: dict[str, Any]) -> str:
    """Human lines for a lease."""
    dom = (lease.get("domain") or {}).get("name") or (lease.get("domain") or {}).get("uuid", "?")
    lines = [f"lease {lease['id']} {lease['state']} for {dom}"]
    if lease.get("state") == "QUEUED":
        lines.append(f"  {queued_line(lease.get('queue') or {})}")
    if lease.get("booking"):
        b = lease["booking"]
        lines.append(f"  booked: {', '.join(b.get('gpus') or []) or '?'} from {_when(b.get('start_at'))} to "
                     f"{_when(b.get('end_at'))}" + (f"; bound and attached from {_when(b['binds_at'])}"
                                                    if b.get("binds_at") else ""))
    if lease.get("expires_at"):
        lines.append(f"  expires {_when(lease['expires_at'])}")
    for d in lease.get("devices") or ():
        fns = d.get("functions") or []
        extra = f" (+{len(fns) - 1} function(s) of IOMMU group {d.get('iommu_group')})" if len(fns) > 1 else ""
        guest = ", ".join(d.get("guest_addresses") or []) or "?"
        lines.append(f"  {d['gpu_id']}: host {fns[0] if fns else '?'}{extra}; guest {guest}")
    for w in lease.get("warnings") or ():
        lines.append(f"  warning {w.get('code')}: {w.get('message')}")
    if lease.get("usage", {}).get("samples"):
        u = lease["usage"]
        lines.append(f"  usage: {u['samples']} samples, mean util {u.get('mean_util_pct', 0):.0f}%")
    if lease.get("end_reason"):
        lines.append(f"  ended: {lease['end_reason']}")
    if lease.get("error"):
        lines.append(f"  error: {lease['error']}")
    return "\n".join(lines)


def guest_gpus(lease: dict[str, Any], cfg: GuestConfig) -> dict[str, Any]:
    """What the guest now sees of the lease's GPUs: NVML's devices mapped to gpu ids, else the PCI scan."""
    sampler = Sampler.open(sys_root=cfg.sys_root)
    try:
        if sampler.available:
            m = map_devices(sampler.devices, [lease])
            return {"source": sampler.backend.source if sampler.backend else None, "note": sampler.note,
                    "devices": [{"index": d.index, "bus_id": d.bus_id, "name": d.name, "uuid": d.uuid,
                                 "memory_total_bytes": d.memory_total_bytes, "gpu_id": m.gpu_of.get(d.index),
                                 "matched_by": m.how.get(d.index)} for d in sampler.devices]}
        wanted = {normalize_bus_id(a) for d in lease.get("devices") or () for a in d.get("guest_addresses") or ()}
        pci = scan_display_devices(cfg.sys_root)
        return {"source": "pci", "note": sampler.note,
                "devices": [dict(vars_of(p), leased=p.address in wanted) for p in pci]}
    finally:
        sampler.close()


def vars_of(p: PciDisplay) -> dict[str, Any]:
    """A PciDisplay as a dict."""
    return {"address": p.address, "class": p.class_hex, "vendor_id": p.vendor_id, "device_id": p.device_id,
            "driver": p.driver, "name": p.name}


def describe_gpus(view: dict[str, Any]) -> str:
    """Human lines for guest_gpus()."""
    if view["source"] == "pci":
        lines = [f"GPUs in this guest (PCI scan; {view['note']}):"]
        lines += [f"  {PciDisplay(d['address'], d['class'], d['vendor_id'], d['device_id'], d['driver'], d['name']).line()}"
                  + ("  <- leased" if d["leased"] else "") for d in view["devices"]]
        if not view["devices"]:
            lines.append("  none found in /sys/bus/pci/devices")
        return "\n".join(lines)
    lines = [f"GPUs in this guest ({view['note']}):"]
    for d in view["devices"]:
        mem = f", {d['memory_total_bytes'] / 2**30:.0f} GiB" if d["memory_total_bytes"] else ""
        tag = f"  <- {d['gpu_id']} (by {d['matched_by']})" if d["gpu_id"] else ""
        lines.append(f"  {d['index']} {d['bus_id']} {d['name']}{mem}{tag}")
    return "\n".join(lines)


# ---- commands --------------------------------------------------------------------------------------------------


async def acquire(client: HostClient, body: dict[str, Any], *, wait_timeout: float, out: TextIO,
                  poll_s: float = 1.0) -> dict[str, Any]:
    """POST the request; while QUEUED (or still attaching) poll with a progress line; ACTIVE or an error."""
    status, lease = await client.create_lease(body)
    deadline = time.monotonic() + wait_timeout
    last = ""
    try:
        while lease["state"] != "ACTIVE":
            if lease["state"] in TERMINAL:
                raise LeaseFailed(f"lease {lease['id']} ended {lease['state']}: "
                                 f"{lease.get('error') or lease.get('end_reason') or 'no reason given'}")
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"lease {lease['id']} not granted within {wait_timeout:g} s "
                                  f"(still {lease['state']}); cancelled it")
            line = (queued_line(lease.get("queue") or {}) if lease["state"] == "QUEUED"
                    else f"{lease['state'].lower()}...")
            if line != last:
                print(f"hostagent-guest: lease {lease['id']} {line}", file=out, flush=True)
                last = line
            await asyncio.sleep(min(poll_s, max(0.05, deadline - time.monotonic())))
            lease = await client.get_lease(lease["id"])
    except (WaitTimeout, asyncio.CancelledError, KeyboardInterrupt):
        if lease["state"] not in TERMINAL:  # do not leave a queued request behind us
            with contextlib.suppress(GuestError):
                await client.release(lease["id"])
        raise
    return lease


async def wait_visible(lease: dict[str, Any], cfg: GuestConfig, settle_s: float) -> bool:
    """Wait (bounded) until the lease's guest addresses show up in sysfs: PCI hot-plug takes a moment."""
    wanted = [normalize_bus_id(d["guest_addresses"][0]) for d in lease.get("devices") or () if d.get("guest_addresses")]
    base = Path(cfg.sys_root) / "bus/pci/devices"
    deadline = time.monotonic() + settle_s
    while True:
        if all((base / a).exists() for a in wanted):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.2)


async def pick_lease(client: HostClient, lease_id: str | None) -> str:
    """The lease named, or this VM's only live lease."""
    if lease_id:
        return lease_id
    live = await client.list_leases(LIVE_STATES)
    if not live:
        raise GuestError("this VM holds no live lease; name one (see `hostagent-guest status`)")
    if len(live) > 1:
        raise GuestError("this VM holds several leases; name one of: " + ", ".join(x["id"] for x in live))
    return str(live[0]["id"])


def emit(args: argparse.Namespace, data: Any, text: str, out: TextIO) -> None:
    """JSON with --json, else the human text."""
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text, file=out, flush=True)


async def cmd_lease(args: argparse.Namespace, cfg: GuestConfig, client: HostClient, out: TextIO) -> int:
    """`lease`: request, wait, print the lease and the GPUs the guest sees."""
    lease = await acquire(client, request_body(args, cfg), wait_timeout=args.wait_timeout, out=sys.stderr)
    visible = await wait_visible(lease, cfg, args.settle)
    gpus = await asyncio.to_thread(guest_gpus, lease, cfg)
    text = describe_lease(lease) + "\n" + describe_gpus(gpus)
    if not visible:
        text += "\n(the lease's guest addresses are not in /sys/bus/pci/devices yet: hot-plug may still be running)"
    emit(args, {"lease": lease, "guest_gpus": gpus}, text, out)
    return 0


async def cmd_status(args: argparse.Namespace, cfg: GuestConfig, client: HostClient, out: TextIO) -> int:
    """`status`: one lease, or every live lease of this VM."""
    if args.lease_id:
        lease = await client.get_lease(args.lease_id)
        emit(args, lease, describe_lease(lease), out)
        return 0
    live = await client.list_leases(LIVE_STATES)
    emit(args, {"leases": live}, "\n".join(describe_lease(x) for x in live) or "no live lease for this VM", out)
    return 0


async def cmd_release(args: argparse.Namespace, cfg: GuestConfig, client: HostClient, out: TextIO) -> int:
    """`release`: DELETE the lease; say so when the detach is pending."""
    lease_id = await pick_lease(client, args.lease_id)
    status, lease = await client.release(lease_id)
    text = describe_lease(lease)
    if status == 202:
        text += "\ndetach pending: stop the processes using the GPU so the guest can let go of it"
    emit(args, lease, text, out)
    return 0


async def cmd_renew(args: argparse.Namespace, cfg: GuestConfig, client: HostClient, out: TextIO) -> int:
    """`renew`: extend the TTL."""
    lease = await client.renew(await pick_lease(client, args.lease_id), args.duration)
    emit(args, lease, describe_lease(lease), out)
    return 0


def _pid_file(cfg: GuestConfig, lease_id: str) -> Path:
    return Path(cfg.state_dir) / f"run-{lease_id}.pid"


def owned_by_run(cfg: GuestConfig, lease_id: str) -> bool:
    """A live `hostagent-guest run` reports for this lease (the daemon must not send its samples twice)."""
    try:
        pid = int(_pid_file(cfg, lease_id).read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def _exit_status(rc: int) -> int:
    """A signal death as the shell reports it (128 + signal)."""
    return 128 - rc if rc < 0 else rc


async def cmd_run(args: argparse.Namespace, cfg: GuestConfig, client: HostClient, out: TextIO) -> int:
    """`run -- CMD`: lease, run CMD with the GPUs, heartbeat its usage, release when it exits; its status is ours."""
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise GuestError("run needs a command: hostagent-guest run [options] -- CMD [ARGS...]")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    got: list[int] = []
    proc: asyncio.subprocess.Process | None = None

    def on_signal(signum: int) -> None:
        got.append(signum)
        if proc is None or proc.returncode is not None:
            stop.set()
            return
        # Ctrl-C on a terminal already reached the command (same foreground process group): do not send it twice.
        if not (signum == signal.SIGINT and sys.stdin.isatty()):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
        loop.call_later(cfg.stop_grace_s, _kill_child)

    def _kill_child() -> None:
        if proc is not None and proc.returncode is None:
            log.warning("the command ignored the signal for %.0f s; killing it", cfg.stop_grace_s)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    handled = (signal.SIGINT, signal.SIGTERM)
    for s in handled:
        loop.add_signal_handler(s, on_signal, s)
    pid_file: Path | None = None
    monitor: Monitor | None = None
    try:
        acquire_task = asyncio.create_task(acquire(client, request_body(args, cfg), wait_timeout=args.wait_timeout,
                                                   out=sys.stderr))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({acquire_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not acquire_task.done():  # a signal while waiting: cancel (acquire releases the queued lease)
            acquire_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire_task
            return _exit_status(-got[0])
        stopper.cancel()
        lease = acquire_task.result()
        print(f"hostagent-guest: lease {lease['id']} ACTIVE: "
              f"{', '.join(d['gpu_id'] for d in lease.get('devices') or ())}", file=sys.stderr, flush=True)
        await wait_visible(lease, cfg, args.settle)
        monitor = Monitor(client, cfg, lambda: Sampler.open(sys_root=cfg.sys_root, work_rate=cfg.work_rate,
                                                            stale_s=3 * cfg.sample_interval_s),
                          extra_gpu_users=lambda: [proc.pid] if proc is not None and proc.returncode is None else [],
                          auto_renew=args.auto_renew)
        tracked = monitor.track(lease)
        with contextlib.suppress(OSError):
            pid_file = _pid_file(cfg, lease["id"])
            pid_file.parent.mkdir(parents=True, exist_ok=True)
            pid_file.write_text(f"{os.getpid()}\n")
        env = dict(os.environ, HOSTAGENT_LEASE_ID=lease["id"], HOSTAGENT_GPU_IDS=",".join(tracked.gpu_ids))
        uuids = {d.index: d.uuid for d in (monitor.sampler.devices if monitor.sampler else [])}
        visible = [uuids.get(i) if i is not None else None for i in map(monitor.map.index_of, tracked.gpu_ids)]
        if visible and all(visible) and "CUDA_VISIBLE_DEVICES" not in env:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(u) for u in visible)  # only the leased GPUs
        mon_task = asyncio.create_task(monitor.run(stop))
        try:
            proc = await asyncio.create_subprocess_exec(*argv, env=env)
        except OSError as exc:
            print(f"hostagent-guest: cannot run {argv[0]}: {exc.strerror}", file=sys.stderr)
            rc = 127 if isinstance(exc, FileNotFoundError) else 126
        else:
            if got:  # a signal arrived between the grant and the start
                on_signal(got[-1])
            rc = await proc.wait()
        stop.set()
        await mon_task
        if not tracked.ended:
            await monitor.sample()
            await monitor.flush(tracked)
            await monitor.release(tracked, f"command exited with status {_exit_status(rc)}")
        print(f"hostagent-guest: {monitor.summary(tracked)}; lease {tracked.ended or tracked.lease.get('state')}",
              file=sys.stderr, flush=True)
        return _exit_status(rc)
    finally:
        for s in handled:
            loop.remove_signal_handler(s)
        if monitor is not None:
            await monitor.close()
        if pid_file is not None:
            with contextlib.suppress(OSError):
                pid_file.unlink()


async def cmd_daemon(args: argparse.Namespace, cfg: GuestConfig, client: HostClient, out: TextIO) -> int:
    """`daemon`: watch every ACTIVE lease of this VM not owned by a `run`, until SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, stop.set)
    monitor = Monitor(client, cfg, lambda: Sampler.open(sys_root=cfg.sys_root, work_rate=cfg.work_rate,
                                                        stale_s=3 * cfg.sample_interval_s))

    async def discover() -> None:
        try:
            active = await client.list_leases(["ACTIVE"])
        except HostUnreachable as exc:
            monitor._host_down(exc.message)
            return
        except ApiError as exc:
            if exc.status >= 500:
                monitor._host_down(exc.message)
                return
            raise
        ids = {x["id"] for x in active}
        for lease in active:
            if lease["id"] not in monitor.leases and not owned_by_run(cfg, lease["id"]):
                monitor.track(lease)
        for lease_id, t in list(monitor.leases.items()):
            if t.ended or (lease_id not in ids and t.lease.get("state") == "ACTIVE" and not t.reclaiming):
                log.info(monitor.summary(t))
                monitor.untrack(lease_id)

    log.info("hostagent-guest daemon watching this VM's leases at %s", client.url)
    _sd_notify("READY=1")
    try:
        await monitor.run(stop, discover=discover)
        for t in monitor.leases.values():  # shutting down: carry what is buffered, but keep the leases
            if not t.ended:
                with contextlib.suppress(GuestError):
                    await monitor.flush(t, retries=1)
            log.info(monitor.summary(t))
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(s)
        await monitor.close()
    return 0


def _sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) we are up; a no-op outside systemd."""
    import socket

    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(state.encode(), addr)


async def cmd_reserve(args: argparse.Namespace, cfg: GuestConfig, client: HostClient, out: TextIO) -> int:
    """`reserve`: book GPUs for [--start, --start + --duration); print the booking, or the earliest window offered."""
    if args.duration is None:
        raise GuestError("a booking states its length: --duration SECONDS")
    body = request_body(args, cfg)
    body["start_at"] = args.start
    body["accept_deferred"] = bool(args.or_later)
    try:
        _, lease = await client.create_lease(body)
    except ApiError as exc:
        err = (exc.body or {}).get("error", {}) if isinstance(exc.body, dict) else {}
        if exc.status == 409 and err.get("earliest_start") is not None:
            offer = GuestError(f"{exc.server_message}\nthe earliest window that fits starts "
                               f"{_when(err['earliest_start'])}: pass --start {err['earliest_start']:.0f}, or "
                               "--or-later")
            offer.exit_code = exc.exit_code
            raise offer from None
        raise
    emit(args, lease, describe_lease(lease), out)
    return 0


COMMANDS: dict[str, Callable[..., Any]] = {"lease": cmd_lease, "status": cmd_status, "release": cmd_release,
                                           "renew": cmd_renew, "run": cmd_run, "daemon": cmd_daemon,
                                           "reserve": cmd_reserve}


async def amain(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """The CLI as a coroutine (tests call this on their own loop)."""
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose or
                        args.command in ("daemon", "run") else logging.WARNING,
                        format="hostagent-guest: %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, url=args.url, token_file=args.token_file, ca_file=args.ca_file,
                          insecure=args.insecure or None)
        url = require_url(cfg)
        async with HostClient(url, cfg.token(), timeout_s=cfg.request_timeout_s, retries=cfg.retries,
                              backoff_max_s=cfg.backoff_max_s, ssl=ssl_context(cfg.ca_file, cfg.insecure)) as client:
            return int(await COMMANDS[args.command](args, cfg, client, out))
    except GuestError as exc:
        print(f"hostagent-guest: error: {exc.message}", file=sys.stderr, flush=True)
        return exc.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point."""
    try:
        return asyncio.run(amain(argv))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
