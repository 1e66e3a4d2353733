"""The CLI as an operator uses it: tables and --json, clear errors, nothing changed on bad input."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from hostagent.cli.parser import main
from hostagent.host.fakesysfs import build_tree
from hostagent.virt.sim import SimulatedHypervisor
from tests.support.agent import make_rig, start_rig


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def drivers(sys_root: Path) -> dict[str, str | None]:
    out = {}
    for dev in (sys_root / "bus/pci/devices").iterdir():
        link = dev / "driver"
        out[dev.name] = link.resolve().name if link.is_symlink() else None
    return out


@pytest.fixture(autouse=True)
def fake_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trees here are fake: the CLI drives them through the fake kernel, chosen as any setting is (here from the
    environment, `host.kernel`), never from what the tree holds."""
    monkeypatch.setenv("HOSTAGENT_HOST__KERNEL", "fake")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return build_tree(tmp_path / "ws", "workstation").sys_root


def test_gpus_table_and_json(ws: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "gpus", "--sysfs-root", str(ws))
    assert code == 0 and "LEASABLE" in out and "RTX 4090" in out
    code, out, _ = run(capsys, "gpus", "--sysfs-root", str(ws), "--json")
    data = json.loads(out)
    assert {len(g["functions"]) for g in data["gpus"]} >= {2, 4}


