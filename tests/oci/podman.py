"""Real Podman containers through the installed OCI hook: the test bed of tests/oci
(its fixtures are conftest.py's) and of bench/bench_oci_hook.py.

Podman (Debian's, rootful, runc, cgroupfs, no systemd: ../shared/reference's
recipe) runs containers from a local root directory holding busybox; there is
no registry.  `podman_environment` takes an exclusive flock on
/tmp/charly-podman.lock, installs the OCI hook where Podman reads hooks when
no --hooks-dir is given (`/usr/share/containers/oci/hooks.d/charly-arbiter.json`,
the package's own file with its paths pointed at this checkout: `podman start`
by the arbiter must find it too), and puts back whatever was there at the end.

The PCI side is a simulated host (`sim:DIR` with `real_holders =
["container"]`): its GPUs' device nodes are real character devices under
DIR/dev, made with mknod as clones of a harmless misc device that no process
on this machine holds (btrfs-control, loop-control, ...).  A clone stands for
/dev/dri/cardN: a container given it gets its major:minor in its spec, as it
would a real GPU node's, and a process can open and hold it, as it would a
GPU's; what it is not is a GPU (there is none here).

The CLI under test is the checkout's (`python -m charly_arbiter` behind the
hook's wrapper) unless CHARLY_ARBITER_E2E_INSTALLED=1, in which case it is
the installed /usr/bin/charly-arbiter and the package's hook files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine import INSTALLED, REPO, HookedService, Unavailable, flocked, restored, run
from simhosts import audio, gpu, host

LOCK = Path("/tmp/charly-podman.lock")
HOOKS_DIR = Path("/usr/share/containers/oci/hooks.d")
HOOK_JSON = HOOKS_DIR / "charly-arbiter.json"
INSTALLED_CONFIG = Path("/etc/charly-arbiter/arbiter.toml")
INSTALLED_HOOK = Path("/usr/libexec/charly-arbiter/oci-hook")
PREFIX = "ca-test-"
PROGRAMS = {"podman": "/usr/bin/podman", "runc": "/usr/bin/runc", "busybox": "/bin/busybox"}
# Misc devices that are harmless to open and hold; the first free ones stand for GPU nodes.
CANDIDATES = (
    "/dev/btrfs-control",
    "/dev/loop-control",
    "/dev/cpu_dma_latency",
    "/dev/fuse",
    "/dev/net/tun",
)
# `podman run` as it works on these machines (crun fails on hybrid cgroups here).
RUN_OPTIONS = (
    "--runtime",
    "runc",
    "--cgroup-manager=cgroupfs",
    "--network=none",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
)
# Exits at once on SIGTERM (a shell as pid 1 ignores it otherwise); its sleeps do not
# inherit the GPU node.
IDLE = 'trap "exit 0" TERM; while :; do sleep 1 3<&- & wait $!; done'

CONFIG = """
host = "sim:{sim}"
state_dir = "{state}"
hook_log = "{hook_log}"

[timeouts]
lock_wait = 20
holder_stop = 10
holder_start = 30
holder_drain = 4
holder_ready = 20
driver_switch = 5
claim_grace = 3

[tokens.gpu0]
address = "0000:0a:00.0"

