"""The resident helper is never a single point of failure, and never runs a command twice.

Real processes and real signals throughout: a server that is not there, whose socket
is stale, that was killed (kill -9) between requests or in the middle of one, that
is hung (SIGSTOP) before it answers, or that answers after the client's deadline;
a child killed in the middle of a command; a client killed while its child runs;
Ctrl-C passed on.  Every command still works, in-process when the helper did not
take it, within the deadline plus its own time, and the history and the ledger
show one claim, never two.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from servetools import Served, cli, history_events, processes, serving
from simhosts import default_host

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Mode
from charly_arbiter.serve import client
from charly_arbiter.serve.client import ENV_DEADLINE, ENV_SERVE, ENV_SOCKET
from tests.cli.clitools import ledger_locked
from tests.conftest import REPO, SimEnv
from tests.core.coretools import assert_converged, check_invariants

pytestmark = pytest.mark.slow

ACQUIRE = ["acquire", "--exclusive", "libvirt:win11", "gpu0"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    with serving(tmp_path / "helper") as served:
        yield served


def _claims(sim: SimEnv) -> list[dict[str, object]]:
    return history_events(sim, "claim")


def _leases(sim: SimEnv) -> list[str]:
    return [lease.claimant for lease in Ledger(sim.state_dir).read().leases]


def _one_claim(sim: SimEnv) -> None:
    """What a single acquire of libvirt:win11 leaves: one claim in the history, one lease."""
    assert [event["claimant"] for event in _claims(sim)] == ["libvirt:win11"], _claims(sim)
    assert _leases(sim) == ["libvirt:win11"]
    check_invariants(sim)


def _child_pid(served: Served, command: str) -> int:
    """The pid of the child that says it is running `command` (its log line's prefix)."""
    served.wait_in_log(f"running {command}")
    line = next(line for line in served.log().splitlines() if f"running {command}" in line)
    found = re.search(r"serve\[(\d+)\]", line)
    assert found is not None, line
    return int(found.group(1))


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}") or _zombie(pid):
            return True
        time.sleep(0.02)
    return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


# -- no server, or a dead one ----------------------------------------------------------------


def test_without_a_server_the_command_runs_in_process_at_once(sim: SimEnv, tmp_path: Path):
    """No socket at all, and a stale socket file (its server gone: connection
    refused): neither waits for the deadline, which is set far beyond the test's
    bound to show it."""
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(stale))  # bound and closed: a socket file nobody listens on
    for path in (tmp_path / "none.sock", stale):
        env = sim.env(**{ENV_SOCKET: str(path), ENV_DEADLINE: "60000"})
        ran = cli(["status", "--json"], env)
        assert ran.code == 0, ran.stderr
        assert ran.seconds < 30
    ran = cli(ACQUIRE, sim.env(**{ENV_SOCKET: str(stale), ENV_DEADLINE: "60000"}))
    assert ran.code == 0 and ran.seconds < 30, ran.stderr
    _one_claim(sim)


def test_must_says_why_the_helper_did_not_take_the_command(sim: SimEnv, tmp_path: Path):
    env = sim.env(**{ENV_SOCKET: str(tmp_path / "none.sock"), ENV_SERVE: "must"})
    ran = cli(ACQUIRE, env)
    assert ran.code == 1, ran.stderr
    assert "did not take the command" in ran.stderr and "No such file" in ran.stderr
    assert _claims(sim) == []
    off = cli(ACQUIRE, sim.env(**{ENV_SOCKET: str(tmp_path / "none.sock"), ENV_SERVE: "off"}))
    assert off.code == 0, off.stderr
    _one_claim(sim)


def test_a_server_killed_between_requests(sim: SimEnv, server: Served):
    """kill -9 of the server: its spares go with it (PR_SET_PDEATHSIG), nothing listens
    any more, and the next command runs in-process without waiting."""
    assert cli(["--version"], server.env(sim)).code == 0
    spares = server.spares()
    os.kill(server.pid, signal.SIGKILL)
    server.process.wait()
    assert all(_gone(pid) for pid in spares), "the spares died with the server"
    ran = cli(ACQUIRE, server.env(sim, mode="", **{ENV_DEADLINE: "60000"}))
    assert ran.code == 0 and ran.seconds < 30, ran.stderr
    assert not any("acquire" in line for line in server.ran())
    _one_claim(sim)


