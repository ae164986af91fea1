"""Driver switching on a fake sysfs tree whose writes behave like the kernel's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from fakesys import FakeKernel

from charly_arbiter.core.host import NO_DRIVER
from charly_arbiter.errors import HostError, InvalidAddress, SwitchFailed, SwitchHung
from charly_arbiter.host.sysfs import Switcher, Sysfs

GPU = "0000:0a:00.0"
AUDIO = "0000:0a:00.1"
HOME = {GPU: "nvidia", AUDIO: "snd_hda_intel"}
VFIO = {GPU: "vfio-pci", AUDIO: "vfio-pci"}


def switcher(kernel: FakeKernel, timeout: float = 1.0) -> Switcher:
    return Switcher(Sysfs(kernel.sys, kernel.write), kernel.dev, timeout, bind_wait=0.2)


def test_group_functions_are_the_gpu_and_its_audio_without_the_bridge(kernel):
    functions = Sysfs(kernel.sys).group_functions(GPU)
    assert [(f.address, f.driver, f.iommu_group) for f in functions] == [
        (GPU, "nvidia", "12"),
        (AUDIO, "snd_hda_intel", "12"),
    ]
    assert functions[0].vendor == "10de" and functions[0].pci_class == "030000"


def test_switch_to_vfio_uses_override_unbind_probe_and_creates_the_group_node(kernel):
    steps = switcher(kernel).switch(VFIO)
    assert kernel.drivers()[GPU] == "vfio-pci" and kernel.drivers()[AUDIO] == "vfio-pci"
    assert (kernel.dev / "vfio" / "12").exists()
    assert [s.from_driver for s in steps] == ["nvidia", "snd_hda_intel"]
    assert kernel.writes[:3] == [
        (f"bus/pci/devices/{GPU}/driver_override", "vfio-pci\n"),
        (f"bus/pci/devices/{GPU}/driver/unbind", GPU),
        ("bus/pci/drivers_probe", GPU),
    ]


def test_switch_back_clears_the_override_and_reprobes(kernel):
    switch = switcher(kernel)
    switch.switch(VFIO)
    kernel.writes.clear()
    switch.switch(HOME)
    assert {a: d for a, d in kernel.drivers().items() if a in HOME} == HOME
    assert (f"bus/pci/devices/{GPU}/driver_override", "\n") in kernel.writes
    assert not (kernel.dev / "vfio" / "12").exists()
    assert (kernel.dev / "dri" / "card1").exists()


def test_nothing_is_written_when_the_drivers_are_already_right(kernel):
    switcher(kernel).switch(HOME)
    assert kernel.writes == []


def test_no_driver_target_lets_the_kernel_choose(kernel):
    switch = switcher(kernel)
    switch.switch(VFIO)
    switch.switch({GPU: NO_DRIVER, AUDIO: NO_DRIVER})
    assert kernel.driver_of(GPU) == "nvidia"


def test_failed_probe_undoes_only_what_was_done_and_names_the_step(kernel):
    switch = switcher(kernel)
    switch.switch(VFIO)
    kernel.unload("snd_hda_intel")  # the audio function will find no driver going home
    kernel.writes.clear()
    with pytest.raises(SwitchFailed) as failure:
        switch.switch(HOME)
    assert failure.value.address == AUDIO and failure.value.step == "verify"
    assert "no driver took the device" in str(failure.value)
    # all or none: the GPU that had gone home went back to vfio-pci, and so did the audio
    assert kernel.driver_of(GPU) == "vfio-pci" and kernel.driver_of(AUDIO) == "vfio-pci"


def test_vfio_not_loaded_fails_before_any_write(kernel):
    kernel.unload("vfio-pci")
    with pytest.raises(SwitchFailed, match="vfio-pci is not loaded"):
        switcher(kernel).switch(VFIO)
    assert kernel.writes == []
    assert kernel.driver_of(GPU) == "nvidia"


def test_module_loader_is_asked_for_vfio_pci_when_it_is_missing(kernel):
    kernel.unload("vfio-pci")
    asked: list[str] = []

    def load(module: str) -> None:
        asked.append(module)
        kernel.load(module)

    switch = Switcher(Sysfs(kernel.sys, kernel.write), kernel.dev, 1.0, load_module=load)
    switch.switch(VFIO)
    assert asked == ["vfio-pci"] and kernel.driver_of(GPU) == "vfio-pci"


def test_hanging_unbind_raises_switch_hung_within_the_timeout_and_writes_nothing_more(kernel):
    kernel.hang_unbind.add("nvidia")
    switch = switcher(kernel, timeout=0.3)
    started = time.monotonic()
    with pytest.raises(SwitchHung) as hung:
        switch.switch(VFIO)
    assert time.monotonic() - started < 2
    assert hung.value.step == "unbind" and hung.value.address == GPU
    writes = len(kernel.writes)
    with pytest.raises(SwitchFailed, match="never returned"):
        switch.switch(HOME)
    assert len(kernel.writes) == writes, "a hung device must not be written again"
    kernel.release.set()  # let the stuck writer thread finish


@pytest.mark.parametrize(
    "address", ["0000:0a:00.0/../x", "../0000:0a:00.0", "0000:0A:00.0", "0000:0a:00.0 ", "a\0b"]
)
def test_bad_addresses_never_reach_a_path(kernel, address):
    with pytest.raises(InvalidAddress):
        Sysfs(kernel.sys).device(address)


def test_ten_thousand_domain_is_accepted(kernel):
    assert Sysfs(kernel.sys).device("10000:01:00.0").name == "10000:01:00.0"


def test_a_device_link_that_leaves_the_root_is_refused(tmp_path, kernel):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (kernel.sys / "bus/pci/devices/0000:0c:00.0").symlink_to(outside)
    with pytest.raises(HostError, match="outside"):
        Sysfs(kernel.sys).device("0000:0c:00.0")


def write_syscalls() -> int:
    """write(2) calls this thread has made so far, from the kernel's task I/O accounting."""
    try:
        text = Path("/proc/thread-self/io").read_text()
    except OSError:
        pytest.skip("this kernel has no per-task I/O accounting (/proc/thread-self/io)")
    return int(next(line for line in text.splitlines() if line.startswith("syscw:")).split()[1])


