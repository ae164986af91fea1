"""Events reach the journal's native socket with structured CHARLY_* fields.

A real AF_UNIX datagram socket stands in for journald's (there is no systemd
here); the datagrams are parsed by an independent reader of the protocol.
"""

from __future__ import annotations

import socket

import pytest
from opstools import decode_journal

from charly_arbiter.ops.journal import JournalSink


@pytest.fixture
def journal(tmp_path):
    path = tmp_path / "journal.socket"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.settimeout(10)
    yield path, receiver
    receiver.close()


def receive_all(receiver: socket.socket) -> list[dict[str, str]]:
    entries = []
    receiver.settimeout(0.5)
    while True:
        try:
            entries.append(dict(decode_journal(receiver.recv(1 << 20))))
        except TimeoutError:
            return entries


def test_an_event_is_one_entry_with_a_message_a_priority_and_its_fields(journal):
    path, receiver = journal
    JournalSink(path)("refused", {"claimant": "libvirt:win11", "token": "gpu1", "why": "busy"})
    entry = dict(decode_journal(receiver.recv(65536)))
    assert entry["CHARLY_EVENT"] == "refused"
    assert entry["CHARLY_CLAIMANT"] == "libvirt:win11"
    assert entry["CHARLY_TOKEN"] == "gpu1"
    assert entry["CHARLY_WHY"] == "busy"
    assert entry["PRIORITY"] == "4"
    assert entry["SYSLOG_IDENTIFIER"] == "charly-arbiter"
    assert entry["MESSAGE"] == "libvirt:win11 was refused gpu1: busy"


def test_a_value_with_a_newline_uses_the_binary_form(journal):
    path, receiver = journal
    JournalSink(path)("poisoned", {"token": "gpu0", "claimant": "x:y", "why": "line 1\nline 2"})
    entry = dict(decode_journal(receiver.recv(65536)))
    assert entry["CHARLY_WHY"] == "line 1\nline 2"
    assert entry["PRIORITY"] == "3"


def test_no_socket_means_nothing_is_sent_and_nothing_fails(tmp_path, caplog):
    """Without journald there is no attempt to send (the attempt would fail and be
    logged) and nothing is created in the socket's place."""
    path = tmp_path / "absent.socket"
    with caplog.at_level("DEBUG", logger="charly_arbiter.ops.journal"):
        JournalSink(path)("claim", {"claimant": "libvirt:a", "token": "gpu0"})
    assert caplog.records == []
    assert list(tmp_path.iterdir()) == []


def test_a_journal_that_went_away_is_logged_not_raised(journal, caplog):
    """A socket file whose journald is gone refuses the datagram: the event is not lost
    from the history, so the sink logs it at debug level and the claim goes on."""
    path, receiver = journal
    receiver.close()  # the file stays, nobody listens: sendto fails (ECONNREFUSED)
    with caplog.at_level("DEBUG", logger="charly_arbiter.ops.journal"):
        JournalSink(path)("claim", {"claimant": "libvirt:a", "token": "gpu0"})
    assert [record.levelname for record in caplog.records] == ["DEBUG"]
    assert "could not send event claim" in caplog.text


def test_a_journal_that_appears_later_gets_the_next_event(tmp_path):
    """The socket is looked for at each event, not once: journald may start after us."""
    path = tmp_path / "journal.socket"
    sink = JournalSink(path)
    sink("claim", {"claimant": "libvirt:a", "token": "gpu0"})
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(path))
        receiver.settimeout(10)
        sink("active", {"claimant": "libvirt:a", "token": "gpu0"})
        assert dict(decode_journal(receiver.recv(65536)))["CHARLY_EVENT"] == "active"


def test_the_cli_sends_each_step_of_a_claim_to_the_journal(sim, journal):
    path, receiver = journal
    env = sim.env(CHARLY_ARBITER_JOURNAL_SOCKET=str(path))
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", env=env)
    assert result.returncode == 0, result.stderr
    entries = receive_all(receiver)
    kinds = [entry["CHARLY_EVENT"] for entry in entries]
    assert kinds[0] == "claim" and kinds[-1] == "active"
    assert "switching" in kinds and "switched" in kinds
    stops = [e["CHARLY_HOLDER"] for e in entries if e["CHARLY_EVENT"] == "preempted"]
    assert sorted(stops) == ["container:llm", "systemd:ollama.service"]
    assert all(e["CHARLY_CLAIMANT"] == "libvirt:win11" for e in entries)
