"""The CLI's boundary (cli/app.py) when the host's environment refuses: sentences, not
"internal error", under real conditions.

A read-only filesystem is a read-only bind mount of the state directory, and a
full one a tmpfs with a size limit, each in a mount namespace of the command's
own (`unshare -m`, as root); an immutable directory is `chattr +i`; a missing
permission is the command run as `nobody` (setpriv); a lock held by a process
of another user is a real process that took the flock and then became `nobody`.
Ctrl-C and SIGTERM are real signals sent to a real claim whose switch hangs
(the simulated host's fault injection, docs/simulated-host.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from clitools import FULL, READ_ONLY, as_at_a_terminal, interrupted_claim, ledger_locked, namespaced
from simhosts import default_host

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import LeaseState
from tests.conftest import DEFAULT_CONFIG, REPO, SimEnv

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts, chattr and setpriv need root")


def one_or_two_sentences(stderr: str, *needles: str) -> None:
    """`charly-arbiter: …` and maybe `hint: …`, naming what it is about; never a bug's words."""
    lines = stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2, stderr
    assert lines[0].startswith("charly-arbiter: "), stderr
    assert len(lines) == 1 or lines[1].startswith("hint: "), stderr
    assert "internal error" not in stderr and "Traceback" not in stderr and "Errno" not in stderr
    for needle in needles:
        assert needle in stderr, (needle, stderr)


