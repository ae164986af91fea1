"""The history log on a real filesystem, with real concurrent writers and real
SIGKILLs (CHARLY_ARBITER_CRASH_AT kills the writing process with signal 9)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from opstools import REPO

from charly_arbiter.errors import ArbiterError
from charly_arbiter.ops.history import HistoryLog, Record, interrupted, parse_since, select

WRITER = """
import sys
from pathlib import Path
from charly_arbiter.ops.history import HistoryLog
log = HistoryLog(Path(sys.argv[1]), max_bytes=int(sys.argv[2]), keep=int(sys.argv[3]))
for n in range(int(sys.argv[4])):
    log.append("switching", {"claimant": f"libvirt:{sys.argv[5]}", "token": "gpu0", "n": n})
"""


def state_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    return directory


def writer(directory: Path, count: int, name: str, max_bytes: int = 1 << 20, keep: int = 3, **env):
    environment = {**os.environ, **env}
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(directory), str(max_bytes), str(keep), str(count), name],
        env=environment,
        cwd=REPO,
    )


def test_an_event_reads_back_with_its_fields_time_and_pid(tmp_path):
    log = HistoryLog(state_dir(tmp_path))
    log.append("refused", {"claimant": "libvirt:win11", "token": "gpu0,gpu1", "why": "busy\nnow"})
    reading = log.read()
    assert reading.notes == ()
    [record] = reading.records
    assert record.kind == "refused"
    assert record.pid == os.getpid()
    assert record.tokens == ("gpu0", "gpu1")
    assert record.get("why") == "busy\nnow"
    assert abs(record.time - datetime.now(UTC)) < timedelta(seconds=5)
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600


def test_rotation_keeps_the_log_bounded_and_the_newest_events(tmp_path):
    log = HistoryLog(state_dir(tmp_path), max_bytes=2000, keep=2)
    for n in range(300):
        log.append("claim", {"claimant": "libvirt:win11", "token": "gpu0", "n": n})
    files = log.files()
    assert [path.name for path in files] == ["history.jsonl.2", "history.jsonl.1", "history.jsonl"]
    assert all(path.stat().st_size <= 2000 for path in files)
    assert not (log.state_dir / "history.jsonl.3").exists()
    numbers = [record.fields["n"] for record in log.read().records]
    assert numbers == list(range(numbers[0], 300)), "oldest first, newest kept, none lost within"
    assert numbers[0] > 0, "the oldest events were dropped"


def test_concurrent_writers_never_interleave_lines_even_while_rotating(tmp_path):
    directory = state_dir(tmp_path)
    writers = [writer(directory, 150, f"vm{i}", max_bytes=6000, keep=50) for i in range(4)]
    assert [w.wait(60) for w in writers] == [0, 0, 0, 0]
    reading = HistoryLog(directory, keep=50).read()
    assert reading.notes == ()
    assert len(reading.records) == 600
    for name in ("vm0", "vm1", "vm2", "vm3"):
        mine = [r.fields["n"] for r in reading.records if r.get("claimant") == f"libvirt:{name}"]
        assert mine == list(range(150)), "each writer's events in its own order"


@pytest.mark.parametrize("step", ["history.write", "history.fsync", "history.rotate"])
def test_kill_9_during_an_append_leaves_a_readable_log(tmp_path, step):
    directory = state_dir(tmp_path)
    assert writer(directory, 20, "before", max_bytes=1500, keep=3).wait(30) == 0
    # The 5th append is killed at `step` (history.rotate: the first rotation it does).
    crashing = writer(
        directory,
        20,
        "killed",
        max_bytes=1500,
        keep=3,
        CHARLY_ARBITER_CRASH_AT=f"{step}#5" if step != "history.rotate" else step,
    )
    assert crashing.wait(30) == -signal.SIGKILL
    assert writer(directory, 3, "after", max_bytes=1500, keep=3).wait(30) == 0
    reading = HistoryLog(directory, max_bytes=1500, keep=3).read()
    assert reading.notes == ()
    names = [r.get("claimant") for r in reading.records]
    assert names[-3:] == ["libvirt:after"] * 3
    assert not list(directory.glob("history.jsonl.*.tmp"))


def test_a_routine_event_is_written_at_once_and_made_durable_by_the_next_other_one(
    tmp_path, monkeypatch
):
    """`switched` records what the ledger holds durably already: written, readable at
    once, not fsynced; `switching` (an action about to start on the host) is, and
    with it the line before it (fsync is the file's, not the line's)."""
    log = HistoryLog(state_dir(tmp_path))
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    log.append("switched", {"claimant": "libvirt:win11", "token": "gpu0"})
    assert synced == []
    assert [r.kind for r in log.read().records] == ["switched"]
    log.append("switching", {"claimant": "libvirt:win11", "token": "gpu0"})
    assert len(synced) == 1
    for kind in ("stopping", "starting", "refused", "failed", "poisoned", "recovered"):
        log.append(kind, {"claimant": "libvirt:win11"})
    assert len(synced) == 7, "every event but the routine ones is fsynced"


def test_a_torn_last_line_is_skipped_with_a_note_and_the_next_event_is_intact(tmp_path):
    """A power cut or a full disk can leave half a line; nothing after it may suffer."""
    log = HistoryLog(state_dir(tmp_path))
    log.append("claim", {"claimant": "libvirt:win11", "token": "gpu0"})
    with open(log.path, "ab") as handle:
        handle.write(b'{"time": "2026-11-29T10:00:00+00:00", "event": "swi')
    reading = log.read()
    assert [r.kind for r in reading.records] == ["claim"]
    assert len(reading.notes) == 1 and "line 2" in reading.notes[0]
    log.append("active", {"claimant": "libvirt:win11", "token": "gpu0"})
    reading = log.read()
    assert [r.kind for r in reading.records] == ["claim", "active"]
    assert len(reading.notes) == 1


def test_a_step_is_interrupted_when_it_is_the_last_event_of_a_dead_process(tmp_path, dead_pid):
    now = datetime.now(UTC)
    records = [
        Record(now, "stopping", dead_pid, {"claimant": "libvirt:a", "holder": "container:llm"}),
        Record(now, "preempted", dead_pid, {"claimant": "libvirt:a", "holder": "container:llm"}),
        Record(now, "switching", dead_pid, {"claimant": "libvirt:a", "token": "gpu0"}),
        Record(now, "switching", os.getpid(), {"claimant": "libvirt:b", "token": "gpu1"}),
    ]
    assert interrupted(records) == {2}, "the finished stop is not, a running process is not"


def test_select_by_token_includes_the_steps_of_claims_on_it(tmp_path):
    now = datetime.now(UTC)
    records = [
        Record(now - timedelta(hours=2), "claim", 10, {"claimant": "libvirt:a", "token": "gpu0"}),
        Record(now, "preempted", 10, {"claimant": "libvirt:a", "holder": "container:llm"}),
        Record(now, "preempted", 11, {"claimant": "libvirt:b", "holder": "container:x"}),
    ]
    assert select(records, token="gpu0") == records[:2]
    assert select(records, claimant="container:llm") == [records[1]]
    assert select(records, since=parse_since("1h", now)) == records[1:]


def test_since_accepts_relative_and_iso_times_and_names_a_bad_one():
    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert parse_since("30m", now) == now - timedelta(minutes=30)
    assert parse_since("2d", now) == now - timedelta(days=2)
    assert parse_since("2026-11-29T10:00+00:00") == datetime(2026, 11, 29, 10, tzinfo=UTC)
    with pytest.raises(ArbiterError, match="'yesterday' is not a time"):
        parse_since("yesterday")


def test_records_are_json_lines(tmp_path):
    log = HistoryLog(state_dir(tmp_path))
    log.append("switched", {"token": "gpu0", "seconds": 0.25})
    [line] = log.path.read_text().splitlines()
    assert json.loads(line)["seconds"] == 0.25
