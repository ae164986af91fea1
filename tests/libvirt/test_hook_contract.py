"""The qemu hook's contract (docs/libvirt.md), on the simulated host, without libvirtd.

libvirt starts a VM whenever `prepare` exits 0, so a refusal that exits 0 hands
the GPU to a second VM.  The real-libvirtd tests (tests/libvirt/test_e2e.py) are
slow; these run the hook the way libvirt does, on every test run: its own process,
`charly-arbiter hook qemu GUEST OPERATION SUB-OPERATION EXTRA`, the domain XML on
stdin, a minimal environment and CHARLY_ARBITER_CONFIG pointing at a simulated
host; and through the shell script hooks/qemu where the script is part of the
path (exit codes, a removed package).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
from simhosts import gpu

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Lease
from tests.conftest import DEFAULT_CONFIG, DEFAULT_HOST, SimEnv

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "https://charly-arbiter.org/xmlns/claim/1"
ADDRESSES = {"gpu0": "0000:0a:00.0", "gpu1": "0000:0b:00.0", "gpu2": "0000:0c:00.0"}

# The default host (gpu0 with preemptible holders, gpu1 with a display manager that
# may not be stopped) plus gpu2, which nothing holds: claiming and releasing it
# stops nothing, so its release finishes inside the hook.
HOST = DEFAULT_HOST + "\n" + gpu("0000:0c:00.0", group=14, model="2204")
CONFIG = (
    DEFAULT_CONFIG
    + """
[tokens.gpu2]
address = "0000:0c:00.0"
"""
)
IGNORED = [
    ("start", "begin"),
    ("started", "begin"),
    ("stopped", "end"),
    ("restore", "begin"),
    ("attach", "begin"),
    ("prepare", "end"),
]
MIB = 1 << 20


@dataclass(frozen=True)
class HookRun:
    returncode: int
    stdout: bytes
    stderr: str

    def lines(self) -> list[str]:
        return self.stderr.splitlines()


Hook = Callable[..., HookRun]


def domain_xml(
    name: str = "vm",
    *,
    pci: tuple[str, ...] = (),
    claim_tokens: tuple[str, ...] = (),
    mode: str = "",
    description_bytes: int = 0,
) -> bytes:
    """A domain XML document: PCI hostdevs of tokens, and/or the claim element."""
    hostdevs = "".join(
        "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
        f"<address domain='0x0000' bus='0x{ADDRESSES[token][5:7]}' slot='0x00' "
        "function='0x0'/></source></hostdev>"
        for token in pci
    )
    metadata = ""
    if claim_tokens or mode:
        body = "".join(f"<ca:token>{token}</ca:token>" for token in claim_tokens)
        mode_attribute = f' mode="{mode}"' if mode else ""
        metadata = (
            f'<metadata><ca:claim xmlns:ca="{NAMESPACE}"{mode_attribute}>{body}</ca:claim>'
            "</metadata>"
        )
    description = f"<description>{'x' * description_bytes}</description>"
    return (
        f"<domain type='kvm'><name>{escape(name)}</name>{description}{metadata}"
        f"<memory unit='MiB'>64</memory><devices>{hostdevs}</devices></domain>"
    ).encode()


def minimal_env(sim: SimEnv) -> dict[str, str]:
    """What libvirt gives a hook, plus where the configuration and the checkout are."""
    return {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C",
        "PYTHONPATH": str(REPO),
        "CHARLY_ARBITER_CONFIG": str(sim.config_path),
    }


def run_hook(
    sim: SimEnv,
    argv: list[str],
    stdin: bytes,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> HookRun:
    result = subprocess.run(
        argv,
        input=stdin,
        capture_output=True,
        env=env or minimal_env(sim),
        cwd=cwd or sim.root,
        timeout=120,
    )
    return HookRun(result.returncode, result.stdout, result.stderr.decode(errors="replace"))


def module_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "charly_arbiter", "hook", *args]


@pytest.fixture
def sim(make_sim: Callable[..., SimEnv]) -> SimEnv:
    return make_sim(host=HOST, config=CONFIG)


def hook_script(directory: Path, program: Path) -> Path:
    """hooks/qemu as installed, pointed at `program` instead of /usr/bin/charly-arbiter."""
    script = (REPO / "hooks" / "qemu").read_text()
    assert "/usr/bin/charly-arbiter" in script
    installed = directory / "qemu-hook"
    installed.write_text(script.replace("/usr/bin/charly-arbiter", str(program)))
    installed.chmod(0o755)
    return installed


def module_hook(sim: SimEnv) -> Hook:
    """`python -m charly_arbiter hook qemu GUEST OPERATION…`, as the package's hook runs it."""

    def by_module(guest: str, *operation: str, stdin: bytes = b"") -> HookRun:
        return run_hook(sim, module_argv("qemu", guest, *operation), stdin)

    return by_module


