"""`plan libvirt:NAME`: what starting a domain would do, its claim read from its real
definition on a real libvirtd (the same reading as the hook's `prepare`), before
anything starts.  The PCI side is the simulated host of tests/libvirt."""

from __future__ import annotations

import json

import pytest

from tests.libvirt.libvirtd import Libvirt, claim

pytestmark = [pytest.mark.slow, pytest.mark.libvirt]

SHARED_HOLDER = claim("shared", ("gpu0",), preemptible="yes", stop="destroy")
EXCLUSIVE = claim("exclusive", ("gpu0",))


def test_plan_of_a_domain_reads_its_claim_and_matches_its_start(lv: Libvirt) -> None:
    holder = lv.define("holder", SHARED_HOLDER)
    vm = lv.define("vm", EXCLUSIVE)
    lv.virsh("start", holder)
    before = lv.ledger_text()
    result = lv.cli("plan", "--json", f"libvirt:{vm}")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["from_definition"] is True
    assert (plan["mode"], plan["tokens"]) == ("exclusive", ["gpu0"])
    assert [stop["holder"] for stop in plan["stops"]] == [f"libvirt:{holder}"]
    assert {switch["to"] for switch in plan["switches"]} == {"vfio-pci"}
    assert lv.ledger_text() == before, "a plan writes nothing"
    lv.virsh("start", vm)  # what the plan said is what the start does
    lv.wait_for("the holder to be stopped", lambda: lv.running() == {vm})
    assert lv.leases()[f"libvirt:{vm}"]["stopped"] == [f"libvirt:{holder}"]
    lv.virsh("destroy", vm)
    lv.wait_for("the holder back", lambda: lv.running() == {holder})


def test_plan_of_a_domain_keeps_the_hooks_policy_and_says_what_claims_nothing(
    lv: Libvirt,
) -> None:
    holder = lv.define("holder", SHARED_HOLDER)
    vm = lv.define("vm", EXCLUSIVE)
    plain = lv.define("plain")
    lv.virsh("start", holder)
    lv.set_preemption("refuse")
    refused = lv.cli("plan", "--json", f"libvirt:{vm}")
    assert refused.returncode == 3, refused.stderr
    document = json.loads(refused.stdout)
    assert f"libvirt:{holder}" in document["refused"]
    assert "virsh shutdown" in document["hint"]
    nothing = lv.cli("plan", "--json", f"libvirt:{plain}")
    assert json.loads(nothing.stdout) == {"claimant": f"libvirt:{plain}", "claims_nothing": True}
    missing = lv.cli("plan", "libvirt:ca-e2e-nowhere")
    assert missing.returncode == 2  # a name that names nothing
    assert "has no domain named ca-e2e-nowhere" in missing.stderr
    assert "virsh list --all" in missing.stderr
