"""charly-arbiter.socket and charly-arbiter.service, as shipped, and the installed program.

systemd's own parser checks the units (`systemd-analyze verify`, their ExecStart=
pointed at the two-line program the package installs); what the helper's safety
rests on is read from the units themselves: the socket the client looks for, the
mode, KillMode=process.  The program the package installs (packaging/launcher.py)
hands its command over like `python -m charly_arbiter`.  Socket activation by
systemd itself is test_server.py's `systemd-socket-activate` case here; under
systemd as PID 1 it is for the systemd guest (tests/kernel/sysguest.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servetools import serving

from charly_arbiter.serve.client import SOCKET
from tests.conftest import REPO, SimEnv

pytestmark = pytest.mark.slow

UNITS = REPO / "etc" / "systemd"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def settings(name: str) -> dict[str, str]:
    """KEY=VALUE lines of a unit (these have each key once)."""
    lines = (UNITS / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def _launcher(path: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            str(REPO / "packaging" / "launcher.py"),
            str(path),
            sys.executable,
            "/usr",
        ],
        check=True,
    )
    return path


def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    if SYSTEMD_ANALYZE is None:
        pytest.fail("systemd-analyze is missing: install systemd (scripts/apt-packages.txt)")
    program = _launcher(tmp_path / "bin" / "charly-arbiter")
    units = tmp_path / "units"
    units.mkdir()
    for name in ("charly-arbiter.socket", "charly-arbiter.service"):
        text = (UNITS / name).read_text().replace("/usr/bin/charly-arbiter", str(program))
        (units / name).write_text(text)
    verify = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", "charly-arbiter.socket", "charly-arbiter.service"],
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (verify.returncode, verify.stderr) == (0, ""), verify.stderr


def test_the_units_say_what_the_helper_relies_on() -> None:
    socket, service = settings("charly-arbiter.socket"), settings("charly-arbiter.service")
    assert socket["ListenStream"] == SOCKET, "the client looks for the socket there"
    assert socket["SocketMode"] == "0600" and socket["SocketUser"] == "root"
    assert "Accept" not in socket, "one server takes every connection (Accept=no)"
    assert service["ExecStart"] == "/usr/bin/charly-arbiter serve"
    assert service["KillMode"] == "process", "a restart must not kill commands in flight"
    assert service["Requires"] == service["After"] == "charly-arbiter.socket"
    hardening = [key for key in service if key.startswith(("Protect", "Private", "NoNew"))]
    assert not hardening, "a command runs here with what it has in-process; none less"


def test_the_installed_program_hands_its_command_over(sim: SimEnv, tmp_path: Path) -> None:
    """The two-line program the package installs, not `python -m`: it takes the same
    path through the client (the package on PYTHONPATH stands for dist-packages)."""
    program = _launcher(tmp_path / "charly-arbiter")
    with serving(tmp_path / "helper") as served:
        result = subprocess.run(
            [str(program), "status", "--json"],
            capture_output=True,
            text=True,
            env={**served.env(sim), "PYTHONPATH": str(REPO)},
            cwd=tmp_path,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert any("ran status --json" in line for line in served.ran()), served.log()