@pytest.fixture(params=["module", "hooks/qemu"])
def hook(request: pytest.FixtureRequest, sim: SimEnv) -> Hook:
    """The hook program itself, or hooks/qemu (run with libvirt's bare environment)
    pointed at a wrapper that runs this checkout: where its exit code must pass through."""
    if request.param == "module":
        return module_hook(sim)
    wrapper = sim.root / "charly-arbiter"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"export CHARLY_ARBITER_CONFIG='{sim.config_path}' PYTHONPATH='{REPO}'\n"
        f"exec '{sys.executable}' -m charly_arbiter \"$@\"\n"
    )
    wrapper.chmod(0o755)
    script = hook_script(sim.root, wrapper)

    def by_script(guest: str, *operation: str, stdin: bytes = b"") -> HookRun:
        return run_hook(sim, [str(script), guest, *operation], stdin, env={"PATH": "/usr/bin:/bin"})

    return by_script


def lease(sim: SimEnv, claimant: str) -> Lease | None:
    return Ledger(sim.state_dir).read().lease_of(claimant)


def assert_one_message(run: HookRun, *names: str) -> None:
    """One line on stderr, `charly-arbiter: ` and one or two sentences naming `names`."""
    assert run.stdout == b""
    assert len(run.lines()) == 1, run.stderr
    line = run.lines()[0]
    assert line.startswith("charly-arbiter: "), line
    # A sentence ends at a full stop before a capital letter or the end ("e.g. 0000:…" does not).
    sentences = [s for s in re.split(r"\.(?=\s+[A-Z]|\s*$)", line) if s.strip()]
    assert 1 <= len(sentences) <= 2, line
    for name in names:
        assert name in line, (name, line)


# -- prepare ---------------------------------------------------------------------------


def test_a_granted_prepare_exits_0_silently_and_holds_the_lease(hook: Hook, sim: SimEnv) -> None:
    run = hook("win11", "prepare", "begin", "-", stdin=domain_xml("win11", pci=("gpu2",)))
    assert (run.returncode, run.stdout, run.stderr) == (0, b"", "")
    held = lease(sim, "libvirt:win11")
    assert held is not None and held.tokens == ("gpu2",) and held.mode == "exclusive"


def test_a_refused_prepare_exits_non_zero_naming_the_token_and_its_holder(
    hook: Hook, sim: SimEnv
) -> None:
    first = hook("win11", "prepare", "begin", "-", stdin=domain_xml("win11", pci=("gpu2",)))
    assert first.returncode == 0, first.stderr
    second = hook("linux", "prepare", "begin", "-", stdin=domain_xml("linux", pci=("gpu2",)))
    assert second.returncode != 0
    assert_one_message(second, "gpu2", "libvirt:win11", "libvirt:linux")
    assert lease(sim, "libvirt:linux") is None
    assert lease(sim, "libvirt:win11") is not None


def test_a_holder_that_may_not_be_stopped_refuses_prepare(hook: Hook, sim: SimEnv) -> None:
    run = hook("win11", "prepare", "begin", "-", stdin=domain_xml("win11", pci=("gpu1",)))
    assert run.returncode != 0
    assert_one_message(run, "gpu1", "systemd:display-manager.service")
    assert Ledger(sim.state_dir).read().leases == ()


