"""The exit-code contract over the whole CLI and the hooks, as one table.

`charly_arbiter/cli/exits.py` says, for every command, subcommand and hook, which
exit status each situation gets (0 success, 1 error, 2 usage, 3 refused); this
runs a real process against the simulated host for every one of its rows, and
fails for a command of cli/__init__.py COMMANDS (or a subcommand, or a hook) that
has no rows there, and for a row that no case here exercises.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
from clitools import READ_ONLY, ledger_locked, namespaced
from simhosts import PF, VF1, default_host, mig_host, sriov_pf, sriov_tokens

from charly_arbiter.cli import COMMANDS
from charly_arbiter.cli.app import build
from charly_arbiter.cli.exits import (
    DETACHED,
    EVERY_COMMAND,
    HOOKS,
    TABLE,
    UNLISTED,
    in_document,
    rows,
)
from charly_arbiter.core.config import load_config
from charly_arbiter.core.host import TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import VFIO, Lease, LeaseState, Mode, Poison, ProcessRef
from charly_arbiter.hooksession import DETACHED as STARTED_BY_HOOKS
from charly_arbiter.hooksession import Handoff
from charly_arbiter.host.procscan import process_ref
from charly_arbiter.ops.history import HistoryLog
from tests.conftest import DEFAULT_CONFIG, REPO, SimEnv

HOSTDEV = (
    "<domain type='kvm'><name>{name}</name><devices><hostdev mode='subsystem' type='pci' "
    "managed='yes'><source><address domain='0x0000' bus='0x{bus}' slot='0x00' function='0x0'/>"
    "</source></hostdev></devices></domain>"
)


NIC = HOSTDEV.format(name="a b", bus="05")
OCI_STATE = '{"id": "c", "status": "creating", "bundle": "{bundle}"}'
OCI_CDI = (
    '{"id": "c", "status": "creating", "bundle": "{bundle}", '
    '"annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=0"}}'
)
# Commands whose output is a report: a failure's reason may be in it, on stdout.
REPORTS = ("status", "doctor", "plan")


@dataclass(frozen=True)
class Case:
    command: str  # a key of exits.TABLE
    code: int
    argv: tuple[str, ...]
    setup: str = "fresh"  # a scenario below
    says: str = ""  # a piece of what it prints (stdout or stderr)
    stdin: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.command}-{self.code}-{self.setup}-{'_'.join(self.argv)[:40]}"


C = Case
CASES = [
    C("charly-arbiter", 0, ("--version",), says="charly-arbiter"),
    C("charly-arbiter", 2, (), says="Usage:"),
    C("charly-arbiter", 2, ("frobnicate",), says="No such command"),
    C("status", 0, ("status",), "poisoned", says="POISONED"),
    C("status", 1, ("status",), "corrupt", says="corrupt"),
    C("status", 1, ("status",), "world_writable", says="writable"),
    C("status", 2, ("status", "--follow"), says="--follow needs --json"),
    C("acquire", 0, ("acquire", "--exclusive", "libvirt:win11", "gpu0"), says="holds gpu0"),
    C("acquire", 1, ("acquire", "--exclusive", "libvirt:win11", "gpu0"), "failing", "poisoned"),
    C("acquire", 1, ("acquire", "--shared", "container:c", "gpu0"), "lock_held", "held by process"),
    C("acquire", 1, ("acquire", "--shared", "container:c", "gpu0"), "read_only", "read-only"),
    C("acquire", 2, ("acquire", "libvirt:x", "gpu0"), says="--exclusive or --shared"),
    C("acquire", 2, ("acquire", "--exclusive", "--shared", "libvirt:x", "gpu0"), says="exclude"),
    C("acquire", 2, ("acquire", "--shared", "container:x", "gpu9"), says="gpu0, gpu1"),
    C("acquire", 2, ("acquire", "--shared", "nocolon", "gpu0"), says="KIND:NAME"),
    C("acquire", 2, ("acquire", "--shared", "container:my llm", "gpu0"), says="container name"),
    C("acquire", 2, ("acquire", "--shared", "systemd:x.exe", "gpu0"), says="unit name"),
    C("acquire", 2, ("acquire", "--shared", "process:12a", "gpu0"), says="process:PID"),
    C("acquire", 2, ("acquire", "--shared", "libvirt:a/b", "gpu0"), says="'/'"),
    C("acquire", 2, ("acquire", "--shared", "vm:x", "gpu0"), says="the kind is one of"),
    C("acquire", 2, ("acquire", "--shared", "arbiter:vfs/gpu0", "gpu0"), says="kind is one of"),
    C("acquire", 3, ("acquire", "--exclusive", "libvirt:other", "gpu0"), "held", "exclusively"),
    C("acquire", 3, ("acquire", "--shared", "container:c", "gpu0"), "poisoned", "poisoned"),
    C("acquire", 3, ("acquire", "--exclusive", "libvirt:w", "gpu1"), says="not preemptible"),
    C("acquire", 3, ("acquire", "--shared", "libvirt:win11", "gpu0"), "in_progress", "acquiring"),
    C("acquire", 3, ("acquire", "--shared", "container:c", "gpu0"), "in_progress", "held"),
    C("release", 0, ("release", "libvirt:nobody"), says="holds no lease"),
    C("release", 0, ("release", "--force", "libvirt:win11"), "held", "released"),
    C("release", 1, ("release", "--force", "libvirt:win11"), "failing_start", "not everything"),
    C("release", 2, ("release", "libvirt:"), says="1 to"),
    C("release", 3, ("release", "libvirt:win11"), "held", "still runs"),
    C("release", 3, ("release", "--force", "libvirt:win11"), "in_progress", "still running"),
    C("restore", 0, ("restore", "--stranded"), says="nothing to restore"),
    C("restore", 0, ("restore", "--force", "libvirt:win11"), "held", "restored libvirt:win11"),
    C("restore", 1, ("restore", "--force", "libvirt:win11"), "failing_start", "not everything"),
    C("restore", 2, ("restore", "--stranded", "libvirt:x"), says="not both"),
    C("restore", 2, ("restore", "systemd:"), says="1 to"),
    C("restore", 3, ("restore", "libvirt:win11"), "held", "still runs"),
    C("restore", 3, ("restore", "libvirt:win11"), "in_progress", "still running"),
    C("poison", 2, ("poison",), says="Usage:"),
    C("poison list", 0, ("poison", "list"), says="no token is poisoned"),
    C("poison list", 1, ("poison", "list"), "corrupt", "corrupt"),
    C("poison clear", 0, ("poison", "clear", "gpu0"), "poisoned", "cleared the poison"),
    C("poison clear", 0, ("poison", "clear", "gpu1"), says="is not poisoned"),
    C("poison clear", 1, ("poison", "clear", "gpu0"), "corrupt", "corrupt"),
    C("poison clear", 2, ("poison", "clear", "gpu9"), says="gpu0, gpu1"),
    C("poison clear", 3, ("poison", "clear", "gpu0"), "unaccounted", "accounts for it"),
    C("sim", 2, ("sim",), says="Usage:"),
    C("sim init", 0, ("sim", "init", "{root}/new"), says="wrote"),
    C("sim init", 1, ("sim", "init", "{config}/under-a-file"), says="cannot use"),
    C("sim init", 3, ("sim", "init", "{sim}"), says="exists"),
    C("sim show", 0, ("sim", "show"), says="boot_id"),
    C("sim show", 2, ("--host", "local", "sim", "show"), says="simulated host"),
    C("sim stop", 0, ("sim", "stop", "container:llm")),
    C("sim stop", 2, ("sim", "stop", "container:-x"), says="container name"),
    C("sim stop", 2, ("--host", "local", "sim", "stop", "container:llm"), says="simulated"),
    C("sim start", 0, ("sim", "start", "container:llm")),
    C("sim start", 2, ("sim", "start", "nocolon"), says="KIND:NAME"),
    C("sim reboot", 0, ("sim", "reboot")),
    C("sim reboot", 2, ("--host", "local", "sim", "reboot"), says="simulated"),
    C("detect", 0, ("--host", "local", "detect", "--json"), says="functions"),
    C("detect", 2, ("detect",), says="this machine's PCI devices"),
    C("doctor", 0, ("doctor", "--hook", "{config}")),
    C("doctor", 1, ("doctor", "--hook", "{config}"), "poisoned", "problem"),
    C("doctor", 1, ("doctor", "--hook", "{config}"), "read_only", "read-only"),
    C("plan", 0, ("plan", "--shared", "container:c", "gpu0"), says="can claim gpu0"),
    C("plan", 1, ("plan", "--shared", "container:c", "gpu0"), "broken_host", "cannot read"),
    C("plan", 2, ("plan", "--shared", "container:c"), says="name the TOKENS"),
    C("plan", 2, ("plan", "container:c", "gpu0"), says="--exclusive or --shared"),
    C("plan", 2, ("plan", "--shared", "--exclusive", "container:c", "gpu0"), says="exclude"),
    C("plan", 2, ("plan", "--shared", "container:c", "gpu9"), says="gpu0, gpu1"),
    C("plan", 2, ("plan", "libvirt:win11"), says="needs libvirt"),
    C("plan", 2, ("plan", "container:c"), says="not a libvirt domain"),
    C("plan", 3, ("plan", "--exclusive", "libvirt:other", "gpu0"), "held", "would be refused"),
    C("explain", 0, ("explain", "gpu0"), says="gpu0"),
    C("explain", 0, ("explain", "libvirt:nobody"), says="holds no lease"),
    C("explain", 1, ("explain", "gpu0"), "world_writable", "writable"),
    C("explain", 2, ("explain", "gpu9"), says="gpu0, gpu1"),
    C("explain", 2, ("explain", "container:a b"), says="container name"),
    C("history", 0, ("history",), says="no events"),
    C("history", 0, ("history", "--token", "gpu7"), "gpu7_in_history", "claims gpu7"),
    C("history", 1, ("history", "--token", "gpu0"), "broken_host", "cannot read"),
    C("history", 2, ("history", "--token", "gpu9"), says="gpu0, gpu1"),
    C("history", 2, ("history", "--claimant", "vm"), says="KIND:NAME"),
    C("history", 2, ("history", "--since", "soon"), says="is not a time"),
    C("metrics", 0, ("metrics",), says="charly_arbiter_ledger_generation"),
    C("metrics", 1, ("metrics", "--output", "{config}/x.prom"), says="could not write"),
    C("adopt", 0, ("adopt", "gpu0", "libvirt:win11"), "unaccounted", "now holds gpu0"),
    C("adopt", 0, ("adopt", "--admin", "gpu0"), "unaccounted", "stays on vfio-pci"),
    C("adopt", 1, ("adopt", "--admin", "gpu0"), "world_writable", "writable"),
    C("adopt", 2, ("adopt", "gpu0"), says="KIND:NAME or --admin"),
    C("adopt", 2, ("adopt", "gpu9", "libvirt:x"), says="gpu0, gpu1"),
    C("adopt", 2, ("adopt", "gpu0", "libvirt:a/b"), "unaccounted", "'/'"),
    C("adopt", 3, ("adopt", "--admin", "gpu1"), says="not on vfio-pci"),
    C("send-home", 0, ("send-home", "gpu0"), "unaccounted", "sent gpu0 home"),
    C("send-home", 1, ("send-home", "gpu0"), "world_writable", "writable"),
    C("send-home", 1, ("send-home", "gpu0"), "unaccounted_failing", "did not go all the way"),
    C("send-home", 2, ("send-home", "gpu9"), says="gpu0, gpu1"),
    C("send-home", 3, ("send-home", "gpu1"), says="not on vfio-pci"),
    C("mig", 0, ("mig", "gpu0"), "mig", "gpu0: MIG off"),
    C("mig", 0, ("mig", "gpu0", "on"), "mig", "stopped and brought back container:llm"),
    C("mig", 1, ("mig", "gpu0", "on"), "mig_failing", "MIG on failed"),
    C("mig", 2, ("mig", "gpu0", "layout"), "mig", "say layout PROFILE"),
    C("mig", 2, ("mig", "gpu0", "layout", "1g.10gb"), "mig", "MIG mode is off"),
    C("mig", 2, ("mig", "gpu9"), "mig", "gpu0, gpu1"),
    C("mig", 2, ("mig", "gpu1"), "mig", "has no MIG mode"),
    C("mig", 3, ("mig", "gpu0", "on"), "mig_held", "held exclusively by libvirt:win11"),
    C("acquire", 2, ("acquire", "--shared", "container:c", "gpu0:0"), "mig", "MIG is off"),
    C("vfs", 0, ("vfs", "pf", "1"), "sriov", "pf: 2 -> 1 VFs"),
    C("vfs", 0, ("vfs", "--configured"), "sriov", "pf has 2 VFs already"),
    C("vfs", 1, ("vfs", "pf", "0"), "sriov_hung", "pf is poisoned now"),
    C("vfs", 2, ("vfs",), says="TOKEN COUNT, or --configured"),
    C("vfs", 2, ("vfs", "gpu0", "1"), says="not an SR-IOV physical function"),
    C("vfs", 2, ("vfs", "pf", "3"), "sriov", "at most 2 VFs"),
    C("vfs", 2, ("vfs", "gpu9", "1"), says="gpu0, gpu1"),
    C("vfs", 3, ("vfs", "pf", "0"), "sriov_leased", "leased by libvirt:vm"),
    C("recover", 0, ("recover",), says="nothing to recover"),
    C("recover", 0, ("recover",), "corrupt", "nothing was written"),
    C("recover", 1, ("recover",), "world_writable", "writable"),
    C("recover", 3, ("recover", "--yes"), "corrupt_both", "cannot be used"),
    C(
        "attach",
        0,
        ("attach", "--unit-dir", "{root}/units", "llm.service", "gpu0"),
        says="attached",
    ),
    C("attach", 1, ("attach", "--unit-dir", "{config}/u", "llm.service", "gpu0"), says="cannot"),
    C("attach", 2, ("attach", "--unit-dir", "{root}/u", "x.socket", "gpu0"), says="service unit"),
    C("attach", 2, ("attach", "--exclusive", "--shared", "x.service", "gpu0"), says="exclude"),
    C("attach", 2, ("attach", "--unit-dir", "{root}/u", "x.service", "gpu9"), says="gpu0, gpu1"),
    C("attach", 3, ("attach", "--unit-dir", "{root}/u", "ollama.service", "gpu0"), "listed", "in"),
    C("detach", 0, ("detach", "llm.service"), says="is not attached"),
    C("detach", 1, ("detach", "llm.service"), "attached_unsafe", "writable"),
    C("detach", 2, ("detach", "x.socket"), says="service unit"),
    C("detach", 3, ("detach", "llm.service"), "attached_and_held", "holds a shared lease"),
    # The hooks: no options, their own argv; libvirt and runtimes go on only on 0.
    C("hook qemu", 0, ("hook", "qemu", "vm", "start", "begin", "-")),
    C("hook qemu", 0, ("hook", "qemu", "vm", "prepare", "begin", "-"), stdin="<domain/>"),
    C("hook qemu", 0, ("hook", "qemu", "vm", "release", "end", "-"), stdin=HOSTDEV, says=""),
    # A domain that claims no GPU starts whatever its name (here a NIC at 0000:05:00.0).
    C("hook qemu", 0, ("hook", "qemu", "a\tb", "prepare", "begin", "-"), stdin=NIC),
    C("hook qemu", 1, ("hook", "qemu", "vm", "prepare", "begin", "-"), stdin="<hostdev>"),
    C("hook qemu", 2, ("hook", "qemu", "vm"), says="usage"),
    C("hook qemu", 2, ("hook", "qemu", "a\tb", "prepare", "begin", "-"), stdin=HOSTDEV),
    C("hook qemu", 3, ("hook", "qemu", "vm", "prepare", "begin", "-"), "held", stdin=HOSTDEV),
    C("hook qemu", 3, ("hook", "qemu", "win11", "migrate", "begin", "-"), "held", stdin=HOSTDEV),
    C("hook oci", 0, ("hook", "oci", "prestart"), "bundle", stdin=OCI_STATE),
    C("hook oci", 0, ("hook", "oci", "poststop"), stdin="not json", says="not JSON"),
    C("hook oci", 1, ("hook", "oci", "prestart"), stdin="not json", says="not JSON"),
    C("hook oci", 2, ("hook", "oci", "frobnicate"), says="usage"),
    C("hook oci", 3, ("hook", "oci", "prestart"), "cdi_poisoned", "poisoned", stdin=OCI_CDI),
    C("hook oci-inject", 0, ("hook", "oci-inject", "{bundle}"), "bundle"),
    C("hook oci-inject", 1, ("hook", "oci-inject", "{root}"), says="cannot add"),
    C("hook oci-inject", 2, ("hook", "oci-inject"), says="usage"),
    C("hook proxmox", 0, ("hook", "proxmox", "100", "post-stop"), "proxmox_vm", says=""),
    C("hook proxmox", 0, ("hook", "proxmox", "100", "pre-start"), "proxmox_vm", says=""),
    C("hook proxmox", 1, ("hook", "proxmox", "100", "pre-start"), "proxmox_bad_vm", "not a PCI"),
    C("hook proxmox", 2, ("hook", "proxmox", "100"), says="usage"),
    C("hook proxmox", 2, ("hook", "proxmox", "99", "pre-start"), says="not a Proxmox VMID"),
    C("hook proxmox", 3, ("hook", "proxmox", "100", "pre-start"), "proxmox_held", "exclusively"),
    # What the hooks start detached, each fed the hand-off a hook writes ({finish}, {watch}).
    C("_finish-release", 0, ("_finish-release", "{finish}"), says=""),
    C("_finish-release", 1, ("_finish-release", "{finish}"), "corrupt", "corrupt"),
    C("_finish-release", 2, ("_finish-release",), says="usage"),
    C("_finish-release", 3, ("_finish-release", "{finish}"), "in_progress", "acquiring"),
    C("_finish-release", 2, ("_finish-release", "{{"), says="not JSON"),
    C("_finish-release", 2, ("_finish-release", "{partial}"), says="lacks"),
    C("_watch-start", 0, ("_watch-start", "{watch}"), "proxmox_held", says=""),
    C("_watch-start", 1, ("_watch-start", "{watch}"), "proxmox_corrupt", "corrupt"),
    C("_watch-start", 2, ("_watch-start", "{finish}", "x"), says="usage"),
    # The resident helper: started by systemd or by hand, never by a person's command.
    C("serve", 0, ("serve", "--socket", "{root}/run/serve.sock", "--idle-exit", "0.1")),
    C("serve", 1, ("serve", "--socket", "{config}/serve.sock"), says="cannot listen"),
    C("serve", 2, ("serve", "--no-such-option"), says="unrecognized arguments"),
]


# -- the scenarios -----------------------------------------------------------------------


def _poison(sim: SimEnv) -> None:
    with Ledger(sim.state_dir).transaction() as txn:
        txn.state = txn.state.with_poison("gpu0", Poison("unbind hung", "2026-01-01T00:00:00"))


def _hold(sim: SimEnv) -> None:
    sim.arbiter().acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])


def _corrupt(sim: SimEnv) -> None:
    _hold(sim)
    (sim.state_dir / "ledger.toml").write_bytes(b"generation = 1\n# torn")


def _corrupt_both(sim: SimEnv) -> None:
    _corrupt(sim)
    (sim.state_dir / "ledger.toml.bak").write_bytes(b"not toml [")


def _world_writable(sim: SimEnv) -> None:
    sim.state_dir.mkdir(mode=0o700)
    sim.state_dir.chmod(0o777)


def _failing(sim: SimEnv) -> None:
    sim.set_host(default_host(gpu0="fail_switch = true"))


def _unaccounted(sim: SimEnv) -> None:
    """gpu0 on vfio-pci with no lease and no poison (a ledger deleted while it was
    passed through, or a tool that bound it there)."""
    sim.set_host(on_vfio(default_host()))


def _unaccounted_failing(sim: SimEnv) -> None:
    sim.set_host(on_vfio(default_host(gpu0="fail_switch = true")))


def on_vfio(host: str) -> str:
    """gpu0's GPU and audio functions (the first two devices) on vfio-pci."""
    host = host.replace('driver = "nvidia"', 'driver = "vfio-pci"', 1)
    return host.replace('driver = "snd_hda_intel"', 'driver = "vfio-pci"', 1)


