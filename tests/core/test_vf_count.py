"""The VF count as the arbiter's (`charly-arbiter vfs`, core/vfcount.py) on the simulated
host, whose `sriov_numvfs` behaves as Linux 6.1's did on the real kernel
(tests/host/test_sriov_model.py holds it to tests/kernel/test_sriov_kernel.py):
through 0, refused while a VF is leased or held by a real process, a teardown
that hangs met by the watchdog and poisoned, a crash left for `restore`, and
the counts of arbiter.toml applied at boot by the reconcile unit's own commands.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from simhosts import PF, VF0, VF1, default_host, sriov_pf, sriov_tokens

from charly_arbiter.core import crashpoints
from charly_arbiter.core.host import TokenSpec
from charly_arbiter.core.model import VFIO, Mode, operation_claimant
from charly_arbiter.core.vfcount import set_vf_count
from charly_arbiter.errors import ClaimRefused, VfCountHung, VfCountRefused
from tests.conftest import DEFAULT_CONFIG, REPO, SimEnv

UNIT = REPO / "etc" / "systemd" / "charly-arbiter-reconcile.service"


@pytest.fixture
def sriov(make_sim) -> SimEnv:
    """gpu0 and gpu1 as ever, and an SR-IOV PF configured for 2 VFs, with no VF yet
    (as after a boot); vf0 is configured on its first VF."""
    return make_sim(host=default_host() + sriov_pf(), config=DEFAULT_CONFIG + sriov_tokens(2))


def vfs_of(sim: SimEnv) -> list[str]:
    return sorted(sim.host().snapshot()["vfs"])


def hold_vf_node(sim: SimEnv, vf: str) -> subprocess.Popen[bytes]:
    """A real process that holds the VF's VFIO group node open (what QEMU does)."""
    group = sim.host().snapshot()["vfs"][vf]["iommu_group"]
    node = sim.sim_dir / "dev" / "vfio" / str(group)
    assert node.exists(), node
    holder = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(node)!r}); import time; time.sleep(300)"]
    )
    deadline = time.monotonic() + 10
    while not any(
        Path(f"/proc/{holder.pid}/fd").iterdir() and str(node) in str(link.readlink())
        for link in Path(f"/proc/{holder.pid}/fd").iterdir()
    ):
        assert time.monotonic() < deadline, "the holder never opened the node"
        time.sleep(0.02)
    return holder


def to_vfio_by_hand(sim: SimEnv, vf: str) -> None:
    """A VF bound to vfio-pci outside the arbiter (no token, no lease)."""
    host = sim.host()
    host.switch(TokenSpec(vf, vf, tuple(host.token_functions(vf, vf))), {vf: VFIO})


def test_vfs_makes_and_removes_the_vfs_always_through_zero(sriov: SimEnv) -> None:
    result = sriov.cli("vfs", "pf", "2", check=True)
    assert result.stdout.startswith("pf: 0 -> 2 VFs (")
    assert vfs_of(sriov) == [VF0, VF1]
    # 2 -> 1: the kernel refuses a change while VFs exist (EBUSY), so 0 first.
    result = sriov.cli("vfs", "--json", "pf", "1", check=True)
    done = json.loads(result.stdout)
    assert (done["before"], done["count"], len(done["seconds"])) == (2, 1, 2)
    assert vfs_of(sriov) == [VF0]
    log = sriov.host().snapshot()["log"]
    assert log[-2:] == [f"sriov {PF} 0", f"sriov {PF} 1"]
    assert sriov.cli("vfs", "pf", "1", check=True).stdout.strip() == "pf has 1 VFs already"
    # The operation's lease is gone, and the history says what happened.
    assert sriov.status()["leases"] == []
    history = sriov.cli("history", check=True).stdout
    assert "pf: changing its VF count from 2 to 1" in history
    assert "pf has 1 VFs now (took" in history
    status = sriov.status()["tokens"]
    assert status["pf"]["virtual_functions"] == [VF0] and status["pf"]["total_vfs"] == 2
    assert status["vf0"]["physical_function"] == PF and not status["vf0"]["absent"]


def test_a_count_change_is_refused_while_a_vf_is_leased_naming_the_lease(sriov: SimEnv) -> None:
    sriov.cli("vfs", "pf", "2", check=True)
    sriov.cli("acquire", "--exclusive", "libvirt:vm", "vf0", check=True)
    result = sriov.cli("vfs", "pf", "0")
    assert result.returncode == 3, result.stderr
    assert f"{VF0} (token vf0) is leased by libvirt:vm (exclusive)" in result.stderr
    assert vfs_of(sriov) == [VF0, VF1]
    # Nor may the PF be taken from under it; once the VM is gone, both go ahead.
    result = sriov.cli("acquire", "--exclusive", "libvirt:whole", "pf")
    assert result.returncode == 3 and "virtual functions are in use" in result.stderr
    sriov.stopped("libvirt:vm")
    sriov.cli("release", "libvirt:vm", check=True)
    sriov.cli("vfs", "pf", "0", check=True)
    # The VF's token, absent now, is refused with how to make it ...
    result = sriov.cli("acquire", "--exclusive", "libvirt:vm", "vf0")
    assert result.returncode == 3 and "does not exist now" in result.stderr
    assert "`charly-arbiter vfs pf N`" in result.stderr
    # ... and the PF, without VFs, is passed through as a whole.
    sriov.cli("acquire", "--exclusive", "libvirt:whole", "pf", check=True)
    result = sriov.cli("acquire", "--exclusive", "libvirt:vm", "vf0")
    assert result.returncode == 3 and "held exclusively by libvirt:whole" in result.stderr


