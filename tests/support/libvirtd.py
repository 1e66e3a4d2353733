"""The private libvirtd for tests (hostagent.bench.libvirtd) and its fixture.

Import the `libvirtd` fixture into a test module to get one daemon for the session (per importing module).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hostagent.bench.libvirtd import LibvirtdUnavailable, PrivateLibvirtd, tiny_domain_xml

__all__ = ["LibvirtdUnavailable", "PrivateLibvirtd", "libvirtd", "tiny_domain_xml"]


@pytest.fixture(scope="session")
def libvirtd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateLibvirtd]:
    """A private libvirtd for the whole session (start-up fails the tests loudly when impossible)."""
    daemon = PrivateLibvirtd(tmp_path_factory.mktemp("libvirtd"))
    try:
        daemon.start()
    except Exception as exc:
        daemon.stop()
        pytest.fail(f"cannot start a private libvirtd: {exc}")
    yield daemon
    daemon.stop()