def _proxmox_vm(sim: SimEnv, line: str = "hostpci0: 0a:00\n") -> None:
    """A Proxmox node's cluster files (what [proxmox] config_dir names) with VM 100,
    whose configuration passes gpu0 through."""
    pve = sim.root / "pve"
    (pve / "qemu-server").mkdir(parents=True)
    (pve / "qemu-server" / "100.conf").write_text(f"name: vm\n{line}")
    sim.config_path.write_text(
        sim.config_path.read_text()
        + f'\n[proxmox]\nconfig_dir = "{pve}"\nrun_dir = "{sim.root / "run"}"\n'
        + f'lock_dir = "{sim.root / "lock"}"\n'
    )


def _proxmox_held(sim: SimEnv) -> None:
    _proxmox_vm(sim)
    _hold(sim)


def _proxmox_corrupt(sim: SimEnv) -> None:
    """VM 100 of a Proxmox node (its lock directory there) on a corrupt ledger."""
    _proxmox_vm(sim)
    (sim.root / "lock").mkdir()
    _corrupt(sim)


def _failing_start(sim: SimEnv) -> None:
    _hold(sim)
    sim.set_host(default_host(llm="fail_start = true"))


def _in_progress(sim: SimEnv) -> Iterator[None]:
    """A lease of libvirt:win11 that a live process (a real one, asleep) is acquiring."""
    sleeper = subprocess.Popen(["/bin/sleep", "120"])
    try:
        owner = process_ref(Path("/proc"), sleeper.pid)
        assert owner is not None
        lease = Lease(
            claimant="libvirt:win11",
            mode=Mode.EXCLUSIVE,
            tokens=("gpu0",),
            state=LeaseState.ACQUIRING,
            transient=False,
            boot_id=sim.host().boot_id(),
            created="2026-01-01T00:00:00+00:00",
        ).owned_by(owner)
        with Ledger(sim.state_dir).transaction() as txn:
            txn.state = txn.state.with_lease(lease)
        yield
    finally:
        sleeper.kill()
        sleeper.wait()