def test_a_count_change_is_refused_while_a_process_holds_a_vf(sriov: SimEnv) -> None:
    """The second VF is no token; a real process holds its VFIO node open."""
    sriov.cli("vfs", "pf", "2", check=True)
    to_vfio_by_hand(sriov, VF1)
    holder = hold_vf_node(sriov, VF1)
    try:
        result = sriov.cli("vfs", "pf", "0")
        assert result.returncode == 3, result.stderr
        assert f"{VF1} is open: pid {holder.pid}" in result.stderr
        result = sriov.cli("acquire", "--exclusive", "libvirt:whole", "pf")
        assert result.returncode == 3 and f"pid {holder.pid}" in result.stderr
    finally:
        holder.kill()
        holder.wait()
    sriov.cli("vfs", "pf", "0", check=True)
    assert vfs_of(sriov) == []


def test_a_hung_teardown_is_met_by_the_watchdog_and_poisons_the_pf(sriov: SimEnv) -> None:
    """The kernel blocks a teardown while a VF's VFIO device is held; a process can hold
    the device by its device fd alone, having closed the group's node, which no scan of
    /dev nodes sees (the sim's `hang_sriov_teardown`, as on the real kernel,
    tests/kernel/test_sriov_kernel.py).  The watchdog gives up, the PF is poisoned saying
    what holds the VF and what to do, and nothing claims it or its VFs until it is
    cleared once the write has returned."""
    sriov.cli("vfs", "pf", "2", check=True)
    sriov.set_host(default_host() + sriov_pf(extra="hang_sriov_teardown = true\n"))
    to_vfio_by_hand(sriov, VF1)
    started = time.monotonic()
    with pytest.raises(VfCountHung) as hung:
        set_vf_count(sriov.arbiter(), "pf", 0)
    detected = time.monotonic() - started
    assert 2 <= detected < 3.5  # timeouts.driver_switch = 2
    hint = hung.value.hint or ""
    assert hint.startswith("pf is poisoned now: stop the holder of its VF's VFIO device")
    assert hint.endswith("then run `charly-arbiter poison clear pf`")
    poison = sriov.arbiter().ledger.read().poison_of("pf")
    assert poison is not None
    assert "no process the arbiter can see" in poison.reason
    assert "the watchdog cannot end a write stuck in the kernel, only its holder can" in (
        poison.reason
    )
    assert sriov.status()["leases"] == []
    for claim in (("--exclusive", "libvirt:vm", "vf0"), ("--exclusive", "libvirt:w", "pf")):
        result = sriov.cli("acquire", *claim)
        assert result.returncode == 3 and "poisoned" in result.stderr, result.stderr
    assert sriov.cli("vfs", "pf", "2").returncode == 3
    # The holder let go (the kernel's hang ends with it): the write returns, the VFs go.
    sriov.set_host(default_host() + sriov_pf())
    deadline = time.monotonic() + 10
    while vfs_of(sriov):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sriov.cli("poison", "clear", "pf", check=True)
    sriov.cli("vfs", "pf", "2", check=True)


def test_the_cli_says_the_hang_in_two_sentences_and_exits_1(sriov: SimEnv) -> None:
    sriov.cli("vfs", "pf", "1", check=True)
    sriov.set_host(default_host() + sriov_pf(extra="hang_sriov_teardown = true\n"))
    to_vfio_by_hand(sriov, VF0)
    result = sriov.cli("vfs", "pf", "0")
    assert result.returncode == 1, result.stderr
    assert "writing 0 to sriov_numvfs failed: the write did not return within 2 s" in (
        result.stderr
    )
    assert "hint: pf is poisoned now" in result.stderr
    sriov.set_host(default_host() + sriov_pf())