def test_real_writer_writes_once(tmp_path):
    """The kernel's store functions see each write(2) as a whole value: one call, all of it."""
    from charly_arbiter.host.sysfs import write_attribute

    target = tmp_path / "attr"
    target.write_text("")
    before = write_syscalls()
    write_attribute(target, "vfio-pci\n")
    assert write_syscalls() - before == 1
    assert target.read_text() == "vfio-pci\n"


def test_real_writer_never_creates_an_attribute(tmp_path):
    """A missing attribute is an error (an old kernel, a driver not loaded), not a new file."""
    from charly_arbiter.host.sysfs import write_attribute

    with pytest.raises(FileNotFoundError):
        write_attribute(tmp_path / "driver_override", "vfio-pci\n")
    assert list(tmp_path.iterdir()) == []


def test_a_write_error_is_a_switch_failure_naming_the_step(kernel):
    def failing(path: Path, text: str) -> None:
        if path.name == "unbind":
            raise OSError(16, "Device or resource busy")
        kernel.write(path, text)

    switch = Switcher(Sysfs(kernel.sys, failing), kernel.dev, 1.0)
    with pytest.raises(SwitchFailed, match="unbind: Device or resource busy"):
        switch.switch(VFIO)
    assert kernel.driver_of(GPU) == "nvidia"


def test_the_watchdog_thread_is_abandoned_not_joined(kernel):
    kernel.hang_unbind.add("nvidia")
    before = threading.active_count()
    with pytest.raises(SwitchHung):
        switcher(kernel, timeout=0.2).switch({GPU: "vfio-pci"})
    assert threading.active_count() == before + 1
    kernel.release.set()


