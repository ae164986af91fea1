"""NVIDIA hosts as they are, at the outermost seams (issue 11).

No NVIDIA driver runs here, so its three faces are modelled from its documented
behaviour: the nodes it creates (fake /dev files of the fake tree: `/dev/nvidiaN`
per GPU, whose N is the "Device Minor" of /proc/driver/nvidia/gpus/ADDR/information,
and the driver-wide `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`,
`nvidia-caps/*`), NVML's per-GPU process lists (the fake pynvml of fakenvml.py),
and nvidia-smi's persistence switch (a script that keeps the mode in a file, as
the daemon does per GPU).  The holders are real processes with those files open,
seen through FakeProc (their real /proc entries).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakenvml import FakeGpu, fake_pynvml
from fakesys import FakeDevice, FakeKernel, FakeProc

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import Config, Timeouts, TokenConfig
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import VFIO, Mode
from charly_arbiter.errors import ClaimRefused
from charly_arbiter.host.holders.nvidia import NvidiaPersistence
from charly_arbiter.host.local import LocalHost
from charly_arbiter.host.sysfs import Roots

GPU0, AUDIO0, GPU1 = "0000:0a:00.0", "0000:0a:00.1", "0000:41:00.0"
DRIVER_WIDE = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


@pytest.fixture
def nvidia_host(tmp_path: Path) -> FakeKernel:
    """Two NVIDIA GPUs on nvidia (minors 0 and 1), the nodes the driver makes."""
    kernel = FakeKernel(tmp_path / "k", loaded={"vfio-pci", "nvidia", "snd_hda_intel"})
    kernel.add(FakeDevice(GPU0, "10de", "2684", "030000", "nvidia", "12"))
    kernel.add(FakeDevice(AUDIO0, "10de", "22ba", "040300", "snd_hda_intel", "12"))
    kernel.add(FakeDevice(GPU1, "10de", "2684", "030000", "nvidia", "30"))
    for name in ("nvidia0", "nvidia1", *DRIVER_WIDE, "nvidia-caps/nvidia-cap1"):
        (kernel.dev / name).parent.mkdir(parents=True, exist_ok=True)
        (kernel.dev / name).touch()
    return kernel


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    proc = FakeProc(tmp_path / "proc")
    proc.nvidia_gpu(GPU0, 0)
    proc.nvidia_gpu(GPU1, 1)
    return proc


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def holding(
    kernel: FakeKernel,
    proc: FakeProc,
    started: list[subprocess.Popen[bytes]],
    *nodes: str,
    program: str = "/bin/sleep",
) -> subprocess.Popen[bytes]:
    """A real process with `nodes` of the fake /dev open (fds 3...)."""
    files = [open(kernel.dev / node, "rb") for node in nodes]
    try:
        process = subprocess.Popen([program, "60"], pass_fds=[f.fileno() for f in files])
    finally:
        for file in files:
            file.close()
    started.append(process)
    proc.show(process.pid)
    return process


def host_for(kernel: FakeKernel, proc: FakeProc, tmp_path: Path, **config: object) -> LocalHost:
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    fields: dict[str, object] = {
        "state_dir": state,
        "timeouts": Timeouts(driver_switch=1.0, holder_stop=2.0, lock_wait=5.0),
        "tokens": (TokenConfig("gpu0", GPU0), TokenConfig("gpu1", GPU1)),
        "process_policy": "refuse",
    }
    fields.update(config)
    return LocalHost(
        Config(**fields),  # type: ignore[arg-type]
        roots=Roots(sys=kernel.sys, proc=proc.root, dev=kernel.dev),
        writer=kernel.write,
        sources={},
        isolate_writes=False,
        load_module=kernel.modprobe,
    )


def claim(host: LocalHost, token: str = "gpu0") -> None:
    Arbiter(host.config, host, Ledger(host.config.state_dir, 5)).acquire(
        "libvirt:win11", Mode.EXCLUSIVE, [token]
    )


def test_a_process_holding_only_nvidiactl_and_uvm_refuses_the_claim(
    nvidia_host, proc, processes, tmp_path
):
    """Before: missed, so the unbind of nvidia would have hung and poisoned the GPU."""
    cuda = holding(nvidia_host, proc, processes, "nvidiactl", "nvidia-uvm")
    host = host_for(nvidia_host, proc, tmp_path)
    with pytest.raises(ClaimRefused) as refused:
        claim(host)
    message = str(refused.value)
    assert f"process:{cuda.pid}" in message and "sleep" in message and "nvidiactl" in message
    assert nvidia_host.driver_of(GPU0) == "nvidia"  # nothing was switched


@pytest.mark.parametrize("node", [*DRIVER_WIDE, "nvidia-caps/nvidia-cap1", "nvidia0"])
def test_every_nvidia_node_counts(nvidia_host, proc, processes, tmp_path, node):
    holder = holding(nvidia_host, proc, processes, node)
    host = host_for(nvidia_host, proc, tmp_path)
    refs = {h.ref for h in host.holders(list(_tokens(host)))}
    assert f"process:{holder.pid}" in refs


def test_the_other_gpus_own_node_does_not_hold_this_one(nvidia_host, proc, processes, tmp_path):
    holding(nvidia_host, proc, processes, "nvidia1")
    host = host_for(nvidia_host, proc, tmp_path)
    claim(host)  # gpu0: nvidia1 belongs to gpu1 only
    assert nvidia_host.driver_of(GPU0) == VFIO


def test_nvml_places_a_driver_wide_holder_on_another_gpu(
    nvidia_host, proc, processes, tmp_path, monkeypatch
):
    """A CUDA process that NVML lists on gpu1 only does not hold gpu0."""
    cuda = holding(nvidia_host, proc, processes, "nvidiactl", "nvidia-uvm", "nvidia1")
    gpus = [FakeGpu("00000000:0A:00.0"), FakeGpu("00000000:41:00.0", compute=[(cuda.pid, 2**30)])]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], gpus))
    host = host_for(nvidia_host, proc, tmp_path)
    claim(host, "gpu0")
    assert nvidia_host.driver_of(GPU0) == VFIO
    assert cuda.poll() is None  # untouched


def test_a_process_nvml_lists_on_the_gpu_holds_it_whatever_the_scan_saw(
    nvidia_host, proc, processes, tmp_path, monkeypatch
):
    """NVML's per-GPU lists are holders too (a process whose fds the scan cannot read,
    in another mount namespace with its own /dev, for example)."""
    quiet = holding(nvidia_host, proc, processes)  # no node open at all
    gpus = [FakeGpu("00000000:0A:00.0", graphics=[(quiet.pid, None)]), FakeGpu("00000000:41:00.0")]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], gpus))
    host = host_for(nvidia_host, proc, tmp_path)
    with pytest.raises(ClaimRefused, match=rf"process:{quiet.pid}.*context on 0000:0a:00\.0"):
        claim(host, "gpu0")
    assert nvidia_host.driver_of(GPU0) == "nvidia"


def test_persistenced_lets_go_of_the_claimed_gpu_only(nvidia_host, proc, processes, tmp_path):
    """nvidia-persistenced holds every GPU's node and the driver-wide ones: the claim
    turns persistence off for gpu0 alone (nvidia-smi -i 0000:0a:00.0 -pm 0) and back
    on at release; the daemon keeps running and gpu1 keeps its persistence."""
    daemon_program = tmp_path / "nvidia-persistenced"
    shutil.copy("/bin/sleep", daemon_program)
    daemon = holding(
        nvidia_host, proc, processes, "nvidia0", "nvidia1", "nvidiactl", program=str(daemon_program)
    )
    modes = tmp_path / "persistence"
    modes.mkdir()
    for address in (GPU0, GPU1):
        (modes / address).write_text("Enabled")
    smi = fake_nvidia_smi(tmp_path, modes, daemon, nvidia_host)
    host = host_for(nvidia_host, proc, tmp_path)
    host.persistence = NvidiaPersistence(host.config, nvidia_smi=str(smi))
    [holder] = [h for h in host.holders(list(_tokens(host))) if h.tokens == ("gpu0",)]
    assert holder.ref == f"nvidia-persistence:{GPU0}" and holder.preemptible
    arbiter = Arbiter(host.config, host, Ledger(host.config.state_dir, 5))
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert nvidia_host.driver_of(GPU0) == VFIO
    assert (modes / GPU0).read_text().strip() == "Disabled"
    assert (modes / GPU1).read_text().strip() == "Enabled"
    assert daemon.poll() is None
    arbiter.release_claimant("libvirt:win11", force=True)
    assert nvidia_host.driver_of(GPU0) == "nvidia"
    assert (modes / GPU0).read_text().strip() == "Enabled"
    assert arbiter.ledger.read().leases == ()


def fake_nvidia_smi(tmp_path: Path, modes: Path, daemon, kernel: FakeKernel) -> Path:
    """nvidia-smi's persistence switch: `-i ADDR -pm 0|1` sets the mode (and, for 0, the
    daemon closes that GPU's node: here it is simply no longer counted, since the real
    process cannot drop an fd from outside); `--query-gpu=persistence_mode -i ADDR`
    prints it; a GPU not on nvidia is unknown to it (exit 6, as nvidia-smi's "No devices
    were found")."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        f"""#!/bin/sh
for a in "$@"; do case "$prev" in -i) addr=$a;; -pm) mode=$a;; esac; prev=$a; done
drv=$(basename "$(readlink {kernel.sys}/bus/pci/devices/$addr/driver)" 2>/dev/null)
[ "$drv" = nvidia ] || exit 6
case "$mode" in
  0) echo Disabled > {modes}/$addr; mv {kernel.dev}/nvidia0 {kernel.dev}/.nvidia0 2>/dev/null;;
  1) echo Enabled > {modes}/$addr; mv {kernel.dev}/.nvidia0 {kernel.dev}/nvidia0 2>/dev/null;;
  *) cat {modes}/$addr;;
esac
"""
    )
    script.chmod(0o755)
    return script


def _tokens(host: LocalHost):
    from charly_arbiter.core.host import TokenSpec

    for token in host.config.tokens:
        yield TokenSpec(
            token.name, token.address, tuple(host.token_functions(token.name, token.address))
        )
