"""One request's process: forked from the server, it becomes the client's command.

It reads the request (client.request), checks that the client may have it run
here, and takes the client's place: its arguments and environment, its umask,
groups, resource limits, priority, CPU affinity and OOM score, which signals it
ignores and blocks.  Only then does it say `ready`; the client's `go` brings its
stdin, stdout, stderr and working directory, and only then does the command run
(a client that has given up never says `go`: it has run the command in-process).
The command is the program's very `main(argv)`, in this fresh process:
configuration, host and ledger are read by the command, as in-process; nothing of
the server's is used but the imported code.

It never runs what the client could not have run itself: the client must be the
server's uid, in the server's namespaces and root directory, with no fewer
capabilities, no `no_new_privs`, no seccomp filter and the same security label
as the server; anything else runs in-process.  Nothing is written to the
client's descriptors before `go` (a refusal is the server's log's, never the
client's stderr).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import locale
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from charly_arbiter.serve import client
from charly_arbiter.serve.client import DESCRIPTORS, LENGTH_BYTES, MAGIC

Run = Callable[[list[str]], object]  # the program's main (it exits, by SystemExit)

# The process this is about: /proc is the one root a fork server has (it acts on
# itself and its client, never on the host the command acts on).
PROC = "/proc"
# Reading the request: a client sends it whole at once; one that stopped (SIGSTOP)
# or vanished is not waited for longer.
REQUEST_WAIT = 10.0
# From `ready` to `go` a client does microseconds of work: one that has not said
# `go` by then is told `refused`, and runs the command itself if it still can.
GO_WAIT = 2.0
NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "user", "cgroup")
RLIMITS = tuple(getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_"))
MAX_REQUEST = 64 << 20


class Refused(Exception):
    """The request is not run here (the message says why): the client runs it."""


@dataclass(frozen=True)
class Request:
    executable: bytes
    package: bytes
    ignored: tuple[int, ...]
    blocked: tuple[int, ...]
    streams: tuple[bytes, bytes, bytes]
    argv0: str
    argv: list[str]
    environment: list[bytes]
    stdin: bytes | None

    @classmethod
    def parse(cls, data: bytes) -> Request:
        fields = _Fields(data)
        executable, package = fields.next(), fields.next()
        ignored, blocked = _numbers(fields.next()), _numbers(fields.next())
        streams = (fields.next(), fields.next(), fields.next())
        argv0 = os.fsdecode(fields.next())
        argv = [os.fsdecode(fields.next()) for _ in range(int(fields.next()))]
        environment = [fields.next() for _ in range(int(fields.next()))]
        stdin = fields.rest() if fields.next() == b"=" else None
        return cls(
            executable,
            package,
            ignored,
            blocked,
            streams,
            argv0,
            argv,
            environment,
            stdin,
        )


class _Fields:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def next(self) -> bytes:
        end = self.data.index(b"\0", self.at)
        field, self.at = self.data[self.at : end], end + 1
        return field

    def rest(self) -> bytes:
        return self.data[self.at :]


def _numbers(field: bytes) -> tuple[int, ...]:
    return tuple(int(n) for n in field.split(b",") if n)


def identity() -> tuple[bytes, bytes]:
    """What a client must share with the server to be served: the interpreter and
    the directory the package was loaded from (client.request sends its own)."""
    return os.fsencode(sys.executable), os.fsencode(client.package_directory())


def serve(
    conn: socket.socket, listener: socket.socket, peer_pid: int, run: Run, verbose: bool
) -> NoReturn:
    """The child's whole life, from the fork on (it never returns to the server's loop)."""
    code = 0
    try:
        listener.close()
        fresh_process()
        log = _log(os.dup(2) if verbose else None)  # the server's log, never the client's
        try:
            request = _receive(conn)
            _become(request, peer_pid, _check(request, peer_pid))
            conn.sendall(b"ready %d\n" % os.getpid())
        except (Refused, OSError, ValueError) as why:
            log(f"not run for pid {peer_pid}: {why}")
            os._exit(0)
        try:
            descriptors = _go(conn)
        except (Refused, OSError) as why:
            log(f"not run for pid {peer_pid}: no `go` ({why})")
            with contextlib.suppress(OSError):
                conn.sendall(b"refused no go\n")  # a client still there runs it itself
            os._exit(0)
        try:
            _take(request, descriptors)
        except (OSError, ValueError) as why:  # nothing ran: the client runs it in-process
            log(f"not run for pid {peer_pid}: {why}")
            conn.sendall(b"refused %s\n" % str(why).encode(errors="replace"))
            os._exit(0)
        conn.settimeout(None)
        client.in_server = True
        log(f"running {_words(request.argv)} for pid {peer_pid}")
        finished = _watch(conn)
        started = time.monotonic()
        word, code = _run(run, request.argv)
        took = (time.monotonic() - started) * 1000
        # Said before the status goes out: once the client has it, the log has the line.
        log(f"ran {_words(request.argv)} for pid {peer_pid}: {word.decode()} {code}, {took:.1f} ms")
        _finish(conn, word, code, finished)
    except BaseException:  # nothing of the server's may run on in a child
        code = 1
    finally:
        os._exit(code)


def _log(fd: int | None) -> Callable[[str], None]:
    def log(text: str) -> None:
        if fd is not None:
            os.write(fd, f"charly-arbiter serve[{os.getpid()}]: {text}\n".encode())

    return log


def _words(argv: list[str]) -> str:
    return " ".join(argv[:2]) or "(no arguments)"


# -- the request ---------------------------------------------------------------------------


def _receive(conn: socket.socket) -> Request:
    """The request (Refused for one that is not whole in time)."""
    conn.settimeout(REQUEST_WAIT)
    data = bytearray()
    header = len(MAGIC) + LENGTH_BYTES
    total: int | None = None
    while total is None or len(data) < total:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise Refused("the client closed the connection before the request was whole")
        data += chunk
        if total is None and len(data) >= header:
            if not data.startswith(MAGIC):
                raise Refused("not a request of this protocol")
            total = header + int.from_bytes(data[len(MAGIC) : header], "big")
            if total > MAX_REQUEST:
                raise Refused(f"a request of {total} bytes")
    if len(data) > total:
        raise Refused("more than the request before `ready`")
    return Request.parse(bytes(data[header:total]))


def _go(conn: socket.socket) -> dict[str, int]:
    """The client's `go` and the descriptors it carries (Refused without them)."""
    conn.settimeout(GO_WAIT)
    space = socket.CMSG_SPACE(len(DESCRIPTORS) * 4)
    data, ancillary, flags, _ = conn.recvmsg(16, space, socket.MSG_CMSG_CLOEXEC)
    received: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            received += [
                int.from_bytes(payload[i : i + 4], sys.byteorder) for i in range(0, usable, 4)
            ]
    if data != b"go\n" or flags & socket.MSG_CTRUNC or len(received) != len(DESCRIPTORS):
        for fd in received:
            os.close(fd)
        raise Refused(f"{data!r} with {len(received)} descriptors")
    return dict(zip(DESCRIPTORS, received, strict=True))


