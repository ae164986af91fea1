"""What the tests that use this machine's own services share: a machine-wide lock
(libvirtd, Podman, /etc/libvirt and the installed package are one per machine,
whichever pytest process or nested suite uses them) and files put back as they
were."""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def flocked(path: Path, holders: str, timeout: float = 900) -> Iterator[float]:
    """Hold an exclusive flock on `path`, waiting up to `timeout` seconds (a failure
    names `holders`, who else takes it); yields how long it waited."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > timeout:
                    pytest.fail(f"{path} stayed locked for {timeout:.0f} s ({holders})")
                time.sleep(1)
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def restored(*paths: Path) -> Iterator[None]:
    """Put each file back as it was (or remove it, if it did not exist)."""
    saved = {path: path.read_bytes() if path.exists() else None for path in paths}
    try:
        yield
    finally:
        for path, content in saved.items():
            if content is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(content)
