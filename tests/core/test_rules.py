"""Every rule of the issue, carried out by the real Arbiter on the simulated host.

In-process (fast); the CLI's own behaviour is in tests/cli.  The simulated
host is the real file-backed one, so each effect is read back from its state."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from coretools import (
    ALL_PREEMPTIBLE,
    HOME,
    REPO,
    assert_converged,
    bind_by_hand,
    host_state,
    host_toml,
    ledger_bytes,
)
from interleave import LogicalClock
from simhosts import holder

from charly_arbiter.core.model import VFIO, LeaseState, Mode, StepState
from charly_arbiter.errors import ClaimRefused, HolderError, SwitchFailed, TokenPoisoned

EXCL, SHARED = Mode.EXCLUSIVE, Mode.SHARED


def drivers(sim, *addresses):
    state = sim.host().snapshot()["drivers"]
    return [state[address] for address in addresses]


def running(sim, ref):
    return sim.host().is_running(ref)


def with_vms(host: str, *tokens: str) -> str:
    """The host with a VM that has each token passed through (libvirt:vm-gpu0, ...):
    the holders a shared claim stops, unlike the units and containers on the home driver."""
    return host + "".join(
        "\n" + holder("libvirt", f"vm-{token}", [token], preemptible=True) for token in tokens
    )


def test_exclusive_preempts_preemptible_holders_and_shared_claimants(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("container:llm", SHARED, ["gpu0"])
    # A unit on the home driver stays beside a shared use.
    assert running(sim, "systemd:ollama.service")
    plan = arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    assert {step.holder for step in plan.stops} == {"container:llm", "systemd:ollama.service"}
    assert drivers(sim, "0000:0a:00.0", "0000:0a:00.1") == [VFIO, VFIO]
    assert not running(sim, "container:llm")
    state = arbiter.ledger.read()
    assert [lease.claimant for lease in state.leases] == ["libvirt:win11"]
    (lease,) = state.leases
    assert lease.state is LeaseState.ACTIVE
    assert {r.holder for r in lease.stopped} == {"container:llm", "systemd:ollama.service"}


def test_refusal_names_the_non_preemptible_holder_and_changes_nothing(sim):
    before = host_state(sim)
    with pytest.raises(ClaimRefused) as refused:
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu1"])
    assert "systemd:display-manager.service" in str(refused.value)
    assert host_state(sim) == before
    assert ledger_bytes(sim.state_dir) is None or sim.arbiter().ledger.read().leases == ()


def test_two_exclusive_leases_on_a_token_are_refused(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:a", EXCL, ["gpu0"])
    with pytest.raises(ClaimRefused, match="held exclusively by libvirt:a"):
        arbiter.acquire("libvirt:b", EXCL, ["gpu0"])
    assert [lease.claimant for lease in arbiter.ledger.read().leases] == ["libvirt:a"]


def test_shared_refcount_first_switches_home_later_only_count(make_sim):
    sim = make_sim(with_vms(host_toml(), "gpu0"))
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:a", EXCL, ["gpu0"])
    sim.stopped("libvirt:a")
    arbiter.release_claimant("libvirt:a")
    # Bind the GPU to another driver by hand (its recorded home is nvidia).
    bind_by_hand(sim.sim_dir, {"0000:0a:00.0": "nouveau"})
    cdi_before = sim.host().snapshot()["cdi_generations"]
    first = arbiter.acquire("container:one", SHARED, ["gpu0"])
    # Only the VM, which has the GPU passed through, makes room.
    assert {s.holder for s in first.stops} == {"libvirt:vm-gpu0"}
    assert running(sim, "container:llm") and running(sim, "systemd:ollama.service")
    assert drivers(sim, "0000:0a:00.0", "0000:0a:00.1") == ["nvidia", "snd_hda_intel"]
    assert sim.host().snapshot()["cdi_generations"] == cdi_before + 1
    log_before = sim.host().snapshot()["log"]
    later = arbiter.acquire("container:two", SHARED, ["gpu0"])
    assert later.stops == () and later.switches == ()
    assert sim.host().snapshot()["log"] == log_before  # nothing touched on the host
    assert arbiter.status().tokens[0].claimants == ("container:one", "container:two")


def test_a_gpu_found_on_vfio_with_no_home_is_refused_or_sent_to_its_default(make_sim):
    """A shared claim used to be granted with the GPU left on no driver (issue 11).

    Found on vfio-pci with no lease, it is refused until an operator decides (issue
    17); sent home, it goes to the driver this host would bind it to, or to none."""
    from simhosts import audio, gpu, host

    from charly_arbiter.errors import TokenUnaccounted

    for default, outcome in (("", "refused"), ('default_driver = "nouveau"', "nouveau")):
        sim = make_sim(
            host(
                gpu("0000:0a:00.0", group=12, driver="vfio-pci", extra=default),
                audio("0000:0a:00.1", group=12),
                gpu("0000:0b:00.0", group=13, model="2204"),
            ),
            name=f"sim-{outcome}",
        )
        arbiter = sim.arbiter()
        with pytest.raises(TokenUnaccounted):
            arbiter.acquire("container:one", SHARED, ["gpu0"])
        sent = sim.cli("send-home", "gpu0")
        assert sent.returncode == 0, sent.stderr
        if outcome == "refused":
            assert drivers(sim, "0000:0a:00.0") == [""]  # no driver takes it
            with pytest.raises(
                ClaimRefused, match=r"no driver on this host can take 0000:0a:00\.0"
            ):
                arbiter.acquire("container:one", SHARED, ["gpu0"])
            assert drivers(sim, "0000:0a:00.0") == [""]
        else:
            arbiter.acquire("container:one", SHARED, ["gpu0"])
            assert drivers(sim, "0000:0a:00.0") == ["nouveau"]
            assert arbiter.ledger.read().home_of("gpu0")["0000:0a:00.0"] == "nouveau"


def test_a_gpu_with_the_console_is_refused_unless_the_token_releases_it(make_sim):
    from charly_arbiter.errors import PassthroughImpossible

    sim = make_sim(host_toml(gpu0="console = true"))
    with pytest.raises(PassthroughImpossible, match="the text console runs on it"):
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])
    assert drivers(sim, "0000:0a:00.0") == ["nvidia"]
    assert running(sim, "container:llm")  # refused before anything was stopped
    config = sim.config_path.read_text().replace(
        'address = "0000:0a:00.0"', 'address = "0000:0a:00.0"\nconsole = "release"'
    )
    sim.config_path.write_text(config)
    sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])
    assert drivers(sim, "0000:0a:00.0") == [VFIO]


def test_shared_refused_under_exclusive(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    with pytest.raises(ClaimRefused, match="exclusively by libvirt:win11"):
        arbiter.acquire("container:llm", SHARED, ["gpu0"])


def test_multi_token_claims_are_all_or_nothing(make_sim):
    sim = make_sim(host_toml(gpu1="fail_switch = true", dm_preemptible=True))
    arbiter = sim.arbiter()
    before = host_state(sim)
    with pytest.raises(SwitchFailed):
        arbiter.acquire("libvirt:win11", EXCL, ["gpu0", "gpu1"])
    # gpu0 was switched before gpu1 failed: it went back, and its holders came back.
    assert host_state(sim) == before
    assert arbiter.ledger.read().leases == ()
    # A refusal on one token takes nothing on the other.
    sim.set_host(host_toml())
    assert arbiter.clear_poison("gpu1")
    with pytest.raises(ClaimRefused, match="display-manager"):
        arbiter.acquire("libvirt:win11", EXCL, ["gpu0", "gpu1"])
    assert host_state(sim) == before


def test_release_returns_home_and_restores_in_reverse_order(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    log_start = len(sim.host().snapshot()["log"])
    sim.stopped("libvirt:win11")
    assert arbiter.release_claimant("libvirt:win11")
    log = sim.host().snapshot()["log"][log_start:]
    starts = [line for line in log if line.startswith("start ")]
    assert starts == ["start systemd:ollama.service", "start container:llm"]
    assert log.index("switch 0000:0a:00.0 nvidia") < log.index(starts[0])
    assert_converged(sim)
    assert arbiter.release_claimant("libvirt:win11") is False


def test_release_failed_is_released_the_same_way(sim):
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 0, result.stderr
    sim.stopped("libvirt:win11")
    result = sim.cli("release", "--failed", "libvirt:win11")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "released libvirt:win11\n"
    assert_converged(sim)


def test_last_shared_release_restores_what_the_first_stopped(make_sim):
    sim = make_sim(with_vms(host_toml(), "gpu0"))
    arbiter = sim.arbiter()
    arbiter.acquire("container:a", SHARED, ["gpu0"])
    arbiter.acquire("container:b", SHARED, ["gpu0"])
    sim.stopped("container:a")
    arbiter.release_claimant("container:a")  # hands what it stopped to container:b
    (lease,) = arbiter.ledger.read().leases
    assert lease.claimant == "container:b"
    assert {r.holder for r in lease.stopped} == {"libvirt:vm-gpu0"}
    assert not running(sim, "libvirt:vm-gpu0") and running(sim, "container:llm")
    sim.stopped("container:b")
    arbiter.release_claimant("container:b")
    assert_converged(sim)
    assert running(sim, "libvirt:vm-gpu0")


def test_shared_release_hands_over_only_what_the_remaining_lease_holds(make_sim):
    sim = make_sim(with_vms(host_toml(dm_preemptible=True), "gpu0", "gpu1"))
    arbiter = sim.arbiter()
    arbiter.acquire("container:a", SHARED, ["gpu0", "gpu1"])
    arbiter.acquire("container:b", SHARED, ["gpu0"])
    assert not running(sim, "libvirt:vm-gpu1")
    assert running(sim, "systemd:display-manager.service")  # on the home driver: it stays
    sim.stopped("container:a")
    arbiter.release_claimant("container:a")
    # gpu1 is free now: its VM is back; gpu0's waits for container:b.
    assert running(sim, "libvirt:vm-gpu1")
    assert not running(sim, "libvirt:vm-gpu0")
    (lease,) = arbiter.ledger.read().leases
    assert {r.holder for r in lease.stopped} == {"libvirt:vm-gpu0"}
    sim.stopped("container:b")
    arbiter.release_claimant("container:b")
    assert_converged(sim)
    assert running(sim, "libvirt:vm-gpu0")


def test_status_fields(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("container:llm", SHARED, ["gpu0"], transient=True)
    status = sim.status()
    assert set(status) >= {"leases", "tokens", "stranded"}
    (lease,) = status["leases"]
    assert {
        k: lease[k] for k in ("claimant", "mode", "tokens", "state", "transient", "stopped")
    } == {
        "claimant": "container:llm",
        "mode": "shared",
        "tokens": ["gpu0"],
        "state": "active",
        "transient": True,
        "stopped": [],  # ollama, on the home driver, stays beside a shared use
    }
    assert status["tokens"]["gpu0"]["mode"] == "shared"
    assert status["tokens"]["gpu0"]["driver"] == "nvidia"
    assert status["tokens"]["gpu0"]["poisoned"] is False
    assert status["tokens"]["gpu0"]["reason"] == ""
    # Not idle: the display manager runs on it, and no claim may stop it.
    assert status["tokens"]["gpu1"]["mode"] == "in-use"
    assert status["tokens"]["gpu1"]["users"] == [
        {"holder": "systemd:display-manager.service", "preemptible": False, "passthrough": False}
    ]
    assert status["stranded"] == []


def test_stranded_by_dead_claimant(sim):
    sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])
    assert sim.status()["stranded"] == []
    assert sim.cli("sim", "stop", "libvirt:win11").returncode == 0
    assert sim.status()["stranded"] == ["libvirt:win11"]
    result = sim.cli("restore", "--stranded")
    assert result.returncode == 0 and result.stdout == "restored libvirt:win11\n"
    assert_converged(sim)


def test_claim_grace_counts_from_activation(make_sim):
    """On the logical clock (tests/core/interleave.py): the grace passes when the test
    moves the clock past it, not after seconds spent waiting."""
    sim = make_sim(host_toml())
    config = sim.config_path.read_text()
    sim.config_path.write_text(config.replace("claim_grace = 0.001", "claim_grace = 2"))
    sim.host().set_running("libvirt:win11", False)  # a VM between prepare and start
    with LogicalClock().installed() as clock:
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])
        assert sim.arbiter().status().stranded == ()
        clock.sleep(1)  # within the grace (a lease's time is to the second)
        assert sim.arbiter().status().stranded == ()
        clock.sleep(2.2)
        assert sim.arbiter().status().stranded == ("libvirt:win11",)
        # The VM starts again without having released: the same claim is already
        # held, and its grace starts over.
        assert sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"]).already_held
        assert sim.arbiter().status().stranded == ()


def test_stranded_by_reboot_and_transient(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("container:check", SHARED, ["gpu1"], transient=True)
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    assert sim.cli("sim", "reboot").returncode == 0
    status = sim.status()
    assert status["stranded"] == ["container:check", "libvirt:win11"]
    # The reboot undid the claim on the host: claiming again is refused until restore.
    with pytest.raises(ClaimRefused, match="earlier boot"):
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])
    assert sim.cli("restore", "--stranded").returncode == 0
    assert_converged(sim)
    # A claimant that claims after the reboot is alive, not stranded.
    sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])
    assert sim.status()["stranded"] == []


def test_restore_is_idempotent(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("container:llm", SHARED, ["gpu0"])
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    sim.host().set_running("libvirt:win11", False)
    assert sim.cli("restore", "--stranded").returncode == 0
    ledger, host = ledger_bytes(sim.state_dir), host_state(sim)
    generation = arbiter.ledger.read().generation
    result = sim.cli("restore", "--stranded")
    assert result.returncode == 0 and result.stdout == "nothing to restore\n"
    assert ledger_bytes(sim.state_dir) == ledger and host_state(sim) == host
    assert arbiter.ledger.read().generation == generation
    # container:llm was a shared claimant: it is running again with its lease.
    assert [lease.claimant for lease in arbiter.ledger.read().leases] == ["container:llm"]


def test_restore_named_and_dry_run(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    sim.stopped("libvirt:win11")
    before = ledger_bytes(sim.state_dir)
    result = sim.cli("restore", "--dry-run", "libvirt:win11")
    assert result.stdout == "would restore libvirt:win11\n"
    assert ledger_bytes(sim.state_dir) == before
    assert sim.cli("restore", "libvirt:win11").returncode == 0
    assert_converged(sim)


def test_fail_switch_poisons_and_only_poison_clear_clears(make_sim):
    sim = make_sim(host_toml(gpu0="fail_switch = true"))
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 1
    assert "0000:0a:00.0" in result.stderr and "simulated failure" in result.stderr
    status = sim.status()
    assert status["tokens"]["gpu0"]["poisoned"] is True
    assert "simulated failure" in status["tokens"]["gpu0"]["reason"]
    assert status["leases"] == []
    # Holders stopped for the claim are back.
    assert running(sim, "container:llm") and running(sim, "systemd:ollama.service")
    sim.set_host(host_toml())  # the fault is gone, but the poison stays
    for args in (("--exclusive", "libvirt:win11"), ("--shared", "container:x")):
        refused = sim.cli("acquire", *args, "gpu0")
        assert refused.returncode == 3
        assert "poisoned" in refused.stderr
        assert "charly-arbiter poison clear gpu0" in refused.stderr
    assert sim.cli("restore", "--stranded").returncode == 0
    assert sim.cli("sim", "reboot").returncode == 0
    assert sim.status()["tokens"]["gpu0"]["poisoned"] is True
    listed = sim.cli("poison", "list")
    assert listed.returncode == 0 and listed.stdout.startswith("gpu0: since ")
    cleared = sim.cli("poison", "clear", "gpu0")
    assert cleared.returncode == 0 and cleared.stdout == "cleared the poison of gpu0\n"
    assert sim.cli("poison", "clear", "gpu0").stdout == "gpu0 is not poisoned\n"
    assert sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0").returncode == 0


def test_hang_switch_poisons_within_the_watchdog_timeout(make_sim):
    sim = make_sim(host_toml(gpu0="hang_switch = true"))
    started = time.monotonic()
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", timeout=30)
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert "did not return within 2 s" in result.stderr
    assert elapsed < 10, elapsed  # driver_switch = 2 in the test config
    assert sim.status()["tokens"]["gpu0"]["poisoned"] is True
    with pytest.raises(TokenPoisoned):
        sim.arbiter().acquire("container:x", SHARED, ["gpu0"])


def test_failed_holder_stop_rolls_the_claim_back(make_sim):
    sim = make_sim(host_toml(ollama="fail_stop = true"))
    with pytest.raises(HolderError, match=r"systemd:ollama\.service"):
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])
    assert_converged(sim)


def cdi_generations(sim):
    return sim.host().snapshot()["cdi_generations"]


def test_the_cdi_spec_follows_every_switch_either_way(sim):
    """After the switch to vfio-pci too (a container must not be handed a GPU that has
    left), and again when it is back home (issue 11)."""
    arbiter = sim.arbiter()
    before = cdi_generations(sim)
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    assert cdi_generations(sim) == before + 1
    sim.stopped("libvirt:win11")
    arbiter.release_claimant("libvirt:win11")
    assert cdi_generations(sim) == before + 2


def test_a_rollback_that_switched_nothing_leaves_the_cdi_spec_alone(make_sim):
    sim = make_sim(host_toml(ollama="fail_stop = true"))
    before = cdi_generations(sim)
    with pytest.raises(HolderError):
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])
    assert cdi_generations(sim) == before


def test_a_token_without_cdi_never_regenerates_it(make_sim):
    config = """
