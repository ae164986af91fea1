"""`attach` / `detach`: a systemd service that claims by itself, and its drop-in.

The drop-in is checked by systemd's own parser (`systemd-analyze verify`, with
the unit directory on SYSTEMD_UNIT_PATH: there is no systemd PID 1 here), and
its ExecStartPre= and ExecStopPost= commands are run as systemd would run
them (split and unescaped the way systemd does for the quoting `attach` uses),
against the simulated host: the unit's claim and its release land in the ledger.
That stand-in for systemd keeps these tests fast and lets them attack the
quoting with any unit name; systemd itself runs the drop-ins of the installed
package in tests/kernel/test_systemd_units.py (start, stop, a refused start, a
crash of the main process, a unit preempted by an exclusive claim).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from charly_arbiter.core.config import load_config
from charly_arbiter.errors import ConfigError

UNIT = "llm@a\\x2db.service"  # an instance with an escaped dash: quoting must keep it
REF = f"systemd:{UNIT}"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.fixture
def units(tmp_path: Path) -> Path:
    directory = tmp_path / "units"
    directory.mkdir()
    (directory / "llm@.service").write_text(
        "[Unit]\nDescription=an inference server\n[Service]\nExecStart=/bin/sleep 1000\n"
    )
    return directory


def exec_lines(dropin: Path, key: str) -> list[str]:
    """The argv of each KEY= line, as systemd splits it: prefixes, quotes, C escapes
    inside quotes, `%%` and `$$` (the subset of the syntax `attach` writes)."""
    found = []
    for line in dropin.read_text().splitlines():
        if line.startswith(f"{key}="):
            command = line.partition("=")[2].lstrip("-+@:!")
            argv = shlex.split(command.replace("%%", "%").replace("$$", "$"))
            found.append(argv)
    return found


def systemd_verify(units: Path) -> subprocess.CompletedProcess[str]:
    """systemd's own parser on the unit, its directory on SYSTEMD_UNIT_PATH."""
    if SYSTEMD_ANALYZE is None:
        pytest.fail("systemd-analyze is missing: install systemd (scripts/apt-packages.txt)")
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", UNIT],
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_attach_writes_a_drop_in_systemd_accepts_and_claims_as_the_unit(sim, units) -> None:
    result = sim.cli("attach", "--unit-dir", str(units), REF, "gpu0", check=True)
    dropin = units / f"{UNIT}.d" / "charly-arbiter.conf"
    assert f"attached {REF} to gpu0 (shared): {dropin}" in result.stdout
    text = dropin.read_text()
    assert "ExecStartPre=+" in text and "ExecStopPost=-+" in text

    verify = systemd_verify(units)
    assert (verify.returncode, verify.stderr) == (0, ""), verify.stderr

    [start] = exec_lines(dropin, "ExecStartPre")
    [stop] = exec_lines(dropin, "ExecStopPost")
    assert start[-4:] == ["--shared", "--", REF, "gpu0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}
    # systemd's environment has none of ours: the drop-in carries --config itself.
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=60)
    [lease] = sim.status()["leases"]
    assert (lease["claimant"], lease["mode"], lease["tokens"]) == (REF, "shared", ["gpu0"])
    subprocess.run(stop, check=True, env=env, capture_output=True, timeout=60)
    assert sim.status()["leases"] == []

    status = sim.status()
    assert status["attached"] == [
        {
            "unit": REF,
            "tokens": ["gpu0"],
            "mode": "shared",
            "preemptible": True,
            "dropin": str(dropin),
        }
    ]
    table = sim.cli("status", check=True).stdout
    assert "attached units" in table and REF in table


