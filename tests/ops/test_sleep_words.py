"""Whether the host may suspend while a GPU is passed through, in `status` (text and
--json) and `explain`, through the real CLI on the simulated host: a lock held, a lock
the host could not take (no systemd) with what to do, and `sleep = "allow"`."""

from __future__ import annotations

import json

from tests.conftest import DEFAULT_CONFIG

WHY = "gpu0 is passed through to libvirt:win11"


def test_a_held_lock_in_status_and_explain(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    text = sim.cli("status", check=True).stdout
    assert f"  sleep blocked while {WHY}\n" in text
    document = sim.status()
    assert document["sleep"] == {
        "policy": "block",
        "locks": {"gpu0": WHY},
        "missing": [],
        "unavailable": None,
    }
    assert document["tokens"]["gpu0"]["sleep_blocked"] == WHY
    assert document["tokens"]["gpu1"]["sleep_blocked"] is None
    assert document["leases"][0]["sleep_locks"] == ["gpu0"]
    for subject in ("gpu0", "libvirt:win11"):
        explained = sim.cli("explain", subject, check=True).stdout
        assert (
            "Sleep is blocked while it is passed through: a logind inhibitor lock (what sleep, "
            f'who charly-arbiter) says "{WHY}"' in explained
        )

    sim.stopped("libvirt:win11")
    sim.cli("release", "libvirt:win11", check=True)
    assert "sleep" not in sim.cli("status", check=True).stdout
    assert sim.status()["sleep"]["locks"] == {}


def test_a_host_without_systemd_says_sleep_is_not_blocked_and_what_to_do(sim):
    sim.set_host("systemd = false\n" + (sim.sim_dir / "host.toml").read_text())
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    text = sim.cli("status", check=True).stdout
    assert (
        "SLEEP NOT BLOCKED while it is passed through: gpu0: cannot block sleep: "
        "systemd is not running here" in text
    )
    assert "hint: run `charly-arbiter restore --stranded` to take the lock again" in text
    document = sim.status()
    assert document["sleep"]["missing"] == ["gpu0"]
    assert "systemd is not running here" in document["sleep"]["unavailable"]
    assert "systemd is not running here" in document["leases"][0]["sleep_lock_error"]
    explained = sim.cli("explain", "gpu0", check=True).stdout
    assert "Sleep is NOT blocked while gpu0 is passed through" in explained
    assert "run `charly-arbiter restore --stranded`, which takes it" in explained

    # systemd is there again: restore takes the lock, and the lease forgets the failure.
    sim.set_host((sim.sim_dir / "host.toml").read_text().replace("systemd = false\n", ""))
    assert sim.cli("restore", "--stranded").returncode == 0
    assert sim.status()["sleep"]["locks"] == {"gpu0": WHY}
    assert sim.status()["leases"][0]["sleep_lock_error"] == ""


def test_sleep_allow_is_said_as_the_operator_s_choice(make_sim):
    sim = make_sim(config='sleep = "allow"\n' + DEFAULT_CONFIG)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    assert (
        '  sleep allowed while it is passed through (sleep = "allow")'
        in sim.cli("status", check=True).stdout
    )
    assert sim.status()["sleep"]["policy"] == "allow"
    assert (
        "Sleep is allowed while it is passed through"
        in sim.cli("explain", "gpu0", check=True).stdout
    )


def test_doctor_says_whether_sleep_can_be_blocked(sim, tmp_path):
    def sleep_check() -> dict[str, str]:
        result = sim.cli("doctor", "--json", "--hook", str(tmp_path / "absent"))
        return next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "sleep")

    assert sleep_check()["level"] == "ok"
    sim.set_host("systemd = false\n" + (sim.sim_dir / "host.toml").read_text())
    check = sleep_check()
    assert check["level"] == "warning"
    assert (
        "sleep cannot be blocked while a GPU is passed through: systemd is not running"
        in (check["message"])
    )
    assert 'sleep = "allow"' in check["fix"]
    sim.config_path.write_text('sleep = "allow"\n' + sim.config_path.read_text())
    assert sleep_check() == {
        "fix": "",
        "level": "ok",
        "message": 'sleep = "allow": the host may suspend while a GPU is passed through',
        "name": "sleep",
    }
