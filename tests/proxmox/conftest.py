"""A Proxmox VE node as far as the hookscript can meet one here.

What is real: the hookscript (hooks/proxmox, installed as a snippet), the
`charly-arbiter` CLI and every hook call as processes of their own, the
ledger, flocks, markers, kill -9; the guests' "QEMU" and container init are
real processes, and the configuration files are written the way Proxmox
writes them (tests/proxmox/configs/, each with the source it follows).
What stands in: `qm` and `pct` (pve_standin.py: qemu-server's and
pve-container's behaviour as read in their source: locks, hookscript phases,
its own vfio-pci binding, qmeventd's cleanup), and the PCI side, a simulated
host (`sim:DIR`, real_holders = proxmox and lxc) whose GPU nodes are real
character devices under DIR/dev of a major no driver has here, so no process
can hold them.  tests/kernel runs the hookscript's switch on a real kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from invariants import HostFacts, assert_invariants, sim_facts
from simhosts import audio, gpu, host

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import LedgerState
from charly_arbiter.host.sim import SimHost
from tests.conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).resolve().parent / "configs"
STANDIN = Path(__file__).resolve().parent / "pve_standin.py"
NODE = "pve1"
TOKENS = {"gpu0": ["0000:0a:00.0", "0000:0a:00.1"], "gpu1": ["0000:0b:00.0"]}
HOMES = {"0000:0a:00.0": "nvidia", "0000:0a:00.1": "snd_hda_intel", "0000:0b:00.0": "nvidia"}


def free_major() -> int:
    """A character major no driver has here (226, drm's, when free): nobody can open
    a node of it, so the simulated GPU nodes never have a process holding them."""
    text = Path("/proc/devices").read_text().partition("Block devices:")[0]
    taken = {int(line.split()[0]) for line in text.splitlines() if line.strip()[:1].isdigit()}
    for major in (226, *range(200, 240)):
        if major not in taken:
            return major
    raise RuntimeError("no free character major between 200 and 239")


@dataclass
class Node:
    """ROOT: pve/ (the cluster file system), run/, snippets/, bin/qm|pct, host/ (the
    simulated PCI side), state/ (the arbiter's), arbiter.toml."""

    root: Path
    major: int

    @property
    def config_path(self) -> Path:
        return self.root / "arbiter.toml"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def sim_dir(self) -> Path:
        return self.root / "host"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}
        return {
            **env,
            "CHARLY_ARBITER_CONFIG": str(self.config_path),
            "PYTHONPATH": str(REPO),
            **extra,
        }

    # -- guests --------------------------------------------------------------------------

    def write_vm(self, vmid: int, text: str, *, hookscript: bool = True) -> Path:
        """A VM's configuration, with the hookscript attached (`qm set VMID --hookscript
        local:snippets/charly-arbiter.sh`) unless told otherwise."""
        path = self.root / "pve" / "qemu-server" / f"{vmid}.conf"
        key = "hookscript: local:snippets/charly-arbiter.sh" if hookscript else ""
        path.write_text(with_key(text, key))
        return path

    def write_ct(self, vmid: int, text: str) -> Path:
        path = self.root / "pve" / "lxc" / f"{vmid}.conf"
        path.write_text(text.replace(" 226:", f" {self.major}:"))
        return path

    def write_mapping(self, text: str) -> None:
        (self.root / "pve" / "mapping" / "pci.cfg").write_text(text)

    def qm(self, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        return self._run("qm", args, check, env)

    def pct(self, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        return self._run("pct", args, check, env)

    def _run(
        self, program: str, args: tuple[str, ...], check: bool, env: dict[str, str]
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.root / "bin" / program), *args],
            capture_output=True,
            text=True,
            timeout=180,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", **env},
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{program} {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
            )
        return result

    def running(self, kind: str, vmid: int) -> bool:
        directory = "qemu-server" if kind == "proxmox" else "lxc"
        try:
            pid = int((self.root / "run" / directory / f"{vmid}.pid").read_text())
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, ValueError):
            return False
        return state not in ("Z", "X")

    def guest_pid(self, kind: str, vmid: int) -> int:
        directory = "qemu-server" if kind == "proxmox" else "lxc"
        return int((self.root / "run" / directory / f"{vmid}.pid").read_text())

    def standin_log(self) -> list[str]:
        path = self.root / "standin.log"
        return path.read_text().splitlines() if path.exists() else []

    def hook_log(self) -> list[str]:
        path = self.root / "hook.log"
        return path.read_text().splitlines() if path.exists() else []

    # -- the arbiter ---------------------------------------------------------------------

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_cli(args, self.env(), check=check, timeout=180)

    def status(self) -> dict[str, Any]:
        return json.loads(self.cli("status", "--json").stdout)  # type: ignore[no-any-return]

    def ledger(self) -> LedgerState:
        return Ledger(self.state_dir).read()

    def leases(self) -> dict[str, Any]:
        return {lease.claimant: lease for lease in self.ledger().leases}

    def drivers(self) -> dict[str, str]:
        return {a: d for a, d in SimHost(self.sim_dir).snapshot()["drivers"].items()}

    def facts(self, expected_running: dict[str, bool]) -> HostFacts:
        """I1-I3's facts: the simulated drivers, and which guests run (real processes)."""
        base = sim_facts(SimHost(self.sim_dir).snapshot(), TOKENS, ())
        running = {
            ref: self.running(ref.split(":")[0], int(ref.split(":")[1])) for ref in expected_running
        }
        return HostFacts(
            drivers=base.drivers,
            token_functions=TOKENS,
            running=running,
            expected_running=frozenset(
                ref for ref, expected in expected_running.items() if expected
            ),
        )

    def check(self, context: str, expected_running: dict[str, bool]) -> None:
        assert_invariants(self.ledger(), self.facts(expected_running), context)

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}\n" + "\n".join(self.hook_log()[-30:])
                )
            time.sleep(0.1)

    def settle(self) -> None:
        """Wait until every guest process that ended has had its cleanup (post-stop)
        and no release is under way (a detached one)."""

        def quiet() -> bool:
            lines = self.standin_log()
            ended = sum(1 for line in lines if " process " in line and " ended " in line)
            cleaned = sum(1 for line in lines if " cleanup " in line and line.endswith(" end"))
            busy = [lease for lease in self.ledger().leases if lease.state != "active"]
            return ended <= cleaned and not busy and not self.watchers()

        self.wait_for("the node to settle", quiet)

    def watchers(self) -> list[int]:
        """The hook's start watchers still waiting (proxmox/hookrun.py's watch_start)."""
        from handoffs import detached_pids

        from charly_arbiter.hooksession import WATCH_START

        return detached_pids(self.state_dir, (WATCH_START,))


