"""`status --follow`'s loop (ops/follow.py): when it looks, what it prints, when it ends;
and its wait on this machine's real kernel: inotify on real files written the way
the ledger and the history write them, a real pipe whose reader goes away, and the
once-a-second look where no watch can be had.  (The whole follower through the CLI
is in test_json_outputs.py, the page's in tests/cockpit.)"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Lease, LeaseState, Mode
from charly_arbiter.ops.follow import FileWakeup, follow
from charly_arbiter.ops.history import HISTORY

LEASE = Lease(
    claimant="container:llm",
    mode=Mode.SHARED,
    tokens=("gpu0",),
    state=LeaseState.ACTIVE,
    transient=False,
    boot_id="boot",
    created="2026-12-01T10:00:00+00:00",
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeWakeup:
    """Stands in for the kernel's word: each wait lets `step` seconds pass (or the
    timeout, if shorter) and runs `then(now)`, which may write a file or say the
    reader is gone."""

    def __init__(self, clock: Clock, then=lambda now: False, step: float = 1.0) -> None:
        self.clock = clock
        self.then = then
        self.step = step
        self.waits: list[float] = []
        self.closed = False

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.clock.now += min(timeout, self.step)
        return bool(self.then(self.clock.now))

    def close(self) -> None:
        self.closed = True


def test_follow_looks_again_every_interval_and_prints_only_changes(tmp_path):
    """What no file records (a claimant that died) is found by the periodic look."""
    watched = tmp_path / "ledger.toml"
    clock = Clock()
    documents = iter(["a", "a", "a", "a", "b", "c"])
    produced: list[float] = []
    emitted: list[tuple[float, str]] = []

    def produce() -> str:
        produced.append(clock.now)
        return next(documents)

    def emit(text: str) -> bool:
        emitted.append((clock.now, text))
        return text != "c"  # the reader goes away after "c"

    def then(now: float) -> bool:
        if now == 12:
            watched.write_text("a write")  # a file change: a look, and a line even if equal
        return False

    waker = FakeWakeup(clock, then)
    follow(produce, [watched], emit, interval=5, clock=clock, wakeup=lambda: waker)
    assert produced == [0, 5, 10, 12, 17, 22]
    assert emitted == [(0, "a"), (12, "a"), (17, "b"), (22, "c")]
    assert waker.closed


@pytest.mark.parametrize("gone_after", [1, 3])
def test_follow_ends_when_the_reader_is_gone_between_changes(tmp_path, gone_after):
    clock = Clock()
    waker = FakeWakeup(clock, lambda now: len(waker.waits) >= gone_after)
    follow(
        lambda: "same",
        [tmp_path / "none"],
        lambda text: True,
        interval=100,
        clock=clock,
        wakeup=lambda: waker,
    )
    assert len(waker.waits) == gone_after
    assert waker.closed


def test_a_change_before_the_wait_is_made_is_not_lost(tmp_path):
    """The wait is set up after the first document is out; a write in between is seen
    by the signature taken before that document, and printed without any wait."""
    watched = tmp_path / "ledger.toml"
    clock = Clock()
    emitted: list[str] = []
    waker = FakeWakeup(clock, lambda now: True)

    def wakeup() -> FakeWakeup:
        watched.write_text("written while the first line was on its way")
        return waker

    documents = iter(["before", "after"])
    follow(
        lambda: next(documents),
        [watched],
        lambda text: emitted.append(text) is None,
        interval=100,
        clock=clock,
        wakeup=wakeup,
    )
    assert emitted == ["before", "after"]
    assert len(waker.waits) == 1  # the second line came before the first wait


def _in_a_moment(action, delay: float = 0.2) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), action()))
    thread.start()
    return thread


def test_a_ledger_write_wakes_the_wait_at_once(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.read()
    waker = FileWakeup([ledger.path, tmp_path / HISTORY], reader=None)
    assert not waker.polling
    try:

        def write() -> None:
            with ledger.transaction() as txn:
                txn.state = replace(txn.state, leases=(LEASE,))

        thread = _in_a_moment(write)
        started = time.monotonic()
        assert waker.wait(60) is False
        assert time.monotonic() - started < 30, "it slept to its timeout: no event woke it"
        thread.join()
    finally:
        waker.close()


def test_a_history_append_wakes_it_and_other_files_do_not(tmp_path):
    history = tmp_path / HISTORY
    history.write_text("")
    waker = FileWakeup([tmp_path / "ledger.toml", history], reader=None)
    try:
        # The lock file and the ledger's temporary file live there too: no wake-up.
        (tmp_path / "ledger.lock").write_text("")
        (tmp_path / "ledger.toml.tmp").write_text("x")
        started = time.monotonic()
        assert waker.wait(0.5) is False
        assert time.monotonic() - started >= 0.45, "woken by a file it does not watch"

        def append() -> None:
            with history.open("a") as handle:
                handle.write('{"event": "refused"}\n')

        thread = _in_a_moment(append)
        started = time.monotonic()
        assert waker.wait(60) is False
        assert time.monotonic() - started < 30, "the history's append did not wake it"
        thread.join()
    finally:
        waker.close()


def test_a_claims_burst_of_writes_is_one_wake_up(tmp_path):
    """A claim replaces the ledger and appends to the history a moment later: one wake-up
    (one look, one line), and nothing left over to wake the next wait."""
    ledger = Ledger(tmp_path)
    history = tmp_path / HISTORY
    waker = FileWakeup([ledger.path, history], reader=None)
    try:

        def claim() -> None:
            with ledger.transaction() as txn:
                txn.state = replace(txn.state, leases=(LEASE,))
            time.sleep(0.005)
            with history.open("a") as handle:
                handle.write('{"event": "active"}\n')

        thread = _in_a_moment(claim)
        assert waker.wait(60) is False
        thread.join()
        started = time.monotonic()
        assert waker.wait(0.5) is False
        assert time.monotonic() - started >= 0.45, "a second wake-up for the same claim"
    finally:
        waker.close()


def test_the_reader_closing_the_pipe_ends_the_wait(tmp_path):
    read_end, write_end = os.pipe()
    waker = FileWakeup([tmp_path / "ledger.toml"], reader=write_end)
    try:
        started = time.monotonic()
        assert waker.wait(0.3) is False  # a reader that is there: only the timeout
        assert time.monotonic() - started >= 0.25
        thread = _in_a_moment(lambda: os.close(read_end))
        started = time.monotonic()
        assert waker.wait(60) is True
        assert time.monotonic() - started < 30
        thread.join()
    finally:
        waker.close()
        os.close(write_end)


def test_without_a_watch_it_looks_every_tick_until_it_can_watch(tmp_path):
    """A state directory that is not there yet cannot be watched: the follower looks
    at the files once a tick instead, and watches it once it is made."""
    state = tmp_path / "not-yet"
    waker = FileWakeup([state / "ledger.toml"], reader=None, tick=0.2)
    try:
        assert waker.polling
        started = time.monotonic()
        assert waker.wait(60) is False
        assert time.monotonic() - started < 30, "a polling wait must end after its tick"
        state.mkdir()
        assert waker.wait(0.01) is False
        assert not waker.polling
    finally:
        waker.close()


def test_a_removed_directory_turns_the_watch_into_looking(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    waker = FileWakeup([state / "ledger.toml"], reader=None, tick=0.2)
    assert not waker.polling
    thread = _in_a_moment(state.rmdir)
    assert waker.wait(60) is False
    thread.join()
    assert waker.polling
    started = time.monotonic()
    assert waker.wait(60) is False
    assert time.monotonic() - started < 30
    assert waker.polling  # still nothing to watch
