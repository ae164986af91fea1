"""Safety defects found once (issue 9), one test each, on the simulated host with the
real CLI and hook.

Each of these failed on the code before the fix: the comment on each says what
it found then.  The invariants (tests/invariants.py) are checked after every
step where the defect broke one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from coretools import (
    HOLDER_REFS,
    REPO,
    check_invariants,
    host_state,
    ledger_bytes,
    read_ledger,
)
from simhosts import device

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import load_config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import LeaseState, Mode, ProcessRef, StepState
from charly_arbiter.errors import ClaimRefused
from charly_arbiter.host.procscan import process_ref
from charly_arbiter.host.sim import SimHost

PROC = Path("/proc")


def domain_xml(name: str, *addresses: str, description: str = "") -> bytes:
    hostdevs = "".join(
        "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
        f"<address domain='0x{a[0:4]}' bus='0x{a[5:7]}' slot='0x{a[8:10]}' "
        f"function='0x{a[11]}'/></source></hostdev>"
        for a in addresses
    )
    text = f"<description>{description}</description>" if description else ""
    return (
        f"<domain type='qemu'><name>{name}</name>{text}<devices>{hostdevs}</devices></domain>"
    ).encode()


def hook(sim, guest: str, operation: str, sub: str, extra: str, xml: bytes):
    return subprocess.run(
        [sys.executable, "-m", "charly_arbiter", "hook", "qemu", guest, operation, sub, extra],
        input=xml,
        capture_output=True,
        env=sim.env(),
        cwd=REPO,
        timeout=120,
    )


def settle(sim, deadline: float = 30.0) -> None:
    """Wait until no lease is acquiring or releasing (a detached release has ended)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if all(lease.state is LeaseState.ACTIVE for lease in read_ledger(sim.state_dir).leases):
            return
        time.sleep(0.05)
    raise AssertionError(f"not settled: {read_ledger(sim.state_dir).leases}")


# -- 1. a VM destroyed and started at once ------------------------------------------


def test_a_vm_destroyed_and_started_at_once_runs_with_its_lease(sim):
    """Before: the release hook handed off to a detached process with the lease still
    active; the next prepare answered "already held", then the detached process sent
    the GPU home: the VM ran without a lease, its holders ran too, and a third VM got
    the same GPU."""
    xml = domain_xml("win11", "0000:0a:00.0")
    for round_ in range(5):
        started = hook(sim, "win11", "prepare", "begin", "-", xml)
        assert started.returncode == 0, started.stderr
        assert started.stdout == b""
        check_invariants(sim, f"round {round_} after prepare")
        sim.stopped("libvirt:win11")  # virsh destroy: then libvirt runs the release hook
        released = hook(sim, "win11", "release", "end", "destroyed", xml)
        assert released.returncode == 0, released.stderr
        lease = read_ledger(sim.state_dir).lease_of("libvirt:win11")
        # Releasing already, under the lock, before the hook returned.
        assert lease is None or lease.state is LeaseState.RELEASING
        sim.host().set_running("libvirt:win11", True)  # virsh start at once
        again = hook(sim, "win11", "prepare", "begin", "-", xml)
        assert again.returncode == 0, again.stderr
        settle(sim)
        state = read_ledger(sim.state_dir)
        lease = state.lease_of("libvirt:win11")
        assert (
            lease is not None and lease.state is LeaseState.ACTIVE and lease.mode is Mode.EXCLUSIVE
        )
        snapshot = host_state(sim)
        assert snapshot["drivers"]["0000:0a:00.0"] == "vfio-pci"
        assert not snapshot["running"]["container:llm"]
        assert not snapshot["running"]["systemd:ollama.service"]
        check_invariants(sim, f"round {round_} after the restart")
        third = hook(
            sim, "linux-dev", "prepare", "begin", "-", domain_xml("linux-dev", "0000:0a:00.0")
        )
        assert third.returncode == 3 and b"held exclusively by libvirt:win11" in third.stderr
        sim.stopped("libvirt:win11")
        assert hook(sim, "win11", "release", "end", "destroyed", xml).returncode == 0
        settle(sim)
        sim.host().set_running("libvirt:win11", True)