[tokens.gpu1]
address = "0000:0b:00.0"
cdi_devices = ["nvidia.com/gpu=1", "nvidia.com/gpu=all"]
"""


def log(message: str) -> None:
    print(f"[podman] {message}", file=sys.stderr, flush=True)


@dataclass
class Podman(HookedService):
    """Podman, the hook's configuration, and helpers for the tests."""

    rootfs: Path
    nodes: dict[str, Path]  # token -> its GPU node (a character device under sim_dir/dev)
    hook_program: Path  # the oci-hook the JSON file names

    def drivers(self) -> dict[str, str]:
        return {
            address: driver
            for token in self.status()["tokens"].values()
            for address, driver in token["drivers"].items()
        }

    def hook_lines(self) -> list[str]:
        return self.hook_log.read_text().splitlines() if self.hook_log.exists() else []

    def configure(self, extra: str = "") -> None:
        """The configuration the hook reads; `extra` is appended ([[holders]] tables)."""
        self.config_path.write_text(
            CONFIG.format(sim=self.sim_dir, state=self.state_dir, hook_log=self.hook_log) + extra
        )
        self.config_path.chmod(0o644)

    def claimant_stopped(self, ref: str) -> None:
        """A simulated claimant (a VM) stops, before its release."""
        from charly_arbiter.host.sim import SimHost

        SimHost(self.sim_dir).set_running(ref, False)

    # -- containers ---------------------------------------------------------------------

    def podman(self, *args: str, check: bool = True, timeout: float = 120) -> Any:
        return run([PROGRAMS["podman"], *args], check=check, timeout=timeout)

    def run(
        self,
        name: str,
        *,
        gpu: str | None = None,
        script: str = IDLE,
        detach: bool = True,
        remove: bool = False,
        annotations: dict[str, str] | None = None,
        global_options: tuple[str, ...] = (),
        options: tuple[str, ...] = RUN_OPTIONS,
        check: bool = True,
    ) -> Any:
        """`podman run` of a busybox container named PREFIX+name; `gpu` gives it that
        token's node as /dev/dri/card0."""
        argv = [*global_options, "run", "--name", PREFIX + name, *options]
        argv += ["-d"] if detach else []
        argv += ["--rm"] if remove else []
        if gpu is not None:
            argv += ["--device", f"{self.nodes[gpu]}:/dev/dri/card0"]
        for key, value in (annotations or {}).items():
            argv += ["--annotation", f"{key}={value}"]
        argv += ["--rootfs", str(self.rootfs), "/bin/sh", "-c", script]
        return self.podman(*argv, check=check)

    def state(self, name: str) -> str:
        """Podman's word for the container's state (running, exited, ...), "" if none."""
        result = self.podman(
            "container", "inspect", "--format", "{{.State.Status}}", PREFIX + name, check=False
        )
        return result.stdout.strip() if result.returncode == 0 else ""

    def pid(self, name: str) -> int:
        result = self.podman("container", "inspect", "--format", "{{.State.Pid}}", PREFIX + name)
        return int(result.stdout.strip())

    def names(self) -> list[str]:
        result = self.podman("ps", "-a", "--format", "{{.Names}}", check=False)
        return [line for line in result.stdout.split() if line.startswith(PREFIX)]

    def holds_node(self, name: str, token: str) -> bool:
        """Whether the container's processes have the token's node open (by number)."""
        from charly_arbiter.host.procscan import char_device_number, scan

        number = char_device_number(self.nodes[token])
        assert number is not None
        found = scan(Path("/proc"), (), numbers={number: str(self.nodes[token])})
        init = self.pid(name)
        return any(_in_container(item.pid, init) for item in found)

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 45) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if check():
                return time.monotonic() - started
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    def settle(self) -> None:
        """No detached release of this state directory runs any more."""
        from handoffs import detached_pids

        def quiet() -> bool:
            return not detached_pids(self.state_dir)

        self.wait_for("the detached releases to end", quiet)

    def clean(self) -> None:
        """No test container exists, and the ledger and sim state are fresh."""
        for name in self.names():
            self.podman("rm", "--force", "--time", "0", name, check=False)
        self.settle()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self.state_dir.mkdir(mode=0o700)
        for name in ("state.json", "state.lock", "log.jsonl"):
            (self.sim_dir / name).unlink(missing_ok=True)
        self.hook_log.unlink(missing_ok=True)
        self.configure()


def _in_container(pid: int, init: int) -> bool:
    """Whether `pid` is the container's init or shares its pid namespace."""
    try:
        return pid == init or os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(
            f"/proc/{init}/ns/pid"
        )
    except OSError:
        return False