def with_key(text: str, line: str) -> str:
    """`line` in its sorted place among the main section's keys, as write_vm_config
    writes them (description comments first, sections after)."""
    if not line:
        return text
    lines = text.splitlines()
    end = next((i for i, item in enumerate(lines) if item.startswith("[") or not item), len(lines))
    comments = [item for item in lines[:end] if item.startswith("#")]
    keys = sorted([item for item in lines[:end] if not item.startswith("#")] + [line])
    return "\n".join([*comments, *keys, *lines[end:]]) + "\n"


def config_text(name: str) -> str:
    """A configuration of tests/proxmox/configs/ (SOURCES.md says what each follows)."""
    return (CONFIGS / name).read_text()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    root = tmp_path / "node"
    for directory in (
        "pve/qemu-server",
        "pve/lxc",
        "pve/mapping",
        "run/qemu-server",
        "run/lxc",
        "snippets",
        "bin",
        "host/dev/dri",
    ):
        (root / directory).mkdir(parents=True)
    os.chmod(root, 0o700)
    (root / "nodename").write_text(f"{NODE}\n")
    major = free_major()
    nodes = {"gpu0": ("card0", 0, "renderD128", 128), "gpu1": ("card1", 1, "renderD129", 129)}
    for card, minor, render, render_minor in nodes.values():
        os.mknod(root / "host/dev/dri" / card, 0o600 | 0o020000, os.makedev(major, minor))
        os.mknod(root / "host/dev/dri" / render, 0o600 | 0o020000, os.makedev(major, render_minor))
    listed = {t: f'nodes = ["dri/{c}", "dri/{r}"]' for t, (c, _, r, _) in nodes.items()}
    (root / "host/host.toml").write_text(
        host(
            gpu("0000:0a:00.0", group=12, extra=listed["gpu0"]),
            audio("0000:0a:00.1", group=12),
            gpu("0000:0b:00.0", group=13, model="2204", extra=listed["gpu1"]),
            real_holders=["proxmox", "lxc"],
        )
    )
    (root / "arbiter.toml").write_text(
        f'host = "sim:{root / "host"}"\n'
        f'state_dir = "{root / "state"}"\n'
        f'hook_log = "{root / "hook.log"}"\n'
        "\n[timeouts]\nlock_wait = 20\ndriver_switch = 2\nclaim_grace = 0.001\n"
        "holder_stop = 10\nholder_start = 20\nlibvirt_call = 20\n"
        '\n[tokens.gpu0]\naddress = "0000:0a:00.0"\n'
        '\n[tokens.gpu1]\naddress = "0000:0b:00.0"\n'
        "\n[proxmox]\n"
        f'config_dir = "{root / "pve"}"\n'
        f'run_dir = "{root / "run" / "qemu-server"}"\n'
        f'lock_dir = "{root / "lock"}"\n'
        f'qm = "{root / "bin" / "qm"}"\n'
        f'pct = "{root / "bin" / "pct"}"\n'
        f'node = "{NODE}"\n'
    )
    for program in ("qm", "pct"):
        wrapper = root / "bin" / program
        wrapper.write_text(
            f"#!/bin/sh\nexec '{sys.executable}' '{STANDIN}' '{root}' {program} \"$@\"\n"
        )
        wrapper.chmod(0o755)
    arbiter = root / "bin" / "charly-arbiter"
    arbiter.write_text(
        "#!/bin/sh\n"
        f"export CHARLY_ARBITER_CONFIG='{root / 'arbiter.toml'}' PYTHONPATH='{REPO}'\n"
        f"exec '{sys.executable}' -m charly_arbiter \"$@\"\n"
    )
    arbiter.chmod(0o755)
    script = (REPO / "hooks" / "proxmox").read_text()
    assert "CHARLY_ARBITER=/usr/bin/charly-arbiter\n" in script
    snippet = root / "snippets" / "charly-arbiter.sh"
    snippet.write_text(
        script.replace("CHARLY_ARBITER=/usr/bin/charly-arbiter", f"CHARLY_ARBITER={arbiter}")
    )
    snippet.chmod(0o755)
    yield Node(root, major)
    _stop_everything(root)


def _stop_everything(root: Path) -> None:
    """Kill what the test left running: the stand-ins' watchers and guests, hooks'
    detached releases and start watchers (each names ROOT on its command line).
    Again until none is left: a guest killed here would have its cleanup, and a
    release, start another."""
    needle = str(root).encode()
    for _ in range(20):
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmdline:
                found.append(int(entry))
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        time.sleep(0.2)
