"""Fixtures shared by every test: a simulated host in a temp directory, and
the real CLI run as a separate process against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from simhosts import default_host

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import load_config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.host.sim import SimHost

REPO = Path(__file__).resolve().parent.parent

# One GPU with its audio function (gpu0), a second GPU alone (gpu1), and holders.
DEFAULT_HOST = default_host()

# A simulated host's arbiter.toml (`{sim}`, `{state}` filled in by make_sim): timeouts
# short enough for a test, a claimant judged at once; `sim_config` adds the tokens.
SIM_CONFIG = """
host = "sim:{sim}"
state_dir = "{state}"

[timeouts]
lock_wait = 20
driver_switch = 2
claim_grace = 0.001
"""


def sim_config(**tokens: str) -> str:
    """SIM_CONFIG with a `[tokens.NAME]` of each address."""
    return SIM_CONFIG + "".join(
        f'\n[tokens.{name}]\naddress = "{address}"\n' for name, address in tokens.items()
    )


DEFAULT_CONFIG = sim_config(gpu0="0000:0a:00.0", gpu1="0000:0b:00.0")

# scripts/test runs the tests of pure code (its PURE list) in a pytest process of their
# own with CHARLY_TESTS_PURE=1, and does not run them again with Debian 12's libraries:
# code that never starts the CLI and never imports a library Debian ships at another
# version gives the same result on the same interpreter.  This holds them to that:
# such a run fails if a test starts the CLI or anything imports one of these.
PURE = os.environ.get("CHARLY_TESTS_PURE") == "1"
THIRD_PARTY = ("click", "tomlkit", "pyudev", "libvirt", "prometheus_client", "pynvml")
NOT_PURE = "take its module out of PURE in scripts/test, so that Debian's libraries run it"


@pytest.fixture(scope="session", autouse=True)
def pure_stays_pure() -> Iterator[None]:
    yield
    if PURE:
        reached = sorted(name for name in THIRD_PARTY if name in sys.modules)
        assert not reached, (
            f"a test run as pure code (CHARLY_TESTS_PURE=1) imported {', '.join(reached)}: "
            + NOT_PURE
        )


def run_cli(
    args: Sequence[str], env: dict[str, str], *, check: bool = False, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """The real `charly-arbiter` CLI as a process of its own, from the checkout; with
    `check`, a failure is the test's, with its stderr."""
    if PURE:
        raise AssertionError(
            f"a test run as pure code (CHARLY_TESTS_PURE=1) starts the CLI: {NOT_PURE}"
        )
    result = subprocess.run(
        [sys.executable, "-m", "charly_arbiter", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"charly-arbiter {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
        )
    return result


@dataclass
class SimEnv:
    """A simulated host, its configuration and state directory, all under tmp_path."""

    root: Path
    sim_dir: Path
    state_dir: Path
    config_path: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}
        env["CHARLY_ARBITER_CONFIG"] = str(self.config_path)
        env.update(extra)
        return env

    def cli(
        self,
        *args: str,
        check: bool = False,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real `charly-arbiter` CLI as its own process."""
        return run_cli(args, env or self.env(), check=check, timeout=timeout)

    def status(self) -> dict[str, Any]:
        result = self.cli("status", "--json")
        return json.loads(result.stdout)  # type: ignore[no-any-return]

    def host(self) -> SimHost:
        return SimHost(self.sim_dir, switch_timeout=2)

    def arbiter(self) -> Arbiter:
        config = load_config(self.config_path, environ={})
        return Arbiter(config, self.host(), Ledger(config.state_dir, config.timeouts.lock_wait))

    def stopped(self, *claimants: str) -> None:
        """The claimants stop (a VM shuts down, a container exits), as before their
        hooks release them: a claimant that still runs is not released without --force."""
        host = self.host()
        for claimant in claimants:
            host.set_running(claimant, False)

    def set_host(self, text: str) -> None:
        (self.sim_dir / "host.toml").write_text(text)


@pytest.fixture
def make_sim(tmp_path: Path) -> Callable[..., SimEnv]:
    def make(host: str = DEFAULT_HOST, config: str = DEFAULT_CONFIG, name: str = "sim") -> SimEnv:
        root = tmp_path / name
        sim_dir = root / "host"
        state_dir = root / "state"
        sim_dir.mkdir(parents=True)
        os.chmod(root, 0o700)
        (sim_dir / "host.toml").write_text(host)
        config_path = root / "arbiter.toml"
        config_path.write_text(config.format(sim=sim_dir, state=state_dir))
        return SimEnv(root, sim_dir, state_dir, config_path)

    return make


@pytest.fixture
def sim(make_sim: Callable[..., SimEnv]) -> SimEnv:
    return make_sim()
