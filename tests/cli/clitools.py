"""Helpers of the CLI tests: a real process that holds the ledger lock, and a claim
cut short by a real signal while its switch hangs (the simulated host's fault)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO, SimEnv


@contextlib.contextmanager
def ledger_locked(state_dir: Path) -> Iterator[int]:
    """Another process holds the ledger lock (through the real Ledger) until the block
    ends; yields its pid."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom pathlib import Path\n"
            "from charly_arbiter.core.ledger import Ledger\n"
            "with Ledger(Path(sys.argv[1])).transaction():\n"
            "    print('locked', flush=True)\n    time.sleep(120)\n",
            str(state_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def as_at_a_terminal() -> None:
    """A child that takes Ctrl-C as a command typed at a terminal does: the suite may run
    where SIGINT is ignored (a background job of a script), and the CLI, like any
    program under `nohup`, keeps an ignored signal ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted_claim(sim: SimEnv, claimant: str, signum: int) -> str:
    """`acquire --exclusive CLAIMANT gpu0` (whose switch hangs, driver_switch long),
    sent `signum` once it is in the write; its last two lines of stderr (before them,
    the progress lines of its steps: stderr is not a terminal)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "charly_arbiter", "acquire", "--exclusive", "--", claimant, "gpu0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=sim.env(),
        cwd=REPO,
        preexec_fn=as_at_a_terminal,
    )
    history = sim.state_dir / "history.jsonl"
    deadline = time.monotonic() + 60
    while '"switching"' not in (history.read_text() if history.exists() else ""):
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.05)
    time.sleep(0.3)  # into the write that hangs
    started = time.monotonic()
    child.send_signal(signum)
    stdout, stderr = child.communicate(timeout=60)
    assert time.monotonic() - started < 10, "the signal ended the command at once"
    assert child.returncode == 1, stderr
    assert stdout == "" and "Traceback" not in stderr
    return "\n".join(stderr.strip().splitlines()[-2:])


# What a mount namespace of the command's own (`unshare -m`, as root) does to the
# state directory ($1) before the command runs: the kernel then answers for real.
READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1"'
FULL = (
    'mount -t tmpfs -o size=64k,mode=0700 tmpfs "$1" && '
    '{ head -c 1M /dev/zero > "$1/filler" 2>/dev/null || true; }'
)


def namespaced(setup: str, state_dir: Path, argv: list[str]) -> list[str]:
    """`argv` run in a mount namespace of its own after `setup` (sh; $1 = state_dir)."""
    return [
        "/usr/bin/unshare",
        "-m",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        f'{setup} && shift && exec "$@"',
        "-",
        str(state_dir),
        *argv,
    ]
