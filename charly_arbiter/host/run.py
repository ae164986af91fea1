"""The one door to external commands.

Every command runs from an absolute path with an argv list (never a shell),
a pinned `LANG=C.UTF-8` and a fixed `PATH`, no inherited stdin/stdout (a hook's
stdout belongs to libvirt), and a timeout.  Success is the exit code; callers
check the resulting state themselves rather than parsing localized text.
Nothing else in the package imports `subprocess`.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from charly_arbiter.errors import CommandFailed

log = logging.getLogger(__name__)

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENVIRONMENT = {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


def which(program: str) -> str | None:
    """The absolute path of `program` on the fixed PATH, or None."""
    return shutil.which(program, path=SAFE_PATH)


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    ok_codes: Sequence[int] = (0,),
    timeout: float = 60.0,
    input_text: str | None = None,
) -> Completed:
    """Run `argv` (argv[0] must be absolute) and return its result.

    Raises `CommandFailed` when the exit code is not in `ok_codes` (with
    `check`) or when the command outlives `timeout`.
    """
    args = list(argv)
    if not args or not args[0].startswith("/"):
        raise ValueError(f"run() needs an absolute program path, got {args[:1]}")
    log.debug("running %s", " ".join(args))
    try:
        result = subprocess.run(
            args,
            input=input_text,
            stdin=None if input_text is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=ENVIRONMENT,
            timeout=timeout,
            close_fds=True,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        log.warning("%s did not finish within %g s", args[0], timeout)
        raise CommandFailed(args, None, str(error.stderr or "")) from error
    except OSError as error:
        raise CommandFailed(args, 127, str(error)) from error
    completed = Completed(result.returncode, result.stdout, result.stderr)
    if check and result.returncode not in ok_codes:
        log.warning("%s exited with %d", args[0], result.returncode)
        raise CommandFailed(args, result.returncode, result.stderr)
    return completed


def spawn_detached(argv: Sequence[str]) -> None:
    """Start `argv` in its own session with no inherited pipes, and do not wait.

    For work a hook hands off: libvirt waits for EOF on the hook's stdout and
    stderr, so a child that kept them would hang the VM's start or stop.  It
    keeps nothing else of its caller either: the fixed environment, and `/` as its
    directory (a hook's may be anywhere, a mount it would keep busy).
    """
    args = list(argv)
    if not args or not args[0].startswith("/"):
        raise ValueError(f"spawn_detached() needs an absolute program path, got {args[:1]}")
    subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENVIRONMENT,
        cwd="/",
        close_fds=True,
        start_new_session=True,
    )
