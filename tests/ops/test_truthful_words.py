"""What status, explain, history, doctor and the refusals say is true, and said alike
(issue 17, item 7): one time format for a person everywhere, counts and articles
that agree, a switch named by the driver it goes to."""

from __future__ import annotations

import re

from simhosts import default_host

from charly_arbiter.core.events import a_or_an, count_of, describe
from charly_arbiter.core.model import VFIO, human_time

# A time as a person reads it, and ISO 8601 (which only --json and the ledger keep).
SHOWN = re.compile(r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\b")
ISO = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d")


def test_every_output_for_a_person_shows_times_one_way(make_sim):
    """A lease, a refusal that quotes it, a poison: every time is YYYY-MM-DD HH:MM:SS,
    local, in status, explain, history, doctor, poison list and the refusals."""
    sim = make_sim(default_host(dm_preemptible=True))
    healthy = (sim.sim_dir / "host.toml").read_text()
    marker = 'driver = "snd_hda_intel"\n'
    sim.set_host(healthy.replace(marker, marker + "fail_switch = true\n"))
    assert sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0").returncode == 1
    sim.set_host(healthy)  # gpu0 is poisoned now
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu1", check=True)
    held = sim.cli("acquire", "--exclusive", "libvirt:other", "gpu1")
    poisoned = sim.cli("acquire", "--shared", "container:x", "gpu0")
    assert held.returncode == poisoned.returncode == 3
    outputs = {
        "held": held.stderr,
        "poisoned": poisoned.stderr,
        "status": sim.cli("status").stdout,
        "explain gpu0": sim.cli("explain", "gpu0").stdout,
        "explain gpu1": sim.cli("explain", "gpu1").stdout,
        "history": sim.cli("history").stdout,
        "doctor": sim.cli("doctor").stdout,
        "poison list": sim.cli("poison", "list").stdout,
    }
    for name, text in outputs.items():
        assert not ISO.search(text), (name, text)
        assert SHOWN.search(text), (name, text)
    document = sim.status()
    created = document["leases"][0]["created"]
    assert ISO.match(created)  # --json keeps ISO 8601 with its offset
    assert f"held exclusively by libvirt:win11 since {human_time(created)}" in outputs["held"]
    since = document["tokens"]["gpu0"]["since"]
    assert ISO.match(since)
    for name in ("poisoned", "status", "explain gpu0", "doctor", "poison list"):
        assert human_time(since) in outputs[name], (name, outputs[name])


def test_counts_articles_and_switch_targets_read_as_sentences():
    assert count_of(1, "lease") == "1 lease" and count_of(0, "lease") == "0 leases"
    assert count_of(2, "lease") == "2 leases"
    assert a_or_an("exclusive") == "an exclusive" and a_or_an("shared") == "a shared"
    fields = {"claimant": "libvirt:win11", "token": "gpu1"}
    assert (
        describe("switching", {**fields, "driver": "nvidia"})
        == "libvirt:win11: switching gpu1 to nvidia"
    )
    assert (
        describe("switching", {**fields, "driver": "nvidia,snd_hda_intel"})
        == "libvirt:win11: switching gpu1 to nvidia and snd_hda_intel"
    )
    # The kernel's choice, unknown before the switch: "home", never "to home".
    assert (
        describe("switching", {**fields, "driver": "home"}) == "libvirt:win11: switching gpu1 home"
    )
    assert "to home" not in describe("switching", {**fields, "driver": "home,nvidia"})
    assert describe("switched", {**fields, "driver": "nvidia", "seconds": 0.5}) == (
        "gpu1 is now on nvidia for libvirt:win11 (took 0.5 s)"
    )


def test_a_switch_home_names_the_driver_the_kernel_chose(make_sim):
    """A GPU whose home is recorded nowhere goes to the kernel's choice; the history
    says which driver that was, not "home"."""
    from simhosts import gpu, host

    sim = make_sim(host(gpu("0000:0a:00.0", group=12), gpu("0000:0b:00.0", group=13)))
    # Found on vfio-pci with no lease (as after a lost ledger); host.toml says nvidia,
    # which the simulated host binds as the kernel's choice.
    sim.host().switch(sim.arbiter().tokens.all()["gpu1"], {"0000:0b:00.0": VFIO})
    assert sim.cli("send-home", "gpu1").returncode == 0
    said = sim.cli("history", "--token", "gpu1", check=True).stdout
    assert "switching gpu1 home" in said
    assert "gpu1 is now on nvidia for process:" in said
    assert "to home" not in said and "on home" not in said
