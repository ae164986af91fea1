"""The ledger matches the host even when the ledger is gone (issue 17, item 2).

A VM holds gpu0 (its claim stopped container:llm and ollama), then the ledger is
lost: deleted with its backup, replaced by a fresh empty one, or by an older
generation.  None of these may read as healthy: status and doctor say what was
found and what to do, every command that would act on it is refused (exit 3)
while the hook's stop goes through, the history records it, and `recover`,
`adopt` and `send-home` settle it, bringing back what the lost lease had stopped.
Every step through the real CLI and the real hook, on the simulated host.
"""

from __future__ import annotations

import json
import shutil

import pytest
from coretools import assert_converged, check_invariants, host_state, ledger_bytes
from handoffs import wait_for_handoffs
from simhosts import audio, gpu, holder, host
from test_safety import domain_xml, hook

from charly_arbiter.compose import build_arbiter
from charly_arbiter.core.config import load_config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import LeaseState, Mode
from charly_arbiter.ops.history import HistoryLog
from tests.conftest import SIM_CONFIG

GPU0, AUDIO0 = "0000:0a:00.0", "0000:0a:00.1"


def held_by_a_vm(sim) -> bytes:
    """win11 holds gpu0; returns the ledger as it was before (no lease on gpu0)."""
    sim.cli("acquire", "--shared", "container:batch", "gpu1", check=True)
    older = (sim.state_dir / "ledger.toml").read_bytes()
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    return older


def lose(sim, how: str, older: bytes) -> None:
    ledger, backup = sim.state_dir / "ledger.toml", sim.state_dir / "ledger.toml.bak"
    if how == "deleted with its backup":
        ledger.unlink()
        backup.unlink()
        return
    if how == "replaced by a fresh one":
        scratch = sim.root / "scratch"
        with Ledger(scratch).transaction() as txn:  # a valid ledger: generation 1, no lease
            txn.state = txn.state.with_home("gpu9", {"0000:0c:00.0": "nvidia"})
        shutil.copyfile(scratch / "ledger.toml", ledger)
        backup.unlink()
    else:  # an older generation put back (a restored file-system snapshot, say)
        ledger.write_bytes(older)
    ledger.chmod(0o600)


LOSSES = ("deleted with its backup", "replaced by a fresh one", "put back at an older generation")


def refused(sim, *args: str) -> str:
    before = (ledger_bytes(sim.state_dir), host_state(sim))
    result = sim.cli(*args)
    assert result.returncode == 3, (args, result.returncode, result.stderr)
    assert (ledger_bytes(sim.state_dir), host_state(sim)) == before, args  # nothing changed
    assert "Traceback" not in result.stderr
    return result.stderr


@pytest.mark.parametrize("how", LOSSES)
def test_a_lost_ledger_never_reads_as_healthy_and_nothing_acts_on_it(sim, how):
    older = held_by_a_vm(sim)
    lose(sim, how, older)

    document = sim.status()
    assert document["tokens"]["gpu0"]["mode"] == "unaccounted"  # (it read "idle" before)
    assert document["tokens"]["gpu0"]["unaccounted"] == [GPU0, AUDIO0]
    recorded = document["history_generation"]
    assert recorded is not None and recorded > document["generation"]
    human = sim.cli("status").stdout
    assert "LEDGER WENT BACK: the ledger is at generation" in human
    assert "hint: run `charly-arbiter recover`" in human
    assert "ON VFIO-PCI WITH NO LEASE: 0000:0a:00.0, 0000:0a:00.1" in human
    assert "\nno leases\n" not in human + "\n"

    doctor = sim.cli("doctor", "--json")
    assert doctor.returncode == 1
    checks = {check["name"]: check for check in json.loads(doctor.stdout)["checks"]}
    assert checks["ledger"]["level"] == "problem"
    assert "history recorded generation" in checks["ledger"]["message"]
    assert checks["token gpu0"]["level"] == "problem"
    assert "`charly-arbiter adopt gpu0 libvirt:win11`" in checks["token gpu0"]["fix"]

    for args in (
        ("acquire", "--shared", "container:x", "gpu1"),
        ("acquire", "--exclusive", "libvirt:other", "gpu0"),
        ("release", "container:batch"),
        ("restore", "--stranded"),
        ("restore", "libvirt:win11"),
        ("poison", "clear", "gpu0"),
        ("adopt", "gpu0", "libvirt:win11"),
        ("send-home", "gpu0"),
    ):
        message = refused(sim, *args)
        assert "the history recorded generation" in message, (args, message)
        assert "hint: run `charly-arbiter recover`" in message
    # A VM's start through the hook fails closed; its stop is never kept waiting.
    started = hook(sim, "other", "prepare", "begin", "-", domain_xml("other", GPU0))
    assert started.returncode == 3 and b"history recorded generation" in started.stderr
    assert started.stdout == b""
    sim.stopped("libvirt:win11")
    stopped = hook(sim, "win11", "release", "end", "-", domain_xml("win11", GPU0))
    assert stopped.returncode == 0
    kinds = [record.kind for record in HistoryLog(sim.state_dir).read().records]
    assert "mismatch" in kinds
    if how == "put back at an older generation":
        # A claimant's own stop releases the lease this ledger gives it (the hooks'
        # path), where an operator's `release` was refused above.
        sim.stopped("container:batch")
        arbiter = build_arbiter(load_config(sim.config_path))
        assert arbiter.release_claimant("container:batch", force=True, stopped=True)
        assert Ledger(sim.state_dir).read().lease_of("container:batch") is None


