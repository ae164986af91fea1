"""The installed program's launcher (packaging/launcher.py) starts Python without `site`:
a command handed to the resident helper never sets it up, and whatever runs in-process
sets it up first and finds the installed libraries.

Real processes, the real launcher as the Makefile writes it (pointing at this
checkout), both interpreters, a real `charly-arbiter serve`.  Whether `site` ran in
a process is read from a `sitecustomize` module only `site` imports: it notes the
pid of each process that ran it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SimEnv
from tests.serve.servetools import serving

sys.path.insert(0, str(REPO / "packaging"))
from launcher import write_launcher

PYTHONS = sorted({sys.executable, "/usr/bin/python3"})

SITECUSTOMIZE = """\
import os
marks = os.environ.get("SITE_MARKS")
if marks:
    with open(marks, "a") as handle:
        handle.write(f"{os.getpid()}\\n")
"""


@pytest.fixture
def marks(tmp_path: Path) -> Path:
    directory = tmp_path / "sitecustomize"
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return tmp_path / "marks"


def _program(tmp_path: Path, python: str, library: str = str(REPO)) -> Path:
    program = tmp_path / "bin" / "charly-arbiter"
    write_launcher(program, python, library)
    return program


def _env(sim: SimEnv, marks: Path, **extra: str) -> dict[str, str]:
    """The simulated host's environment, without this checkout on PYTHONPATH: the
    launcher must find the package itself; only the marking sitecustomize is there."""
    env = sim.env(SITE_MARKS=str(marks), **extra)
    env["PYTHONPATH"] = str(marks.parent / "sitecustomize")
    return env


def _ran_site(marks: Path) -> int:
    return len(marks.read_text().split()) if marks.exists() else 0


@pytest.mark.parametrize("python", PYTHONS)
def test_in_process_the_program_sets_site_up_and_runs(
    sim: SimEnv, tmp_path: Path, marks: Path, python: str
) -> None:
    program = _program(tmp_path, python)
    assert program.read_text().startswith(f"#!{python} -S\n")
    done = subprocess.run(
        [str(program), "status", "--json"],
        env=_env(sim, marks, CHARLY_ARBITER_SERVE="off"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert '"gpu0"' in done.stdout
    assert _ran_site(marks) == 1  # click, tomlkit and the rest were found through site


@pytest.mark.parametrize("python", PYTHONS)
def test_a_command_the_helper_runs_never_sets_site_up_in_the_client(
    sim: SimEnv, tmp_path: Path, marks: Path, python: str
) -> None:
    program = _program(tmp_path, python)
    with serving(tmp_path / "serve", python=python) as served:
        done = subprocess.run(
            [str(program), "status", "--json"],
            env=_env(sim, marks, **served.env(sim)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr + served.log()
        assert '"gpu0"' in done.stdout
        assert any("status" in line for line in served.ran()), served.log()
    assert _ran_site(marks) == 0


def test_the_libvirt_hook_sets_site_up_only_for_its_slow_path(
    sim: SimEnv, tmp_path: Path, marks: Path
) -> None:
    program = _program(tmp_path, "/usr/bin/python3")
    env = _env(sim, marks, CHARLY_ARBITER_SERVE="off")
    usb_only = (
        b"<domain type='kvm'><name>usb</name><devices><hostdev mode='subsystem' type='usb'>"
        b"<source><vendor id='0x1'/><product id='0x2'/></source></hostdev></devices></domain>"
    )
    # (on the simulated host every hostdev goes the slow way: its PCI is its own files)
    real_host = {**env, "CHARLY_ARBITER_CONFIG": str(tmp_path / "no-configuration.toml")}
    _prepare(program, "usb", usb_only, real_host)
    assert _ran_site(marks) == 0  # the fast path: the standard library only
    claim = (
        b"<domain type='kvm'><name>vm</name><metadata>"
        b"<ca:claim xmlns:ca='https://charly-arbiter.org/xmlns/claim/1' mode='shared'>"
        b"<ca:token>gpu1</ca:token></ca:claim></metadata></domain>"
    )
    _prepare(program, "vm", claim, env)
    assert _ran_site(marks) == 1
    assert [lease["claimant"] for lease in sim.status()["leases"]] == ["libvirt:vm"]


def _prepare(program: Path, guest: str, xml: bytes, env: dict[str, str]) -> None:
    """libvirt's `prepare begin` through the program, which lets the domain start."""
    done = subprocess.run(
        [str(program), "hook", "qemu", guest, "prepare", "begin", "-"],
        input=xml,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout == b"", done.stderr


def test_a_launcher_whose_directory_is_wrong_finds_the_package_through_site(
    sim: SimEnv, tmp_path: Path, marks: Path
) -> None:
    """The checkout's .venv has the package installed (editable), which only `site`
    puts on the path: a launcher pointing elsewhere falls back to it."""
    venv_python = REPO / ".venv" / "bin" / "python"
    if not venv_python.exists():
        pytest.fail("no .venv: run scripts/setup")
    program = _program(tmp_path, str(venv_python), library=str(tmp_path / "nowhere"))
    done = subprocess.run(
        [str(program), "--version"],
        env=_env(sim, marks, CHARLY_ARBITER_SERVE="off"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "charly-arbiter, version" in done.stdout
