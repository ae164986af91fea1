"""The state directory's files, opened the one safe way.

Every file the arbiter keeps (the ledger, its backup and lock, the history and
its lock) is opened through `open_checked`: never through a symlink, never a
directory, FIFO or device, never a file hard-linked elsewhere (a lock file
linked to /etc/shadow would be truncated), never one that someone other than
root could have written.  Each refusal is a `StateDirUnsafe` that names the
file and what is wrong with it, so an odd state directory is reported in one
sentence and nothing is touched.  Locks are flocks taken within a deadline.

What the host refuses (a read-only or full filesystem, a missing permission) is
a `StateDirError` with the path and the fix (`describe_os_error`), never a bare
OSError: the operator meets it as one or two sentences.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from charly_arbiter.errors import StateDirError, StateDirUnsafe

_POLL = 0.02
_ODD = {
    errno.ELOOP: "it is a symlink",
    errno.EISDIR: "it is a directory",
    errno.ENXIO: "it is not a regular file",
    errno.ENOTDIR: "a part of its path is not a directory",
}


def check_directory(directory: Path, *, create: bool) -> None:
    """The state directory: a real directory, owned by root, writable by nobody else."""
    with host_refusals(directory, "use"):
        if create and not directory.exists() and not directory.is_symlink():
            # exist_ok: processes started at once race to make it (the first command's
            # claims on a fresh host); what is there is checked below all the same.
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            info = os.lstat(directory)
        except FileNotFoundError:
            return
    if stat.S_ISLNK(info.st_mode):
        raise StateDirUnsafe(directory, "it is a symlink")
    if not stat.S_ISDIR(info.st_mode):
        raise StateDirUnsafe(directory, "it is not a directory")
    check_owner_and_mode(directory, info)


def check_existing(path: Path, *, single_link: bool = False) -> os.stat_result | None:
    """A state file that may or may not exist: if it does, it must be a safe one
    (its lstat is returned; None when there is none)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    _check_file_info(path, info, single_link)
    return info


def open_checked(path: Path, flags: int, mode: int = 0o600, *, single_link: bool = True) -> int:
    """Open a state file (`os.open` flags) and return the descriptor, or refuse it.

    O_NOFOLLOW and O_NONBLOCK keep a symlink or a FIFO planted in the state
    directory from being followed or blocking us; the checks are made on the
    open descriptor, so the file cannot be swapped between check and use.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as error:
        why = _ODD.get(error.errno or 0)
        if why is None:
            raise state_dir_error(path, error, "open") from error
        raise StateDirUnsafe(path, why) from None
    try:
        _check_file_info(path, os.fstat(fd), single_link)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_within(handle: IO[str] | int, timeout: float) -> bool:
    """Take an exclusive flock on an open lock file, polling until `timeout`;
    False when it stayed busy.

    flock(2) is the one lock primitive of the arbiter (the ledger, the history,
    the simulated host): released by the kernel when its holder dies, never
    stale, and taken here without a library (portalocker's import costs more
    than starting the interpreter, on every claim).
    """
    deadline = time.monotonic() + timeout
    fd = handle if isinstance(handle, int) else handle.fileno()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL)


def remove_stray(path: Path) -> bool:
    """Remove a temporary file an interrupted write left behind; True if there was one."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(info.st_mode):
        raise StateDirUnsafe(path, "it is a directory where the arbiter writes a temporary file")
    path.unlink()
    return True


