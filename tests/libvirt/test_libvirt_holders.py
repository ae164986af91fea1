"""LibvirtHolders against libvirt's own `test:///FILE` driver (in-process, no daemon).

The driver implements lookups, XML, shutdown, destroy, managed save and
create like the QEMU driver's API does; each connection gets its own copy of
the domains in the file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from charly_arbiter.core.config import Config, HolderConfig, Timeouts
from charly_arbiter.core.host import PciFunction, TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Lease, LeaseState, Mode, StepState, StoppedHolder
from charly_arbiter.errors import HolderError
from charly_arbiter.host.markers import is_acting
from charly_arbiter.host.sysfs import Roots
from charly_arbiter.libvirt.domains import LibvirtHolders

libvirt = pytest.importorskip("libvirt")

NS = "https://charly-arbiter.org/xmlns/claim/1"
NODE = f"""<node>
<domain type='test'><name>holder</name><memory>65536</memory><os><type>hvm</type></os>
<metadata><ca:claim xmlns:ca="{NS}" mode="shared" preemptible="yes" stop="managedsave">
<ca:token>gpu0</ca:token></ca:claim></metadata></domain>
<domain type='test'><name>passthrough</name><memory>65536</memory><os><type>hvm</type></os>
<devices><hostdev mode='subsystem' type='pci' managed='yes'><source>
<address domain='0x0000' bus='0x0a' slot='0x00' function='0x1'/></source></hostdev></devices>
</domain>
<domain type='test'><name>listed</name><memory>65536</memory><os><type>hvm</type></os></domain>
<domain type='test'><name>bystander</name><memory>65536</memory><os><type>hvm</type></os></domain>
</node>"""


def function(address: str) -> PciFunction:
    return PciFunction(address, "10de", "2684", "030000", "nvidia", "12")


GPU0 = TokenSpec("gpu0", "0000:0a:00.0", (function("0000:0a:00.0"), function("0000:0a:00.1")))


@pytest.fixture
def config(tmp_path: Path) -> Config:
    node = tmp_path / "node.xml"
    node.write_text(NODE)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return Config(
        state_dir=state,
        libvirt_uri=f"test://{node}",
        timeouts=Timeouts(holder_stop=1, libvirt_call=10),
        holders=(HolderConfig("libvirt:listed", ("gpu0",), preemptible=False, stop="shutdown"),),
    )


def test_domains_using_a_token_are_holders_by_the_xml_rules(config: Config) -> None:
    source = LibvirtHolders(config)
    found = {holder.ref: holder for holder in source.holders([GPU0])}
    assert set(found) == {"libvirt:holder", "libvirt:passthrough", "libvirt:listed"}
    assert found["libvirt:holder"].preemptible
    assert found["libvirt:holder"].how == "virsh managedsave"
    assert not found["libvirt:passthrough"].preemptible
    assert found["libvirt:passthrough"].detail == "exclusive claim"
    assert found["libvirt:listed"].detail == "listed in arbiter.toml"
    assert all(holder.running for holder in found.values())


def test_managedsave_stop_and_start_restores_the_image(config: Config) -> None:
    source = LibvirtHolders(config)
    source.holders([GPU0])
    source.stop("libvirt:holder")
    assert not source.is_running("libvirt:holder")
    domain = source._lookup("holder")
    assert domain.hasManagedSaveImage(0)
    source.start("libvirt:holder")
    assert source.is_running("libvirt:holder")
    assert not domain.hasManagedSaveImage(0)


def test_shutdown_stop_and_unknown_domain(config: Config) -> None:
    source = LibvirtHolders(config)
    source.stop("libvirt:listed")
    assert not source.is_running("libvirt:listed")
    assert not source.is_running("libvirt:nosuchvm")
    with pytest.raises(HolderError, match="no domain"):
        source.start("libvirt:nosuchvm")


def stopped_for(config: Config, holder: str) -> None:
    """A lease of another claimant that records `holder` as stopped for it."""
    record = StoppedHolder(holder, StepState.DONE, tokens=("gpu0",))
    with Ledger(config.state_dir).transaction() as txn:
        txn.state = txn.state.with_lease(
            Lease(
                "libvirt:other",
                Mode.EXCLUSIVE,
                ("gpu0",),
                LeaseState.ACTIVE,
                False,
                "b",
                "t",
                stopped=(record,),
            )
        )


def test_in_a_hook_the_own_domain_is_never_touched_nor_enumerated(config: Config) -> None:
    """In a hook, candidates come from the ledger and the configuration only: the
    holders the ledger records as stopped and the claimants of active leases, never
    the claimant of an unfinished lease (it may be locked by its own pending hook)."""
    with Ledger(config.state_dir).transaction() as txn:
        txn.state = txn.state.with_lease(
            Lease("libvirt:holder", Mode.SHARED, ("gpu0",), LeaseState.RELEASING, False, "b", "t")
        )
    source = LibvirtHolders(config, subject="passthrough")
    assert {holder.ref for holder in source.holders([GPU0])} == {"libvirt:listed"}
    with Ledger(config.state_dir).transaction() as txn:
        txn.state = txn.state.without_lease("libvirt:holder")
    stopped_for(config, "libvirt:holder")
    refs = {holder.ref for holder in source.holders([GPU0])}
    assert refs == {"libvirt:holder", "libvirt:listed"}  # bystander and itself not asked
    assert source.is_running("libvirt:passthrough")
    for action in (source.stop, source.start):
        with pytest.raises(HolderError, match="this hook runs for"):
            action("libvirt:passthrough")


def test_stop_marks_the_domain_as_acted_on_for_its_own_hook(config: Config) -> None:
    source = LibvirtHolders(config)
    assert not is_acting(config.state_dir, "libvirt:holder")
    with source.acting("libvirt:holder"):
        assert is_acting(config.state_dir, "libvirt:holder")
        assert not is_acting(config.state_dir, "libvirt:listed")
    assert not is_acting(config.state_dir, "libvirt:holder")


def test_with_libvirtd_unreachable_liveness_comes_from_qemu_processes(
    config: Config, tmp_path: Path
) -> None:
    """/proc is the outermost seam here: a fake one with a QEMU command line."""
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cmdline").write_bytes(
        b"qemu-system-x86_64\0-name\0guest=win,,11,debug-threads=on\0"
    )
    down = Config(
        state_dir=config.state_dir,
        libvirt_uri="qemu+unix:///system?socket=/nonexistent/libvirt-sock",
        timeouts=config.timeouts,
    )
    source = LibvirtHolders(down, roots=Roots(proc=proc))
    assert source.is_running("libvirt:win,11")
    assert not source.is_running("libvirt:win")


def test_a_domain_whose_hook_runs_is_never_looked_up(config: Config) -> None:
    """libvirt locks a domain while its hook runs: others take it as alive and leave it be."""
    from charly_arbiter.host.markers import HOOK_DIR, in_hook, marked

    stopped_for(config, "libvirt:holder")
    source = LibvirtHolders(config, subject="passthrough")
    with marked(config.state_dir, HOOK_DIR, "libvirt:listed"):
        assert in_hook(config.state_dir, "libvirt:listed")
        source.stop("libvirt:holder")  # not in a hook: stopped
        assert source.is_running("libvirt:listed")
        assert {h.ref for h in source.holders([GPU0])} == {"libvirt:holder"}
        with pytest.raises(HolderError, match="own libvirt hook is running"):
            source.stop("libvirt:listed")
    assert not in_hook(config.state_dir, "libvirt:listed")
    assert {h.ref for h in source.holders([GPU0])} == {"libvirt:holder", "libvirt:listed"}
