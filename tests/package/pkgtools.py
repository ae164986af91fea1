"""Helpers of the package tests: running commands, the lock, the cached Debian 12 root."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import machine
import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CACHE = Path("/var/cache/charly-arbiter-tests")
BASE_TARBALL = CACHE / "bookworm-minbase-systemd.tar"
BASE_MAX_AGE = 14 * 24 * 3600
MIRROR = "http://deb.debian.org/debian"
LIBVIRT_LOCK = Path("/tmp/charly-libvirt.lock")
CLEAN_ENV = {
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
    "DEBIAN_FRONTEND": "noninteractive",
}


def log(message: str) -> None:
    print(f"[package] {message}", file=sys.stderr, flush=True)


def run(
    argv: list[str], *, check: bool = True, timeout: float = 600, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run a command, stdout and stderr together; fail with the whole output."""
    started = time.monotonic()
    result = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, **kw
    )
    log(f"{' '.join(argv)} -> {result.returncode} ({time.monotonic() - started:.1f} s)")
    if check and result.returncode != 0:
        raise AssertionError(f"{argv} exited {result.returncode}:\n{result.stdout}")
    return result


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the package tests install packages: they need root (CI runs as root)")


@contextlib.contextmanager
def flocked(path: Path, timeout: float = 900) -> Iterator[None]:
    """Hold an exclusive flock on PATH (waiting up to TIMEOUT seconds), saying so."""
    with machine.flocked(path, "another test session", timeout) as waited:
        log(f"holding {path} (waited {waited:.0f} s for it)")
        yield


@dataclass(frozen=True)
class Deb:
    path: Path
    version: str
    build_seconds: float


@dataclass
class Chroot:
    """A Debian 12 root to install into; commands run in it with a clean environment."""

    root: Path

    def run(self, *argv: str, check: bool = True, timeout: float = 600) -> Any:
        return run(
            ["/usr/sbin/chroot", str(self.root), *argv], check=check, timeout=timeout, env=CLEAN_ENV
        )

    def apt(self, *args: str, check: bool = True) -> Any:
        return self.run("apt-get", "-y", "-q", "-o", "Dpkg::Use-Pty=0", *args, check=check)

    def install(self, deb: Deb) -> Any:
        shutil.copy(deb.path, self.root / "tmp" / deb.path.name)
        return self.apt("install", "--no-install-recommends", f"/tmp/{deb.path.name}")

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")


def base_tarball() -> Path:
    """The cached debootstrap of bookworm; built (about 30 s) when missing or stale."""
    with flocked(CACHE / ".lock"):
        if BASE_TARBALL.exists() and time.time() - BASE_TARBALL.stat().st_mtime < BASE_MAX_AGE:
            return BASE_TARBALL
        if not os.access("/usr/sbin/debootstrap", os.X_OK):
            pytest.fail("debootstrap is missing: run scripts/setup (scripts/apt-packages.txt)")
        building = CACHE / "building-root"
        shutil.rmtree(building, ignore_errors=True)
        log(f"debootstrap bookworm (minbase + systemd) from {MIRROR} into the cache")
        run(
            [
                "/usr/sbin/debootstrap",
                "--variant=minbase",
                "--include=systemd",
                "bookworm",
                str(building),
                MIRROR,
            ],
            env=CLEAN_ENV,
        )
        partial = BASE_TARBALL.with_suffix(".partial")
        run(["tar", "-C", str(building), "--numeric-owner", "-cf", str(partial), "."])
        partial.replace(BASE_TARBALL)
        shutil.rmtree(building)
        return BASE_TARBALL
