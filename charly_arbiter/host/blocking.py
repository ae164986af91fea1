"""Calls that may never return, bounded: one way for every one of them.

Some things the arbiter does can block forever: unbinding `nvidia` while
anything holds the GPU, unbinding `vfio-pci` while a VM has the device open, a
libvirt call while libvirtd holds a lock.  `bounded` runs such a call in a
daemon thread and gives up on it after its deadline: the caller gets
`TimedOut` and goes on, and the stuck thread is abandoned (a thread blocked in
the kernel cannot be cancelled, but nobody waits for it).

A sysfs write stuck in the kernel is worse: a process cannot finish exiting
while one of its threads is stuck in one, so the CLI, or a libvirt hook whose
pipes libvirt reads to the end, would stay until the kernel lets go (seen on
a real kernel).  So those writes go to a helper process forked from this one
(`ChildWriter`): when one hangs, only the helper is stranded.  The helper is
forked once and reused (a fork per write costs more than the write itself on
slow machines); one that is still busy is never reused, so after a hang the
next write gets a fresh helper.  It keeps nothing open but its two pipes
(stdio goes to /dev/null, the ledger lock is closed) and answers each request
with the write's errno.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

T = TypeVar("T")


class TimedOut(Exception):
    """A bounded call did not return within its deadline (its thread is abandoned)."""

    def __init__(self, name: str, timeout: float) -> None:
        super().__init__(f"{name} did not return within {timeout:g} s")
        self.timeout = timeout


def bounded(action: Callable[[], T], timeout: float, name: str) -> T:
    """`action()`, or `TimedOut` after `timeout` seconds; its own exception is re-raised."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(action())
        except BaseException as error:  # handed to the caller below
            failure.append(error)

    worker = threading.Thread(target=target, name=name, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimedOut(name, timeout)
    if failure:
        raise failure[0]
    return outcome[0]


def errno_text(error: OSError) -> str:
    """An errno as people search for it: `EBUSY (Device or resource busy)`."""
    name = errno.errorcode.get(error.errno or 0, "")
    text = error.strerror or str(error)
    return f"{name} ({text})" if name else text


Writer = Callable[[Path, str], None]
_HEADER = struct.Struct("=i")


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _serve(writer: Writer, requests: int, replies: int) -> NoReturn:  # pragma: no cover
    """The helper's whole life (coverage is not collected in a forked child)."""
    code = 0
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        low, high = sorted((requests, replies))
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, os.sysconf("SC_OPEN_MAX"))
        while True:
            header = _read_exactly(requests, _HEADER.size)
            if len(header) < _HEADER.size:
                break  # the arbiter has exited
            payload = _read_exactly(requests, _HEADER.unpack(header)[0])
            path, _, text = payload.decode().partition("\0")
            try:
                writer(Path(path), text)
                result = 0
            except OSError as error:
                result = error.errno or errno.EIO
            os.write(replies, _HEADER.pack(result))
    except BaseException:
        code = 255
    finally:
        os._exit(code)


class _Helper:
    def __init__(self, writer: Writer) -> None:
        request_read, self.requests = os.pipe()
        self.replies, reply_write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover
            _serve(writer, request_read, reply_write)
        os.close(request_read)
        os.close(reply_write)

    def write(self, path: Path, text: str) -> bool:
        """Have the helper write; False when it died (it is not used again)."""
        payload = f"{path}\0{text}".encode()
        try:
            os.write(self.requests, _HEADER.pack(len(payload)) + payload)
        except BrokenPipeError:
            return False
        reply = _read_exactly(self.replies, _HEADER.size)
        if len(reply) < _HEADER.size:
            return False
        result = _HEADER.unpack(reply)[0]
        if result:
            raise OSError(result, os.strerror(result))
        return True

    def close(self) -> None:
        os.close(self.requests)
        os.close(self.replies)


class ChildWriter:
    """A `Writer` whose writes are made by helper processes."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self._idle: list[_Helper] = []
        self._lock = threading.Lock()

    def __call__(self, path: Path, text: str) -> None:
        with self._lock:
            helper = self._idle.pop() if self._idle else _Helper(self.writer)
        alive = False
        try:
            alive = helper.write(path, text)
        except OSError:
            alive = True  # the write failed; the helper is fine
            raise
        finally:
            if alive:
                with self._lock:
                    self._idle.append(helper)
            else:
                helper.close()
                os.waitpid(helper.pid, os.WNOHANG)
        if not alive:
            raise OSError(errno.EIO, "the writer process died")

    def close(self) -> None:
        """End the idle helpers (a busy one is stuck in the kernel and is left alone)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for helper in idle:
            helper.close()  # EOF on its requests: it exits
            os.waitpid(helper.pid, 0)
