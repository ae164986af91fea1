"""The processes a hook hands its work to: one hand-off value, a fixed environment.

A hook that must return at once (libvirt, a runtime and qemu-server wait for it)
starts `charly-arbiter _finish-release` or `_watch-start` with one argument, its
`Handoff` as JSON (hooksession.py).  These tests take the value through that
trip, refuse what is not one, start a real detached process from a caller
whose environment, directory and pipes it must not keep, and carry a hook's
release to its end through the real verb.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from charly_arbiter.core.config import load_config
from charly_arbiter.core.model import Mode, ProcessRef
from charly_arbiter.errors import UsageError
from charly_arbiter.hooksession import FINISH_RELEASE, Handoff
from charly_arbiter.host.procscan import process_ref
from charly_arbiter.host.run import ENVIRONMENT, spawn_detached
from tests.conftest import REPO, SimEnv


def _handoff(sim: SimEnv, **changes: object) -> Handoff:
    config = load_config(sim.config_path, environ={})
    return Handoff.of(config, "libvirt:win11", owner=ProcessRef(41, 7), **changes)  # type: ignore[arg-type]


def test_a_handoff_survives_its_trip_through_one_argument(
    sim: SimEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the hook knew comes back whole: a reason with quotes and spaces, a path
    that is not UTF-8, the owner; paths absolute whatever the hook's directory."""
    handoff = _handoff(sim, reason='it "crashed" = badly', success=False)
    assert Handoff.from_json(handoff.to_json()) == handoff
    assert handoff.to_json().isascii()
    odd = Handoff(None, "/var/lib/\udcff state", "local", "container:c", created="x")
    assert Handoff.from_json(odd.to_json()) == odd
    monkeypatch.chdir(sim.root)
    relative = load_config(Path("arbiter.toml"), environ={})
    moved = Handoff.of(relative, "container:c")
    assert moved.config == str(sim.config_path) and Path(moved.state_dir).is_absolute()


BAD = {
    "not-json": "{",
    "a-list": "[]",
    "a-field-missing": '{"config": null, "state_dir": "/s", "host": "local"}',
    "an-unknown-field": (
        '{"config": null, "state_dir": "/s", "host": "local", "claimant": "libvirt:a", "x": 1}'
    ),
    "a-relative-state-dir": (
        '{"config": null, "state_dir": "s", "host": "local", "claimant": "libvirt:a"}'
    ),
    "success-as-text": (
        '{"config": null, "state_dir": "/s", "host": "local", "claimant": "libvirt:a", '
        '"success": "yes"}'
    ),
    "an-owner-that-is-no-process": (
        '{"config": null, "state_dir": "/s", "host": "local", "claimant": "libvirt:a", '
        '"owner": {"pid": true}}'
    ),
    "an-owner-below-zero": (
        '{"config": null, "state_dir": "/s", "host": "local", "claimant": "libvirt:a", '
        '"owner": {"pid": 4, "start": -1}}'
    ),
}


@pytest.mark.parametrize("text", BAD.values(), ids=BAD.keys())
def test_what_is_not_a_handoff_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError):
        Handoff.from_json(text)


def test_a_detached_process_keeps_nothing_of_its_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own session, the fixed environment (nothing of the hook's: no PYTHONPATH, no
    CHARLY_ARBITER_*), `/` as its directory, /dev/null on stdin, stdout and stderr (the
    hook's caller waits for EOF on its pipes)."""
    report = tmp_path / "report"
    monkeypatch.setenv("CHARLY_ARBITER_HOST", "sim:/nowhere")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    monkeypatch.chdir(tmp_path)
    script = (
        "import json, os, sys\n"
        "fds = [os.readlink(f'/proc/self/fd/{n}') for n in (0, 1, 2)]\n"
        "state = {'env': dict(os.environ), 'cwd': os.getcwd(), 'fds': fds,\n"
        "         'sid': os.getsid(0), 'pid': os.getpid()}\n"
        f"open({str(report) + '.tmp'!r}, 'w').write(json.dumps(state))\n"
        f"os.rename({str(report) + '.tmp'!r}, {str(report)!r})\n"
    )
    spawn_detached([sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    while not report.exists():
        assert time.monotonic() < deadline, "the detached process never ran"
        time.sleep(0.02)
    seen = json.loads(report.read_text())
    assert seen["env"] == ENVIRONMENT
    assert seen["cwd"] == "/"
    assert seen["fds"] == ["/dev/null"] * 3
    assert seen["sid"] == seen["pid"] != os.getsid(0)


def test_the_finish_takes_a_release_over_from_the_hook_that_began_it(sim: SimEnv) -> None:
    """A hook began the release (the lease `releasing`, its writer the hook) and is still
    alive: the real `_finish-release`, handed that hook as owner, carries it to its end;
    one handed another owner is refused (exit 3) and changes nothing."""
    arbiter = sim.arbiter()
    plan = arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    stopped = [step.holder for step in plan.stops]
    assert stopped
    sim.stopped("libvirt:win11")
    hook = subprocess.Popen(["/bin/sleep", "60"])
    try:
        owner = process_ref(Path("/proc"), hook.pid)
        assert owner is not None
        arbiter.owner = owner  # the hook that began it
        assert arbiter.releaser().begin("libvirt:win11", True, "shutdown") is not None
        assert sim.status()["leases"][0]["state"] == "releasing"
        config = load_config(sim.config_path, environ={})
        for handed, code in ((ProcessRef(1, 1), 3), (owner, 0)):
            handoff = Handoff.of(config, "libvirt:win11", reason="shutdown", owner=handed)
            result = subprocess.run(
                [sys.executable, "-m", "charly_arbiter", FINISH_RELEASE, handoff.to_json()],
                capture_output=True,
                text=True,
                env=sim.env(),
                timeout=60,
                cwd=REPO,
            )
            assert (result.returncode, result.stdout) == (code, ""), result.stderr
            if code:
                assert sim.status()["leases"][0]["state"] == "releasing"
    finally:
        hook.kill()
        hook.wait()
    assert sim.status()["leases"] == []
    assert all(sim.host().is_running(holder) for holder in stopped)