def _lock_held(sim: SimEnv) -> Iterator[None]:
    """A real second process holds the ledger lock, past a short lock_wait."""
    sim.config_path.write_text(
        sim.config_path.read_text().replace("lock_wait = 20", "lock_wait = 0.5")
    )
    with ledger_locked(sim.state_dir):
        yield


def _read_only(sim: SimEnv) -> None:
    """The state directory on a read-only filesystem: a read-only bind mount of it,
    in the test's own mount namespace (see the case runner)."""
    sim.state_dir.mkdir(mode=0o700)


def _broken_host(sim: SimEnv) -> None:
    sim.set_host("[[devices]\n")


def _listed(sim: SimEnv) -> None:
    sim.config_path.write_text(
        sim.config_path.read_text()
        + '\n[[holders]]\nkind = "systemd"\nname = "ollama.service"\ntokens = ["gpu0"]\n'
    )


def _attached_and_held(sim: SimEnv) -> None:
    units = sim.root / "units"
    result = sim.cli("attach", "--unit-dir", str(units), "llm.service", "gpu0")
    assert result.returncode == 0, result.stderr
    sim.arbiter().acquire("systemd:llm.service", Mode.SHARED, ["gpu0"])


def _attached_unsafe(sim: SimEnv) -> None:
    _attached_and_held(sim)
    sim.state_dir.chmod(0o777)


