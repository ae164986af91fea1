"""What a hook may say, and where: the one voice of the libvirt and the OCI hook.

A hook's stdout belongs to its caller (libvirt reads it as the hook's answer,
a runtime may too), so nothing may ever reach it; the hook's refusal is one or
two sentences on stderr, which libvirt and Podman show as the failed start's
cause.  Imported on the hooks' fast paths: `os` and `sys` only.
"""

from __future__ import annotations

import os
import sys


def stdout_to_stderr() -> None:
    """Nothing this process (or a child) writes can reach the caller's stdout."""
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(1)
    sys.stdout = sys.stderr


def say(message: str, hint: str | None) -> None:
    """One or two sentences on stderr; names in them (`libvirt:../../x`) stay as they are."""
    text = f"charly-arbiter: {_sentence(message)}"
    if hint:
        text += f" Hint: {_sentence(hint)}"
    print(text, file=sys.stderr)


def _sentence(text: str) -> str:
    return text if text.endswith((".", "!", "?")) else f"{text}."
