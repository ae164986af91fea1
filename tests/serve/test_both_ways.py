"""Every command and hook gives the same output and exit status through the resident
helper as in-process.

Each case runs twice, as real processes against two identical simulated hosts: once
in-process (CHARLY_ARBITER_SERVE=off), once through a real `charly-arbiter serve`
(CHARLY_ARBITER_SERVE=must: a command the helper did not take fails, so a case
cannot pass by running in-process both times).  The outputs are compared whole,
with only the two hosts' directories told apart; and the server's log shows that
the child ran the command.  A hook's fast path decides without the helper
(never slower than before): those cases are the same by construction, and are
here so that the table covers every hook.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import click
import pytest
from servetools import Ran, Served, cli, serving
from simhosts import PF, default_host, mig_host, sriov_pf, sriov_tokens

from charly_arbiter.cli import COMMANDS
from charly_arbiter.cli.app import build
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Mode, Poison
from tests.conftest import DEFAULT_CONFIG, REPO, SimEnv

pytestmark = pytest.mark.slow

HOSTDEV = (
    "<domain type='kvm'><name>{name}</name><devices><hostdev mode='subsystem' type='pci' "
    "managed='yes'><source><address domain='0x0000' bus='0x0a' slot='0x00' function='0x0'/>"
    "</source></hostdev></devices></domain>"
)
CLAIM = (
    "<domain><name>{name}</name><metadata><ca:claim "
    "xmlns:ca='https://charly-arbiter.org/xmlns/claim/1' mode='shared'>"
    "<ca:token>gpu1</ca:token></ca:claim></metadata></domain>"
)
OCI_CDI = (
    '{{"id": "c", "status": "creating", "bundle": "{bundle}", '
    '"annotations": {{"cdi.k8s.io/gpu": "nvidia.com/gpu=0"}}}}'
)


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    setup: str = "fresh"
    stdin: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.setup}-{'_'.join(self.argv)[:50]}"


C = Case
CASES = [
    C(()),
    C(("--version",)),
    C(("--help",)),
    C(("frobnicate",)),
    C(("status",), "held"),
    C(("status", "--json"), "held"),
    C(("status",), "corrupt"),
    C(("status", "--follow")),
    C(("acquire", "--exclusive", "libvirt:win11", "gpu0")),
    C(("acquire", "--exclusive", "libvirt:other", "gpu0"), "held"),
    C(("acquire", "--shared", "container:my llm", "gpu0")),
    C(("acquire", "--exclusive", "libvirt:win11", "gpu0"), "failing"),
    C(("release", "--force", "libvirt:win11"), "held"),
    C(("release", "libvirt:win11"), "held"),
    C(("restore", "--stranded")),
    C(("restore", "--force", "libvirt:win11"), "held"),
    C(("poison",)),
    C(("poison", "list"), "poisoned"),
    C(("poison", "clear", "gpu0"), "poisoned"),
    C(("sim",)),
    C(("sim", "show")),
    C(("sim", "stop", "container:llm")),
    C(("sim", "start", "container:llm")),
    C(("sim", "reboot")),
    C(("sim", "init", "{root}/new")),
    C(("detect",)),
    C(("--host", "local", "detect", "--json")),
    C(("doctor", "--hook", "{config}"), "poisoned"),
    C(("plan", "--shared", "container:c", "gpu0")),
    C(("plan", "--exclusive", "libvirt:other", "gpu0"), "held"),
    C(("explain", "gpu0"), "held"),
    C(("explain", "container:a b")),
    C(("history", "--claimant", "vm")),
    C(("metrics",), "poisoned"),
    C(("recover",), "corrupt"),
    C(("attach", "--unit-dir", "{root}/units", "llm.service", "gpu0")),
    C(("detach", "llm.service")),
    C(("adopt", "--admin", "gpu0"), "unaccounted"),
    C(("send-home", "gpu1")),
    C(("vfs", "pf", "1"), "sriov"),
    C(("vfs", "pf", "3"), "sriov"),
    C(("mig", "gpu0")),
    C(("mig", "gpu0", "on"), "mig"),
    C(("mig", "gpu0", "on"), "mig_held"),
    # The hooks: their slow paths are handed over; stdout stays empty both ways.
    C(("hook", "qemu", "vm", "prepare", "begin", "-"), "held", HOSTDEV),
    C(("hook", "qemu", "win11", "release", "end", "-"), "held", HOSTDEV),
    C(("hook", "qemu", "nolease", "release", "end", "-"), stdin=HOSTDEV),
    C(("hook", "qemu", "bench", "prepare", "begin", "-"), stdin=CLAIM),
    C(("hook", "qemu", "vm", "prepare", "begin", "-"), stdin="<hostdev>"),
    C(("hook", "qemu", "a\tb", "prepare", "begin", "-"), stdin=HOSTDEV),
    C(("hook", "qemu", "vm", "start", "begin", "-")),
    C(("hook", "qemu", "vm")),
    C(("hook", "oci", "prestart"), "cdi_poisoned", OCI_CDI),
    C(("hook", "oci", "poststop"), stdin="not json"),
    C(("hook", "oci", "frobnicate")),
    C(("hook", "oci-inject", "{root}")),
    C(("hook", "proxmox", "100", "pre-start"), "proxmox_held"),
    C(("hook", "proxmox", "100", "post-stop"), "proxmox_held"),
    C(("hook", "proxmox", "99", "pre-start")),
]
# What differs between two hosts and two moments, not between two ways of running:
# ages and times of day, a simulated host's random boot id.
VARYING = re.compile(
    r"\d+(\.\d+)?( ?(s|ms|min|h)\b| ago)|\d\d:\d\d(:\d\d)?|\d{4}-\d\d-\d\dT\S+"
    r"|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|\d\.\d+e\+\d\d"
)


def _poison(sim: SimEnv) -> None:
    with Ledger(sim.state_dir).transaction() as txn:
        txn.state = txn.state.with_poison("gpu0", Poison("unbind hung", "2026-01-01T00:00:00"))


def _hold(sim: SimEnv) -> None:
    sim.arbiter().acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])


def _corrupt(sim: SimEnv) -> None:
    _hold(sim)
    (sim.state_dir / "ledger.toml").write_bytes(b"generation = 1\n# torn")


def _failing(sim: SimEnv) -> None:
    sim.set_host(default_host(gpu0="fail_switch = true"))


def _unaccounted(sim: SimEnv) -> None:
    host = default_host().replace('driver = "nvidia"', 'driver = "vfio-pci"', 1)
    sim.set_host(host.replace('driver = "snd_hda_intel"', 'driver = "vfio-pci"', 1))


def _cdi_poisoned(sim: SimEnv) -> None:
    sim.config_path.write_text(
        sim.config_path.read_text().replace(
            'address = "0000:0a:00.0"\n',
            'address = "0000:0a:00.0"\ncdi_devices = ["nvidia.com/gpu=0"]\n',
        )
    )
    _poison(sim)
    bundle = sim.root / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text('{"ociVersion": "1.0.2"}')


def _sriov(sim: SimEnv) -> None:
    """An SR-IOV physical function configured for 2 VFs, with them."""
    sim.set_host(default_host() + sriov_pf())
    sim.config_path.write_text(sim.config_path.read_text() + sriov_tokens(2))
    sim.host().write_sysfs(PF, "sriov_numvfs", "2")


def _mig(sim: SimEnv) -> None:
    sim.set_host(mig_host())


def _mig_held(sim: SimEnv) -> None:
    _mig(sim)
    _hold(sim)


def _proxmox_held(sim: SimEnv) -> None:
    pve = sim.root / "pve"
    (pve / "qemu-server").mkdir(parents=True)
    (pve / "qemu-server" / "100.conf").write_text("name: vm\nhostpci0: 0a:00\n")
    sim.config_path.write_text(
        sim.config_path.read_text()
        + f'\n[proxmox]\nconfig_dir = "{pve}"\nrun_dir = "{sim.root / "run"}"\n'
        + f'lock_dir = "{sim.root / "lock"}"\n'
    )
    _hold(sim)


SCENARIOS: dict[str, Callable[[SimEnv], None]] = {
    "fresh": lambda sim: None,
    "held": _hold,
    "poisoned": _poison,
    "corrupt": _corrupt,
    "failing": _failing,
    "unaccounted": _unaccounted,
    "cdi_poisoned": _cdi_poisoned,
    "proxmox_held": _proxmox_held,
    "sriov": _sriov,
    "mig": _mig,
    "mig_held": _mig_held,
}


def _run(sim: SimEnv, case: Case, env: dict[str, str]) -> Ran:
    words = {"root": str(sim.root), "config": str(sim.config_path)}
    argv = [arg.format(**words) for arg in case.argv]
    name = argv[2].replace("\t", " ") if argv[:2] == ["hook", "qemu"] and len(argv) > 2 else ""
    stdin = case.stdin.format(name=name, bundle=sim.root / "bundle")
    return cli(argv, {**env, **case.env}, stdin)


def _said(ran: Ran, sim: SimEnv) -> tuple[int, str, str]:
    """What a person or a program reads, with what differs between the two hosts and
    moments (VARYING, the hosts' directories) told apart from what the command decided."""

    def plain(text: str) -> str:
        return VARYING.sub("<varies>", text.replace(str(sim.root), "<root>"))

    return ran.code, plain(ran.stdout), plain(ran.stderr)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("serve")) as served:
        yield served


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_same_output_and_exit_status_through_the_helper(
    make_sim: Callable[..., SimEnv], server: Served, case: Case
) -> None:
    here = make_sim(config=DEFAULT_CONFIG + "\n", name="in-process")
    there = make_sim(config=DEFAULT_CONFIG + "\n", name="served")
    for sim in (here, there):
        SCENARIOS[case.setup](sim)
    before = len(server.ran())
    if case.argv[:2] == ("status", "--follow"):
        pytest.skip("status --follow runs until its reader goes: test_faults follows it")
    in_process = _run(here, case, here.env(CHARLY_ARBITER_SERVE="off"))
    served = _run(there, case, server.env(there))
    assert _said(served, there) == _said(in_process, here)
    assert "Traceback" not in served.stderr
    fast_path = case.argv[:1] == ("hook",) and not _slow_path(case, there)
    assert len(server.ran()) == before + (0 if fast_path else 1), server.log()
    if case.argv[:1] == ("hook",):
        assert served.stdout == "", "a hook's stdout is its caller's: nothing reaches it"