def _gpu7_in_history(sim: SimEnv) -> None:
    """A token the configuration no longer has, in the history of when it had it."""
    sim.state_dir.mkdir(mode=0o700)
    HistoryLog(sim.state_dir).append(
        "claim", {"claimant": "libvirt:old", "token": "gpu7", "mode": "shared"}
    )


def _cdi_poisoned(sim: SimEnv) -> None:
    sim.config_path.write_text(
        sim.config_path.read_text().replace(
            'address = "0000:0a:00.0"\n',
            'address = "0000:0a:00.0"\ncdi_devices = ["nvidia.com/gpu=0"]\n',
        )
    )
    _poison(sim)
    _bundle(sim)


def _bundle(sim: SimEnv) -> None:
    bundle = sim.root / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text('{"ociVersion": "1.0.2"}')


def _sriov(sim: SimEnv, fault: str = "") -> None:
    """An SR-IOV physical function (a token, configured for 2 VFs) with its 2 VFs, the
    first a token of its own."""
    sim.set_host(default_host() + sriov_pf(extra=fault))
    sim.config_path.write_text(sim.config_path.read_text() + sriov_tokens(2))
    sim.host().write_sysfs(PF, "sriov_numvfs", "2")


def _sriov_leased(sim: SimEnv) -> None:
    _sriov(sim)
    sim.arbiter().acquire("libvirt:vm", Mode.EXCLUSIVE, ["vf0"])


