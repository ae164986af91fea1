"""A Proxmox VM starts through the hookscript, stops what holds its GPU, and gives
everything back on stop; refusals name the conflict.

Every step goes through the stand-in `qm`/`pct` (which run the hookscript as
qemu-server does: pre-start under the VM's lock before its own PCI binding,
pre-stop inside `qm shutdown`, post-stop from the cleanup that follows any end
of QEMU), the installed hooks/proxmox snippet and the real CLI, as processes.
I1-I3 (tests/invariants.py) are checked after each step.  conftest.py says
what is real and what stands in.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from invariants import assert_converged

from charly_arbiter.core.config import load_config
from charly_arbiter.hooksession import WATCH_START, Handoff
from tests.proxmox.conftest import Node, config_text

pytestmark = pytest.mark.slow

WIN11 = "proxmox:100"
LLM = "proxmox:101"
JELLYFIN = "lxc:200"
GPU0 = ("0000:0a:00.0", "0000:0a:00.1")
GPU1 = "0000:0b:00.0"


def on_vfio(node: Node, *addresses: str) -> bool:
    drivers = node.drivers()
    return all(drivers[address] == "vfio-pci" for address in addresses)


def at_home(node: Node) -> bool:
    drivers = node.drivers()
    return (drivers[GPU0[0]], drivers[GPU0[1]], drivers[GPU1]) == (
        "nvidia",
        "snd_hda_intel",
        "nvidia",
    )


def test_a_vm_stops_a_container_holding_its_gpu_and_gives_everything_back(node: Node) -> None:
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_ct(200, config_text("ct-200-jellyfin.conf"))
    node.pct("start", "200")
    expected = {JELLYFIN: True, WIN11: False}
    node.check("before", expected)

    node.qm("start", "100")
    assert node.running("proxmox", 100) and not node.running("lxc", 200)
    lease = node.leases()[WIN11]
    assert (lease.mode, lease.tokens) == ("exclusive", ("gpu0",))  # not the snapshot's gpu1
    assert [record.holder for record in lease.stopped] == [JELLYFIN]
    assert on_vfio(node, *GPU0) and node.drivers()[GPU1] == "nvidia"
    # qemu-server's own PCI preparation ran after pre-start and found nothing to bind.
    log = node.standin_log()
    assert any("finds 0000:0a:00.0 on vfio-pci already" in line for line in log), log
    assert not any("qemu-server binds" in line for line in log), log
    node.check("running", expected)

    node.qm("shutdown", "100")
    node.wait_for("the container back", lambda: node.running("lxc", 200))
    node.settle()
    assert node.leases() == {} and at_home(node)
    node.check("after", expected)


def test_a_vm_preempts_a_preemptible_vgpu_vm_which_gets_its_shared_lease_back(
    node: Node,
) -> None:
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_vm(101, config_text("vm-101-llm-mdev.conf"))
    node.qm("start", "101")
    assert node.leases()[LLM].mode == "shared" and at_home(node)  # an mdev keeps nvidia
    expected = {LLM: True}

    node.qm("start", "100")
    assert node.running("proxmox", 100) and not node.running("proxmox", 101)
    assert list(node.leases()) == [WIN11]
    record = node.leases()[WIN11].stopped[0]
    assert (record.holder, record.shared_tokens) == (LLM, ("gpu0",))
    # The holder's own hookscript ran nested: pre-stop inside `qm shutdown 101`
    # (which the arbiter ran from VM 100's pre-start), post-stop from its cleanup.
    log = node.standin_log()
    assert any(line.endswith("hookscript 101 pre-stop rc=0") for line in log), log
    node.check("running", expected)

    node.qm("stop", "100")
    node.wait_for("the vGPU VM back", lambda: node.running("proxmox", 101))
    node.settle()
    assert list(node.leases()) == [LLM] and node.leases()[LLM].mode == "shared"
    assert at_home(node)
    node.check("after", expected)
    # Its start by the arbiter ran its pre-start nested: it took nothing but its lease back.
    nested = [line for line in node.hook_log() if "proxmox:101 holds gpu0 (shared)" in line]
    assert len(nested) == 2, node.hook_log()


def test_a_second_vm_on_a_held_gpu_is_refused_naming_the_holder(node: Node) -> None:
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_vm(103, "name: audio\nhostpci0: 0a:00.1\nmemory: 2048\n")
    node.qm("start", "100")
    before = (node.state_dir / "ledger.toml").read_bytes()

    refused = node.qm("start", "103", check=False)
    assert refused.returncode != 0
    assert "hookscript error for 103 on pre-start" in refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.startswith("charly-arbiter: ")]
    assert len(lines) == 1, refused.stderr
    assert "proxmox:103" in lines[0] and "gpu0" in lines[0] and "proxmox:100" in lines[0]
    assert not node.running("proxmox", 103)
    assert (node.state_dir / "ledger.toml").read_bytes() == before
    assert not any("cleanup 103" in line for line in node.standin_log())
    node.check("refused", {WIN11: True})


@pytest.mark.parametrize(
    ("container", "token", "vm"),
    [
        ("ct-202-whisper.conf", "gpu1", "hostpci0: 0000:0b:00.0\n"),
        ("ct-201-ollama.conf", "gpu0", "hostpci0: 0000:0a:00\n"),
    ],
    ids=["mount-entry-and-allow-rule", "allow-every-drm-node-and-dri-directory"],
)
def test_a_container_that_may_not_be_stopped_refuses_the_start(
    node: Node, container: str, token: str, vm: str
) -> None:
    vmid = container.split("-")[1]
    node.write_ct(int(vmid), config_text(container))
    node.pct("start", vmid)
    node.write_vm(104, "name: worker\n" + vm)

    refused = node.qm("start", "104", check=False)
    assert refused.returncode != 0
    line = next(item for item in refused.stderr.splitlines() if item.startswith("charly-arbiter: "))
    assert f"lxc:{vmid}" in line and token in line and "proxmox:104" in line, line
    assert "not preemptible" in line and "tag charly-preemptible" in line, line
    assert node.running("lxc", int(vmid)) and not node.running("proxmox", 104)
    assert node.leases() == {} and at_home(node)


def test_a_mapping_gets_the_device_qemu_server_chooses(node: Node) -> None:
    """Entry one of the pool is reserved by VM 100 (qemu-server's reservation file):
    the mapping's next entry is claimed, as qemu-server will take it."""
    node.write_mapping(config_text("pci.cfg"))
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_vm(105, "hostpci0: mapping=gpu-pool,pcie=1\nmachine: q35\nname: pool\n")
    node.qm("start", "100")
    node.qm("start", "105")
    assert node.leases()["proxmox:105"].tokens == ("gpu1",)
    assert on_vfio(node, GPU1)
    assert any("finds 0000:0b:00.0 on vfio-pci already" in line for line in node.standin_log())
    node.qm("stop", "105")
    node.qm("stop", "100")
    node.settle()
    assert node.leases() == {} and at_home(node)


def test_pending_changes_count_as_proxmox_applies_them(node: Node) -> None:
    """qemu-server applies [PENDING] before pre-start: hostpci1 there is claimed too.
    A hostpci line deleted while the VM runs goes at its stop (vm_stop_cleanup applies
    pending changes before post-stop runs): the VM's lease is still released."""
    node.write_mapping(config_text("pci.cfg"))
    path = node.write_vm(102, config_text("vm-102-mapping.conf"))
    node.qm("start", "102")
    assert node.leases()["proxmox:102"].tokens == ("gpu0", "gpu1")
    assert "[PENDING]" not in path.read_text()

    path.write_text(path.read_text() + "\n[PENDING]\ndelete: hostpci0,hostpci1\n")
    node.qm("shutdown", "102")
    node.settle()
    assert "hostpci" not in path.read_text()
    assert node.leases() == {} and at_home(node)


def test_a_start_that_fails_after_pre_start_gives_everything_back(node: Node) -> None:
    """QEMU does not come up after pre-start claimed: Proxmox runs no post-stop, so the
    hook's start watcher releases once the VM's lock is free and the VM does not run."""
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_ct(200, config_text("ct-200-jellyfin.conf"))
    node.pct("start", "200")
    (node.root / "run" / "100.fail-start").touch()
    failed = node.qm("start", "100", check=False)
    assert failed.returncode != 0 and "start failed" in failed.stderr
    node.wait_for("the container back", lambda: node.running("lxc", 200))
    node.wait_for("the lease to go", lambda: node.leases() == {})
    assert at_home(node)
    assert any("did not start after its pre-start claimed gpu0" in line for line in node.hook_log())
    node.check("after the failed start", {JELLYFIN: True})
    (node.root / "run" / "100.fail-start").unlink()
    node.qm("start", "100")  # a start that works keeps its lease: the watcher lets it be
    node.wait_for("the start watcher to end", lambda: not node.watchers())
    assert list(node.leases()) == [WIN11] and node.running("proxmox", 100)


def test_a_guest_crash_runs_post_stop_and_converges(node: Node) -> None:
    """kill -9 of QEMU: qmeventd's cleanup runs post-stop, which gives everything back."""
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_ct(200, config_text("ct-200-jellyfin.conf"))
    node.pct("start", "200")
    node.qm("start", "100")
    os.kill(node.guest_pid("proxmox", 100), signal.SIGKILL)
    node.wait_for("the container back", lambda: node.running("lxc", 200))
    node.settle()
    assert node.leases() == {} and at_home(node)
    assert any("cleanup 100 begin clean=0" in line for line in node.standin_log())
    node.check("after the crash", {JELLYFIN: True})


@pytest.mark.parametrize("step", ["acquire.intent", "acquire.stop", "acquire.switch"])
def test_a_hookscript_killed_mid_pre_start_converges_on_restore(node: Node, step: str) -> None:
    """kill -9 of the hook inside pre-start: Proxmox aborts the start (the hookscript
    failed) and runs no post-stop; `restore --stranded` brings everything back."""
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_ct(200, config_text("ct-200-jellyfin.conf"))
    node.pct("start", "200")
    failed = node.qm("start", "100", check=False, CHARLY_ARBITER_CRASH_AT=step)
    assert failed.returncode != 0 and "got signal 9" in failed.stderr, failed.stderr
    assert not node.running("proxmox", 100)
    node.check(f"killed at {step}", {JELLYFIN: True})

    node.cli("restore", "--stranded")
    state = node.ledger()
    facts = node.facts({JELLYFIN: True})
    assert_converged(
        state,
        facts,
        {**{a: h for a, h in zip(GPU0, ("nvidia", "snd_hda_intel"), strict=True)}, GPU1: "nvidia"},
        [JELLYFIN],
    )
    second = node.cli("restore", "--stranded")
    assert node.ledger() == state, second.stderr
    node.qm("start", "100")  # and the VM starts normally afterwards
    assert on_vfio(node, *GPU0)


def test_two_vms_started_at_once_for_one_gpu_one_wins(node: Node) -> None:
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_vm(103, "name: audio\nhostpci0: 0a:00.1\n")
    results: dict[str, subprocess.CompletedProcess[str]] = {}

    def start(vmid: str) -> None:
        results[vmid] = node.qm("start", vmid, check=False)

    threads = [threading.Thread(target=start, args=(vmid,)) for vmid in ("100", "103")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    codes = sorted(result.returncode for result in results.values())
    assert codes[0] == 0 and codes[1] != 0, {k: r.stderr for k, r in results.items()}
    winner = next(vmid for vmid, result in results.items() if result.returncode == 0)
    assert list(node.leases()) == [f"proxmox:{winner}"]
    node.check("after the race", {f"proxmox:{winner}": True})


def test_preemption_refuse_never_stops_another_vm(node: Node) -> None:
    with node.config_path.open("a") as handle:
        handle.write('preemption = "refuse"\n')  # the last table is [proxmox]
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_vm(101, config_text("vm-101-llm-mdev.conf"))
    node.qm("start", "101")
    refused = node.qm("start", "100", check=False)
    assert refused.returncode != 0
    line = next(item for item in refused.stderr.splitlines() if item.startswith("charly-arbiter: "))
    assert "proxmox:101" in line and "qm shutdown" in line, line
    assert node.running("proxmox", 101) and list(node.leases()) == [LLM]


def cgroup2_root() -> Path | None:
    """Where a cgroup v2 hierarchy is mounted writable (alone, or beside v1)."""
    for candidate in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (candidate / "cgroup.controllers").exists() and os.access(candidate, os.W_OK):
            return candidate
    return None


@pytest.fixture
def container_cgroup(node: Node) -> Iterator[Path]:
    """A real cgroup `…/lxc/200/ns`, where pve-container puts container 200's processes."""
    root = cgroup2_root()
    if root is None or os.geteuid() != 0:
        pytest.skip("needs root and a writable cgroup v2 hierarchy")
    base = root / f"charly-arbiter-test-{os.getpid()}-{id(node)}"
    leaf = base / "lxc" / "200" / "ns"
    leaf.mkdir(parents=True)
    yield leaf
    for pid in (leaf / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)
    for directory in (leaf, leaf.parent, leaf.parent.parent, base):
        for _ in range(50):
            try:
                directory.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_process_of_the_container_holding_the_node_is_stopped_with_it(
    node: Node, container_cgroup: Path
) -> None:
    """The container's transcoder holds /dev/dri/renderD128 open (a real open file of
    a real process, in the container's real cgroup): it is the container's, which is
    stopped, not a stray process that refuses the claim.  The same process outside
    the container's cgroup refuses it."""
    from tests.oci.podman import Unavailable, free_devices

    try:
        device = free_devices(1)[0]
    except Unavailable as why:
        pytest.skip(str(why))
    render = node.sim_dir / "dev" / "dri" / "renderD128"
    render.unlink()
    os.mknod(render, 0o600 | stat.S_IFCHR, device.st_rdev)  # an openable node nobody holds
    (node.root / "run" / "200.holds").write_text(str(render))
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_ct(200, config_text("ct-200-jellyfin.conf"))

    node.pct("start", "200")  # its process outside the container's cgroup
    refused = node.qm("start", "100", check=False)
    assert refused.returncode != 0
    line = next(item for item in refused.stderr.splitlines() if item.startswith("charly-arbiter: "))
    assert str(node.guest_pid("lxc", 200)) in line and "renderD128" in line, line
    node.pct("stop", "200")
    node.settle()

    (node.root / "run" / "200.cgroup").write_text(str(container_cgroup))
    node.pct("start", "200")
    pid = node.guest_pid("lxc", 200)
    assert "/lxc/200/ns" in Path(f"/proc/{pid}/cgroup").read_text()
    node.qm("start", "100")
    assert [record.holder for record in node.leases()[WIN11].stopped] == [JELLYFIN]
    assert not node.running("lxc", 200) and on_vfio(node, *GPU0)
    node.qm("shutdown", "100")
    node.wait_for("the container back", lambda: node.running("lxc", 200))
    node.settle()
    assert node.leases() == {} and at_home(node)


def run_start_watcher(node: Node, created: str) -> None:
    """The hook's start watcher (`_watch-start`) with the hand-off pre-start gives it."""
    config = load_config(node.config_path, state_dir=node.state_dir, host=f"sim:{node.sim_dir}")
    handoff = Handoff.of(config, WIN11, created=created)
    result = subprocess.run(
        [sys.executable, "-m", "charly_arbiter", WATCH_START, handoff.to_json()],
        env=node.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_the_start_watcher_takes_only_a_start_that_never_reached_post_start(node: Node) -> None:
    """A stop right after a start can take the VM's lock before the watcher does: the
    VM then does not run and its post-stop has not run yet.  Played deterministically:
    qmeventd's part (the stand-in's watcher) is killed before QEMU, so no post-stop
    runs, and the watcher is run by hand: it leaves the lease of a start that reached
    post-start alone, and releases it once that note is gone."""
    node.write_vm(100, config_text("vm-100-win11.conf"))
    node.write_ct(200, config_text("ct-200-jellyfin.conf"))
    node.pct("start", "200")
    node.qm("start", "100")
    node.wait_for("the start watcher to end", lambda: not node.watchers())
    created = node.leases()[WIN11].created
    qemu = node.guest_pid("proxmox", 100)
    qmeventd = int(Path(f"/proc/{qemu}/stat").read_text().rpartition(")")[2].split()[1])
    os.kill(qmeventd, signal.SIGKILL)
    os.kill(qemu, signal.SIGKILL)
    node.wait_for("QEMU gone", lambda: not node.running("proxmox", 100))

    run_start_watcher(node, created)
    assert node.leases()[WIN11].state == "active"  # post-start ran: not a failed start
    assert not any("did not start" in line for line in node.hook_log())

    (node.state_dir / "proxmox-started" / "100").unlink()
    run_start_watcher(node, created)
    assert node.leases() == {} and at_home(node) and node.running("lxc", 200)
    assert any("did not start after its pre-start" in line for line in node.hook_log())
    node.qm("cleanup", "100", "0", "0")  # qmeventd's, late: finds nothing to release
    node.check("after", {JELLYFIN: True})
