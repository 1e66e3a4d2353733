"""The guest agent's parts without a host: bus ids, device mapping, the sample buffer, work rate, config, sampler."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from hostagent.guest.buffer import SampleBuffer
from hostagent.guest.cli import describe_lease
from hostagent.guest.config import GuestConfigError, load_config
from hostagent.guest.errors import ApiError
from hostagent.guest.mapping import map_devices
from hostagent.guest.sampler import (GpuInfo, Reading, Sampler, WorkRateSource, main, normalize_bus_id,
                                     parse_work_rate, pci_names, scan_display_devices)
from tests.support.guest import FakeGpu, FakeNvml, guest_sysfs

ROOT = Path(__file__).resolve().parents[2]


def test_bus_ids_from_nvml_and_sysfs_normalize_alike() -> None:
    assert normalize_bus_id(b"00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("00000001:0A:1F.7") == "0001:0a:1f.7"
    assert normalize_bus_id("junk") == "junk"


def gpu(index: int, bus: str) -> GpuInfo:
    return GpuInfo(index, bus, "GPU")


def lease(lid: str, *devs: tuple[str, str]) -> dict[str, object]:
    return {"id": lid, "devices": [{"gpu_id": g, "guest_addresses": [a, a[:-1] + "1"]} for g, a in devs]}


def test_mapping_by_guest_address_beats_order() -> None:
    devices = [gpu(0, "0000:00:05.0"), gpu(1, "0000:00:06.0")]
    m = map_devices(devices, [lease("l1", ("gpu-b", "0000:00:06.0"), ("gpu-a", "0000:00:05.0"))])
    assert dict(m.gpu_of) == {1: "gpu-b", 0: "gpu-a"} and set(m.how.values()) == {"pci-address"}
    assert m.index_of("gpu-b") == 1 and m.unmapped == ()


def test_mapping_falls_back_to_order_without_claiming_matched_devices() -> None:
    # q35: the guest numbered the buses itself; one lease still matches by address.
    devices = [gpu(0, "0000:01:00.0"), gpu(1, "0000:00:05.0"), gpu(2, "0000:02:00.0")]
    leases = [lease("l1", ("gpu-a", "0000:07:01.0"), ("gpu-b", "0000:07:02.0")), lease("l2", ("gpu-c", "0000:00:05.0"))]
    m = map_devices(devices, leases)
    assert m.gpu_of[1] == "gpu-c" and m.how[1] == "pci-address"
    assert (m.gpu_of[0], m.gpu_of[2]) == ("gpu-a", "gpu-b") and m.how[0] == m.how[2] == "order"


def test_mapping_reports_leased_gpus_the_guest_does_not_see() -> None:
    m = map_devices([gpu(0, "0000:00:05.0")], [lease("l1", ("gpu-a", "0000:00:05.0"), ("gpu-b", "0000:00:09.0"))])
    assert m.unmapped == ("gpu-b",) and dict(m.gpu_of) == {0: "gpu-a"}


def test_buffer_drops_oldest_counts_and_commits_only_what_was_sent() -> None:
    b = SampleBuffer(3)
    items = [{"ts": float(i)} for i in range(5)]
    for s in items:
        b.add(s)
    assert len(b) == 3 and b.dropped == 2 and [s["ts"] for s in b.peek(10)] == [2.0, 3.0, 4.0]
    batch = b.peek(2)
    b.add({"ts": 5.0})  # overtakes the batch's head while it is in flight
    b.commit(batch)
    assert [s["ts"] for s in b.peek(10)] == [4.0, 5.0] and b.dropped == 3
    b.reject(b.peek(1)[0])
    assert b.rejected == 1 and [s["ts"] for s in b.peek(10)] == [5.0]
    with pytest.raises(ValueError):
        SampleBuffer(0)


def test_work_rate_text_forms() -> None:
    assert parse_work_rate("12.5\n") == 12.5
    assert parse_work_rate('{"0": 3, "0000:00:05.0": 4.5, "x": -1}') == {"0": 3.0, "0000:00:05.0": 4.5}
    assert parse_work_rate("") is None and parse_work_rate("fast") is None and parse_work_rate("-3") is None


def reading(index: int = 0, bus: str = "0000:00:05.0") -> Reading:
    return Reading(100.0, index, bus, 50.0, 1, None, None)


def test_work_rate_file_goes_stale(tmp_path: Path) -> None:
    path = tmp_path / "rate"
    path.write_text("42\n")
    os.utime(path, (1000.0, 1000.0))
    now = [1010.0]
    src = WorkRateSource(str(path), stale_s=30.0, clock=lambda: now[0])
    assert src.apply([reading()])[0].work_rate == 42.0
    now[0] = 1031.0  # the job stopped reporting: a rate from long ago is not current work
    assert src.apply([reading()])[0].work_rate is None


def test_work_rate_socket_keeps_the_latest_value(tmp_path: Path) -> None:
    path = tmp_path / "rate.sock"
    src = WorkRateSource(f"unix:{path}")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"1.0", str(path))
            s.sendto(b'{"1": 7.0}', str(path))
        r0, r1 = src.apply([reading(0), reading(1, "0000:00:06.0")])
        assert r0.work_rate is None and r1.work_rate == 7.0
    finally:
        src.close()
    assert not path.exists()


def test_config_precedence_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "guest.toml"
    f.write_text('[guest]\nurl = "http://file:1"\nheartbeat_interval_s = 10\nstop_gpu_users = true\n')
    cfg = load_config(str(f), env={})
    assert cfg.url == "http://file:1" and cfg.heartbeat_interval_s == 10.0 and cfg.stop_gpu_users
    cfg = load_config(str(f), env={"HOSTAGENT_URL": "http://env:2", "HOSTAGENT_TOKEN_FILE": "/t"})
    assert (cfg.url, cfg.token_file) == ("http://env:2", "/t")
    assert load_config(str(f), env={"HOSTAGENT_URL": "http://env:2"}, url="https://flag:3").url == "https://flag:3"
    assert load_config(None, env={"HOSTAGENT_GUEST_CONFIG": str(f)}).url == "http://file:1"
    f.write_text('urll = "x"\n')
    with pytest.raises(GuestConfigError, match="unknown key 'urll'"):
        load_config(str(f), env={})
    f.write_text('retries = "many"\n')
    with pytest.raises(GuestConfigError, match="retries must be a int"):
        load_config(str(f), env={})
    with pytest.raises(GuestConfigError, match="config file /nonexistent does not exist"):
        load_config(None, env={"HOSTAGENT_GUEST_CONFIG": "/nonexistent"})  # named explicitly: must exist
    f.write_text("")
    with pytest.raises(GuestConfigError, match="batch_max must be 1..1000"):
        load_config(str(f), env={}, batch_max=1001)
    with pytest.raises(GuestConfigError, match="url must start with http"):
        load_config(str(f), env={}, url="ftp://x")


def test_api_error_messages_name_the_cause() -> None:
    e = ApiError(503, "overloaded", "ingestion queue full", None, 2.0)
    assert "overloaded" in e.message and "retry after 2 s" in e.message and e.exit_code == 3
    e = ApiError(409, "conflict", "no free GPU matches", "gpus")
    assert e.message == "the host agent refused (409 conflict) [gpus]: no free GPU matches"


# ---- the sampler --------------------------------------------------------------------------------------------


def test_nvml_sampler_reads_every_gpu_and_tolerates_partial_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu("00000000:00:05.0", util=30, used=5, pids=[11, 12]), FakeGpu("00000000:00:06.0", util=90)]
    FakeNvml(gpus).install(monkeypatch)
    s = Sampler.open(sys_root="/nonexistent")
    assert s.available and s.note == "NVML: driver 550.54.15, 2 GPU(s)"
    assert [d.bus_id for d in s.devices] == ["0000:00:05.0", "0000:00:06.0"]
    r = s.read(5.0)
    assert (r[0].util_pct, r[0].mem_used_bytes, r[0].processes) == (30.0, 5, (11, 12))
    gpus[1].broken = True  # a GPU that falls off the bus: None values, the other still reports
    r = s.read(6.0)
    assert r[0].util_pct == 30.0 and r[1].util_pct is None and r[1].mem_used_bytes is None


def test_processes_not_supported_is_unknown_not_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml([FakeGpu("00000000:00:05.0")], processes_supported=False).install(monkeypatch)
    assert Sampler.open(sys_root="/nonexistent").read()[0].processes is None


def test_without_nvml_the_sampler_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    s = Sampler.open(sys_root="/nonexistent")
    assert not s.available and s.read() == [] and "NVML did not initialise" in s.note


def test_amdgpu_sysfs_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND).install(monkeypatch)
    root = guest_sysfs(tmp_path, {"0000:00:07.0": ("0x038000", "0x1002", "0x740f"),
                                  "0000:00:01.0": ("0x060100", "0x8086", "0x7000")})
    dev = root / "bus/pci/devices/0000:00:07.0"
    (dev / "gpu_busy_percent").write_text("37\n")
    (dev / "mem_info_vram_used").write_text("1024\n")
    (dev / "mem_info_vram_total").write_text("4096\n")
    s = Sampler.open(sys_root=str(root))
    assert s.backend is not None and s.backend.source == "sysfs"
    [r] = s.read(1.0)
    assert (r.bus_id, r.util_pct, r.mem_used_bytes, r.mem_total_bytes) == ("0000:00:07.0", 37.0, 1024, 4096)


def test_pci_scan_lists_display_controllers_with_names(tmp_path: Path) -> None:
    root = guest_sysfs(tmp_path / "sys", {"0000:00:02.0": ("0x030000", "0x1234", "0x1111"),
                                          "0000:00:05.0": ("0x030200", "0x10de", "0x2330"),
                                          "0000:00:03.0": ("0x020000", "0x8086", "0x100e")})
    drivers = tmp_path / "sys/bus/pci/drivers/nvidia"
    drivers.mkdir(parents=True)
    (root / "bus/pci/devices/0000:00:05.0/driver").symlink_to(drivers)
    found = scan_display_devices(root)
    assert [(d.address, d.driver) for d in found] == [("0000:00:02.0", None), ("0000:00:05.0", "nvidia")]
    ids = tmp_path / "pci.ids"
    ids.write_text("# c\n10de  NVIDIA Corporation\n\t2330  GH100 [H100 SXM5 80GB]\n\t\t10de 16c1  sub\n"
                   "1234  Technical Corp\nC 00  Unclassified\n")
    assert pci_names("10de", "2330", [str(ids)]) == "NVIDIA Corporation GH100 [H100 SXM5 80GB]"
    assert pci_names("1234", "9999", [str(ids)]) == "Technical Corp device 9999"
    assert pci_names("abcd", "0001", [str(ids)]) == "PCI device abcd:0001"


def test_sampler_main_once_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    FakeNvml([FakeGpu("00000000:00:05.0", util=12, used=3, pids=[7])]).install(monkeypatch)
    assert main(["--once", "--json", "--sys-root", "/nonexistent"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["source"] == "nvml" and snap["readings"][0]["util_pct"] == 12.0
    assert snap["readings"][0]["process_count"] == 1 and snap["readings"][0]["mem_used_bytes"] == 3


def test_sampler_module_without_nvml_says_so_and_fails() -> None:
    """The real module as a process on this GPU-less machine (pynvml finds no driver library)."""
    r = subprocess.run([sys.executable, "-m", "hostagent.guest.sampler", "--once", "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    snap = json.loads(r.stdout)
    assert r.returncode == 1 and snap["available"] is False and "NVML" in snap["note"]


def test_guest_package_imports_nothing_host_only() -> None:
    code = ("import sys, hostagent.guest.cli, hostagent.guest.sampler;"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('libvirt', 'sqlalchemy', 'sklearn', 'lxml',"
            " 'numpy', 'alembic', 'apscheduler') or (m.startswith('hostagent.') and not m.startswith('hostagent.guest')));"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_lease_flags_in_the_tenants_terms_become_request_fields() -> None:
    from hostagent.guest.cli import build_parser, request_body

    args = build_parser().parse_args(["lease", "--total-memory-gib", "100", "--requires", "bf16,fp64"])
    body = request_body(args)
    assert body["total_memory_gib"] == 100.0 and body["requires"] == ["bf16", "fp64"] and "gpus" not in body
    args = build_parser().parse_args(["lease", "--target-work-rate", "2500", "--task-type", "resnet"])
    body = request_body(args)
    assert body["target_work_rate"] == 2500.0 and body["task_type"] == "resnet" and "gpus" not in body


def test_a_partial_lease_is_topped_up_unless_the_guest_says_no_top_up() -> None:
    from hostagent.guest.cli import build_parser, request_body

    body = request_body(build_parser().parse_args(["lease", "--gpus", "4", "--accept-partial"]))
    assert body["accept_partial"] is True and "top_up" not in body  # the host's default: topped up
    body = request_body(build_parser().parse_args(["lease", "--gpus", "4", "--accept-partial", "--no-top-up"]))
    assert body["top_up"] is False


def test_a_guest_with_a_move_hook_says_its_lease_can_move() -> None:
    """`movable: true` lets the host move the lease to free a block for a waiting request (leases.consolidate):
    only a guest that can follow a move notice (an `on_move` hook) says it; the host's parser keeps it."""
    from hostagent.domain.lease import parse_lease_request
    from hostagent.guest.cli import build_parser, request_body
    from hostagent.guest.config import GuestConfig

    args = build_parser().parse_args(["lease", "--gpus", "1"])
    assert "movable" not in request_body(args, GuestConfig())
    body = request_body(args, GuestConfig(on_move="/usr/local/bin/checkpoint-and-move"))
    assert body["movable"] is True
    kw = {"now": 1e9, "max_duration_s": 86400}
    assert parse_lease_request(body, **kw).movable is True and parse_lease_request({"gpus": 1}, **kw).movable is False
    with pytest.raises(Exception, match="movable"):
        parse_lease_request({"gpus": 1, "movable": "yes"}, **kw)