@pytest.mark.parametrize("how", LOSSES)
def test_recover_then_adopt_gives_the_vm_its_lease_and_its_holders_a_way_back(sim, how):
    older = held_by_a_vm(sim)
    lose(sim, how, older)
    look = sim.cli("recover", check=True).stdout
    assert "gpu0: held by libvirt:win11 (exclusive) since" in look
    assert "it had stopped container:llm, which is stopped now" in look
    assert "host: gpu0 is on vfio-pci, and the ledger as it is has no lease on it" in look
    assert "nothing was written" in look
    done = sim.cli("recover", "--yes", check=True).stdout
    assert "then settle gpu0 with" in done
    assert sim.status()["history_generation"] is None
    # The ledger-wide refusal is gone; gpu0 itself is still refused until settled.
    message = refused(sim, "acquire", "--exclusive", "libvirt:other", "gpu0")
    assert "0000:0a:00.0, 0000:0a:00.1 on vfio-pci" in message
    assert "`charly-arbiter adopt gpu0 KIND:NAME`" in message
    if how != "put back at an older generation":  # (that one still has batch's lease)
        sim.cli("acquire", "--shared", "container:batch", "gpu1", check=True)

    adopted = sim.cli("adopt", "gpu0", "libvirt:win11", check=True).stdout
    assert "libvirt:win11 now holds gpu0 (exclusive)" in adopted
    assert "container:llm" in adopted and "systemd:ollama.service" in adopted
    lease = Ledger(sim.state_dir).read().lease_of("libvirt:win11")
    assert lease is not None and lease.mode is Mode.EXCLUSIVE
    assert lease.state is LeaseState.ACTIVE
    assert {r.holder for r in lease.unrestored()} == {"container:llm", "systemd:ollama.service"}
    check_invariants(sim, "after adopt")
    assert sim.status()["tokens"]["gpu0"]["mode"] == "exclusive"
    # The VM stops: its hook releases the adopted lease, and everything comes back.
    sim.stopped("libvirt:win11", "container:batch")
    assert hook(sim, "win11", "release", "end", "-", domain_xml("win11", GPU0)).returncode == 0
    wait_for_handoffs(sim.state_dir)  # the hook's detached finish
    sim.cli("restore", "--stranded", check=True)
    assert_converged(sim)
    assert Ledger(sim.state_dir).read().leases == ()