def replace_file(
    path: Path,
    data: bytes,
    *,
    temp: Path,
    mode: int = 0o600,
    durable: bool = True,
    before_replace: Callable[[], None] | None = None,
    step: Callable[[str], None] | None = None,
) -> None:
    """Replace `path` with `data` in one step: a new `temp` (O_EXCL, never followed),
    written whole, fsynced, renamed over `path`, and the directory fsynced.

    A crash leaves the old file or the new one, never a mix.  An fsync error is
    final for this write (after one, Linux may have dropped the dirty pages:
    retrying could "succeed" with nothing on disk), so nothing is retried and
    the old file stays.  `before_replace` runs just before the rename (the
    ledger links its backup there); `step` is told each step's name, for crash
    tests.  `durable=False` skips the fsyncs, for a simulation's own state.
    """
    mark = step or (lambda name: None)
    mark("open_temp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        half = len(data) // 2
        write_all(fd, data[:half])
        mark("write_half")
        write_all(fd, data[half:])
        mark("write_all")
        os.fchmod(fd, mode)
        if durable:
            os.fsync(fd)
        mark("fsync_temp")
    except BaseException:
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        if before_replace is not None:
            before_replace()
        mark("backup")
        os.replace(temp, path)
        mark("rename")
        if durable:
            fsync_dir(path.parent)
        mark("fsync_dir")
    except OSError:
        temp.unlink(missing_ok=True)
        raise


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno != errno.EINVAL:  # some filesystems cannot fsync a directory
            raise
    finally:
        os.close(fd)


# -- what the host refused, in sentences ------------------------------------------------


@contextlib.contextmanager
def host_refusals(path: Path, action: str) -> Iterator[None]:
    """Turn an OSError of the state directory's own steps into a `StateDirError`
    naming the file it concerns (the error's own, else `path`) and the fix."""
    try:
        yield
    except OSError as error:
        raise state_dir_error(Path(error.filename or path), error, action) from error


def state_dir_error(path: Path, error: OSError, action: str) -> StateDirError:
    why, fix = describe_os_error(path, error)
    return StateDirError(path, action, why, fix)


def describe_os_error(path: Path, error: OSError) -> tuple[str, str]:
    """Why the host refused something on `path`, and what an operator does about it."""
    code = error.errno or 0
    if code == errno.EROFS:
        mount = mount_point(path)
        return (
            f"it is on a read-only filesystem ({mount})",
            f"remount {mount} read-write (mount -o remount,rw {mount}), or set state_dir "
            "(--state-dir) to a directory on a writable filesystem",
        )
    if code in (errno.ENOSPC, errno.EDQUOT):
        mount = mount_point(path)
        full = "full" if code == errno.ENOSPC else "over its quota"
        return (
            f"its filesystem ({mount}) is {full}",
            f"free space on {mount} (df -h {mount} shows it), then run the command again",
        )
    if code in (errno.EACCES, errno.EPERM):
        if os.geteuid() != 0:
            owner = _owner_of(path)
            return (
                f"permission denied (this runs as {_user(os.geteuid())}"
                + (f", and {owner[0]} belongs to {owner[1]})" if owner else ")"),
                "run it as root (sudo charly-arbiter …): the state directory is root's",
            )
        return (
            "permission denied, although this runs as root",
            f"look for an immutable or append-only attribute (lsattr -d {path}, then "
            "chattr -i) or a security module's rule (AppArmor, SELinux) on it",
        )
    if code in (errno.ENOENT, errno.ENOTDIR):
        return (
            "a directory on its path is missing",
            f"create {path.parent} or set state_dir (--state-dir) to one that exists",
        )
    return (error.strerror or str(error), f"check {path} and its filesystem")


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem `path` is on: the longest mount point of this
    process's mount table that contains it (a bind mount too, which `ismount` misses)."""
    resolved = os.path.realpath(path)
    best = "/"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
            for line in table:
                fields = line.split()
                if len(fields) < 5:
                    continue
                point = _unescape(fields[4])
                inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
                if inside and len(point) > len(best):
                    best = point
    except OSError:
        pass
    return Path(best)


def _unescape(field: str) -> str:
    """mountinfo writes a space, a tab, a newline and a backslash as octal escapes."""
    for escape, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escape, char)
    return field


def _owner_of(path: Path) -> tuple[Path, str] | None:
    """The nearest existing ancestor of `path` (or itself) and the user who owns it."""
    current = path
    while current != current.parent:
        try:
            return current, _user(os.lstat(current).st_uid)
        except OSError:
            current = current.parent
    return None


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_owner_and_mode(path: Path, info: os.stat_result) -> None:
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateDirUnsafe(path, f"it is group- or world-writable (mode {info.st_mode:o})")
    if os.geteuid() == 0 and info.st_uid != 0:
        raise StateDirUnsafe(path, f"it is owned by uid {info.st_uid}, not root")


def _check_file_info(path: Path, info: os.stat_result, single_link: bool) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise StateDirUnsafe(path, "it is a symlink")
    if stat.S_ISDIR(info.st_mode):
        raise StateDirUnsafe(path, "it is a directory")
    if not stat.S_ISREG(info.st_mode):
        raise StateDirUnsafe(path, "it is not a regular file")
    if single_link and info.st_nlink > 1:
        raise StateDirUnsafe(path, f"it has {info.st_nlink} hard links (another file shares it)")
    check_owner_and_mode(path, info)
