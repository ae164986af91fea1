"""The Podman tests' fixtures: one Podman test bed (podman.py) for the session, clean
before each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from machine import real_session

from tests.oci.podman import Podman, log, podman_environment, why_not


@pytest.fixture(scope="session")
def podman_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    yield from real_session(tmp_path_factory, "podman", why_not, podman_environment, log)


@pytest.fixture
def pm(podman_session: Podman) -> Iterator[Podman]:
    """Podman, with no test container and an empty ledger before each test."""
    podman_session.clean()
    yield podman_session
