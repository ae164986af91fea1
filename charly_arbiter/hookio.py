"""What a hook may say, and where: the one voice of the libvirt, OCI and Proxmox hooks.

A hook's stdout belongs to its caller (libvirt reads it as the hook's answer,
a runtime may too), so nothing may ever reach it; the hook's refusal is one or
two sentences on stderr, which libvirt, Podman and Proxmox show as the failed
start's cause.  `guarded` is the boundary every hook's main() runs its work
behind: one sentence, and the exit code of the contract.  Imported on the hooks'
fast paths: `os` and `sys` only, which is also why the configuration is scanned
here as bytes, never parsed.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's: the fast path imports no `typing` at run time
if TYPE_CHECKING:
    from collections.abc import Callable

DEFAULT_CONFIG = "/etc/charly-arbiter/arbiter.toml"  # core/config's, without importing it
DEFAULT_STATE = b"/var/lib/charly-arbiter"  # core/config's DEFAULT_STATE_DIR, likewise
ENV_STATE_DIR = "CHARLY_ARBITER_STATE_DIR"
# The most of a ledger a fast path reads (a thousand leases are a few hundred KiB).
MAX_LEDGER = 64 << 20


class Unsure(Exception):
    """A fast path cannot tell for certain: the slow path decides."""


def stdout_to_stderr() -> None:
    """Nothing this process (or a child) writes can reach the caller's stdout."""
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(1)
    sys.stdout = sys.stderr


def guarded(work: Callable[[], int], *, what: str, lets_go: Callable[[], bool]) -> int:
    """`work()`'s exit code; whatever it raises becomes one sentence on stderr and an
    exit code: an `ArbiterError`'s own (1 failed, 2 usage, 3 refused), 1 for anything
    else ("internal error in WHAT", a traceback with CHARLY_ARBITER_DEBUG set), and 0
    whenever `lets_go()` says the caller must go on (a stop is never held back: libvirt,
    the runtime and Proxmox go on only on 0).  Nothing of it reaches stdout."""
    stdout_to_stderr()
    try:
        return work()
    except Exception as error:  # the boundary: one sentence, and the right exit code
        from charly_arbiter.errors import ArbiterError

        code = 1
        if isinstance(error, ArbiterError):
            say(str(error), error.hint)
            code = error.exit_code
        else:
            if os.environ.get("CHARLY_ARBITER_DEBUG"):
                import traceback

                traceback.print_exc()
            say(f"internal error in {what}: {error!r}", None)
        return 0 if lets_go() else code


def python_with_site() -> None:
    """Set Python's `site` up now, if the program was started without it.

    The installed launcher starts Python with -S (packaging/launcher.py): handing a
    command to the resident helper needs the standard library only, and skipping
    `site` saves a third of the interpreter's start.  Whatever runs in-process (the
    click CLI, the hooks' slow paths, the server) imports installed libraries, which
    `site` puts on sys.path (with their .pth files and sitecustomize): it calls this
    first.  The launcher's own entry for the package is taken out first and put
    back only if `site` did not add it, so the search order is the usual one."""
    global _site_ready
    if _site_ready or not sys.flags.no_site:
        return
    _site_ready = True
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if sys.path and sys.path[-1] == ours:
        sys.path.pop()
    import site

    site.main()
    if ours not in sys.path:
        sys.path.append(ours)


_site_ready = False


def say(message: str, hint: str | None) -> None:
    """One or two sentences on stderr; names in them (`libvirt:../../x`) stay as they are."""
    text = f"charly-arbiter: {_sentence(message)}"
    if hint:
        text += f" Hint: {_sentence(hint)}"
    print(text, file=sys.stderr)


def _sentence(text: str) -> str:
    return text if text.endswith((".", "!", "?")) else f"{text}."


def scan_config(config: str | None) -> tuple[bool, bytes] | None:
    """What a fast path may learn from the configuration without parsing it:
    whether the host is simulated (`sim:DIR`, whose device nodes and PCI are its
    own files, not this machine's) and the file's bytes (empty when there is
    none: the defaults apply).  None when the file is there but cannot be read:
    the full path decides then, and says why."""
    if os.environ.get("CHARLY_ARBITER_HOST", "").startswith("sim:"):
        return True, b""
    path = config or os.environ.get("CHARLY_ARBITER_CONFIG") or DEFAULT_CONFIG
    try:
        with open(path, "rb") as handle:
            text = handle.read()
    except FileNotFoundError:
        return False, b""
    except OSError:
        return None
    simulated = any(
        line.lstrip().startswith(b"host") and b'"sim:' in line for line in text.splitlines()
    )
    return simulated, text


def setting(toml: bytes, key: bytes) -> bytes | None:
    """The value of `key = "…"` in arbiter.toml, read without a TOML parser: None
    when no line sets it; Unsure when a line does in a way this does not read for
    certain (escapes, a multi-line string, the key twice).  The slow path parses
    the file properly and has the last word."""
    if b"'''" in toml or b'"""' in toml:
        raise Unsure
    found = None
    for raw in toml.splitlines():
        line = raw.strip()
        if not line.startswith(key):
            continue
        rest = line[len(key) :].lstrip()
        if not rest.startswith(b"="):
            continue
        value = rest[1:].strip()
        quote = value[:1]
        if quote not in (b'"', b"'"):
            raise Unsure
        end = value.find(quote, 1)
        text, tail = value[1:end], value[end + 1 :].strip()
        if end < 0 or b"\\" in text or (tail and not tail.startswith(b"#")) or found is not None:
            raise Unsure
        found = text
    return found


def state_dir(settings: bytes, *, simulated: bool) -> bytes:
    """The state directory, from the environment or arbiter.toml's bytes; Unsure for a
    simulated host that names none (its own, DIR/state: the slow path knows it) and
    for one that is not an absolute path (the slow path says what is wrong)."""
    state = os.environ.get(ENV_STATE_DIR, "").encode() or setting(settings, b"state_dir")
    if not state:
        if simulated:
            raise Unsure
        return DEFAULT_STATE
    if not state.startswith(b"/"):
        raise Unsure
    return state


def read_bounded(path: bytes, limit: int, missing: bytes | None = None) -> bytes:
    """A file's bytes, at most `limit` of them; `missing` when it does not exist
    (None: Unsure), Unsure when it cannot be read or is larger."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except FileNotFoundError:
        if missing is None:
            raise Unsure from None
        return missing
    except OSError:
        raise Unsure from None
    if len(data) > limit:
        raise Unsure
    return data


def ledger_may_name(claimant: str, state: bytes) -> bool:
    """Whether the ledger in `state` may name `claimant` (as a lease's, or as a
    holder a lease stopped); False only when sure that it does not: the name is
    plain (printable, with no quote or backslash: the ledger writes it as it is,
    core/ledger_format._string) and its quoted form is nowhere in the ledger's
    bytes.  Read without the lock, like the slow path's first look: the ledger is
    only ever replaced whole."""
    plain = claimant.isprintable() and '"' not in claimant and "\\" not in claimant
    if not plain:
        return True
    try:
        ledger = read_bounded(state + b"/ledger.toml", MAX_LEDGER, missing=b"")
    except Unsure:
        return True
    return b'"' + claimant.encode() + b'"' in ledger


def configured_ledger_may_name(claimant: str) -> bool:
    """`ledger_may_name` in the configured state directory (environment, then
    arbiter.toml); True when that cannot be read for certain."""
    scan = scan_config(None)
    if scan is None:
        return True
    try:
        state = state_dir(scan[1], simulated=scan[0])
    except Unsure:
        return True
    return ledger_may_name(claimant, state)
