"""A release that cannot finish says so, and the lock is never held while the
host is asked whether a claimant runs (that may be a libvirt call)."""

from __future__ import annotations

import fcntl
import os

from coretools import assert_converged, host_toml

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.model import Mode


def test_release_that_cannot_restart_a_holder_exits_1_and_keeps_the_lease(sim):
    assert sim.cli("acquire", "--shared", "container:llm", "gpu0").returncode == 0
    assert sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0").returncode == 0
    sim.set_host(host_toml(llm="fail_start = true"))

    sim.stopped("libvirt:win11")
    result = sim.cli("release", "libvirt:win11")

    assert result.returncode == 1, result.stderr
    assert "not everything came back" in result.stderr
    assert "charly-arbiter restore libvirt:win11" in result.stderr
    assert result.stdout == ""
    assert [lease["claimant"] for lease in sim.status()["leases"]] == ["libvirt:win11"]

    sim.set_host(host_toml())
    restored = sim.cli("restore", "libvirt:win11")
    assert restored.returncode == 0, restored.stderr
    assert sim.cli("release", "--force", "container:llm").returncode == 0
    assert_converged(sim)


class LockWatchingHost:
    """The real simulated host, noting every question or action on the host (whether
    a claimant runs, a start, a stop, a driver switch, a read of a token's drivers)
    made while another open file description could not take the ledger lock."""

    WATCHED = ("is_running", "are_running", "start", "stop", "switch", "token_functions")

    def __init__(self, inner, lock_path):
        self.inner = inner
        self.lock_path = lock_path
        self.asked_under_lock: list[str] = []

    def __getattr__(self, name):
        found = getattr(self.inner, name)
        if name not in self.WATCHED:
            return found

        def watched(*args, **kwargs):
            if self._locked():
                self.asked_under_lock.append(f"{name} {args[0]}")
            return found(*args, **kwargs)

        return watched

    def _locked(self) -> bool:
        if not self.lock_path.exists():
            return False
        fd = os.open(self.lock_path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)


def test_acquire_asks_whether_claimants_run_before_taking_the_lock(sim):
    first = sim.arbiter()
    first.acquire("container:llm", Mode.SHARED, ["gpu0"])
    first.acquire("container:web", Mode.SHARED, ["gpu0"])
    watching = LockWatchingHost(sim.host(), sim.state_dir / "ledger.lock")
    arbiter = Arbiter(first.config, watching, first.ledger)

    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])

    assert watching.asked_under_lock == []
    assert {lease.claimant for lease in arbiter.ledger.read().leases} == {"libvirt:win11"}


def test_a_release_touches_the_host_only_with_the_lock_let_go(sim):
    """Its decisions are made under the lock (core/release_planner.py); every read of
    and action on the host (whether a holder runs, its start, the switch home, the
    drivers) happens outside it: a start may run a VM's hook, which calls back in."""
    first = sim.arbiter()
    first.acquire("container:llm", Mode.SHARED, ["gpu0"])
    first.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    sim.stopped("libvirt:win11")
    watching = LockWatchingHost(sim.host(), sim.state_dir / "ledger.lock")
    arbiter = Arbiter(first.config, watching, first.ledger)

    assert arbiter.release_claimant("libvirt:win11")

    assert watching.asked_under_lock == []
    leases = arbiter.ledger.read().leases
    assert [(lease.claimant, lease.tokens) for lease in leases] == [("container:llm", ("gpu0",))]