def test_send_home_waits_for_the_vm_then_brings_back_what_it_had_stopped(sim):
    held_by_a_vm(sim)
    lose(sim, "deleted with its backup", b"")
    sim.cli("recover", "--yes", check=True)
    message = refused(sim, "send-home", "gpu0")
    assert "the history says libvirt:win11 holds it" in message
    assert "`charly-arbiter adopt gpu0 libvirt:win11`" in message
    sim.stopped("libvirt:win11", "container:batch")
    sent = sim.cli("send-home", "gpu0", check=True).stdout
    assert sent.startswith("sent gpu0 home; started ")
    assert_converged(sim)
    said = sim.cli("history", "--token", "gpu0", check=True).stdout
    assert "sending gpu0 home, as an operator decided" in said
    assert "gpu0 is now on nvidia and snd_hda_intel" in said


def test_an_emptied_ledger_is_corrupt_and_explain_does_not_call_the_gpu_idle(sim):
    held_by_a_vm(sim)
    (sim.state_dir / "ledger.toml").write_bytes(b"")
    assert sim.status()["tokens"]["gpu0"]["mode"] == "unknown"
    said = sim.cli("explain", "gpu0").stdout
    assert "idle" not in said
    assert "Who holds gpu0 (0000:0a:00.0) is unknown: the ledger is corrupt" in said
    assert "0000:0a:00.0 on vfio-pci" in said
    # With its backup gone too: recovered empty, past the history's generation, the
    # GPU on vfio-pci poisoned (nothing is handed out before a person has looked).
    (sim.state_dir / "ledger.toml.bak").unlink()
    sim.cli("recover", "--empty", "--yes", check=True)
    document = sim.status()
    assert document["history_generation"] is None
    assert document["tokens"]["gpu0"]["poisoned"] is True


def test_a_gpu_bound_to_vfio_at_boot_that_no_token_claims_is_left_alone(make_sim):
    sim = make_sim(
        host(
            gpu(GPU0, group=12),
            audio(AUDIO0, group=12),
            gpu("0000:0b:00.0", group=13, model="2204"),
            gpu("0000:0c:00.0", group=14, driver="vfio-pci"),  # the administrator's
            holder("container", "llm", ["gpu0"], preemptible=True),
        )
    )
    document = sim.status()
    assert sorted(document["tokens"]) == ["gpu0", "gpu1"]
    assert all(token["unaccounted"] == [] for token in document["tokens"].values())
    checks = json.loads(sim.cli("doctor", "--json").stdout)["checks"]
    alone = next(c for c in checks if c["name"] == "gpu 0000:0c:00.0")
    assert alone["level"] == "ok"
    assert "no token claims it: the arbiter leaves it alone" in alone["message"]
    assert not [c for c in checks if c["level"] == "problem"], checks
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)


def test_without_a_configuration_a_gpu_bound_at_boot_is_adopted_as_the_administrators(
    make_sim,
):
    """Every GPU is a token then: one on vfio-pci with no lease is refused until the
    operator says it is there on purpose; then it is passed through as it is, stays on
    vfio-pci after a release, and is never shared."""
    sim = make_sim(
        host(gpu(GPU0, group=12), gpu("0000:0c:00.0", group=14, driver="vfio-pci")), SIM_CONFIG
    )
    token = "0000:0c:00.0"
    assert sim.status()["tokens"][token]["mode"] == "unaccounted"
    refused(sim, "acquire", "--exclusive", "libvirt:vm", token)
    sim.cli("adopt", "--admin", token, check=True)
    document = sim.status()
    assert document["tokens"][token]["mode"] == "idle"
    assert document["tokens"][token]["bound_by_admin"] is True
    assert "its home is vfio-pci" in sim.cli("status").stdout
    log = len(sim.host().snapshot()["log"])
    sim.cli("acquire", "--exclusive", "libvirt:vm", token, check=True)
    sim.stopped("libvirt:vm")
    sim.cli("release", "libvirt:vm", check=True)
    assert sim.host().snapshot()["drivers"][token] == "vfio-pci"
    assert not [line for line in sim.host().snapshot()["log"][log:] if "switch" in line]
    message = refused(sim, "acquire", "--shared", "container:x", token)
    assert "its home is vfio-pci" in message
    # The administrator changes their mind: it goes to the driver the host would bind.
    sim.cli("send-home", token, check=True)
    assert sim.status()["tokens"][token]["mode"] == "idle"
    assert sim.status()["tokens"][token]["bound_by_admin"] is False
