"""NVIDIA's vGPU on SR-IOV virtual functions (core/vgpu.py, LocalHost), on the fake
kernel of fakesys.py: NVIDIA's driver and vGPU manager cannot run here, so the VFs'
`nvidia/creatable_vgpu_types` and `nvidia/current_vgpu_type` are modelled at the
outermost seam, as NVIDIA's Virtual GPU Software User Guide documents them for
vGPU 17 and later on GPUs without mdev ("Creating an NVIDIA vGPU on a Linux with
KVM Hypervisor that Uses a Vendor-Specific VFIO Framework"): the creatable list
(`ID : name` lines under a header) narrows to the type the other VFs have, an ID
written to current_vgpu_type creates the vGPU (EINVAL for one not listed), 0
removes it, and vfio-pci does not take such a VF (kubevirt#17642).

A VM's claim on a vGPU VF switches no driver: the VF stays on nvidia and gets the
token's `vgpu_type` at prepare, 0 at release; a type it does not list is refused
before anything changes.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakesys import FakeKernel, nvidia_with_vgpu_vfs

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import TokenConfig
from charly_arbiter.core.host import Vgpu, parse_vgpu_types
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Mode
from charly_arbiter.core.tokens import TokenCatalogue
from charly_arbiter.errors import ClaimRefused, TokenUnaccounted

PF = "0000:41:00.0"
VF0, VF1 = "0000:41:00.4", "0000:41:00.5"  # offset 4, stride 1


@pytest.fixture
def vms() -> Iterator[tuple[str, str]]:
    """Two claimants that run (real processes standing for the VMs: this host has no
    libvirt to ask)."""
    processes = [subprocess.Popen(["/bin/sleep", "600"]) for _ in range(2)]
    yield tuple(f"process:{p.pid}" for p in processes)  # type: ignore[misc]
    for process in processes:
        process.kill()
        process.wait()


@pytest.fixture
def kernel(tmp_path: Path) -> FakeKernel:
    kernel = nvidia_with_vgpu_vfs(tmp_path)
    kernel.write(kernel.device_dir(PF) / "sriov_numvfs", "2")
    return kernel


def arbiter_on(make_host, **types: str) -> Arbiter:
    tokens = [TokenConfig("pf", PF)] + [
        TokenConfig(name, address, vgpu_type=types.get(name))
        for name, address in (("vf0", VF0), ("vf1", VF1))
    ]
    host = make_host(tokens=tuple(tokens))
    return Arbiter(host.config, host, Ledger(host.config.state_dir))


def test_the_creatable_list_is_read_as_nvidia_lays_it_out():
    text = "ID    : vGPU Name\n557   : NVIDIA L40S-1Q\n558   : NVIDIA L40S-2Q\n"
    assert parse_vgpu_types(text) == ((557, "NVIDIA L40S-1Q"), (558, "NVIDIA L40S-2Q"))
    assert parse_vgpu_types("NVIDIA L40S-12Q   1177\n") == ((1177, "NVIDIA L40S-12Q"),)
    vgpu = Vgpu(((557, "NVIDIA L40S-1Q"),))
    assert vgpu.find("557") == vgpu.find("nvidia l40s-1q") == (557, "NVIDIA L40S-1Q")
    assert vgpu.find("NVIDIA L40S-2Q") is None


def test_a_vms_claim_gives_the_vf_its_type_on_nvidia_and_its_release_clears_it(
    kernel, make_host, vms
):
    vm, other = vms
    arbiter = arbiter_on(make_host, vf0="NVIDIA L40S-2Q", vf1="557")
    [vf0] = TokenCatalogue(arbiter.config, arbiter.host).resolve(["vf0"])
    assert vf0.primary is not None and vf0.primary.vgpu is not None
    assert [name for _, name in vf0.primary.vgpu.creatable] == [
        "NVIDIA L40S-1Q",
        "NVIDIA L40S-2Q",
        "NVIDIA L40S-4Q",
    ]
    plan = arbiter.acquire(vm, Mode.EXCLUSIVE, ["vf0"])
    assert [(s.address, s.to_driver) for s in plan.switches] == [(VF0, "vgpu:558")]
    assert kernel.driver_of(VF0) == "nvidia" and kernel.vgpu_type(VF0) == 558
    assert kernel.driver_of(PF) == "nvidia"
    # One type at a time: the other VF can have only 558 now, so 557 is refused, and
    # nothing is written.
    with pytest.raises(ClaimRefused) as refused:
        arbiter.acquire(other, Mode.EXCLUSIVE, ["vf1"])
    assert "does not list vGPU type '557'" in str(refused.value)
    assert "NVIDIA L40S-2Q (558)" in str(refused.value)
    assert kernel.vgpu_type(VF1) == 0
    assert arbiter.release_claimant(vm, force=True)
    assert kernel.driver_of(VF0) == "nvidia" and kernel.vgpu_type(VF0) == 0
    state = arbiter.ledger.read()
    assert state.leases == () and state.poisoned == ()
    # With the first VF free again, the second gets its 1-Q.
    arbiter.acquire(other, Mode.EXCLUSIVE, ["vf1"])
    assert kernel.vgpu_type(VF1) == 557


def test_a_vgpu_vf_without_a_configured_type_or_claimed_shared_is_refused(kernel, make_host):
    arbiter = arbiter_on(make_host, vf1="NVIDIA L40S-4Q")
    with pytest.raises(ClaimRefused) as refused:
        arbiter.acquire("libvirt:vm", Mode.EXCLUSIVE, ["vf0"])
    assert "no vgpu_type is configured" in str(refused.value)
    assert "NVIDIA L40S-1Q (557)" in (refused.value.hint or "")
    with pytest.raises(ClaimRefused, match="only given to a VM"):
        arbiter.acquire("container:c", Mode.SHARED, ["vf1"])
    assert kernel.driver_of(VF0) == "nvidia" and kernel.driver_of(VF1) == "nvidia"
    assert kernel.vgpu_type(VF0) == kernel.vgpu_type(VF1) == 0


def test_vfio_pci_does_not_take_a_vgpu_vf(kernel, make_host):
    """What a claim without vGPU would do (switch it to vfio-pci) fails on the real
    driver; the fake refuses it the same way, and the planner never tries."""
    kernel.write(kernel.device_dir(VF0) / "driver" / "unbind", VF0)
    kernel.write(kernel.device_dir(VF0) / "driver_override", "vfio-pci")
    kernel.write(kernel.device_dir(VF0).parent.parent / "drivers_probe", VF0)
    assert kernel.driver_of(VF0) is None


def test_a_type_set_by_hand_is_unaccounted_until_an_operator_decides(kernel, make_host):
    """A VF with a vGPU type and no lease (a type written outside the arbiter, a lease
    lost): like a GPU on vfio-pci nobody accounts for, every claim is refused; send-home
    clears the type."""
    kernel.write(kernel.device_dir(VF0) / "nvidia" / "current_vgpu_type", "558")
    arbiter = arbiter_on(make_host, vf0="558")
    with pytest.raises(TokenUnaccounted):
        arbiter.acquire("libvirt:vm", Mode.EXCLUSIVE, ["vf0"])
    from charly_arbiter.ops.reconcile import send_home

    send_home(arbiter, "vf0", [])
    assert kernel.vgpu_type(VF0) == 0 and kernel.driver_of(VF0) == "nvidia"
    arbiter.acquire("libvirt:vm", Mode.EXCLUSIVE, ["vf0"])
    assert kernel.vgpu_type(VF0) == 558


# -- the simulated host ------------------------------------------------------------------


def test_the_simulated_host_gives_vgpu_types_as_the_fake_kernel_does(make_sim):
    """The same rules on `sim:DIR` (host.toml's `vgpu_types` on the PF): two VMs, two
    VFs, one type at a time; I1-I3 (with I2's vGPU clause) after every step."""
    from invariants import assert_invariants, sim_facts
    from simhosts import PF as SPF
    from simhosts import VF0 as SVF0
    from simhosts import VF1 as SVF1
    from simhosts import default_host, sriov_tokens, vgpu_pf

    from tests.conftest import DEFAULT_CONFIG

    tokens = (
        sriov_tokens(2, vf_tokens=("vf0", "vf1"))
        .replace(f'address = "{SVF0}"', f'address = "{SVF0}"\nvgpu_type = "NVIDIA L40S-2Q"')
        .replace(f'address = "{SVF1}"', f'address = "{SVF1}"\nvgpu_type = 557')
    )
    sim = make_sim(host=default_host() + vgpu_pf(), config=DEFAULT_CONFIG + tokens)
    sim.cli("vfs", "pf", "2", check=True)
    functions = {"pf": (SPF,), "vf0": (SVF0,), "vf1": (SVF1,)}

    def check(label: str) -> None:
        facts = sim_facts(sim.host().snapshot(), functions, (), {"vf0": "pf", "vf1": "pf"})
        assert_invariants(sim.arbiter().ledger.read(), facts, label)

    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:a", Mode.EXCLUSIVE, ["vf0"])
    check("vf0 claimed")
    vfs = sim.host().snapshot()["vfs"]
    assert vfs[SVF0]["vgpu"] == 558 and sim.host().snapshot()["drivers"][SVF0] == "nvidia"
    with pytest.raises(ClaimRefused, match="does not list vGPU type '557'"):
        arbiter.acquire("libvirt:b", Mode.EXCLUSIVE, ["vf1"])
    check("vf1 refused")
    sim.stopped("libvirt:a")
    assert arbiter.release_claimant("libvirt:a")
    check("vf0 released")
    assert sim.host().snapshot()["vfs"][SVF0]["vgpu"] == 0
    arbiter.acquire("libvirt:b", Mode.EXCLUSIVE, ["vf1"])
    assert sim.host().snapshot()["vfs"][SVF1]["vgpu"] == 557
    check("vf1 claimed")
    # The PF is never taken from under them, nor are the VFs' count changed.
    assert sim.cli("vfs", "pf", "0").returncode == 3
