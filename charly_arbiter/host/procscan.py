"""Which processes hold a device node open, from `/proc/*/fd` (root configurable).

`lsof` and `fuser` are not always installed and parse poorly; reading the fd
links is what they do anyway.  A process that exits or denies access while it
is being read is skipped: the scan is a snapshot, repeated before every claim.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.core.model import ProcessRef


@dataclass(frozen=True)
class OpenNode:
    pid: int
    comm: str
    node: str


def scan(proc_root: Path, nodes: Collection[str], exclude: Collection[int] = ()) -> list[OpenNode]:
    """Every (pid, command name, node) where a process has one of `nodes` open."""
    wanted = set(nodes)
    if not wanted:
        return []
    found: list[OpenNode] = []
    for pid in _pids(proc_root):
        if pid in exclude:
            continue
        fd_dir = proc_root / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        held: set[str] = set()
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target in wanted:
                held.add(target)
        for node in sorted(held):
            found.append(OpenNode(pid, command_name(proc_root, pid), node))
    return found


def command_lines(proc_root: Path, wanted: Callable[[list[bytes]], bool]) -> list[int]:
    """The pids whose command line (its arguments, as bytes) `wanted` accepts."""
    found = []
    for entry in _pids(proc_root):
        try:
            arguments = (proc_root / str(entry) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted(arguments):
            found.append(entry)
    return found


def _pids(proc_root: Path) -> list[int]:
    try:
        return sorted(int(entry) for entry in os.listdir(proc_root) if entry.isdigit())
    except OSError:
        return []


def command_name(proc_root: Path, pid: int) -> str:
    try:
        return (proc_root / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def program_name(proc_root: Path, pid: int) -> str:
    """The executable's name, untruncated (`comm` stops at 15 characters)."""
    try:
        return os.path.basename(os.readlink(proc_root / str(pid) / "exe"))
    except OSError:
        pass
    try:
        argv0 = (proc_root / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return command_name(proc_root, pid)
    return os.path.basename(argv0.decode(errors="replace")) or command_name(proc_root, pid)


def alive(proc_root: Path, pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a zombie holds nothing)."""
    fields = _stat_fields(proc_root, pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def process_ref(proc_root: Path, pid: int) -> ProcessRef | None:
    """`pid` with its start time, or None when no such process runs."""
    fields = _stat_fields(proc_root, pid)
    if len(fields) <= _STARTTIME or fields[0] in ("Z", "X") or not fields[_STARTTIME].isdigit():
        return None
    return ProcessRef(pid, int(fields[_STARTTIME]))


def process_alive(proc_root: Path, ref: ProcessRef) -> bool:
    """Whether the very process `ref` names still runs: not a zombie, and not a
    later process that reuses its pid (its start time differs)."""
    if ref.pid <= 0:
        return False
    found = process_ref(proc_root, ref.pid)
    return found is not None and (ref.start == 0 or found.start == ref.start)


# /proc/PID/stat: "PID (COMM) STATE PPID ...": the fields after the command name,
# which may itself contain spaces and parentheses; starttime is field 22 of the
# whole line, the 20th after the command.
_STARTTIME = 19


def _stat_fields(proc_root: Path, pid: int) -> list[str]:
    try:
        text = (proc_root / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return []
    return text.rpartition(")")[2].split()
