"""The ledger's write discipline, in-process on a real directory: modes, the
generation and checksum, the previous generation kept as .bak, and an fsync
error that is fatal for its write (no retry, no rename, old file intact)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import replace

import pytest

from charly_arbiter.core import ledger as ledger_module
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Lease, LeaseState, Mode
from charly_arbiter.errors import LedgerCorrupt, LedgerWriteFailed


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
    # A ledger this small has no JSON copy (CACHE_FROM).
    assert sorted(p.name for p in ledger.state_dir.iterdir()) == [
        "ledger.lock",
        "ledger.toml",
        "ledger.toml.bak",
    ]


def test_the_lock_file_names_the_last_taker_over_a_longer_note(tmp_path):
    """The pid is written over the note before it, never truncated first: it must
    still read as this pid after a longer one."""
    ledger = Ledger(tmp_path / "state")
    with ledger.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:a"))
    ledger.lock_path.write_bytes(ledger_module._pid_note(4194304))
    with ledger.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:b"))
    assert ledger.lock_path.read_text().split() == [str(os.getpid())]
    fd = os.open(ledger.lock_path, os.O_RDONLY)
    try:  # not locked: the note is the answer
        assert ledger_module._lock_holder(fd) == os.getpid()
    finally:
        os.close(fd)


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


# -- the format: whatever the state holds, it reads back the same ----------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from charly_arbiter.core import ledger_format  # noqa: E402
from charly_arbiter.core.model import (  # noqa: E402
    Claimant,
    LedgerState,
    Poison,
    StepState,
    StoppedHolder,
)

# Any text a libvirt domain's name may hold: quotes, backslashes, colons, other
# scripts, spaces (not '/', nor what no terminal shows: controls, format characters).
names = st.text(
    alphabet=st.characters(
        blacklist_categories=("Cs", "Cc", "Cf", "Zl", "Zp"), blacklist_characters="/"
    ),
    min_size=1,
    max_size=20,
)
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)
claimants = st.one_of(
    st.builds(lambda name: Claimant.of("libvirt", name), names),
    st.builds(
        lambda name: Claimant.of("container", name),
        st.from_regex(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,19}", fullmatch=True),
    ),
    st.builds(
        lambda name: Claimant.of("systemd", name),
        st.from_regex(
            r"[a-zA-Z0-9:_.\\-]{1,12}(@[a-zA-Z0-9:_.\\@-]{1,8})?\.(service|scope)", fullmatch=True
        ),
    ),
)
tokens = st.lists(
    st.from_regex(r"[a-z0-9._-]{1,8}", fullmatch=True), min_size=1, max_size=3, unique=True
)
records = st.builds(
    StoppedHolder,
    holder=claimants,
    state=st.sampled_from(StepState),
    shared_tokens=tokens.map(tuple),
    restored=st.booleans(),
    tokens=tokens.map(tuple),
)
leases = st.builds(
    Lease,
    claimant=claimants,
    mode=st.sampled_from(Mode),
    tokens=tokens.map(tuple),
    state=st.sampled_from(LeaseState),
    transient=st.booleans(),
    boot_id=texts,
    created=texts,
    owner_pid=st.integers(0, 2**22),
    owner_start=st.integers(0, 2**40),
    stopped=st.lists(records, max_size=3).map(tuple),
    note=texts,
    sleep_locks=st.lists(st.from_regex(r"[a-z0-9._-]{1,8}", fullmatch=True), max_size=2).map(tuple),
    sleep_lock_error=texts,
)
states = st.builds(
    LedgerState,
    generation=st.integers(0, 2**40),
    leases=st.lists(leases, max_size=4, unique_by=lambda lease: lease.claimant).map(tuple),
    homes=st.dictionaries(
        st.from_regex(r"[a-z0-9]{1,6}", fullmatch=True),
        st.dictionaries(
            st.from_regex(r"0000:0[0-9a-f]:00\.[0-7]", fullmatch=True), texts, max_size=3
        ).map(lambda d: tuple(sorted(d.items()))),
        max_size=3,
    ).map(lambda d: tuple(sorted(d.items()))),
    poisoned=st.dictionaries(
        st.from_regex(r"[a-z0-9]{1,6}", fullmatch=True),
        st.builds(Poison, texts, texts),
        max_size=2,
    ).map(lambda d: tuple(sorted(d.items()))),
)


@settings(max_examples=300, deadline=None)
@given(states)
def test_every_state_reads_back_as_it_was_written(state):
    data = ledger_format.encode(state)  # encode itself re-parses and compares
    assert ledger_format.decode(data) == state


# -- the JSON copy beside the ledger: used only for the bytes it was made from -------


@pytest.fixture
def every_ledger_cached(monkeypatch):
    """Every ledger with its JSON copy, and no state remembered from the writes: the
    readers below must go to the file and its copy."""
    monkeypatch.setattr(ledger_module, "CACHE_FROM", 0)
    yield
    ledger_module.forget_decoded()


def two_generations(tmp_path):
    ledger = Ledger(tmp_path / "state")
    with ledger.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:a"))
    old_cache = (ledger.state_dir / "ledger.cache.json").read_bytes()
    with ledger.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:b"))
    return ledger, old_cache


def test_the_json_copy_is_what_a_reader_uses_for_its_ledger(tmp_path, every_ledger_cached):
    ledger, _ = two_generations(tmp_path)
    cache = ledger.state_dir / "ledger.cache.json"
    digest = ledger_format.checksum_of(ledger.path.read_bytes())
    # A copy made from these very bytes is believed: put another state in it to see it.
    marked = LedgerState(generation=99, leases=(lease("container:from-the-copy"),))
    cache.write_bytes(ledger_format.encode_cache(marked, digest))
    ledger_module.forget_decoded()
    assert Ledger(ledger.state_dir).read() == marked


def test_a_stale_or_damaged_json_copy_is_not_used(tmp_path, every_ledger_cached):
    ledger, old_cache = two_generations(tmp_path)
    cache = ledger.state_dir / "ledger.cache.json"
    truth = [lease.claimant for lease in Ledger(ledger.state_dir).read().leases]
    assert truth == ["container:a", "container:b"]
    cache.write_bytes(old_cache)  # made from the previous generation
    assert [x.claimant for x in Ledger(ledger.state_dir).read().leases] == truth
    damaged = bytearray(ledger_format.encode_cache(LedgerState(), "0" * 64))
    damaged[-5] ^= 1
    cache.write_bytes(bytes(damaged))
    assert [x.claimant for x in Ledger(ledger.state_dir).read().leases] == truth
    cache.write_bytes(b"")
    assert [x.claimant for x in Ledger(ledger.state_dir).read().leases] == truth


def test_a_json_copy_never_hides_a_corrupt_ledger(tmp_path, every_ledger_cached):
    ledger, _ = two_generations(tmp_path)
    data = bytearray(ledger.path.read_bytes())
    data[len(data) // 2] ^= 1
    ledger.path.write_bytes(bytes(data))
    with pytest.raises(LedgerCorrupt):
        Ledger(ledger.state_dir).read()


def test_only_a_large_ledger_has_a_json_copy_and_a_stale_one_goes_with_its_size(tmp_path):
    """Below CACHE_FROM bytes the TOML is parsed (cheaper than writing a copy at every
    write); from it on, the copy is written and used; back below it, the copy is
    removed, not left to be read and refused at every read."""
    ledger = Ledger(tmp_path / "state")
    cache = ledger.state_dir / "ledger.cache.json"
    many = tuple(lease(f"container:c{index}") for index in range(40))
    with ledger.transaction() as txn:
        txn.state = replace(txn.state, leases=many[:1])
    assert len(ledger.path.read_bytes()) < ledger_module.CACHE_FROM and not cache.exists()
    with ledger.transaction() as txn:
        txn.state = replace(txn.state, leases=many)
    assert len(ledger.path.read_bytes()) >= ledger_module.CACHE_FROM
    digest = ledger_format.checksum_of(ledger.path.read_bytes())
    assert cache.read_bytes() == ledger_format.encode_cache(ledger.read(), digest)
    marked = LedgerState(generation=99, leases=(lease("container:from-the-copy"),))
    cache.write_bytes(ledger_format.encode_cache(marked, digest))
    ledger_module.forget_decoded()
    assert Ledger(ledger.state_dir).read() == marked  # a large ledger is read from it
    with ledger.transaction() as txn:
        txn.state = replace(txn.state, leases=many[:2])
    assert not cache.exists()
    assert [x.claimant for x in Ledger(ledger.state_dir).read().leases] == [
        "container:c0",
        "container:c1",
    ]


def test_a_ledger_read_ahead_is_not_decoded_again_until_its_bytes_change(tmp_path, monkeypatch):
    """What a spare of the resident helper does while it waits: a later reader (a new
    Ledger, as a command opens it) reads the bytes and skips only their decoding; the
    bytes changed by another process (copied in here, which this process does not
    remember) are decoded anew."""
    one, two = Ledger(tmp_path / "one"), Ledger(tmp_path / "two")
    with one.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:a"))
    with two.transaction() as txn:
        txn.state = txn.state.with_lease(lease("container:a")).with_lease(lease("container:b"))
    ledger_module.forget_decoded()
    assert Ledger(one.state_dir).read_ahead() == 1
    decoded: list[int] = []
    real_decode = ledger_format.decode
    monkeypatch.setattr(ledger_format, "decode", lambda *a: decoded.append(1) or real_decode(*a))
    assert [x.claimant for x in Ledger(one.state_dir).read().leases] == ["container:a"]
    assert decoded == []
    (one.path.parent / "other").write_bytes(two.path.read_bytes())
    os.replace(one.path.parent / "other", one.path)
    after = Ledger(one.state_dir).read()
    assert [x.claimant for x in after.leases] == ["container:a", "container:b"]
    assert decoded == [1]
    assert Ledger(tmp_path / "nothing").read_ahead() == 0  # no ledger yet: nothing to do


# -- a lease's sleep locks: optional keys, so that a ledger from before them reads -------


def test_a_lease_without_sleep_locks_is_written_as_before_and_an_old_ledger_reads():
    plain = LedgerState(generation=3, leases=(lease("libvirt:win11"),))
    data = ledger_format.encode(plain)
    assert b"sleep_lock" not in data  # byte for byte what an older version wrote
    assert ledger_format.decode(data).leases[0].sleep_locks == ()


def test_a_lease_s_sleep_locks_read_back_and_a_wrong_type_is_corruption():
    locked = replace(lease("libvirt:win11"), sleep_locks=("gpu0",), sleep_lock_error="")
    data = ledger_format.encode(LedgerState(generation=1, leases=(locked,)))
    assert b'sleep_locks = ["gpu0"]' in data
    assert ledger_format.decode(data).leases[0].sleep_locks == ("gpu0",)
    failed = replace(locked, sleep_locks=(), sleep_lock_error="systemd is not running here")
    data = ledger_format.encode(LedgerState(generation=1, leases=(failed,)))
    assert ledger_format.decode(data).leases[0].sleep_lock_error == "systemd is not running here"
    body = ledger_format.encode(LedgerState(generation=1, leases=(locked,))).split(b"\n", 1)[1]
    wrong = body.replace(b'sleep_locks = ["gpu0"]', b"sleep_locks = true")
    digest = hashlib.sha256(wrong).hexdigest().encode()
    with pytest.raises(ledger_format.FormatError, match="sleep_locks"):
        ledger_format.decode(b'checksum = "sha256:' + digest + b'"\n' + wrong)