def test_a_claim_on_a_vf_waits_while_its_pfs_count_is_changing(sriov: SimEnv) -> None:
    """The count change's lease (arbiter:vfs/pf, here from 0 to 2) keeps VF claims out
    (a retry, not a refusal: the VF is about to exist), a second change, and an
    exclusive claim on the PF, while it runs."""
    arbiter = sriov.arbiter()
    spec = arbiter.tokens.reread(["pf"])[0]
    from charly_arbiter.core.vfs import decide_count

    with arbiter.ledger.transaction() as txn:
        plan = decide_count(
            txn.state,
            spec,
            2,
            parents=arbiter.tokens.parents(),
            coverage=arbiter.tokens.addresses(),
            vf_users=[],
            me=arbiter.owner,
            boot_id=arbiter.host.boot_id(),
            stranded=frozenset(),
            created="2026-01-01T00:00:00+00:00",
        )
        assert plan is not None and plan.writes == (2,)
        txn.state = txn.state.with_lease(plan.lease)
    with pytest.raises(ClaimRefused) as refused:
        sriov.arbiter().acquire("libvirt:vm", Mode.EXCLUSIVE, ["vf0"], wait=0)
    assert refused.value.retry and "is being changed" in str(refused.value)
    with pytest.raises(VfCountRefused) as second:
        set_vf_count(sriov.arbiter(), "pf", 0)
    assert second.value.retry and "under way" in str(second.value)
    # The PF itself is shared meanwhile (its users stay), never taken exclusively.
    with pytest.raises(ClaimRefused, match="acquiring"):
        sriov.arbiter().acquire("libvirt:whole", Mode.EXCLUSIVE, ["pf"], wait=0)


def test_a_change_cut_short_by_a_signal_poisons_the_pf(sriov: SimEnv) -> None:
    """Ctrl-C between the writes of 2 -> 1 (the count is 0 then): nobody can say where
    the kernel is, so the PF is poisoned, as a switch cut short is; its lease goes."""
    sriov.cli("vfs", "pf", "2", check=True)
    writes = []

    def interrupt(step: str) -> None:
        if step == "vfs.write":
            writes.append(step)
            if len(writes) == 2:
                raise KeyboardInterrupt

    crashpoints.hook = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            set_vf_count(sriov.arbiter(), "pf", 1)
    finally:
        crashpoints.hook = None
    state = sriov.arbiter().ledger.read()
    assert state.lease_of(operation_claimant("vfs", "pf")) is None
    poison = state.poison_of("pf")
    assert poison is not None and "was interrupted" in poison.reason
    assert vfs_of(sriov) == []  # the first write (0) was made, the second not


def test_a_real_kill_9_mid_change_is_stranded_and_restore_ends_it(sriov: SimEnv) -> None:
    """A real `vfs` process killed with SIGKILL while its write hangs: its lease stays,
    stranded (its writer is gone), and is ended by `restore --stranded`."""
    sriov.cli("vfs", "pf", "2", check=True)
    sriov.set_host(default_host() + sriov_pf(extra="hang_sriov_teardown = true\n"))
    to_vfio_by_hand(sriov, VF1)
    config = sriov.config_path.read_text().replace("driver_switch = 2", "driver_switch = 30")
    sriov.config_path.write_text(config)
    process = subprocess.Popen(
        [sys.executable, "-m", "charly_arbiter", "vfs", "pf", "0"],
        env=sriov.env(),
        cwd=REPO,
        stderr=subprocess.PIPE,
    )
    ours = operation_claimant("vfs", "pf")
    deadline = time.monotonic() + 20
    while sriov.arbiter().ledger.read().lease_of(ours) is None:
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    time.sleep(0.3)  # in the write now
    process.kill()
    process.wait()
    status = sriov.status()
    assert [lease["claimant"] for lease in status["leases"]] == [ours]
    assert status["stranded"] == [ours]
    sriov.set_host(default_host() + sriov_pf())
    sriov.cli("restore", "--stranded", check=True)
    assert sriov.status()["leases"] == []


def test_the_reconcile_unit_restores_then_sets_the_configured_counts_at_boot(
    sriov: SimEnv,
) -> None:
    """A reboot takes the VFs (the kernel does not keep the count) and strands the lease
    of the VM that had vf0: the unit's own commands, in its order (ExecStart, then
    ExecStartPost), end the lease and then make the configured VFs again."""
    sriov.cli("vfs", "pf", "2", check=True)
    sriov.cli("acquire", "--exclusive", "libvirt:vm", "vf0", check=True)
    sriov.cli("sim", "reboot", check=True)
    assert vfs_of(sriov) == []
    commands = [
        shlex.split(line.partition("=")[2])
        for line in UNIT.read_text().splitlines()
        if line.startswith(("ExecStart=", "ExecStartPost="))
    ]
    assert [command[1:] for command in commands] == [
        ["restore", "--stranded"],
        ["vfs", "--configured"],
    ]
    for command in commands:
        assert command[0] == "/usr/bin/charly-arbiter"
        sriov.cli(*command[1:], check=True)
    assert vfs_of(sriov) == [VF0, VF1]
    assert sriov.status()["leases"] == []
    # Without a configured count, the step sets nothing and says nothing is wrong.
    sriov.config_path.write_text(sriov.config_path.read_text().replace("vfs = 2\n", ""))
    assert sriov.cli("vfs", "--configured", check=True).stdout == ""
