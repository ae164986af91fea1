"""Which processes hold a device node open, from `/proc/*/fd` (root configurable).

`lsof` and `fuser` are not always installed and parse poorly; reading the fd
links is what they do anyway.  A process that exits or denies access while it
is being read is skipped: the scan is a snapshot, repeated before every claim.

A link names the node as the process sees it: inside a container that is the
container's own `/dev/…`, not the host's path.  So a node is also recognised
by its device number (what `stat` of the fd says), for every fd whose link
lies under `/dev/`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from charly_arbiter.core.model import ProcessRef

DeviceNumber = tuple[int, int]  # (major, minor) of a character device


@dataclass(frozen=True)
class OpenNode:
    pid: int
    comm: str
    node: str


def scan(
    proc_root: Path,
    nodes: Collection[str],
    exclude: Collection[int] = (),
    numbers: Mapping[DeviceNumber, str] | None = None,
) -> list[OpenNode]:
    """Every (pid, command name, node) where a process has one of `nodes` open, or a
    character device whose number `numbers` maps to one of them (by any path)."""
    wanted = set(nodes)
    by_number = dict(numbers or {})
    if not wanted and not by_number:
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
            elif by_number and target.startswith("/dev/"):
                node = _node_by_number(fd_dir / fd, by_number)
                if node is not None:
                    held.add(node)
        for node in sorted(held):
            found.append(OpenNode(pid, command_name(proc_root, pid), node))
    return found


def _node_by_number(fd: Path, numbers: Mapping[DeviceNumber, str]) -> str | None:
    try:
        info = os.stat(fd)
    except OSError:
        return None
    if not stat.S_ISCHR(info.st_mode):
        return None
    return numbers.get((os.major(info.st_rdev), os.minor(info.st_rdev)))


def char_device_number(path: Path) -> DeviceNumber | None:
    """The (major, minor) of a character device node, or None for anything else."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISCHR(info.st_mode):
        return None
    return os.major(info.st_rdev), os.minor(info.st_rdev)


def cgroup_paths(proc_root: Path, pid: int) -> tuple[str, ...]:
    """The cgroup paths `pid` is in (every hierarchy's, v1 and v2), or () when gone."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return ()
    return tuple(
        dict.fromkeys(line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2)
    )


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
