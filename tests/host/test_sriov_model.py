"""SR-IOV as the models show it: the fake kernel of fakesys.py and the simulated host
do what Linux 6.1 did under QEMU (tests/kernel/test_sriov_kernel.py, QEMU's emulated
NVMe controller as the physical function), and the package reads, detects and
catalogues what they show.

The facts taken from the real kernel: VFs at PF + offset + index * stride, each in
an IOMMU group of its own (the lowest free number), their vendor id reading 0xffff
in configuration space; another count while VFs exist is EBUSY, more than
`sriov_totalvfs` ERANGE; a VF is probed only with autoprobe on or an override;
vfio-pci refuses a PF whose VFs exist; writing 0 while a process holds a VF's
VFIO device fd blocks after that VF's `virtfnN`, `physfn` and `driver` links are
gone, a reader of `sriov_numvfs` blocks with it (the package's reads do not), and
both return once the holder has exited; a holder of the group file alone
blocks nothing.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakesys import FakeKernel, gpu_with_vfs

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import Config, TokenConfig
from charly_arbiter.core.host import NO_DRIVER, Sriov
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import LedgerState, Mode
from charly_arbiter.core.planner import home_map
from charly_arbiter.core.tokens import TokenCatalogue
from charly_arbiter.errors import SwitchFailed, SwitchHung
from charly_arbiter.host.blocking import ChildWriter, TimedOut, bounded
from charly_arbiter.host.detect import SriovInfo, detect, document, render
from charly_arbiter.host.sim import SimHost
from charly_arbiter.host.sysfs import Switcher, Sysfs

PF = "0000:03:00.0"
VF0, VF1 = "0000:03:00.1", "0000:03:00.2"
OTHER = "0000:0b:00.0"  # a plain GPU beside it


@pytest.fixture
def kernel(tmp_path: Path) -> FakeKernel:
    return gpu_with_vfs(tmp_path)


@pytest.fixture
def holder() -> Iterator[subprocess.Popen[bytes]]:
    """A real process that stands for QEMU holding a VF's VFIO device fd."""
    process = subprocess.Popen(["/bin/sleep", "600"])
    yield process
    process.kill()
    process.wait()


def numvfs(kernel: FakeKernel, text: str) -> None:
    kernel.write(kernel.device_dir(PF) / "sriov_numvfs", text)


def numvfs_errno(kernel: FakeKernel, text: str) -> int | None:
    with pytest.raises(OSError) as error:
        numvfs(kernel, text)
    return error.value.errno


def autoprobe_off(kernel: FakeKernel) -> None:
    kernel.write(kernel.device_dir(PF) / "sriov_drivers_autoprobe", "0")


def switcher(kernel: FakeKernel, timeout: float = 1.0) -> Switcher:
    return Switcher(Sysfs(kernel.sys, kernel.write), kernel.dev, timeout, bind_wait=0.2)


