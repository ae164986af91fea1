"""Helpers of the Cockpit tests: a real Cockpit, a real browser, the arbiter on a
simulated host.

Each test gets its own cockpit-ws (no TLS, on a free loopback port, with
`--local-session`: a session with no login, whose cockpit-bridge runs as the
user running the tests) and its own simulated host.  The page's package is
this checkout's `cockpit/` directory, found by the bridge through
XDG_DATA_HOME; the command it runs comes from a manifest override in
XDG_CONFIG_HOME (`charly-arbiter.override.json`), the documented way an
administrator points the page at another command: here Debian's python3 with
the checkout on PYTHONPATH, and CHARLY_ARBITER_CONFIG naming the simulated
host's configuration.  Nothing is installed system-wide.

One headless Chromium, driven by chromedriver through Debian's selenium,
serves the whole session; its flags keep it off the network (no background
requests, no component updates, no sync).  Screenshots go to
build/test-output/cockpit/ (or $CHARLY_TEST_OUTPUT/cockpit/).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "cockpit"
COCKPIT_WS = Path("/usr/lib/cockpit/cockpit-ws")
COCKPIT_BRIDGE = Path("/usr/bin/cockpit-bridge")
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
PYTHON = "/usr/bin/python3"  # what the Debian package runs on
OUTPUT = Path(os.environ.get("CHARLY_TEST_OUTPUT", REPO / "build" / "test-output")) / "cockpit"
CLEAN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
COCKPIT_LOCK = Path("/tmp/charly-cockpit.lock")  # see conftest.browser


def need(*paths: Path) -> None:
    missing = [str(path) for path in paths if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run scripts/setup (scripts/apt-packages.txt)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Cockpit:
    """One cockpit-ws with its session's directories."""

    port: int
    process: subprocess.Popen[bytes]
    root: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_cockpit(root: Path, config: dict[str, Any] | None, package: Path = PACKAGE) -> Cockpit:
    """cockpit-ws serving the page in `package` (this checkout's); `config` overrides the
    manifest's "config" (the command and its environment), None leaves the shipped default."""
    need(COCKPIT_WS, COCKPIT_BRIDGE)
    data = root / "data" / "cockpit"
    settings = root / "config" / "cockpit"
    home = root / "home"
    for directory in (data, settings, home):
        directory.mkdir(parents=True, exist_ok=True)
    (data / "charly-arbiter").symlink_to(package, target_is_directory=True)
    if config is not None:
        override = {"config": config}
        (settings / "charly-arbiter.override.json").write_text(json.dumps(override, indent=2))
    env = {
        "PATH": CLEAN_PATH,
        "LANG": "C.UTF-8",
        "HOME": str(home),
        "XDG_DATA_HOME": str(root / "data"),
        "XDG_CONFIG_HOME": str(root / "config"),
    }
    port = _free_port()
    log = root / "cockpit-ws.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                str(COCKPIT_WS),
                "--no-tls",
                "--port",
                str(port),
                "--address",
                "127.0.0.1",
                f"--local-session={COCKPIT_BRIDGE}",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=root,
        )
    cockpit = Cockpit(port, process, root, log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"cockpit-ws exited {process.returncode}:\n{log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return cockpit
        except OSError:
            time.sleep(0.1)
    cockpit.stop()
    raise AssertionError(f"cockpit-ws did not listen on {port} within 30 s:\n{log.read_text()}")


def arbiter_config(
    config_path: Path, *, command: list[str] | None = None, repo: Path = REPO
) -> dict[str, Any]:
    """The override that runs the CLI of `repo` (this checkout) on Debian's python3
    against `config_path`."""
    return {
        "command": command or [PYTHON, "-m", "charly_arbiter"],
        "environ": [f"PYTHONPATH={repo}", f"CHARLY_ARBITER_CONFIG={config_path}"],
    }


def start_chromium(profile: Path) -> Any:
    """Headless Chromium driven by chromedriver (Debian's selenium), kept off the network;
    `profile` is its user data directory, the caller's to remove."""
    need(CHROMIUM, CHROMEDRIVER)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

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
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


@dataclass
class Browser:
    """Headless Chromium, with the page's frame switched to and helpers to wait on it."""

    driver: Any
    shots: list[Path] = field(default_factory=list)

    def viewport(self, width: int, height: int, mobile: bool = False) -> None:
        self.driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile},
        )

    def open_page(self, cockpit: Cockpit, timeout: float = 60) -> float:
        """Open the GPUs page inside Cockpit's shell; returns seconds until the shell's
        frame for it exists (the page's own first render is measured by the page)."""
        from selenium.webdriver.common.by import By

        self.driver.switch_to.default_content()
        started = time.monotonic()
        self.driver.get(f"{cockpit.url}/charly-arbiter")
        frame = self.wait(
            lambda d: next(
                (
                    f
                    for f in d.find_elements(By.TAG_NAME, "iframe")
                    if "/charly-arbiter/index.html" in (f.get_attribute("src") or "")
                ),
                None,
            ),
            timeout,
            "the shell never made a frame for the GPUs page",
        )
        elapsed = time.monotonic() - started
        self.driver.switch_to.frame(frame)
        return elapsed

    def wait(self, condition: Callable[[Any], Any], timeout: float = 30, what: str = "") -> Any:
        from selenium.common.exceptions import TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(condition)
        except TimeoutException:
            body = self.text()
            raise AssertionError(
                f"timed out after {timeout} s: {what}\npage text:\n{body}"
            ) from None

    def text(self, selector: str = "body") -> str:
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.common.by import By

        try:
            return str(self.driver.find_element(By.CSS_SELECTOR, selector).text)
        except WebDriverException:
            return ""

    def wait_text(self, selector: str, needle: str, timeout: float = 30) -> str:
        self.wait(lambda d: needle in self.text(selector), timeout, f"{needle!r} in {selector}")
        return self.text(selector)

    def click(self, selector: str, timeout: float = 30) -> None:
        from selenium.webdriver.common.by import By

        element = self.wait(
            lambda d: next(
                (e for e in d.find_elements(By.CSS_SELECTOR, selector) if e.is_enabled()), None
            ),
            timeout,
            f"{selector} to be enabled",
        )
        element.click()

    def screenshot(self, name: str) -> Path:
        """A picture of the whole shell (Cockpit's frame around the page)."""
        self.driver.switch_to.default_content()
        OUTPUT.mkdir(parents=True, exist_ok=True)
        path = OUTPUT / f"{name}.png"
        self.driver.save_screenshot(str(path))
        assert path.stat().st_size > 10_000, f"{path} is nearly empty"
        self.shots.append(path)
        self.enter_page()
        return path

    def enter_page(self) -> None:
        from selenium.webdriver.common.by import By

        for frame in self.driver.find_elements(By.TAG_NAME, "iframe"):
            if "/charly-arbiter/index.html" in (frame.get_attribute("src") or ""):
                self.driver.switch_to.frame(frame)
                return
