"""The host preflight (#24): a GPU the host still uses is refused before the agent touches it, with the reason;
the lease fails, the GPU waits for the operator, and the operator's clear brings it back once the cause is gone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hostagent.host import preflight
from hostagent.host.fakesysfs import build_tree
from hostagent.host.sysfs import Sysfs
from tests.support.agent import AgentRig, make_rig, start_rig

RTX4090 = "0000:01:00.0"


def holds(proc: Path, pid: int, comm: str, *nodes: str) -> None:
    """A host process with these device nodes open."""
    fd = proc / str(pid) / "fd"
    fd.mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "comm").write_text(comm + "\n")
    for n, node in enumerate(nodes, start=3):
        os.symlink(node, fd / str(n))


def nvidia_minor(proc: Path, address: str, minor: int) -> None:
    info = proc / "driver/nvidia/gpus" / address / "information"
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text(f"Model:           NVIDIA A100\nDevice Minor:    {minor}\nBus Location:    {address}\n")


def test_the_workstation_as_found_refuses_its_boot_display_card(tmp_path: Path) -> None:
    tree = build_tree(tmp_path, "workstation")
    got = preflight.check(Sysfs(tree.sys_root), tree.proc_root, RTX4090, [RTX4090, "0000:01:00.1"])
    assert len(got.refusals) == 2, got
    assert "pid 1234 (Xorg) holds /dev/nvidia0" in got.refusals[0]  # /dev/nvidiactl alone is no one card's
    assert "efifb" in got.refusals[1] and "video=efifb:off" in got.refusals[1]
    ready = build_tree(tmp_path / "ready", "workstation-vfio")
    assert preflight.check(Sysfs(ready.sys_root), ready.proc_root, RTX4090, [RTX4090, "0000:01:00.1"]) == \
        preflight.Preflight()


def test_only_the_processes_holding_this_gpu_refuse_it(tmp_path: Path) -> None:
    tree = build_tree(tmp_path, "dgx8")
    a, b = tree.gpus[0], tree.gpus[1]
    assert "Device Minor" in (tree.proc_root / "driver/nvidia/gpus" / b / "information").read_text()
    nvidia_minor(tree.proc_root, a, 0)
    nvidia_minor(tree.proc_root, b, 1)
    holds(tree.proc_root, 4242, "nvidia-persistenced", "/dev/nvidia1", "/dev/nvidiactl")
    drm = tree.sys_root / "bus/pci/devices" / a / "drm" / "renderD128"
    drm.mkdir(parents=True)
    holds(tree.proc_root, 777, "python3", "/dev/dri/renderD128")
    sysfs = Sysfs(tree.sys_root)
    first = preflight.check(sysfs, tree.proc_root, a, [a])
    assert [r.split(":")[0] for r in first.refusals] == ["host process pid 777 (python3) holds /dev/dri/renderD128"]
    second = preflight.check(sysfs, tree.proc_root, b, [b])
    assert len(second.refusals) == 1 and "pid 4242 (nvidia-persistenced) holds /dev/nvidia1" in second.refusals[0]
    assert preflight.check(sysfs, tree.proc_root, tree.gpus[2], [tree.gpus[2]]).refusals == ()


def test_boot_vga_and_reset_policy(tmp_path: Path) -> None:
    tree = build_tree(tmp_path, "dgx8")
    gpu = tree.gpus[0]
    dev = tree.sys_root / "bus/pci/devices" / gpu
    sysfs = Sysfs(tree.sys_root)
    assert preflight.reset_methods(sysfs, gpu) == ["flr", "bus"]
    (dev / "reset_method").unlink()  # a kernel before 5.15: `reset` alone says some method exists
    assert preflight.reset_methods(sysfs, gpu) is None
    (dev / "boot_vga").write_text("1\n")
    (dev / "reset_method").write_text("\n")
    got = preflight.check(sysfs, tree.proc_root, gpu, [gpu])
    assert len(got.refusals) == 1 and "boot VGA" in got.refusals[0]
    assert len(got.warnings) == 1 and "no reset method" in got.warnings[0]
    got = preflight.check(sysfs, tree.proc_root, gpu, [gpu], allow_boot_vga=True, no_reset="refuse")
    assert len(got.refusals) == 1 and "no reset method" in got.refusals[0] and got.warnings == ()
    (dev / "reset_method").write_text("flr bus\n")
    assert preflight.check(sysfs, tree.proc_root, gpu, [gpu], allow_boot_vga=True) == preflight.Preflight()


async def test_a_refused_gpu_fails_the_lease_untouched_and_waits_for_the_operator(tmp_path: Path,
                                                                                  aiohttp_client: Any) -> None:
    rig: AgentRig = await start_rig(make_rig(tmp_path, scenario="workstation"), aiohttp_client)
    op = rig.auth("operator")
    r = await rig.client.post("/v1/leases", json={"model": "4090"}, headers=rig.auth("vm-a"))
    body = await r.json()
    assert r.status == 500 and "efifb" in body["error"]["message"], body
    assert rig.sysfs_driver(RTX4090) == "nvidia" and rig.sysfs_driver("0000:01:00.1") == "snd_hda_intel"
    gpu_id = body["lease"]["devices"][0]["gpu_id"]
    listed = {g["id"]: g for g in (await (await rig.client.get("/v1/gpus", headers=op)).json())["gpus"]}
    assert listed[gpu_id]["state"] == "unavailable" and "efifb" in listed[gpu_id]["attention"]
    r = await rig.client.post("/v1/leases", json={"model": "4090"}, headers=rig.auth("vm-a"))
    assert r.status == 409  # never placed again until the operator clears it
    # the operator stops the display manager, boots with video=efifb:off (here: the claim leaves /proc/iomem) and
    # clears the GPU
    for fd in (rig.tree.proc_root / "1234" / "fd").iterdir():
        fd.unlink()
    iomem = rig.tree.proc_root / "iomem"
    iomem.write_text("".join(line + "\n" for line in iomem.read_text().splitlines() if "efifb" not in line))
    assert (await rig.client.post(f"/v1/gpus/{gpu_id}/clear-quarantine", headers=op)).status == 200
    r = await rig.client.post("/v1/leases", json={"model": "4090"}, headers=rig.auth("vm-a"))
    assert r.status == 201, await r.text()
    assert rig.sysfs_driver(RTX4090) == "vfio-pci"
