"""Helpers of the operator-experience tests: golden files, the journal's wire
format read back independently, and a real pseudo-terminal to run the CLI in."""

from __future__ import annotations

import os
import re
import select
import struct
import subprocess
import sys
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden"
REGENERATE = os.environ.get("CHARLY_REGENERATE_GOLDEN") == "1"
REPO = Path(__file__).resolve().parents[2]

_TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?")
_AGO = re.compile(r"\(\d+ (?:s|min|h \d+ min|d \d+ h) ago\)")
_PID = re.compile(r"(process|pid) \d+")


def normalise(text: str, root: Path | None = None) -> str:
    """Hide what changes between runs: times, ages, pids and the temp directory."""
    if root is not None:
        text = text.replace(str(root), "<ROOT>")
    text = _AGO.sub("(<AGE> ago)", text)
    text = _TIME.sub("<TIME>", text)
    return _PID.sub(r"\1 <PID>", text)


def assert_golden(name: str, text: str) -> None:
    """Compare with tests/ops/golden/NAME; CHARLY_REGENERATE_GOLDEN=1 rewrites it
    (review the diff with `git diff tests/ops/golden` before committing)."""
    path = GOLDEN / name
    if REGENERATE:
        path.write_text(text)
        return
    assert path.exists(), f"no golden file {path}; run with CHARLY_REGENERATE_GOLDEN=1"
    expected = path.read_text()
    assert text == expected, (
        f"{name} differs from its golden file (CHARLY_REGENERATE_GOLDEN=1 to accept):\n"
        f"--- expected\n{expected}\n--- got\n{text}"
    )


def decode_journal(data: bytes) -> list[tuple[str, str]]:
    """The journal's native protocol, parsed the way journald does (see systemd's
    `journal-send.c` docs): KEY=VALUE\\n, or KEY\\n + le64 length + bytes + \\n."""
    fields = []
    at = 0
    while at < len(data):
        end = data.index(b"\n", at)
        line = data[at:end]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            at = end + 1
        else:
            key = line
            (length,) = struct.unpack("<Q", data[end + 1 : end + 9])
            value = data[end + 9 : end + 9 + length]
            assert data[end + 9 + length : end + 10 + length] == b"\n"
            at = end + 10 + length
        fields.append((key.decode(), value.decode()))
    return fields


def run_in_pty(args: list[str], env: dict[str, str], timeout: float = 30) -> str:
    """Run the real CLI with stdout and stderr on a real pseudo-terminal."""
    controller, terminal = os.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "charly_arbiter", *args],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env=env,
        cwd=REPO,
        close_fds=True,
    )
    os.close(terminal)
    output = b""
    try:
        while True:
            ready, _, _ = select.select([controller], [], [], timeout)
            if not ready:
                raise AssertionError(f"no output from {args} within {timeout} s")
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's other side closed
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(controller)
        process.wait(timeout)
    return output.decode()
