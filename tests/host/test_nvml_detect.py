"""`detect` over the fake tree; NVML through a fake `pynvml` put in sys.modules (the
outermost seam: the module the real library would be), and the real fallback."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from fakesys import FakeDevice

from charly_arbiter.host.detect import amd_gfx_targets, detect, document, render
from charly_arbiter.host.nvml import Nvml, normalize_bus_id

GPU = "0000:0a:00.0"


def fake_pynvml(calls: list[str]) -> types.ModuleType:
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def record(name, value=None):
        def call(*args):
            calls.append(name)
            return value

        return call

    handle = object()
    module.NVMLError = NVMLError
    module.nvmlInit = record("init")
    module.nvmlShutdown = record("shutdown")
    module.nvmlDeviceGetCount = record("count", 1)
    module.nvmlDeviceGetHandleByIndex = record("handle", handle)
    module.nvmlDeviceGetPciInfo = record("pci", types.SimpleNamespace(busId=b"00000000:0A:00.0"))
    module.nvmlDeviceGetName = record("name", "NVIDIA GeForce RTX 4090")
    module.nvmlDeviceGetUUID = record("uuid", "GPU-1234")
    module.nvmlDeviceGetMemoryInfo = record("memory", types.SimpleNamespace(total=24 * 2**30))
    module.nvmlDeviceGetComputeRunningProcesses = record(
        "compute", [types.SimpleNamespace(pid=4242, usedGpuMemory=2**30)]
    )
    module.nvmlDeviceGetGraphicsRunningProcesses = record(
        "graphics", [types.SimpleNamespace(pid=77, usedGpuMemory=None)]
    )
    return module


def test_bus_ids_are_normalized():
    assert normalize_bus_id(b"00000000:0A:00.0") == "0000:0a:00.0"
    assert normalize_bus_id("00010000:01:00.0") == "10000:01:00.0"


def test_detect_uses_nvml_for_nvidia_and_closes_it(make_host, monkeypatch):
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls))
    result = detect(make_host())
    [gpu] = [g for g in result.gpus if g.address == GPU]
    assert (gpu.source, gpu.name, gpu.uuid) == ("nvml", "NVIDIA GeForce RTX 4090", "GPU-1234")
    assert gpu.memory_total == 24 * 2**30 and gpu.processes == (4242, 77)
    assert result.nvml == "used"
    assert calls[0] == "init" and calls[-1] == "shutdown"


def test_switch_closes_nvml_before_the_first_write(make_host, kernel, monkeypatch):
    events: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(events))
    host = make_host()
    writer = host.sysfs.writer
    host.sysfs.writer = lambda path, text: (events.append("write"), writer(path, text))[1]
    host.nvml.gpus()
    assert host.nvml.is_open
    from charly_arbiter.core.host import TokenSpec

    functions = tuple(host.token_functions("gpu0", GPU))
    host.switch(TokenSpec("gpu0", GPU, functions), {GPU: "vfio-pci"})
    assert events.index("shutdown") < events.index("write")
    assert not host.nvml.is_open


def test_without_the_module_detect_says_so_and_uses_sysfs(make_host, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    result = detect(make_host())
    [gpu] = [g for g in result.gpus if g.address == GPU]
    assert gpu.source == "sysfs" and gpu.uuid is None
    assert "nvidia-ml-py" in result.nvml and "sysfs" in result.nvml
    assert "[10de:2684]" in gpu.name


def test_real_pynvml_without_the_driver_library_falls_back():
    """The installed nvidia-ml-py, for real, on a machine without libnvidia-ml."""
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed for this python")
    nvml = Nvml()
    if nvml.open():
        nvml.close()
        pytest.skip("this machine has a working NVML; the fallback is not reachable here")
    assert nvml.error is not None and "NVML is not usable" in nvml.error
    assert nvml.gpus() == {}


def test_detect_reports_groups_nodes_labels_and_viability(make_host, kernel):
    result = detect(make_host())
    functions = {f.address: f for f in result.functions}
    gpu = functions[GPU]
    assert gpu.class_label == "VGA compatible controller" and gpu.vendor_name == "NVIDIA"
    assert gpu.iommu_group == "12"
    assert gpu.group_members == ("0000:00:01.0", "0000:0a:00.1")
    assert gpu.nodes == (str(kernel.dev / "dri" / "card1"),)
    assert functions["0000:0a:00.1"].class_label == "Audio device"
    viable = {g.address: g for g in result.gpus}
    assert viable[GPU].viable
    assert not viable["0000:0b:00.0"].viable
    assert "boot display" in viable["0000:0b:00.0"].not_viable_because[0]
    assert result.vfio.iommu_on and result.vfio.iommu_groups == 3
    assert result.vfio.vfio_pci == "loaded" and result.vfio.vfio_container
    json.dumps(document(result))
    text = render(result)
    assert "0000:0a:00.0 10de:2684 VGA compatible controller" in text
    assert "NOT viable for passthrough: 0000:0b:00.0 is the boot display" in text


def test_a_storage_controller_in_the_group_makes_it_not_viable(make_host, kernel):
    kernel.add(FakeDevice("0000:0a:00.2", "1022", "7901", "010601", "ahci", "12"))
    [gpu] = [g for g in detect(make_host()).gpus if g.address == GPU]
    assert not gpu.viable
    assert "0000:0a:00.2 in its group is a storage controller" in gpu.not_viable_because[0]


def test_vfio_node_is_reported_once_the_gpu_is_on_vfio(make_host, kernel):
    host = make_host()
    from charly_arbiter.core.host import TokenSpec

    functions = tuple(host.token_functions("gpu0", GPU))
    host.switch(TokenSpec("gpu0", GPU, functions), {f.address: "vfio-pci" for f in functions})
    [gpu] = [g for g in detect(host).gpus if g.address == GPU]
    assert gpu.vfio_node == str(kernel.dev / "vfio" / "12") and gpu.vfio_node_accessible
    info = {f.address: f for f in detect(host).functions}[GPU]
    assert info.nodes == (str(kernel.dev / "vfio" / "12"),)


def test_amd_gfx_target_from_the_kfd_topology(tmp_path: Path):
    node = tmp_path / "class/kfd/kfd/topology/nodes"
    (node / "0").mkdir(parents=True)
    (node / "0" / "properties").write_text("cpu_cores_count 16\ngfx_target_version 0\n")
    (node / "1").mkdir()
    (node / "1" / "properties").write_text("gfx_target_version 110000\nlocation_id 768\ndomain 0\n")
    (node / "2").mkdir()
    (node / "2" / "properties").write_text("gfx_target_version 90010\nlocation_id 1032\ndomain 0\n")
    assert amd_gfx_targets(tmp_path) == {"0000:03:00.0": "gfx1100", "0000:04:01.0": "gfx90a"}


def test_memlock_is_compared_with_the_vm_size(make_host):
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    small = detect(make_host(), vm_memory=1).vfio
    assert small.memlock_enough
    if soft != resource.RLIM_INFINITY:
        assert not detect(make_host(), vm_memory=soft + 1).vfio.memlock_enough
