"""`charly-arbiter serve` itself: its socket, who it serves, how it starts and stops.

Real processes: the server started by hand (as CI must: no systemd as PID 1) and
by systemd's own `systemd-socket-activate`, which passes the socket as systemd does
(LISTEN_FDS); real peers of another uid (65534), a real upgrade of the code on disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from servetools import Served, _clean_environment, cli, serving

from charly_arbiter.serve.client import ENV_SERVE, ENV_SOCKET
from tests.conftest import REPO, SimEnv

pytestmark = pytest.mark.slow

NOBODY = 65534


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "charly_arbiter", "serve", *args],
        capture_output=True,
        text=True,
        env=env or _clean_environment(),
        cwd=REPO,
        timeout=120,
    )


def test_the_socket_is_the_owners_alone(tmp_path: Path):
    with serving(tmp_path) as served:
        mode = os.stat(served.socket).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert os.stat(served.socket).st_uid == os.geteuid()
    assert not served.socket.exists(), "a server that bound its socket removes it"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory uid 65534 can reach (pytest's own are the owner's alone)."""
    with tempfile.TemporaryDirectory(prefix="charly-serve-") as directory:
        os.chmod(directory, 0o755)
        yield Path(directory)


def test_a_peer_of_another_uid_is_refused(sim: SimEnv, shared_dir: Path):
    """Even with the socket opened to everyone, a client of another uid is refused
    (SO_PEERCRED): its command is not run by the server's uid."""
    with serving(shared_dir) as served:
        os.chmod(served.socket, 0o666)
        env = {**served.env(sim), "HOME": "/"}
        result = subprocess.run(
            [sys.executable, "-m", "charly_arbiter", "--version"],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            timeout=120,
        )
        assert result.returncode == 1, result.stderr
        assert "did not take the command" in result.stderr
        served.wait_in_log(f"uid {NOBODY} is not this server's")
        assert served.ran() == []


def test_the_client_refuses_a_server_of_another_uid(sim: SimEnv, shared_dir: Path):
    """A socket someone else listens on (here uid 65534) never gets a command, nor
    a byte of it: the client checks the server's uid before it sends anything."""
    directory = shared_dir / "theirs"
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    path = directory / "serve.sock"
    listener = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen()\n"
            "print('listening', flush=True)\n"
            "c, _ = s.accept(); data = b''\n"
            "while chunk := c.recv(65536): data += chunk\n"
            "print(len(data), flush=True)\n",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline() == "listening\n"
        must = cli(["--version"], sim.env(**{ENV_SOCKET: str(path), ENV_SERVE: "must"}))
        assert must.code == 1 and f"served by uid {NOBODY}" in must.stderr, must.stderr
        assert listener.stdout.readline() == "0\n", "not a byte reached it"
        ran = cli(["status", "--json"], sim.env(**{ENV_SOCKET: str(path)}))
        assert ran.code == 0, "the command runs in-process"
    finally:
        listener.kill()
        listener.wait()


@pytest.mark.parametrize("there", ["stale", "live", "file", "open directory"])
def test_what_is_at_the_socket_path(tmp_path: Path, there: str):
    """A stale socket file (its server gone) is replaced; a live server, a file that is
    not a socket, or a directory others may write to (they could swap the socket)
    is an error (exit 1), and nothing is removed."""
    path = tmp_path / "run" / "serve.sock"
    path.parent.mkdir()
    if there == "stale":
        with socket.socket(socket.AF_UNIX) as stale:
            stale.bind(str(path))
        with serving(tmp_path, env=None) as served:
            assert served.socket == path
        return
    if there == "live":
        with serving(tmp_path / "first") as first:
            result = _serve("--socket", str(first.socket))
            assert result.returncode == 1
            assert "another server listens" in result.stderr
            assert first.socket.exists() and first.process.poll() is None
        return
    if there == "file":
        path.write_text("mine\n")
        result = _serve("--socket", str(path))
        assert result.returncode == 1 and "not a socket" in result.stderr
        assert path.read_text() == "mine\n"
        return
    path.parent.chmod(0o777)
    result = _serve("--socket", str(path))
    assert result.returncode == 1 and "others may write" in result.stderr
    assert not path.exists()