def test_child_writer_writes_in_one_reused_helper_and_reports_its_errno(tmp_path):
    from charly_arbiter.host.blocking import ChildWriter

    def record(path: Path, text: str) -> None:
        if text == "busy":
            raise OSError(16, "Device or resource busy")
        path.write_text(f"{text} from {os.getpid()}")

    writer = ChildWriter(record)
    writer(tmp_path / "first", "x")
    writer(tmp_path / "second", "y")
    first = (tmp_path / "first").read_text().split(" from ")
    second = (tmp_path / "second").read_text().split(" from ")
    assert first[0] == "x" and second[0] == "y"
    assert first[1] == second[1] != str(os.getpid())  # one helper, not this process
    with pytest.raises(OSError) as error:
        writer(tmp_path / "third", "busy")
    assert error.value.errno == 16 and "busy" in str(error.value)
    writer(tmp_path / "fourth", "z")  # a failed write does not lose the helper
    assert (tmp_path / "fourth").read_text().split(" from ")[1] == first[1]
    writer.close()
    helper = int(first[1])
    with pytest.raises(ChildProcessError):
        os.waitpid(helper, os.WNOHANG)  # ended and reaped


def test_a_dead_helper_is_reported_and_replaced(tmp_path):
    from charly_arbiter.host.blocking import ChildWriter

    def record(path: Path, text: str) -> None:
        if text == "die":
            os._exit(3)
        path.write_text(str(os.getpid()))

    writer = ChildWriter(record)
    with pytest.raises(OSError, match="writer process died"):
        writer(tmp_path / "a", "die")
    writer(tmp_path / "b", "ok")
    assert (tmp_path / "b").read_text() != str(os.getpid())


def test_an_isolated_hanging_write_strands_only_the_child(kernel, tmp_path):
    """The parent gets SwitchHung on time while the child sleeps in the "kernel"."""
    marker = tmp_path / "child-pid"

    def stuck(path: Path, text: str) -> None:
        if path.name == "unbind":
            marker.write_text(str(os.getpid()))
            time.sleep(30)
        kernel.write(path, text)

    switch = Switcher(Sysfs(kernel.sys, stuck), kernel.dev, 0.5, isolate=True)
    started = time.monotonic()
    with pytest.raises(SwitchHung):
        switch.switch({GPU: "vfio-pci"})
    assert time.monotonic() - started < 5
    child = int(marker.read_text())
    assert child != os.getpid()
    # the next write, to another device, gets a fresh helper and goes through
    switch.switch({"0000:0b:00.0": "vfio-pci"})
    assert kernel.driver_of("0000:0b:00.0") == "vfio-pci"
    os.kill(child, 9)


def test_an_unbind_that_returns_after_the_timeout_is_not_followed_by_a_probe(kernel):
    kernel.hang_unbind.add("nvidia")
    switch = switcher(kernel, timeout=0.2)
    before = set(threading.enumerate())
    with pytest.raises(SwitchHung):
        switch.switch({GPU: "vfio-pci"})
    kernel.release.set()  # the kernel lets go late; the abandoned thread finishes the unbind
    for abandoned in set(threading.enumerate()) - before:
        abandoned.join(5)
        assert not abandoned.is_alive(), abandoned
    assert kernel.driver_of(GPU) is None
    assert ("bus/pci/drivers_probe", GPU) not in kernel.writes


def test_the_hooks_fast_paths_look_where_the_host_roots_are() -> None:
    """The fast paths import nothing, so they spell this machine's roots again: the
    same ones Roots gives every host, holder source and hook session."""
    from charly_arbiter.host.sysfs import HOST_ROOTS
    from charly_arbiter.libvirt import hook as libvirt_hook
    from charly_arbiter.oci import hook as oci_hook

    assert Path(libvirt_hook.SYS_ROOT) == HOST_ROOTS.sys == Path(oci_hook.SYS_ROOT)
    assert Path(oci_hook.PROC_ROOT) == HOST_ROOTS.proc