def _sriov_hung(sim: SimEnv) -> None:
    """The second VF on vfio-pci, bound by hand (no token, no lease), and a teardown
    that blocks on it as the kernel's does while a VM holds its VFIO device."""
    _sriov(sim, "hang_sriov_teardown = true\n")
    host = sim.host()
    host.switch(TokenSpec(VF1, VF1, tuple(host.token_functions(VF1, VF1))), {VF1: VFIO})


def _mig(sim: SimEnv, fault: str = "") -> None:
    """gpu0 MIG-capable (NVML's side of the simulated host)."""
    sim.set_host(mig_host(gpu0=fault))


def _mig_held(sim: SimEnv) -> None:
    _mig(sim)
    _hold(sim)


SCENARIOS: dict[str, Callable[[SimEnv], Iterator[None] | None]] = {
    "fresh": lambda sim: None,
    "poisoned": _poison,
    "held": _hold,
    "corrupt": _corrupt,
    "corrupt_both": _corrupt_both,
    "world_writable": _world_writable,
    "failing": _failing,
    "failing_start": _failing_start,
    "unaccounted": _unaccounted,
    "proxmox_vm": _proxmox_vm,
    "proxmox_bad_vm": lambda sim: _proxmox_vm(sim, "hostpci0: 0A:00.0\n"),
    "proxmox_held": _proxmox_held,
    "proxmox_corrupt": _proxmox_corrupt,
    "unaccounted_failing": _unaccounted_failing,
    "in_progress": _in_progress,
    "lock_held": _lock_held,
    "read_only": _read_only,
    "broken_host": _broken_host,
    "listed": _listed,
    "attached_and_held": _attached_and_held,
    "cdi_poisoned": _cdi_poisoned,
    "attached_unsafe": _attached_unsafe,
    "gpu7_in_history": _gpu7_in_history,
    "bundle": _bundle,
    "mig": _mig,
    "mig_failing": lambda sim: _mig(sim, "fail_mig = true"),
    "mig_held": _mig_held,
    "sriov": _sriov,
    "sriov_leased": _sriov_leased,
    "sriov_hung": _sriov_hung,
}


