"""The local host's sleep locks (host/inhibit.py): the exact commands, against small
stand-ins for systemd-run and systemctl that keep each transient unit as a file (this
machine's systemd is not PID 1 here; the real logind is met in the systemd guest of
tests/kernel).  A host without systemd cannot hold a lock and says why."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from charly_arbiter.errors import HostError
from charly_arbiter.host.inhibit import SleepLocks, token_of, unit_of

# systemd-run: refuses a unit name that is loaded already (as systemd does), else
# "starts" it: a file named after the unit holding its description and command.
SYSTEMD_RUN = """
import json, os, sys
units = os.environ["FAKE_UNITS"]
args = sys.argv[1:]
with open(os.path.join(units, "calls"), "a") as log:
    log.write(json.dumps(["systemd-run", *args]) + "\\n")
unit = next(a.split("=", 1)[1] for a in args if a.startswith("--unit="))
description = next(a.split("=", 1)[1] for a in args if a.startswith("--description="))
path = os.path.join(units, unit)
if os.path.exists(path):
    sys.stderr.write(f"Failed to start transient service unit: Unit {unit} was already loaded\\n")
    sys.exit(1)
with open(path, "w") as unit_file:
    json.dump({"description": description, "command": args[args.index("--") + 1:]}, unit_file)
"""
SYSTEMCTL = """
import fnmatch, json, os, sys
units = os.environ["FAKE_UNITS"]
args = sys.argv[1:]
with open(os.path.join(units, "calls"), "a") as log:
    log.write(json.dumps(["systemctl", *args]) + "\\n")
names = args[args.index("--") + 1:]
if args[0] == "stop":
    path = os.path.join(units, names[0])
    if not os.path.exists(path):
        sys.stderr.write(f"Failed to stop {names[0]}: Unit {names[0]} not loaded.\\n")
        sys.exit(5)
    os.unlink(path)
elif args[0] == "list-units":
    for unit in sorted(os.listdir(units)):
        if fnmatch.fnmatch(unit, names[0]):
            with open(os.path.join(units, unit)) as unit_file:
                description = json.load(unit_file)["description"]
            print(f"{unit} loaded active running {description}")
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    units = tmp_path / "units"
    units.mkdir()
    for name, body in (("systemd-run", SYSTEMD_RUN), ("systemctl", SYSTEMCTL)):
        script = bin_dir / name
        script.write_text(f"#!{sys.executable}\n{body}")
        script.chmod(0o755)
    (bin_dir / "systemd-inhibit").write_text("")
    (bin_dir / "sleep").write_text("")
    monkeypatch.setattr(
        "charly_arbiter.host.run.ENVIRONMENT", {**os.environ, "FAKE_UNITS": str(units)}
    )
    (tmp_path / "run" / "systemd" / "system").mkdir(parents=True)
    return tmp_path


def locks(root: Path, **missing: bool) -> SleepLocks:
    def which(name: str) -> str | None:
        return None if missing.get(name.replace("-", "_")) else str(root / "bin" / name)

    return SleepLocks(root / "run", start_timeout=10, stop_timeout=10, which=which)


def calls(root: Path) -> list[list[str]]:
    path = root / "units" / "calls"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_lock_is_a_transient_unit_running_systemd_inhibit_until_it_is_stopped(fake):
    host = locks(fake)
    why = "gpu0 is passed through to libvirt:my vm"
    host.inhibit("gpu0", why)
    bin_dir = fake / "bin"
    assert calls(fake)[0] == [
        "systemd-run",
        "--unit=charly-arbiter-inhibit-gpu0.service",
        "--collect",
        "--quiet",
        f"--description={why}",
        "--",
        str(bin_dir / "systemd-inhibit"),
        "--what=sleep",
        "--who=charly-arbiter",
        f"--why={why}",
        "--mode=block",
        str(bin_dir / "sleep"),
        "infinity",
    ]
    assert host.inhibitors() == {"gpu0": why}
    host.uninhibit("gpu0")
    assert calls(fake)[-1] == ["systemctl", "stop", "--", "charly-arbiter-inhibit-gpu0.service"]
    assert host.inhibitors() == {}
    host.uninhibit("gpu0")  # none held: nothing to do, no error


def test_a_unit_left_by_an_earlier_lock_is_stopped_and_started_with_the_new_why(fake):
    host = locks(fake)
    host.inhibit("gpu0", "gpu0 is passed through to libvirt:old")
    host.inhibit("gpu0", "gpu0 is passed through to libvirt:new")
    assert host.inhibitors() == {"gpu0": "gpu0 is passed through to libvirt:new"}


def test_a_host_without_systemd_cannot_hold_a_lock_and_says_why(fake):
    (fake / "run" / "systemd" / "system").rmdir()
    host = locks(fake)
    assert "systemd is not running here" in (host.unavailable() or "")
    with pytest.raises(HostError, match="gpu0: cannot block sleep: systemd is not running here"):
        host.inhibit("gpu0", "why")
    assert host.inhibitors() == {}
    assert calls(fake) == []


def test_a_missing_program_is_named(fake):
    host = locks(fake, systemd_inhibit=True)
    assert host.unavailable() == "systemd-inhibit is not installed"
    with pytest.raises(HostError, match="systemd-inhibit is not installed"):
        host.inhibit("gpu0", "why")


def test_units_are_named_after_tokens_and_read_back():
    assert unit_of("0000:0a:00.0") == "charly-arbiter-inhibit-0000:0a:00.0.service"
    assert token_of(unit_of("gpu0")) == "gpu0"
    assert token_of("ssh.service") is None
    with pytest.raises(HostError):
        unit_of("gpu0/../x")
