"""The demo's past: days of usage made by running its simulated guests against the real agent on a fast clock.

Before the demo serves, :func:`write_history` builds the agent on the demo's own state (journal, usage store,
simulated host) with a virtual clock that starts ``days`` ago, serves its API on a loopback port, and lets the
guests of :mod:`hostagent.demo.guests` live through those days in steps of a minute: they lease, heartbeat through
the guest agent's code, wait in the queue, get partial grants, finish, and forget GPUs that the agent's own reaper
then reclaims (its two strikes driven by the same virtual clock). Every lease, event, sample and reclaim reaches the
journal and the store by the agent's normal write path; nothing is written as a hand-made row. Then the placement
model is trained from those records with the real lifecycle, so the first page opened shows charts, a model in use
with its evaluation figures, explained placement decisions and a reclaim history.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostagent.config import Settings
from hostagent.demo.guests import DemoGuest, HostInterrupts, Pace, gpu_info
from hostagent.guest.client import HostClient

log = logging.getLogger("hostagent.demo")

# Jobs of 20 minutes to 5 hours, think times up to an hour: about a hundred leases a day on the demo's 16 GPUs.
HISTORY = Pace(think_s=(300.0, 3600.0), busy_s=(1200.0, 5 * 3600.0), forget_chance=0.15, priority_chance=0.1,
               queue_patience_s=2 * 3600.0, heartbeat_s=300.0, sample_s=60.0, book_chance=0.1,
               book_ahead_s=(1800.0, 6 * 3600.0))
STEP_S = 60.0  # the virtual clock's step: a guest samples once per step at most
# The detector's periods in the history (the operator's defaults scaled by a half): a forgotten GPU is reclaimed
# within about an hour of going idle.
HISTORY_RECLAIM = {"enabled": True, "check_interval_s": 1800.0, "grace_s": 900.0, "min_lease_age_s": 900.0,
                   "notice_window_s": 300.0}


@dataclass
class VirtualClock:
    """The history's clock: moved by the driver, read by the agent and the guests."""

    now: float

    def __call__(self) -> float:
        return self.now


def history_settings(settings: Settings) -> Settings:
    """The demo's settings with the history's reclaim periods, served on a loopback port of its own."""
    reclaim = dataclasses.replace(settings.reclaim, **HISTORY_RECLAIM)  # type: ignore[arg-type]
    agent = dataclasses.replace(settings.agent, listen="127.0.0.1", port=0, metrics_listen="")
    return dataclasses.replace(settings, reclaim=reclaim, agent=agent)


async def write_history(settings: Settings, creds: dict[str, Any], hv_path: Path, *, days: float, seed: int = 1,
                        now: float | None = None) -> dict[str, Any]:
    """Live `days` of the demo's guests on a virtual clock ending at `now`; return what happened."""
    from aiohttp import web

    from hostagent.runtime import build_runtime, make_app
    from hostagent.virt.sim import SimulatedHypervisor

    end = time.time() if now is None else now
    # the past is summed up in one line at its end: its guests' and the agent's step-by-step chatter stays quiet
    quiet = {name: logging.getLogger(name) for name in ("hostagent.guest", "hostagent.reaper", "hostagent.host",
                                                        "hostagent.leases", "hostagent.placement")}
    levels = {name: lg.level for name, lg in quiet.items()}
    for lg in quiet.values():
        lg.setLevel(logging.ERROR)
    clock = VirtualClock(end - days * 86400.0)
    hs = history_settings(settings)
    # The simulated guests of the past acknowledge unplugs at once and attaches take no time: no wall time is spent
    # waiting for what a virtual minute covers anyway.
    hv = SimulatedHypervisor.load(hv_path, sysfs_root=hs.host.sysfs_root, attach_latency_s=0.0, detach_ack_delay_s=0.0)
    rt = build_runtime(hs, hypervisor=hv, clock=clock)
    runner = web.AppRunner(make_app(rt))
    await runner.setup()
    guests: list[DemoGuest] = []
    started = time.monotonic()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # noqa: SLF001
        url = f"http://127.0.0.1:{port}"
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(HostClient(url, vm["token"], retries=0))
                       for vm in creds["vms"]]
            info = await gpu_info(clients[0])
            rng = random.Random(seed)
            irq = HostInterrupts(hs.proc_root)
            guests = [DemoGuest(vm["domain"], c, HISTORY, clock, random.Random(rng.randrange(1 << 30)), info, irq)
                      for vm, c in zip(creds["vms"], clients)]
            next_tick = clock.now
            while clock.now < end:
                clock.now = min(end, clock.now + STEP_S)
                for g in guests:
                    await g.step()
                irq.publish()
                if clock.now >= next_tick:
                    await rt.reaper.tick()
                    next_tick = clock.now + 60.0
                await asyncio.sleep(0)  # the agent's own tasks (queue drains, the ingest flush) run between steps
            for g in guests:
                await g.leave()
            await rt.ingestor.flush()
    finally:
        await runner.cleanup()
        for name, lg in quiet.items():
            lg.setLevel(levels[name])
    counts: dict[str, int] = {}
    for g in guests:
        for k, v in g.counts.items():
            counts[k] = counts.get(k, 0) + v
    return {"days": days, "wall_s": round(time.monotonic() - started, 1), **counts}


def train_model(settings: Settings, now: float | None = None) -> dict[str, Any]:
    """Train the placement model from the store's records (the real lifecycle) and activate it if it is good."""
    from hostagent.learn import lifecycle
    from hostagent.store.repo import UsageStore

    store = UsageStore(settings.store_url, settings.agent.host_id, spool_path=settings.spool_path,
                       auto_upgrade=True)
    try:
        res = lifecycle.train(store, target=settings.placement.outcome, min_records=settings.placement.min_records,
                              now=now)
        return res.to_dict()
    finally:
        store.close()
