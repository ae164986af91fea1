"""`charly-arbiter hook proxmox VMID PHASE`: what the Proxmox hookscript runs.

qemu-server runs a VM's hookscript with `VMID PHASE` (pve-guest-common's
exec_hookscript) at `pre-start` (a non-zero exit aborts the start),
`post-start`, `pre-stop` (only for a stop through the API) and `post-stop`
(from `qm cleanup`, after every end of the QEMU process, a crash included).
The arbiter claims at `pre-start`, notes at `post-start` that the start worked
(a file named by the VMID under the state directory, for hookrun's start
watcher; written here, without the slow path), and releases at `post-stop`;
`pre-stop` exits 0 at once (hooks/proxmox does not even start Python for it).

The path for a VM that names no PCI device imports almost nothing (`os` and
`sys`): it reads the VM's configuration file and scans the bytes of its main
section for `hostpci` and the override's `charly-`; at `post-stop` it also
scans the ledger for a lease of the VM (its hostpci lines may have gone with
pending changes applied at the stop).  Everything after that is `hookrun`, unless
the resident helper takes it (`serve`: the same command, in a process that has
imported everything already).

Contract (docs/proxmox.md): nothing on stdout; `pre-start` refuses with exit 1
and one or two sentences on stderr (Proxmox shows them in the start task's
log); `post-start` and `post-stop` always exit 0.  The VMID is untrusted until it is checked
to be one (an integer from 100 to 999999999).
"""

from __future__ import annotations

import os
import sys

from charly_arbiter.hookio import (
    Unsure,
    guarded,
    ledger_may_name,
    python_with_site,
    read_bounded,
    say,
    scan_config,
    setting,
    state_dir,
)

HANDLED = ("pre-start", "post-start", "post-stop")
ALWAYS_SUCCEED = ("post-start", "post-stop")
# vmconf.MAX_CONFIG_BYTES, not imported: the fast path stays light.
MAX_CONFIG = 1 << 20
# core/config's default (ProxmoxConfig.config_dir), not imported.
DEFAULT_PVE = b"/etc/pve"
# STATE/proxmox-started/VMID: the start reached post-start (hookrun.STARTED_DIR).
STARTED_DIR = b"proxmox-started"
# Without one of these in its main section a VM cannot claim (vmconf's rules).
CLAIM_MARKERS = (b"hostpci", b"charly-")
USAGE = "usage: charly-arbiter hook proxmox VMID PHASE"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"charly-arbiter: {USAGE}", file=sys.stderr)
        return 2
    vmid, phase = argv
    if phase not in HANDLED:
        return 0  # post-start, pre-stop, and phases a later Proxmox may add
    # Proxmox goes on only on 0: a refused (3), unusable (2) or failed (1) pre-start
    # aborts the start; a stop is never held back.
    return guarded(
        lambda: _dispatch(vmid, phase),
        what=f"the {phase} hook for VM {vmid!r}",
        lets_go=lambda: phase in ALWAYS_SUCCEED,
    )


def _dispatch(vmid: str, phase: str) -> int:
    if not valid_vmid(vmid):
        if phase in ALWAYS_SUCCEED:
            return 0
        say(
            f"{vmid!r} is not a Proxmox VMID (an integer from 100 to 999999999)",
            "this hookscript is run by Proxmox as `SCRIPT VMID PHASE`",
        )
        return 2
    try:
        if phase == "post-start":
            _note_started(vmid)
            return 0
        if not _may_concern(vmid, phase):
            return 0  # the fast path: nothing to claim, nothing to release
    except Unsure:
        if phase == "post-start":
            return 0  # the watcher then asks whether the VM runs

    from charly_arbiter.serve.client import forward

    served = forward(["hook", "proxmox", vmid, phase])
    if served is not None:
        return served
    python_with_site()
    from charly_arbiter.proxmox import hookrun

    return hookrun.dispatch(vmid, phase)


def valid_vmid(text: str) -> bool:
    """qemu-server's pve-vmid: 100 to 999999999, no leading zero."""
    return text.isascii() and text.isdigit() and text[0] != "0" and 3 <= len(text) <= 9


def _may_concern(vmid: str, phase: str) -> bool:
    """False only when sure: the VM's main section names no PCI device and no
    override, and (at post-stop) the ledger does not name the VM."""
    simulated, settings = _settings()
    pve = setting(settings, b"config_dir") or DEFAULT_PVE
    # No file at pre-start (a container, or a wrong config_dir): the slow path says
    # which.  At post-stop, qm cleanup runs only while the file exists; the ledger decides.
    missing = None if phase == "pre-start" else b""
    if may_claim(_read(pve + b"/qemu-server/" + vmid.encode() + b".conf", missing)):
        return True
    return phase == "post-stop" and ledger_may_name(
        f"proxmox:{vmid}", state_dir(settings, simulated=simulated)
    )


def _note_started(vmid: str) -> None:
    """post-start of a VM that holds a lease: STATE/proxmox-started/VMID (pre-start
    removed it before claiming).  The VMID is checked, so it is a safe file name."""
    simulated, settings = _settings()
    state = state_dir(settings, simulated=simulated)
    if not ledger_may_name(f"proxmox:{vmid}", state):
        return
    directory = state + b"/" + STARTED_DIR
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(
            directory + b"/" + vmid.encode(),
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        os.close(fd)
    except OSError:
        raise Unsure from None


def _settings() -> tuple[bool, bytes]:
    """Whether the host is simulated, and arbiter.toml's bytes (hookio.scan_config)."""
    scan = scan_config(None)
    if scan is None:
        raise Unsure
    return scan


def may_claim(config: bytes) -> bool:
    """Whether the main section (before the first `[` line) mentions hostpci or the
    override's `charly-` (description lines and tags, any case)."""
    main = config
    if config.startswith(b"["):
        main = b""
    else:
        cut = config.find(b"\n[")
        if cut >= 0:
            main = config[:cut]
    lowered = main.lower()
    return any(marker in lowered for marker in CLAIM_MARKERS)


def _read(path: bytes, missing: bytes | None = None) -> bytes:
    """A file's bytes, bounded; `missing` when it does not exist (None: unsure)."""
    return read_bounded(path, MAX_CONFIG * 16, missing)