def test_socket_activation_as_systemd_does_it(sim: SimEnv, tmp_path: Path):
    """systemd's own `systemd-socket-activate` listens and passes the socket (fd 3,
    LISTEN_FDS, LISTEN_PID) as the .socket unit does; the server serves on it."""
    activate = shutil.which("systemd-socket-activate")
    if activate is None:
        pytest.skip("systemd-socket-activate is not installed (Debian's systemd package)")
    path = tmp_path / "serve.sock"
    log = tmp_path / "serve.log"
    with open(log, "wb") as errors:
        server = subprocess.Popen(
            [activate, "-l", str(path), sys.executable, "-m", "charly_arbiter", "serve", "-v"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            env=_clean_environment(),
            cwd=REPO,
            start_new_session=True,
        )
    served = Served(server, path, log)
    try:
        deadline = time.monotonic() + 60
        while not path.exists():
            assert time.monotonic() < deadline and server.poll() is None, served.log()
            time.sleep(0.05)
        ran = cli(["status", "--json"], served.env(sim))
        assert ran.code == 0, ran.stderr + served.log()
        assert any("status --json" in line for line in served.ran())
        assert f"listening on {path}" in served.log()
    finally:
        served.stop()


def test_a_server_started_anew_when_its_code_changes(sim: SimEnv, tmp_path: Path):
    """An upgrade replaces the files the server's code came from: within a second it
    execs itself anew (the same pid, the same socket) and serves the new code."""
    copy = tmp_path / "installed"
    shutil.copytree(
        REPO / "charly_arbiter", copy / "charly_arbiter", ignore=shutil.ignore_patterns("*.pyc")
    )
    env = {**_clean_environment(), "PYTHONPATH": str(copy)}
    socket_path = tmp_path / "run" / "serve.sock"
    log = tmp_path / "serve.log"

    def served_version() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "charly_arbiter", "--version"],
            capture_output=True,
            text=True,
            env={
                **sim.env(),
                "PYTHONPATH": str(copy),
                ENV_SOCKET: str(socket_path),
                ENV_SERVE: "must",
                "CHARLY_ARBITER_SERVE_DEADLINE_MS": "10000",
            },
            cwd=copy,
            timeout=120,
        )

    with open(log, "wb") as errors:
        server = subprocess.Popen(
            [sys.executable, "-m", "charly_arbiter", "serve", "-v", "--socket", str(socket_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            env=env,
            cwd=copy,
            start_new_session=True,
        )
    served = Served(server, socket_path, log)
    try:
        served.wait_in_log("listening on")
        assert served_version().returncode == 0
        module = copy / "charly_arbiter" / "cli" / "status.py"
        module.write_text(module.read_text() + "\n# upgraded\n")
        served.wait_in_log("the code on disk changed")
        deadline = time.monotonic() + 60
        while served.log().count("listening on") < 2:
            assert time.monotonic() < deadline and server.poll() is None, served.log()
            time.sleep(0.05)
        served.wait_for_spares()
        assert served_version().returncode == 0
        assert len(served.ran()) == 2
        # The same process, execed: the pid of every line is the server's.
        assert f"serve[{server.pid}]: the code on disk changed" in served.log()
    finally:
        assert served.stop() == 0
    assert not socket_path.exists(), "the server execed anew still removes the socket it bound"


def test_a_client_of_another_package_runs_in_process(sim: SimEnv, tmp_path: Path):
    """The server runs one installation's code: a client of another (a checkout beside
    the installed package) is not served by it."""
    copy = tmp_path / "other"
    shutil.copytree(REPO / "charly_arbiter", copy / "charly_arbiter")
    with serving(tmp_path / "helper") as served:
        result = subprocess.run(
            [sys.executable, "-m", "charly_arbiter", "--version"],
            capture_output=True,
            text=True,
            env={**served.env(sim, mode=""), "PYTHONPATH": str(copy)},
            cwd=copy,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        served.wait_in_log("another interpreter or package")
        assert served.ran() == []


def test_idle_exit_and_sigterm(tmp_path: Path):
    idle = _serve("--socket", str(tmp_path / "idle.sock"), "--idle-exit", "0.2")
    assert idle.returncode == 0, idle.stderr
    assert not (tmp_path / "idle.sock").exists()
    with serving(tmp_path / "helper") as served:
        spares = served.spares()
        os.kill(served.pid, signal.SIGTERM)
        assert served.process.wait(timeout=30) == 0
        assert "stopped" in served.log()
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{pid}") for pid in spares):
            assert time.monotonic() < deadline, "the spares end with the server"
            time.sleep(0.02)


def test_an_unknown_option_is_a_usage_error():
    result = _serve("--no-such-option")
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr


@pytest.mark.parametrize(
    ("less", "why"),
    [(["--no-new-privs"], "NoNewPrivs"), (["--bounding-set=-sys_admin"], "fewer capabilities")],
)
def test_a_client_with_less_than_the_server_runs_in_process(
    sim: SimEnv, tmp_path: Path, less: list[str], why: str
):
    """A root client that was given less (no_new_privs, a smaller capability bounding
    set, as a sandboxed unit is) never has its command run by the server's full
    root: it runs in-process, with what it has."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv is missing (util-linux)")
    with serving(tmp_path / "helper") as served:
        result = subprocess.run(
            [setpriv, *less, "--", sys.executable, "-m", "charly_arbiter", "status", "--json"],
            capture_output=True,
            text=True,
            env=served.env(sim, mode=""),
            cwd=REPO,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        served.wait_in_log(why)
        assert served.ran() == []
