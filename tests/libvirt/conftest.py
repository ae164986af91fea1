"""The real-libvirtd tests' fixtures: one libvirtd test bed (libvirtd.py) for the
session, with no test domain and an empty ledger before each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from machine import real_session

from tests.libvirt.libvirtd import RUN, Libvirt, libvirt_environment, log, pid_alive, why_not


@pytest.fixture(scope="session")
def libvirt_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Libvirt]:
    yield from real_session(tmp_path_factory, "libvirt-e2e", why_not, libvirt_environment, log)


@pytest.fixture
def lv(libvirt_session: Libvirt) -> Iterator[Libvirt]:
    """The daemon, with no test domain and an empty ledger before each test."""
    libvirt_session.clean()
    if not pid_alive(RUN / "libvirtd.pid"):
        libvirt_session.start_daemons()
    yield libvirt_session