@dataclass(frozen=True)
class World:
    """What a process may do and see: its namespaces and root, /proc/PID/status (uids,
    capabilities, no_new_privs, seccomp; also what the child copies), its label."""

    namespaces: tuple[tuple[int, int], ...]
    root: tuple[int, int]
    status: dict[str, str]
    label: str

    @classmethod
    def of(cls, pid: str) -> World:
        return cls(
            tuple(_stat(f"{PROC}/{pid}/ns/{namespace}") for namespace in NAMESPACES),
            _stat(f"{PROC}/{pid}/root"),
            _status(pid),
            _label(pid),
        )


@functools.cache
def server_world() -> World:
    """The server's, read once (the server calls it before it forks its spares)."""
    return World.of("self")


def _check(request: Request, pid: int) -> World:
    """The client's world; Refused unless the client runs this very code and could do
    all this child can."""
    if (request.executable, request.package) != identity():
        raise Refused(
            f"another interpreter or package ({os.fsdecode(request.executable)}, "
            f"{os.fsdecode(request.package)})"
        )
    if pid <= 0:
        raise Refused("the client's process is not visible here")
    mine, theirs = server_world(), World.of(str(pid))
    for namespace, ours, its in zip(NAMESPACES, mine.namespaces, theirs.namespaces, strict=True):
        if ours != its:
            raise Refused(f"the client is in another {namespace} namespace")
    if mine.root != theirs.root:
        raise Refused("the client has another root directory")
    if mine.status["Uid"].split() != theirs.status["Uid"].split():
        raise Refused(f"the client's uids are {theirs.status['Uid'].split()}")
    for field in ("CapEff", "CapPrm", "CapBnd"):
        if int(mine.status[field], 16) & ~int(theirs.status[field], 16):
            raise Refused(f"the client has fewer capabilities ({field} {theirs.status[field]})")
    for field in ("NoNewPrivs", "Seccomp"):
        if theirs.status.get(field, "0") != mine.status.get(field, "0"):
            raise Refused(f"the client runs with {field} {theirs.status.get(field)}")
    if mine.label != theirs.label:
        raise Refused(f"the client's security label is {theirs.label!r}")
    return theirs


def _stat(path: str) -> tuple[int, int]:
    found = os.stat(path)
    return found.st_dev, found.st_ino


def _status(pid: str) -> dict[str, str]:
    with open(f"{PROC}/{pid}/status", encoding="utf-8", errors="replace") as handle:
        lines = handle.read().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _label(pid: str) -> str:
    try:
        with open(f"{PROC}/{pid}/attr/current", "rb") as handle:
            return handle.read().rstrip(b"\0\n").decode(errors="replace")
    except OSError:
        return ""


# -- taking the client's place ---------------------------------------------------------------


def _become(request: Request, pid: int, world: World) -> None:
    """This process as the client's, before `ready` (nothing runs until `go`)."""
    _attributes(pid, world.status)
    os.environ.clear()
    for item in request.environment:
        key, _, value = item.partition(b"=")
        if key:
            os.environb[key] = value
    time.tzset()
    with contextlib.suppress(locale.Error):
        locale.setlocale(locale.LC_CTYPE, "")
    sys.argv = [request.argv0, *request.argv]
    for signum in request.ignored:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, request.blocked)


