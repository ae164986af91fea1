"""Health after coming home (issue 11).  A GPU that went home but does not answer
(its configuration space reads all ones: it fell off the bus after a reset it did
not survive) or that the nvidia driver bound without initialising it (NVML does
not list it; NVML is the fake pynvml of fakenvml.py) is poisoned, with what to try."""

from __future__ import annotations

import sys

from fakenvml import FakeGpu, fake_pynvml

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Mode

GPU = "0000:0a:00.0"
AUDIO = "0000:0a:00.1"


def claim_and_release(host) -> Arbiter:
    arbiter = Arbiter(host.config, host, Ledger(host.config.state_dir, 5))
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    return arbiter


def test_a_gpu_that_does_not_answer_at_home_is_poisoned_with_what_to_try(make_host, kernel):
    host = make_host()
    arbiter = claim_and_release(host)
    config = kernel.device_dir(GPU).resolve() / "config"
    config.write_bytes(b"\xff" * 64)  # what a dead device answers to every read
    arbiter.release_claimant("libvirt:win11", force=True)
    poison = arbiter.ledger.read().poison_of("gpu0")
    assert poison is not None
    assert "0xffff" in poison.reason and "reset" in poison.reason
    assert kernel.driver_of(GPU) == "nvidia"  # bound, but of no use


def test_a_gpu_the_driver_bound_but_nvml_does_not_see_is_poisoned(make_host, kernel, monkeypatch):
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls, gpus=[]))
    host = make_host()
    arbiter = claim_and_release(host)
    arbiter.release_claimant("libvirt:win11", force=True)
    poison = arbiter.ledger.read().poison_of("gpu0")
    assert poison is not None and "NVML does not list the GPU" in poison.reason
    assert not host.nvml.is_open  # closed again: it holds /dev/nvidia* itself


def test_a_healthy_gpu_comes_home_unpoisoned(make_host, kernel, monkeypatch):
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls, [FakeGpu("00000000:0A:00.0")]))
    host = make_host()
    arbiter = claim_and_release(host)
    arbiter.release_claimant("libvirt:win11", force=True)
    assert arbiter.ledger.read().poisoned == ()
    assert (kernel.driver_of(GPU), kernel.driver_of(AUDIO)) == ("nvidia", "snd_hda_intel")
    assert "init" in calls  # NVML was asked


def test_without_nvml_the_config_space_check_alone_decides(make_host, kernel, monkeypatch):
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls, fail_init=True))
    host = make_host()
    arbiter = claim_and_release(host)
    arbiter.release_claimant("libvirt:win11", force=True)
    assert arbiter.ledger.read().poisoned == ()