def test_release_gives_the_claim_back_and_exits_0(hook: Hook, sim: SimEnv) -> None:
    xml = domain_xml("win11", pci=("gpu2",))
    assert hook("win11", "prepare", "begin", "-", stdin=xml).returncode == 0
    run = hook("win11", "release", "end", "destroyed", stdin=xml)
    assert (run.returncode, run.stdout, run.stderr) == (0, b"", "")
    assert lease(sim, "libvirt:win11") is None


def test_release_of_a_domain_without_a_lease_is_a_quiet_no_op(hook: Hook, sim: SimEnv) -> None:
    run = hook("never", "release", "end", "-", stdin=domain_xml("never", pci=("gpu2",)))
    assert (run.returncode, run.stdout, run.stderr) == (0, b"", "")


def test_reconnect_keeps_the_lease_and_exits_0(hook: Hook, sim: SimEnv) -> None:
    xml = domain_xml("win11", pci=("gpu2",))
    assert hook("win11", "prepare", "begin", "-", stdin=xml).returncode == 0
    run = hook("win11", "reconnect", "begin", "-", stdin=xml)
    assert (run.returncode, run.stdout) == (0, b"")
    assert lease(sim, "libvirt:win11") is not None


# -- migrate ---------------------------------------------------------------------------


def test_migrate_of_an_exclusive_claimant_is_refused(hook: Hook, sim: SimEnv) -> None:
    run = hook("win11", "migrate", "begin", "-", stdin=domain_xml("win11", pci=("gpu2",)))
    assert run.returncode != 0
    assert_one_message(run, "libvirt:win11", "gpu2", "migrate")


@pytest.mark.parametrize(
    "xml",
    [domain_xml("vm", claim_tokens=("gpu2",), mode="shared"), domain_xml("vm")],
    ids=["shared-claim", "no-claim"],
)
def test_migrate_of_a_shared_or_unclaimed_domain_is_allowed(sim: SimEnv, xml: bytes) -> None:
    run = module_hook(sim)("vm", "migrate", "begin", "-", stdin=xml)
    assert (run.returncode, run.stdout, run.stderr) == (0, b"", "")


# -- operations the hook does not handle -------------------------------------------------


