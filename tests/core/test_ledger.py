"""The ledger's write discipline, in-process on a real directory: modes, the
generation and checksum, the previous generation kept as .bak, and an fsync
error that is fatal for its write (no retry, no rename, old file intact)."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Lease, LeaseState, Mode
from charly_arbiter.errors import LedgerWriteFailed


def lease(name: str) -> Lease:
    return Lease(
        claimant=name,
        mode=Mode.SHARED,
        tokens=("gpu0",),
        state=LeaseState.ACTIVE,
        transient=False,
        boot_id="boot",
        created="2026-01-01T00:00:00+00:00",
    )


def test_every_write_is_a_new_checksummed_generation_with_the_previous_as_backup(tmp_path):
    ledger = Ledger(tmp_path / "state")
    with ledger.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:a"))
    first = ledger.path.read_bytes()
    with ledger.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:b"))
    assert ledger.read().generation == 2
    assert [x.claimant for x in ledger.read().leases] == ["container:a", "container:b"]
    assert ledger.backup.read_bytes() == first
    assert ledger.path.read_bytes().startswith(b'checksum = "sha256:')
    with ledger.transaction():
        pass  # nothing changed: nothing written
    assert ledger.read().generation == 2
    assert stat.S_IMODE(os.stat(ledger.state_dir).st_mode) == 0o700
    for path in (ledger.path, ledger.backup, ledger.lock_path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert sorted(p.name for p in ledger.state_dir.iterdir()) == [
        "ledger.lock",
        "ledger.toml",
        "ledger.toml.bak",
    ]


def test_the_lock_file_is_never_replaced(tmp_path):
    ledger = Ledger(tmp_path / "state")
    with ledger.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:a"))
    inode = os.stat(ledger.lock_path).st_ino
    for index in range(5):
        with ledger.transaction() as txn:
            txn.state = txn.state.with_lease(lease(f"container:x{index}"))
    assert os.stat(ledger.lock_path).st_ino == inode


def test_an_fsync_error_is_fatal_for_the_write(tmp_path, monkeypatch):
    ledger = Ledger(tmp_path / "state")
    with ledger.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:a"))
    before = ledger.path.read_bytes()
    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(LedgerWriteFailed, match="Input/output error") as failed:
        with ledger.transaction() as txn:
            txn.state = txn.state.with_lease(lease("container:b"))
    assert "the previous state is kept" in str(failed.value)
    assert len(calls) == 1  # no retry
    monkeypatch.undo()
    assert ledger.path.read_bytes() == before  # no rename
    assert not (ledger.state_dir / "ledger.toml.tmp").exists()
    assert [x.claimant for x in ledger.read().leases] == ["container:a"]


def test_a_stray_temp_file_is_removed_under_the_lock_not_trusted(tmp_path):
    ledger = Ledger(tmp_path / "state")
    with ledger.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:a"))
    stray = ledger.state_dir / "ledger.toml.tmp"
    stray.write_bytes(b"half a ledger")
    assert ledger.tidy().leases == ledger.read().leases
    assert not stray.exists()


def test_a_reader_overtaken_by_the_first_two_writes_does_not_call_the_ledger_corrupt(tmp_path):
    """Seen in CI under 16 concurrent CLIs: a lock-free reader that found no ledger,
    then the first write and the first backup happened, must read an empty ledger,
    not report damage."""
    from charly_arbiter.core.model import Poison

    state_dir = tmp_path / "state"
    writer = Ledger(state_dir)
    reader = Ledger(state_dir)
    state_dir.mkdir(mode=0o700)
    raced = []

    class OvertakenPath(type(reader.path)):
        def exists(self, *args, **kwargs):
            found = super().exists(*args, **kwargs)
            if not found and not raced:
                raced.append(True)
                for index in range(2):  # the first write, then one that makes the .bak
                    with writer.transaction() as txn:
                        txn.state = txn.state.with_poison(f"gpu{index}", Poison("r", "s"))
            return found

    reader.path = OvertakenPath(reader.path)
    assert reader.read().leases == ()
    assert raced and writer.backup.exists()
