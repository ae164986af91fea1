"""A service's processes are the service's, and drains with real processes (LocalHost).

The service's process is real and lives in a real cgroup named like the unit,
in the `name=systemd` hierarchy (/sys/fs/cgroup/systemd/system.slice/UNIT),
where systemd itself puts a unit's processes; its GPU node is the fake tree's
dev/dri/card1, which it holds open.  The outermost seam is `systemctl`: a small
script keeps the unit's state in a file.  It stands in for systemd here because
these tests run on the fake sysfs tree (an NVIDIA GPU, on this machine's
kernel), and for their faults (a drain that never lets go waits out its
timeout, a marker from an earlier boot, an operator's stop while drained),
which are quicker to meet here than in a guest.  The process closes its node on
SIGUSR1 (a model unloaded) and opens it again on SIGUSR2 (loaded again).

Under a real systemd (tests/kernel/test_systemd_units.py): a unit's process is
the unit's by the cgroup systemd put it in, and a unit drained in place by
`systemctl kill --signal=USR1` lets go of bochs-drm's card0, runs on, and takes
it again through its `ready` command.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import HolderConfig, Timeouts
from charly_arbiter.core.host import TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Mode
from charly_arbiter.errors import HolderError
from charly_arbiter.host.draining import Drained
from charly_arbiter.host.holders.systemd import SystemdHolders

GPU = "0000:0a:00.0"
HIERARCHY = Path("/sys/fs/cgroup/systemd")
SERVER = """
import os, signal, sys, time
node = sys.argv[1]
held = [os.open(node, os.O_RDONLY)]
def unload(*_):
    while held:
        os.close(held.pop())
def load(*_):
    if not held:
        held.append(os.open(node, os.O_RDONLY))
signal.signal(signal.SIGUSR1, unload)
signal.signal(signal.SIGUSR2, load)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""
SYSTEMCTL = """#!/bin/sh
for last; do :; done
case "$1" in
  is-active) [ -e "{state}/$last" ] ;;
  stop) rm -f "{state}/$last" ;;
  start) touch "{state}/$last" ;;
  *) exit 64 ;;
esac
"""


