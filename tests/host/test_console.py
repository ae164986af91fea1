"""A GPU that drives the host's console or display is refused with what runs on it,
unless `console = "release"` says how to free it (issue 11).

The fake tree models what the kernel shows (Linux 6.x): the DRM driver's fbdev
framebuffer (`/sys/class/graphics/fbN`, its `device` the GPU) while the GPU is on
its own driver, fbcon's vtconsole ("frame buffer device", `bind` 1 while it draws
on the framebuffers), the boot display's `boot_vga`, and the firmware's
framebuffer as a bound `efi-framebuffer.0` platform device.  The real-kernel
tests (tests/kernel) meet the real thing: fbcon on bochs-drm's fb0.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from fakesys import FakeDevice, FakeKernel

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import TokenConfig
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import VFIO, Mode
from charly_arbiter.errors import PassthroughImpossible, ScreenInUse

GPU = "0000:0a:00.0"


@pytest.fixture
def kernel(tmp_path) -> FakeKernel:
    """The boot GPU with its framebuffer and fbcon on it, and its HDMI audio."""
    kernel = FakeKernel(tmp_path, loaded={"vfio-pci", "nvidia", "snd_hda_intel"})
    kernel.fbcon(bound=True)
    kernel.platform_framebuffer()
    kernel.add(
        FakeDevice(
            GPU,
            "10de",
            "2684",
            "030000",
            "nvidia",
            "12",
            boot_vga=True,
            drm=("card0",),
            framebuffer="fb0",
        )
    )
    kernel.add(FakeDevice("0000:0a:00.1", "10de", "22ba", "040300", "snd_hda_intel", "12"))
    return kernel


def arbiter(host) -> Arbiter:
    return Arbiter(host.config, host, Ledger(host.config.state_dir, 5))


def fbcon_bound(kernel: FakeKernel) -> str:
    return (kernel.sys / "class/vtconsole/vtcon1/bind").read_text().strip()


def test_the_boot_gpu_with_the_console_is_refused_saying_what_runs_on_it(make_host, kernel):
    host = make_host()
    with pytest.raises(PassthroughImpossible) as refused:
        arbiter(host).acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    message = str(refused.value)
    assert "it is the boot display (0000:0a:00.0 has boot_vga)" in message
    assert "the text console runs on it (fb0)" in message
    assert 'console = "release"' in (refused.value.hint or "")
    assert kernel.driver_of(GPU) == "nvidia" and fbcon_bound(kernel) == "1"


def test_a_display_server_on_it_is_named(make_host, kernel, tmp_path):
    xorg = tmp_path / "Xorg"
    shutil.copy("/bin/sleep", xorg)
    with open(kernel.dev / "dri" / "card0", "rb") as card:
        server = subprocess.Popen([str(xorg), "60"], stdin=card)
    try:
        # (a display server is the screen's: the screen rule names it, issue 19)
        with pytest.raises(ScreenInUse, match=rf"Xorg \(pid {server.pid}\)"):
            arbiter(make_host()).acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    finally:
        server.kill()
        server.wait()


def test_release_takes_the_console_off_and_gives_it_back(make_host, kernel):
    host = make_host(tokens=(TokenConfig("gpu0", GPU, console="release"),))
    claims = arbiter(host)
    claims.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert kernel.driver_of(GPU) == VFIO
    assert fbcon_bound(kernel) == "0"
    platform = kernel.sys / "bus/platform/drivers/efi-framebuffer"
    assert not (platform / "efi-framebuffer.0").exists()  # the boot framebuffer let go
    assert ("class/vtconsole/vtcon1/bind", "0\n") in kernel.writes
    claims.release_claimant("libvirt:win11", force=True)
    assert kernel.driver_of(GPU) == "nvidia"
    assert fbcon_bound(kernel) == "1"  # the console is back on the GPU's own framebuffer


def test_a_gpu_that_is_no_display_is_not_refused(make_host, kernel):
    (kernel.device_dir(GPU).resolve() / "boot_vga").write_text("0\n")
    kernel.fbcon(bound=False)
    claims = arbiter(make_host())
    claims.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert kernel.driver_of(GPU) == VFIO


def test_the_top_level_console_setting_covers_zero_config_tokens(make_host, kernel):
    """With no tokens configured every GPU is a token named after its address."""
    host = make_host(tokens=(), console="release")
    claims = arbiter(host)
    claims.acquire("libvirt:win11", Mode.EXCLUSIVE, [GPU])
    assert kernel.driver_of(GPU) == VFIO and fbcon_bound(kernel) == "0"