def test_a_claim_that_read_the_drivers_before_a_release_finished_is_not_refused(sim):
    """Found by CI (the test above, Debian's python): a prepare read gpu0 on vfio-pci
    while its previous lease was releasing; the release then sent gpu0 home and gave the
    lease back before the prepare took the lock, and the planner, with no lease and the
    stale drivers, refused the VM as "on vfio-pci and no lease accounts for it".  Here
    the first reading is made stale by hand: the claim reads again and goes through."""
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    stale = arbiter.tokens.reread(["gpu0"])  # on vfio-pci, under the lease
    sim.stopped("libvirt:win11")
    arbiter.release_claimant("libvirt:win11")
    sim.host().set_running("libvirt:win11", True)
    assert host_state(sim)["drivers"]["0000:0a:00.0"] == "nvidia"
    readings = iter([stale])
    fresh = arbiter.tokens.reread
    arbiter.tokens.reread = lambda names: next(readings, None) or fresh(names)  # type: ignore[method-assign]
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert read_ledger(sim.state_dir).lease_of("libvirt:win11") is not None
    check_invariants(sim, "after the claim")


def test_a_prepare_that_waits_too_long_for_its_release_is_refused_clearly(sim):
    """A release that never ends (its writer hung) does not let the VM start without a
    lease: the prepare waits `claim_wait`, then refuses with the reason."""
    text = sim.config_path.read_text().replace(
        "claim_grace = 0.001", "claim_grace = 0.001\nclaim_wait = 1"
    )
    sim.config_path.write_text(text)
    sim.arbiter().acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    sleeper = subprocess.Popen(["/bin/sleep", "60"])
    try:
        _unfinished_lease_by(sim, process_ref(PROC, sleeper.pid), LeaseState.RELEASING)
        started = time.monotonic()
        result = hook(sim, "win11", "prepare", "begin", "-", domain_xml("win11", "0000:0a:00.0"))
        assert result.returncode == 3  # refused: the start fails, as on any non-zero
        assert b"its previous lease is still being released" in result.stderr
        assert time.monotonic() - started >= 1.0
    finally:
        sleeper.kill()
        sleeper.wait()


# -- 2. a preempted shared claimant comes back beside a new exclusive lease ---------


def test_a_preempted_shared_claimant_is_not_reinstated_beside_a_new_exclusive_lease(sim):
    """Before: releasing an exclusive lease restarted a preempted shared claimant and
    recreated its lease without looking whether another exclusive lease had taken the
    GPU meanwhile (I1), and the GPU then stayed on vfio-pci under the shared lease.
    Now the write that records gpu0 home also marks container:llm as being started,
    so there is no moment between them: libvirt:b's claim right after it is refused
    (try again), not granted beside the comeback; once container:llm runs with its
    lease back, b's claim preempts it as any, and b's release gives it back."""
    arbiter = sim.arbiter()
    arbiter.acquire("container:llm", Mode.SHARED, ["gpu0"])
    arbiter.acquire("libvirt:a", Mode.EXCLUSIVE, ["gpu0"])  # preempts container:llm
    sim.stopped("libvirt:a")
    from charly_arbiter.core import crashpoints

    seen = []

    def between(step: str) -> None:
        # The first moment after libvirt:a sent gpu0 home: libvirt:b claims gpu0.
        if step != "ledger.unlocked":
            return
        releasing = read_ledger(sim.state_dir).lease_of("libvirt:a")
        if releasing is not None and releasing.switch_state("gpu0") is StepState.DONE:
            crashpoints.hook = None
            seen.append([(str(r.holder), r.state) for r in releasing.unrestored()])
            with pytest.raises(ClaimRefused, match="being started again"):
                sim.arbiter().acquire("libvirt:b", Mode.EXCLUSIVE, ["gpu0"], wait=0)
            check_invariants(sim, "libvirt:b refused during the release")

    crashpoints.hook = between
    try:
        arbiter.release_claimant("libvirt:a")
    finally:
        crashpoints.hook = None
    assert len(seen) == 1 and ("container:llm", StepState.STARTING) in seen[0], seen
    state = read_ledger(sim.state_dir)
    assert [(lease.claimant, lease.mode) for lease in state.leases] == [
        ("container:llm", Mode.SHARED)
    ]
    check_invariants(sim, "after the release")
    arbiter.acquire("libvirt:b", Mode.EXCLUSIVE, ["gpu0"])  # preempts container:llm again
    lease = read_ledger(sim.state_dir).lease_of("libvirt:b")
    assert lease is not None and {r.holder for r in lease.unrestored()} >= {"container:llm"}
    check_invariants(sim, "libvirt:b holds gpu0")
    sim.stopped("libvirt:b")
    arbiter.release_claimant("libvirt:b")
    state = read_ledger(sim.state_dir)
    assert [(lease.claimant, lease.mode) for lease in state.leases] == [
        ("container:llm", Mode.SHARED)
    ]
    assert host_state(sim)["drivers"]["0000:0a:00.0"] == "nvidia"
    check_invariants(sim, "at the end")