def _slow_path(case: Case, sim: SimEnv) -> bool:
    """Whether the hook hands its case over (its fast path cannot decide it)."""
    hook = case.argv[1]
    if hook == "qemu":  # prepare or release of XML that names a hostdev or a claim,
        handled = len(case.argv) >= 6 and case.argv[3] in ("prepare", "release")
        if handled and case.argv[3] == "release":  # a release of a domain the ledger names
            ledger = sim.state_dir / "ledger.toml"
            text = ledger.read_text() if ledger.exists() else ""
            handled = f'"libvirt:{case.argv[2]}"' in text
        return handled and any(marker in case.stdin for marker in ("hostdev", "claim"))
    if hook == "oci":
        return case.setup == "cdi_poisoned"
    if hook == "proxmox":
        return case.argv[2] == "100"
    return False


def test_the_table_has_every_command_and_hook() -> None:
    found = {" ".join(case.argv[:2]) for case in CASES} | {
        case.argv[0] for case in CASES if case.argv
    }
    cli_ = build(COMMANDS)
    missing = []
    for name in cli_.list_commands(click.Context(cli_)):
        command = cli_.get_command(click.Context(cli_), name)
        assert command is not None
        subs = (
            command.list_commands(click.Context(command))
            if isinstance(command, click.Group)
            else []
        )
        missing += [w for w in [name, *(f"{name} {sub}" for sub in subs)] if w not in found]
    missing += [
        h for h in ("hook qemu", "hook oci", "hook oci-inject", "hook proxmox") if h not in found
    ]
    assert not missing, f"commands the table does not run both ways: {missing}"


def test_a_command_from_another_mount_namespace_runs_in_process(
    sim: SimEnv, server: Served
) -> None:
    """A client whose filesystem is not the server's (here a read-only bind mount of
    the state directory in a namespace of its own) is never served: the child would
    see another filesystem.  It runs in-process, and the kernel refuses its write."""
    sim.state_dir.mkdir(mode=0o700)
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    command = [
        "/usr/bin/unshare",
        "-m",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        script,
        "-",
        str(sim.state_dir),
        sys.executable,
        "-m",
        "charly_arbiter",
        "acquire",
        "--shared",
        "container:c",
        "gpu0",
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=server.env(sim, mode=""),
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 1 and "read-only" in result.stderr, result.stderr
    server.wait_in_log("another mnt namespace")