def test_vfio_bind_release_whole_group(ws: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = drivers(ws)
    code, out, _ = run(capsys, "vfio", "bind", "0000:02:00.0", "--sysfs-root", str(ws), "--dry-run")
    assert code == 0 and "driver_override" in out and drivers(ws) == before  # dry run changes nothing
    code, out, _ = run(capsys, "vfio", "bind", "0000:02:00.3", "--sysfs-root", str(ws), "--json")
    res = json.loads(out)
    assert code == 0 and res["ok"] and len(res["drivers"]) == 4  # the whole group, from any of its functions
    now = drivers(ws)
    assert {now[a] for a in res["drivers"]} == {"vfio-pci"}
    assert (ws.parent / "dev/vfio" / str(res["group"])).exists()
    code, out, _ = run(capsys, "vfio", "release", "0000:02:00.0", "--sysfs-root", str(ws))
    assert code == 0 and "done" in out
    assert drivers(ws) == before


@pytest.mark.parametrize("argv,needle", [
    (("vfio", "bind", "02:00"), "malformed PCI address"),
    (("vfio", "bind", "0000:7f:00.0"), "no PCI device at 0000:7f:00.0"),
])
def test_vfio_bad_input_changes_nothing(ws: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                        needle: str) -> None:
    before = drivers(ws)
    code, _, err = run(capsys, *argv, "--sysfs-root", str(ws))
    assert code == 1 and needle in err and err.startswith("hostagent: error:")
    assert drivers(ws) == before


def test_vfio_refuses_a_non_viable_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys_root = build_tree(tmp_path / "sr", "shared-rootport").sys_root
    before = drivers(sys_root)
    code, _, err = run(capsys, "vfio", "bind", "0000:03:00.0", "--sysfs-root", str(sys_root))
    assert code == 1 and "not viable" in err and "host device" in err
    assert drivers(sys_root) == before


def test_attach_detach_dry_run_and_errors(ws: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hv_path = tmp_path / "hv.json"
    hv = SimulatedHypervisor(path=hv_path)
    hv.define("vm1", running=True)
    hv.save()
    common = ("--sysfs-root", str(ws), "--libvirt-uri", f"sim://{hv_path}")
    code, out, _ = run(capsys, "attach", "--domain", "vm1", "--gpu", "0000:02:00.0", "--dry-run", *common)
    # host.guest_layout's default (auto): libvirt picks a hot-pluggable slot for each function, so no guest address
    assert code == 0 and out.count("<hostdev") == 4 and "<address type=\"pci\" domain" not in out and "dry run" in out
    code, _, err = run(capsys, "attach", "--domain", "nope", "--gpu", "0000:02:00.0", *common)
    assert code == 1 and "nope" in err
    code, _, err = run(capsys, "attach", "--domain", "vm1", "--gpu", "gpu-zzz", *common)
    assert code == 1 and "no GPU" in err
    code, _, err = run(capsys, "attach", "--domain", "vm1", "--gpu", "0000:02:00.0", *common)
    assert code == 1 and "vfio bind" in err  # not on vfio-pci yet: says what to run first
    assert asyncio.run(SimulatedHypervisor.load(hv_path).attached_hostdevs(hv.domains_sync()[0].uuid)) == ()
    assert run(capsys, "vfio", "bind", "0000:02:00.0", "--sysfs-root", str(ws))[0] == 0
    code, out, _ = run(capsys, "attach", "--domain", "vm1", "--gpu", "0000:02:00.0", *common, "--json")
    assert code == 0 and json.loads(out)["attached"] is True
    code, out, _ = run(capsys, "detach", "--domain", "vm1", "--gpu", "0000:02:00.0", *common, "--json")
    assert code == 0 and json.loads(out)["confirmed"] is True


async def test_leases_and_release_through_the_api(tmp_path: Path, aiohttp_client: Any,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    r = await rig.client.post("/v1/leases", json={"gpus": 1, "task_type": "inference"}, headers=rig.auth("vm-a"))
    lease = await r.json()
    url = str(rig.client.make_url("")).rstrip("/")
    api = ("--url", url, "--token", rig.operator)
    code = await asyncio.to_thread(main, ["leases", *api])
    out = capsys.readouterr().out
    assert code == 0 and lease["id"] in out and "ACTIVE" in out and "vm-a" in out
    code = await asyncio.to_thread(main, ["release", lease["id"], *api])
    out = capsys.readouterr().out
    assert code == 0 and "RELEASED" in out
    code = await asyncio.to_thread(main, ["leases", "--state", "ACTIVE", "--json", *api])
    assert code == 0 and json.loads(capsys.readouterr().out)["leases"] == []
    code = await asyncio.to_thread(main, ["release", "l-nope", *api])
    assert code == 1 and "404" in capsys.readouterr().err
    code = await asyncio.to_thread(main, ["leases", "--url", "http://127.0.0.1:9", "--token", "x", "--timeout", "2"])
    assert code == 3 and "cannot reach" in capsys.readouterr().err


async def test_lease_move_through_the_api(tmp_path: Path, aiohttp_client: Any,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    lease = await (await rig.client.post("/v1/leases", json={"gpus": 1}, headers=rig.auth("vm-a"))).json()
    gpus = (await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json())["gpus"]
    target = next(g["id"] for g in gpus if g["state"] == "free")
    api = ("--url", str(rig.client.make_url("")).rstrip("/"), "--token", rig.operator)
    code = await asyncio.to_thread(main, ["lease", "move", lease["id"], "--to", target, "--deadline", "120", *api])
    out = capsys.readouterr().out
    assert code == 0 and f"{target} attached beside {lease['devices'][0]['gpu_id']}" in out, out
    assert dict(rig.runtime.manager.leases[lease["id"]].move)["phase"] == "waiting"
    code = await asyncio.to_thread(main, ["lease", "move", lease["id"], "--to", target, *api])
    assert code == 1 and "409" in capsys.readouterr().err  # a move is under way already


def test_token_issue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rig = make_rig(tmp_path)
    rig.runtime.journal.close()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[agent]\nstate_dir = "{rig.settings.state_dir}"\n[libvirt]\nuri = "{rig.settings.libvirt.uri}"\n')
    code, out, _ = run(capsys, "token", "issue", "--config", str(cfg), "--domain", "vm-b", "--json")
    data = json.loads(out)
    assert code == 0 and data["domain"] == "vm-b" and data["token"].startswith("vm_")
    code, _, err = run(capsys, "token", "issue", "--config", str(cfg), "--domain", "vm-zzz")
    assert code == 1 and "vm-zzz" in err


# Every command of `hostagent --help`, with the options its own --help must name; a command group maps each of its
# actions to theirs (bench's benchmarks take the benchmark script's own arguments: listed only).
HELP: dict[str, Any] = {
    "serve": ("--config", "--sysfs-root", "--port", "--listen"),
    "demo": ("--port", "--listen", "--state-dir", "--db", "--scenario", "--quiet", "--history-days", "--seed",
             "--hosts", "--host-id", "--fast-reclaim"),
    "doctor": ("--config", "--json", "--sysfs-root"),
    "gpus": ("--config", "--json", "--sysfs-root"),
    "leases": ("--url", "--token", "--token-file", "--timeout", "--state", "--since"),
    "release": ("--url", "--token", "--timeout"),
    "lease": {"move": ("--url", "--token", "--to", "--from", "--deadline")},
    "gpu": {"clear": ("--url", "--token")},
    "token": {"issue": ("--domain", "--operator", "--state-dir")},
    "vfio": {"bind": ("--sysfs-root", "--dry-run", "--force"), "release": ("--sysfs-root", "--dry-run", "--driver")},
    "attach": ("--domain", "--gpu", "--dry-run", "--libvirt-uri"),
    "detach": ("--domain", "--gpu", "--dry-run", "--libvirt-uri"),
    "reaper": {"status": ("--url", "--token"), "pause": ("--url", "--token"), "resume": ("--url", "--token")},
    "db": {"upgrade": ("--db", "--state-dir"), "status": ("--db", "--state-dir"),
           "export": ("--db", "--host", "--since", "--until", "--all-hosts", "--output"),
           "rejected": ("--db", "--payload"), "replay": ("--db", "--host"), "discard": ("--db", "--host")},
    "model": {"train": ("--db", "--target", "--min-records"), "evaluate": ("--db",), "show": ("--db", "--limit"),
              "rollback": ("--db",), "simulate": ("--throughputs", "--host", "--trace", "--policies")},
    "topology": ("--url", "--token", "--local", "--sysfs-root"),
    "probe": ("--url", "--token", "--timeout"),
    "bench": {name: None for name in ("all", "load", "overhead", "restart", "ingest", "rollup", "place", "dashboard",
                                      "tenants")},
}


def parse_help(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """An argparse help text's options and listed (sub)commands, each with its description ("" when none)."""
    options: dict[str, str] = {}
    listed: dict[str, str] = {}
    lines = text.splitlines()
    section = ""
    for i, line in enumerate(lines):
        if line and not line.startswith(" "):
            section = line
            continue
        follow = lines[i + 1] if i + 1 < len(lines) else ""
        wrapped = follow.strip() if follow.startswith(" " * 8) and not follow.lstrip().startswith("-") else ""
        if section == "options:" and line.startswith("  -"):
            head, _, desc = line.strip().partition("  ")
            for name in re.findall(r"(?:^|, )(-{1,2}[a-z][a-z0-9-]*)", head):
                options[name] = desc.strip() or wrapped
        elif section == "positional arguments:" and re.match(r"^ {4}\S", line):
            name, _, desc = line.strip().partition("  ")
            listed[name] = desc.strip() or wrapped
    return options, listed


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, str], dict[str, str], str]:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0, argv
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hostagent {' '.join(argv)}".rstrip()), out[:80]
    return (*parse_help(out), out)


def leaf_parsers() -> dict[tuple[str, ...], Any]:
    """Every command line's own parser (commands and actions), from the real parser."""
    import argparse

    from hostagent.cli.parser import build_parser

    out: dict[tuple[str, ...], Any] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[path] = parser
        for sub in subs:
            for name, child in sub.choices.items():
                walk(child, (*path, name))

    walk(build_parser(), ())
    return out


def test_help_is_useful(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`hostagent --help` lists every command with a one-line description; each command's --help (each action's,
    for a command group) names its options, each with a description."""
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps to the terminal: one line per entry, whatever runs this
    _, commands, top = help_of(capsys)
    assert set(HELP) <= set(commands), f"not listed: {set(HELP) - set(commands)}"
    for name, desc in commands.items():
        assert desc and "\n" not in desc, f"`hostagent --help` lists {name} without a one-line description"
        assert re.search(rf"^ {{4}}{re.escape(name)} +{re.escape(desc)}$", top, re.M)
    parsers = leaf_parsers()
    for cmd, spec in HELP.items():
        options, actions, _ = help_of(capsys, cmd)
        if isinstance(spec, dict):
            assert set(spec) <= set(actions), f"`hostagent {cmd} --help` does not list {set(spec) - set(actions)}"
            assert all(actions.values()), f"`hostagent {cmd} --help` lists an action without a description"
            runs = [((cmd, action), wanted) for action, wanted in spec.items() if wanted is not None]
        else:
            runs = [((cmd,), spec)]
        for argv, wanted in runs:
            options, _, _ = help_of(capsys, *argv)
            missing = [o for o in ("--help", *wanted) if not options.get(o)]
            assert not missing, f"`hostagent {' '.join(argv)} --help` does not name (and describe) {missing}"
            if argv in parsers:  # every option the command takes is in its help, described
                takes = {o for a in parsers[argv]._actions for o in a.option_strings if o.startswith("--")}
                undescribed = sorted(o for o in takes if not options.get(o))
                assert not undescribed, f"`hostagent {' '.join(argv)} --help`: no description for {undescribed}"


@pytest.mark.parametrize("scenario", ["dgx8", "workstation", "shared-rootport", "iommu-off", "demo16"])
def test_gpus_json_validates_against_the_documented_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           scenario: str) -> None:
    import jsonschema

    schema = json.loads((Path(__file__).parents[2] / "docs/schemas/gpus.schema.json").read_text())
    sys_root = build_tree(tmp_path / scenario, scenario).sys_root
    code, out, _ = run(capsys, "gpus", "--sysfs-root", str(sys_root), "--json")
    assert code == 0
    jsonschema.validate(json.loads(out), schema, cls=jsonschema.Draft202012Validator)


async def test_api_gpus_validate_against_the_same_schema(tmp_path: Path, aiohttp_client: Any) -> None:
    import jsonschema

    schema = json.loads((Path(__file__).parents[2] / "docs/schemas/gpus.schema.json").read_text())
    rig = await start_rig(make_rig(tmp_path), aiohttp_client)
    await rig.client.post("/v1/leases", json={"gpus": 2}, headers=rig.auth("vm-a"))
    body = await (await rig.client.get("/v1/gpus", headers=rig.auth("operator"))).json()
    jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)
