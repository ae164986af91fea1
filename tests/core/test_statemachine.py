"""A hypothesis state machine over the real Arbiter, Ledger and simulated host.

Random sequences of acquire, release, restore, a claimant dying, a reboot,
and crashes in the middle of any of them (crashpoints.hook raises a
BaseException at a chosen step, the way a kill -9 would stop the process
there: nothing below it runs, no `except Exception` catches it).  A simple
model predicts which claims the rules allow; after every step the invariants
of the issue are checked on the ledger and the simulated host.

Runs on the newest hypothesis and on Debian 12's 6.67.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from coretools import ALL_PREEMPTIBLE, HOLDER_REFS, HOME, ledger_bytes
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from charly_arbiter.core import crashpoints
from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import load_config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import VFIO, LeaseState, Mode, ProcessRef
from charly_arbiter.core.planner import blocks_token
from charly_arbiter.errors import ClaimRefused
from charly_arbiter.host.sim import SimHost

CLAIMANTS = ("libvirt:a", "libvirt:b", "container:c", "container:d")
TOKENS = ("gpu0", "gpu1")
TOKEN_FUNCTIONS = {"gpu0": ("0000:0a:00.0", "0000:0a:00.1"), "gpu1": ("0000:0b:00.0",)}
CRASH_STEPS = (
    "ledger.open_temp",
    "ledger.write_half",
    "ledger.fsync_temp",
    "ledger.backup",
    "ledger.rename",
    "ledger.fsync_dir",
    "acquire.intent",
    "acquire.stop",
    "acquire.switch",
    "acquire.active",
    "release.intent",
    "release.switch",
    "release.start",
    "release.restored",
)
CONFIG = """
host = "sim:{sim}"
state_dir = "{state}"

[timeouts]
lock_wait = 5
driver_switch = 2
claim_grace = 0.001

[tokens.gpu0]
address = "0000:0a:00.0"

