"""The operator CLI as a user meets it when something is wrong: real processes,
exit codes, stdout holding only the command's output, short errors on stderr,
and the refusals to use an unsafe state directory or an invalid configuration."""

from __future__ import annotations

import os
import time

import pytest
from clitools import ledger_locked
from simhosts import default_host


def assert_short_error(result, *needles):
    """One or two sentences (an error line and a hint) on stderr, nothing on stdout."""
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2, result.stderr
    assert lines[0].startswith("charly-arbiter: ")
    if len(lines) == 2:
        assert lines[1].startswith("hint: ")
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def test_exit_codes(sim):
    ok = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert ok.returncode == 0 and "Traceback" not in ok.stderr  # stderr: progress lines
    assert ok.stdout.startswith("libvirt:win11 holds gpu0 (exclusive); stopped ")

    refused = sim.cli("acquire", "--exclusive", "libvirt:other", "gpu0")
    assert refused.returncode == 3
    assert_short_error(refused, "gpu0", "libvirt:win11", "hint:")

    unknown = sim.cli("acquire", "--shared", "container:x", "gpu9")
    assert unknown.returncode == 2  # a name that names nothing: usage
    assert_short_error(unknown, "gpu9", "gpu0, gpu1")

    usage = sim.cli("acquire", "libvirt:x", "gpu0")
    assert usage.returncode == 2 and usage.stdout == ""
    assert "--exclusive or --shared" in usage.stderr
    assert sim.cli("frobnicate").returncode == 2
    assert sim.cli("restore", "--stranded", "libvirt:x").returncode == 2


def test_non_preemptible_refusal_names_the_holder(sim):
    refused = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu1")
    assert refused.returncode == 3
    assert_short_error(
        refused, "gpu1 (0000:0b:00.0)", "systemd:display-manager.service", "not preemptible"
    )


def test_bad_claimant_is_an_error_naming_it(sim):
    result = sim.cli("acquire", "--shared", "nocolon", "gpu0")
    assert result.returncode == 2
    assert_short_error(result, "'nocolon'", "KIND:NAME")


def test_traceback_only_with_verbose(make_sim):
    sim = make_sim(default_host(gpu0="fail_switch = true"))
    quiet = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
    assert quiet.stdout == ""
    sim.cli("poison", "clear", "gpu0", check=True)
    loud = sim.cli("-v", "acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert loud.returncode == 1
    assert "Traceback" in loud.stderr and "SwitchFailed" in loud.stderr
    assert loud.stdout == ""


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ('host = "sim:{sim}"\nstate_dir = 5\n', "state_dir", "expected a string"),
        ('host = "sim:{sim}"\n[timeouts]\nlock_wait = "x"\n', "timeouts.lock_wait", "above 0"),
        # Issue 9: nan waited forever (lock_wait) or raised after holders were stopped
        # (driver_switch); infinities and absurd values are refused the same way.
        ('host = "sim:{sim}"\n[timeouts]\nlock_wait = nan\n', "timeouts.lock_wait", "above 0"),
        ('host = "sim:{sim}"\n[timeouts]\ndriver_switch = nan\n', "timeouts.driver_switch", "0"),
        ('host = "sim:{sim}"\n[timeouts]\nholder_stop = inf\n', "timeouts.holder_stop", "0"),
        ('host = "sim:{sim}"\n[timeouts]\nclaim_wait = 1e9\n', "timeouts.claim_wait", "most"),
        # The state directory would put the ledger among the system's own files.
        ('host = "sim:{sim}"\nstate_dir = "/"\n', "state_dir", "system directory"),
        ('host = "sim:{sim}"\nstate_dir = "/etc"\n', "state_dir", "system directory"),
        ('host = "sim:{sim}"\nstate_dir = "/var/lib"\n', "state_dir", "system directory"),
        ('host = "sim:{sim}"\nstate_dir = "state"\n', "state_dir", "not an absolute path"),
        ('host = "sim:{sim}"\nstate_dir = "/var/lib/x/../.."\n', "state_dir", "normalised"),
        (
            'host = "sim:{sim}"\n[tokens.gpu0]\naddress = "0000:0a:00.0"\n'
            'home_driver = "../../x"\n',
            "tokens.gpu0.home_driver",
            "not a kernel driver name",
        ),
        (
            'host = "sim:{sim}"\n[[holders]]\nkind = "systemd"\nname = "a.service"\n'
            "tokens = [1, 2]\n",
            "holders[0].tokens",
            "list of token names",
        ),
        ('host = "sim:{sim}"\nhook_log = "hook.log"\n', "hook_log", "not an absolute path"),
        ('host = "sim:{sim}"\nlibvirt_uri = "qemu:///x\\n"\n', "libvirt_uri", "control"),
        ('host = "sim:{sim}"\n[timeouts]\nlock_wai = 1\n', "timeouts.lock_wai", "not a known"),
        ('host = "sim:{sim}"\n[tokens.gpu0]\naddress = "0a:00.0"\n', "tokens.gpu0.address", "PCI"),
        ('host = "sim:{sim}"\n[tokens.gpu0]\n', "tokens.gpu0.address", "is missing"),
        ('host = "sim:{sim}"\nfrobnicate = 1\n', "frobnicate", "not a known setting"),
        ('host = "nowhere"\n', "host", "not `local` or `sim:DIR`"),
        ('host = "sim:{sim}"\n[[holders]]\nkind = "x"\n', "holders[0].kind", "expected one of"),
        ('host = "sim:{sim}"\ndevice_holder_policy = "kill"\n', "device_holder_policy", "refuse"),
        ("host = [\n", None, "is not valid TOML"),
    ],
)
def test_config_errors_name_the_file_and_the_key(sim, text, key, why):
    sim.config_path.write_text(text.format(sim=sim.sim_dir))
    result = sim.cli("status")
    assert result.returncode == 2  # like a usage error: the command line's file is wrong
    assert_short_error(result, str(sim.config_path), why)
    if key:
        assert f"{sim.config_path}: {key}: " in result.stderr


