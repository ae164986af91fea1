"""`charly-arbiter serve`: the resident helper's server (hidden from --help).

Started by systemd for charly-arbiter.socket (the listening socket comes as
LISTEN_FDS) or by hand (it listens on --socket itself, 0600 in a root-owned
directory).  It imports every module of the package, and with them click and
the standard library, and then only keeps two children forked ahead,
waiting in accept: the one that takes a connection checks the peer's uid
(SO_PEERCRED), tells the server (which forks the next), and does everything else
for that request (child.py).  So no request waits for a fork, a slow, stopped
or hostile client never holds the server up, and a child that crashes or is
killed is that one client's failure only.  A spare that has taken nothing dies
with the server (PR_SET_PDEATHSIG); one that has taken a request lives on.

It reads no configuration and builds nothing at start but imported code: every
command reads its configuration, host and ledger afresh in its own child.  A
spare, while it waits, decodes the ledger that a command without options reads
(the program's `ahead`): the command still reads the file, and skips only the
decoding of the very same bytes (core/ledger.py, `read_ahead`).  When
the files its code was loaded from change (an upgrade), it starts itself anew
(exec, keeping the socket) within a second.  SIGTERM,
SIGINT or SIGHUP stop it (exit 0); the commands it started finish on their own,
each in a session of its own (the unit has KillMode=process).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import pkgutil
import select
import signal
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn

from charly_arbiter.serve import child, prefault
from charly_arbiter.serve.client import ENV_SOCKET, SOCKET

Run = Callable[[list[str]], object]
Ahead = Callable[[], str]  # what it did, for the log

PROGRAM = "charly-arbiter serve"
# sd_listen_fds(3): the first socket systemd passes.
LISTEN_FD = 3
LISTEN_VARIABLES = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
# Set by a server that execs itself anew: the socket path it bound (and removes at exit).
ENV_OWNED = "CHARLY_ARBITER_SERVE_SOCKET_OWNED"
BACKLOG = 128
# Children waiting in accept, forked ahead of the requests they take: a burst of
# that many is taken at once, and no request waits for a fork.
SPARES = 2
# How often an idle server looks whether the files of its code changed.
TICK = 1.0
# A spare that took a request is replaced this long after, while another still
# waits: a fork (and the stat of every source file) competes for the CPU with the
# request just taken, on a small machine.  With none left, at once.
REFILL_AFTER = 0.25
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Imported at start beside the package's own modules: what the commands import
# inside functions, on the paths people wait for.
ALSO_IMPORTED = ("json", "shlex", "tomllib", "tomlkit", "uuid", "ctypes", "logging.handlers")


class ServeError(Exception):
    """The server cannot start (exit 1): the message says why, the hint what to do."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


class Stopping:
    """SIGTERM, SIGINT and SIGHUP, noted and made readable on a pipe the loop waits
    on.  The handler never raises: an exception raised in a handler that runs inside
    an at-fork callback or a finalizer would be swallowed, and the signal lost."""

    def __init__(self) -> None:
        self.wakeup, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.signal: int | None = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._note)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum
        with contextlib.suppress(OSError):
            os.write(self._write, b"!")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wakeup, 64):
                pass

    def close(self) -> None:
        """In a spare: the server's signals and pipe are not its own."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        os.close(self.wakeup)
        os.close(self._write)


def main(argv: list[str], run: Run, ahead: Ahead | None = None) -> int:
    """`charly-arbiter serve [--socket PATH] [--idle-exit SECONDS] [-v]`; `run` is the
    program's main, which each child runs for its request; `ahead`, what a spare does
    for the next request while it waits (the CLI's: decode the ledger ahead)."""
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="The resident helper: run each command in a fork of this process.",
    )
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help=f"listen here when systemd passes no socket (default ${ENV_SOCKET} or {SOCKET})",
    )
    parser.add_argument(
        "--idle-exit",
        metavar="SECONDS",
        type=float,
        help="exit after this long without a request (socket activation starts it again)",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="a line per request on stderr"
    )
    options = parser.parse_args(argv)  # 2 on a usage error
    path = options.socket or os.environ.get(ENV_SOCKET) or SOCKET
    log = _log(options.verbose > 0)
    try:
        preloaded = preload()
        listener, owned = listening(path)
    except ServeError as error:
        print(f"charly-arbiter: {error}\nhint: {error.hint}", file=sys.stderr)
        return 1
    log(f"listening on {listener.getsockname() or path} ({preloaded} modules imported)")
    try:
        _loop(listener, run, ahead, options.verbose > 0, options.idle_exit, log, owned)
    finally:
        listener.close()
        if owned:
            with contextlib.suppress(OSError):
                os.unlink(owned)
    return 0


