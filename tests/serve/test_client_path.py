"""What the program pays before and after the hand-over (serve/client.py): no `os` and
no `__future__` on its way to the helper, and no interpreter finalization after it.

Real processes: the launcher as the package writes it (packaging/launcher.py: Python
without `site`), a real `charly-arbiter serve`, both interpreters.  What the client
imported is read from `-X importtime`, which only the client's interpreter has (the
child that runs the command is a fork of the server).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SimEnv
from tests.serve.servetools import serving

sys.path.insert(0, str(REPO / "packaging"))
from launcher import write_launcher

PYTHONS = sorted({sys.executable, "/usr/bin/python3"})
# What the hand-over does without: `os` drags in posixpath, stat and
# _collections_abc, about 1 ms of a program started without `site`.
NOT_ON_THE_PROGRAMS_PATH = {"os", "posixpath", "stat", "_collections_abc", "__future__"}


def _imported(stderr: str) -> set[str]:
    """The modules `-X importtime` reports, from a process's stderr."""
    return {
        line.rpartition("|")[2].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


@pytest.mark.parametrize("python", PYTHONS)
def test_a_command_handed_over_imports_neither_os_nor_future(
    sim: SimEnv, tmp_path: Path, python: str
) -> None:
    program = tmp_path / "bin" / "charly-arbiter"
    write_launcher(program, python, str(REPO))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with serving(tmp_path / "serve", python=python) as served:
        done = subprocess.run(
            [python, "-S", "-X", "importtime", str(program), "status", "--json"],
            env={**env, **served.env(sim)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr + served.log()
        assert any("status" in line for line in served.ran()), served.log()
    imported = _imported(done.stderr)
    assert "charly_arbiter.serve.client" in imported  # the report is the client's
    assert not imported & NOT_ON_THE_PROGRAMS_PATH, sorted(imported)
    # In-process, the same program does import them (the check above can fail).
    alone = subprocess.run(
        [python, "-S", "-X", "importtime", str(program), "--version"],
        env={**env, **sim.env(CHARLY_ARBITER_SERVE="off")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert alone.returncode == 0, alone.stderr
    assert "os" in _imported(alone.stderr)


def _client(
    code: str,
    python: str = sys.executable,
    entry: str = str(REPO),
    cwd: Path | None = None,
    **environ: str,
) -> subprocess.CompletedProcess[str]:
    """`code` after importing the client the way the program does (-S, no `os`), from
    the path entry `entry`, put first so that no PYTHONPATH finds the package before it."""
    prelude = f"import sys; sys.path.insert(0, {entry!r}); "
    prelude += "from charly_arbiter.serve import client; "
    # Buffered as the program's stdout is (PYTHONUNBUFFERED would hide a lost flush).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run(
        [python, "-S", "-c", prelude + code],
        env={**env, **environ},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("python", PYTHONS)
def test_exit_now_flushes_what_was_written_and_keeps_the_status(python: str) -> None:
    # stdout is a pipe, so block-buffered: without the flush the text would be lost.
    done = _client("sys.stdout.write('said'); sys.stderr.write('told'); client.exit_now(7)", python)
    assert (done.returncode, done.stdout, done.stderr) == (7, "said", "told")
    for status in (0, 3, 255, 256, -1):
        wanted = subprocess.run([python, "-S", "-c", f"raise SystemExit({status})"]).returncode
        assert _client(f"client.exit_now({status})", python).returncode == wanted
    # A status beyond C's int is said the way sys.exit says it.
    huge = 1 << 40
    wanted = subprocess.run([python, "-S", "-c", f"raise SystemExit({huge})"], capture_output=True)
    got = _client(f"client.exit_now({huge})", python)
    assert (got.returncode, got.stderr) == (wanted.returncode, wanted.stderr.decode())


def test_exit_now_skips_what_finalization_would_run() -> None:
    """The one thing the program gives up: finalization.  Nothing on its path
    registers anything for it; this shows it is really skipped, not merely fast."""
    done = _client("import atexit; atexit.register(print, 'finalized'); client.exit_now(0)")
    assert (done.returncode, done.stdout) == (0, "")


def test_the_package_directory_is_what_os_path_makes_of_it(tmp_path: Path) -> None:
    """The client sends it and the server compares it with its own (child.identity),
    so it must not depend on how sys.path spelled the directory."""
    wanted = os.path.dirname(os.path.dirname(os.path.abspath(REPO / "charly_arbiter/serve/x")))
    spellings = [str(REPO), f"{REPO}/.", f"{REPO}/../{REPO.name}", os.path.relpath(REPO, tmp_path)]
    for spelling in spellings:
        done = _client("print(client.package_directory())", entry=spelling, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == wanted, spelling


def test_the_environment_follows_os_environ_once_os_is_imported() -> None:
    code = (
        "print(client.getenv('CHARLY_T'), end=' '); "
        "import os; os.environ['CHARLY_T'] = 'changed'; "
        "print(client.getenv('CHARLY_T'), client.environment_bytes()[b'CHARLY_T'].decode())"
    )
    done = _client(code, CHARLY_T="at start")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ", 2) == ["at", "start", "changed changed\n"]
