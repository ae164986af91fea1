"""The host layer on a real Linux kernel: Debian's 6.1 under QEMU/TCG (see guest.py).

One boot per module runs scenario.py inside the guest: the real `charly-arbiter`
CLI detects the GPU-shaped pair at 00:02.0/00:02.1 (bochs-drm + snd_hda_intel,
one IOMMU group), refuses or terminates a real process holding /dev/dri/card0,
moves both functions to the real vfio-pci and back, and meets two real
faults: a home driver that is gone (drivers_probe binds nothing; the switch
is undone and the token poisoned) and an unbind of vfio-pci that blocks in the
kernel because a "VM" holds the device open (the watchdog gives up, the token
is poisoned).  These tests judge what the guest recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from guest import Kernel, QemuUnavailable, boot, check_qemu, prepare_kernel, repo_mount_script

pytestmark = [pytest.mark.slow, pytest.mark.kernel]

REPO = Path(__file__).resolve().parents[2]
GPU = "0000:00:02.0"
AUDIO = "0000:00:02.1"
HOME = {GPU: "bochs-drm", AUDIO: "snd_hda_intel"}
VFIO = {GPU: "vfio-pci", AUDIO: "vfio-pci"}
BENCH_CYCLES = 10


def guest_script(kernel: Kernel, *args: str) -> str:
    return (
        "export PATH=/usr/sbin:/usr/bin:/sbin:/bin PYTHONDONTWRITEBYTECODE=1 HOME=/tmp\n"
        + repo_mount_script(REPO)
        + f"export PYTHONPATH={REPO}\n"
        f"/usr/bin/python3 {REPO}/tests/kernel/scenario.py {kernel.root} {' '.join(args)}\n"
    )


def run_guest(directory: Path, *args: str) -> dict[str, Any]:
    try:
        check_qemu()
    except QemuUnavailable as why:
        pytest.skip(f"QEMU CANNOT RUN HERE, the real-kernel tests are SKIPPED: {why}")
    kernel = prepare_kernel()
    booted = boot(kernel, directory, guest_script(kernel, *args), timeout=900, repo=REPO)
    results = directory / "results.json"
    console = (
        (directory / "console.log").read_text() if (directory / "console.log").exists() else ""
    )
    assert results.exists(), (
        f"the guest wrote no results (qemu exit {booted.returncode}):\n"
        f"{booted.serial[-3000:]}\n{console[-3000:]}"
    )
    recorded: dict[str, Any] = json.loads(results.read_text())
    recorded["boot_seconds"] = round(booted.seconds, 1)
    recorded["console"] = console
    recorded["serial"] = booted.serial
    print(f"guest run took {booted.seconds:.1f} s; steps: {recorded.get('step_seconds')}")
    return recorded


@pytest.fixture(scope="module")
def guest(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_guest(tmp_path_factory.mktemp("guest"), "all", str(BENCH_CYCLES))


def no_errors(guest: dict[str, Any], step: str) -> None:
    assert step not in guest["errors"], guest["errors"][step]


def test_guest_starts_with_the_home_drivers(guest):
    assert guest["home_bound"], guest["initial_drivers"]


def test_detect_sees_both_functions_in_one_group(guest):
    no_errors(guest, "detect")
    assert guest["detect_cli"]["rc"] == 0, guest["detect_cli"]["stderr"]
    functions = {f["address"]: f for f in guest["detect"]["functions"]}
    gpu, audio = functions[GPU], functions[AUDIO]
    assert gpu["iommu_group"] == audio["iommu_group"] is not None
    assert gpu["group_members"] == [AUDIO] and audio["group_members"] == [GPU]
    assert (gpu["driver"], audio["driver"]) == ("bochs-drm", "snd_hda_intel")
    assert gpu["class_label"] == "Display controller" and audio["class_label"] == "Audio device"
    assert "/dev/dri/card0" in gpu["nodes"]
    [display] = [g for g in guest["detect"]["gpus"] if g["address"] == GPU]
    assert display["viable"], display["not_viable_because"]
    assert display["source"] == "sysfs"
    vfio = guest["detect"]["vfio"]
    assert vfio["iommu_on"] and vfio["vfio_pci"] == "loaded"
    assert f"{GPU} 1234:" in guest["detect_text"]


def test_the_console_on_the_gpu_refuses_it_or_is_released_and_given_back(guest):
    """On the real kernel: fbcon draws on bochs-drm's fb0 (issue 11)."""
    no_errors(guest, "console")
    console = guest["console_scenario"]
    assert console["fbcon_before"] == "1"
    refused = console["refused"]
    assert refused["rc"] == 3 and "the text console runs on it (fb0)" in refused["stderr"]
    assert 'console = "release"' in refused["stderr"]
    assert refused["drivers"] == HOME and refused["fbcon"] == "1"
    released = console["released"]
    assert released["rc"] == 0, released["stderr"]
    assert set(released["drivers"].values()) == {"vfio-pci"}
    # Unbound, fbcon let go of the console; with its last framebuffer gone the kernel
    # unregisters it altogether (its vtconsole disappears) until a framebuffer returns.
    assert released["fbcon"] in ("0", "none")
    home = console["home"]
    assert home["rc"] == 0, home["stderr"]
    assert home["drivers"] == HOME and home["fbcon"] == "1" and home["fb0"]


def test_detect_says_the_emulated_functions_have_no_reset_method(guest):
    functions = {f["address"]: f for f in guest["detect"]["functions"]}
    assert functions[GPU]["reset_method"] == "" and functions[AUDIO]["reset_method"] == ""
    assert "no reset method" in guest["detect_text"]


