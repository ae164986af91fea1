"""MIG as the arbiter changes it (`mig TOKEN on|off|layout`, core/migop.py) on the
simulated host, whose NVML side (host.toml's `mig_profiles`, host/sim.py) refuses a
change while a client uses the GPU, as NVML does: the change is an exclusive claim of
the arbiter's own that stops and drains every holder of the GPU, preempts the shared
leases on it (containers on its MIG instances), changes nothing else, and brings them
all back; a kill -9 in the middle is `restore`'s.  MIG instances are sub-tokens,
`TOKEN:N`, claimed shared.  tests/host/test_mig_nvml.py holds the real NVML calls to
the fake pynvml.
"""

from __future__ import annotations

import json

import pytest
from simhosts import default_host, mig_host

from charly_arbiter.core.host import MigChange
from charly_arbiter.core.migop import change_mig
from charly_arbiter.core.model import Mode, operation_claimant
from charly_arbiter.errors import ClaimRefused, MigFailed, MigInvalid
from tests.conftest import SimEnv

HOLDERS = ("container:llm", "systemd:ollama.service")


@pytest.fixture
def sim(make_sim) -> SimEnv:
    return make_sim(host=mig_host())


def running(sim: SimEnv) -> dict[str, bool]:
    return {ref: sim.host().snapshot()["running"][ref] for ref in HOLDERS}


def test_a_change_stops_what_uses_the_gpu_and_brings_it_back_leases_and_all(sim):
    sim.cli("mig", "gpu0", "on", check=True)
    sim.cli("mig", "gpu0", "layout", "3g.40gb,2g.20gb,1g.10gb", check=True)
    shown = json.loads(sim.cli("mig", "--json", "gpu0", check=True).stdout)
    assert [(i["sub_token"], i["profile"], i["cdi"]) for i in shown["instances"]] == [
        ("gpu0:0", "3g.40gb", "nvidia.com/gpu=0:0"),
        ("gpu0:1", "2g.20gb", "nvidia.com/gpu=0:1"),
        ("gpu0:2", "1g.10gb", "nvidia.com/gpu=0:2"),
    ]
    # A container on instance 1: a shared lease on the GPU.
    sim.cli("acquire", "--shared", "container:ai", "gpu0:1", check=True)
    assert [x["tokens"] for x in sim.status()["leases"]] == [["gpu0"]]
    done = json.loads(sim.cli("mig", "--json", "gpu0", "layout", "7g.80gb", check=True).stdout)
    assert set(done["stopped"]) == {*HOLDERS, "container:ai"}
    assert [i["profile"] for i in done["instances"]] == ["7g.80gb"]
    # Everyone back, the container with its shared lease; no lease of the change left.
    assert running(sim) == dict.fromkeys(HOLDERS, True)
    leases = sim.status()["leases"]
    assert [(x["claimant"], x["tokens"], x["mode"]) for x in leases] == [
        ("container:ai", ["gpu0"], "shared")
    ]
    history = sim.cli("history", check=True).stdout
    assert "gpu0: changing its MIG layout 7g.80gb, its holders stopped" in history
    assert "gpu0: MIG layout 7g.80gb done, its holders back" in history
    # What NVML was asked, and while nothing ran on the GPU.
    log = sim.host().snapshot()["log"]
    change = log.index("mig 0000:0a:00.0 layout 7g.80gb")
    assert "stop container:ai" in log[:change] and "start container:ai" in log[change:]


def test_a_holder_that_may_not_be_stopped_refuses_the_change_and_nothing_moves(make_sim):
    rigid = 'name = "ollama.service"\ntokens = ["gpu0"]\npreemptible = '
    host = mig_host().replace(rigid + "true", rigid + "false")
    assert rigid + "false" in host
    sim = make_sim(host=host)
    result = sim.cli("mig", "gpu0", "on")
    assert result.returncode == 3, result.stderr
    assert "systemd:ollama.service" in result.stderr and "not preemptible" in result.stderr
    assert json.loads(sim.cli("mig", "--json", "gpu0").stdout)["enabled"] is False
    assert running(sim) == dict.fromkeys(HOLDERS, True) and sim.status()["leases"] == []


def test_nvmls_failure_brings_everyone_back_and_says_why(make_sim):
    sim = make_sim(host=mig_host(gpu0="fail_mig = true"))
    with pytest.raises(MigFailed, match="MIG on failed: simulated"):
        change_mig(sim.arbiter(), "gpu0", MigChange(enabled=True))
    assert running(sim) == dict.fromkeys(HOLDERS, True)
    assert sim.status()["leases"] == []
    result = sim.cli("mig", "gpu0", "on")
    assert result.returncode == 1 and "MIG on failed" in result.stderr


def test_a_change_killed_half_way_is_stranded_and_restore_brings_everyone_back(sim):
    """kill -9 (the arbiter's own crash point) once the holders are stopped, before
    NVML was asked: the lease of arbiter:mig/gpu0 is stranded with its dead writer,
    and `restore --stranded` starts what it stopped."""
    result = sim.cli("mig", "gpu0", "on", env=sim.env(CHARLY_ARBITER_CRASH_AT="mig.change"))
    assert result.returncode == -9, result.stderr
    status = sim.status()
    ours = str(operation_claimant("mig", "gpu0"))
    assert status["stranded"] == [ours]
    assert running(sim) == dict.fromkeys(HOLDERS, False)
    sim.cli("restore", "--stranded", check=True)
    assert running(sim) == dict.fromkeys(HOLDERS, True) and sim.status()["leases"] == []
    assert json.loads(sim.cli("mig", "--json", "gpu0").stdout)["enabled"] is False


def test_sub_tokens_are_claimed_shared_only_and_only_while_the_instance_exists(sim):
    arbiter = sim.arbiter()
    with pytest.raises(MigInvalid, match="MIG is off"):
        arbiter.acquire("container:ai", Mode.SHARED, ["gpu0:0"])
    change_mig(arbiter, "gpu0", MigChange(enabled=True))
    change_mig(arbiter, "gpu0", MigChange(layout=("3g.40gb",)))
    with pytest.raises(MigInvalid, match="claimed shared"):
        arbiter.acquire("libvirt:vm", Mode.EXCLUSIVE, ["gpu0:0"])
    with pytest.raises(MigInvalid, match=r"no MIG instance 1 \(it has gpu0:0 \(3g\.40gb\)\)"):
        arbiter.acquire("container:ai", Mode.SHARED, ["gpu0:1"])
    plan = arbiter.acquire("container:ai", Mode.SHARED, ["gpu0:0"])
    assert plan.tokens == ("gpu0",)
    # A VM's claim on the whole GPU preempts the container on the instance, as any
    # shared use of it.
    plan = arbiter.acquire("libvirt:vm", Mode.EXCLUSIVE, ["gpu0"])
    assert "container:ai" in plan.preempted_leases


def test_a_gpu_without_mig_is_a_usage_error(make_sim):
    sim = make_sim(host=default_host())
    result = sim.cli("mig", "gpu0", "on")
    assert result.returncode == 2 and "has no MIG mode" in result.stderr, result.stderr


def test_the_change_waits_for_no_vm_it_refuses_one_that_holds_the_gpu(sim):
    sim.arbiter().acquire("libvirt:vm", Mode.EXCLUSIVE, ["gpu0"])
    with pytest.raises(ClaimRefused, match="held exclusively by libvirt:vm"):
        change_mig(sim.arbiter(), "gpu0", MigChange(enabled=True))