@pytest.mark.parametrize(("operation", "sub_operation"), IGNORED)
def test_other_operations_exit_0_at_once_without_reading_stdin(
    sim: SimEnv, operation: str, sub_operation: str
) -> None:
    """stdin stays open and unwritten: a hook that waited for the XML would hang here."""
    child = subprocess.Popen(
        module_argv("qemu", "win11", operation, sub_operation, "-"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=minimal_env(sim),
        cwd=sim.root,
    )
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    try:
        returncode = child.wait(timeout=15)
        stdout, stderr = child.stdout.read(), child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pipe in (child.stdin, child.stdout, child.stderr):
            pipe.close()
    assert (returncode, stdout, stderr) == (0, b"", b"")
    assert not (sim.state_dir / "ledger.toml").exists()


def test_another_driver_than_qemu_is_not_the_hooks_business(sim: SimEnv) -> None:
    run = run_hook(
        sim, module_argv("lxc", "c1", "prepare", "begin", "-"), domain_xml("c1", pci=("gpu2",))
    )
    assert (run.returncode, run.stdout, run.stderr) == (0, b"", "")
    assert not (sim.state_dir / "ledger.toml").exists()


def test_a_domain_without_a_claim_passes_quietly(hook: Hook, sim: SimEnv) -> None:
    run = hook("plain", "prepare", "begin", "-", stdin=domain_xml("plain"))
    assert (run.returncode, run.stdout, run.stderr) == (0, b"", "")
    assert not (sim.state_dir / "ledger.toml").exists()


@pytest.mark.parametrize(
    "args",
    [[], ["qemu"], ["qemu", "vm"], ["qemu", "vm", "prepare"], ["finish-release", "x"]],
    ids=["nothing", "driver-only", "no-operation", "no-sub-operation", "detached-bad"],
)
def test_bad_arguments_are_a_usage_error_on_stderr(sim: SimEnv, args: list[str]) -> None:
    run = run_hook(sim, module_argv(*args), domain_xml("vm", pci=("gpu2",)))
    assert run.returncode == 2
    assert run.stdout == b""
    assert "usage" in run.stderr


# -- errors: prepare refuses, release and reconnect still exit 0 -----------------------------


def corrupt_ledger(sim: SimEnv) -> None:
    """A ledger and a backup that both fail their checksum: nothing may be trusted."""
    sim.state_dir.mkdir(mode=0o700)
    for name in ("ledger.toml", "ledger.toml.bak"):
        (sim.state_dir / name).write_text('checksum = "sha256:00"\nschema = 1\n')
        (sim.state_dir / name).chmod(0o600)


def state_dir_is_a_file(sim: SimEnv) -> None:
    """Not an ArbiterError: the hook's boundary turns it into an internal error."""
    sim.state_dir.write_text("not a directory\n")


def config_missing(sim: SimEnv) -> None:
    sim.config_path.unlink()


def host_unreadable(sim: SimEnv) -> None:
    (sim.sim_dir / "host.toml").write_text("[[[ not toml\n")


BREAKAGES = {
    "corrupt-ledger": corrupt_ledger,
    "internal-error": state_dir_is_a_file,
    "no-config": config_missing,
    "bad-host": host_unreadable,
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_on_errors_prepare_refuses_and_release_and_reconnect_exit_0(
    sim: SimEnv, breakage: str
) -> None:
    BREAKAGES[breakage](sim)
    hook = module_hook(sim)
    xml = domain_xml("win11", pci=("gpu2",))
    prepare = hook("win11", "prepare", "begin", "-", stdin=xml)
    assert prepare.returncode != 0, prepare.stderr
    assert prepare.stdout == b""
    assert prepare.lines() and prepare.lines()[-1].startswith("charly-arbiter: ")
    assert "Traceback" not in prepare.stderr
    for operation in (["release", "end", "destroyed"], ["reconnect", "begin", "-"]):
        run = hook("win11", *operation, stdin=xml)
        assert (run.returncode, run.stdout) == (0, b""), (operation, run.stderr)
        assert "Traceback" not in run.stderr


# -- the XML is untrusted ---------------------------------------------------------------------


ODD = b"<name>vm-with-odd-xml</name>"
MALFORMED = {
    "truncated": b"<domain type='kvm'>" + ODD + b"<devices><hostdev mode='subsystem'",
    "doctype": b"<!DOCTYPE d [<!ENTITY e 'hostdev'>]><domain>" + ODD + b"&e;</domain>",
    "not-a-domain": b"<hostdev mode='subsystem' type='pci'/>",
    "bad-address": b"<domain>" + ODD + b"<devices><hostdev mode='subsystem' type='pci'>"
    b"<source><address bus='0xzz' slot='0x00'/></source></hostdev></devices></domain>",
    "not-utf8": b"<domain><name>\xff\xfe</name><devices><hostdev/></devices></domain>",
}


@pytest.mark.parametrize("document", MALFORMED)
def test_malformed_xml_refuses_prepare_clearly_and_release_exits_0(
    sim: SimEnv, document: str
) -> None:
    hook = module_hook(sim)
    prepare = hook("vm-with-odd-xml", "prepare", "begin", "-", stdin=MALFORMED[document])
    assert prepare.returncode != 0
    assert_one_message(prepare, "vm-with-odd-xml", "XML")
    release = hook("vm-with-odd-xml", "release", "end", "-", stdin=MALFORMED[document])
    assert (release.returncode, release.stdout) == (0, b"")
    assert Ledger(sim.state_dir).read().leases == ()


def test_a_gpu_hostdev_after_a_large_description_is_claimed(sim: SimEnv) -> None:
    """A claim may not hide behind 2 MiB of text: not read is not "no claim"."""
    xml = domain_xml("big", pci=("gpu2",), description_bytes=2 * MIB)
    hook = module_hook(sim)
    prepare = hook("big", "prepare", "begin", "-", stdin=xml)
    assert (prepare.returncode, prepare.stdout) == (0, b""), prepare.stderr
    held = lease(sim, "libvirt:big")
    assert held is not None and held.tokens == ("gpu2",)
    other = hook("other", "prepare", "begin", "-", stdin=domain_xml("other", pci=("gpu2",)))
    assert other.returncode != 0
    release = hook("big", "release", "end", "-", stdin=xml)
    assert (release.returncode, release.stdout) == (0, b"")
    assert lease(sim, "libvirt:big") is None


def test_xml_above_the_bound_is_refused_at_prepare(sim: SimEnv) -> None:
    """Above a generous bound (16 MiB; libvirt's own is 10 MiB) the hook cannot know
    what the rest claims: it refuses with a message, and release still exits 0."""
    xml = domain_xml("huge", pci=("gpu2",), description_bytes=64 * MIB + 4096)
    hook = module_hook(sim)
    prepare = hook("huge", "prepare", "begin", "-", stdin=xml)
    assert prepare.returncode != 0
    assert_one_message(prepare, "huge")
    assert re.search(r"larger|too large|too big|exceeds|bytes|MiB", prepare.stderr), prepare.stderr
    assert not (sim.state_dir / "ledger.toml").exists() or lease(sim, "libvirt:huge") is None
    release = hook("huge", "release", "end", "-", stdin=xml)
    assert (release.returncode, release.stdout) == (0, b"")


# -- the guest name is untrusted ----------------------------------------------------------------

HOSTILE = {
    # libvirt refuses a '/' in a domain's name, and so does the arbiter (exit 2 at
    # prepare): the two with one test that such a name fails closed and stays no path.
    "dot-dot": "../../escaped",
    "dots": "..escaped..",
    "absolute": "{root}/escaped-absolute",
    "spaces-and-shell": "my vm; $(touch escaped) `x`",
    # 130 two-byte characters are 260 bytes, more than a file name may have:
    # a name used as a path component would fail.
    "long": "\u00e9" * 130,
}


def every_path(root: Path) -> Iterator[Path]:
    for directory, subdirectories, files in os.walk(root):
        for name in [*subdirectories, *files]:
            yield Path(directory) / name


# The hook run under a Python audit hook that logs every file-system call (open, mkdir,
# rename, unlink, ...) whose path contains NEEDLE: a path made from the guest name is
# caught even when the file is gone again by the time the hook exits.
AUDITED_HOOK = """
import os, sys
log, needle = open(sys.argv[1], "a"), sys.argv[2]
NOT_PATHS = ("os.putenv", "os.unsetenv")
def audit(event, args):
    if event != "open" and not event.startswith(("os.", "shutil.")) or event in NOT_PATHS:
        return
    for arg in args:
        if isinstance(arg, (str, bytes, os.PathLike)) and needle in os.fsdecode(arg):
            log.write(f"{event} {os.fsdecode(arg)!r}\\n")
            log.flush()
sys.addaudithook(audit)
from charly_arbiter.cli import main
main(sys.argv[3:])
"""


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_guest_name_never_becomes_a_path(sim: SimEnv, kind: str) -> None:
    """Through a whole life (prepare, reconnect, migrate, release), run from a deep
    working directory, no file-system call names the guest, and nothing is left
    but the state files the hook always has."""
    guest = HOSTILE[kind].format(root=sim.root)
    needle = "escaped" if "escaped" in guest else guest
    claimant = f"libvirt:{guest}"
    workdir = sim.root / "cwd" / "a" / "b"
    workdir.mkdir(parents=True)
    audit_log = sim.root / "audit.log"
    audit_log.touch()
    before = set(every_path(sim.root))
    xml = domain_xml(guest, pci=("gpu2",))

    def hook(*operation: str) -> HookRun:
        argv = [sys.executable, "-c", AUDITED_HOOK, str(audit_log), needle, "hook", "qemu"]
        return run_hook(sim, [*argv, guest, *operation], xml, cwd=workdir)

    legal = "/" not in guest
    granted = hook("prepare", "begin", "-")
    if legal:
        assert (granted.returncode, granted.stdout, granted.stderr) == (0, b"", "")
    else:
        assert granted.returncode == 2 and "cannot contain '/'" in granted.stderr
    assert (lease(sim, claimant) is not None) == legal
    assert hook("reconnect", "begin", "-").returncode == 0
    assert hook("migrate", "begin", "-").returncode != 0
    assert (lease(sim, claimant) is not None) == legal
    released = hook("release", "end", "-")
    assert (released.returncode, released.stdout) == (0, b"")
    assert lease(sim, claimant) is None

    assert audit_log.read_text() == ""
    created = set(every_path(sim.root)) - before
    # the ledger and its companions, and the simulated host's own state: nothing else
    places = (sim.state_dir, sim.sim_dir)
    strays = [path for path in created if not any(path.is_relative_to(p) for p in places)]
    assert strays == []
    assert list(workdir.iterdir()) == []


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_guest_name_is_shown_exactly_in_messages(sim: SimEnv, kind: str) -> None:
    """`libvirt:../../x` is what the operator must type: a message shows it as it is."""
    guest = HOSTILE[kind].format(root=sim.root)
    claimant = f"libvirt:{guest}"
    hook = module_hook(sim)
    xml = domain_xml(guest, pci=("gpu2",))
    if "/" in guest:  # no claimant can have it: its own start is refused, naming it
        own = hook(guest, "prepare", "begin", "-", stdin=xml)
        assert own.returncode == 2
        assert_one_message(own, claimant)
        return
    assert hook(guest, "prepare", "begin", "-", stdin=xml).returncode == 0
    refused = hook("other", "prepare", "begin", "-", stdin=domain_xml("other", pci=("gpu2",)))
    assert refused.returncode != 0
    assert_one_message(refused, "libvirt:other", "gpu2", claimant)
    migrate = hook(guest, "migrate", "begin", "-", stdin=xml)
    assert migrate.returncode != 0
    assert_one_message(migrate, claimant)


def test_a_guest_name_with_a_newline_is_refused_on_one_line(sim: SimEnv) -> None:
    hook = module_hook(sim)
    xml = domain_xml("two lines", pci=("gpu2",))
    prepare = hook("two\nlines", "prepare", "begin", "-", stdin=xml)
    assert prepare.returncode != 0
    assert_one_message(prepare, "two\\nlines")
    release = hook("two\nlines", "release", "end", "-", stdin=xml)
    assert (release.returncode, release.stdout) == (0, b"")
    assert Ledger(sim.state_dir).read().leases == ()


# -- hooks/qemu without its program -----------------------------------------------------------


@pytest.mark.parametrize("program", ["absent", "not-executable", "dangling-link"])
@pytest.mark.parametrize(
    "operation",
    [["prepare", "begin", "-"], ["release", "end", "destroyed"], ["migrate", "begin", "-"]],
    ids=["prepare", "release", "migrate"],
)
def test_the_script_does_nothing_when_the_package_is_gone(
    sim: SimEnv, program: str, operation: list[str]
) -> None:
    """A removed package never blocks a VM: exit 0, nothing on stdout or stderr."""
    target = sim.root / "charly-arbiter"
    if program == "not-executable":
        target.write_text("#!/bin/sh\necho should not run >&2\nexit 1\n")
        target.chmod(0o644)
    elif program == "dangling-link":
        target.symlink_to(sim.root / "removed")
    script = hook_script(sim.root, target)
    run = run_hook(
        sim,
        [str(script), "win11", *operation],
        domain_xml("win11", pci=("gpu2",)),
        env={"PATH": "/usr/bin:/bin"},
    )
    assert (run.returncode, run.stdout, run.stderr) == (0, b"", "")
