"""Crash injection with a real kill -9: the CLI runs with
CHARLY_ARBITER_CRASH_AT=STEP[#N] and SIGKILLs itself there (crashpoints.py).

After every crash the ledger parses and verifies, `restore` run as a real
process converges the simulated host (holders running, tokens home, no
leases), and a second `restore` changes nothing (ledger bytes and host state
compared).  Every step of the ledger write is hit in several transactions of
each workflow, and every step of the acquire and release workflows."""

from __future__ import annotations

import signal

import pytest
from coretools import (
    HOLDER_REFS,
    HOME,
    LEDGER_STEPS,
    assert_converged,
    host_state,
    ledger_bytes,
    read_ledger,
)

from charly_arbiter.core.model import LeaseState, Mode

ACQUIRE_STEPS = (
    "acquire.intent",
    "acquire.stop",
    "acquire.stop#2",
    "acquire.switch",
    "acquire.sleep",
    "acquire.active",
)
RELEASE_STEPS = (
    "release.intent",
    "release.sleep",
    "release.switch",
    "release.start",
    "release.start#2",
    "release.restored",
)

# (scenario, crash point): an exclusive claim from a clean host, the release
# of one, and an exclusive claim that preempts a shared claimant.
MATRIX = (
    [("acquire", step) for step in ACQUIRE_STEPS]
    # (the shared claim already stopped ollama: only container:llm is stopped)
    + [("preempt", step) for step in ACQUIRE_STEPS if step != "acquire.stop#2"]
    + [("release", step) for step in RELEASE_STEPS]
    # the intent, a step record, and the last transaction of each workflow
    + [("acquire", f"{step}#{n}") for step in LEDGER_STEPS for n in (1, 2, 5)]
    + [("release", f"{step}#{n}") for step in LEDGER_STEPS for n in (1, 3, 5)]
)
FAST = {
    ("acquire", "ledger.rename#1"),
    ("acquire", "acquire.stop#2"),
    ("preempt", "acquire.switch"),
    ("release", "release.start"),
    ("release", "ledger.write_half#3"),
}


def crash(sim, step, *args):
    result = sim.cli(*args, env=sim.env(CHARLY_ARBITER_CRASH_AT=step))
    return result.returncode == -signal.SIGKILL


def run_scenario(sim, scenario, step):
    if scenario == "preempt":
        sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    if scenario == "release":
        sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
        sim.stopped("libvirt:win11")  # the VM shuts down; its hook releases it
        died = crash(sim, step, "release", "libvirt:win11")
    else:
        died = crash(sim, step, "acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert died, f"the CLI never reached {step}"
    assert not (sim.state_dir / "ledger.lock").is_symlink()

    # The ledger is always one complete generation, old or new.
    state = read_ledger(sim.state_dir)
    assert all(lease.claimant in {"libvirt:win11", "container:llm"} for lease in state.leases)

    # The VM died with the command: its lease is stranded, whatever its state.
    sim.cli("sim", "stop", "libvirt:win11", check=True)
    if state.lease_of("libvirt:win11") is not None:
        assert "libvirt:win11" in sim.status()["stranded"]
    restored = sim.cli("restore", "--stranded")
    assert restored.returncode == 0, restored.stderr
    assert not (sim.state_dir / "ledger.toml.tmp").exists()

    if scenario == "preempt":
        # The preempted shared claimant is back, running, with its lease.
        leases = read_ledger(sim.state_dir).leases
        assert [(lease.claimant, lease.mode, lease.state) for lease in leases] == [
            ("container:llm", Mode.SHARED, LeaseState.ACTIVE)
        ]
        snapshot = host_state(sim)
        assert snapshot["drivers"] == HOME
        assert all(snapshot["running"][ref] for ref in HOLDER_REFS), snapshot
    else:
        assert_converged(sim)

    before = (ledger_bytes(sim.state_dir), host_state(sim))
    again = sim.cli("restore", "--stranded")
    assert again.returncode == 0 and again.stdout == "nothing to restore\n"
    assert (ledger_bytes(sim.state_dir), host_state(sim)) == before

    if scenario == "preempt":
        sim.cli("release", "--force", "container:llm", check=True)
        assert_converged(sim)


@pytest.mark.parametrize(("scenario", "step"), sorted(FAST))
def test_kill_9_then_restore_converges(sim, scenario, step):
    run_scenario(sim, scenario, step)


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "step"), [case for case in MATRIX if case not in FAST])
def test_kill_9_at_every_step_then_restore_converges(sim, scenario, step):
    run_scenario(sim, scenario, step)


def test_kill_9_in_the_middle_of_restore_then_restore_converges(sim):
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    sim.cli("sim", "stop", "libvirt:win11", check=True)
    assert crash(sim, "release.start#2", "restore", "--stranded")
    assert read_ledger(sim.state_dir).lease_of("libvirt:win11").state is LeaseState.RELEASING
    assert sim.cli("restore", "--stranded").returncode == 0
    sim.cli("release", "--force", "container:llm", check=True)
    assert_converged(sim)
