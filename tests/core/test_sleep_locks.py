"""Sleep locks (core/sleeplocks.py): an active exclusive lease holds a logind
inhibitor per token while its GPUs are passed through, recorded in its lease before
it is taken and forgotten once let go; `sleep = "allow"` holds none; a host that
cannot hold one (no systemd) never fails the claim; `restore` converges the host's
locks to what the leases need, after a kill -9 at any step."""

from __future__ import annotations

import itertools
import signal

import pytest
from coretools import assert_converged, read_ledger
from invariants import sleep_lock_violations
from simhosts import default_host

from charly_arbiter.core.model import (
    Claimant,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    ProcessRef,
    SleepPolicy,
)
from charly_arbiter.core.sleeplocks import (
    blocks_sleep,
    decide_sleep_locks,
    forgotten,
    lock_why,
    wanted,
    with_recorded,
)
from tests.conftest import DEFAULT_CONFIG

WIN11 = "gpu0 is passed through to libvirt:win11"


def locks(sim) -> dict[str, str]:
    return dict(sim.host().inhibitors())


def host_log(sim) -> list[str]:
    return list(sim.host().snapshot()["log"])


# -- on the simulated host, through the real CLI -----------------------------------------


def test_an_exclusive_claim_blocks_sleep_until_its_release(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    assert locks(sim) == {"gpu0": WIN11}
    lease = read_ledger(sim.state_dir).lease_of("libvirt:win11")
    assert lease.state is LeaseState.ACTIVE and lease.sleep_locks == ("gpu0",)
    log = host_log(sim)
    # Taken once the GPU is on vfio-pci (the VM may start only after it).
    assert log.index("inhibit gpu0") > log.index("switch 0000:0a:00.0 vfio-pci")

    sim.stopped("libvirt:win11")
    sim.cli("release", "libvirt:win11", check=True)
    assert locks(sim) == {}
    log = host_log(sim)
    # Let go of as the release begins, while the GPU is still the lease's.
    assert log.index("uninhibit gpu0") < log.index("switch 0000:0a:00.0 nvidia")
    assert_converged(sim)


def test_shared_claims_and_the_arbiter_s_own_operations_hold_no_lock(sim):
    sim.cli("acquire", "--shared", "container:batch", "gpu1", check=True)
    assert locks(sim) == {}
    assert not blocks_sleep(Mode.EXCLUSIVE, Claimant.parse("arbiter:mig/gpu0"), SleepPolicy.BLOCK)
    assert blocks_sleep(Mode.EXCLUSIVE, Claimant.parse("container:x"), SleepPolicy.BLOCK)


def test_sleep_allow_holds_no_lock(make_sim):
    sim = make_sim(config='sleep = "allow"\n' + DEFAULT_CONFIG)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    assert locks(sim) == {}
    assert read_ledger(sim.state_dir).lease_of("libvirt:win11").sleep_locks == ()
    assert not [line for line in host_log(sim) if "inhibit" in line]


def test_a_two_gpu_claim_holds_a_lock_per_gpu(sim):
    sim.set_host(default_host(dm_preemptible=True))
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", "gpu1", check=True)
    assert locks(sim) == {
        "gpu0": WIN11,
        "gpu1": "gpu1 is passed through to libvirt:win11",
    }


def test_a_host_without_systemd_starts_the_vm_and_records_why_sleep_is_not_blocked(sim):
    text = (sim.sim_dir / "host.toml").read_text()
    sim.set_host("systemd = false\n" + text)
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 0, result.stderr
    lease = read_ledger(sim.state_dir).lease_of("libvirt:win11")
    assert lease.state is LeaseState.ACTIVE
    assert "systemd is not running here" in lease.sleep_lock_error
    assert locks(sim) == {}
    history = sim.cli("history", "--json", check=True).stdout
    assert '"event": "sleep-lock-failed"' in history


def test_restore_takes_a_missing_lock_and_lets_go_of_a_stale_one(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    host = sim.host()
    host.uninhibit("gpu0")  # lost (an operator's `systemctl stop`)
    host.inhibit("gpu1", "gpu1 is passed through to libvirt:gone")  # nobody's
    assert sim.cli("restore", "--stranded").returncode == 0
    assert locks(sim) == {"gpu0": WIN11}
    assert read_ledger(sim.state_dir).lease_of("libvirt:win11").sleep_locks == ("gpu0",)


def test_restore_after_sleep_became_allowed_lets_go_and_forgets(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    sim.config_path.write_text('sleep = "allow"\n' + sim.config_path.read_text())
    assert sim.cli("restore", "--stranded").returncode == 0
    assert locks(sim) == {}
    assert read_ledger(sim.state_dir).lease_of("libvirt:win11").sleep_locks == ()


ACQUIRE_CRASHES = ("acquire.switch", "acquire.sleep", "acquire.active", "ledger.rename#5")
RELEASE_CRASHES = ("release.intent", "release.sleep", "release.switch", "release.start")


@pytest.mark.parametrize("step", ACQUIRE_CRASHES)
@pytest.mark.parametrize("vm_runs", [False, True])
def test_kill_9_in_a_claim_then_restore_leaves_the_locks_the_leases_need(sim, step, vm_runs):
    result = sim.cli(
        "acquire",
        "--exclusive",
        "libvirt:win11",
        "gpu0",
        env=sim.env(CHARLY_ARBITER_CRASH_AT=step),
    )
    assert result.returncode == -signal.SIGKILL
    check_sleep_locks(sim, step)
    if not vm_runs:
        sim.cli("sim", "stop", "libvirt:win11", check=True)
    assert sim.cli("restore", "--stranded").returncode == 0
    state = read_ledger(sim.state_dir)
    lease = state.lease_of("libvirt:win11")
    if vm_runs and lease is not None and lease.state is LeaseState.ACTIVE:
        assert locks(sim) == {"gpu0": WIN11}  # the VM runs with its GPU: no sleep
    else:
        assert locks(sim) == {}
    check_sleep_locks(sim, f"after restore ({step})")
    if not vm_runs:
        assert_converged(sim)


@pytest.mark.parametrize("step", RELEASE_CRASHES)
def test_kill_9_in_a_release_then_restore_lets_go_of_the_lock(sim, step):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    sim.stopped("libvirt:win11")
    result = sim.cli("release", "libvirt:win11", env=sim.env(CHARLY_ARBITER_CRASH_AT=step))
    assert result.returncode == -signal.SIGKILL
    check_sleep_locks(sim, step)
    assert sim.cli("restore", "--stranded").returncode == 0
    assert locks(sim) == {}
    assert_converged(sim)


def check_sleep_locks(sim, where: str) -> None:
    problems = sleep_lock_violations(read_ledger(sim.state_dir), locks(sim))
    assert not problems, f"{where}: {problems}"


# -- the rules, exhaustively over small ledgers and host locks ---------------------------

CLAIMANTS = (Claimant.parse("libvirt:a"), Claimant.parse("libvirt:b"))
TOKENS = ("gpu0", "gpu1")


def lease(claimant: Claimant, mode: Mode, tokens, state: LeaseState, owner: int = 0, locks=()):
    return Lease(
        claimant=claimant,
        mode=mode,
        tokens=tuple(tokens),
        state=state,
        transient=False,
        boot_id="boot",
        created="2026-01-01T00:00:00+00:00",
        owner_pid=owner,
        sleep_locks=tuple(locks),
    )


def small_states():
    """Every ledger of up to two leases on distinct tokens (I1), each in any state and
    mode, recording any of its tokens' locks, with or without a live writer."""
    shapes = list(
        itertools.product(Mode, LeaseState, (False, True), ((), ("gpu0",), ("gpu0", "gpu1")))
    )
    for first, second in itertools.product(shapes, [None, *shapes]):
        leases = []
        for claimant, shape, tokens in (
            (CLAIMANTS[0], first, ("gpu0",)),
            (CLAIMANTS[1], second, ("gpu1",)),
        ):
            if shape is None:
                continue
            mode, state, live, recorded = shape
            owner = 7 if live else 0
            leases.append(
                lease(claimant, mode, tokens, state, owner, [t for t in recorded if t in tokens])
            )
        yield LedgerState(leases=tuple(leases))


def host_locks():
    whys = (None, "right", "other")
    yield from itertools.product(whys, repeat=len(TOKENS))


@pytest.mark.parametrize("policy", list(SleepPolicy))
def test_converging_gives_exactly_the_locks_the_active_exclusive_leases_need(policy):
    for state, choice in itertools.product(small_states(), host_locks()):
        need = wanted(state, policy)
        held = {}
        for token, kind in zip(TOKENS, choice, strict=True):
            if kind == "right":
                held[token] = need.get(token, f"{token} is passed through to libvirt:gone")
            elif kind == "other":
                held[token] = f"{token} is passed through to libvirt:other"
        busy = frozenset(x.claimant for x in state.leases if x.owner_pid)
        plan = decide_sleep_locks(state, policy, held, busy)
        # Carried out: taken (recorded first), let go (forgotten after).
        after = dict(held)
        for token in plan.let_go:
            del after[token]
        for token, why, owner in plan.take:
            after[token] = why
            state_after = with_recorded(state, owner, [token])
            assert token in state_after.lease_of(owner).sleep_locks
        ledger = state
        for token, _, owner in plan.take:
            ledger = with_recorded(ledger, owner, [token])
        for token, owner in plan.record:
            ledger = with_recorded(ledger, owner, [token])
        ledger = forgotten(ledger, {*plan.let_go, *plan.forget})
        mine = {
            token
            for x in state.leases
            if x.claimant in busy
            for token in (*x.tokens, *x.sleep_locks)
        }
        context = (state, held, policy, plan)
        # Every lock not in a busy lease's hands is exactly what is needed...
        assert {t: w for t, w in after.items() if t not in mine} == {
            t: w for t, w in need.items() if t not in mine
        }, context
        # ...with its why, recorded by the lease that needs it, and nothing else recorded.
        for token, why in need.items():
            if token not in mine:
                assert why == lock_why(
                    token, next(x.claimant for x in state.leases if token in x.tokens)
                )
                owner = next(x for x in ledger.leases if token in x.tokens)
                assert token in owner.sleep_locks, context
        for token in {t for x in ledger.leases for t in x.sleep_locks} - mine:
            assert token in need, context
        # Busy leases' tokens are never touched.
        assert not mine & ({t for t, _, _ in plan.take} | set(plan.let_go) | set(plan.forget))
        if policy is SleepPolicy.ALLOW:
            assert not plan.take


def test_a_lease_in_the_hands_of_a_live_process_keeps_its_lock():
    acquiring = lease(CLAIMANTS[0], Mode.EXCLUSIVE, ["gpu0"], LeaseState.ACQUIRING, 7, ["gpu0"])
    state = LedgerState(leases=(acquiring,))
    held = {"gpu0": "gpu0 is passed through to libvirt:a"}
    assert decide_sleep_locks(state, SleepPolicy.BLOCK, held, {CLAIMANTS[0]}).empty
    # Its writer gone (a kill -9 before it turned active): nobody needs the lock.
    plan = decide_sleep_locks(state, SleepPolicy.BLOCK, held, frozenset())
    assert plan.let_go == ("gpu0",)
    assert ProcessRef(7) == acquiring.owner
