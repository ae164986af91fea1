"""The quick-start scenario through the real CLI on the simulated host."""

from __future__ import annotations


def test_exclusive_claim_preempts_shared_holder_and_release_brings_it_back(sim):
    assert sim.cli("acquire", "--shared", "container:llm", "gpu0").returncode == 0
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 0, result.stderr
    status = sim.status()
    assert status["tokens"]["gpu0"]["mode"] == "exclusive"
    assert set(status["tokens"]["gpu0"]["drivers"].values()) == {"vfio-pci"}
    assert [lease["claimant"] for lease in status["leases"]] == ["libvirt:win11"]
    assert not sim.host().is_running("container:llm")

    sim.stopped("libvirt:win11")
    assert sim.cli("release", "libvirt:win11").returncode == 0
    status = sim.status()
    assert status["tokens"]["gpu0"]["drivers"] == {
        "0000:0a:00.0": "nvidia",
        "0000:0a:00.1": "snd_hda_intel",
    }
    assert [lease["claimant"] for lease in status["leases"]] == ["container:llm"]
    assert sim.host().is_running("container:llm")
    assert sim.host().is_running("systemd:ollama.service")
