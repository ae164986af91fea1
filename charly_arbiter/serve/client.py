"""The client half of the resident helper: hand this command to `charly-arbiter serve`,
or say that it is not there, and the caller runs the command in-process as without it.

Imported by the program before anything heavy (cli/__init__.py, and the hooks' slow
paths): `posix`, `sys`, `time` and the C halves of `socket` and `signal`, nothing of
the arbiter, so a host without the helper pays one failed `connect` (tens of
microseconds) and a host with it a few milliseconds for the whole hand-over.

The hand-over (docs/architecture.md, "Where people wait"):
1. connect; the server must run as this process's uid (SO_PEERCRED);
2. send the request: the arguments, the environment, how stdio is encoded, which
   signals are ignored or blocked, and what a hook has already read from stdin;
3. a child the server forked ahead takes it, checks that it may run it here, and
   says `ready`; the client answers `go` only if it has not given up by then, and
   only `go` carries stdin, stdout, stderr and the working directory (SCM_RIGHTS):
   a hung server never holds a caller's pipes (libvirt reads a hook's to the end);
4. the child runs the command only on `go`, so a command never runs twice (a child
   that finds its client gone exits without running it, and a client that said
   `go` never runs it itself, unless the child answers `refused` before running);
5. the child's exit status comes back.  Signals the client gets meanwhile (Ctrl-C,
   SIGTERM, SIGHUP, SIGQUIT) are passed on to the child; a client that goes away
   (kill -9) takes its child with it.
No socket, a refused connection, a server of another uid, a dead or hung one, or
no `ready` within the deadline (steps 1-3 together): `forward` returns None.

It uses `posix`, not `os`: importing `os` (posixpath, stat, _collections_abc) is
about 1 ms of a program started without `site`, where the whole hand-over is a few
(docs/architecture.md, "Python without `site`").  For the same reason there is no
`from __future__ import annotations` here, and the annotations of names imported
only for the type checker are quoted.
"""

import posix
import sys
import time

TYPE_CHECKING = False  # not typing's: nothing more is imported on the program's path
if TYPE_CHECKING:
    from _socket import socket
    from collections.abc import Sequence
    from types import ModuleType
    from typing import NoReturn

SOCKET = "/run/charly-arbiter/serve.sock"
ENV_SOCKET = "CHARLY_ARBITER_SOCKET"
# "off": never hand a command over; "must": fail (exit 1) rather than run it here
# (for checks and benchmarks that must know where a command ran).
ENV_SERVE = "CHARLY_ARBITER_SERVE"
ENV_DEADLINE = "CHARLY_ARBITER_SERVE_DEADLINE_MS"
# From connect to `ready`: a healthy server answers in 1-3 ms (docs/architecture.md);
# this is what a stopped-but-listening or hung one costs a command at most.
DEADLINE_MS = 50.0
MAGIC = b"charly-arbiter serve 1\n"
LENGTH_BYTES = 8
# The descriptors a request carries, in this order.
DESCRIPTORS = ("stdin", "stdout", "stderr", "cwd")
# Passed on to the child while it runs: SIGHUP, SIGINT, SIGQUIT, SIGTERM.
FORWARDED = (1, 2, 3, 15)
# Signals whose disposition and mask a request carries (1-31 less SIGKILL, SIGSTOP).
CATCHABLE = tuple(n for n in range(1, 32) if n not in (9, 19))

# True in a child of the server, which runs the command itself.
in_server = False


class NotServed(Exception):
    """The helper did not take the command (the message says why); it runs in-process."""


def environment_bytes() -> dict[bytes, bytes]:
    """This process's environment: `posix.environ` is the very dict os.environ and
    os.environb keep it in, so a change made through them is seen here too."""
    return posix.environ


def getenv(name: str) -> str | None:
    """os.getenv's answer, from environment_bytes."""
    value = environment_bytes().get(fsencode(name))
    return None if value is None else value.decode(*_filesystem_encoding())


def fsencode(text: str) -> bytes:
    """os.fsencode of a str."""
    return text.encode(*_filesystem_encoding())


def _filesystem_encoding() -> tuple[str, str]:
    return sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def package_directory() -> str:
    """The directory of the package this module was imported from, as
    os.path.abspath spells it: the client sends it and the server compares it with
    its own (child.identity), both from this function."""
    path = __file__ if __file__.startswith("/") else f"{posix.getcwd()}/{__file__}"
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            del parts[-1:]
        elif part not in ("", "."):
            parts.append(part)
    return "/" + "/".join(parts[:-2])  # less serve/client.py