def test_a_preempted_shared_claimant_gets_no_lease_on_a_gpu_left_on_vfio(sim):
    """Found by the long state machine: an exclusive lease whose way home failed was
    restored; the shared claimant it had preempted came back with its shared lease on
    the GPU left on vfio-pci (poisoned), and clearing the poison then left a GPU on
    vfio-pci with no exclusive lease (I2).  It comes back without a lease there."""
    from coretools import bind_by_hand, host_toml

    arbiter = sim.arbiter()
    arbiter.acquire("container:llm", Mode.SHARED, ["gpu0"])
    arbiter.acquire("libvirt:a", Mode.EXCLUSIVE, ["gpu0"])  # preempts container:llm
    (sim.sim_dir / "host.toml").write_text(host_toml(gpu0="fail_switch = true"))
    sim.stopped("libvirt:a")
    arbiter.release_claimant("libvirt:a")  # gpu0 cannot go home: poisoned
    check_invariants(sim, "after the failed release")
    arbiter.restore(None)  # the stranded, half-released lease
    check_invariants(sim, "after restore")
    state = read_ledger(sim.state_dir)
    assert state.poison_of("gpu0") is not None
    assert state.leases == (), state.leases
    assert host_state(sim)["running"]["container:llm"] is True
    assert host_state(sim)["drivers"]["0000:0a:00.0"] == "vfio-pci"
    # The operator's repair: the GPU bound home by hand, the fault gone, the poison cleared.
    (sim.sim_dir / "host.toml").write_text(host_toml())
    bind_by_hand(sim.sim_dir, {"0000:0a:00.0": "nvidia", "0000:0a:00.1": "snd_hda_intel"})
    assert arbiter.clear_poison("gpu0")
    check_invariants(sim, "after poison clear")
    arbiter.acquire("container:llm", Mode.SHARED, ["gpu0"])
    check_invariants(sim, "claimed again")


# -- 4. the writer of an unfinished lease, known by pid alone -----------------------


def _unfinished_lease_by(
    sim, writer: ProcessRef | None, state: LeaseState = LeaseState.ACQUIRING
) -> None:
    """Make libvirt:win11's lease one that `writer` is still carrying out."""
    assert writer is not None
    with Ledger(sim.state_dir).transaction() as txn:
        lease = txn.state.lease_of("libvirt:win11")
        assert lease is not None
        txn.state = txn.state.with_lease(replace(lease, state=state).owned_by(writer))


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0]


def test_a_zombie_writer_is_dead(sim):
    """Before: kill(pid, 0) succeeds for a zombie, so its lease stayed "in progress"
    and `restore` refused until the zombie was reaped."""
    sim.arbiter().acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    zombie = subprocess.Popen(["/bin/true"])
    try:
        # Exited, not reaped: a zombie (waited for, not slept for).
        deadline = time.monotonic() + 30
        while _process_state(zombie.pid) != "Z":
            assert time.monotonic() < deadline, "/bin/true never exited"
            time.sleep(0.01)
        _unfinished_lease_by(sim, ProcessRef(zombie.pid))
        sim.stopped("libvirt:win11")
        assert "libvirt:win11" in sim.status()["stranded"]
        result = sim.cli("restore", "--stranded")
        assert result.returncode == 0 and "restored libvirt:win11" in result.stdout, result.stderr
    finally:
        zombie.wait()


