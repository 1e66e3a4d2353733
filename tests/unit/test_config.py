"""Configuration: TOML + env overrides validated into frozen settings; one clear error naming the key.

That every setting is documented, and that every documented key does what the document says, is
tests/adapters/test_config_keys.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hostagent.cli.parser import main
from hostagent.config import load_settings, settings_from_dict
from hostagent.domain.errors import ConfigError


def test_defaults_when_no_file() -> None:
    s = settings_from_dict({})
    assert s.agent.port == 8470 and s.reclaim.grace_s == 1200 and s.reclaim.check_interval_s == 3600
    assert s.store_url.startswith("sqlite:///") and s.dev_root == Path("/dev")
    assert s.host.kernel == "sysfs"  # the running kernel unless a composition (demo, test rig) says fake


def test_file_env_and_overrides_layer(tmp_path: Path) -> None:
    f = tmp_path / "h.toml"
    f.write_text('[agent]\nport = 9000\n[reclaim]\ngrace_s = 30\n[host]\nsysfs_root = "/tmp/x/sys"\n')
    s = load_settings(f, environ={"HOSTAGENT_RECLAIM__GRACE_S": "45", "HOSTAGENT_AGENT__LISTEN": "::1"})
    assert s.agent.port == 9000 and s.reclaim.grace_s == 45.0 and s.agent.listen == "::1"
    assert s.dev_root == Path("/tmp/x/dev") and s.proc_root == Path("/tmp/x/proc")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.agent.port = 1  # type: ignore[misc]


@pytest.mark.parametrize("text,key", [
    ("[agent]\nport = 'x'\n", "agent.port"),
    ("[agent]\nprot = 1\n", "agent.prot"),
    ("[nope]\n", "nope"),
    ("[reclaim]\ngrace_s = -1\n", "reclaim.grace_s"),
    ("[reclaim]\nidle_util_pct = 101\n", "reclaim.idle_util_pct"),
    ("[host]\ngpu_vendors = ['nvidia']\n", "host.gpu_vendors"),
    ("[agent]\ntls_cert = '/x'\n", "agent.tls_cert"),
    ("[leases]\nnuma_policy = 'sometimes'\n", "leases.numa_policy"),
    ("[host]\nkernel = 'auto'\n", "host.kernel"),
    ("[libvirt]\ndetach_retries = -1\n", "libvirt.detach_retries"),
    ("[placement]\nobjective = 'balance'\n", "placement.objective"),
    ("[placement]\nobjective_per_task = { inference = 'balance' }\n", "placement.objective_per_task.inference"),
    ("[placement]\nobjective_per_task = { inference = 1 }\n", "placement.objective_per_task.inference"),
    ("[placement]\ntrain_threads = -1\n", "placement.train_threads"),
    ("[placement]\ntrain_threads = 'x'\n", "placement.train_threads"),
    ("[placement]\ntrain_threads = 1025\n", "placement.train_threads"),
])
def test_invalid_file_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    f = tmp_path / "h.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_settings(f, environ={})
    assert exc.value.field == key
    assert str(f) in exc.value.message


def test_train_threads_is_one_unless_the_file_says_otherwise(tmp_path: Path) -> None:
    # the scheduled retraining's fit threads (tests/adapters/test_train_threads.py): one, the host's CPUs being its
    # guests'; 0 is scikit-learn's own default
    assert settings_from_dict({}).placement.train_threads == 1
    f = tmp_path / "h.toml"
    for value in (0, 4, 1024):
        f.write_text(f"[placement]\ntrain_threads = {value}\n")
        assert load_settings(f, environ={}).placement.train_threads == value
    assert load_settings(f, environ={"HOSTAGENT_PLACEMENT__TRAIN_THREADS": "2"}).placement.train_threads == 2


def test_cli_exits_2_with_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "h.toml"
    f.write_text("[reclaim]\ngrace = 5\n")
    assert main(["gpus", "--config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key reclaim.grace" in err[0] and "grace_s" in err[0]


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "missing.toml", environ={})


def test_not_toml(tmp_path: Path) -> None:
    f = tmp_path / "h.toml"
    f.write_text("[agent\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(f, environ={})


def test_a_removed_key_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict({"placement": {"model_dir": "/var/lib/hostagent/models"}})
    assert info.value.field == "placement.model_dir" and "usage store" in info.value.message


def test_settings_without_a_file_still_take_the_environment() -> None:
    from hostagent.config import settings_without_file

    s = settings_without_file({"agent": {"port": 0}}, environ={"HOSTAGENT_AGENT__GUEST_REQUESTS_PER_S": "7",
                                                               "HOSTAGENT_AGENT__PORT": "9999"})
    assert s.agent.guest_requests_per_s == 7.0 and s.agent.port == 0  # the explicit override wins
