"""A corrupt ledger is always a typed LedgerCorrupt with a clear message: never
"no leases", never overwritten.  The corpus is built from a real ledger
written by the arbiter; the CLI is run as a real process on a sample."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
from coretools import host_state, ledger_bytes

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Mode
from charly_arbiter.errors import LedgerCorrupt


def with_checksum(body: bytes) -> bytes:
    """A file whose checksum is right for `body`: only the content is wrong."""
    return b'checksum = "sha256:' + hashlib.sha256(body).hexdigest().encode() + b'"\n' + body


@pytest.fixture
def good(sim):
    """A real ledger with two leases, a home and a poison record."""
    arbiter = sim.arbiter()
    arbiter.acquire("container:llm", Mode.SHARED, ["gpu0"])
    arbiter.acquire("container:other", Mode.SHARED, ["gpu0"])
    return ledger_bytes(sim.state_dir)


def corpus(good: bytes) -> list[tuple[str, bytes]]:
    body = good.split(b"\n", 1)[1]
    rng = random.Random(20261129)
    cases = [("empty", b""), ("only-newline", b"\n"), ("all-nul", b"\0" * len(good))]
    cases += [(f"truncated-{n}", good[:n]) for n in range(1, len(good), 3)]
    for index in range(300):
        data = bytearray(good)
        position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
        cases.append((f"bitflip-{index}-at-{position}", bytes(data)))
    for index in range(20):
        data = bytearray(good)
        start = rng.randrange(len(data))
        data[start : start + rng.randrange(1, 64)] = b"\0" * len(data[start : start + 64])
        cases.append((f"nul-run-{index}", bytes(data[: len(good)])))
    cases += [
        ("deep-nesting", with_checksum(b"a = " + b"[" * 20000 + b"]" * 20000 + b"\n")),
        ("deep-inline-tables", with_checksum(b"a = " + b"{b = " * 5000 + b"1" + b"}" * 5000)),
        ("not-utf8", with_checksum(body.replace(b"container:llm", b"container:\xff\xfe"))),
        ("nul-inside", with_checksum(body.replace(b"container:llm", b"container:\0llm"))),
        ("empty-body", with_checksum(b"")),
        ("schema-3", with_checksum(body.replace(b"schema = 2", b"schema = 3"))),
        ("generation-str", with_checksum(body.replace(b"generation = ", b'generation = "x" #'))),
        ("generation-bool", with_checksum(body.replace(b"generation = ", b"generation = true #"))),
        (
            "leases-int",
            with_checksum(b"schema = 1\ngeneration = 1\nleases = 5\nhomes = {}\npoisoned = {}\n"),
        ),
        ("mode-unknown", with_checksum(body.replace(b'mode = "shared"', b'mode = "sole"', 1))),
        ("tokens-ints", with_checksum(body.replace(b'tokens = ["gpu0"]', b"tokens = [1]", 1))),
        ("missing-key", with_checksum(body.replace(b"transient = false\n", b"", 1))),
        ("toml-garbage", with_checksum(b"this is not toml = = =\n")),
        ("json", with_checksum(json.dumps({"schema": 1}).encode())),
        ("checksum-of-other-body", with_checksum(b"x = 1\n")[:77] + body),
    ]
    return cases


def test_corpus_is_always_a_typed_clear_error(sim, good):
    ledger = Ledger(sim.state_dir)
    path = sim.state_dir / "ledger.toml"
    for name, data in corpus(good):
        if data == good:
            continue  # a bit flip that flipped nothing that matters cannot happen; be safe
        path.write_bytes(data)
        with pytest.raises(LedgerCorrupt) as corrupt:
            state = ledger.read()
            pytest.fail(f"{name}: read as {state}")
        message = str(corrupt.value)
        assert message.startswith(f"the ledger {path} is corrupt: "), (name, message)
        assert len(message) < 300 and "\n" not in message, (name, message)
        assert corrupt.value.hint, name
        assert path.read_bytes() == data, name


@pytest.mark.parametrize(
    "name", ["empty", "truncated-40", "bitflip-0", "deep-nesting", "generation-str"]
)
def test_cli_fails_closed_and_never_overwrites(sim, good, name):
    data = next(data for case, data in corpus(good) if case.startswith(name))
    path = sim.state_dir / "ledger.toml"
    (sim.state_dir / "ledger.toml.bak").unlink()
    path.write_bytes(data)
    status = sim.cli("status")
    assert status.returncode == 1
    assert "LEDGER CORRUPT" in status.stdout or "corrupt" in status.stderr
    assert "no leases" not in status.stdout and "idle" not in status.stdout
    as_json = sim.cli("status", "--json")
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["corrupt"].startswith(f"the ledger {path} is corrupt")
    for args in (
        ("acquire", "--exclusive", "libvirt:win11", "gpu0"),
        ("release", "--force", "container:llm"),
        ("restore", "--stranded"),
        ("poison", "clear", "gpu0"),
        ("poison", "list"),
    ):
        result = sim.cli(*args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "is corrupt" in result.stderr and "Traceback" not in result.stderr
        assert result.stdout == ""
        assert path.read_bytes() == data, args
    assert not sim.host().snapshot()["drivers"]["0000:0a:00.0"] == "vfio-pci"


MUTATIONS = (
    ("acquire", "--exclusive", "libvirt:other", "gpu1"),
    ("acquire", "--shared", "container:third", "gpu0"),
    ("release", "--force", "libvirt:win11"),
    ("restore", "--stranded"),
    ("restore", "--stranded", "--dry-run"),
    ("restore", "--force", "libvirt:win11"),
    ("poison", "clear", "gpu0"),
)


def test_a_corrupt_ledger_is_never_repaired_from_its_backup(sim):
    """Before (issue 9): with a VM holding a GPU and one bit of the ledger flipped, `restore
    --stranded` moved the file aside, continued from the backup (one generation
    old, the lease still `acquiring` by a dead pid) and sent the GPU home under
    the running VM.  Now every mutating command fails closed (I4): the ledger,
    its backup and the host stay exactly as they were."""
    arbiter = sim.arbiter()
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    path = sim.state_dir / "ledger.toml"
    backup = sim.state_dir / "ledger.toml.bak"
    assert Ledger(sim.state_dir).backup_state().leases  # a usable backup exists
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    before = (path.read_bytes(), backup.read_bytes(), host_state(sim))
    for args in MUTATIONS:
        result = sim.cli(*args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "is corrupt" in result.stderr and "nothing was changed" in result.stderr, args
        assert "charly-arbiter recover" in result.stderr, args
        assert "Traceback" not in result.stderr
        assert (path.read_bytes(), backup.read_bytes(), host_state(sim)) == before, args
    assert host_state(sim)["drivers"]["0000:0a:00.0"] == "vfio-pci"
    assert not [p for p in sim.state_dir.iterdir() if ".corrupt-" in p.name]
    status = sim.cli("status")
    assert status.returncode == 1 and "LEDGER CORRUPT" in status.stdout


def test_recover_shows_the_backup_against_the_host_and_writes_only_with_yes(sim, good):
    path = sim.state_dir / "ledger.toml"
    backup_state = Ledger(sim.state_dir).backup_state()
    damaged = good[:50]
    path.write_bytes(damaged)
    look = sim.cli("recover")
    assert look.returncode == 0, look.stderr
    assert "is corrupt" in look.stdout
    assert f"the backup is generation {backup_state.generation}" in look.stdout
    assert "container:llm: shared on gpu0, active" in look.stdout
    assert "host: the drivers agree with the backup" in look.stdout
    assert "nothing was written" in look.stdout and "recover --yes" in look.stdout
    assert path.read_bytes() == damaged
    done = sim.cli("recover", "--yes")
    assert done.returncode == 0, done.stderr
    aside = [p for p in sim.state_dir.iterdir() if p.name.startswith("ledger.toml.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes() == damaged
    state = Ledger(sim.state_dir).read()
    assert state.generation > backup_state.generation
    assert state.leases == backup_state.leases
    result = sim.cli("acquire", "--shared", "container:third", "gpu0")
    assert result.returncode == 0, result.stderr
    again = sim.cli("recover", "--yes")
    assert again.returncode == 0 and "nothing to recover" in again.stdout


def test_recover_says_where_the_host_disagrees_with_the_backup(sim):
    sim.arbiter().acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    path = sim.state_dir / "ledger.toml"
    (sim.state_dir / "ledger.toml.bak").unlink()
    with Ledger(sim.state_dir).transaction() as txn:
        txn.state = txn.state.without_lease("libvirt:win11")
    with Ledger(sim.state_dir).transaction() as txn:  # the backup now has no lease
        txn.state = txn.state.with_home("gpu9", {"0000:0c:00.0": "nvidia"})
    path.write_bytes(b"")
    look = sim.cli("recover")
    assert "host: gpu0 is on vfio-pci, but the backup has no exclusive lease" in look.stdout


def test_recover_when_the_backup_is_corrupt_too(sim, good):
    path = sim.state_dir / "ledger.toml"
    backup = sim.state_dir / "ledger.toml.bak"
    sim.host().switch(sim.arbiter().tokens.all()["gpu1"], {"0000:0b:00.0": "vfio-pci"})
    path.write_bytes(b"")
    backup.write_bytes(good[:10])
    refused = sim.cli("acquire", "--shared", "container:third", "gpu0")
    assert refused.returncode == 1 and "is corrupt" in refused.stderr
    assert path.read_bytes() == b"" and backup.read_bytes() == good[:10]
    look = sim.cli("recover")
    assert "the backup cannot be used" in look.stdout and "--empty --yes" in look.stdout
    no_backup = sim.cli("recover", "--yes")
    assert no_backup.returncode == 3 and "--empty --yes" in no_backup.stderr  # refused
    assert path.read_bytes() == b""
    fresh = sim.cli("recover", "--empty", "--yes")
    assert fresh.returncode == 0, fresh.stderr
    state = Ledger(sim.state_dir).read()
    assert state.leases == ()
    assert [token for token, _ in state.poisoned] == ["gpu1"]  # found on vfio-pci: unknown why


def test_both_corrupt_refuses_to_write(sim, good):
    path = sim.state_dir / "ledger.toml"
    backup = sim.state_dir / "ledger.toml.bak"
    path.write_bytes(b"")
    backup.write_bytes(good[:10])
    result = sim.cli("acquire", "--shared", "container:third", "gpu0")
    assert result.returncode == 1
    assert "is corrupt" in result.stderr
    assert path.read_bytes() == b"" and backup.read_bytes() == good[:10]


def test_a_missing_ledger_with_a_backup_is_corrupt_not_empty(sim, good):
    (sim.state_dir / "ledger.toml").unlink()
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 1 and "is missing" in result.stderr
    assert not (sim.state_dir / "ledger.toml").exists()


def test_restore_alone_cleans_up_after_an_interrupted_first_write(sim):
    result = sim.cli(
        "acquire",
        "--shared",
        "container:x",
        "gpu1",
        env=sim.env(CHARLY_ARBITER_CRASH_AT="ledger.fsync_temp"),
    )
    assert result.returncode == -9
    assert (sim.state_dir / "ledger.toml.tmp").exists()
    assert not (sim.state_dir / "ledger.toml").exists()
    assert sim.cli("restore", "--stranded").stdout == "nothing to restore\n"
    assert not (sim.state_dir / "ledger.toml.tmp").exists()