def _log(verbose: bool) -> Callable[[str], None]:
    def log(text: str) -> None:
        if verbose:
            print(f"{PROGRAM}[{os.getpid()}]: {text}", file=sys.stderr, flush=True)

    return log


# -- the socket ------------------------------------------------------------------------------


def listening(path: str) -> tuple[socket.socket, str | None]:
    """systemd's socket (LISTEN_FDS), or one bound at `path`; with the path to remove at
    exit (None for systemd's, which systemd removes)."""
    inherited = _inherited()
    if inherited is not None:
        return inherited, os.environ.pop(ENV_OWNED, None)
    return _bind(path), path


def _inherited() -> socket.socket | None:
    count, pid = os.environ.get("LISTEN_FDS"), os.environ.get("LISTEN_PID")
    for name in LISTEN_VARIABLES:
        os.environ.pop(name, None)  # not for the commands (they get their client's anyway)
    if not count or pid != str(os.getpid()):
        return None
    if count != "1":
        raise ServeError(
            f"systemd passed {count} sockets; the helper listens on one",
            "charly-arbiter.socket must have a single ListenStream=",
        )
    listener = socket.socket(fileno=LISTEN_FD)
    if listener.family != socket.AF_UNIX or listener.type != socket.SOCK_STREAM:
        raise ServeError(
            "systemd passed a socket that is not a Unix stream socket",
            "charly-arbiter.socket must have ListenStream=/run/charly-arbiter/serve.sock",
        )
    os.set_inheritable(LISTEN_FD, False)
    listener.setblocking(False)
    return listener


def _bind(path: str) -> socket.socket:
    """Listen at `path`, 0600, in a directory only this uid can change; a stale socket
    file (its server is gone) is replaced, a live one is not."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        found = os.lstat(directory)
        if not stat.S_ISDIR(found.st_mode):
            raise NotADirectoryError(f"{directory} is not a directory")
        if found.st_uid != os.geteuid() or found.st_mode & 0o022:
            raise ServeError(
                f"cannot listen in {directory}: it is not owned by this uid, or others may "
                "write to it (they could replace the socket)",
                f"use a directory of this uid's, mode 0755 or stricter (--socket, ${ENV_SOCKET})",
            )
        _clear(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mask = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(mask)
        os.chmod(path, 0o600)
        listener.listen(BACKLOG)
        listener.setblocking(False)
    except OSError as error:
        raise ServeError(
            f"cannot listen on {path}: {error.strerror or error}",
            f"choose another path (--socket, ${ENV_SOCKET})",
        ) from None
    return listener


def _clear(path: str) -> None:
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(found.st_mode):
        raise ServeError(
            f"cannot listen on {path}: something that is not a socket is there",
            "move it away, or choose another path (--socket)",
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # its server is gone
        return
    except OSError:
        pass
    finally:
        probe.close()
    raise ServeError(
        f"another server listens on {path}",
        "stop it first (`systemctl stop charly-arbiter.service charly-arbiter.socket`)",
    )


# -- the code it runs ------------------------------------------------------------------------


def preload() -> int:
    """Import every module of the package (not __main__, which runs the program), and
    ALSO_IMPORTED; those whose optional library is missing are left to the commands."""
    import charly_arbiter

    for info in pkgutil.walk_packages(charly_arbiter.__path__, "charly_arbiter."):
        if info.name.rpartition(".")[2] != "__main__":
            with contextlib.suppress(ImportError):
                importlib.import_module(info.name)
    for name in ALSO_IMPORTED:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    return len(sys.modules)


class Code:
    """The files the server's code came from, as they were at start: a package upgrade
    replaces them (dpkg, rpm and pip write each file anew)."""

    def __init__(self) -> None:
        self.files = {path: _stamp(path) for path in _sources()}

    def changed(self) -> bool:
        return any(_stamp(path) != stamp for path, stamp in self.files.items())


def _sources() -> Iterator[str]:
    """The package's modules and data, every top-level module, and the interpreter."""
    yield sys.executable
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and ("." not in name or name.startswith("charly_arbiter.")):
            yield path
    import charly_arbiter

    data = os.path.join(os.path.dirname(charly_arbiter.__file__ or ""), "data")
    with contextlib.suppress(OSError):
        yield from (os.path.join(data, name) for name in os.listdir(data))


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_mtime_ns, found.st_size


def _again(listener: socket.socket, owned: str | None) -> NoReturn:
    """exec this program anew, with the socket (as systemd passes it)."""
    fd = listener.fileno()
    if fd != LISTEN_FD:
        os.dup2(fd, LISTEN_FD)
    os.set_inheritable(LISTEN_FD, True)
    environment = {**os.environ, "LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid())}
    if owned:
        environment[ENV_OWNED] = owned
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environment)  # noqa: S606  (no shell: argv)


