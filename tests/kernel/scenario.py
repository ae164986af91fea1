"""Runs INSIDE the QEMU guest (host's /usr/bin/python3, this checkout on PYTHONPATH).

Drives the real `charly-arbiter` CLI against the guest kernel's sysfs, with
0000:00:02.0 (bochs-drm) and 0000:00:02.1 (snd_hda_intel) as one token, and
writes what it saw to /run/results/results.json for the host-side tests to
judge.  Nothing here asserts: each step records facts (exit codes, messages,
drivers, nodes, timings) and goes on, so one failure does not hide the rest.

Usage: scenario.py KERNEL_ROOT all [BENCH_CYCLES] | KERNEL_ROOT bench CYCLES [BLOCK]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

GPU = "0000:00:02.0"
AUDIO = "0000:00:02.1"
HOME = {GPU: "bochs-drm", AUDIO: "snd_hda_intel"}
SYS = Path("/sys/bus/pci")
RESULTS = Path("/run/results")
REPO = Path(__file__).resolve().parents[2]
CONFIG = """
host = "local"
state_dir = "{state}"
device_holder_policy = "{policy}"

[timeouts]
driver_switch = {switch_timeout}
holder_stop = 5
lock_wait = 30

[tokens.gpu]
address = "{gpu}"
# fbcon draws on bochs-drm's fb0 in this guest: the arbiter takes it off and back.
console = "{console}"
"""

# VFIO ioctls (linux/vfio.h): _IO(';', 100 + n)
VFIO_SET_IOMMU = 0x3B66
VFIO_GROUP_SET_CONTAINER = 0x3B68
VFIO_GROUP_GET_DEVICE_FD = 0x3B6A
VFIO_TYPE1_IOMMU = 1


def driver(address: str) -> str | None:
    try:
        return os.path.basename(os.readlink(SYS / "devices" / address / "driver"))
    except OSError:
        return None


def drivers() -> dict[str, str | None]:
    return {address: driver(address) for address in (GPU, AUDIO)}


def group() -> str:
    return os.path.basename(os.readlink(SYS / "devices" / GPU / "iommu_group"))


def wait_for(predicate: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def send_home_by_hand() -> None:
    """The bare sysfs sequence back to the home drivers (between scenarios)."""
    for address in (GPU, AUDIO):
        write(SYS / "devices" / address / "driver_override", "\n")
        if driver(address) not in (None, HOME[address]):
            write(SYS / "devices" / address / "driver" / "unbind", address)
        if driver(address) is None:
            write(SYS / "drivers_probe", address)
    wait_for(lambda: drivers() == HOME, 20)


def make_config(
    name: str, policy: str = "refuse", switch_timeout: float = 10, console: str = "release"
) -> Path:
    state = Path("/run") / f"state-{name}"
    state.mkdir(mode=0o700, exist_ok=True)
    path = Path("/run") / f"{name}.toml"
    path.write_text(
        CONFIG.format(
            state=state, policy=policy, switch_timeout=switch_timeout, gpu=GPU, console=console
        )
    )
    return path


def cli_argv(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "charly_arbiter", "--config", str(config), *args]


def cli(config: Path, *args: str, timeout: float = 180) -> dict[str, Any]:
    started = time.monotonic()
    result = subprocess.run(
        cli_argv(config, *args), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    return {
        "rc": result.returncode,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "seconds": round(time.monotonic() - started, 3),
    }


def status(config: Path) -> dict[str, Any]:
    result = cli(config, "status", "--json")
    try:
        return {"rc": result["rc"], **json.loads(result["stdout"])}
    except ValueError:
        return result


def sleeper(stdin: Any = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["/bin/sleep", "600"], stdin=stdin)


# -- scenarios --------------------------------------------------------------------------


def scenario_detect(out: dict[str, Any]) -> None:
    config = make_config("detect")
    result = cli(config, "detect", "--json")
    out["detect_cli"] = {k: v for k, v in result.items() if k != "stdout"}
    out["detect"] = json.loads(result["stdout"])
    out["detect_text"] = cli(config, "detect")["stdout"]


def fbcon_bound() -> str:
    """fbcon's vtconsole: 1 while the framebuffer console draws (here on bochs's fb0)."""
    for vtcon in sorted(Path("/sys/class/vtconsole").iterdir()):
        if "frame buffer" in (vtcon / "name").read_text():
            return (vtcon / "bind").read_text().strip()
    return "none"


def scenario_console(out: dict[str, Any]) -> None:
    """The real framebuffer console on the GPU: refused by default, released on request."""
    claimant = sleeper()
    record: dict[str, Any] = {"fbcon_before": fbcon_bound()}
    out["console_scenario"] = record
    try:
        refused = cli(
            make_config("console-refuse", console="refuse"),
            "acquire",
            "--exclusive",
            f"process:{claimant.pid}",
            "gpu",
        )
        record["refused"] = {**refused, "drivers": drivers(), "fbcon": fbcon_bound()}
        config = make_config("console-release")
        acquired = cli(config, "acquire", "--exclusive", f"process:{claimant.pid}", "gpu")
        record["released"] = {**acquired, "drivers": drivers(), "fbcon": fbcon_bound()}
        home = cli(config, "release", "--force", f"process:{claimant.pid}")
        record["home"] = {
            **home,
            "drivers": drivers(),
            "fbcon": fbcon_bound(),
            "fb0": Path("/sys/class/graphics/fb0").exists(),
        }
    finally:
        claimant.kill()
        claimant.wait()
        send_home_by_hand()


def scenario_holder_refused(out: dict[str, Any]) -> None:
    config = make_config("refuse", policy="refuse")
    with open("/dev/dri/card0", "rb") as card:
        holder = sleeper(stdin=card)
    claimant = sleeper()
    try:
        result = cli(config, "acquire", "--exclusive", f"process:{claimant.pid}", "gpu")
        out["refused"] = {
            **result,
            "holder_pid": holder.pid,
            "holder_alive": holder.poll() is None,
            "drivers": drivers(),
        }
    finally:
        for process in (holder, claimant):
            process.kill()
            process.wait()


def scenario_holder_terminated_then_release(out: dict[str, Any]) -> None:
    config = make_config("terminate", policy="terminate")
    with open("/dev/dri/card0", "rb") as card:
        holder = sleeper(stdin=card)
    claimant = sleeper()
    node = Path("/dev/vfio") / group()
    try:
        result = cli(config, "acquire", "--exclusive", f"process:{claimant.pid}", "gpu")
        wait_for(lambda: holder.poll() is not None, 10)
        out["terminated"] = {
            **result,
            "holder_pid": holder.pid,
            "holder_returncode": holder.poll(),
            "drivers": drivers(),
            "vfio_node": str(node),
            "vfio_node_exists": node.exists(),
            "card0_exists": Path("/dev/dri/card0").exists(),
            "status": status(config),
        }
        result = cli(config, "release", "--force", f"process:{claimant.pid}")
        out["released"] = {
            **result,
            "drivers": drivers(),
            "card0_exists": Path("/dev/dri/card0").exists(),
            "vfio_node_exists": node.exists(),
            "status": status(config),
        }
    finally:
        for process in (holder, claimant):
            if process.poll() is None:
                process.kill()
            process.wait()
        send_home_by_hand()


def scenario_proxmox(out: dict[str, Any]) -> None:
    """The Proxmox hookscript (hooks/proxmox as a snippet) run by the qm stand-in of
    tests/proxmox, on this real kernel: pre-start moves the pair to the real
    vfio-pci before qemu-server's own PCI step (the stand-in records what it finds),
    post-stop (from the cleanup after "QEMU" ends) brings both functions home."""
    root = Path("/run/pve-node")
    for directory in ("pve/qemu-server", "pve/lxc", "run/qemu-server", "lock", "snippets", "bin"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    config = make_config("proxmox")
    config.write_text(
        f'hook_log = "{root}/hook.log"\n'
        + config.read_text()
        + f'\n[proxmox]\nconfig_dir = "{root}/pve"\nrun_dir = "{root}/run/qemu-server"\n'
        + f'lock_dir = "{root}/lock"\nqm = "{root}/bin/qm"\npct = "{root}/bin/pct"\n'
    )
    standin = REPO / "tests" / "proxmox" / "pve_standin.py"
    for program in ("qm", "pct"):
        write(
            root / "bin" / program,
            f'#!/bin/sh\nexec {sys.executable} {standin} {root} {program} "$@"\n',
        )
        (root / "bin" / program).chmod(0o755)
    wrapper = root / "bin" / "charly-arbiter"
    write(
        wrapper,
        f"#!/bin/sh\nexport CHARLY_ARBITER_CONFIG={config} PYTHONPATH={REPO}\n"
        f'exec {sys.executable} -m charly_arbiter "$@"\n',
    )
    wrapper.chmod(0o755)
    hookscript = (REPO / "hooks" / "proxmox").read_text()
    write(
        root / "snippets" / "charly-arbiter.sh",
        hookscript.replace("/usr/bin/charly-arbiter", str(wrapper)),
    )
    (root / "snippets" / "charly-arbiter.sh").chmod(0o755)
    write(
        root / "pve" / "qemu-server" / "100.conf",
        "hookscript: local:snippets/charly-arbiter.sh\nhostpci0: 00:02,pcie=1,x-vga=1\nname: vm\n",
    )
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}

    def qm(*args: str) -> dict[str, Any]:
        started = time.monotonic()
        result = subprocess.run(
            [str(root / "bin" / "qm"), *args], capture_output=True, text=True, env=env, timeout=180
        )
        return {
            "rc": result.returncode,
            "stderr": result.stderr,
            "seconds": round(time.monotonic() - started, 2),
        }

    from charly_arbiter.core.ledger import Ledger

    def leases() -> list[dict[str, Any]]:
        state = Ledger(Path("/run/state-proxmox")).read()
        return [{"claimant": str(x.claimant), "mode": str(x.mode)} for x in state.leases]

    try:
        started = qm("start", "100")
        out["proxmox_start"] = {**started, "drivers": drivers(), "leases": leases()}
        stopped = qm("stop", "100")
        home = wait_for(lambda: drivers() == HOME, 60)
        leases_gone = wait_for(lambda: leases() == [], 30)
        post_stop = root / "standin.log"
        wait_for(lambda: "hookscript 100 post-stop" in post_stop.read_text(), 30)
        out["proxmox_stop"] = {
            **stopped,
            "home": home,
            "leases_gone": leases_gone,
            "drivers": drivers(),
        }
        for name in ("standin.log", "hook.log", "standin.times"):
            log = root / name
            key = "proxmox_" + name.replace(".", "_")
            out[key] = log.read_text().splitlines() if log.exists() else []
    finally:
        send_home_by_hand()


def scenario_failed_switch_poisons(out: dict[str, Any], kernel_root: str) -> None:
    """A real failure: snd_hda_intel is unloaded while the token sits on vfio-pci,
    so going home finds no driver for 02.1 (drivers_probe still succeeds)."""
    config = make_config("fail")
    claimant = sleeper()
    try:
        acquired = cli(config, "acquire", "--exclusive", f"process:{claimant.pid}", "gpu")
        rmmod = subprocess.run(["/sbin/rmmod", "snd_hda_intel"], capture_output=True, text=True)
        result = cli(config, "release", "--force", f"process:{claimant.pid}")
        out["failed_switch"] = {
            **result,
            "acquire_rc": acquired["rc"],
            "acquire_stderr": acquired["stderr"],
            "rmmod_rc": rmmod.returncode,
            "drivers": drivers(),
            "status": status(config),
            "doctor": cli(config, "doctor", "--json"),
        }
    finally:
        claimant.kill()
        claimant.wait()
        modprobe(kernel_root, "snd-hda-intel")
        send_home_by_hand()


# What QEMU does with an assigned device, reduced to the part that matters here:
# attach the group to a container, set the IOMMU type, and hold the device fd.
VM_PROGRAM = f"""
import fcntl, os, struct, sys, time
group, address, go, ready = sys.argv[1:5]
while not os.path.exists(go):
    time.sleep(0.05)