def test_a_process_holding_card0_is_refused_by_default(guest):
    no_errors(guest, "refused")
    refused = guest["refused"]
    assert refused["rc"] == 3, refused["stderr"]
    message = refused["stderr"]
    assert f"process:{refused['holder_pid']}" in message
    assert "sleep has /dev/dri/card0 open" in message
    assert refused["holder_alive"]
    assert refused["drivers"] == HOME


def test_terminate_policy_kills_the_holder_and_moves_both_functions_to_vfio(guest):
    no_errors(guest, "terminated")
    done = guest["terminated"]
    assert done["rc"] == 0, done["stderr"]
    assert done["holder_returncode"] == -15  # SIGTERM was enough
    assert done["drivers"] == VFIO
    assert done["vfio_node_exists"], done["vfio_node"]
    assert not done["card0_exists"]
    assert done["status"]["tokens"]["gpu"]["mode"] == "exclusive"


def test_release_brings_both_drivers_back(guest):
    released = guest["released"]
    assert released["rc"] == 0, released["stderr"]
    assert released["drivers"] == HOME
    assert released["card0_exists"] and not released["vfio_node_exists"]
    assert released["status"]["leases"] == []


def test_the_proxmox_hookscript_moves_the_pair_and_brings_it_home(guest):
    """hooks/proxmox run by the qm stand-in (tests/proxmox/pve_standin.py), on this
    real kernel: pre-start moves both functions to the real vfio-pci before
    qemu-server's own PCI step looks at them; post-stop, run by the cleanup after
    the stand-in's QEMU process ends, sends both home."""
    no_errors(guest, "proxmox")
    start = guest["proxmox_start"]
    assert start["rc"] == 0, start["stderr"]
    assert start["drivers"] == VFIO
    leases = start["leases"]
    assert [(x["claimant"], x["mode"]) for x in leases] == [("proxmox:100", "exclusive")]
    print("\n".join(guest["proxmox_standin_times"] + guest["proxmox_hook_log"]))
    log = guest["proxmox_standin_log"]
    pre_start = next(
        i for i, line in enumerate(log) if line.endswith("hookscript 100 pre-start rc=0")
    )
    found = [line.split(" ", 1)[1] for line in log[pre_start:] if "qemu-server finds" in line]
    assert found == [
        f"qemu-server finds {GPU} on vfio-pci",
        f"qemu-server finds {AUDIO} on vfio-pci",
    ], log
    stop = guest["proxmox_stop"]
    assert stop["rc"] == 0, stop["stderr"]
    assert stop["home"] and stop["leases_gone"], (stop, guest["proxmox_hook_log"])
    assert stop["drivers"] == HOME
    assert any(line.endswith("hookscript 100 post-stop rc=0") for line in log), log
    # The start watcher left the start alone: it reached post-start (the stop that came
    # right after may have taken the VM's lock first).
    assert not any("did not start" in line for line in guest["proxmox_hook_log"])


def test_a_failed_switch_is_undone_and_poisons_the_token(guest):
    no_errors(guest, "failed_switch")
    failed = guest["failed_switch"]
    assert failed["acquire_rc"] == 0, failed["acquire_stderr"]
    assert failed["rmmod_rc"] == 0
    token = failed["status"]["tokens"]["gpu"]
    assert token["poisoned"]
    assert f"{AUDIO}: switching to snd_hda_intel failed at verify" in token["reason"]
    assert "no driver took the device" in token["reason"]
    # all or none: the GPU function that had reached bochs-drm went back to vfio-pci
    assert failed["drivers"] == VFIO
    assert failed["doctor"]["rc"] == 1
    checks = json.loads(failed["doctor"]["stdout"])["checks"]
    assert any(c["name"] == "poison gpu" and c["level"] == "problem" for c in checks)


def test_a_hanging_unbind_is_given_up_on_and_poisons_the_token(guest):
    no_errors(guest, "hung_switch")
    hung = guest["hung_switch"]
    assert hung["vm_opened_device"]
    assert hung["poisoned"], hung.get("cli_stderr")
    [reason] = hung["poison_reasons"].values()
    assert reason == (
        f"{GPU}: switching to bochs-drm failed at unbind: the write did not return within 3 s"
    )
    # The kernel really blocked: 02.0 was unbound only when the VM let go, and
    # nothing more was written to it (no probe): it stays without a driver.
    assert hung["drivers_while_hung"][AUDIO] == "vfio-pci"
    assert hung["drivers_after_vm_exit"] == {GPU: None, AUDIO: "vfio-pci"}
    assert "did not return within 3 s" in hung["cli_stderr"]
    # The write was made by a child process: the CLI itself exits while the VM
    # still holds the device (a stuck thread would have kept it until then).
    assert hung["cli_exited_while_vm_held_device"], hung["cli_finished_after"]
    assert "poison gpu" in hung["doctor"]["stdout"] and hung["doctor"]["rc"] == 1


def test_benchmark_numbers_are_recorded(guest):
    no_errors(guest, "bench")
    bench = guest["bench"]
    assert bench["cycles"] == BENCH_CYCLES
    assert bench["drivers_after"] == HOME
    print(json.dumps(bench, indent=1))
    # A loose bound that still catches a switch path gone badly wrong (sleeps, rescans).
    assert bench["host_switch_ratio"] < 3, bench


def test_no_kernel_oops_or_warning(guest):
    console = guest["serial"]
    for marker in ("Oops", "BUG:", "WARNING: CPU", "Call Trace"):
        assert marker not in console, console[-4000:]
