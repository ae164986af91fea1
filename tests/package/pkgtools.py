"""Helpers of the package tests: running commands, the lock, the cached Debian 12 root."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Iterator
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


APT = ["apt-get", "-y", "-q", "-o", "Dpkg::Use-Pty=0"]


def is_installed() -> bool:
    """Whether dpkg knows charly-arbiter (installed, or purged but for its conffiles)."""
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", "charly-arbiter"],
        capture_output=True,
        text=True,
        check=False,
    )
    return "ok installed" in result.stdout or "config-files" in result.stdout


@contextlib.contextmanager
def installed_on_this_machine(deb: Path) -> Iterator[subprocess.CompletedProcess[str]]:
    """`apt install ./DEB` on this machine for the block (under the lock the libvirt and
    Podman runs share: the installed package is one per machine), then `apt purge`;
    yields the install's output.  Refuses a machine where it is installed already."""
    need_root()
    with flocked(LIBVIRT_LOCK):
        if is_installed():
            pytest.fail(
                "charly-arbiter is already installed here: `apt purge charly-arbiter` first"
            )
        output = run([*APT, "install", "--no-install-recommends", str(deb)], env=CLEAN_ENV)
        try:
            yield output
        finally:
            purge = run([*APT, "purge", "charly-arbiter"], env=CLEAN_ENV, check=False)
            assert purge.returncode == 0, purge.stdout


def run_installed_suite(
    tmp_path: Path, label: str, paths: Iterable[str], timeout: float, **env: str
) -> None:
    """The checkout's tests `paths` against the INSTALLED package: Debian's python3 with
    -P and the checkout's tests/ alone on the path (never its charly_arbiter/), with
    CHARLY_ARBITER_E2E_INSTALLED=1 and `env`; every test must pass, none be skipped."""
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "tests").symlink_to(REPO / "tests")
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("CHARLY_", "PYTHON"))}
    environment.update(
        PYTHONPATH=str(tmp_path / "path"),
        CHARLY_ARBITER_E2E_INSTALLED="1",
        PYTHONSAFEPATH="1",
        PATH=CLEAN_ENV["PATH"],
        **env,
    )
    started = time.monotonic()
    suite = subprocess.run(
        ["/usr/bin/python3", "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *paths],
        cwd=REPO,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    log(f"{label} against the installed package: {time.monotonic() - started:.0f} s")
    log(suite.stdout[-6000:])
    summary = suite.stdout.strip().splitlines()[-1] if suite.stdout.strip() else ""
    assert suite.returncode == 0, suite.stdout[-12000:]
    assert "passed" in summary and "skipped" not in summary, summary


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
