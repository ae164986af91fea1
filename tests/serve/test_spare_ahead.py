"""What a spare of the resident helper does while it waits (serve/prefault.py, the
CLI's read-ahead): it makes the server's memory its own, at idle priority, stops as
soon as a connection waits, and decodes the ledger ahead without ever serving a
command the bytes it decoded when the ledger changed since.  Real forks, real
page faults counted by the kernel, a real server and real CLI processes."""

from __future__ import annotations

import errno
import json
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from charly_arbiter.serve import prefault
from tests.conftest import REPO, SimEnv
from tests.serve.servetools import serving

MIB = 1 << 20


def faults_writing(memory: bytearray, before_writing: bool) -> int:
    """The minor faults a fork takes writing one byte to every page of `memory` (the
    parent's), after `prefault` or not."""
    listener, other = socket.socketpair()  # nothing waits on it: prefault runs to the end
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports through the pipe and never returns to pytest
        try:
            if before_writing:
                prefault.prefault(listener)
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for at in range(0, len(memory), 4096):
                memory[at] = 1
            taken = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
            os.write(write, str(taken).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        taken = int(answer.read() or "-1")
    os.waitpid(pid, 0)
    listener.close()
    other.close()
    return taken


def test_a_prefaulted_fork_writes_the_servers_memory_without_a_fault():
    memory = bytearray(16 * MIB)  # the parent's, shared with the fork until written
    pages = len(memory) // 4096
    assert faults_writing(memory, before_writing=False) >= pages // 2
    assert faults_writing(memory, before_writing=True) < pages // 20


def test_a_waiting_connection_stops_it_before_the_next_chunk():
    listener, client = socket.socketpair()
    calls: list[tuple[int, int]] = []

    def advise(address: int, length: int) -> int:
        calls.append((address, length))
        client.send(b"x")  # a connection arrives while the first chunk is copied
        return 0

    maps = "7f0000000000-7f0000800000 rw-p 00000000 00:00 0 \n"
    assert prefault.prefault(listener, advise, maps) == prefault.CHUNK
    assert calls == [(0x7F0000000000, prefault.CHUNK)]
    assert prefault.prefault(listener, advise, maps) == 0  # waiting from the start
    listener.close()
    client.close()


def test_only_private_writable_data_is_copied_a_chunk_at_a_time():
    maps = "\n".join(
        [
            "00400000-00600000 r-xp 00000000 08:01 12 /usr/bin/python3.11",
            "00600000-00601000 rw-p 00200000 08:01 12 /usr/bin/python3.11",
            "01000000-01500000 rw-p 00000000 00:00 0                          [heap]",
            "7f0000000000-7f0000001000 rw-s 00000000 00:05 7 /dev/zero (deleted)",
            "7f0000100000-7f0000101000 ---p 00000000 00:00 0 ",
            "7f0000200000-7f0000210000 rw-p 00000000 00:00 0 ",
            "7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                  [stack]",
            "7ffc00100000-7ffc00102000 r--p 00000000 00:00 0                  [vvar]",
        ]
    )
    listener, other = socket.socketpair()
    calls: list[tuple[int, int]] = []
    done = prefault.prefault(listener, lambda a, n: calls.append((a, n)) or 0, maps)
    heap = [
        (0x1000000 + at, min(prefault.CHUNK, 0x500000 - at))
        for at in range(0, 0x500000, prefault.CHUNK)
    ]
    assert calls == [(0x600000, 0x1000), *heap, (0x7F0000200000, 0x10000)]
    assert done == sum(length for _, length in calls)
    listener.close()
    other.close()


def test_a_kernel_without_the_advice_leaves_the_spare_as_it_was():
    listener, other = socket.socketpair()
    calls: list[int] = []

    def refuse(address: int, length: int) -> int:
        calls.append(address)
        return errno.EINVAL

    maps = "01000000-01500000 rw-p 00000000 00:00 0 [heap]\n"
    assert prefault.prefault(listener, refuse, maps) == 0
    assert len(calls) == 1  # asked once, not for every chunk
    listener.close()
    other.close()


def test_the_spare_works_at_idle_priority_and_waits_at_its_own():
    before = os.sched_getscheduler(0)
    with prefault.idle_priority():
        assert os.sched_getscheduler(0) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == before


def test_a_process_that_could_not_leave_idle_priority_never_takes_it():
    """Without CAP_SYS_NICE and with the default RLIMIT_NICE (0), leaving SCHED_IDLE is
    refused (sched(7)): such a server's spare works at its own priority instead of
    serving its request at idle priority (or dying of the refusal)."""
    script = (
        "import os, resource, sys; sys.path.insert(0, sys.argv[1]); "
        "from charly_arbiter.serve import prefault; "
        "resource.setrlimit(resource.RLIMIT_NICE, (0, 0)); "
        "os.setgid(65534); os.setuid(65534); "
        "before = os.sched_getscheduler(0); "
        "ctx = prefault.idle_priority(); ctx.__enter__(); "
        "inside = os.sched_getscheduler(0); ctx.__exit__(None, None, None); "
        "print(before, inside, os.sched_getscheduler(0))"
    )
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    done = subprocess.run(
        [sys.executable, "-c", script, str(REPO)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(os.SCHED_OTHER)] * 3


@pytest.fixture
def sim_served(sim: SimEnv, tmp_path: Path) -> Iterator[tuple[SimEnv, object]]:
    sim.cli("acquire", "--shared", "container:a", "gpu0", check=True)
    with serving(tmp_path / "serve", env=sim.env()) as served:
        yield sim, served


def test_a_change_after_the_spares_read_ahead_is_what_a_served_status_shows(sim_served):
    """The spares decoded the ledger with container:a; then container:b claims
    in-process: `status` through the helper reads the file again and shows both."""
    sim, served = sim_served
    served.wait_in_log("ahead: 1 leases")
    assert (
        sim.cli(
            "acquire", "--shared", "container:b", "gpu0", env=sim.env(CHARLY_ARBITER_SERVE="off")
        ).returncode
        == 0
    )
    shown = sim.cli("status", "--json", env=served.env(sim), check=True)
    claimants = [lease["claimant"] for lease in json.loads(shown.stdout)["leases"]]
    assert claimants == ["container:a", "container:b"]
    assert len(served.ran()) == 1


GROUP_AHEAD = """
import json, sys
from charly_arbiter import cli
from charly_arbiter.cli import app

print(cli._read_ahead(), file=sys.stderr)
ahead = app._built
def build(lazy):
    raise AssertionError("the command built its group again")
app.build = build
for argv in (["status", "--json"], ["--version"], ["status", "--json"]):
    try:
        cli.main(argv)
    except SystemExit as done:
        print(f"exit {done.code}", file=sys.stderr)
assert app._built is ahead
"""


def test_the_command_a_spare_takes_uses_the_group_it_built_ahead(sim: SimEnv) -> None:
    """What the spare built while it waited is what the command runs: the build is not
    done again (the test makes it fail), and the one group serves one command after
    another, each with a context of its own."""
    done = subprocess.run(
        [sys.executable, "-c", GROUP_AHEAD],
        env=sim.env(PYTHONPATH=str(REPO)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[1:] == ["exit 0", "exit 0", "exit 0"], done.stderr
    statuses = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(statuses) == 2 and json.loads(statuses[0]) == json.loads(statuses[1])
    assert "charly-arbiter, version" in done.stdout


def test_a_group_is_built_again_for_another_table_of_commands() -> None:
    from charly_arbiter.cli import COMMANDS
    from charly_arbiter.cli.app import built

    assert built(COMMANDS) is built(COMMANDS)
    fewer = {"status": COMMANDS["status"]}
    assert built(fewer).list_commands(None) == ["status"]  # type: ignore[arg-type]
    assert built(COMMANDS).list_commands(None) == sorted(COMMANDS)  # type: ignore[arg-type]