def wait_until(predicate: object, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- the fake kernel ----------------------------------------------------------------------


def test_a_count_makes_vfs_with_their_links_and_an_iommu_group_each(kernel):
    numvfs(kernel, "2\n")
    pf = kernel.device_dir(PF)
    assert [os.readlink(pf / f"virtfn{i}") for i in (0, 1)] == [f"../{VF0}", f"../{VF1}"]
    sysfs = Sysfs(kernel.sys)
    assert sysfs.function(PF).sriov == Sriov(2, (VF0, VF1))
    vf0, vf1 = sysfs.function(VF0), sysfs.function(VF1)
    assert vf0.physfn == vf1.physfn == PF and vf0.is_virtual
    # Groups of their own, the lowest numbers free (the kernel's ida): here 0 and 1.
    assert (vf0.iommu_group, vf1.iommu_group) == ("0", "1")
    assert (vf0.vendor, vf0.device, vf0.pci_class) == ("8086", "56c1", "038000")
    assert sysfs.config_vendor(VF0) == 0xFFFF  # as the SR-IOV specification says
    assert sysfs.config_vendor(PF) == 0x8086
    assert kernel.driver_of(VF0) == "i915"  # autoprobe is on by default
    assert sysfs.attribute(PF, "sriov_numvfs") == "2"


def test_the_count_changes_only_through_zero(kernel):
    numvfs(kernel, "2")
    assert numvfs_errno(kernel, "1") == errno.EBUSY
    assert numvfs_errno(kernel, "3") == errno.ERANGE
    assert numvfs_errno(kernel, "x") == errno.EINVAL
    numvfs(kernel, "2")  # the count it has: nothing happens
    assert kernel.vfs(PF) == [VF0, VF1]
    numvfs(kernel, "0")
    assert kernel.vfs(PF) == [] and not list(kernel.device_dir(PF).glob("virtfn*"))
    assert not (kernel.sys / "kernel/iommu_groups/0").exists()
    numvfs(kernel, "1")
    assert kernel.vfs(PF) == [VF0]


def test_no_count_without_a_driver_on_the_pf_and_its_unbind_leaves_the_vfs(kernel):
    numvfs(kernel, "2")
    kernel.write(kernel.sys / "bus/pci/drivers/i915/unbind", PF)
    assert kernel.vfs(PF) == [VF0, VF1]  # "driver left SR-IOV enabled after remove"
    assert numvfs_errno(kernel, "0") == errno.ENOENT


def test_a_vf_is_probed_only_with_autoprobe_on_or_an_override(kernel):
    autoprobe_off(kernel)
    numvfs(kernel, "2")
    assert kernel.driver_of(VF0) is None
    kernel.write(kernel.sys / "bus/pci/drivers_probe", VF0)
    assert kernel.driver_of(VF0) is None
    switcher(kernel).switch({VF0: "vfio-pci"})
    assert kernel.driver_of(VF0) == "vfio-pci" and (kernel.dev / "vfio/0").exists()
    switcher(kernel).switch({VF0: NO_DRIVER})
    assert kernel.driver_of(VF0) is None and not (kernel.dev / "vfio/0").exists()


def test_vfio_pci_refuses_a_pf_whose_vfs_exist_and_the_switch_says_why(kernel):
    numvfs(kernel, "2")
    with pytest.raises(SwitchFailed) as failed:
        switcher(kernel).switch({PF: "vfio-pci"})
    assert "SR-IOV enabled (2 virtual function(s))" in str(failed.value)
    assert kernel.driver_of(PF) == "i915" and kernel.vfs(PF) == [VF0, VF1]  # undone


def test_a_held_vf_blocks_the_teardown_and_the_readers_of_sriov_numvfs_not_the_packages(
    kernel, holder
):
    autoprobe_off(kernel)
    numvfs(kernel, "2")
    switcher(kernel).switch({VF0: "vfio-pci"})
    kernel.hold_vfio_device(VF0, holder.pid)
    path = kernel.device_dir(PF) / "sriov_numvfs"
    writer = ChildWriter(kernel.write)  # as LocalHost makes the writes that can block
    with pytest.raises(TimedOut):
        bounded(lambda: writer(path, "0"), 0.5, "sriov_numvfs")
    read: list[str] = []
    with pytest.raises(TimedOut):  # the device lock
        bounded(lambda: read.append(path.read_text()), 0.3, "read sriov_numvfs")
    sysfs = Sysfs(kernel.sys)
    started = time.monotonic()
    pf = bounded(lambda: sysfs.function(PF), 2, "the package's read")
    assert time.monotonic() - started < 1
    # VF0 is half-way: its links are gone, its device is still there.
    assert pf.sriov == Sriov(2, (VF1,))
    vf0 = sysfs.function(VF0)
    assert (vf0.physfn, vf0.driver) == (None, None)
    assert sysfs.function(VF1).physfn == PF
    assert (kernel.dev / "vfio/0").exists()
    holder.kill()
    holder.wait()
    assert wait_until(lambda: not kernel.vfs(PF))
    assert wait_until(lambda: read == ["0\n"])
    assert not (kernel.dev / "vfio/0").exists() and sysfs.attribute(PF, "sriov_numvfs") == "0"
    writer(path, "2")  # the helper that was stuck is back, and the count can be set again
    assert kernel.vfs(PF) == [VF0, VF1]
    writer.close()


def test_a_holder_of_the_group_file_alone_blocks_nothing(kernel):
    autoprobe_off(kernel)
    numvfs(kernel, "2")
    switcher(kernel).switch({VF0: "vfio-pci"})
    with open(kernel.dev / "vfio/0", "rb"):
        bounded(lambda: numvfs(kernel, "0"), 2, "sriov_numvfs")
    assert kernel.vfs(PF) == [] and not (kernel.dev / "vfio/0").exists()


def test_unbinding_vfio_pci_from_a_held_vf_blocks_after_its_driver_link_is_gone(kernel, holder):
    autoprobe_off(kernel)
    numvfs(kernel, "2")
    switch = switcher(kernel, timeout=0.3)
    switch.switch({VF0: "vfio-pci"})
    kernel.hold_vfio_device(VF0, holder.pid)
    with pytest.raises(SwitchHung):
        switch.switch({VF0: NO_DRIVER})
    assert kernel.driver_of(VF0) is None and (kernel.dev / "vfio/0").exists()
    holder.kill()
    holder.wait()
    assert wait_until(lambda: not (kernel.dev / "vfio/0").exists())


# -- the package on it: tokens, the switch of a VF, detect ---------------------------------


def test_without_configured_tokens_the_vfs_are_no_tokens_and_the_pf_knows_them(kernel, make_host):
    numvfs(kernel, "2")  # display-class VFs, as Intel's or AMD's
    host = make_host(tokens=())
    assert [g.address for g in host.gpus()] == [PF, VF0, VF1, OTHER]
    catalogue = TokenCatalogue(host.config, host)
    assert sorted(catalogue.all()) == [PF, OTHER]
    assert catalogue.all()[PF].virtual_functions == (VF0, VF1)
    assert catalogue.all()[OTHER].virtual_functions == ()


def test_a_vf_configured_by_address_knows_its_pf_and_goes_to_vfio_pci_and_back(kernel, make_host):
    autoprobe_off(kernel)
    numvfs(kernel, "2")
    host = make_host(tokens=(TokenConfig("vf0", VF0), TokenConfig("pf", PF)))
    vf0, pf = TokenCatalogue(host.config, host).resolve(["vf0", "pf"])
    assert vf0.physical_function == PF and [f.address for f in vf0.functions] == [VF0]
    assert pf.physical_function is None and pf.virtual_functions == (VF0, VF1)
    host.switch(vf0, {VF0: "vfio-pci"})
    assert kernel.driver_of(VF0) == "vfio-pci"
    # Home: its configuration space reads 0xffff, as every VF's does; the health check
    # asks its physical function whether the device answers.
    host.switch(vf0, {VF0: NO_DRIVER})
    assert kernel.driver_of(VF0) is None


def test_a_vfs_home_is_no_driver_while_its_pfs_autoprobe_is_off(kernel, make_host, tmp_path):
    """On the real kernel a VF under a PF with `sriov_drivers_autoprobe` 0 stays without
    a driver, and `drivers_probe` binds none to it without an override: its home is no
    driver, or a release would send it to i915 (whose module takes it), the bind would
    never come, and the VF would be poisoned.  With autoprobe on, the kernel's own
    choice is its home, as for any function found without a driver."""
    release = tmp_path / "modules" / os.uname().release
    release.mkdir(parents=True)
    (release / "modules.alias").write_text("alias pci:v00008086d*sv*sd*bc03sc*i* i915\n")
    (release / "modules.dep").write_text("kernel/drivers/gpu/drm/i915/i915.ko:\n")
    (release / "modules.builtin").write_text("")
    numvfs(kernel, "1")
    kernel.write(kernel.device_dir(VF0) / "driver" / "unbind", VF0)
    host = make_host(tokens=(TokenConfig("vf0", VF0),), modules_root=tmp_path / "modules")
    [vf0] = TokenCatalogue(host.config, host).resolve(["vf0"])
    assert home_map(LedgerState(), vf0) == {VF0: "i915"}
    autoprobe_off(kernel)
    [vf0] = TokenCatalogue(host.config, host).resolve(["vf0"])
    assert home_map(LedgerState(), vf0) == {VF0: NO_DRIVER}
    # A claim and its release, as the hook makes them: back to no driver, not poisoned.
    config = host.config
    arbiter = Arbiter(config, host, Ledger(config.state_dir))
    arbiter.acquire("libvirt:vm", Mode.EXCLUSIVE, ["vf0"])
    assert kernel.driver_of(VF0) == "vfio-pci"
    assert arbiter.release_claimant("libvirt:vm", force=True)
    assert kernel.driver_of(VF0) is None
    state = arbiter.ledger.read()
    assert state.leases == () and state.poisoned == ()


def test_a_vf_whose_pf_does_not_answer_fails_the_health_check(kernel, make_host):
    autoprobe_off(kernel)
    numvfs(kernel, "1")
    host = make_host(tokens=(TokenConfig("vf0", VF0),))
    [vf0] = TokenCatalogue(host.config, host).resolve(["vf0"])
    host.switch(vf0, {VF0: "vfio-pci"})
    (kernel.device_dir(PF).resolve() / "config").write_bytes(b"\xff" * 64)
    with pytest.raises(SwitchFailed, match=f"its physical function {PF}'s configuration space"):
        host.switch(vf0, {VF0: NO_DRIVER})


def test_detect_shows_the_pf_with_its_vfs_and_each_vf_with_its_pf(kernel, make_host):
    numvfs(kernel, "2")
    result = detect(make_host(tokens=()))
    functions = {f.address: f for f in result.functions}
    assert functions[PF].sriov == SriovInfo(2, 2, (VF0, VF1), 1, 1, "56c1", True)
    assert functions[PF].physfn is None and functions[OTHER].sriov is None
    assert functions[VF0].physfn == PF and functions[VF0].iommu_group == "0"
    gpus = {g.address: g for g in result.gpus}
    assert gpus[PF].vfs == (VF0, VF1) and not gpus[PF].viable
    assert "2 virtual function(s) enabled" in gpus[PF].not_viable_because[0]
    assert gpus[VF0].physfn == PF and gpus[VF0].viable
    as_json = document(result)
    [pf_json] = [f for f in as_json["functions"] if f["address"] == PF]
    assert pf_json["sriov"]["vfs"] == (VF0, VF1) and pf_json["sriov"]["num_vfs"] == 2
    text = render(result)
    assert f"SR-IOV 2 of 2 VFs: {VF0}, {VF1}" in text
    assert f"{VF1} 8086:56c1" in text and f"virtual function of {PF}" in text
    assert f"a virtual function of {PF}, not a GPU of its own" in text


# -- the simulated host ---------------------------------------------------------------------

SIM_HOST = f"""
[[devices]]
address = "{PF}"
vendor = "8086"
device = "56c0"
class = "038000"
driver = "i915"
iommu_group = 0
sriov_totalvfs = 2
sriov_vf_device = "56c1"
sriov_vf_driver = "i915"
{{fault}}

[[devices]]
address = "{OTHER}"
vendor = "8086"
device = "a780"
class = "030000"
driver = "i915"
iommu_group = 2
"""


def sim_host(directory: Path, fault: str = "") -> SimHost:
    directory.mkdir(exist_ok=True)
    (directory / "host.toml").write_text(SIM_HOST.format(fault=fault))
    return SimHost(directory, switch_timeout=0.5)


def sim_errno(host: SimHost, text: str) -> int | None:
    with pytest.raises(OSError) as error:
        host.write_sysfs(PF, "sriov_numvfs", text)
    return error.value.errno


def test_the_simulated_host_makes_and_removes_vfs_as_the_kernel_does(tmp_path):
    host = sim_host(tmp_path / "sim")
    host.write_sysfs(PF, "sriov_numvfs", "2\n")
    functions = {f.address: f for f in host.token_functions("pf", PF)}
    assert functions[PF].sriov == Sriov(2, (VF0, VF1))
    vf0, vf1 = host.token_functions("vf0", VF0)[0], host.token_functions("vf1", VF1)[0]
    assert vf0.physfn == vf1.physfn == PF
    assert (vf0.iommu_group, vf1.iommu_group) == ("1", "3")  # the lowest numbers free
    assert (vf0.device, vf0.driver) == ("56c1", "i915")
    assert sorted(TokenCatalogue(Config(), host).all()) == [PF, OTHER]
    assert sim_errno(host, "1") == errno.EBUSY
    assert sim_errno(host, "3") == errno.ERANGE
    assert sim_errno(host, "two") == errno.EINVAL
    host.write_sysfs(PF, "sriov_numvfs", "2")
    host.write_sysfs(PF, "sriov_numvfs", "0")
    assert [f.address for f in host.gpus()] == [PF, OTHER]
    with pytest.raises(OSError) as error:
        host.write_sysfs(PF, "sriov_totalvfs", "4")
    assert error.value.errno == errno.EACCES
    host.write_sysfs(PF, "sriov_numvfs", "1")
    host.reboot()  # the count does not survive a reboot
    assert host.token_functions("pf", PF)[0].sriov == Sriov(2, ())


def test_the_simulated_host_refuses_vfio_for_a_pf_with_vfs_and_probes_vfs_as_told(tmp_path):
    host = sim_host(tmp_path / "sim")
    host.write_sysfs(PF, "sriov_drivers_autoprobe", "0")
    host.write_sysfs(PF, "sriov_numvfs", "2")
    [pf] = TokenCatalogue(Config(), host).resolve([PF])
    with pytest.raises(SwitchFailed, match="SR-IOV enabled"):
        host.switch(pf, {PF: "vfio-pci"})
    catalogue = TokenCatalogue(Config(tokens=(TokenConfig("vf0", VF0),)), host)
    [vf0] = catalogue.resolve(["vf0"])
    assert vf0.physical_function == PF and vf0.functions[0].driver is None
    host.switch(vf0, {VF0: "vfio-pci"})
    host.switch(vf0, {VF0: NO_DRIVER})
    assert host.snapshot()["drivers"][VF0] == ""


def test_the_simulated_teardown_blocks_on_a_held_vf_until_the_fault_is_lifted(tmp_path):
    directory = tmp_path / "sim"
    host = sim_host(directory, fault="hang_sriov_teardown = true")
    host.write_sysfs(PF, "sriov_drivers_autoprobe", "0")
    host.write_sysfs(PF, "sriov_numvfs", "2")
    [vf0] = TokenCatalogue(Config(tokens=(TokenConfig("vf0", VF0),)), host).resolve(["vf0"])
    host.switch(vf0, {VF0: "vfio-pci"})
    with pytest.raises(TimedOut):
        bounded(lambda: host.write_sysfs(PF, "sriov_numvfs", "0"), 0.5, "sriov_numvfs")
    # Half-way, as on the kernel: VF0 has lost its links and its driver, VF1 has not.
    functions = {f.address: f for f in host.token_functions("pf", PF)}
    assert functions[PF].sriov == Sriov(2, (VF1,))
    stuck = host.token_functions("vf0", VF0)[0]
    assert (stuck.physfn, stuck.driver) == (None, None)
    sim_host(directory)  # the holder let go
    assert wait_until(lambda: host.token_functions("pf", PF)[0].sriov == Sriov(2, ()))
    assert VF0 not in host.snapshot()["drivers"]