def test_the_guest_agent_imports_nothing_but_the_standard_library() -> None:
    """A guest image has Python and little else: the guest CLI and everything it imports at start are stdlib (pynvml,
    optional, is imported only when NVML is sampled)."""
    code = ("import sys; before = {m.split('.')[0] for m in sys.modules}; "  # the interpreter's own start (site)
            "import hostagent.guest.cli, hostagent.guest.monitor, hostagent.guest.client; "
            "names = {m.split('.')[0] for m in sys.modules} - before; "
            "print('\\n'.join(sorted(n for n in names if n not in sys.stdlib_module_names and n != 'hostagent')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.split() == [], f"the guest agent imports packages a guest may not have: {out.stdout.split()}"
    mods = subprocess.run([sys.executable, "-c", "import sys, hostagent.guest.cli; "
                           "print('\\n'.join(m for m in sys.modules if m.startswith('hostagent.')))"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert mods and all(m.startswith("hostagent.guest") for m in mods), mods  # none of the host's own modules


def test_the_guest_client_sends_again_on_a_new_connection_when_the_kept_one_was_closed() -> None:
    """A kept-alive connection the server closed while it was idle fails before any answer: the request goes again at
    once on a new connection (no retry counted, no backoff), and an answer's body and Retry-After are read."""
    import asyncio
    import http.server
    import itertools
    import threading

    from hostagent.guest.client import HostClient

    conns: list[int] = []

    class OneShot(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # says keep-alive, then closes after one answer (as an idle timeout does)
        opened = itertools.count(1)

        def setup(self) -> None:
            super().setup()
            # one handler per connection: number them (an id() of the socket can come back for the next one)
            self.serial = next(OneShot.opened)

        def do_GET(self) -> None:  # noqa: N802
            conns.append(self.serial)
            body = json.dumps({"n": len(conns)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OneShot)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def two() -> list[object]:
        async with HostClient(f"http://127.0.0.1:{srv.server_address[1]}", "t", retries=0, sleep=sleep) as c:
            first = await c.request("GET", "/a")
            await asyncio.sleep(0.2)  # the server has closed it by now
            return [first, await c.request("GET", "/b")]
    try:
        assert asyncio.run(two()) == [(200, {"n": 1}), (200, {"n": 2})]
        assert slept == [] and conns == [1, 2]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("blocks", [True, False])
async def test_a_backend_that_may_block_is_read_in_a_thread_and_one_that_cannot_on_the_loop(blocks: bool) -> None:
    """NVML and sysfs reads can stall on a wedged driver: never on the event loop. A backend that says it does not
    block (the demo's simulated GPUs) is read inline: no thread hop for each of its thousands of samples."""
    import threading

    from hostagent.guest.config import GuestConfig
    from hostagent.guest.monitor import Monitor

    class Backend:
        note = "test GPUs"
        devices = [GpuInfo(0, "0000:00:05.0", "GPU", source="test")]

        def __init__(self) -> None:
            self.threads: list[str] = []
            self.blocks = blocks

        def read(self, ts: float) -> list[Reading]:
            self.threads.append(threading.current_thread().name)
            return [Reading(ts, 0, "0000:00:05.0", 50.0, 1, 2)]

        def close(self) -> None:
            pass

    backend = Backend()
    monitor = Monitor(None, GuestConfig(url="http://127.0.0.1:1"), lambda: Sampler(backend, backend.note),  # type: ignore[arg-type]
                      clock=lambda: 100.0)
    monitor.track({"id": "l-1", "devices": [{"gpu_id": "g0", "guest_addresses": ["0000:00:05.0"]}]})
    assert monitor.sampler is not None and monitor.sampler.blocks is blocks
    assert await monitor.sample() == 1
    on_loop = backend.threads == [threading.current_thread().name]
    assert on_loop is not blocks, backend.threads
    assert [s["util_pct"] for s in monitor.leases["l-1"].buffer.peek(5)] == [50.0]


def test_a_queued_lease_says_why_it_waits_where_the_host_says() -> None:
    lease = {"id": "L1", "state": "QUEUED", "domain": {"name": "vm-a"},
             "queue": {"position": 2, "eta": None, "note": "waiting for a better GPU: predicted to end in 120 s there "
                                                           "(free in 60 s) against 600 s on the GPUs free now"}}
    assert describe_lease(lease).splitlines()[1] == (
        "  queued: position 2, eta never; waiting for a better GPU: predicted to end in 120 s there (free in 60 s) "
        "against 600 s on the GPUs free now")
    del lease["queue"]["note"]  # type: ignore[attr-defined]
    assert describe_lease(lease).splitlines()[1] == "  queued: position 2, eta never"
