"""The hook's path for a domain that claims nothing stays light: measured with
`python -X importtime` on the real hook process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLAIN = b"<domain type='qemu'><name>plain</name><devices><serial type='pty'/></devices></domain>"
HEAVY = ("libvirt", "pyudev", "pynvml", "click", "tomlkit", "portalocker")


def imported_modules(
    *args: str, stdin: bytes, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[bytes], set[str]]:
    """`charly-arbiter hook ARGS` with -X importtime, and what it imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "charly_arbiter", "hook", *args],
        input=stdin,
        capture_output=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **(env or {})},
        timeout=60,
    )
    return result, modules_in(result.stderr)


def modules_in(importtime: bytes) -> set[str]:
    """The modules -X importtime's lines on stderr name."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime.decode().splitlines()
        if line.startswith("import time:") and "|" in line
    }


@pytest.mark.parametrize(
    "operation",
    [["prepare", "begin", "-"], ["release", "end", "destroyed"], ["start", "begin", "-"]],
)
def test_no_claim_path_imports_nothing_heavy(operation: list[str]) -> None:
    result, modules = imported_modules("qemu", "plain", *operation, stdin=PLAIN)
    assert result.returncode == 0
    assert result.stdout == b""
    assert "charly_arbiter.libvirt.hook" in modules, (
        "no import was measured: the check would be empty"
    )
    heavy = {m for m in modules if m.split(".")[0] in HEAVY}
    assert heavy == set(), heavy
    for module in (
        "charly_arbiter.core.config",
        "charly_arbiter.core.ledger",
        "charly_arbiter.libvirt.domainxml",
    ):
        assert module not in modules
    assert "logging" not in modules


def test_fast_path_markers_match_the_claim_rules() -> None:
    from charly_arbiter.libvirt.domainxml import NAMESPACE
    from charly_arbiter.libvirt.hook import CLAIM_MARKERS

    assert set(CLAIM_MARKERS) == {b"hostdev", NAMESPACE.encode()}
    assert not any(marker in PLAIN for marker in CLAIM_MARKERS)


def script_with_fake(tmp_path: Path) -> Path:
    """hooks/qemu pointed at a fake charly-arbiter that shows what it was given."""
    fake = tmp_path / "charly-arbiter"
    fake.write_text('#!/bin/sh\nprintf "%s|" "$@" >&2; cat >&2; exit 3\n')
    fake.chmod(0o755)
    hook = tmp_path / "qemu"
    hook.write_text(
        (REPO / "hooks" / "qemu").read_text().replace("/usr/bin/charly-arbiter", str(fake))
    )
    hook.chmod(0o755)
    return hook


# Bytes a shell could mangle: escapes, format characters, UTF-8, CR, final newlines.
ODD_XML = (
    "<domain><name>n</name><description>100% \\n $(x) `y` \u00e9\r</description>"
    "<devices><hostdev mode='subsystem' type='pci'/></devices></domain>\n\n\n"
).encode()


def test_hook_script_hands_arguments_and_stdin_on_byte_for_byte(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(script_with_fake(tmp_path)), "odd name;$(x)", "prepare", "begin", "-"],
        input=ODD_XML,
        capture_output=True,
        timeout=10,
    )
    assert result.returncode == 3
    assert result.stdout == b""
    assert result.stderr == b"hook|qemu|odd name;$(x)|prepare|begin|-|" + ODD_XML


@pytest.mark.parametrize(
    ("operation", "xml"),
    [
        (["prepare", "begin", "-"], PLAIN),  # no hostdev, no claim element
        (["release", "end", "destroyed"], PLAIN),
        (["started", "begin", "-"], ODD_XML),  # an operation the arbiter does not handle
        (["stopped", "end", "-"], ODD_XML),
        (["prepare", "end", "-"], ODD_XML),
    ],
)
def test_hook_script_starts_no_python_where_none_is_needed(
    tmp_path: Path, operation: list[str], xml: bytes
) -> None:
    result = subprocess.run(
        [str(script_with_fake(tmp_path)), "vm", *operation],
        input=xml,
        capture_output=True,
        timeout=10,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


# -- the fast path's own decision: a hostdev that is not a GPU needs no Python beyond it --


def fake_sysfs(root: Path, devices: dict[str, tuple[str, int | None]]) -> Path:
    """A sysfs tree with `address -> (class, IOMMU group or None)`: the two things
    the fast path reads, laid out as the kernel lays them out."""
    for address, (pci_class, group) in devices.items():
        device = root / "bus/pci/devices" / address
        device.mkdir(parents=True)
        (device / "class").write_text(f"{pci_class}\n")
        if group is not None:
            members = root / "kernel/iommu_groups" / str(group) / "devices"
            members.mkdir(parents=True, exist_ok=True)
            (members / address).symlink_to(device)
            (device / "iommu_group").symlink_to(root / "kernel/iommu_groups" / str(group))
    return root


def pci_hostdev(source: str, guest: str = "0000:05:00.0", kind: str = "pci") -> str:
    def attributes(address: str) -> str:
        domain, bus, rest = address.split(":")
        slot, function = rest.split(".")
        return f"domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'"

    return (
        f"<hostdev mode='subsystem' type='{kind}' managed='yes'>"
        f"<source><address {attributes(source)}/></source>"
        f"<address type='pci' {attributes(guest)}/></hostdev>"
    )


def xml_with(*hostdevs: str, extra: str = "") -> bytes:
    return f"<domain><name>v</name>{extra}<devices>{''.join(hostdevs)}</devices></domain>".encode()


SYSFS = {
    "0000:03:00.0": ("0x020000", 5),  # a NIC alone in its group
    "0000:0a:00.0": ("0x030000", 12),  # a GPU
    "0000:0a:00.1": ("0x040300", 12),  # its HDMI audio function
    "0000:0c:00.0": ("0x0c0330", None),  # a USB controller, no IOMMU group
}


@pytest.mark.parametrize(
    ("xml", "expected"),
    [
        pytest.param(PLAIN, False, id="no-hostdev"),
        pytest.param(xml_with(pci_hostdev("0000:03:00.0")), False, id="a-nic"),
        pytest.param(xml_with(pci_hostdev("0000:0c:00.0")), False, id="usb-controller-by-slot"),
        pytest.param(xml_with(pci_hostdev("0000:0a:00.0")), True, id="a-gpu"),
        pytest.param(xml_with(pci_hostdev("0000:0a:00.1")), True, id="a-gpus-audio-alone"),
        pytest.param(
            xml_with(pci_hostdev("0000:03:00.0"), pci_hostdev("0000:0a:00.0")), True, id="nic+gpu"
        ),
        pytest.param(
            xml_with(pci_hostdev("0000:03:00.0", guest="0000:0a:00.0")), False, id="guest-address"
        ),
        pytest.param(xml_with(pci_hostdev("0000:0f:00.0")), True, id="not-in-sysfs"),
        pytest.param(xml_with(pci_hostdev("0000:03:00.0", kind="mdev")), True, id="mdev"),
        pytest.param(
            xml_with(
                "<hostdev mode='subsystem' type='usb'><source><vendor id='0x1'/></source></hostdev>"
            ),
            False,
            id="usb-device",
        ),
        pytest.param(
            xml_with(
                "<hostdev mode='subsystem' type='pci'><source><address bus='0x03'/>"
                "</source></hostdev>"
            ),
            True,
            id="odd-address",
        ),
        pytest.param(
            xml_with(
                pci_hostdev("0000:03:00.0"),
                extra="<metadata><ca:claim xmlns:ca='https://charly-arbiter.org/xmlns/claim/1'/>"
                "</metadata>",
            ),
            True,
            id="claim-element",
        ),
    ],
)
def test_the_fast_path_lets_go_only_what_cannot_claim(
    tmp_path: Path, xml: bytes, expected: bool
) -> None:
    from charly_arbiter.libvirt.hook import may_claim

    sys_root = fake_sysfs(tmp_path / "sys", SYSFS)
    config = tmp_path / "arbiter.toml"
    config.write_text('[tokens.gpu0]\naddress = "0000:0a:00.0"\n')
    assert may_claim(xml, str(sys_root), str(config)) is expected


def test_an_address_the_configuration_names_or_a_simulated_host_goes_the_slow_way(
    tmp_path: Path,
) -> None:
    from charly_arbiter.libvirt.hook import may_claim

    sys_root = str(fake_sysfs(tmp_path / "sys", SYSFS))
    nic = xml_with(pci_hostdev("0000:03:00.0"))
    config = tmp_path / "arbiter.toml"
    config.write_text('[tokens.nic]\naddress = "0000:03:00.0"\n')
    assert may_claim(nic, sys_root, str(config))
    config.write_text('host = "sim:/srv/sim"\n')
    assert may_claim(nic, sys_root, str(config))
    config.write_text('# host = "local" or "sim:DIR"\nhost = "local"\n')  # a comment says nothing
    assert not may_claim(nic, sys_root, str(config))
    config.unlink()
    assert not may_claim(nic, sys_root, str(config))


def test_a_nic_hostdev_is_let_go_without_the_configuration_the_ledger_or_typing(
    tmp_path: Path,
) -> None:
    """The whole hook process, measured with -X importtime, over a fake sysfs (with -S:
    what `site` imports is the installation's, not the hook's)."""
    sys_root = fake_sysfs(tmp_path / "sys", SYSFS)
    program = (
        "import sys; import charly_arbiter.libvirt.hook as hook; "
        f"hook.SYS_ROOT = {str(sys_root)!r}; "
        "sys.exit(hook.main(['qemu', 'nicvm', 'prepare', 'begin', '-']))"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-X", "importtime", "-c", program],
        input=xml_with(pci_hostdev("0000:03:00.0")),
        capture_output=True,
        cwd=REPO,
        # Not this machine's /etc: an installed package's configuration must not decide.
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "CHARLY_ARBITER_CONFIG": str(tmp_path / "none.toml"),
        },
        timeout=60,
    )
    modules = modules_in(result.stderr)
    assert (result.returncode, result.stdout) == (0, b""), result.stderr
    assert "charly_arbiter.libvirt.hook" in modules
    assert not {
        m
        for m in modules
        if m.startswith("charly_arbiter.")
        and m != "charly_arbiter.libvirt.hook"
        and m != "charly_arbiter.libvirt"
        and m != "charly_arbiter.hookio"  # what a hook says: os and sys only
    }
    assert not {"typing", "re", "logging", "click", "tomlkit"} & modules, modules


def test_both_hooks_scan_the_configuration_the_same_way(tmp_path: Path, monkeypatch) -> None:
    """hookio.scan_config, which the libvirt and the OCI fast paths share: the default
    path is core/config's; no file means the defaults; an unreadable one sends the
    hook the slow way (which says why); a simulated host is seen in the file or the
    environment."""
    from charly_arbiter.core.config import DEFAULT_CONFIG
    from charly_arbiter.hookio import DEFAULT_CONFIG as HOOK_DEFAULT
    from charly_arbiter.hookio import scan_config

    assert Path(HOOK_DEFAULT) == DEFAULT_CONFIG
    monkeypatch.delenv("CHARLY_ARBITER_HOST", raising=False)
    monkeypatch.delenv("CHARLY_ARBITER_CONFIG", raising=False)
    assert scan_config(str(tmp_path / "missing.toml")) == (False, b"")
    real = tmp_path / "arbiter.toml"
    real.write_bytes(b'[tokens.gpu0]\naddress = "0000:0a:00.0"\n')
    assert scan_config(str(real)) == (False, real.read_bytes())
    monkeypatch.setenv("CHARLY_ARBITER_CONFIG", str(real))
    assert scan_config(None) == (False, real.read_bytes())
    simulated = tmp_path / "sim.toml"
    simulated.write_bytes(b'  host = "sim:/tmp/x"\n')
    assert scan_config(str(simulated)) == (True, simulated.read_bytes())
    assert scan_config(str(tmp_path)) is None  # a directory: not readable as a file
    monkeypatch.setenv("CHARLY_ARBITER_HOST", "sim:/tmp/x")
    assert scan_config(str(tmp_path / "missing.toml")) == (True, b"")


# -- a release the ledger does not name (every refused start) --------------------------------

GPU_HOSTDEV_XML = xml_with(pci_hostdev("0000:0a:00.0"))
END = ("release", "end", "destroyed")


def _ledger_naming(state: Path, *claimants: str, holder: str | None = None) -> None:
    """A real ledger (core/ledger's own writer) with an active lease of each claimant,
    the first one having stopped `holder`."""
    from charly_arbiter.core.ledger import Ledger
    from charly_arbiter.core.model import Lease, LeaseState, LedgerState, Mode, StoppedHolder

    leases = tuple(
        Lease(
            claimant=claimant,
            mode=Mode.SHARED,
            tokens=("gpu1",),
            state=LeaseState.ACTIVE,
            transient=False,
            boot_id="b",
            created="2026-01-01T00:00:00+00:00",
            stopped=(StoppedHolder(holder=holder, tokens=("gpu1",)),) if holder and i == 0 else (),
        )
        for i, claimant in enumerate(claimants)
    )
    with Ledger(state).transaction() as txn:
        txn.state = LedgerState(generation=txn.state.generation, leases=leases)


def _release(tmp_path: Path, guest: str) -> tuple[subprocess.CompletedProcess[bytes], set[str]]:
    config = tmp_path / "arbiter.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    env = {"CHARLY_ARBITER_CONFIG": str(config), "CHARLY_ARBITER_SERVE": "off"}
    result, modules = imported_modules("qemu", guest, *END, stdin=GPU_HOSTDEV_XML, env=env)
    assert (result.returncode, result.stdout) == (0, b""), result.stderr
    assert "charly_arbiter.libvirt.hook" in modules, "no import was measured"
    return result, modules


def test_a_release_the_ledger_does_not_name_is_let_go_without_the_slow_path(
    tmp_path: Path,
) -> None:
    """A domain with a GPU hostdev stops, and the ledger names nothing of it (its start
    was refused): the hook exits 0 having read the ledger's bytes only.  The same
    release of a domain the ledger does name, as a claimant or as a holder a lease
    stopped, goes the slow way; and so does one whose name the ledger would escape."""
    _ledger_naming(tmp_path / "state", "libvirt:other", "container:win11")
    _, modules = _release(tmp_path, "win11")
    assert "charly_arbiter.libvirt.hookrun" not in modules
    assert "charly_arbiter.core.ledger" not in modules
    for ledger, guest in (
        (("libvirt:win11",), "win11"),
        (("libvirt:other",), 'we"ird'),
    ):
        _ledger_naming(tmp_path / "state", *ledger)
        _, modules = _release(tmp_path, guest)
        assert "charly_arbiter.libvirt.hookrun" in modules, (ledger, guest)
    _ledger_naming(tmp_path / "state", "libvirt:other", holder="libvirt:win11")
    _, modules = _release(tmp_path, "win11")
    assert "charly_arbiter.libvirt.hookrun" in modules


@pytest.mark.parametrize(
    "name",
    ["win11", "a b", "it's", "ü-vm", "x#y=z", "$(id)", "[t]", "a'b\"c", "back\\slash"],
)
def test_the_ledgers_bytes_name_every_claimant_and_holder_it_holds(
    tmp_path: Path, name: str
) -> None:
    """ledger_may_name against the ledger's own writer: never False for a claimant or
    a stopped holder the ledger holds, whatever the name (a name it escapes is always
    "may"); False for one it does not hold only when the name is plain."""
    from charly_arbiter.hookio import ledger_may_name

    state = tmp_path / "state"
    claimant = f"libvirt:{name}"
    _ledger_naming(state, claimant)
    assert ledger_may_name(claimant, str(state).encode())
    _ledger_naming(state, "container:c", holder=claimant)
    assert ledger_may_name(claimant, str(state).encode())
    _ledger_naming(state, "container:c")
    plain = '"' not in name and "\\" not in name
    assert ledger_may_name(claimant, str(state).encode()) is not plain


def test_what_the_release_fast_path_cannot_read_for_certain_goes_the_slow_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from charly_arbiter.hookio import (
        Unsure,
        configured_ledger_may_name,
        ledger_may_name,
        state_dir,
    )

    monkeypatch.delenv("CHARLY_ARBITER_HOST", raising=False)
    monkeypatch.delenv("CHARLY_ARBITER_STATE_DIR", raising=False)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "ledger.toml").mkdir()  # not readable as a file
    assert ledger_may_name("libvirt:x", str(tmp_path / "dir").encode())
    assert not ledger_may_name("libvirt:x", str(tmp_path / "none").encode())  # no ledger yet
    assert ledger_may_name("libvirt:x\x07", str(tmp_path / "none").encode())  # escaped
    assert state_dir(b"", simulated=False) == b"/var/lib/charly-arbiter"
    for settings, simulated in ((b"", True), (b'state_dir = "relative"\n', False)):
        with pytest.raises(Unsure):
            state_dir(settings, simulated=simulated)
    monkeypatch.setenv("CHARLY_ARBITER_STATE_DIR", str(tmp_path / "none"))
    assert state_dir(b"", simulated=True) == str(tmp_path / "none").encode()
    assert not configured_ledger_may_name("libvirt:x")
    # A simulated host named by the environment keeps its ledger in DIR/state: unsure.
    monkeypatch.delenv("CHARLY_ARBITER_STATE_DIR")
    monkeypatch.setenv("CHARLY_ARBITER_HOST", f"sim:{tmp_path}")
    assert configured_ledger_may_name("libvirt:x")
