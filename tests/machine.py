"""What the tests that use this machine's own services share: a machine-wide lock
(libvirtd, Podman, /etc/libvirt and the installed package are one per machine,
whichever pytest process or nested suite uses them), files put back as they
were, commands run with their output kept, and a session's real service
(skipped where it cannot run, failed where it should and does not start)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest


@contextlib.contextmanager
def flocked(path: Path, holders: str, timeout: float = 900) -> Iterator[float]:
    """Hold an exclusive flock on `path`, waiting up to `timeout` seconds (a failure
    names `holders`, who else takes it); yields how long it waited."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > timeout:
                    pytest.fail(f"{path} stayed locked for {timeout:.0f} s ({holders})")
                time.sleep(1)
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def restored(*paths: Path) -> Iterator[None]:
    """Put each file back as it was (or remove it, if it did not exist)."""
    saved = {path: path.read_bytes() if path.exists() else None for path in paths}
    try:
        yield
    finally:
        for path, content in saved.items():
            if content is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(content)


T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
# The CLI under test: the installed /usr/bin/charly-arbiter and the package's hook
# files (tests/package runs the suites so), else the checkout's.
INSTALLED = os.environ.get("CHARLY_ARBITER_E2E_INSTALLED") == "1"


@dataclass
class HookedService:
    """A real service (libvirtd, Podman) that runs the arbiter's hook, the simulated
    host behind it, and the CLI under test (`cli_argv`), pointed at its configuration."""

    work: Path
    sim_dir: Path
    state_dir: Path
    config_path: Path
    hook_log: Path
    cli_argv: list[str]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}
        env["CHARLY_ARBITER_CONFIG"] = str(self.config_path)
        if not INSTALLED:
            env["PYTHONPATH"] = str(REPO)
        return env

    def cli(self, *args: str, check: bool = False, timeout: float = 120) -> Any:
        return run([*self.cli_argv, *args], check=check, timeout=timeout, env=self.env())

    def status(self) -> dict[str, Any]:
        result = self.cli("status", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)  # type: ignore[no-any-return]

    def leases(self) -> dict[str, dict[str, Any]]:
        return {lease["claimant"]: lease for lease in self.status()["leases"]}


class Unavailable(Exception):
    """A real service cannot be run here, though it should: the message says why."""


def run(argv: list[str], check: bool = True, timeout: float = 120, **kw: Any) -> Any:
    """A command's result, its output kept; with `check`, fail with its stderr."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode != 0:
        raise AssertionError(f"{argv} exited {result.returncode}:\n{result.stderr}")
    return result


def real_session(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    why_not: Callable[[], str | None],
    environment: Callable[[Path], AbstractContextManager[T]],
    log: Callable[[str], None],
) -> Iterator[T]:
    """A session fixture's body: the service `environment` sets up in a directory of
    its own, skipped (and said in the log) where `why_not` gives a reason, a failure
    where it should start and raises `Unavailable`."""
    reason = why_not()
    if reason:
        log(f"SKIPPING the {name} tests: {reason}")
        pytest.skip(reason)
    try:
        with environment(tmp_path_factory.mktemp(name)) as env:
            yield env
    except Unavailable as error:
        pytest.fail(str(error))