# -- the loop --------------------------------------------------------------------------------


def _loop(
    listener: socket.socket,
    run: Run,
    ahead: Ahead | None,
    verbose: bool,
    idle_exit: float | None,
    log: Callable[[str], None],
    owned: str | None,
) -> None:
    """Keep SPARES children waiting in accept; fork another when one takes a
    connection (REFILL_AFTER later, unless none is left) or dies; every TICK, look
    whether the code on disk changed."""
    code = Code()
    stopping = Stopping()
    child.server_world()  # read once, here: every child compares its client with it
    listener.setblocking(True)  # the spares block in accept (the kernel wakes one)
    # Children share the imported code's pages: no collection may touch them (gc.freeze).
    gc.collect()
    gc.freeze()
    spares: dict[int, int] = {}  # the read end of a spare's pipe -> its pid
    last = checked = time.monotonic()
    refill_at = last  # when the spares are made up again
    try:
        while True:
            now = time.monotonic()
            while len(spares) < SPARES and stopping.signal is None:
                if spares and now < refill_at:
                    break
                forked = _spare(listener, stopping, run, ahead, verbose, log)
                if forked is None:
                    break  # out of processes: the clients run in-process meanwhile
                spares[forked[0]] = forked[1]
            wait = TICK if len(spares) == SPARES else max(0.0, min(TICK, refill_at - now))
            readable = select.select([stopping.wakeup, *spares], [], [], wait)[0]
            if stopping.signal is not None:
                log(f"stopped by {signal.Signals(stopping.signal).name}")
                return
            if stopping.wakeup in readable:
                stopping.drain()  # a spare's, before it let the server's signals go
                readable.remove(stopping.wakeup)
            for fd in readable:
                took = os.read(fd, 1)
                os.close(fd)
                pid = spares.pop(fd)
                if took:
                    last = time.monotonic()
                    refill_at = last + REFILL_AFTER
                else:
                    log(f"spare {pid} ended before it took a request")
            if time.monotonic() - checked >= TICK:
                checked = time.monotonic()
                if code.changed():
                    log("the code on disk changed: starting anew")
                    _end(spares)
                    _again(listener, owned)
            if idle_exit is not None and time.monotonic() - last > idle_exit:
                log(f"no request for {idle_exit:g} s: exiting")
                return
    finally:
        _end(spares)


def _end(spares: dict[int, int]) -> None:
    """The spares are idle in accept (one that took a connection has left the dict)."""
    for fd, pid in spares.items():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        os.close(fd)
    spares.clear()


def _spare(
    listener: socket.socket,
    stopping: Stopping,
    run: Run,
    ahead: Ahead | None,
    verbose: bool,
    log: Callable[[str], None],
) -> tuple[int, int] | None:
    """Fork a child that waits for the next connection; (its pipe, its pid)."""
    took, tell = os.pipe()
    server = os.getpid()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as error:
        log(f"fork: {error}")
        os.close(took)
        os.close(tell)
        time.sleep(TICK)
        return None
    if pid == 0:
        try:
            os.close(took)
            stopping.close()
            _take(listener, tell, server, run, ahead, verbose, log)
        finally:
            os._exit(1)
    os.close(tell)
    return took, pid


def _take(
    listener: socket.socket,
    tell: int,
    server: int,
    run: Run,
    ahead: Ahead | None,
    verbose: bool,
    log: Callable[[str], None],
) -> NoReturn:
    """A spare's life: dies with the server while it waits (PR_SET_PDEATHSIG), makes
    the server's memory its own (prefault.py) and does `ahead` at idle priority,
    unless a connection waits already; takes one connection, tells the server, and
    becomes that request's process."""
    _die_with_parent(signal.SIGKILL)
    if os.getppid() != server:
        os._exit(0)  # the server died while this was being forked
    with prefault.idle_priority():
        with contextlib.suppress(OSError):
            prefault.prefault(listener)  # the copies a fork owes, before a request waits
        if ahead is not None and not prefault.waiting(listener):
            with contextlib.suppress(Exception):  # the command meets it again, and says it
                log(f"spare {os.getpid()}: {ahead()}")
    while True:
        try:
            conn, _ = listener.accept()
            break
        except (InterruptedError, ConnectionAbortedError):
            continue
    _die_with_parent(0)  # from here on, the request outlives the server
    os.write(tell, b"t")
    os.close(tell)
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.geteuid():
        log(f"refused pid {pid}: uid {uid} is not this server's {os.geteuid()}")
        os._exit(0)
    child.serve(conn, listener, pid, run, verbose)


def _die_with_parent(signum: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