def _take(request: Request, fds: dict[str, int]) -> None:
    """The client's stdin, stdout, stderr and working directory, from its `go`."""
    try:
        stdin = fds["stdin"]
        if request.stdin is not None:  # what the hook had read: the command reads it again
            stdin = os.memfd_create("stdin", os.MFD_CLOEXEC)
            _write(stdin, request.stdin)
            os.lseek(stdin, 0, os.SEEK_SET)
        for target, source in ((0, stdin), (1, fds["stdout"]), (2, fds["stderr"])):
            os.dup2(source, target)
        os.fchdir(fds["cwd"])
    finally:
        for fd in {stdin, *fds.values()}:
            os.close(fd)
    sys.stdin = _stream(0, "r", request.streams[0])
    sys.stdout = _stream(1, "w", request.streams[1])
    sys.stderr = _stream(2, "w", request.streams[2])
    # sys.__stdout__ and the others are what the interpreter started with: the client's.
    vars(sys).update(__stdin__=sys.stdin, __stdout__=sys.stdout, __stderr__=sys.stderr)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _attributes(pid: int, status: dict[str, str]) -> None:
    """The client's umask, groups, resource limits, priority, affinity and OOM score."""
    os.umask(int(status["Umask"], 8))
    real, effective, saved, _ = (int(n) for n in status["Gid"].split())
    if (real, effective, saved) != os.getresgid():
        os.setresgid(real, effective, saved)
    groups = [int(n) for n in status.get("Groups", "").split()]
    if sorted(groups) != sorted(os.getgroups()):
        os.setgroups(groups)
    for limit in RLIMITS:
        # A limit this kernel lacks, or one not ours to raise, stays as it is.
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(limit, resource.prlimit(pid, limit))
    try:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, pid))
        os.sched_setaffinity(0, os.sched_getaffinity(pid))
        with open(f"{PROC}/{pid}/oom_score_adj", "rb") as theirs:
            score = theirs.read()
        with open(f"{PROC}/self/oom_score_adj", "wb") as ours:
            ours.write(score)
    except OSError:
        pass


def _stream(fd: int, mode: str, spec: bytes) -> io.TextIOWrapper:
    """A standard stream on `fd` as the client's interpreter made it."""
    encoding, errors, line, through = spec.decode().split(":")
    binary = open(fd, mode + "b", closefd=False)  # noqa: SIM115  (the stream's, for its life)
    return io.TextIOWrapper(
        binary,
        encoding=encoding,
        errors=errors,
        newline="\n",
        line_buffering=line == "1",
        write_through=through == "1",
    )


# -- running and reporting -------------------------------------------------------------------


def _watch(conn: socket.socket) -> threading.Event:
    """Signals from the client go to the command's main thread; a client gone
    (kill -9) takes the command with it, as it would in-process.  Set the event
    it returns before the exit status goes out (the client then closes its end)."""
    main = threading.get_ident()
    finished = threading.Event()

    def watch() -> None:
        data = b""
        while True:
            try:
                chunk = conn.recv(64)
            except OSError:
                chunk = b""
            if not chunk:
                if not finished.is_set():
                    os.kill(os.getpid(), signal.SIGKILL)
                return
            data += chunk
            while b"\n" in data:
                line, _, data = data.partition(b"\n")
                word, _, number = line.partition(b" ")
                if word == b"signal" and number.isdigit():
                    signal.pthread_kill(main, int(number))

    threading.Thread(target=watch, name="client", daemon=True).start()
    return finished


def _run(run: Run, argv: list[str]) -> tuple[bytes, int]:
    """What the interpreter would have made of `main(argv)`: an exit status, or the
    signal it dies of (an uncaught KeyboardInterrupt)."""
    try:
        run(argv)
    except SystemExit as done:
        if done.code is None:
            return b"exit", 0
        if isinstance(done.code, int):
            return b"exit", done.code
        print(done.code, file=sys.stderr)
        return b"exit", 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return b"signal", signal.SIGINT
    except BaseException:
        traceback.print_exc()
        return b"exit", 1
    return b"exit", 0


def _finish(conn: socket.socket, word: bytes, code: int, finished: threading.Event) -> None:
    """The interpreter's exit (threads joined, atexit, stdio flushed), then the status;
    the client's descriptors are let go first, so that a reader of its stdout sees
    the end when the client exits."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    finished.set()
    conn.sendall(b"%s %d\n" % (word, code))


def fresh_process() -> None:
    """Right after the fork: a session of its own (the server's group and terminal are
    not the command's), and signals as a new interpreter has them."""
    os.setsid()
    for signum in client.CATCHABLE:
        if signum == signal.SIGINT:
            signal.signal(signum, signal.default_int_handler)
        elif signum in (signal.SIGPIPE, signal.SIGXFSZ):  # as Python sets them at start
            signal.signal(signum, signal.SIG_IGN)
        else:
            signal.signal(signum, signal.SIG_DFL)
    logger = logging.getLogger("charly_arbiter")
    logger.handlers[:] = []
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