@pytest.mark.parametrize(
    ("mode", "why"), [(0o666, "world-writable"), (0o620, "group- or world-writable")]
)
def test_a_configuration_others_can_change_is_refused(sim, mode, why):
    sim.config_path.chmod(mode)
    before = sim.host().snapshot()
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 2
    assert_short_error(result, str(sim.config_path), why)
    assert sim.host().snapshot() == before
    assert not (sim.state_dir / "ledger.toml").exists()


def test_a_configuration_that_is_not_a_file_is_refused(sim):
    sim.config_path.unlink()
    os.mkfifo(sim.config_path, 0o600)  # a FIFO would block a reader without O_NONBLOCK
    result = sim.cli("status", timeout=20)
    assert result.returncode == 2
    assert_short_error(result, str(sim.config_path), "not a regular file")


def test_environment_and_options_override_the_configuration(sim, tmp_path):
    other = tmp_path / "other-state"
    env = sim.env(CHARLY_ARBITER_STATE_DIR=str(other))
    sim.cli("acquire", "--shared", "container:x", "gpu0", env=env, check=True)
    assert (other / "ledger.toml").exists()
    assert not (sim.state_dir / "ledger.toml").exists()
    elsewhere = tmp_path / "third"
    sim.cli(
        "--state-dir",
        str(elsewhere),
        "acquire",
        "--shared",
        "container:y",
        "gpu0",
        env=env,
        check=True,
    )
    assert (elsewhere / "ledger.toml").exists()


def test_state_dir_that_is_a_symlink_is_refused(sim, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    sim.state_dir.symlink_to(real)
    result = sim.cli("acquire", "--shared", "container:x", "gpu0")
    assert result.returncode == 1
    assert_short_error(result, str(sim.state_dir), "symlink")
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_group_or_world_writable_state_dir_is_refused(sim, mode):
    sim.state_dir.mkdir()
    sim.state_dir.chmod(mode)
    for args in (("acquire", "--shared", "container:x", "gpu0"), ("status",)):
        result = sim.cli(*args)
        assert result.returncode == 1
        assert_short_error(result, str(sim.state_dir), "writable")


def test_ledger_files_that_are_symlinks_or_writable_are_refused(sim, tmp_path):
    sim.cli("acquire", "--shared", "container:x", "gpu0", check=True)
    ledger = sim.state_dir / "ledger.toml"
    ledger.chmod(0o666)
    assert_short_error(sim.cli("release", "--force", "container:x"), str(ledger), "writable")
    ledger.chmod(0o600)
    target = tmp_path / "elsewhere.toml"
    ledger.rename(target)
    ledger.symlink_to(target)
    assert_short_error(sim.cli("release", "--force", "container:x"), str(ledger), "symlink")
    ledger.unlink()
    target.rename(ledger)
    lock = sim.state_dir / "ledger.lock"
    lock.unlink()
    lock.symlink_to(tmp_path / "lock-target")
    assert_short_error(sim.cli("release", "--force", "container:x"), "ledger.lock")
    assert not (tmp_path / "lock-target").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the owner check applies when running as root")
def test_state_dir_not_owned_by_root_is_refused(sim):
    sim.state_dir.mkdir(mode=0o700)
    os.chown(sim.state_dir, 1000, 1000)
    result = sim.cli("acquire", "--shared", "container:x", "gpu0")
    assert result.returncode == 1
    assert_short_error(result, str(sim.state_dir), "owned by uid 1000")
    os.chown(sim.state_dir, 0, 0)
    sim.cli("acquire", "--shared", "container:x", "gpu0", check=True)
    os.chown(sim.state_dir / "ledger.toml", 1000, 0)
    assert_short_error(sim.cli("status"), "ledger.toml", "owned by uid 1000")


def test_a_lock_held_by_another_process_gives_ledger_busy_naming_its_pid(sim):
    """A real second process holds the ledger lock (through the real Ledger)."""
    sim.config_path.write_text(
        sim.config_path.read_text().replace("lock_wait = 20", "lock_wait = 1.5")
    )
    with ledger_locked(sim.state_dir) as pid:
        started = time.monotonic()
        result = sim.cli("acquire", "--shared", "container:x", "gpu0")
        elapsed = time.monotonic() - started
        assert result.returncode == 1
        assert_short_error(result, f"held by process {pid}", "gave up after 1.5 s")
        assert 1.5 <= elapsed < 10
        # Reading needs no lock: status works while the lock is held.
        assert sim.cli("status", "--json").returncode == 0
    # The kernel released the flock with the process: no stale lock.
    sim.cli("acquire", "--shared", "container:x", "gpu0", check=True)
