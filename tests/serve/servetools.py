"""Helpers of the resident helper's tests: a real `charly-arbiter serve`, started by hand
(CI has no systemd as PID 1; the socket unit itself is for a systemd guest), its log
and its processes.  Everything here is real: processes, sockets, signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.serve.client import ENV_DEADLINE, ENV_SERVE, ENV_SOCKET
from tests.conftest import REPO, SimEnv

# Served commands may take this long to be taken on a loaded CI machine (a row that
# must be served is never measured against the default deadline).
PATIENT = "10000"


@dataclass
class Served:
    """A running server: its process (a session of its own), socket and log."""

    process: subprocess.Popen[bytes]
    socket: Path
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def env(self, sim: SimEnv, mode: str = "must", **extra: str) -> dict[str, str]:
        """The simulated host's environment, pointed at this server."""
        return sim.env(
            **{ENV_SOCKET: str(self.socket), ENV_SERVE: mode, ENV_DEADLINE: PATIENT, **extra}
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ran(self) -> list[str]:
        """The log's line for every command a child ran."""
        return [line for line in self.log().splitlines() if ": ran " in line]

    def spares(self) -> list[int]:
        """Its children still waiting for a request (in its session; a child that took
        one has a session of its own)."""
        return [pid for pid, ppid, sid in processes() if ppid == self.pid and sid == self.pid]

    def wait_for_spares(self, count: int = 2, timeout: float = 30) -> list[int]:
        deadline = time.monotonic() + timeout
        while len(found := self.spares()) < count:
            assert self.process.poll() is None, self.log()
            assert time.monotonic() < deadline, f"no spares: {self.log()}"
            time.sleep(0.02)
        return found

    def wait_in_log(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert time.monotonic() < deadline, f"{text!r} not in the log:\n{self.log()}"
            time.sleep(0.02)

    def stop(self) -> int:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGCONT)
            self.process.terminate()
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            status = Path(f"/proc/{self.pid}/status").read_text()
            tasks = os.listdir(f"/proc/{self.pid}/task")
            wchan = (
                " ".join(
                    f"{t}:{Path(f'/proc/{self.pid}/task/{t}/wchan').read_text()}" for t in tasks
                )
                + " children: "
                + str([p for p, pp, _ in processes() if pp == self.pid])
            )
            self.process.terminate()
            try:
                again = self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                again = None
            self.process.kill()
            self.process.wait()
            raise AssertionError(
                f"again: {again}; SIGTERM did not stop it ({wchan}):\n{status}\n{self.log()}"
            )


def processes() -> Iterator[tuple[int, int, int]]:
    """(pid, ppid, session) of every process, from /proc/PID/stat."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text.rpartition(")")[2].split()
        yield int(entry), int(fields[1]), int(fields[3])


@contextlib.contextmanager
def serving(
    root: Path, *args: str, env: dict[str, str] | None = None, python: str = sys.executable
) -> Iterator[Served]:
    """`charly-arbiter serve -v --socket ROOT/serve.sock ARGS`, until the block ends,
    ready (its spares forked) when the block begins."""
    socket = root / "run" / "serve.sock"
    log_path = root / "serve.log"
    environment = env if env is not None else _clean_environment()
    root.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [python, "-m", "charly_arbiter", "serve", "-v", "--socket", str(socket), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=environment,
            cwd=REPO,
            start_new_session=True,
        )
    served = Served(process, socket, log_path)
    try:
        served.wait_in_log("listening on")
        served.wait_for_spares()
        yield served
    finally:
        served.stop()


def _clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}


def cli(argv: list[str], env: dict[str, str], stdin: str = "", timeout: float = 120) -> Ran:
    """`charly-arbiter ARGV` as its own process (the program's path: `python -m`),
    timed."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "charly_arbiter", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )
    return Ran(result.returncode, result.stdout, result.stderr, time.monotonic() - started)


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str
    stderr: str
    seconds: float


def history_events(sim: SimEnv, event: str) -> list[dict[str, object]]:
    import json

    path = sim.state_dir / "history.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == event]