def exit_now(code: int) -> "NoReturn":
    """End the program with the exit status the helper's child sent back, without the
    interpreter's finalization (its module teardown is 1-1.5 ms, a tenth of the
    program's start): nothing here leaves work for it once the standard streams are
    flushed.  A status outside C's int goes the usual way, as sys.exit says it."""
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105  (contextlib is an import this path does without)
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, closed, or a broken pipe
            pass
    if -(1 << 31) <= code < 1 << 31:
        posix._exit(code)
    sys.exit(code)


def forward(argv: "Sequence[str]", stdin: bytes | None = None) -> int | None:
    """Have the resident helper run `charly-arbiter ARGV`: its exit status, or None
    when it did not take the command.  `stdin`: what a hook already read from its
    stdin (the child reads these bytes instead).

    Raises ArbiterError when the command was handed over but no exit status came
    back (its process was killed), and, with CHARLY_ARBITER_SERVE=must, when the
    helper did not take it."""
    mode = getenv(ENV_SERVE) or ""
    if in_server or mode == "off":
        return None
    try:
        return _hand_over(argv, stdin).wait()
    except NotServed as why:
        if mode == "must":
            raise _error(
                f"the resident helper did not take the command ({why}), and "
                f"{ENV_SERVE}=must forbids running it here",
                f"see `systemctl status charly-arbiter.socket charly-arbiter.service`, "
                f"or unset {ENV_SERVE}",
            ) from None
        return None


def run_program(argv: "Sequence[str]") -> int | None:
    """`forward` for the CLI: a command that was lost is said as the CLI says an error."""
    try:
        return forward(argv)
    except Exception as error:
        from charly_arbiter.errors import ArbiterError

        if not isinstance(error, ArbiterError):
            raise
        print(f"charly-arbiter: {error}", file=sys.stderr)
        if error.hint:
            print(f"hint: {error.hint}", file=sys.stderr)
        return 1


def deadline_seconds() -> float:
    try:
        milliseconds = float(getenv(ENV_DEADLINE) or DEADLINE_MS)
    except ValueError:
        milliseconds = DEADLINE_MS
    return max(milliseconds, 1.0) / 1000


def request(argv: "Sequence[str]", stdin: bytes | None) -> bytes:
    """The request's bytes: MAGIC, the body's length, then NUL-separated fields (what
    child.Request reads); a hook's stdin bytes last, whole."""
    signals = _signal()
    ignored = [n for n in CATCHABLE if signals.getsignal(n) == signals.SIG_IGN]
    blocked = sorted(int(n) for n in signals.pthread_sigmask(signals.SIG_BLOCK, ()))
    streams = [_stream(stream) for stream in (sys.stdin, sys.stdout, sys.stderr)]
    environment = [key + b"=" + value for key, value in environment_bytes().items()]
    fields = [
        fsencode(sys.executable),
        fsencode(package_directory()),
        b",".join(b"%d" % n for n in ignored),
        b",".join(b"%d" % n for n in blocked),
        *streams,
        fsencode(sys.argv[0] if sys.argv else ""),
        b"%d" % len(argv),
        *(fsencode(argument) for argument in argv),
        b"%d" % len(environment),
        *environment,
        b"-" if stdin is None else b"=",
    ]
    body = b"\0".join(fields) + b"\0" + (stdin or b"")
    return MAGIC + len(body).to_bytes(LENGTH_BYTES, "big") + body


