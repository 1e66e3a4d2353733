"""A simulated hypervisor: the Hypervisor port in memory, with real domain XML, for tests and the demo.

It behaves like libvirt where leasing depends on it: hostdev XML is applied to a per-domain XML document
(duplicate PCI sources, guest address and alias clashes are refused), a running domain gets live + persistent
changes and a shut-off one persistent only, a live detach completes only when the "guest" acknowledges it
(a DEVICE_REMOVED event after a delay) or never (refusal: the DETACH_PENDING case). Faults to inject:
`fail_attach_after` (an attach fails after that many hostdevs, and what it attached is undone), `refuse_detach`
(the domain's guest never acknowledges a detach: a release's, or the undo of a failed attach, which is then
reported unconfirmed as libvirt's adapter reports it: ``rollback_confirmed`` False in the error's details),
`fail_detach` (the domain's guest rejects unplug requests: DEVICE_REMOVAL_FAILED after the acknowledgement delay).

It is as strict as libvirt and QEMU where they are strict (see hostagent.virt.sim_rules, which cites the sources):
errors carry libvirt's codes (``libvirt_code`` in the details, as the real adapter gives them); with a sysfs root
(the agent's composition passes host.sysfs_root) a live attach of an unmanaged function not on vfio-pci, or of a
group that is not viable or is held by another domain, is refused; a running domain has only so many hot-pluggable
slots (``hotplug_slots``, else the free slots of an i440fx bus 0); a guest acknowledges an unplug after
DETACH_ACK_DELAY_S unless told otherwise; a second unplug request for a device whose unplug is pending fails as
QEMU's device_del does; libvirt's refusals to hot-plug a function other than 0 and to hot-unplug a multifunction
slot are on (both can be turned off, for a test of the agent against an older libvirt). With a path, its state is
written to a JSON file after every change (temp file + fsync + rename) so a killed agent finds, on restart,
the same domains and devices, as it would find them in libvirtd.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lxml import etree

from hostagent.domain.errors import Conflict, HypervisorError, InvalidInput, NotFound
from hostagent.domain.hostdev import HostdevPci, free_guest_slots, parse_domain_hostdevs
from hostagent.virt.port import DetachResult, DomainEvent, DomainInfo, DomainState, EventCallback, EventKind
from hostagent.virt.sim_xml import alias_of, contains, domain_element, find_source, multifunction, remove_source
from hostagent.virt.sim_rules import (VIR_ERR_CONFIG_UNSUPPORTED, VIR_ERR_INTERNAL_ERROR, VIR_ERR_OPERATION_FAILED,
                                      VIR_ERR_OPERATION_INVALID, VIR_ERR_XML_ERROR, HostDevices, libvirt_error,
                                      qemu_error)

log = logging.getLogger("hostagent.virt.sim")

STATE_VERSION = 1
# How long a guest takes to let go of a device: about a second with ACPI hot-unplug (the i440fx bus 0 slots this
# simulator hot-plugs into), about 5 s with PCIe native hot-unplug (pciehp's attention-button wait,
# drivers/pci/hotplug/pciehp_ctrl.c); a test that wants a faster or slower guest says so (detach_ack_delay_s).
DETACH_ACK_DELAY_S = 1.0
RELEASE_POLL_S = 0.05  # how often the simulator answers the fake kernel's requests to let go of a held device
_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, remove_blank_text=True)


@dataclass
class _Domain:
    uuid: str
    name: str
    state: DomainState
    config: Any  # lxml element: the persistent definition
    live: Any | None = None  # lxml element while running
    # alias -> wall-clock time the guest acknowledges the detach, or None when it never will
    pending: dict[str, float | None] = field(default_factory=dict)

    def info(self) -> DomainInfo:
        return DomainInfo(self.name, self.uuid, self.state)

    def current(self) -> Any:
        return self.live if self.live is not None else self.config


class SimulatedHypervisor:
    """The Hypervisor port in memory; lifecycle methods (`define`, `start`, `shutdown`, ...) drive it in tests."""

    def __init__(
        self,
        domains: Iterable[str | DomainInfo] = (),
        *,
        attach_latency_s: float = 0.0,
        detach_ack_delay_s: float = DETACH_ACK_DELAY_S,
        refuse_detach: Iterable[str] = (),
        fail_detach: Iterable[str] = (),
        fail_attach_after: int | None = None,
        refuse_multifunction_unplug: bool = True,
        refuse_nonzero_function_hotplug: bool = True,
        hotplug_slots: int | None = None,
        sysfs_root: str | os.PathLike[str] | None = None,
        path: Path | str | None = None,
    ) -> None:
        self.attach_latency_s = attach_latency_s
        self.detach_ack_delay_s = detach_ack_delay_s
        self.refuse_detach: set[str] = set(refuse_detach)
        # Guests that reject unplug requests (QEMU's DEVICE_UNPLUG_GUEST_ERROR, libvirt's DEVICE_REMOVAL_FAILED):
        # the request fails after the acknowledgement delay and the device stays.
        self.fail_detach: set[str] = set(fail_detach)
        # How many hostdevs a running domain can hold: a q35 guest hot-plugs into its free pcie-root-ports, and
        # libvirt adds none while it runs ("No more available PCI slots"). None: the free slots of bus 0.
        self.hotplug_slots = hotplug_slots
        # The host's sysfs, where a live attach checks what libvirt and QEMU check (sim_rules.HostDevices)
        self.host = HostDevices(sysfs_root) if sysfs_root is not None else None
        # Every single-hostdev attach counts; once `attach_count` reaches this, attaches fail (until reset).
        self.fail_attach_after = fail_attach_after
        self.attach_count = 0
        # libvirt refuses to hot-unplug a device whose guest address is multifunction (qemuIsMultiFunctionDevice,
        # src/qemu/qemu_hotplug.c)
        self.refuse_multifunction_unplug = refuse_multifunction_unplug
        # libvirt refuses a live attach whose guest address has function != 0 (virDomainPCIAddressReserveAddr...,
        # src/conf/domain_addr.c; seen on the real nested libvirtd)
        self.refuse_nonzero_function_hotplug = refuse_nonzero_function_hotplug
        self.path = Path(path) if path is not None else None
        self._domains: dict[str, _Domain] = {}
        self._subscribers: list[EventCallback] = []
        self._waiters: dict[tuple[str, str], list[asyncio.Future[bool]]] = {}
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._release_timer: asyncio.TimerHandle | None = None
        self._seq = 0
        self._written_seq = 0
        self._write_lock = threading.Lock()
        for d in domains:
            if isinstance(d, DomainInfo):
                self._add(d.name, d.uuid, d.state)
            else:
                self._add(d, None, DomainState.RUNNING)
        if self._domains:
            self.save()

    # -- persistence ---------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Path | str, **overrides: Any) -> SimulatedHypervisor:
        """Restore from `path` (an empty hypervisor bound to path when the file does not exist yet)."""
        p = Path(path)
        if not p.exists():
            return cls(path=p, **overrides)
        try:
            doc = json.loads(p.read_text())
            settings = doc["settings"]
            hv = cls(path=p, **{**{
                "attach_latency_s": float(settings["attach_latency_s"]),
                "detach_ack_delay_s": float(settings["detach_ack_delay_s"]),
                "refuse_detach": settings["refuse_detach"],
                "fail_detach": settings.get("fail_detach", ()),
                "fail_attach_after": settings["fail_attach_after"],
                "refuse_multifunction_unplug": bool(settings.get("refuse_multifunction_unplug", True)),
                "refuse_nonzero_function_hotplug": bool(settings.get("refuse_nonzero_function_hotplug", True)),
                "hotplug_slots": settings.get("hotplug_slots"),
            }, **overrides})
            hv.attach_count = int(doc.get("attach_count", 0))
            for d in doc["domains"]:
                dom = _Domain(d["uuid"], d["name"], DomainState(d["state"]), etree.fromstring(d["config"].encode(), _PARSER),
                              etree.fromstring(d["live"].encode(), _PARSER) if d["live"] else None,
                              {k: (None if v is None else float(v)) for k, v in d["pending"].items()})
                hv._domains[dom.uuid] = dom
        except (OSError, ValueError, KeyError, TypeError, etree.XMLSyntaxError) as exc:
            raise HypervisorError(f"simulated hypervisor state {p} is unreadable: {exc}", path=str(p)) from exc
        # The "guest" kept running while nobody watched: detaches it would acknowledge are done by now.
        for dom in hv._domains.values():
            for alias, due in list(dom.pending.items()):
                if due is not None and dom.uuid not in hv.refuse_detach | hv.fail_detach:
                    hv._remove_live(dom, alias)
                elif due is not None:
                    dom.pending.pop(alias, None)  # rejected meanwhile: the device stays
            hv._hold(dom)
        return hv

    def _snapshot(self) -> tuple[int, str]:
        self._seq += 1
        doc = {
            "version": STATE_VERSION,
            "settings": {"attach_latency_s": self.attach_latency_s, "detach_ack_delay_s": self.detach_ack_delay_s,
                         "refuse_detach": sorted(self.refuse_detach), "fail_detach": sorted(self.fail_detach),
                         "fail_attach_after": self.fail_attach_after,
                         "refuse_multifunction_unplug": self.refuse_multifunction_unplug,
                         "refuse_nonzero_function_hotplug": self.refuse_nonzero_function_hotplug,
                         "hotplug_slots": self.hotplug_slots},
            "attach_count": self.attach_count,
            "domains": [
                {"uuid": d.uuid, "name": d.name, "state": d.state.value,
                 "config": etree.tostring(d.config, encoding="unicode"),
                 "live": etree.tostring(d.live, encoding="unicode") if d.live is not None else None,
                 "pending": d.pending}
                for d in self._domains.values()
            ],
        }
        return self._seq, json.dumps(doc, indent=1)

    def _write(self, seq: int, text: str) -> None:
        """Crash-safe replace of the state file; an older snapshot never overwrites a newer one."""
        assert self.path is not None
        with self._write_lock:
            if seq <= self._written_seq:
                return
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            self._written_seq = seq

    def save(self) -> None:
        """Write the state file now (no-op without a path)."""
        if self.path is not None:
            self._write(*self._snapshot())

    async def _save_async(self) -> None:
        if self.path is not None:
            seq, text = self._snapshot()  # taken on the loop, so it is a consistent picture
            await asyncio.to_thread(self._write, seq, text)

    def _save_soon(self) -> None:
        """From a loop callback: snapshot now, write in a worker thread (a real libvirtd's disk writes never block
        the agent's event loop; neither should the simulator's). A crash before the write is safe: the older
        state still lists the acknowledged detach as pending with its due time, and loading completes it."""
        if self.path is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the loop (a test's thread, the CLI): write now
            self.save()
            return
        seq, text = self._snapshot()
        fut = loop.run_in_executor(None, self._write, seq, text)
        fut.add_done_callback(_log_failed_save)

    # -- lifecycle, for tests and the demo -----------------------------------------------------------------------
    def _add(self, name: str, uuid: str | None, state: DomainState) -> _Domain:
        if not name:
            raise InvalidInput("a domain needs a name", field="name")
        if any(d.name == name for d in self._domains.values()):
            raise Conflict(f"domain {name!r} already exists", field="name")
        uid = str(uuidlib.UUID(uuid)) if uuid else str(uuidlib.uuid4())
        if uid in self._domains:
            raise Conflict(f"domain with uuid {uid} already exists", field="uuid")
        dom = _Domain(uid, name, DomainState.SHUT_OFF, domain_element(name, uid))
        self._domains[uid] = dom
        if state is DomainState.RUNNING:
            dom.state, dom.live = DomainState.RUNNING, copy.deepcopy(dom.config)
        elif state is not DomainState.SHUT_OFF:
            dom.state = state
        return dom

    def define(self, name: str, *, running: bool = False, uuid: str | None = None,
               numa_node: int | None = None) -> DomainInfo:
        """Define a new domain (and start it when `running`); `numa_node`: its memory bound to that host node
        (`<numatune><memory mode='strict' nodeset='N'/>`), as an operator pins a VM."""
        dom = self._add(name, uuid, DomainState.SHUT_OFF)
        if numa_node is not None:
            self.set_numa_node(dom.uuid, numa_node)
        self._emit(DomainEvent(dom.uuid, dom.name, EventKind.DEFINED))
        if running:
            self.start(dom.uuid)
        else:
            self.save()
        return dom.info()

    def set_numa_node(self, name_or_uuid: str, node: int | None) -> None:
        """Bind the domain's memory to a host NUMA node, or unbind it (None), in its definition and, when it runs,
        live: `virsh numatune DOMAIN --mode strict --nodeset N --live --config`."""
        dom = self._find(name_or_uuid)
        for el in (dom.config, dom.live):
            if el is None:
                continue
            for old in el.findall("numatune"):
                el.remove(old)
            if node is not None:
                tune = etree.Element("numatune")
                etree.SubElement(tune, "memory", mode="strict", nodeset=str(node))
                el.find("vcpu").addnext(tune)
        self.save()

    def start(self, name_or_uuid: str) -> None:
        """Boot a shut-off domain: its live XML becomes a copy of the persistent one."""
        dom = self._find(name_or_uuid)
        if dom.state is DomainState.RUNNING:
            raise HypervisorError(f"domain {dom.name} is already running", domain=dom.name)
        # libvirt refuses to start a domain whose hostdev cannot be assigned (virHostdevPreparePCIDevices): in use by
        # another running domain, or (with the host's sysfs) not on a stub driver, or its group not viable.
        busy = self._sources_in_use(exclude=dom.uuid)
        for hd in parse_domain_hostdevs(etree.tostring(dom.config)):
            self._check_host(dom, hd, busy)
        dom.state, dom.live = DomainState.RUNNING, copy.deepcopy(dom.config)
        self._hold(dom)
        self.save()
        self._emit(DomainEvent(dom.uuid, dom.name, EventKind.STARTED))

    def shutdown(self, name_or_uuid: str) -> None:
        """Stop a running domain (its devices leave with the guest)."""
        self._stop(self._find(name_or_uuid), DomainState.SHUT_OFF, EventKind.STOPPED)

    def crash(self, name_or_uuid: str) -> None:
        """The guest crashed: stopped, with a crashed event."""
        self._stop(self._find(name_or_uuid), DomainState.CRASHED, EventKind.CRASHED)

    def undefine(self, name_or_uuid: str) -> None:
        """Remove a domain (a running one is stopped first)."""
        dom = self._find(name_or_uuid)
        if dom.live is not None:
            self._stop(dom, DomainState.SHUT_OFF, EventKind.STOPPED)
        del self._domains[dom.uuid]
        self.save()
        self._emit(DomainEvent(dom.uuid, dom.name, EventKind.UNDEFINED))

    def acknowledge_detaches(self, name_or_uuid: str) -> int:
        """The guest finally lets go: complete every pending detach of the domain now; returns how many."""
        dom = self._find(name_or_uuid)
        self.refuse_detach.discard(dom.uuid)
        self.fail_detach.discard(dom.uuid)
        aliases = list(dom.pending)
        for alias in aliases:
            self._complete(dom.uuid, alias)
        self.save()
        return len(aliases)

    def set_refuse_detach(self, name_or_uuid: str, refuse: bool = True) -> None:
        """Make the domain's guest ignore (or again honour) detach requests."""
        dom = self._find(name_or_uuid)
        (self.refuse_detach.add if refuse else self.refuse_detach.discard)(dom.uuid)
        self.save()

    def eject(self, name_or_uuid: str, address: str) -> None:
        """The guest ejects a device by itself (an ACPI eject from inside it): the device leaves the live XML and
        DEVICE_REMOVED fires, with no detach asked for."""
        dom = self._find(name_or_uuid)
        for node in (dom.live.iterfind("devices/hostdev[@type='pci']") if dom.live is not None else ()):
            if str(HostdevPci.from_xml(node).source) == address:
                alias = alias_of(node)
                dom.pending[alias] = time.time()
                self._complete(dom.uuid, alias)
                return
        raise NotFound(f"{address} is not in the running domain {dom.name}", field="address")

    def set_fail_detach(self, name_or_uuid: str, fail: bool = True) -> None:
        """Make the domain's guest reject (or again accept) unplug requests: DEVICE_REMOVAL_FAILED, device kept."""
        dom = self._find(name_or_uuid)
        (self.fail_detach.add if fail else self.fail_detach.discard)(dom.uuid)
        self.save()

    def domains_sync(self) -> list[DomainInfo]:
        """Every domain, without an event loop (for setup code)."""
        return [d.info() for d in self._domains.values()]

    def _stop(self, dom: _Domain, state: DomainState, kind: EventKind) -> None:
        if dom.live is None:
            raise HypervisorError(f"domain {dom.name} is not running", domain=dom.name)
        if self.host is not None:  # QEMU exits: every vfio device it held is closed
            for hd in parse_domain_hostdevs(etree.tostring(dom.live)):
                self.host.close(str(hd.source))
        dom.state, dom.live = state, None
        for alias in list(dom.pending):
            self._cancel_timer(dom.uuid, alias)
            # The device left with the guest: a waiting detach is now truly done.
            self._resolve(dom.uuid, alias, True)
        dom.pending.clear()
        self.save()
        self._emit(DomainEvent(dom.uuid, dom.name, kind))

    # -- the port ------------------------------------------------------------------------------------------------
    async def list_domains(self) -> list[DomainInfo]:
        """Every domain, running or not."""
        return self.domains_sync()

    async def get_domain(self, name_or_uuid: str) -> DomainInfo:
        """One domain by name or UUID; NotFound when unknown."""
        return self._find(name_or_uuid).info()

    async def domain_xml(self, uuid: str, live: bool = True) -> str:
        """The live XML (running domain) or the persistent XML."""
        dom = self._find(uuid)
        el = dom.current() if live else dom.config
        return str(etree.tostring(el, encoding="unicode", pretty_print=True))

    async def attached_hostdevs(self, uuid: str) -> tuple[HostdevPci, ...]:
        """PCI hostdevs in the domain now (live XML when running)."""
        return parse_domain_hostdevs(etree.tostring(self._find(uuid).current()))

    async def attach_hostdevs(self, uuid: str, hostdevs: Sequence[HostdevPci]) -> None:
        """Attach one by one (live + config when running, live only where the config holds it already); undo the
        ones done if a later one fails."""
        dom = self._find(uuid)
        if self.attach_latency_s:
            await asyncio.sleep(self.attach_latency_s)
        done: list[HostdevPci] = []
        try:
            for hd in hostdevs:
                if self.fail_attach_after is not None and self.attach_count >= self.fail_attach_after:
                    raise qemu_error("device_add", f"simulated failure attaching {hd.source} to {dom.name}",
                                     domain=dom.name, address=str(hd.source))
                # Running, a device its definition holds already goes in live only, as the libvirt adapter does.
                in_config = dom.live is not None and find_source(dom.config, hd) is not None
                targets = ([] if in_config else [dom.config]) + ([dom.live] if dom.live is not None else [])
                for el in targets:
                    self._check_attach(dom, el, hd, live=el is dom.live)
                if dom.live is not None:
                    self._check_host(dom, hd, self._sources_in_use(exclude=dom.uuid))
                for el in targets:
                    self._insert(el, hd)
                if dom.live is not None and self.host is not None:
                    self.host.open(str(hd.source), dom.name)
                self.attach_count += 1
                done.append(hd)
            missing = [hd for hd in hostdevs if not contains(dom.current(), hd)]
            if missing:
                raise libvirt_error(f"attached hostdevs missing from the domain XML: {[str(h.source) for h in missing]}",
                                    VIR_ERR_INTERNAL_ERROR, domain=dom.name)
        except HypervisorError as exc:
            if done:
                # The undo is a detach, as libvirt's adapter makes it (and says whether it was confirmed): a guest
                # that ignores detach requests (`refuse_detach`) keeps the devices it got in its live XML.
                unconfirmed = self._undo_attach(dom, done)
                exc.details["rollback_confirmed"] = not unconfirmed
                if unconfirmed:
                    exc.details["rollback_pending"] = [str(hd.source) for hd in unconfirmed]
            await self._save_async()
            raise
        await self._save_async()

    def _undo_attach(self, dom: _Domain, done: Sequence[HostdevPci]) -> list[HostdevPci]:
        """Remove what a failed attach added; return the hostdevs whose live removal the guest never confirms.

        The persistent part goes at once (as in libvirt). A running guest that refuses detaches keeps each device
        in its live XML as a pending detach that is never acknowledged (no DEVICE_REMOVED, until
        `acknowledge_detaches` or the domain stops): the unconfirmed undo after which nothing may give the device
        back to a host driver. Any other guest lets go at once."""
        unconfirmed = []
        for hd in done:
            remove_source(dom.config, hd)
            if dom.live is None:
                continue
            el = find_source(dom.live, hd)
            if el is None:
                continue
            if dom.uuid in self.refuse_detach:
                dom.pending[alias_of(el)] = None
                unconfirmed.append(hd)
            else:
                remove_source(dom.live, hd)
                if self.host is not None:
                    self.host.close(str(hd.source))
        return unconfirmed

    async def detach_hostdevs(self, uuid: str, hostdevs: Sequence[HostdevPci], timeout_s: float) -> DetachResult:
        """Detach; on a running domain wait up to timeout_s for the guest's acknowledgement of each."""
        dom = self._find(uuid)
        if dom.live is None:
            for hd in hostdevs:
                remove_source(dom.config, hd)
            await self._save_async()
            return DetachResult(removed=tuple(hostdevs))
        loop = asyncio.get_running_loop()
        waits: list[tuple[HostdevPci, asyncio.Future[bool] | None]] = []
        errors: list[str] = []
        for hd in hostdevs:
            remove_source(dom.config, hd)  # the persistent part is immediate, as in libvirt
            el = find_source(dom.live, hd)
            if el is None:
                waits.append((hd, None))  # not attached (any more): nothing to wait for
                continue
            if self.refuse_multifunction_unplug and multifunction(dom.live, el):
                errors.append(libvirt_error(f"cannot hot unplug hostdev device with multifunction PCI guest address: "
                                            f"{hd.source}", VIR_ERR_OPERATION_FAILED).message)
                waits.append((hd, _never_removed(loop)))
                continue
            alias = alias_of(el)
            fut: asyncio.Future[bool] = loop.create_future()
            self._waiters.setdefault((dom.uuid, alias), []).append(fut)
            waits.append((hd, fut))
            if alias in dom.pending:
                # QEMU refuses a second device_del while the first is pending (qmp_device_del, softmmu/qdev-monitor.c:
                # "is already in the process of unplug"); libvirt then still waits for the device's DEVICE_REMOVED.
                errors.append(qemu_error("device_del", f"Device {alias} is already in the process of unplug").message)
                continue
            self._request_unplug(dom, alias, loop)
        await self._save_async()
        futures = [f for _, f in waits if f is not None]
        if futures:
            await asyncio.wait(futures, timeout=max(0.0, timeout_s))
        removed: list[HostdevPci] = []
        pending: list[HostdevPci] = []
        for hd, waiter in waits:
            ok = waiter is None or (waiter.done() and not waiter.cancelled() and waiter.result())
            (removed if ok else pending).append(hd)
            if waiter is not None and not waiter.done():
                waiter.cancel()
        self._prune_waiters()
        return DetachResult(removed=tuple(removed), pending=tuple(pending), errors=tuple(errors))

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        """Call `callback` for every DomainEvent; returns an unsubscribe function."""
        self._subscribers.append(callback)
        if self.host is not None and self._release_timer is None:
            with contextlib.suppress(RuntimeError):  # no running loop (set-up code): nothing to answer yet
                self._release_timer = asyncio.get_running_loop().call_later(RELEASE_POLL_S,
                                                                            self._watch_release_requests)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    async def close(self) -> None:
        """Cancel acknowledgement timers and write the state one last time."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        await self._save_async()

    # -- internals -----------------------------------------------------------------------------------------------
    def _find(self, name_or_uuid: str) -> _Domain:
        key = name_or_uuid.strip().lower()
        if key in self._domains:
            return self._domains[key]
        for d in self._domains.values():
            if d.name == name_or_uuid:
                return d
        raise NotFound(f"no domain {name_or_uuid!r}", field="domain")

    def _sources_in_use(self, *, exclude: str) -> dict[Any, str]:
        busy = {}
        for d in self._domains.values():
            if d.uuid != exclude and d.live is not None:
                for hd in parse_domain_hostdevs(etree.tostring(d.live)):
                    busy[hd.source] = d.name
        return busy

    def _check_host(self, dom: _Domain, hd: HostdevPci, busy: dict[Any, str]) -> None:
        """What libvirt checks of the host side before a hostdev goes into a running domain."""
        if hd.source in busy:
            raise libvirt_error(f"PCI device {hd.source} is in use by driver QEMU, domain {busy[hd.source]}",
                                VIR_ERR_OPERATION_INVALID, domain=dom.name, address=str(hd.source))
        if self.host is not None:
            self.host.check_assignable(str(hd.source), managed=hd.managed, domain=dom.name,
                                       in_use={str(src): name for src, name in busy.items()})

    def _check_attach(self, dom: _Domain, el: Any, hd: HostdevPci, *, live: bool) -> None:
        where = "live" if live else "persistent"
        existing = parse_domain_hostdevs(etree.tostring(el))
        if any(h.source == hd.source for h in existing):
            # qemuDomainAttachDeviceConfig ("device is already in the domain configuration"); a live one is in use
            raise libvirt_error(f"PCI device {hd.source} is already in the {where} definition of {dom.name}",
                                VIR_ERR_OPERATION_INVALID, domain=dom.name, address=str(hd.source))
        # Compared in Python, not by an XPath predicate built from the alias: ElementPath has no concat(), so no
        # literal can hold both quote characters, and an alias is the caller's text.
        if hd.alias is not None and any(a.get("name") == hd.alias for a in el.iterfind("devices/*/alias")):
            # virDomainDeviceDefValidateAliasesIterator, src/conf/domain_validate.c
            raise libvirt_error(f"non unique alias detected: {hd.alias}", VIR_ERR_CONFIG_UNSUPPORTED,
                                domain=dom.name, alias=hd.alias)
        if live and hd.guest is not None and hd.guest.function != 0 and self.refuse_nonzero_function_hotplug:
            raise libvirt_error("Only PCI device addresses with function=0 are supported", VIR_ERR_INTERNAL_ERROR,
                                domain=dom.name, address=str(hd.source))
        if hd.guest is not None:
            g = hd.guest
            for addr in el.iterfind("devices/*/address[@type='pci']"):
                if (int(addr.get("domain", "0"), 16), int(addr.get("bus", "0"), 16), int(addr.get("slot", "0"), 16),
                        int(addr.get("function", "0"), 16)) == (g.domain, g.bus, g.slot, g.function):
                    # virDomainPCIAddressReserveAddrInternal: XML error for the definition, internal error live
                    raise libvirt_error(f"Attempted double use of PCI Address {g.pci} in {dom.name}",
                                        VIR_ERR_INTERNAL_ERROR if live else VIR_ERR_XML_ERROR, domain=dom.name,
                                        guest_address=str(g.pci))
        if live:
            held = len(existing)
            if hd.guest is None:
                try:
                    free_guest_slots(etree.tostring(el), 0, 1)
                    free = True
                except Conflict:
                    free = False
            else:
                free = True  # its own address: checked for clashes above
            if (self.hotplug_slots is not None and held >= self.hotplug_slots) or not free:
                # qemuDomainPCIAddressSetNextAddr / virDomainPCIAddressGetNextAddr, src/conf/domain_addr.c
                raise libvirt_error("No more available PCI slots", VIR_ERR_INTERNAL_ERROR, domain=dom.name,
                                    address=str(hd.source), hotplug_slots=self.hotplug_slots)

    def _insert(self, el: Any, hd: HostdevPci) -> None:
        node = hd.to_element()
        if hd.guest is None:
            slot = free_guest_slots(etree.tostring(el), 0, 1)[0]
            etree.SubElement(node, "address", type="pci", domain="0x0000", bus="0x00", slot=f"0x{slot:02x}",
                             function="0x0")
        if hd.alias is None:
            # libvirt names unaliased devices itself; do the same so detach events can name them.
            n = len(el.findall("devices/hostdev"))
            alias = etree.Element("alias", name=f"hostdev{n}")
            node.insert(list(node).index(node.find("source")) + 1, alias)  # type: ignore[arg-type]
        el.find("devices").append(node)

    def _complete(self, uuid: str, alias: str) -> None:
        """The guest acknowledged: the device leaves the live XML and DEVICE_REMOVED fires. A guest that rejects
        unplugs (`fail_detach`) answers instead with DEVICE_REMOVAL_FAILED (QEMU's DEVICE_UNPLUG_GUEST_ERROR), the
        device stays, and a later request may try again."""
        self._timers.pop((uuid, alias), None)
        dom = self._domains.get(uuid)
        if dom is None or alias not in dom.pending:
            return
        if uuid in self.fail_detach:
            dom.pending.pop(alias, None)
            self._save_soon()
            self._resolve(uuid, alias, False)
            self._emit(DomainEvent(dom.uuid, dom.name, EventKind.DEVICE_REMOVAL_FAILED, alias))
            return
        self._remove_live(dom, alias)
        self._save_soon()
        self._resolve(uuid, alias, True)
        self._emit(DomainEvent(dom.uuid, dom.name, EventKind.DEVICE_REMOVED, alias))

    def _remove_live(self, dom: _Domain, alias: str) -> None:
        dom.pending.pop(alias, None)
        if dom.live is not None:
            for node in dom.live.iterfind("devices/hostdev"):
                if alias_of(node) == alias:
                    node.getparent().remove(node)
                    if self.host is not None:
                        self.host.close(str(HostdevPci.from_xml(node).source))

    def _hold(self, dom: _Domain) -> None:
        """QEMU of a running domain holds the vfio device of every hostdev in its live XML (see sim_rules)."""
        if self.host is not None and dom.live is not None:
            for hd in parse_domain_hostdevs(etree.tostring(dom.live)):
                self.host.open(str(hd.source), dom.name)

    def _watch_release_requests(self) -> None:
        """Answer the kernel's requests to let go of a held vfio device (an unbind of vfio-pci under a running
        guest) as QEMU does: it asks the guest to unplug the device; a guest that acknowledges lets go (then
        DEVICE_REMOVED, and the blocked unbind completes), one that refuses keeps it, and the unbind stays blocked.
        Runs every RELEASE_POLL_S on the event loop while subscribers exist."""
        self._release_timer = None
        if self.host is None or not self._subscribers:
            return
        loop = asyncio.get_running_loop()
        for address in self.host.take_requests():
            for dom in self._domains.values():
                if dom.live is None:
                    continue
                for node in dom.live.iterfind("devices/hostdev[@type='pci']"):
                    if str(HostdevPci.from_xml(node).source) == address:
                        self._request_unplug(dom, alias_of(node), loop)
        self._release_timer = loop.call_later(RELEASE_POLL_S, self._watch_release_requests)

    def _request_unplug(self, dom: _Domain, alias: str, loop: asyncio.AbstractEventLoop) -> None:
        """Ask the guest to let go of `alias` (a device_del): acknowledged after the delay, refused, or rejected."""
        if alias in dom.pending:
            return
        if dom.uuid in self.refuse_detach:
            dom.pending[alias] = None
        elif (dom.uuid, alias) not in self._timers:
            dom.pending[alias] = time.time() + self.detach_ack_delay_s
            self._timers[(dom.uuid, alias)] = loop.call_later(self.detach_ack_delay_s, self._complete, dom.uuid, alias)

    def _resolve(self, uuid: str, alias: str, value: bool) -> None:
        for fut in self._waiters.pop((uuid, alias), []):
            if not fut.done():
                fut.set_result(value)

    def _cancel_timer(self, uuid: str, alias: str) -> None:
        handle = self._timers.pop((uuid, alias), None)
        if handle is not None:
            handle.cancel()

    def _prune_waiters(self) -> None:
        for key in [k for k, futs in self._waiters.items() if all(f.done() for f in futs)]:
            del self._waiters[key]

    def _emit(self, event: DomainEvent) -> None:
        for cb in list(self._subscribers):
            try:
                cb(event)
            except Exception:
                log.exception("event subscriber failed on %s", event.kind.value)


def _never_removed(loop: asyncio.AbstractEventLoop) -> asyncio.Future[bool]:
    fut: asyncio.Future[bool] = loop.create_future()
    fut.set_result(False)
    return fut


def _log_failed_save(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("simulated hypervisor: writing the state file failed: %s", fut.exception())