[tokens.gpu1]
address = "0000:0b:00.0"
"""


class Crash(BaseException):
    """Stands for a kill -9 at a crash point."""


def _dead_pid() -> int:
    child = subprocess.Popen(["/bin/true"])
    child.wait()
    return child.pid


token_sets = st.sampled_from([("gpu0",), ("gpu1",), ("gpu0", "gpu1")])


class ArbiterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="charly-sm-"))
        self.root.chmod(0o700)
        sim_dir = self.root / "host"
        sim_dir.mkdir()
        (sim_dir / "host.toml").write_text(ALL_PREEMPTIBLE)
        config_path = self.root / "arbiter.toml"
        config_path.write_text(CONFIG.format(sim=sim_dir, state=self.root / "state"))
        self.config = load_config(config_path, environ={})
        self.host = SimHost(sim_dir, switch_timeout=2)
        self.ledger = Ledger(self.config.state_dir, self.config.timeouts.lock_wait)
        # Every operation "runs in a process" that is gone by the time anyone
        # looks: an in-progress lease left by a crash is then stranded.
        self.owner = _dead_pid()
        self.dead: set[str] = set()
        self.crashed = False

    def teardown(self) -> None:
        crashpoints.hook = None
        shutil.rmtree(self.root, ignore_errors=True)

    def arbiter(self) -> Arbiter:
        return Arbiter(self.config, self.host, self.ledger, owner=ProcessRef(self.owner))

    # -- the model -----------------------------------------------------------------

    def predict(self, claimant: str, mode: Mode, tokens: tuple[str, ...]) -> bool | None:
        """Whether the rules allow the claim; None where a crash left things unsure."""
        if self.crashed:
            return None
        state = self.ledger.read()
        own = state.lease_of(claimant)
        if own is not None:
            return own.mode is mode and set(own.tokens) == set(tokens)
        for lease in state.leases:
            if not set(lease.tokens) & set(tokens):
                continue
            if lease.claimant in self.dead or lease.mode is Mode.EXCLUSIVE:
                return False
        return True

    # -- rules ---------------------------------------------------------------------

    @rule(claimant=st.sampled_from(CLAIMANTS), mode=st.sampled_from(Mode), tokens=token_sets)
    def acquire(self, claimant: str, mode: Mode, tokens: tuple[str, ...]) -> None:
        # A claimant that claims is starting (a VM in its prepare hook).
        self.host.set_running(claimant, True)
        self.dead.discard(claimant)
        expected = self.predict(claimant, mode, tokens)
        try:
            self.arbiter().acquire(claimant, mode, list(tokens))
            allowed = True
        except ClaimRefused:
            allowed = False
        assert expected is None or allowed == expected, (claimant, mode, tokens, expected)

    @rule(claimant=st.sampled_from(CLAIMANTS), failed=st.booleans())
    def release(self, claimant: str, failed: bool) -> None:
        had = self.ledger.read().lease_of(claimant) is not None
        # The claimant says it is done (its hook, after it stopped).
        assert self.arbiter().release_claimant(claimant, success=not failed, force=True) is had

    @rule(claimant=st.sampled_from(CLAIMANTS))
    def claimant_dies(self, claimant: str) -> None:
        self.host.set_running(claimant, False)
        self.dead.add(claimant)

    @rule()
    def restore_stranded(self) -> None:
        self.arbiter().restore()
        self._settle()

    @rule()
    def reboot(self) -> None:
        self.host.reboot()
        self.dead.update(CLAIMANTS)
        self.arbiter().restore()
        self._settle()
        self.dead.clear()

    @rule(
        op=st.sampled_from(["acquire", "release", "restore"]),
        claimant=st.sampled_from(CLAIMANTS),
        mode=st.sampled_from(Mode),
        tokens=token_sets,
        step=st.sampled_from(CRASH_STEPS),
        nth=st.integers(1, 3),
    )
    def crash(
        self, op: str, claimant: str, mode: Mode, tokens: tuple[str, ...], step: str, nth: int
    ) -> None:
        seen = 0

        def die_at(name: str) -> None:
            nonlocal seen
            if name == step:
                seen += 1
                if seen == nth:
                    raise Crash(name)

        crashpoints.hook = die_at
        try:
            if op == "acquire":
                self.host.set_running(claimant, True)
                self.dead.discard(claimant)
                self.arbiter().acquire(claimant, mode, list(tokens))
            elif op == "release":
                self.arbiter().release_claimant(claimant, force=True)
            else:
                self.arbiter().restore()
        except (Crash, ClaimRefused) as error:
            self.crashed |= isinstance(error, Crash)
        finally:
            crashpoints.hook = None

    @rule()
    def everyone_gone_then_restore_twice(self) -> None:
        # Restoring a lease starts again the shared claimants it preempted, with
        # their leases: they are alive again.  Everyone dies again until no
        # lease is left (each round removes at least the leases it restored).
        for _ in range(len(CLAIMANTS) + 1):
            for claimant in CLAIMANTS:
                self.host.set_running(claimant, False)
            self.dead.update(CLAIMANTS)
            self.arbiter().restore()
            if not self.ledger.read().leases:
                break
        state = self.ledger.read()
        assert state.leases == (), state.leases
        snapshot = self.host.snapshot()
        for ref in HOLDER_REFS:
            assert snapshot["running"][ref], (ref, snapshot["running"])
        assert snapshot["drivers"] == HOME
        before = (ledger_bytes(self.ledger.state_dir), self.host.snapshot()["running"])
        self.arbiter().restore()
        assert (ledger_bytes(self.ledger.state_dir), self.host.snapshot()["running"]) == before
        self._settle()

    def _settle(self) -> None:
        state = self.ledger.read()
        self.crashed = any(lease.state is not LeaseState.ACTIVE for lease in state.leases)

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def never_two_claims_where_one_is_exclusive(self) -> None:
        state = self.ledger.read()
        for token in TOKENS:
            blocking = [lease for lease in state.leases if blocks_token(lease, token)]
            if any(lease.mode is Mode.EXCLUSIVE for lease in blocking):
                assert len(blocking) == 1, (token, blocking)

    @invariant()
    def active_leases_have_their_drivers(self) -> None:
        state = self.ledger.read()
        drivers = self.host.snapshot()["drivers"]
        for lease in state.leases:
            if lease.state is not LeaseState.ACTIVE:
                continue
            for token in lease.tokens:
                for address in TOKEN_FUNCTIONS[token]:
                    want = VFIO if lease.mode is Mode.EXCLUSIVE else HOME[address]
                    assert drivers[address] == want, (lease, address, drivers)

    @invariant()
    def every_stopped_holder_is_recorded_in_exactly_one_lease(self) -> None:
        state = self.ledger.read()
        running = self.host.snapshot()["running"]
        owners: dict[str, list[str]] = {}
        for lease in state.leases:
            for record in lease.stopped:
                if not record.restored:
                    owners.setdefault(record.holder, []).append(lease.claimant)
        for holder, leases in owners.items():
            assert len(leases) == 1, (holder, leases)
        for ref in HOLDER_REFS:
            if not running[ref]:
                assert ref in owners, (ref, state.leases)

    @invariant()
    def without_a_crash_every_lease_is_active(self) -> None:
        if not self.crashed:
            assert all(lease.state is LeaseState.ACTIVE for lease in self.ledger.read().leases)


def machine_settings(examples: int) -> settings:
    return settings(
        max_examples=int(os.environ.get("CHARLY_TEST_EXAMPLES", examples)),
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


def test_state_machine():
    run_state_machine_as_test(ArbiterMachine, settings=machine_settings(20))


@pytest.mark.slow
def test_state_machine_long():
    """The same machine, long enough to reach rarer crash and hand-over orders."""
    run_state_machine_as_test(ArbiterMachine, settings=machine_settings(400))