container = os.open("/dev/vfio/vfio", os.O_RDWR)
group_fd = os.open(f"/dev/vfio/{{group}}", os.O_RDWR)
fcntl.ioctl(group_fd, {VFIO_GROUP_SET_CONTAINER}, struct.pack("i", container))
fcntl.ioctl(container, {VFIO_SET_IOMMU}, {VFIO_TYPE1_IOMMU})
name = bytearray(address.encode() + b"\\0")
device = fcntl.ioctl(group_fd, {VFIO_GROUP_GET_DEVICE_FD}, name, True)
open(ready, "w").write(str(device))
time.sleep(600)
"""


def scenario_hung_switch_poisons(out: dict[str, Any]) -> None:
    """A real hang: a "VM" holds the vfio device open (as QEMU does), so unbinding
    vfio-pci blocks in the kernel until it lets go.  The watchdog must give up."""
    timeout = 3.0
    config = make_config("hang", switch_timeout=timeout)
    go, ready = Path("/run/vm-go"), Path("/run/vm-ready")
    vm = subprocess.Popen(
        [sys.executable, "-c", VM_PROGRAM, group(), GPU, str(go), str(ready)],
        stderr=subprocess.PIPE,
    )
    record: dict[str, Any] = {"switch_timeout": timeout}
    out["hung_switch"] = record
    try:
        record["acquire"] = cli(config, "acquire", "--exclusive", f"process:{vm.pid}", "gpu")
        go.touch()
        record["vm_opened_device"] = wait_for(ready.exists, 30)
        started = time.monotonic()
        release = subprocess.Popen(
            cli_argv(config, "release", "--force", f"process:{vm.pid}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        poisoned = wait_for(lambda: bool(poison_reasons("hang")), 120)
        record["poisoned_after"] = round(time.monotonic() - started, 3)
        record["poisoned"] = poisoned
        record["poison_reasons"] = poison_reasons("hang")
        record["drivers_while_hung"] = drivers()
        # The CLI has reported; does its process get to exit while the kernel is stuck?
        exited_early = wait_for(lambda: release.poll() is not None, 5)
        record["cli_exited_while_vm_held_device"] = exited_early
        vm.kill()
        vm.wait()
        stdout, stderr = release.communicate(timeout=120)
        record["cli_rc"] = release.returncode
        record["cli_stdout"] = stdout
        record["cli_stderr"] = stderr
        record["cli_finished_after"] = round(time.monotonic() - started, 3)
        record["status"] = status(config)
        record["drivers_after_vm_exit"] = drivers()
        record["doctor"] = cli(config, "doctor")
    finally:
        if vm.poll() is None:
            vm.kill()
            vm.wait()
        send_home_by_hand()


def poison_reasons(name: str) -> dict[str, str]:
    """Read the ledger the way `status` does, without starting another interpreter."""
    from charly_arbiter.core.ledger import Ledger

    reading = Ledger(Path("/run") / f"state-{name}").inspect()
    if reading.state is None:
        return {}
    return {token: poison.reason for token, poison in reading.state.poisoned}


# -- benchmark ----------------------------------------------------------------------------

BARE_CYCLE = """
for f in {gpu} {audio}; do
  echo vfio-pci > /sys/bus/pci/devices/$f/driver_override
  echo $f > /sys/bus/pci/devices/$f/driver/unbind
  echo $f > /sys/bus/pci/drivers_probe
