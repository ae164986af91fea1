"""Device-holding processes: real processes holding nodes of the fake tree open,
found through the real /proc, refused or terminated by policy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from charly_arbiter.core.host import TokenSpec
from charly_arbiter.errors import HolderError
from charly_arbiter.host.holders.process import ProcessHolders
from charly_arbiter.host.procscan import alive, scan

GPU = "0000:0a:00.0"


def token(host) -> TokenSpec:
    return TokenSpec("gpu0", GPU, tuple(host.token_functions("gpu0", GPU)))


@pytest.fixture
def holder(kernel):
    """A real `sleep` with the GPU's DRM node (dev/dri/card1 of the fake tree) open."""
    with open(kernel.dev / "dri" / "card1", "rb") as node:
        process = subprocess.Popen(["/bin/sleep", "60"], stdin=node)
    yield process
    if process.poll() is None:
        process.kill()
    process.wait()


def test_scan_finds_pid_command_and_node(kernel, holder):
    node = str(kernel.dev / "dri" / "card1")
    found = scan(Path("/proc"), {node})
    assert [(item.pid, item.comm, item.node) for item in found] == [(holder.pid, "sleep", node)]


def test_refuse_policy_reports_a_holder_that_is_not_preemptible(make_host, holder, kernel):
    host = make_host(process_policy="refuse")
    [found] = host.holders([token(host)])
    assert found.ref == f"process:{holder.pid}"
    assert not found.preemptible and found.running and not found.restartable
    assert "sleep" in found.detail and str(kernel.dev / "dri" / "card1") in found.detail
    assert found.tokens == ("gpu0",)


def test_terminate_policy_stops_it_with_sigterm(make_host, holder):
    host = make_host(process_policy="terminate")
    [found] = host.holders([token(host)])
    assert found.preemptible
    host.stop(found.ref)
    assert holder.wait(timeout=5) == -signal.SIGTERM
    assert not host.is_running(found.ref)


def test_a_process_that_ignores_sigterm_gets_sigkill_after_the_timeout(make_host, kernel):
    program = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    with open(kernel.dev / "dri" / "card1", "rb") as node:
        stubborn = subprocess.Popen(
            [sys.executable, "-c", program], stdin=node, stdout=subprocess.PIPE
        )
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    host = make_host(process_policy="terminate")  # holder_stop = 2 s
    started = time.monotonic()
    host.stop(f"process:{stubborn.pid}")
    assert 1.9 < time.monotonic() - started < 8
    assert stubborn.wait(timeout=5) == -signal.SIGKILL


def test_a_gone_process_stops_quietly_and_start_does_nothing(make_host):
    process = subprocess.Popen(["/bin/true"])
    process.wait()
    host = make_host()
    assert not host.is_running(f"process:{process.pid}")
    host.stop(f"process:{process.pid}")
    host.start(f"process:{process.pid}")


def test_zombies_hold_nothing(tmp_path):
    process = subprocess.Popen(["/bin/cat"], stdin=subprocess.PIPE)
    assert alive(Path("/proc"), process.pid)  # running (waiting for input)
    assert process.stdin is not None
    process.stdin.close()
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert not alive(Path("/proc"), process.pid)
    process.wait()


def test_own_process_is_not_a_holder(make_host, kernel):
    with open(kernel.dev / "dri" / "card1", "rb"):
        host = make_host()
        assert host.holders([token(host)]) == []


def test_no_nodes_no_holders(make_host, kernel):
    host = make_host()
    source = ProcessHolders(host.config, host.sysfs, dev_root=kernel.dev)
    assert source.holders([TokenSpec("none", "0000:00:17.0", ())]) == []


def test_a_ref_of_another_kind_is_refused():
    from charly_arbiter.core.config import Config

    with pytest.raises(HolderError):
        ProcessHolders(Config()).is_running("systemd:x.service")