def in_namespace(setup: str, state_dir: Path, argv: list[str], env: dict[str, str]) -> str:
    """The CLI with `argv` in a mount namespace of its own, after `setup`: it fails (1)."""
    result = subprocess.run(
        namespaced(setup, state_dir, [sys.executable, "-m", "charly_arbiter", *argv]),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    return result.stderr


def test_a_read_only_state_directory_is_one_sentence_naming_it_and_the_fix(sim: SimEnv) -> None:
    sim.state_dir.mkdir(mode=0o700)
    argv = ["acquire", "--exclusive", "libvirt:win11", "gpu0"]
    stderr = in_namespace(READ_ONLY, sim.state_dir, argv, sim.env())
    one_or_two_sentences(stderr, str(sim.state_dir), "read-only filesystem", "remount")
    assert sim.host().snapshot()["log"] == []  # nothing was stopped or switched
    # doctor says so too, with the same fix.
    doctor = subprocess.run(
        namespaced(
            READ_ONLY,
            sim.state_dir,
            [sys.executable, "-m", "charly_arbiter", "doctor", "--hook", str(sim.config_path)],
        ),
        capture_output=True,
        text=True,
        env=sim.env(),
        cwd=REPO,
        timeout=120,
    )
    assert doctor.returncode == 1
    assert f"problem  state dir: {sim.state_dir} cannot be written: it is on a read-only" in (
        doctor.stdout
    )


def test_a_full_state_directory_is_one_sentence_and_the_ledger_is_kept(sim: SimEnv) -> None:
    sim.state_dir.mkdir(mode=0o700)
    argv = ["acquire", "--shared", "container:x", "gpu0"]
    stderr = in_namespace(FULL, sim.state_dir, argv, sim.env())
    one_or_two_sentences(stderr, "is full", "free space on", "the previous state is kept")


def test_an_immutable_state_directory_names_the_attribute(sim: SimEnv) -> None:
    if shutil.which("chattr") is None:
        pytest.fail("chattr is missing (e2fsprogs)")
    sim.state_dir.mkdir(mode=0o700)
    made = subprocess.run(["chattr", "+i", str(sim.state_dir)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"this filesystem has no immutable attribute: {made.stderr.strip()}")
    try:
        result = sim.cli("acquire", "--shared", "container:x", "gpu0")
        assert result.returncode == 1
        one_or_two_sentences(result.stderr, str(sim.state_dir), "although this runs as root")
        assert "lsattr" in result.stderr and "chattr -i" in result.stderr
    finally:
        subprocess.run(["chattr", "-i", str(sim.state_dir)], check=True)


@pytest.fixture
def open_tree() -> Iterator[Path]:
    """A directory outside pytest's root-only tmp, which `nobody` can enter."""
    root = Path(tempfile.mkdtemp(prefix="charly-perm-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_missing_permission_says_who_runs_and_to_run_as_root(
    make_sim: Callable[..., SimEnv], open_tree: Path
) -> None:
    sim_dir = open_tree / "host"
    state = open_tree / "state"
    sim_dir.mkdir()
    (sim_dir / "host.toml").write_text(default_host())
    os.chown(sim_dir, NOBODY, NOBODY)  # the simulated machine is nobody's; the ledger is root's
    state.mkdir(mode=0o700)
    with Ledger(state).transaction() as txn:
        txn.state = txn.state  # a ledger, root's
    config = open_tree / "arbiter.toml"
    config.write_text(DEFAULT_CONFIG.format(sim=sim_dir, state=state))
    config.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}
    for argv in (["status"], ["acquire", "--shared", "container:x", "gpu0"]):
        result = subprocess.run(
            ["/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             sys.executable, "-m", "charly_arbiter", "--config", str(config), *argv],
            capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
        )  # fmt: skip
        assert result.returncode == 1, result.stderr
        one_or_two_sentences(result.stderr, str(state), "permission denied", "nobody", "as root")


def test_a_lock_held_by_a_process_of_another_user_names_the_user(sim: SimEnv) -> None:
    sim.config_path.write_text(
        sim.config_path.read_text().replace("lock_wait = 20", "lock_wait = 0.5")
    )
    Ledger(sim.state_dir).tidy()  # the state directory and its lock file, root's
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            f"os.setgid({NOBODY}); os.setuid({NOBODY})\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n",
            str(sim.state_dir / "ledger.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        result = sim.cli("acquire", "--shared", "container:x", "gpu0")
        assert result.returncode == 1
        one_or_two_sentences(
            result.stderr, f"held by process {holder.pid} of user nobody", "ask nobody"
        )
    finally:
        holder.kill()
        holder.wait()


# -- signals ------------------------------------------------------------------------------


@pytest.fixture
def hanging(make_sim: Callable[..., SimEnv]) -> SimEnv:
    """gpu0's switch hangs (like an unbind of nvidia under a user); the watchdog waits 60 s."""
    config = DEFAULT_CONFIG.replace("driver_switch = 2", "driver_switch = 60") + "\n"
    return make_sim(host=default_host(gpu0="hang_switch = true"), config=config)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_hung_switch_poisons_and_says_what_was_left(
    hanging: SimEnv, signum: int
) -> None:
    sim = hanging
    stderr = interrupted_claim(sim, "libvirt:win11", signum)
    name = signal.Signals(signum).name
    one_or_two_sentences(
        stderr,
        f"interrupted by {name} half-way",
        "container:llm, systemd:ollama.service stopped for it",
        "gpu0 poisoned",
        "`charly-arbiter restore libvirt:win11`",
        "`charly-arbiter poison clear gpu0`",
    )
    state = Ledger(sim.state_dir).read()
    poison = state.poison_of("gpu0")
    assert poison is not None and f"interrupted by {name}" in poison.reason
    lease = state.lease_of("libvirt:win11")
    assert lease is not None and lease.state is LeaseState.ACQUIRING
    # The command it names converges: what was stopped comes back, the lease goes.
    restored = sim.cli("restore", "libvirt:win11")
    assert restored.returncode == 0, restored.stderr
    after = sim.status()
    assert after["leases"] == [] and after["tokens"]["gpu0"]["poisoned"]
    running = sim.host().snapshot()["running"]
    assert running["container:llm"] and running["systemd:ollama.service"]


def _has_open(pid: int, path: str) -> bool:
    with contextlib.suppress(OSError):
        return any(os.readlink(fd) == path for fd in Path(f"/proc/{pid}/fd").iterdir())
    return False


def test_a_signal_before_the_claim_began_says_nothing_was_left(sim: SimEnv) -> None:
    """Ctrl-C while the claim waits for the ledger lock (another process holds it): no
    lease was written, and the sentence says so."""
    with ledger_locked(sim.state_dir):
        child = subprocess.Popen(
            [sys.executable, "-m", "charly_arbiter", "acquire", "--exclusive", "libvirt:w", "gpu0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=sim.env(),
            cwd=REPO,
            preexec_fn=as_at_a_terminal,
        )
        # Waited for: the child has the lock file open, polling it (lock_wait is 20 s).
        lock = str(sim.state_dir / "ledger.lock")
        deadline = time.monotonic() + 30
        while not _has_open(child.pid, lock):
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.02)
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 1 and stdout == ""
    one_or_two_sentences(stderr, "interrupted by SIGINT", "libvirt:w holds no lease now")
    assert Ledger(sim.state_dir).read().leases == ()
