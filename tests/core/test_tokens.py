"""Tokens never overlap (issue 17, item 1): one function, one IOMMU group, one owner.

The configurations attacked: the same address under two names, a GPU and its
own audio function as two tokens, two GPUs that share an IOMMU group (configured,
and with no configuration at all).  The catalogue refuses the first three with
exit 2 naming both tokens and what they share; doctor says so; and the planner
refuses by address on its own, which is checked here with the catalogue's check
planted away (and shown to matter: with the planner's planted away too, I1 breaks).
"""

from __future__ import annotations

import json

import pytest
from coretools import host_state, ledger_bytes
from invariants import sim_facts, violations
from simhosts import audio, default_host, gpu, holder, host

from charly_arbiter.core import planner, tokens
from charly_arbiter.core.model import VFIO, Mode
from charly_arbiter.errors import ClaimRefused, TokensOverlap
from tests.conftest import SIM_CONFIG, sim_config

GPU0, AUDIO0, GPU1 = "0000:0a:00.0", "0000:0a:00.1", "0000:0b:00.0"

config = sim_config


# Two GPUs behind one bridge without ACS: one IOMMU group (12) for both.
ONE_GROUP = host(
    gpu(GPU0, group=12),
    audio(AUDIO0, group=12),
    gpu(GPU1, group=12, model="2204"),
    holder("container", "llm", ["gpu0"], preemptible=True),
)

OVERLAPS = {
    "the same address under two names": (
        default_host(),
        config(gpu0=GPU0, again=GPU0),
        ("gpu0", "again", GPU0),
    ),
    "a GPU and its own audio function": (
        default_host(),
        config(gpu0=GPU0, gpu0audio=AUDIO0),
        ("gpu0", "gpu0audio", "IOMMU group 12"),
    ),
    "two GPUs in one IOMMU group": (
        ONE_GROUP,
        config(gpu0=GPU0, gpu1=GPU1),
        ("gpu0", "gpu1", "IOMMU group 12"),
    ),
}


@pytest.mark.parametrize("case", sorted(OVERLAPS))
def test_overlapping_tokens_are_a_configuration_error_that_changes_nothing(make_sim, case):
    host_text, config_text, named = OVERLAPS[case]
    sim = make_sim(host_text, config_text)
    before = host_state(sim)
    for args in (
        ("status",),
        ("acquire", "--exclusive", "libvirt:a", "gpu0"),
        ("acquire", "--shared", "container:b", named[1]),
        ("plan", "--exclusive", "libvirt:a", "gpu0"),
    ):
        result = sim.cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        message = result.stderr
        assert f"tokens {named[0]} and {named[1]} overlap: both hold" in message, message
        assert named[2] in message
        assert f"hint: keep one of tokens.{named[0]} and tokens.{named[1]}" in message
        assert "Traceback" not in message
    assert ledger_bytes(sim.state_dir) is None  # nothing written
    assert host_state(sim) == before  # nothing switched, nothing stopped
    doctor = sim.cli("doctor", "--json")
    assert doctor.returncode == 1
    checks = {check["name"]: check for check in json.loads(doctor.stdout)["checks"]}
    assert checks["tokens"]["level"] == "problem"
    assert f"tokens {named[0]} and {named[1]} overlap" in checks["tokens"]["message"]


def test_without_a_configuration_two_gpus_in_one_group_are_one_token(make_sim):
    """They can only leave the host together, so they are not two tokens: one, named
    after the first GPU, with every function of the group; doctor says so, and an
    exclusive claim is refused (the group has another card's functions)."""
    sim = make_sim(ONE_GROUP, SIM_CONFIG)
    document = sim.status()
    assert list(document["tokens"]) == [GPU0]
    assert set(document["tokens"][GPU0]["drivers"]) == {GPU0, AUDIO0, GPU1}
    doctor = json.loads(sim.cli("doctor", "--json").stdout)
    warning = next(c for c in doctor["checks"] if c["name"] == f"token {GPU0}")
    assert warning["level"] == "warning"
    assert f"{GPU1} shares IOMMU group with {GPU0}: they are one token" in warning["message"]
    refused = sim.cli("acquire", "--exclusive", "libvirt:a", GPU1)
    assert refused.returncode != 0 and f"no token named '{GPU1}'" in refused.stderr
    refused = sim.cli("acquire", "--exclusive", "libvirt:a", GPU0)
    assert refused.returncode == 3 and f"also holds {GPU1}" in refused.stderr
    # One GPU per group stays one token per GPU, as before.
    plain = make_sim(default_host(), SIM_CONFIG, name="plain")
    assert list(plain.status()["tokens"]) == [GPU0, GPU1]


