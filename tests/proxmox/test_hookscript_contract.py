"""The hookscript's contract (docs/proxmox.md), without a Proxmox stand-in.

qemu-server starts the VM whenever `pre-start` exits 0, so a refusal that
exits 0 hands the GPU to a second VM; a `post-stop` that fails only leaves a
warning in the task log, but must never hang or print to stdout.  These run the
hook as qemu-server does (exec_hookscript: `SCRIPT VMID PHASE`, its own
process, stdin not used) against a simulated host whose holders are simulated
too, directly and through hooks/proxmox.  The VMID is untrusted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from simhosts import gpu

from charly_arbiter.core.ledger import Ledger
from tests.conftest import DEFAULT_CONFIG, DEFAULT_HOST, SimEnv

REPO = Path(__file__).resolve().parents[2]
HOST = DEFAULT_HOST + "\n" + gpu("0000:0c:00.0", group=14, model="2204")


@pytest.fixture
def sim(make_sim: Callable[..., SimEnv], tmp_path: Path) -> SimEnv:
    pve = tmp_path / "sim" / "pve"
    config = (
        DEFAULT_CONFIG
        + '\n[tokens.gpu2]\naddress = "0000:0c:00.0"\n'
        + f'\n[proxmox]\nconfig_dir = "{pve}"\nlock_dir = "{pve.parent / "lock"}"\nnode = "pve1"\n'
    )
    env = make_sim(host=HOST, config=config)
    for directory in ("qemu-server", "lxc", "mapping"):
        (pve / directory).mkdir(parents=True)
    return env


def write_vm(sim: SimEnv, vmid: str, text: str) -> Path:
    path = sim.root / "pve" / "qemu-server" / f"{vmid}.conf"
    path.write_text(text)
    return path


def hook(
    sim: SimEnv, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "charly_arbiter", "hook", "proxmox", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env
        or {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "CHARLY_ARBITER_CONFIG": str(sim.config_path),
        },
        cwd=sim.root,
        timeout=120,
    )


def one_sentence(result: subprocess.CompletedProcess[str], *names: str) -> str:
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("charly-arbiter: "), result.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def leases(sim: SimEnv) -> dict[str, object]:
    return {lease.claimant: lease for lease in Ledger(sim.state_dir).read().leases}


def test_pre_start_claims_silently_and_post_stop_releases(sim: SimEnv) -> None:
    write_vm(sim, "100", "hostpci0: 0c:00,pcie=1\nname: vm\n")
    granted = hook(sim, "100", "pre-start")
    assert (granted.returncode, granted.stdout, granted.stderr) == (0, "", "")
    assert list(leases(sim)) == ["proxmox:100"]
    released = hook(sim, "100", "post-stop")
    assert (released.returncode, released.stdout, released.stderr) == (0, "", "")
    assert leases(sim) == {}


def test_a_refused_pre_start_exits_3_naming_the_token_and_the_holder(sim: SimEnv) -> None:
    write_vm(sim, "100", "hostpci0: 0c:00\n")
    write_vm(sim, "101", "hostpci0: 0c:00.0\n")
    assert hook(sim, "100", "pre-start").returncode == 0
    refused = hook(sim, "101", "pre-start")
    assert refused.returncode == 3
    one_sentence(refused, "proxmox:101", "gpu2", "proxmox:100")
    assert list(leases(sim)) == ["proxmox:100"]
    # Proxmox runs no post-stop after a refused start; one run by hand changes nothing.
    assert hook(sim, "101", "post-stop").returncode == 0
    assert list(leases(sim)) == ["proxmox:100"]


def test_a_holder_that_may_not_be_stopped_refuses(sim: SimEnv) -> None:
    write_vm(sim, "100", "hostpci0: 0b:00.0\n")
    refused = hook(sim, "100", "pre-start")
    assert refused.returncode == 3
    one_sentence(refused, "gpu1", "systemd:display-manager.service")


@pytest.mark.parametrize("phase", ["post-start", "pre-stop", "unknown-phase"])
def test_other_phases_of_a_vm_without_a_lease_exit_0_at_once(sim: SimEnv, phase: str) -> None:
    write_vm(sim, "100", "hostpci0: 0c:00\n")
    result = hook(sim, "100", phase)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert not sim.state_dir.exists()


@pytest.mark.parametrize("args", [[], ["100"], ["100", "pre-start", "x"]])
def test_bad_arguments_are_a_usage_error(sim: SimEnv, args: list[str]) -> None:
    result = hook(sim, *args)
    assert result.returncode == 2 and result.stdout == "" and "usage" in result.stderr


HOSTILE = [
    "../../escaped",
    "99",
    "1000000000",
    "0100",
    "100\n",
    "\uff11\uff10\uff10",
    "-1",
    "",
    "1e3",
]


@pytest.mark.parametrize("vmid", HOSTILE, ids=[repr(v) for v in HOSTILE])
def test_a_hostile_vmid_fails_closed_at_pre_start_and_touches_nothing(
    sim: SimEnv, vmid: str
) -> None:
    before = sorted(p for p in sim.root.rglob("*"))
    refused = hook(sim, vmid, "pre-start")
    assert refused.returncode == 2  # usage: Proxmox never runs it so
    line = one_sentence(refused, "not a Proxmox VMID")
    assert repr(vmid) in line
    released = hook(sim, vmid, "post-stop")
    assert (released.returncode, released.stdout, released.stderr) == (0, "", "")
    assert sorted(p for p in sim.root.rglob("*")) == before


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("hostpci0: 0A:00.0\n", ("proxmox:100", "hostpci0", "not a PCI id")),
        ("hostpci2: host=0a:00,mapping=pool\n", ("hostpci2", "both host and mapping")),
        ("hostpci0: mapping=missing\n", ("proxmox:100", "'missing'", "no such PCI mapping")),
        ("#charly-arbiter%3A mode=maybe\n", ("proxmox:100", "override", "mode='maybe'")),
        ("tags: charly-preemptibel\nhostpci0: 0c:00\n", ("charly-preemptibel",)),
    ],
)
def test_a_configuration_it_cannot_read_refuses_the_start(
    sim: SimEnv, text: str, names: tuple[str, ...]
) -> None:
    write_vm(sim, "100", text)
    refused = hook(sim, "100", "pre-start")
    assert refused.returncode == 1
    one_sentence(refused, *names)
    assert (hook(sim, "100", "post-stop").returncode, leases(sim)) == (0, {})


def test_a_configuration_larger_than_the_bound_is_refused(sim: SimEnv) -> None:
    write_vm(sim, "100", "hostpci0: 0c:00\n" + "#" + "x" * (1 << 20) + "\n")
    refused = hook(sim, "100", "pre-start")
    assert refused.returncode == 1
    one_sentence(refused, "larger than 1 MiB")


def test_a_container_is_not_a_claimant(sim: SimEnv) -> None:
    (sim.root / "pve" / "lxc" / "200.conf").write_text("dev0: /dev/dri/renderD128\n")
    result = hook(sim, "200", "pre-start")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert leases(sim) == {}


def test_a_vm_this_node_has_no_file_of_is_refused_at_pre_start(sim: SimEnv) -> None:
    refused = hook(sim, "100", "pre-start")
    assert refused.returncode == 1
    one_sentence(refused, "proxmox:100", "no configuration on this node")
    assert hook(sim, "100", "post-stop").returncode == 0


def test_snapshots_and_pending_changes_are_not_what_it_starts_with(sim: SimEnv) -> None:
    write_vm(sim, "100", "name: vm\n\n[PENDING]\nhostpci0: 0c:00\n\n[snap]\nhostpci0: 0b:00\n")
    result = hook(sim, "100", "pre-start")
    assert (result.returncode, result.stderr) == (0, "")
    assert leases(sim) == {}


def corrupt_ledger(sim: SimEnv) -> None:
    sim.state_dir.mkdir(mode=0o700)
    for name in ("ledger.toml", "ledger.toml.bak"):
        (sim.state_dir / name).write_text('checksum = "sha256:00"\nschema = 1\n"proxmox:100"\n')
        (sim.state_dir / name).chmod(0o600)


def state_dir_is_a_file(sim: SimEnv) -> None:
    sim.state_dir.write_text("not a directory\n")


def host_unreadable(sim: SimEnv) -> None:
    (sim.sim_dir / "host.toml").write_text("[[[ not toml\n")


def config_broken(sim: SimEnv) -> None:
    sim.config_path.write_text(sim.config_path.read_text() + '\n[proxmox.x]\ny = "z"\n')


BREAKAGES = {
    "corrupt-ledger": corrupt_ledger,
    "internal-error": state_dir_is_a_file,
    "bad-host": host_unreadable,
    "bad-config": config_broken,
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_on_errors_pre_start_refuses_and_post_start_and_post_stop_exit_0(
    sim: SimEnv, breakage: str
) -> None:
    write_vm(sim, "100", "hostpci0: 0c:00\n")
    BREAKAGES[breakage](sim)
    refused = hook(sim, "100", "pre-start")
    # (A configuration that is not valid is a usage error, 2; the others are errors.)
    assert refused.returncode == (2 if breakage == "bad-config" else 1), refused
    assert refused.stdout == "", refused
    assert refused.stderr.splitlines()[-1].startswith("charly-arbiter: ")
    assert "Traceback" not in refused.stderr
    for phase in ("post-start", "post-stop"):
        result = hook(sim, "100", phase)
        assert (result.returncode, result.stdout) == (0, ""), (phase, result.stderr)
        assert "Traceback" not in result.stderr


def test_post_stop_releases_a_vm_whose_hostpci_lines_are_gone(sim: SimEnv) -> None:
    """The fast path reads the ledger at post-stop: qemu-server applies pending changes
    (a deleted hostpci line) at the stop, before post-stop runs."""
    path = write_vm(sim, "100", "hostpci0: 0c:00\n")
    assert hook(sim, "100", "pre-start").returncode == 0
    path.write_text("name: vm\n")
    assert (hook(sim, "100", "post-stop").returncode, leases(sim)) == (0, {})


# -- through hooks/proxmox ---------------------------------------------------------------------


def installed(sim: SimEnv, program: Path) -> Path:
    script = (REPO / "hooks" / "proxmox").read_text()
    snippet = sim.root / "charly-arbiter.sh"
    snippet.write_text(script.replace("/usr/bin/charly-arbiter", str(program)))
    snippet.chmod(0o755)
    return snippet


def wrapper(sim: SimEnv) -> Path:
    program = sim.root / "charly-arbiter"
    program.write_text(
        "#!/bin/sh\n"
        f"export CHARLY_ARBITER_CONFIG='{sim.config_path}' PYTHONPATH='{REPO}'\n"
        f"exec '{sys.executable}' -m charly_arbiter \"$@\"\n"
    )
    program.chmod(0o755)
    return program


def run_script(snippet: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(snippet), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=120,
    )


def test_the_script_passes_exit_codes_through_and_keeps_stdout_empty(sim: SimEnv) -> None:
    snippet = installed(sim, wrapper(sim))
    write_vm(sim, "100", "hostpci0: 0c:00\n")
    write_vm(sim, "101", "hostpci0: 0c:00\n")
    assert (run_script(snippet, "100", "pre-start").returncode, leases(sim).keys()) == (
        0,
        {"proxmox:100"},
    )
    refused = run_script(snippet, "101", "pre-start")
    assert refused.returncode == 3 and refused.stdout == "" and "gpu2" in refused.stderr
    assert run_script(snippet, "100", "post-stop").returncode == 0
    assert leases(sim) == {}


def test_the_script_lets_only_pre_start_post_start_and_post_stop_through(
    sim: SimEnv, tmp_path: Path
) -> None:
    fake = tmp_path / "fake"
    fake.write_text('#!/bin/sh\necho "ran $*" >&2\necho stdout\nexit 3\n')
    fake.chmod(0o755)
    snippet = installed(sim, fake)
    for phase in ("post-start", "post-stop"):
        assert run_script(snippet, "100", phase).returncode == 3
    for phase in ("pre-stop", "whatever"):
        assert (
            run_script(snippet, "100", phase).returncode,
            run_script(snippet, "100", phase).stderr,
        ) == (0, "")
    ran = run_script(snippet, "100", "pre-start")
    # Exit status through, and the program's stdout sent to stderr.
    assert (ran.returncode, ran.stdout) == (3, "")
    assert ran.stderr.splitlines() == ["ran hook proxmox 100 pre-start", "stdout"]


@pytest.mark.parametrize("program", ["absent", "not-executable", "dangling-link"])
def test_the_script_does_nothing_when_the_package_is_gone(sim: SimEnv, program: str) -> None:
    target = sim.root / "gone"
    if program == "not-executable":
        target.write_text("#!/bin/sh\nexit 1\n")
        target.chmod(0o644)
    elif program == "dangling-link":
        target.symlink_to(sim.root / "removed")
    snippet = installed(sim, target)
    for phase in ("pre-start", "post-stop"):
        result = run_script(snippet, "100", phase)
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert os.access(snippet, os.X_OK)