def test_a_pid_reused_by_another_process_is_not_the_writer(sim):
    """Before: a live process that got the dead writer's pid kept its lease "in
    progress".  The start time tells them apart."""
    sim.arbiter().acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    other = subprocess.Popen(["/bin/sleep", "60"])
    try:
        real = process_ref(PROC, other.pid)
        assert real is not None
        _unfinished_lease_by(sim, ProcessRef(other.pid, real.start - 1))  # an earlier process
        sim.stopped("libvirt:win11")
        assert "libvirt:win11" in sim.status()["stranded"]
        assert sim.cli("restore", "--stranded").returncode == 0
        # The very same process, though, is alive: its lease is in progress.
        sim.host().set_running("libvirt:win11", True)
        sim.arbiter().acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
        _unfinished_lease_by(sim, real)
        sim.stopped("libvirt:win11")
        assert "libvirt:win11" not in sim.status()["stranded"]
        refused = sim.cli("restore", "libvirt:win11")
        assert refused.returncode == 3 and f"by process {other.pid}" in refused.stderr
    finally:
        other.kill()
        other.wait()


# -- 5. releasing a claimant that still runs -----------------------------------------


@pytest.mark.parametrize("command", [("release",), ("restore",)])
def test_releasing_or_restoring_a_claimant_that_runs_is_refused(sim, command):
    """Before: `release` (and `restore NAME`) sent the GPU home under a running VM (on
    a real host the unbind blocks until QEMU lets go, and the GPU is poisoned)."""
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    before = (ledger_bytes(sim.state_dir), host_state(sim))
    refused = sim.cli(*command, "libvirt:win11")
    assert refused.returncode == 3
    assert refused.stderr.startswith("charly-arbiter: libvirt:win11 still runs")
    assert "--force" in refused.stderr and refused.stdout == ""
    assert (ledger_bytes(sim.state_dir), host_state(sim)) == before
    forced = sim.cli(*command, "--force", "libvirt:win11")
    assert forced.returncode == 0, forced.stderr
    assert read_ledger(sim.state_dir).leases == ()


# -- 7. a failure that is not the arbiter's own error ---------------------------------


class _BrokenStop(SimHost):
    def stop(self, ref: str) -> None:
        if ref == "systemd:ollama.service":
            raise ValueError("a bug in a holder source")
        super().stop(ref)


def test_any_exception_after_the_first_side_effect_rolls_back(sim):
    """Before: only ArbiterError triggered the rollback, so a holder stayed stopped and
    the lease stayed `acquiring`."""
    config = load_config(sim.config_path, environ={})
    host = _BrokenStop(sim.sim_dir, switch_timeout=2)
    arbiter = Arbiter(config, host, Ledger(config.state_dir, config.timeouts.lock_wait))
    before = host_state(sim)
    with pytest.raises(ValueError, match="a bug"):
        arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert host_state(sim) == before
    assert read_ledger(sim.state_dir).leases == ()


# -- 8. odd state files ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo", "hardlink"])
def test_an_odd_lock_file_is_refused_and_nothing_is_touched(sim, tmp_path, kind):
    """Before: a symlink, directory or FIFO gave an internal error, and a lock file
    hard-linked to another file was accepted and that file truncated."""
    sim.cli("acquire", "--shared", "container:x", "gpu1", check=True)
    lock = sim.state_dir / "ledger.lock"
    lock.unlink()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "directory":
        lock.mkdir()
    elif kind == "fifo":
        os.mkfifo(lock, 0o600)
    else:
        os.link(victim, lock)
    before = (ledger_bytes(sim.state_dir), host_state(sim))
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", timeout=20)
    assert result.returncode == 1
    assert "ledger.lock" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2
    assert (ledger_bytes(sim.state_dir), host_state(sim)) == before
    assert victim.read_text() == "precious\n"


def test_a_directory_where_the_backup_temp_goes_is_refused(sim):
    sim.cli("acquire", "--shared", "container:x", "gpu1", check=True)
    (sim.state_dir / "ledger.toml.bak.tmp").mkdir()
    result = sim.cli("acquire", "--shared", "container:y", "gpu1")
    assert result.returncode == 1
    assert "ledger.toml.bak.tmp" in result.stderr and "is a directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_symlinked_history_file_is_one_line_and_the_claim_still_works(sim, tmp_path):
    """Before: a traceback without -v.  The history is not worth failing a claim for:
    the event is not kept, and the message says why in one line."""
    sim.cli("acquire", "--shared", "container:x", "gpu1", check=True)
    history = sim.state_dir / "history.jsonl"
    target = tmp_path / "elsewhere.jsonl"
    history.rename(target)
    history.symlink_to(target)
    before = target.read_bytes()
    result = sim.cli("acquire", "--shared", "container:y", "gpu1")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "history.jsonl: it is a symlink" in result.stderr
    assert target.read_bytes() == before