def free_devices(count: int) -> list[os.stat_result]:
    """`count` harmless misc devices that exist and that no process holds open."""
    from charly_arbiter.host.procscan import char_device_number, scan

    found = []
    for path in CANDIDATES:
        number = char_device_number(Path(path))
        if number is None:
            continue
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            continue
        if scan(Path("/proc"), (), numbers={number: path}):
            continue
        found.append(os.stat(path))
        if len(found) == count:
            return found
    raise Unavailable(f"fewer than {count} free misc devices among {', '.join(CANDIDATES)}")


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "the Podman tests need root"
    missing = [path for path in PROGRAMS.values() if not os.access(path, os.X_OK)]
    if missing:
        return f"missing {', '.join(missing)}: run scripts/setup (scripts/apt-packages.txt)"
    if INSTALLED and not os.access(INSTALLED_HOOK, os.X_OK):
        return f"CHARLY_ARBITER_E2E_INSTALLED=1 but {INSTALLED_HOOK} is not installed"
    return None


@contextlib.contextmanager
def podman_environment(work: Path) -> Iterator[Podman]:
    """The hook installed, a simulated host with real GPU-node stand-ins, under the lock."""
    os.chmod(work, 0o700)
    sim_dir, state_dir = work / "host", work / "state"
    (sim_dir / "dev" / "dri").mkdir(parents=True)
    rootfs = work / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "tmp").mkdir(mode=0o1777)
    shutil.copy(PROGRAMS["busybox"], rootfs / "bin" / "busybox")
    (rootfs / "bin" / "sh").symlink_to("busybox")
    with flocked(LOCK, "another Podman test session"):
        nodes = {}
        for token, device in zip(("gpu0", "gpu1"), free_devices(2), strict=True):
            node = sim_dir / "dev" / "dri" / f"card-{token}"
            os.mknod(node, 0o600 | 0o020000, device.st_rdev)
            nodes[token] = node
        (sim_dir / "host.toml").write_text(
            host(
                gpu("0000:0a:00.0", group=12, extra=f'nodes = ["dri/{nodes["gpu0"].name}"]'),
                audio("0000:0a:00.1", group=12),
                gpu("0000:0b:00.0", group=13, model="2204", extra='nodes = ["dri/card-gpu1"]'),
                real_holders=["container"],
            )
        )
        hook_log = work / "hook.log"
        if INSTALLED:
            cli_argv = ["/usr/bin/charly-arbiter"]
            config_path = INSTALLED_CONFIG
            hook_program = INSTALLED_HOOK
        else:
            config_path = work / "arbiter.toml"
            wrapper = work / "charly-arbiter"
            wrapper.write_text(
                "#!/bin/sh\n"
                f"export CHARLY_ARBITER_CONFIG='{config_path}' PYTHONPATH='{REPO}'\n"
                f"exec '{sys.executable}' -m charly_arbiter \"$@\"\n"
            )
            wrapper.chmod(0o755)
            hook_program = work / "oci-hook"
            hook_program.write_text(
                (REPO / "hooks" / "oci-hook")
                .read_text()
                .replace("/usr/bin/charly-arbiter", str(wrapper))
            )
            hook_program.chmod(0o755)
            cli_argv = [sys.executable, "-m", "charly_arbiter"]
        env = Podman(
            work, sim_dir, state_dir, config_path, hook_log, cli_argv, rootfs, nodes, hook_program
        )
        backups = [HOOK_JSON] if not INSTALLED else [INSTALLED_CONFIG]
        created_dir = not HOOKS_DIR.exists()
        with restored(*backups):
            if INSTALLED:
                if not HOOK_JSON.is_file():
                    raise Unavailable(f"the installed package did not install {HOOK_JSON}")
                INSTALLED_CONFIG.parent.mkdir(parents=True, exist_ok=True)
            else:
                HOOKS_DIR.mkdir(parents=True, exist_ok=True)
                HOOK_JSON.write_text(
                    (REPO / "hooks" / "charly-arbiter.json")
                    .read_text()
                    .replace("/usr/libexec/charly-arbiter/oci-hook", str(hook_program))
                )
            env.clean()
            log(f"Podman with the hook {HOOK_JSON} ({'installed' if INSTALLED else 'checkout'})")
            try:
                yield env
            finally:
                env.clean()
        if created_dir:
            with contextlib.suppress(OSError):
                HOOKS_DIR.rmdir()
                HOOKS_DIR.parent.rmdir()