def _stdin(sim: SimEnv, case: Case) -> str:
    if case.stdin == HOSTDEV:
        bus = "0b" if case.setup == "fresh" else "0a"
        name = case.argv[2] if case.argv[1] == "qemu" else "vm"
        return HOSTDEV.format(name=name.replace("\t", " "), bus=bus)
    return case.stdin.replace("{bundle}", str(sim.root / "bundle"))


def _run(sim: SimEnv, case: Case) -> subprocess.CompletedProcess[str]:
    words = {
        "root": str(sim.root),
        "sim": str(sim.sim_dir),
        "config": str(sim.config_path),
        "bundle": str(sim.root / "bundle"),
    }
    if case.command in DETACHED:
        config = load_config(sim.config_path)
        words["finish"] = Handoff.of(config, "libvirt:win11", owner=ProcessRef(1)).to_json()
        words["watch"] = Handoff.of(config, "proxmox:100", created="2026-01-01").to_json()
        words["partial"] = '{"host": "local"}'
    argv = [arg.format(**words) for arg in case.argv]
    command = [sys.executable, "-m", "charly_arbiter", *argv]
    if case.setup == "read_only":
        # A read-only bind mount of the state directory, in a mount namespace of
        # this process's own (unshare -m): the kernel answers EROFS for real.
        command = namespaced(READ_ONLY, sim.state_dir, command)
    return subprocess.run(
        command,
        input=_stdin(sim, case),
        capture_output=True,
        text=True,
        env={**sim.env(), **case.env},
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_every_row_of_the_exit_table(make_sim: Callable[..., SimEnv], case: Case) -> None:
    sim = make_sim(config=DEFAULT_CONFIG + "\n")
    setup = SCENARIOS[case.setup](sim)
    try:
        if setup is not None:
            next(setup)
        started = time.monotonic()
        result = _run(sim, case)
        elapsed = time.monotonic() - started
    finally:
        if setup is not None:
            next(setup, None)
    said = result.stdout + result.stderr
    assert result.returncode == case.code, f"{case.argv} exited {result.returncode}:\n{said}"
    assert case.says in said, (case.says, said)
    assert "Traceback" not in said and "internal error" not in said, said
    assert elapsed < 60
    if case.code and case.command not in HOOKS + DETACHED + REPORTS:
        assert result.stderr.strip(), "a failure says why on stderr"


def _command_tree() -> list[str]:
    """Every command and subcommand of the real CLI, by its words after charly-arbiter."""
    found: list[str] = ["charly-arbiter"]

    def walk(command: click.Command, ctx: click.Context, path: list[str]) -> None:
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                found.append(" ".join([*path, name]))
                walk(sub, click.Context(sub, info_name=name, parent=ctx), [*path, name])

    cli = build(COMMANDS)
    walk(cli, click.Context(cli, info_name="charly-arbiter"), [])
    return found


def test_the_table_has_rows_for_every_command_and_a_case_for_every_row() -> None:
    commands = _command_tree()
    assert set(COMMANDS) <= set(commands)
    missing = [
        command for command in [*commands, *HOOKS, *DETACHED, *UNLISTED] if command not in TABLE
    ]
    assert not missing, f"commands without exit rows in cli/exits.py: {missing}"
    stale = [
        command for command in TABLE if command not in [*commands, *HOOKS, *DETACHED, *UNLISTED]
    ]
    assert not stale, f"rows for commands that do not exist: {stale}"
    covered = {(case.command, case.code) for case in CASES}
    untested = [
        (command, row.code, row.when)
        for command in TABLE
        for row in TABLE[command]
        if (command, row.code) not in covered
    ]
    assert not untested, f"rows no case exercises: {untested}"


def test_the_verbs_the_hooks_start_have_rows_and_stay_out_of_help(sim: SimEnv) -> None:
    """A hook's detached processes are the CLI's hidden verbs: the table holds their
    rows (the hooks start exactly these), and --help lists none of them."""
    assert DETACHED == STARTED_BY_HOOKS
    assert not set(DETACHED) & set(_command_tree())
    shown = sim.cli("--help")
    assert shown.returncode == 0 and "_finish" not in shown.stdout and "_watch" not in shown.stdout
    unknown = sim.cli("_frobnicate", "{}")
    assert unknown.returncode == 2 and "no such command" in unknown.stderr


@pytest.mark.parametrize("command", [c for c in _command_tree() if c != "charly-arbiter"])
def test_every_command_refuses_an_unknown_option_with_2(sim: SimEnv, command: str) -> None:
    """EVERY_COMMAND's row, for each command: an option it does not have is a usage error."""
    assert [row.code for row in EVERY_COMMAND] == [2]
    result = sim.cli(*command.split(), "--no-such-option")
    assert result.returncode == 2, result.stderr
    assert "No such option" in result.stderr and result.stdout == ""
    assert 2 in [row.code for row in rows(command)]


@pytest.mark.parametrize(
    "command",
    ["status", "poison list", "history", "explain gpu0", "acquire --shared container:x gpu0"],
)
def test_a_configuration_that_is_not_valid_exits_2(sim: SimEnv, command: str) -> None:
    sim.config_path.write_text('host = "nowhere"\n')
    result = sim.cli(*command.split())
    assert result.returncode == 2, result.stderr
    assert str(sim.config_path) in result.stderr


def test_the_docs_show_the_table_this_module_holds() -> None:
    """docs/operations.md's table is generated from cli/exits.py, never edited by hand
    (`PYTHONPATH=. python3 packaging/gen-manpages.py --exit-table docs/operations.md`)."""
    document = (REPO / "docs" / "operations.md").read_text()
    assert in_document(document) == document