host = "sim:{sim}"
state_dir = "{state}"

[tokens.gpu0]
address = "0000:0a:00.0"
cdi = false
"""
    sim = make_sim(config=config)
    before = cdi_generations(sim)
    sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])
    assert cdi_generations(sim) == before


def test_a_gpu_dead_at_home_is_poisoned_and_restore_still_converges(make_sim):
    sim = make_sim(host_toml(gpu0="dead_at_home = true"))
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    sim.stopped("libvirt:win11")
    arbiter.release_claimant("libvirt:win11")
    state = arbiter.ledger.read()
    poison = state.poison_of("gpu0")
    assert poison is not None and "health check" in poison.reason
    assert drivers(sim, "0000:0a:00.0") == ["nvidia"]  # bound, but it does not answer
    assert running(sim, "container:llm") and running(sim, "systemd:ollama.service")
    arbiter.restore(None)
    assert arbiter.ledger.read().leases == ()


def test_failed_stop_after_preempting_a_shared_claimant_gives_its_lease_back(make_sim):
    sim = make_sim(host_toml(ollama="fail_stop = true"))
    arbiter = sim.arbiter()
    sim.host().set_running("systemd:ollama.service", False)
    arbiter.acquire("container:llm", SHARED, ["gpu0"])
    sim.host().set_running("systemd:ollama.service", True)  # started by hand meanwhile
    before = host_state(sim)
    with pytest.raises(HolderError, match=r"systemd:ollama\.service"):
        arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    assert host_state(sim) == before
    (lease,) = arbiter.ledger.read().leases
    assert (lease.claimant, lease.mode, lease.state) == ("container:llm", SHARED, LeaseState.ACTIVE)


def test_failed_holder_start_keeps_the_lease_for_restore(make_sim):
    sim = make_sim(host_toml(llm="fail_start = true"))
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    sim.stopped("libvirt:win11")
    assert arbiter.release_claimant("libvirt:win11")
    (lease,) = arbiter.ledger.read().leases
    assert lease.state is LeaseState.RELEASING
    assert lease.switch_state("gpu0") is StepState.DONE
    assert drivers(sim, "0000:0a:00.0") == ["nvidia"]
    sim.set_host(host_toml())
    assert sim.cli("restore", "libvirt:win11").returncode == 0
    assert_converged(sim)


def test_acquire_is_idempotent_for_the_same_claimant(sim):
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0"])
    before = ledger_bytes(sim.state_dir)
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 0 and "already holds gpu0" in result.stdout
    assert ledger_bytes(sim.state_dir) == before
    refused = sim.cli("acquire", "--shared", "libvirt:win11", "gpu0")
    assert refused.returncode == 3 and "already holds" in refused.stderr


def test_every_token_of_the_group_moves_together(make_sim):
    sim = make_sim(ALL_PREEMPTIBLE)
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", EXCL, ["gpu0", "gpu1"])
    assert set(sim.host().snapshot()["drivers"].values()) == {VFIO}
    sim.stopped("libvirt:win11")
    arbiter.release_claimant("libvirt:win11")
    assert sim.host().snapshot()["drivers"] == HOME


def test_release_of_a_claim_another_live_process_is_carrying_out_is_refused(make_sim):
    """A real acquire hangs in its driver switch while a second real process
    tries to release the same claimant."""
    sim = make_sim(host_toml(gpu0="hang_switch = true"))
    claim = subprocess.Popen(
        [sys.executable, "-m", "charly_arbiter", "acquire", "--exclusive", "libvirt:win11", "gpu0"],
        env=sim.env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            leases = sim.status()["leases"]
            if leases and leases[0]["state"] == "acquiring":
                break
            time.sleep(0.05)
        else:
            pytest.fail("the claim never showed up as acquiring")
        before = ledger_bytes(sim.state_dir)
        sim.stopped("libvirt:win11")
        result = sim.cli("release", "libvirt:win11")
        assert result.returncode == 3  # refused: another live process carries it out
        assert f"is acquiring by process {claim.pid}, which is still running" in result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
        assert ledger_bytes(sim.state_dir) == before
        assert sim.status()["stranded"] == []  # its owner is alive
    finally:
        _, stderr = claim.communicate(timeout=30)
    assert claim.returncode == 1 and "did not return within" in stderr
    sim.set_host(host_toml())
    assert sim.status()["leases"] == []
    assert running(sim, "container:llm") and running(sim, "systemd:ollama.service")


def test_restore_of_an_acquiring_lease_with_a_poisoned_token(make_sim):
    """kill -9 right after the poison was written: the lease is still acquiring."""
    sim = make_sim(host_toml(gpu0="fail_switch = true"))
    # Transactions: the intent, two stop records, then the poison.
    result = sim.cli(
        "acquire",
        "--exclusive",
        "libvirt:win11",
        "gpu0",
        env=sim.env(CHARLY_ARBITER_CRASH_AT="ledger.fsync_dir#4"),
    )
    assert result.returncode == -9
    state = sim.arbiter().ledger.read()
    assert state.poison_of("gpu0") is not None
    (lease,) = state.leases
    assert lease.state is LeaseState.ACQUIRING
    assert sim.status()["stranded"] == ["libvirt:win11"]
    restored = sim.cli("restore", "--stranded")
    assert restored.returncode == 0, restored.stderr
    state = sim.arbiter().ledger.read()
    assert state.leases == () and state.poison_of("gpu0") is not None  # the poison stays
    assert drivers(sim, "0000:0a:00.0", "0000:0a:00.1") == ["nvidia", "snd_hda_intel"]
    assert running(sim, "container:llm") and running(sim, "systemd:ollama.service")
    before = (ledger_bytes(sim.state_dir), host_state(sim))
    assert sim.cli("restore", "--stranded").stdout == "nothing to restore\n"
    assert (ledger_bytes(sim.state_dir), host_state(sim)) == before
    refused = sim.cli("acquire", "--shared", "container:x", "gpu0")
    assert refused.returncode == 3 and "poison clear gpu0" in refused.stderr
