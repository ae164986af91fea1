"""End to end on a real libvirtd: real QEMU/TCG domains, the real hook, the real CLI.

Each scenario asserts the ledger (through `status --json`) and which domains
run.  The PCI side is simulated (tests/libvirt/conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from tests.libvirt.conftest import PREFIX, Libvirt, claim

pytestmark = [pytest.mark.slow, pytest.mark.libvirt]

SHARED_HOLDER = claim("shared", ("gpu0",), preemptible="yes")
EXCLUSIVE = claim("exclusive", ("gpu0",))


def test_domain_without_claim_starts_and_stops_with_nothing_in_the_ledger(lv: Libvirt) -> None:
    """Scenario 7."""
    plain = lv.define("plain")
    lv.virsh("start", plain)
    assert lv.running() == {plain}
    lv.virsh("destroy", plain)
    assert lv.running() == set()
    assert lv.status()["leases"] == []
    assert lv.ledger_text() == ""


def test_exclusive_claimant_preempts_shared_holder_and_brings_it_back(lv: Libvirt) -> None:
    """Scenario 1: the holder is shut down (then destroyed after holder_stop) and restarted."""
    holder = lv.define("holder", SHARED_HOLDER)
    vm = lv.define("vm", EXCLUSIVE)
    lv.virsh("start", holder)
    assert lv.leases()[f"libvirt:{holder}"]["mode"] == "shared"

    lv.virsh("start", vm)
    assert lv.running() == {vm}
    leases = lv.leases()
    assert list(leases) == [f"libvirt:{vm}"]
    assert leases[f"libvirt:{vm}"]["stopped"] == [f"libvirt:{holder}"]
    token = lv.status()["tokens"]["gpu0"]
    assert token["mode"] == "exclusive"
    assert set(token["drivers"].values()) == {"vfio-pci"}

    lv.virsh("destroy", vm)
    lv.wait_for("the holder to run again", lambda: lv.running() == {holder})
    lv.wait_for("the holder's shared lease", lambda: list(lv.leases()) == [f"libvirt:{holder}"])
    status = lv.status()
    assert status["leases"][0]["mode"] == "shared"
    assert status["tokens"]["gpu0"]["drivers"] == {
        "0000:0a:00.0": "nvidia",
        "0000:0a:00.1": "snd_hda_intel",
    }
    assert status["stranded"] == []