@pytest.fixture
def unit(tmp_path: Path) -> Iterator[str]:
    """A cgroup named like a service unit, removed afterwards."""
    slice_dir = HIERARCHY / "system.slice"
    if not os.access(HIERARCHY / "cgroup.procs", os.W_OK):
        pytest.skip("no writable name=systemd cgroup hierarchy to put a process in")
    created = not slice_dir.exists()
    name = f"ca-test-{os.getpid()}.service"
    (slice_dir / name).mkdir(parents=True)
    try:
        yield name
    finally:
        for pid in (slice_dir / name / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (HIERARCHY / "cgroup.procs").write_text(pid)
        (slice_dir / name).rmdir()
        if created:
            with contextlib.suppress(OSError):
                slice_dir.rmdir()


@pytest.fixture
def server(kernel, unit) -> Iterator[subprocess.Popen[str]]:
    """The service's process, holding the GPU's DRM node, inside the unit's cgroup."""
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(kernel.dev / "dri" / "card1")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    (HIERARCHY / "system.slice" / unit / "cgroup.procs").write_text(str(process.pid))
    yield process
    process.kill()
    process.wait()


@pytest.fixture
def unit_host(tmp_path: Path, make_host, unit) -> Callable[..., Drained]:
    """A LocalHost whose systemd source lists the unit (preemptible), with `changes`,
    and the drains around it (as compose.open_host gives it)."""
    state = tmp_path / "units"
    state.mkdir()
    (state / unit).touch()  # it runs
    systemctl = tmp_path / "systemctl"
    systemctl.write_text(SYSTEMCTL.format(state=state))
    systemctl.chmod(0o755)

    def make(**keys: object) -> Drained:
        listed = HolderConfig(f"systemd:{unit}", ("gpu0",), preemptible=True, **keys)  # type: ignore[arg-type]
        timeouts = Timeouts(driver_switch=1.0, holder_stop=2.0, lock_wait=5.0, holder_drain=2.0)
        host = make_host(holders=(listed,), timeouts=timeouts)
        host.registry.factories["systemd"] = lambda config: SystemdHolders(config, str(systemctl))
        host.registry.kinds = ("systemd",)
        return Drained(host, host.config)

    return make


def token(host: Drained) -> TokenSpec:
    return TokenSpec("gpu0", GPU, tuple(host.token_functions("gpu0", GPU)))


def comm(process: subprocess.Popen[str]) -> str:
    return Path(f"/proc/{process.pid}/comm").read_text().strip()


def holds(process: subprocess.Popen[str], node: Path) -> bool:
    fds = Path(f"/proc/{process.pid}/fd")
    return any(os.readlink(fd) == str(node) for fd in fds.iterdir())


def test_a_units_processes_are_the_units_and_a_strangers_refuse(
    unit_host, server, kernel, unit
) -> None:
    host = unit_host()
    holders = host.holders([token(host)])
    assert [holder.ref for holder in holders] == [f"systemd:{unit}"]
    [user] = host.device_users([token(host)])
    assert (user.pid, user.owner) == (server.pid, f"systemd:{unit}")
    assert (
        str(user)
        == f"pid {server.pid} ({comm(server)}) of systemd:{unit} has {kernel.dev}/dri/card1 open"
    )

    # Out of the unit's cgroup it is a process of its own, and refuses as before.
    (HIERARCHY / "cgroup.procs").write_text(str(server.pid))
    refs = [holder.ref for holder in host.holders([token(host)])]
    assert refs == [f"process:{server.pid}", f"systemd:{unit}"]


def test_a_drain_in_place_lets_go_keeps_running_and_comes_back_ready(
    unit_host, server, kernel, unit
) -> None:
    node = kernel.dev / "dri" / "card1"
    ready = f"kill -USR2 {server.pid}; sleep 0.3; ls -l /proc/{server.pid}/fd | grep -q card1"
    host = unit_host(
        stop="drain",
        drain=("/bin/kill", "-USR1", str(server.pid)),
        ready=("/bin/sh", "-c", ready),
    )
    arbiter = Arbiter(host.config, host, Ledger(host.config.state_dir, 5))
    plan = arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert [(step.holder, step.how) for step in plan.stops] == [(f"systemd:{unit}", "drain")]
    assert server.poll() is None and not holds(server, node)
    assert kernel.driver_of(GPU) == "vfio-pci"
    assert not host.is_running(f"systemd:{unit}")  # drained: it does not hold its GPU
    [drained] = host.holders([token(host)])
    assert not drained.running and "drained" in drained.detail

    arbiter.release_claimant("libvirt:win11", force=True)
    assert kernel.driver_of(GPU) == "nvidia"
    assert holds(server, node), "its ready command did not run"
    assert host.is_running(f"systemd:{unit}")


def test_a_drained_units_process_that_holds_the_gpu_again_is_a_holder_of_its_own(
    unit_host, server, unit
) -> None:
    """Drained, the unit does not hold its GPU: a process of its that opened the GPU's
    node again is no longer covered by the unit, and is a holder of its own."""
    host = unit_host(stop="drain", drain=("/bin/true",))
    host.drains._mark(f"systemd:{unit}")
    found = [(holder.ref, holder.running) for holder in host.holders([token(host)])]
    assert found == [(f"process:{server.pid}", True), (f"systemd:{unit}", False)]


def test_a_drain_that_does_not_let_go_fails_naming_what_holds_the_gpu(
    unit_host, server, kernel, unit
) -> None:
    host = unit_host(stop="drain", drain=("/bin/true",))
    arbiter = Arbiter(host.config, host, Ledger(host.config.state_dir, 5))
    started = time.monotonic()
    with pytest.raises(HolderError) as failed:
        arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert time.monotonic() - started >= host.config.timeouts.holder_drain
    assert str(failed.value) == (
        f"could not drain systemd:{unit}: its GPU is still held 2 s after the drain: "
        f"pid {server.pid} ({comm(server)}) of systemd:{unit} has {kernel.dev}/dri/card1 open"
    )
    assert kernel.driver_of(GPU) == "nvidia"
    assert Ledger(host.config.state_dir).read().leases == ()
    assert host.is_running(f"systemd:{unit}")


def test_a_drained_marker_of_an_earlier_boot_is_not_believed(unit_host, unit, tmp_path) -> None:
    host = unit_host(stop="drain", drain=("/bin/true",))
    host.drains._mark(f"systemd:{unit}")
    assert not host.is_running(f"systemd:{unit}")
    marker = next((host.config.state_dir / "drained").iterdir())
    marker.write_text("an-earlier-boot\n")
    assert host.is_running(f"systemd:{unit}")


def test_a_drain_before_a_stop_runs_first_and_a_failing_one_does_not_keep_it(
    unit_host, unit, tmp_path
) -> None:
    order = tmp_path / "order"
    host = unit_host(drain=("/bin/sh", "-c", f"echo drain >> {order}; exit 7"))
    host.stop(f"systemd:{unit}")
    assert order.read_text() == "drain\n"
    assert not host.is_running(f"systemd:{unit}")


def test_a_drained_unit_that_stopped_meanwhile_is_started_again(
    unit_host, server, kernel, unit, tmp_path
) -> None:
    host = unit_host(stop="drain", drain=("/bin/kill", "-USR1", str(server.pid)))
    arbiter = Arbiter(host.config, host, Ledger(host.config.state_dir, 5))
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    (tmp_path / "units" / unit).unlink()  # an operator stopped it while it was drained
    arbiter.release_claimant("libvirt:win11", force=True)
    assert (tmp_path / "units" / unit).exists(), "the release did not start it again"
    assert host.is_running(f"systemd:{unit}")