def test_a_wrong_program_in_the_drop_in_fails_systemds_check(sim, units) -> None:
    """The check above can fail: systemd-analyze refuses a program that is not there."""
    sim.cli("attach", "--unit-dir", str(units), REF, "gpu0", check=True)
    dropin = units / f"{UNIT}.d" / "charly-arbiter.conf"
    [start] = exec_lines(dropin, "ExecStartPre")
    dropin.write_text(dropin.read_text().replace(start[0], "/nonexistent/charly-arbiter"))
    verify = systemd_verify(units)
    assert verify.returncode != 0 and "not executable" in verify.stderr


def test_an_attached_unit_is_recorded_as_a_holder_with_its_preemptibility(sim, units) -> None:
    sim.cli("attach", "--unit-dir", str(units), "--no-preemptible", REF, "gpu0", check=True)
    config = load_config(sim.config_path, environ={})
    holder = config.holder(REF)
    assert holder is not None and holder.attached is not None
    assert (holder.tokens, holder.preemptible, holder.mode) == (("gpu0",), False, "shared")
    assert json.loads(sim.cli("status", "--json").stdout)["attached"][0]["preemptible"] is False


def test_detach_removes_both_and_refuses_while_the_unit_holds_a_lease(sim, units) -> None:
    sim.cli("attach", "--unit-dir", str(units), REF, "gpu0", check=True)
    dropin = units / f"{UNIT}.d" / "charly-arbiter.conf"
    record = sim.config_path.parent / "attached.d" / f"{UNIT}.toml"
    assert dropin.exists() and record.exists()
    sim.cli("acquire", "--shared", REF, "gpu0", check=True)
    refused = sim.cli("detach", REF)
    assert refused.returncode == 3
    assert "holds a shared lease on gpu0" in refused.stderr
    assert dropin.exists() and record.exists()

    sim.cli("release", "--force", REF, check=True)
    assert sim.cli("detach", REF, check=True).stdout.startswith(f"detached {REF}")
    assert not dropin.exists() and not dropin.parent.exists() and not record.exists()
    assert sim.status()["attached"] == []
    assert "is not attached" in sim.cli("detach", REF, check=True).stdout


def test_attach_refuses_what_it_cannot_do_and_changes_nothing(sim, units) -> None:
    cases = [
        (["systemd:not a unit", "gpu0"], "a unit name ends with its type"),
        (["systemd:x.socket", "gpu0"], "is not the name of a service unit"),
        (["libvirt:vm", "gpu0"], "only systemd units attach"),
        (["systemd:x.service", "gpu9"], "gpu9"),
    ]
    for args, message in cases:
        result = sim.cli("attach", "--unit-dir", str(units), *args)
        assert result.returncode != 0 and message in result.stderr, (args, result.stderr)
    assert sorted(p.name for p in units.iterdir()) == ["llm@.service"]
    assert not (sim.config_path.parent / "attached.d").exists()


def test_an_attached_record_is_validated_like_arbiter_toml(sim) -> None:
    attached = sim.config_path.parent / "attached.d"
    attached.mkdir()
    record = attached / "x.service.toml"
    record.write_text('kind = "systemd"\nname = "x.service"\ntokens = ["gpu0"]\nbogus = 1\n')
    with pytest.raises(ConfigError) as error:
        load_config(sim.config_path, environ={})
    assert error.value.path == record and error.value.key == "bogus"
    result = sim.cli("status")
    assert result.returncode == 2 and f"{record}: bogus: is not a known setting" in result.stderr

    record.write_text('kind = "systemd"\nname = "x.service"\ntokens = ["gpu7"]\n')
    with pytest.raises(ConfigError, match="'gpu7' is not a configured token"):
        load_config(sim.config_path, environ={})
    record.write_text('kind = "systemd"\nname = "x.service"\ntokens = ["gpu0"]\n')
    assert load_config(sim.config_path, environ={}).holder("systemd:x.service") is not None
    duplicate = attached / "y.toml"
    duplicate.write_text('kind = "systemd"\nname = "x.service"\ntokens = ["gpu0"]\n')
    with pytest.raises(ConfigError, match=r"is listed in .*x\.service\.toml already"):
        load_config(sim.config_path, environ={})
