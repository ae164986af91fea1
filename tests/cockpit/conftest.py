"""Fixtures of the Cockpit tests: one headless Chromium for the session, and a
cockpit-ws per test (cockpittools.py says how each is set up)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cockpittools import CHROMEDRIVER, CHROMIUM, Browser, Cockpit, need, start_cockpit


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    need(CHROMIUM, CHROMEDRIVER)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="charly-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--window-size=1280,800",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
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