# -- 9. a start that can never succeed -----------------------------------------------


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("iommu = false\n", "the IOMMU is off"),
        ("vfio_pci = false\n", "vfio-pci is neither loaded nor installed"),
    ],
)
def test_a_host_that_cannot_pass_through_refuses_before_stopping_anything(sim, fault, why):
    """Before: on a host without an IOMMU a claim stopped its holders (12 s for a VM)
    before libvirt refused the start; the holder was then cold-restarted."""
    sim.set_host(fault + (sim.sim_dir / "host.toml").read_text())
    before = (ledger_bytes(sim.state_dir), host_state(sim))
    result = hook(sim, "win11", "prepare", "begin", "-", domain_xml("win11", "0000:0a:00.0"))
    assert result.returncode == 3
    assert why.encode() in result.stderr and b"cannot pass it through" in result.stderr
    assert (ledger_bytes(sim.state_dir), host_state(sim)) == before
    assert "refused" in sim.cli("history").stdout
    # Shared claims need no IOMMU.
    assert sim.cli("acquire", "--shared", "container:x", "gpu0").returncode == 0


def test_an_iommu_group_shared_with_another_device_is_refused(sim):
    nic = device(
        "0000:0c:00.0", vendor="8086", model="1533", pci_class="020000", driver="igb", group=12
    )
    sim.set_host((sim.sim_dir / "host.toml").read_text() + "\n" + nic)
    before = host_state(sim)
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 3
    assert "0000:0c:00.0 (class 020000)" in result.stderr
    assert host_state(sim) == before


# -- 10. smaller ---------------------------------------------------------------------------


def test_a_token_whose_lease_is_releasing_is_not_shown_idle(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    sim.set_host(
        (sim.sim_dir / "host.toml")
        .read_text()
        .replace('name = "llm"\n', 'name = "llm"\nfail_start = true\n')
    )
    sim.stopped("libvirt:win11")
    arbiter.release_claimant("libvirt:win11")  # home, but container:llm will not start
    status = json.loads(sim.cli("status", "--json").stdout)
    assert status["tokens"]["gpu0"]["mode"] == "releasing"
    assert "releasing" in sim.cli("status").stdout.split("\n", 1)[0]


def test_events_quote_values_with_spaces_in_the_log(sim):
    result = sim.cli("-v", "acquire", "--shared", "libvirt:my llm", "gpu1")
    assert result.returncode == 0, result.stderr
    assert 'claimant="libvirt:my llm"' in result.stderr


def test_every_holder_stays_recorded_through_a_refused_claim(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    refused = sim.cli("acquire", "--exclusive", "libvirt:other", "gpu0")
    assert refused.returncode == 3
    check_invariants(sim, "after a refusal")
    assert {r.holder for r in read_ledger(sim.state_dir).leases[0].unrestored()} == set(
        HOLDER_REFS[:2]
    )
    with pytest.raises(ClaimRefused):
        sim.arbiter().acquire("libvirt:other", Mode.EXCLUSIVE, ["gpu0"])


def test_explain_never_speaks_of_pid_0(sim):
    """Before: a release that could not finish left its lease with no writer, and
    `explain` said "pid 0"."""
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    sim.set_host(
        (sim.sim_dir / "host.toml")
        .read_text()
        .replace('name = "llm"\n', 'name = "llm"\nfail_start = true\n')
    )
    sim.stopped("libvirt:win11")
    assert sim.cli("release", "libvirt:win11").returncode == 1  # container:llm did not start
    lease = read_ledger(sim.state_dir).lease_of("libvirt:win11")
    assert lease is not None and lease.owner is None
    text = sim.cli("explain", "libvirt:win11").stdout
    assert "stranded" in text and "restore libvirt:win11" in text
    assert "pid 0" not in text and "process 0" not in text
