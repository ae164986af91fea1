"""A spare's memory made its own while it waits, not while a request does.

A child forked from the server shares the server's pages until it writes to one,
and Python writes to every object it touches (its reference count): a command in
a fresh fork takes a copy-on-write fault for each page of the modules, functions
and code objects it runs through.  Measured on the simulated host: 1,400-2,000
faults for a claim or a release, 4-8 ms of each on a virtual machine, where a
fault is dear.  A spare waits idle for its request, so it takes those copies
there: every private writable mapping is populated for writing
(MADV_POPULATE_WRITE, Linux 5.14), a few MiB at a time, and it stops as soon as a
connection waits (that request is served at once; what is left faults in as
before).

The cost: each spare holds a copy of the server's private memory (its anonymous
RSS, some 20-30 MiB), and some milliseconds of CPU after each fork, taken at
idle priority (`idle_priority`).  A kernel without the advice refuses it
(EINVAL): the spare then waits as it did before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import select
import socket
from collections.abc import Callable, Iterator

MADV_POPULATE_WRITE = 23  # <asm-generic/mman-common.h>
CAP_SYS_NICE = 23  # <linux/capability.h>
# How much is populated between two looks at the listening socket.
CHUNK = 2 << 20
# Mappings that are not the process's data: the stack, and the kernel's pages.
SKIPPED = ("[stack]", "[vvar]", "[vdso]", "[vsyscall]")

Advise = Callable[[int, int], int]  # (address, length) -> 0, or an errno


@contextlib.contextmanager
def idle_priority() -> Iterator[None]:
    """SCHED_IDLE for the block: a spare does its work while a CPU has nothing else to
    do, never at the expense of the request being served (on a small machine the
    spare is forked as that request starts).  Only from SCHED_OTHER or SCHED_BATCH,
    and only where the process may return to it (`_may_return`); the policy is put
    back when the block ends."""
    policy = os.sched_getscheduler(0)
    if policy not in (os.SCHED_OTHER, os.SCHED_BATCH) or not _may_return():
        yield
        return
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, os.sched_param(0))


def _may_return() -> bool:
    """Whether leaving SCHED_IDLE is allowed: with CAP_SYS_NICE (root's), or an
    RLIMIT_NICE that allows this nice value (sched(7)); a spare left at idle priority
    would run its request there."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    if limit == resource.RLIM_INFINITY or 20 - nice <= limit:
        return True
    with open("/proc/self/status", encoding="ascii", errors="replace") as handle:
        for line in handle:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


def waiting(listener: socket.socket) -> bool:
    """Whether a connection waits on `listener` (then a spare stops what it does ahead)."""
    return bool(select.select([listener], [], [], 0)[0])


def prefault(listener: socket.socket, advise: Advise | None = None, maps: str = "") -> int:
    """Populate this process's private writable memory for writing until done or a
    connection waits on `listener`; the bytes populated.  `advise` and `maps` (the
    text of /proc/self/maps) are for tests."""
    advise = advise or _madvise()
    if not maps:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as handle:
            maps = handle.read()
    done = 0
    for start, end in _chunks(maps):
        if waiting(listener):
            break  # a request waits: it goes first
        error = advise(start, end - start)
        if error == errno.EINVAL and done == 0:
            break  # a kernel before 5.14: the advice is unknown
        if error == 0:
            done += end - start
    return done


def _chunks(maps: str) -> Iterator[tuple[int, int]]:
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3:4] != "p":
            continue
        if len(fields) == 6 and fields[5].strip() in SKIPPED:
            continue
        low, _, high = fields[0].partition("-")
        start, end = int(low, 16), int(high, 16)
        for at in range(start, end, CHUNK):
            yield at, min(at + CHUNK, end)


def _madvise() -> Advise:
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int

    def advise(address: int, length: int) -> int:
        if madvise(address, length, MADV_POPULATE_WRITE) == 0:
            return 0
        return ctypes.get_errno()

    return advise