def test_a_server_killed_in_the_middle_of_a_request(sim: SimEnv, server: Served):
    """The request's child has a session of its own: the server's kill -9 (of its
    whole process group) does not touch it, and the command finishes as it would
    have in-process."""
    sim.state_dir.mkdir(mode=0o700)
    with ledger_locked(sim.state_dir):
        client = subprocess.Popen(
            [sys.executable, "-m", "charly_arbiter", *ACQUIRE],
            env=server.env(sim),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        child = _child_pid(server, "acquire --exclusive")
        os.killpg(server.pid, signal.SIGKILL)  # the server and its spares
        server.process.wait()
        assert os.path.exists(f"/proc/{child}"), "the child waits for the ledger's lock"
    _, stderr = client.communicate(timeout=120)
    assert client.returncode == 0, stderr
    _one_claim(sim)


# -- a server that does not answer in time ---------------------------------------------------


def _stop(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def _go_on(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("hung", ["server", "spares"])
def test_a_hung_or_late_server_never_runs_a_command_twice(sim: SimEnv, server: Served, hung: str):
    """SIGSTOP before it answers: the server with its spares (hung), or only the
    spares (the connection waits, and is taken after the client's deadline: a late
    answer).  The client runs the command in-process after its deadline; once the
    server goes on, the child that takes the stale request finds its client gone and
    does not run it."""
    spares = server.wait_for_spares()
    stopped = [server.pid, *spares] if hung == "server" else spares
    _stop(stopped)
    try:
        # Its pipes reach their end when it exits: the stopped server holds none of
        # them (descriptors travel with `go` only; libvirt reads a hook's to the end).
        ran = cli(ACQUIRE, server.env(sim, mode="", **{ENV_DEADLINE: "300"}), timeout=60)
    finally:
        _go_on(stopped)
    assert ran.code == 0, ran.stderr
    assert ran.seconds >= 0.3, "it waited for the deadline"
    server.wait_in_log("not run")
    assert not any("acquire" in line for line in server.ran()), server.log()
    _one_claim(sim)
    served = cli(["status", "--json"], server.env(sim))
    assert served.code == 0, "the server serves again"
    assert json.loads(served.stdout)["leases"][0]["claimant"] == "libvirt:win11"


@pytest.mark.parametrize("then", ["closes", "waits"])
def test_a_child_runs_nothing_without_go(
    sim: SimEnv, server: Served, monkeypatch: pytest.MonkeyPatch, then: str
):
    """The narrowest windows: the child's `ready` is in the client's socket when the
    client gives up (its deadline passed as it arrived) and closes without `go`; or
    the client stops between `ready` and `go` (SIGSTOP, swapped out) with its socket
    open.  The child has the request and could run it: it must not.  A client still
    there is told `refused`, and runs the command itself."""
    monkeypatch.setenv("CHARLY_ARBITER_CONFIG", str(sim.config_path))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(server.socket))
        sock.sendall(client.request(ACQUIRE, None))
        answer = b""
        while not answer.endswith(b"\n"):
            answer += sock.recv(64)
        assert answer.startswith(b"ready "), answer
        child = int(answer.split()[1])
        if then == "waits":
            sock.settimeout(60)
            assert sock.recv(64) == b"refused no go\n"
            assert _gone(child, timeout=120), "the child ended, its client still connected"
    assert _gone(child, timeout=120), "the child ended"
    assert "no `go`" in server.log()
    assert _claims(sim) == [] and not sim.state_dir.joinpath("ledger.toml").exists()


def test_a_deadline_the_server_cannot_meet(sim: SimEnv, server: Served):
    """A deadline of a millisecond, shorter than any fork: each command gives up and
    runs in-process, each late child exits without running.  Ten claims and
    releases, and the history has ten of each."""
    env = server.env(sim, mode="", **{ENV_DEADLINE: "1"})
    for _ in range(10):
        assert cli(["acquire", "--shared", "container:c", "gpu0"], env).code == 0
        assert cli(["release", "--force", "container:c"], env).code == 0
    assert len(_claims(sim)) == 10
    assert len(history_events(sim, "release")) == 10
    assert _leases(sim) == []


# -- children and clients that die ----------------------------------------------------------


def test_a_child_killed_in_the_middle_of_a_command(sim: SimEnv, server: Served):
    """kill -9 of the child in the middle of a claim (the crash point after the
    switch's intent is in the ledger): the client reports a failure (exit 1) with the
    command that converges, and `restore` converges; I1-I3 hold throughout."""
    ran = cli(ACQUIRE, server.env(sim, CHARLY_ARBITER_CRASH_AT="acquire.switch"))
    assert ran.code == 1, ran.stderr
    assert "ended without an exit status" in ran.stderr and "restore" in ran.stderr
    check_invariants(sim, "after the kill")
    restored = cli(["restore", "--stranded"], server.env(sim))
    assert restored.code == 0, restored.stderr
    check_invariants(sim, "after restore")
    assert_converged(sim)
    assert cli(["--version"], server.env(sim)).code == 0, "the server serves on"


def test_a_client_killed_takes_its_child_with_it(sim: SimEnv, server: Served):
    """kill -9 of the client of a long command (`status --json --follow`): its
    connection closes, and the child goes too, as the command would in-process."""
    client = subprocess.Popen(
        [sys.executable, "-m", "charly_arbiter", "status", "--json", "--follow"],
        env=server.env(sim),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        child = _child_pid(server, "status --json")
        assert client.stdout is not None and json.loads(client.stdout.readline())["leases"] == []
    finally:
        client.kill()
        client.wait()
    assert _gone(child), "the child outlived its client"


def test_ctrl_c_is_passed_on_and_said_as_in_process(make_sim, server: Served):
    """SIGINT to the client while its claim hangs in a switch: the child is
    interrupted as the command would be, says the same two lines, exits 1."""
    said = []
    for way in ("off", "must"):
        sim = make_sim(host=default_host(gpu0="hang_switch = true"), name=f"sim-{way}")
        sim.config_path.write_text(
            sim.config_path.read_text().replace("driver_switch = 2", "driver_switch = 60")
        )
        client = subprocess.Popen(
            [sys.executable, "-m", "charly_arbiter", *ACQUIRE],
            env=server.env(sim, mode=way),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # Ctrl-C as at a terminal, wherever the suite runs (see clitools.as_at_a_terminal).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 60
        history = sim.state_dir / "history.jsonl"
        while '"switching"' not in (history.read_text() if history.exists() else ""):
            assert client.poll() is None and time.monotonic() < deadline, client.communicate()
            time.sleep(0.05)
        time.sleep(0.3)  # into the write that hangs
        client.send_signal(signal.SIGINT)
        stdout, stderr = client.communicate(timeout=60)
        assert client.returncode == 1, stderr
        assert stdout == "" and "Traceback" not in stderr
        said.append("\n".join(stderr.strip().splitlines()[-2:]).replace(str(sim.root), "<root>"))
    assert "interrupted by SIGINT" in said[0]
    assert said[1] == said[0]


def test_the_detached_release_outlives_the_server(sim: SimEnv, server: Served):
    """A hook's release that brings holders back hands that to a detached process;
    through the helper its parent is the request's child, in a session of its own,
    so killing the server's whole process group does not touch it (systemd's part is
    the unit's KillMode=process).  The test holds the ledger's lock from the moment
    the hook returns, so the detached process is still waiting when the server dies."""
    sim.arbiter().acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    sim.stopped("libvirt:win11")
    xml = (
        "<domain><name>win11</name><devices><hostdev mode='subsystem' type='pci'><source>"
        "<address domain='0x0000' bus='0x0a' slot='0x00' function='0x0'/></source>"
        "</hostdev></devices></domain>"
    )
    lock = os.open(sim.state_dir / "ledger.lock", os.O_RDWR | os.O_CLOEXEC)
    try:
        ran = cli(["hook", "qemu", "win11", "release", "end", "-"], server.env(sim), xml)
        fcntl.flock(lock, fcntl.LOCK_EX)  # before the detached process has started Python
        assert ran.code == 0 and any(": ran hook qemu" in line for line in server.ran())
        finishers = [pid for pid, _, _ in processes() if _is_finisher(pid, sim)]
        assert len(finishers) == 1, "the release was handed to a detached process"
        os.killpg(server.pid, signal.SIGKILL)
        server.process.wait()
        time.sleep(0.2)
        assert os.path.exists(f"/proc/{finishers[0]}") and not _zombie(finishers[0])
    finally:
        os.close(lock)  # the detached process goes on
    deadline = time.monotonic() + 60
    while _leases(sim):
        assert time.monotonic() < deadline, _leases(sim)
        time.sleep(0.05)
    assert _gone(finishers[0])
    assert sim.host().snapshot()["running"]["container:llm"]
    check_invariants(sim)


def _is_finisher(pid: int, sim: SimEnv) -> bool:
    """A detached release of this test's simulated host (its hand-off names the host's
    configuration): the suite's other lanes, run beside it, start their own."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"finish-release" in argv and str(sim.config_path).encode() in argv
