"""The home driver is always known.

A GPU found on vfio-pci (bound there at boot, or left by a crashed tool) with no
home recorded in the ledger or configured is nothing the ledger accounts for: no
claim touches it until an operator settles it (issue 17).  `send-home` then
sends it to a home from the data file, checked against the kernel's module index
(`modules.alias`, here a small one written per test in the format depmod writes:
it stands for /lib/modules/RELEASE); when nothing on the host can take it, a
shared claim is refused with that reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fakesys import FakeKernel

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import VFIO, Mode
from charly_arbiter.errors import ClaimRefused, TokenUnaccounted
from charly_arbiter.host.kmod import KernelModules
from charly_arbiter.host.local import LocalHost
from charly_arbiter.host.pcidata import pci_data
from charly_arbiter.ops.reconcile import send_home

GPU = "0000:0a:00.0"
AUDIO = "0000:0a:00.1"

# What depmod writes for these modules (real lines of Debian 6.1's modules.alias,
# trimmed to the ones that matter, plus the proprietary driver's own alias).
NVIDIA_ALIAS = "alias pci:v000010DEd*sv*sd*bc03sc00i00* nvidia\n"
ALIASES = (
    "alias pci:v000010DEd*sv*sd*bc03sc*i* nouveau\n"
    "alias pci:v*d*sv*sd*bc04sc03i00* snd_hda_intel\n"
    "alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci\n"
    "alias pci:v00001234d00001111sv*sd*bc*sc*i* bochs\n"
)
DEPS = (
    "kernel/drivers/gpu/drm/nouveau/nouveau.ko:\n"
    "kernel/sound/pci/hda/snd-hda-intel.ko: kernel/sound/pci/hda/snd-hda-codec.ko\n"
    "kernel/drivers/vfio/pci/vfio-pci.ko: kernel/drivers/vfio/vfio.ko\n"
)


def modules_tree(root: Path, *, nvidia: bool, nouveau: bool = True) -> Path:
    release = root / "modules" / os.uname().release
    release.mkdir(parents=True)
    aliases = "".join(line for line in ALIASES.splitlines(True) if nouveau or "nouveau" not in line)
    (release / "modules.alias").write_text((NVIDIA_ALIAS if nvidia else "") + aliases)
    deps = DEPS + ("updates/dkms/nvidia.ko:\n" if nvidia else "")
    (release / "modules.dep").write_text(deps)
    (release / "modules.builtin").write_text("")
    return root / "modules"


def strand_on_vfio(host: LocalHost, kernel: FakeKernel) -> None:
    """What a crashed tool or vfio-pci.ids at boot leaves: the group on vfio-pci, the
    GPU's own driver unloaded, and no ledger that knows where it came from."""
    from charly_arbiter.core.host import TokenSpec

    token = TokenSpec("gpu0", GPU, tuple(host.token_functions("gpu0", GPU)))
    host.switch(token, {GPU: VFIO, AUDIO: VFIO})
    kernel.unload("nvidia")


def test_the_module_index_says_which_modules_take_a_device(tmp_path):
    modules = KernelModules(modules_tree(tmp_path, nvidia=True))
    gpu = "pci:v000010DEd00002684sv00001043sd000088E2bc03sc00i00"
    assert modules.matching(gpu) == ["nvidia", "nouveau"]
    assert modules.matching("pci:v000010DEd000022BAsv00001043sd000088E2bc04sc03i00") == [
        "snd_hda_intel"
    ]
    assert modules.matching("pci:v00008086d0000A780sv00001043sd000088E2bc03sc00i00") == []
    assert modules.has("vfio-pci") and modules.has("snd_hda_intel") and modules.has("nvidia")
    assert not modules.has("amdgpu")


def test_the_data_file_prefers_the_vendor_driver_then_any_module_but_a_stub():
    data = pci_data()
    assert data.default_driver("10de", ["nvidia", "nouveau"]) == "nvidia"
    assert data.default_driver("10de", ["nouveau"]) == "nouveau"
    assert data.default_driver("1234", ["bochs"]) == "bochs-drm"  # driver named otherwise
    assert data.default_driver("10de", ["snd_hda_intel"]) == "snd_hda_intel"
    assert data.default_driver("10de", ["vfio_pci"]) is None
    assert data.module_of("bochs-drm") == "bochs" and data.module_of("vfio-pci") == "vfio_pci"


@pytest.mark.parametrize(("nvidia", "expected"), [(True, "nvidia"), (False, "nouveau")])
def test_a_gpu_found_on_vfio_with_no_home_goes_to_the_driver_the_kernel_has(
    tmp_path, make_host, kernel, nvidia, expected
):
    kernel.installed = {"nvidia", "nouveau"} if nvidia else {"nouveau"}
    kernel.devices[GPU].native = expected  # which of the two matches it first here
    host = make_host(modules_root=modules_tree(tmp_path, nvidia=nvidia))
    strand_on_vfio(host, kernel)
    arbiter = Arbiter(host.config, host, Ledger(host.config.state_dir, 5))
    with pytest.raises(TokenUnaccounted):  # nothing claims it before the operator decides
        arbiter.acquire("container:llm", Mode.SHARED, ["gpu0"])
    send_home(arbiter, "gpu0", [])
    assert (kernel.driver_of(GPU), kernel.driver_of(AUDIO)) == (expected, "snd_hda_intel")
    assert expected in kernel.loaded  # loaded for the switch, as libvirt loads the stub


def test_a_gpu_no_driver_can_take_refuses_a_shared_claim_with_the_reason(
    tmp_path, make_host, kernel
):
    host = make_host(modules_root=modules_tree(tmp_path, nvidia=False, nouveau=False))
    strand_on_vfio(host, kernel)
    arbiter = Arbiter(host.config, host, Ledger(host.config.state_dir, 5))
    send_home(arbiter, "gpu0", [])  # off vfio-pci; the kernel binds nothing to it
    assert kernel.driver_of(GPU) is None
    before = arbiter.ledger.read()
    with pytest.raises(ClaimRefused) as refused:
        arbiter.acquire("container:llm", Mode.SHARED, ["gpu0"])
    assert "no driver on this host can take 0000:0a:00.0" in str(refused.value)
    assert "home_driver" in str(refused.value.hint)
    assert kernel.driver_of(GPU) is None  # nothing was touched
    assert arbiter.ledger.read().leases == before.leases == ()


def test_a_configured_home_driver_wins_over_the_module_index(tmp_path, make_host, kernel):
    from charly_arbiter.core.config import TokenConfig
    from charly_arbiter.core.planner import home_map

    kernel.installed = {"nouveau"}
    kernel.devices[GPU].native = "nouveau"
    host = make_host(
        modules_root=modules_tree(tmp_path, nvidia=False),
        tokens=(TokenConfig("gpu0", GPU, home_driver="nvidia"),),
    )
    strand_on_vfio(host, kernel)
    arbiter = Arbiter(host.config, host, Ledger(host.config.state_dir, 5))
    (spec,) = arbiter.tokens.reread(["gpu0"])
    # Where `send-home` (and any release) would send it: the configured driver.
    assert home_map(arbiter.ledger.read(), spec)[GPU] == "nvidia"
