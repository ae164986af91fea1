"""Fixtures of the Cockpit tests: one headless Chromium for the session, and a
cockpit-ws per test (cockpittools.py says how each is set up)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cockpittools import COCKPIT_LOCK, Browser, Cockpit, start_chromium, start_cockpit
from machine import flocked


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    # One Chromium-driven session on this machine at a time (another test session,
    # bench/bench_page.py): two compete for the CPUs and each one's waits stretch.
    with flocked(COCKPIT_LOCK, "another Cockpit test session or bench/bench_page.py"):
        profile = tempfile.mkdtemp(prefix="charly-chromium-")
        driver = start_chromium(Path(profile))
        try:
            session = Browser(driver)
            session.viewport(1280, 800)
            yield session
        finally:
            driver.quit()
            shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def cockpit_for(tmp_path: Path) -> Iterator[Callable[..., Cockpit]]:
    """start(config) -> a running cockpit-ws; every one is stopped after the test."""
    started: list[Cockpit] = []

    def start(config: dict[str, Any] | None) -> Cockpit:
        cockpit = start_cockpit(tmp_path / f"cockpit{len(started)}", config)
        started.append(cockpit)
        return cockpit

    yield start
    for cockpit in started:
        cockpit.stop()