def aliased(make_sim, monkeypatch):
    """gpu0 and gpu0audio (its own audio function) with the catalogue's check planted
    away; container:s shares gpu0 (on its home drivers)."""
    monkeypatch.setattr(tokens, "check_overlap", lambda specs, path: None)
    sim = make_sim(default_host(), config(gpu0=GPU0, gpu0audio=AUDIO0, gpu1=GPU1))
    arbiter = sim.arbiter()
    arbiter.acquire("container:s", Mode.SHARED, ["gpu0"])
    return sim, arbiter


def function_facts(sim):
    return sim_facts(
        sim.host().snapshot(),
        {"gpu0": (GPU0, AUDIO0), "gpu0audio": (GPU0, AUDIO0), "gpu1": (GPU1,)},
        (),
    )


def test_the_catalogue_check_raises_for_the_arbiter_too(make_sim):
    sim = make_sim(default_host(), config(gpu0=GPU0, gpu0audio=AUDIO0))
    with pytest.raises(TokensOverlap) as refused:
        sim.arbiter().acquire("libvirt:a", Mode.EXCLUSIVE, ["gpu0"])
    assert refused.value.exit_code == 2


def test_the_planner_refuses_a_function_another_name_holds_without_the_catalogue(
    make_sim, monkeypatch
):
    sim, arbiter = aliased(make_sim, monkeypatch)
    before = host_state(sim)
    for mode in Mode:
        with pytest.raises(ClaimRefused) as refused:
            arbiter.acquire("libvirt:b", mode, ["gpu0audio"])
        assert "also part of token gpu0, which is held by container:s" in str(refused.value)
        assert refused.value.exit_code == 3
    assert host_state(sim) == before
    # The same with gpu0 held exclusively, and the group on vfio-pci under it.
    sim.stopped("container:s")
    arbiter.release_claimant("container:s")
    arbiter.acquire("libvirt:a", Mode.EXCLUSIVE, ["gpu0"])
    for mode in Mode:
        with pytest.raises(
            ClaimRefused, match="also part of token gpu0, which is held by libvirt:a"
        ):
            arbiter.acquire("libvirt:b", mode, ["gpu0audio"])
    assert sim.host().snapshot()["drivers"][AUDIO0] == VFIO
    assert violations(arbiter.ledger.read(), function_facts(sim)) == []
    # A token that shares nothing is claimed as usual.
    arbiter.acquire("container:c", Mode.SHARED, ["gpu1"])


def test_without_either_check_one_function_gets_two_owners(make_sim, monkeypatch):
    """What the two checks stand against (the code before issue 17): an exclusive claim
    on the audio token switches the whole group to vfio-pci under container:s's shared
    lease on gpu0."""
    sim, arbiter = aliased(make_sim, monkeypatch)
    monkeypatch.setattr(planner, "overlapping", lambda *args: None)
    arbiter.acquire("libvirt:b", Mode.EXCLUSIVE, ["gpu0audio"])
    found = violations(arbiter.ledger.read(), function_facts(sim))
    assert any(problem.startswith(f"I1: {GPU0} is held exclusively") for problem in found), found


def test_a_token_named_after_its_address_is_no_mig_sub_token(make_sim):
    """Without a configuration tokens are named after their addresses, colons and all:
    `0000:0a:00.0` is that token, never instance 0 of a token `0000:0a:00` (found by the
    chain's zero-config VM on the real kernel); `0000:0a:00.0:1` is its MIG instance 1."""
    from charly_arbiter.core.model import Mode
    from charly_arbiter.errors import MigInvalid

    sim = make_sim(config='host = "sim:{sim}"\nstate_dir = "{state}"\n')
    arbiter = sim.arbiter()
    catalogue, mig = arbiter.tokens, arbiter.host.mig
    names = ["0000:0a:00.0", "0000:0b:00.0"]
    assert catalogue.parent_names(names, Mode.EXCLUSIVE, mig) == names
    with pytest.raises(MigInvalid, match=r"0000:0a:00\.0 has no MIG instance 1"):
        catalogue.parent_names(["0000:0a:00.0:1"], Mode.SHARED, mig)
