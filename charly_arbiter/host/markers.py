"""Markers: a small file naming this process while it does something to a holder.

libvirt (and a container runtime) holds a domain locked while its hook runs,
and a holder's own hook runs nested while the arbiter stops or starts it.
Both are said with a marker under the state directory, named by a hash of the
ref (never by the untrusted name itself) and holding the writer's pid and start
time, so a marker left by a process that died, or whose pid was reused, is not
believed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from charly_arbiter.core.model import ProcessRef
from charly_arbiter.host.procscan import process_alive, process_ref
from charly_arbiter.host.sysfs import PROC_ROOT

ACTING_DIR = "libvirt-acting"  # holders this arbiter is stopping or starting
HOOK_DIR = "libvirt-hooks"  # domains whose own hook runs now


def is_acting(state_dir: Path, ref: str) -> bool:
    """Whether a live arbiter process is stopping or starting `ref` right now."""
    return _marked_by_live_process(state_dir / ACTING_DIR / _marker_name(ref))


def in_hook(state_dir: Path, ref: str) -> bool:
    """Whether `ref`'s own hook is running now (libvirt holds that domain locked)."""
    return _marked_by_live_process(state_dir / HOOK_DIR / _marker_name(ref))


@contextlib.contextmanager
def marked(state_dir: Path, kind: str, ref: str) -> Iterator[None]:
    """A file naming this process, for as long as the block runs (see is_acting, in_hook)."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory = state_dir / kind
    directory.mkdir(mode=0o700, exist_ok=True)
    marker = directory / _marker_name(ref)
    me = process_ref(PROC_ROOT, os.getpid()) or ProcessRef(os.getpid())
    marker.write_text(f"{me.pid} {me.start}")
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


def _marked_by_live_process(marker: Path) -> bool:
    """Whether the process that wrote the marker still runs (not a reuse of its pid)."""
    try:
        pid, _, start = marker.read_text().strip().partition(" ")
        writer = ProcessRef(int(pid), int(start or "0"))
    except (OSError, ValueError):
        return False
    return process_alive(PROC_ROOT, writer)


def _marker_name(ref: str) -> str:
    """A file name for `ref` that never carries the (untrusted) domain name itself."""
    return hashlib.sha256(ref.encode()).hexdigest()[:32]