def _stream(stream: object) -> bytes:
    """`ENCODING:ERRORS:LINE_BUFFERING:WRITE_THROUGH` of a standard stream."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    errors = getattr(stream, "errors", None) or "strict"
    line = int(bool(getattr(stream, "line_buffering", False)))
    through = int(bool(getattr(stream, "write_through", False)))
    return f"{encoding}:{errors}:{line}:{through}".encode()


def _signal() -> "ModuleType":
    """signal's C half: signal.py imports enum, milliseconds on the hooks' path."""
    return __import__("_signal")


def _hand_over(argv: "Sequence[str]", stdin: bytes | None) -> "Connection":
    """Steps 1-3 of the module's docstring, within the deadline; NotServed otherwise."""
    import _socket

    path = getenv(ENV_SOCKET) or SOCKET
    deadline = time.monotonic() + deadline_seconds()
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    connection = Connection(sock, deadline)
    cwd = -1
    try:
        cwd = posix.open(".", posix.O_PATH | posix.O_DIRECTORY | posix.O_CLOEXEC)
        connection.settle()
        sock.connect(path)
        peer = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
        uid = int.from_bytes(peer[4:8], sys.byteorder)
        if uid != posix.geteuid():
            raise NotServed(f"{path} is served by uid {uid}, not this uid {posix.geteuid()}")
        connection.settle()
        sock.sendall(request(argv, stdin))
        answer = connection.line()
        if not answer.startswith(b"ready "):
            raise NotServed(f"{path} closed the connection" if not answer else "a bad answer")
        connection.forward_signals()
        descriptors = b"".join(fd.to_bytes(4, sys.byteorder) for fd in (0, 1, 2, cwd))
        sock.sendmsg([b"go\n"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, descriptors)])
    except NotServed:
        sock.close()
        raise
    except (OSError, ValueError) as error:
        sock.close()
        connection.restore_signals()
        raise NotServed(f"{path}: {error}") from None
    finally:
        if cwd >= 0:
            posix.close(cwd)
    return connection


class Connection:
    """One hand-over's socket: lines in, within the deadline until `go`."""

    def __init__(self, sock: "socket", deadline: float) -> None:
        self.sock = sock
        self.deadline: float | None = deadline
        self.buffer = b""
        self.forwarded: list[int] = []
        self.previous: dict[int, object] = {}

    def settle(self) -> None:
        """The time left until the deadline, as the socket's timeout (TimeoutError after)."""
        if self.deadline is None:
            self.sock.settimeout(None)
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer within the deadline")
        self.sock.settimeout(left)

    def line(self) -> bytes:
        """The next line without its newline; b"" when the other end closed first."""
        while b"\n" not in self.buffer:
            self.settle()
            data = self.sock.recv(256)
            if not data:
                return b""
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return bytes(line)

    def forward_signals(self) -> None:
        """From `go` on, the signals of FORWARDED go to the child (those this process
        ignores stay ignored: the child ignores them too)."""
        signals = _signal()

        def pass_on(signum: int, frame: object) -> None:
            self.forwarded.append(signum)
            try:
                self.sock.send(b"signal %d\n" % signum)
            except OSError:
                return  # the child is gone: its end says so

        for signum in FORWARDED:
            handler = signals.getsignal(signum)
            if handler != signals.SIG_IGN:
                self.previous[signum] = handler
                signals.signal(signum, pass_on)

    def restore_signals(self) -> None:
        signals = _signal()
        for signum, handler in self.previous.items():
            signals.signal(signum, handler)
        self.previous.clear()

    def wait(self) -> int:
        """The child's exit status (step 5); as it ended by a signal, so does this
        process.  NotServed when the child refused before running the command."""
        self.deadline = None
        try:
            answer = self.line()
        except OSError:
            answer = b""
        finally:
            self.sock.close()
        word, _, number = answer.partition(b" ")
        if word == b"refused":
            self.restore_signals()
            raise NotServed(f"the helper refused it: {number.decode(errors='replace')}")
        if word == b"exit" and number.lstrip(b"-").isdigit():
            return int(number)
        if word == b"signal" and number.isdigit():
            return _die_by(int(number))
        if self.forwarded:
            # Passed a signal it did not handle (SIGQUIT, a SIGTERM in a hook): it died
            # of it, as this process would have in-process.
            return _die_by(self.forwarded[-1])
        raise _error(
            "the command ended without an exit status: its process in the resident "
            "helper was killed",
            f"run {_command('status')} to see what it left, and "
            f"{_command('restore', '--stranded')} if a lease is stranded",
        )


def _die_by(signum: int) -> int:
    """End this process by `signum`, as the command's did (128 + N if it survives)."""
    signals = _signal()
    signals.signal(signum, signals.SIG_DFL)
    posix.kill(posix.getpid(), signum)
    return 128 + signum


def _command(*words: str) -> str:
    from charly_arbiter.errors import cli_command

    return cli_command(*words)


def _error(message: str, hint: str) -> Exception:
    from charly_arbiter.errors import ArbiterError

    return ArbiterError(message, hint=hint)
