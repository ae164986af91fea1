"""`detect` over the fake tree; NVML through a fake `pynvml` put in sys.modules (the
outermost seam: the module the real library would be), and the real fallback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from fakenvml import FakeGpu, fake_pynvml
from fakesys import FakeDevice

from charly_arbiter.host.detect import amd_gfx_targets, detect, document, render
from charly_arbiter.host.nvml import Nvml, normalize_bus_id

GPU = "0000:0a:00.0"


def one_gpu(calls: list[str]):
    """The RTX 4090 at 0a:00.0 with a compute and a graphics process."""
    gpu = FakeGpu("00000000:0A:00.0", compute=[(4242, 2**30)], graphics=[(77, None)])
    return fake_pynvml(calls, [gpu])


def test_bus_ids_are_normalized():
    assert normalize_bus_id(b"00000000:0A:00.0") == "0000:0a:00.0"
    assert normalize_bus_id("00010000:01:00.0") == "10000:01:00.0"


def test_detect_uses_nvml_for_nvidia_and_closes_it(make_host, monkeypatch):
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", one_gpu(calls))
    result = detect(make_host())
    [gpu] = [g for g in result.gpus if g.address == GPU]
    assert (gpu.source, gpu.name, gpu.uuid) == ("nvml", "NVIDIA GeForce RTX 4090", "GPU-1234")
    assert gpu.memory_total == 24 * 2**30 and gpu.processes == (4242, 77)
    assert result.nvml == "used"
    assert calls[0] == "init" and calls[-1] == "shutdown"


def test_switch_closes_nvml_before_the_first_write(make_host, kernel, monkeypatch):
    events: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", one_gpu(events))
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


def test_detect_reports_reset_methods_and_foreign_group_members(tmp_path, make_host, kernel):
    """Each function's reset_method, and a GPU whose group holds a device that is not
    one of its functions (a NIC behind the same switch) is not viable (issue 11)."""
    kernel.add(FakeDevice("0000:0c:00.0", "8086", "15f3", "020000", None, "13", reset_method=""))
    result = detect(make_host())
    by_address = {f.address: f for f in result.functions}
    assert by_address[GPU].reset_method == "flr bus"
    assert by_address["0000:0c:00.0"].reset_method == ""
    [other] = [g for g in result.gpus if g.address == "0000:0b:00.0"]
    assert not other.viable
    assert any(
        "0000:0c:00.0" in why and "shares its IOMMU group" in why
        for why in other.not_viable_because
    )
    text = render(result)
    assert "reset flr/bus" in text and "no reset method" in text
    assert json.loads(json.dumps(document(result)))["functions"][0]["reset_method"] is not None


def test_doctor_warns_about_a_function_without_a_reset_method(make_host, kernel):
    from charly_arbiter.ops.doctor import Level, host_checks

    host = make_host()
    kernel_audio = kernel.device_dir("0000:0a:00.1").resolve() / "reset_method"
    kernel_audio.write_text("\n")
    checks = {c.name: c for c in host_checks(host.config, host, 2**30)}
    assert checks["reset gpu0"].level is Level.WARNING
    assert "0000:0a:00.1 cannot be reset" in checks["reset gpu0"].message
    kernel_audio.write_text("flr\n")
    checks = {c.name: c for c in host_checks(host.config, host, 2**30)}
    assert checks["reset gpu0"].level is Level.OK
