"""`charly-arbiter hook qemu GUEST OP SUBOP EXTRA`: what libvirt's qemu hook runs.

libvirt waits for this on every VM start and stop, so the path for a domain
that claims nothing imports almost nothing: the XML is scanned as bytes and
the hook exits before the configuration, the ledger or libvirt are loaded.
Everything after the scan is `hookrun`, imported here and only here, lazily.

Contract (docs/libvirt.md): nothing on stdout (libvirt reads it as XML for
some operations); `prepare` refuses with a non-zero exit and one or two
sentences on stderr; `release` and `reconnect` always exit 0; `migrate`
refuses a domain with an exclusive claim; every other operation exits 0 at
once.  The guest name is untrusted: it only ever becomes `libvirt:NAME`.
"""

from __future__ import annotations

import os
import sys

HANDLED = {"prepare": "begin", "release": "end", "reconnect": "begin", "migrate": "begin"}
ALWAYS_SUCCEED = ("release", "reconnect")
# Above libvirt's own 10 MiB: a domain whose XML is larger is refused at prepare
# rather than read in part (a hostdev past the part read would pass unclaimed).
# The same bound as domainxml.MAX_XML_BYTES (not imported: the fast path stays light).
MAX_XML = 16 << 20
# Without one of these bytes the XML cannot claim (the domainxml rules, without
# importing them: the fast path stays at the cost of starting Python).
CLAIM_MARKERS = (b"hostdev", b"https://charly-arbiter.org/xmlns/claim/1")
USAGE = "usage: charly-arbiter hook qemu GUEST OPERATION SUB-OPERATION EXTRA"


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(f"charly-arbiter: {USAGE}", file=sys.stderr)
        return 2
    driver, guest, operation, sub_operation = argv[:4]
    extra = argv[4] if len(argv) > 4 else "-"
    if driver != "qemu" or HANDLED.get(operation) != sub_operation:
        return 0
    stdout_to_stderr()
    try:
        return _dispatch(guest, operation, extra)
    except Exception as error:  # the boundary: one sentence, and the right exit code
        from charly_arbiter.errors import ArbiterError

        if isinstance(error, ArbiterError):
            say(str(error), error.hint)
        else:
            if os.environ.get("CHARLY_ARBITER_DEBUG"):
                import traceback

                traceback.print_exc()
            say(f"internal error in the {operation} hook for {guest!r}: {error!r}", None)
        return 0 if operation in ALWAYS_SUCCEED else 1


def _dispatch(guest: str, operation: str, extra: str) -> int:
    xml = _read_stdin()
    # Too large to read whole: refused at prepare; otherwise the ledger decides.
    oversized = len(xml) > MAX_XML
    if oversized and operation == "prepare":
        say(
            f"the domain XML of {guest!r} is larger than {MAX_XML >> 20} MiB; "
            "it is refused rather than read in part",
            "shorten its <description> or metadata",
        )
        return 1
    if not oversized and not any(marker in xml for marker in CLAIM_MARKERS):
        return 0  # the fast path: no hostdev, no claim element
    from charly_arbiter.libvirt import hookrun

    return hookrun.dispatch(guest, operation, extra, None if oversized else xml)


def _read_stdin() -> bytes:
    """The whole XML up to MAX_XML bytes (one byte more says it was larger)."""
    try:
        return sys.stdin.buffer.read(MAX_XML + 1)
    except (OSError, ValueError, AttributeError):
        return b""


def stdout_to_stderr() -> None:
    """Nothing this process (or a child) writes can reach libvirt's stdout pipe."""
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
