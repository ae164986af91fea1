"""Where a request through the resident helper spends its time, step by step.

Run by bench_costs.py with the interpreter it measures, against the server it
started (CHARLY_ARBITER_SOCKET, the simulated host's CHARLY_ARBITER_CONFIG in the
environment).  It does what serve/client.py does, with a clock between the
steps: connect; send the request; wait for `ready` (a spare child, forked
ahead, accepts, checks the client and takes its attributes); `go` with the
descriptors, to the exit status (the child takes them, runs the command, exits).
The command's output goes to /dev/null.  Prints `STEP MEDIAN_MS` lines.  Not a timed test.

Run: python bench/serve_phases.py [RUNS]
"""

from __future__ import annotations

import _socket
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from charly_arbiter.serve import client


def one(argv: list[str], samples: dict[str, list[float]], label: str) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        started = time.perf_counter()
        sock.connect(os.environ[client.ENV_SOCKET])
        connected = time.perf_counter()
        sock.sendall(client.request(argv, None))
        requested = time.perf_counter()
        connection = client.Connection(sock, time.monotonic() + 10)
        if not connection.line().startswith(b"ready "):
            raise SystemExit("the server did not take the request")
        ready = time.perf_counter()
        fds = b"".join(fd.to_bytes(4, sys.byteorder) for fd in (0, null, null, cwd))
        sock.sendmsg([b"go\n"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        connection.deadline = None
        status = connection.line()
        done = time.perf_counter()
    finally:
        sock.close()
        os.close(null)
        os.close(cwd)
    if status != b"exit 0":
        raise SystemExit(f"{argv}: {status!r}")
    if label == "--version":
        samples["connect"].append(connected - started)
        samples["send the request"].append(requested - connected)
        samples["until `ready`: a spare's accept, its checks, the client's attributes"].append(
            ready - requested
        )
    samples[f"`go` until the exit status: `{label}` and the child's exit"].append(done - ready)


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    samples: dict[str, list[float]] = {
        "connect": [],
        "send the request": [],
        "until `ready`: a spare's accept, its checks, the client's attributes": [],
    }
    for label, argv in (("--version", ["--version"]), ("status --json", ["status", "--json"])):
        samples[f"`go` until the exit status: `{label}` and the child's exit"] = []
        for _ in range(runs):
            one(argv, samples, label)
    for name, values in samples.items():
        print(f"{name} {statistics.median(values) * 1000:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