done
for f in {gpu} {audio}; do
  echo > /sys/bus/pci/devices/$f/driver_override
  echo $f > /sys/bus/pci/devices/$f/driver/unbind
  echo $f > /sys/bus/pci/drivers_probe
done
"""


def bench(out: dict[str, Any], cycles: int, block: int = 5) -> None:
    """Time switching to vfio-pci and back: bare shell writes against charly-arbiter.

    The two alternate in blocks of `block` cycles, so that load on the machine
    running QEMU falls on both alike; the figures are per cycle (both functions
    to vfio-pci and back).  `host.switch` is the switching layer alone;
    acquire/release is the whole arbiter (ledger transactions with fsync, the
    /proc holder scan, the holder sources) around the same switch.
    """
    sys.path.insert(0, str(REPO))
    from charly_arbiter.core.arbiter import Arbiter
    from charly_arbiter.core.config import load_config
    from charly_arbiter.core.ledger import Ledger
    from charly_arbiter.core.model import Mode
    from charly_arbiter.host.local import LocalHost

    script = Path("/run/bare.sh")
    script.write_text(
        f"for i in $(seq {block}); do {BARE_CYCLE.format(gpu=GPU, audio=AUDIO)} done\n"
    )
    config = load_config(make_config("bench"), environ={})
    host = LocalHost(config)
    arbiter = Arbiter(config, host, Ledger(config.state_dir, 30))
    token = arbiter.tokens.all()["gpu"]
    to_vfio = {GPU: "vfio-pci", AUDIO: "vfio-pci"}
    claimant = sleeper()
    ref = f"process:{claimant.pid}"

    def bare_block() -> None:
        subprocess.run(["/bin/sh", str(script)], check=True)

    def switch_block() -> None:
        for _ in range(block):
            host.switch(token, to_vfio)
            host.switch(token, HOME)

    def arbiter_block() -> None:
        for _ in range(block):
            arbiter.acquire(ref, Mode.EXCLUSIVE, ["gpu"])
            # The sleeper stands in for QEMU and keeps running: release it as a hook would.
            arbiter.release_claimant(ref, force=True)

    for warm_up in (bare_block, switch_block, arbiter_block):
        warm_up()
    times: dict[str, list[float]] = {"bare": [], "switch": [], "arbiter": []}
    blocks = {"bare": bare_block, "switch": switch_block, "arbiter": arbiter_block}
    for _ in range(max(1, cycles // block)):
        for name, run in blocks.items():
            started = time.monotonic()
            run()
            times[name].append((time.monotonic() - started) / block)
    claimant.kill()
    claimant.wait()
    median = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    out["bench"] = {
        "cycles": block * len(times["bare"]),
        "block": block,
        "per_cycle_ms": {
            name: [round(v * 1000, 1) for v in values] for name, values in times.items()
        },
        "bare_ms": round(median["bare"] * 1000, 1),
        "host_switch_ms": round(median["switch"] * 1000, 1),
        "arbiter_ms": round(median["arbiter"] * 1000, 1),
        "host_switch_ratio": round(median["switch"] / median["bare"], 3),
        "arbiter_ratio": round(median["arbiter"] / median["bare"], 3),
        "drivers_after": drivers(),
    }


def modprobe(kernel_root: str, *modules: str) -> None:
    subprocess.run(["/sbin/modprobe", "-a", "-d", kernel_root, *modules], check=False)


def main() -> None:
    kernel_root, mode = sys.argv[1], sys.argv[2]
    out: dict[str, Any] = {"errors": {}}
    boot_started = float(Path("/proc/uptime").read_text().split()[0])
    modprobe(kernel_root, "bochs", "snd-hda-intel", "vfio-pci", "vfio_iommu_type1")
    out["home_bound"] = wait_for(lambda: drivers() == HOME, 30)
    out["initial_drivers"] = drivers()
    out["guest_uptime_at_start"] = boot_started
    steps: list[tuple[str, Any]]
    if mode == "bench":
        block = int(sys.argv[4]) if len(sys.argv) > 4 else 5
        steps = [("bench", lambda: bench(out, int(sys.argv[3]), block))]
    else:
        steps = [
            ("detect", lambda: scenario_detect(out)),
            ("console", lambda: scenario_console(out)),
            ("refused", lambda: scenario_holder_refused(out)),
            ("terminated", lambda: scenario_holder_terminated_then_release(out)),
            ("proxmox", lambda: scenario_proxmox(out)),
            ("failed_switch", lambda: scenario_failed_switch_poisons(out, kernel_root)),
            ("hung_switch", lambda: scenario_hung_switch_poisons(out)),
        ]
        if len(sys.argv) > 3:
            steps.append(("bench", lambda: bench(out, int(sys.argv[3]))))
    for name, step in steps:
        started = time.monotonic()
        try:
            step()
        except Exception:
            out["errors"][name] = traceback.format_exc()
        out.setdefault("step_seconds", {})[name] = round(time.monotonic() - started, 2)
        (RESULTS / "results.json").write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
