"""MIG through NVML (host/nvml.py, the real use), against the fake `pynvml` of
fakenvml.py: NVIDIA's driver and libnvidia-ml cannot run here, so NVML's MIG calls
are modelled at the outermost seam, as NVML's API reference and NVIDIA's MIG user
guide describe them (see fakenvml.py).  What the arbiter reads (the mode, the MIG
devices by index with their instances, UUIDs and profiles) and what it does (the
mode; a layout: every compute and GPU instance destroyed, then a GPU instance per
profile with the compute instance that takes all of it), and NVML's refusals.
"""

from __future__ import annotations

import sys

import pytest
from fakenvml import FakeGpu, FakeMig, fake_pynvml

from charly_arbiter.core.host import MigChange
from charly_arbiter.errors import MigFailed, MigInvalid
from charly_arbiter.host.nvml import Nvml

GPU = "0000:0a:00.0"


@pytest.fixture
def gpu(monkeypatch) -> FakeGpu:
    found = FakeGpu(
        "00000000:0A:00.0", name="NVIDIA H100 80GB HBM3", uuid="GPU-abcd", mig=FakeMig()
    )
    other = FakeGpu("00000000:0B:00.0", uuid="GPU-ef01")
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], [other, found]))
    return found


def test_the_mode_and_a_layout_are_set_and_read_back_as_nvml_lists_them(gpu):
    nvml = Nvml()
    state = nvml.mig(GPU)
    assert state is not None and not state.enabled and state.instances == ()
    assert state.index == 1  # the GPU's NVML index: NVIDIA's CDI names say 1:N
    assert nvml.set_mig(GPU, MigChange(enabled=True)).enabled
    after = nvml.set_mig(GPU, MigChange(layout=("3g.40gb", "2g.20gb", "1g.10gb")))
    assert [(i.index, i.profile, i.gpu_instance, i.compute_instance) for i in after.instances] == [
        (0, "3g.40gb", 1, 0),
        (1, "2g.20gb", 2, 0),
        (2, "1g.10gb", 3, 0),
    ]
    assert after.instances[0].uuid == "MIG-abcd-1-0"
    # A new layout replaces the old one whole.
    again = nvml.set_mig(GPU, MigChange(layout=("7g.80gb",)))
    assert [(i.profile, i.gpu_instance) for i in again.instances] == [("7g.80gb", 1)]
    nvml.close()


def test_nvml_refuses_while_a_process_uses_the_gpu_and_says_so(gpu):
    gpu.compute.append((4242, 2**30))
    with pytest.raises(MigFailed) as failed:
        Nvml().set_mig(GPU, MigChange(enabled=True))
    assert "In use by another client" in str(failed.value)
    assert "every process must have let go" in (failed.value.hint or "")


def test_a_mode_that_waits_for_a_reset_is_a_failure_with_what_to_do(gpu):
    assert gpu.mig is not None
    gpu.mig.reset_needed = True
    with pytest.raises(MigFailed) as failed:
        Nvml().set_mig(GPU, MigChange(enabled=True))
    assert "pending" in str(failed.value)
    assert f"nvidia-smi -r -i {GPU}" in (failed.value.hint or "")


def test_what_the_gpu_cannot_have_is_refused(gpu):
    nvml = Nvml()
    with pytest.raises(MigInvalid, match="turn it on first"):
        nvml.set_mig(GPU, MigChange(layout=("1g.10gb",)))
    nvml.set_mig(GPU, MigChange(enabled=True))
    with pytest.raises(MigInvalid, match=r"no MIG profile 9g\.90gb"):
        nvml.set_mig(GPU, MigChange(layout=("9g.90gb",)))
    with pytest.raises(MigFailed, match="Insufficient Resources"):
        nvml.set_mig(GPU, MigChange(layout=("7g.80gb", "1g.10gb")))
    # A GPU without MIG: no state, and NVML's word for why.
    assert nvml.mig("0000:0b:00.0") is None and "Not Supported" in (nvml.error or "")


def test_the_local_host_in_compose_s_drains_says_why_a_gpu_has_no_mig(make_host):
    """`mig TOKEN` on a GPU without MIG says the local host's reason, also through the
    drains wrapper compose.open_host puts around every host (host/draining.Drained)."""
    from charly_arbiter.core.arbiter import Arbiter
    from charly_arbiter.core.config import TokenConfig
    from charly_arbiter.core.ledger import Ledger
    from charly_arbiter.core.migop import mig_state
    from charly_arbiter.host.draining import Drained

    host = make_host(tokens=(TokenConfig("igpu", "0000:0b:00.0"),))
    drained = Drained(host, host.config)
    arbiter = Arbiter(host.config, drained, Ledger(host.config.state_dir))
    with pytest.raises(MigInvalid, match=r"has no MIG mode \(it is no NVIDIA GPU\)"):
        mig_state(arbiter, "igpu")
