"""Every command's exit statuses, decided once: the table behind docs/operations.md,
each man page's EXIT STATUS, and tests/cli/test_exits.py, which runs a case for
every row and fails for a command (or subcommand) that has no rows here.

The contract (errors.EXIT_*): 0 success; 1 error, the command was tried and
failed (the host, the state directory, a step), or a check it makes found a
problem; 2 usage, the command as given cannot work whatever the state (an
option, a name its kind cannot have or that names nothing, a configuration
that is not valid, a command for another kind of host); 3 refused, well-formed
but refused by the rules in the present state, with nothing changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from charly_arbiter.errors import EXIT_ERROR, EXIT_OK, EXIT_REFUSED, EXIT_USAGE

MEANING = {
    EXIT_OK: "success",
    EXIT_ERROR: "error",
    EXIT_USAGE: "usage",
    EXIT_REFUSED: "refused",
}


@dataclass(frozen=True)
class Exit:
    code: int
    when: str


# What every command of the CLI shares (not the hooks, which have no options).
EVERY_COMMAND = (
    Exit(
        EXIT_USAGE,
        "an unknown option, a missing or extra argument; a configuration file that is not valid",
    ),
)

_NAMES = "a claimant its kind cannot have (KIND:NAME, checked by the rules of what it names)"
_TOKENS = "a token that is not configured (the known ones are listed)"
_STATE = (
    "the state directory is unsafe (a symlink, writable by others) or the host refuses it "
    "(read-only, full, a missing permission), or another process holds the ledger lock "
    "past timeouts.lock_wait"
)
_INTERRUPTED = (
    "interrupted by SIGINT, SIGTERM or SIGHUP: what was left and the `restore` that "
    "converges it are printed; a switch cut short poisons its GPU"
)
_NO_SUBCOMMAND = "no subcommand, or one that does not exist"
_CONTRADICTED = (
    "the ledger went backwards against the history (`recover` first), or the GPU is on "
    "vfio-pci with nothing in the ledger to account for it (`adopt` or `send-home` first)"
)
_NOT_SIM = "the host is not simulated"

TABLE: dict[str, tuple[Exit, ...]] = {
    "charly-arbiter": (
        Exit(EXIT_OK, "--help or --version"),
        Exit(EXIT_USAGE, "no command, or one that does not exist"),
    ),
    "status": (
        Exit(EXIT_OK, "the state was shown, stranded leases and poisoned GPUs included"),
        Exit(EXIT_ERROR, f"the ledger is corrupt (the state is shown all the same); {_STATE}"),
        Exit(EXIT_USAGE, "--follow without --json"),
    ),
    "acquire": (
        Exit(EXIT_OK, "the claimant holds the tokens now (or held them already)"),
        Exit(
            EXIT_ERROR,
            "a step failed (a switch, which poisons the GPU; a holder that did not stop) and "
            f"the claim was undone; {_INTERRUPTED}; {_STATE}",
        ),
        Exit(
            EXIT_USAGE,
            f"no mode, or --exclusive with --shared; {_NAMES}; {_TOKENS}; a MIG instance "
            "(TOKEN:N) the GPU does not have now, or claimed exclusively",
        ),
        Exit(
            EXIT_REFUSED,
            "refused: another lease holds the GPU, a holder that is not preemptible, a "
            "poisoned GPU, a lease of this claimant still in progress or from an earlier boot; "
            + _CONTRADICTED,
        ),
    ),
    "release": (
        Exit(EXIT_OK, "released, or the claimant held no lease"),
        Exit(
            EXIT_ERROR,
            f"not everything came back (the lease stays for `restore`); {_INTERRUPTED}; {_STATE}",
        ),
        Exit(EXIT_USAGE, _NAMES),
        Exit(
            EXIT_REFUSED,
            "the claimant still runs (without --force), or another live process is "
            "acquiring or releasing its lease; the ledger went backwards against the history",
        ),
    ),
    "restore": (
        Exit(EXIT_OK, "restored, or nothing to restore (--dry-run: what would be)"),
        Exit(EXIT_ERROR, f"a restore step failed (the lease stays); {_INTERRUPTED}; {_STATE}"),
        Exit(EXIT_USAGE, f"--stranded together with claimant names; {_NAMES}"),
        Exit(
            EXIT_REFUSED,
            "a named claimant still runs (without --force), or another live process is "
            "carrying out its lease; the ledger went backwards against the history",
        ),
    ),
    "poison": (Exit(EXIT_USAGE, _NO_SUBCOMMAND),),
    "poison list": (
        Exit(EXIT_OK, "listed (an empty list too)"),
        Exit(EXIT_ERROR, f"the ledger is corrupt; {_STATE}"),
    ),
    "poison clear": (
        Exit(EXIT_OK, "cleared, or the token was not poisoned"),
        Exit(EXIT_ERROR, f"the ledger is corrupt; {_STATE}"),
        Exit(EXIT_USAGE, "a token that is neither configured nor poisoned"),
        Exit(EXIT_REFUSED, _CONTRADICTED),
    ),
    "sim": (Exit(EXIT_USAGE, _NO_SUBCOMMAND),),
    "sim init": (
        Exit(EXIT_OK, "DIR/host.toml and DIR/arbiter.toml were written"),
        Exit(EXIT_ERROR, "DIR cannot be written"),
        Exit(EXIT_REFUSED, "DIR/host.toml exists (nothing is overwritten)"),
    ),
    "sim show": (
        Exit(EXIT_OK, "the simulated host's state was printed"),
        Exit(EXIT_USAGE, _NOT_SIM),
    ),
    "sim stop": (
        Exit(EXIT_OK, "the holder or claimant is marked as not running"),
        Exit(EXIT_USAGE, f"{_NOT_SIM}; {_NAMES}"),
    ),
    "sim start": (
        Exit(EXIT_OK, "the holder or claimant is marked as running"),
        Exit(EXIT_USAGE, f"{_NOT_SIM}; {_NAMES}"),
    ),
    "sim reboot": (
        Exit(EXIT_OK, "a new boot of the simulated host"),
        Exit(EXIT_USAGE, _NOT_SIM),
    ),
    "detect": (
        Exit(EXIT_OK, "this machine's PCI functions and VFIO readiness were shown"),
        Exit(EXIT_USAGE, "the host is simulated (detect reads this machine's sysfs only)"),
    ),
    "doctor": (
        Exit(EXIT_OK, "no check found a problem (warnings allowed)"),
        Exit(EXIT_ERROR, f"a check found a problem (each says its fix), such as: {_STATE}"),
    ),
    "plan": (
        Exit(EXIT_OK, "the claim would be granted, or the domain claims no GPU"),
        Exit(EXIT_ERROR, f"the host or libvirt cannot be asked; {_STATE}"),
        Exit(
            EXIT_USAGE,
            f"a mode without tokens, tokens without a mode, or both modes; {_NAMES}; "
            f"{_TOKENS}; a domain libvirt does not know, or no libvirt to ask "
            "(a simulated host without real libvirt holders)",
        ),
        Exit(EXIT_REFUSED, "the claim would be refused (the reason is printed)"),
    ),
    "explain": (
        Exit(EXIT_OK, "explained (a claimant without a lease too)"),
        Exit(EXIT_ERROR, _STATE),
        Exit(EXIT_USAGE, f"{_TOKENS}; {_NAMES}"),
    ),
    "history": (
        Exit(EXIT_OK, "the events were shown (none too)"),
        Exit(
            EXIT_ERROR,
            "a --token that is not in the history, and the host cannot be asked which tokens "
            "it has (unreadable history files are skipped with a note, never an error)",
        ),
        Exit(
            EXIT_USAGE,
            "a --token neither configured nor in the history; a malformed --claimant or --since",
        ),
    ),
    "metrics": (
        Exit(EXIT_OK, "written to stdout or --output"),
        Exit(EXIT_ERROR, f"--output cannot be written, or prometheus-client is missing; {_STATE}"),
    ),
    "recover": (
        Exit(EXIT_OK, "the ledger verifies, or the comparison was shown, or (--yes) recovered"),
        Exit(EXIT_ERROR, _STATE),
        Exit(
            EXIT_REFUSED,
            "--yes, but the backup cannot be used (and no --empty): nothing is written",
        ),
    ),
    "adopt": (
        Exit(
            EXIT_OK, "KIND:NAME now holds the token exclusively, or (--admin) vfio-pci is its home"
        ),
        Exit(EXIT_ERROR, _STATE),
        Exit(EXIT_USAGE, f"neither or both of KIND:NAME and --admin; {_NAMES}; {_TOKENS}"),
        Exit(
            EXIT_REFUSED,
            "the token is not on vfio-pci without a lease (the ledger accounts for it), or "
            "the ledger went backwards against the history (`recover` first)",
        ),
    ),
    "mig": (
        Exit(EXIT_OK, "the MIG state was shown, or changed and everything it stopped is back"),
        Exit(
            EXIT_ERROR,
            "NVML refused or failed the change (what it stopped is back all the same), or "
            f"a holder did not come back (the lease stays for `restore`); {_STATE}",
        ),
        Exit(
            EXIT_USAGE,
            f"layout without PROFILE,..., or PROFILE,... without layout; {_TOKENS}; a GPU "
            "without MIG, a layout while MIG is off, a profile it does not have",
        ),
        Exit(
            EXIT_REFUSED,
            "another lease holds the GPU exclusively, a holder that is not preemptible uses "
            "it, it is poisoned or off its driver, or a change of it runs already",
        ),
    ),
    "vfs": (
        Exit(EXIT_OK, "the count is set (or was already); with --configured, every configured one"),
        Exit(
            EXIT_ERROR,
            "the kernel refused a write of sriov_numvfs, or one hung (the physical function is "
            f"poisoned, with what to do); with --configured, one of them failed; {_STATE}",
        ),
        Exit(
            EXIT_USAGE,
            f"neither TOKEN COUNT nor --configured; {_TOKENS}; a token that is no SR-IOV "
            "physical function, or more VFs than it can have",
        ),
        Exit(
            EXIT_REFUSED,
            "a virtual function is leased or open, the physical function is held exclusively, "
            "poisoned or off its driver, another change of its count runs, or the ledger "
            "went backwards",
        ),
    ),
    "send-home": (
        Exit(
            EXIT_OK, "the token went home, and what the history says was stopped for it came back"
        ),
        Exit(
            EXIT_ERROR,
            f"it did not go all the way home (the lease stays for `restore`); {_STATE}",
        ),
        Exit(EXIT_USAGE, _TOKENS),
        Exit(
            EXIT_REFUSED,
            "the token is not on vfio-pci without a lease, the claimant the history says "
            "holds it still runs (without --force), or the ledger went backwards",
        ),
    ),
    "attach": (
        Exit(EXIT_OK, "the unit's drop-in and holder record were written"),
        Exit(EXIT_ERROR, "the drop-in or the holder record cannot be written"),
        Exit(EXIT_USAGE, f"not a service unit; --exclusive with --shared; {_TOKENS}"),
        Exit(EXIT_REFUSED, "the unit is listed in arbiter.toml already"),
    ),
    "detach": (
        Exit(EXIT_OK, "detached, or the unit was not attached"),
        Exit(EXIT_ERROR, _STATE),
        Exit(EXIT_USAGE, "not a service unit"),
        Exit(EXIT_REFUSED, "the unit holds a lease now (without --force)"),
    ),
    "hook qemu": (
        Exit(
            EXIT_OK,
            "the VM may go on: no claim, a granted claim; release and reconnect always; "
            "every operation the arbiter does not handle",
        ),
        Exit(
            EXIT_ERROR,
            "prepare or migrate failed (a domain XML that cannot be read, a step): the VM "
            "does not start (fail closed)",
        ),
        Exit(
            EXIT_USAGE,
            "fewer than four arguments; at prepare, a domain that may claim a GPU under a "
            "name no claimant can have (a control character): the VM does not start",
        ),
        Exit(
            EXIT_REFUSED,
            "prepare refused (the reason on stderr, which libvirt shows); migrate of a "
            "domain with an exclusive claim",
        ),
    ),
    "hook oci": (
        Exit(EXIT_OK, "the container may go on: no GPU, a granted claim; a release always"),
        Exit(
            EXIT_ERROR,
            "a claim failed, or the state on stdin cannot be read: the container does not "
            "start (fail closed)",
        ),
        Exit(EXIT_USAGE, "an argument that is not a stage or --engine=NAME"),
        Exit(EXIT_REFUSED, "the claim was refused (the reason on stderr, which the runtime shows)"),
    ),
    "hook proxmox": (
        Exit(
            EXIT_OK,
            "the VM may go on: no claim, a granted claim; post-start and post-stop always; "
            "every phase the arbiter does not handle",
        ),
        Exit(
            EXIT_ERROR,
            "pre-start failed (a VM configuration it cannot read, a step): the VM does not "
            "start (fail closed)",
        ),
        Exit(
            EXIT_USAGE,
            "not two arguments; at pre-start, a VMID that is not one, or an arbiter.toml "
            "that is not valid: the VM does not start",
        ),
        Exit(EXIT_REFUSED, "pre-start refused (the reason on stderr, in the start's task log)"),
    ),
    "hook oci-inject": (
        Exit(EXIT_OK, "the hook is in the bundle's config.json (added now or before)"),
        Exit(EXIT_ERROR, "the bundle's config.json cannot be read or written"),
        Exit(EXIT_USAGE, "no bundle, or an argument that is not --hook=/PATH or --engine=NAME"),
    ),
    # The verbs a hook starts as a process of its own (hooksession.DETACHED): not in
    # --help, since no person runs them, but held to the same contract; their stderr
    # is /dev/null when a hook starts them, so the log says what went wrong too.
    "_finish-release": (
        Exit(
            EXIT_OK,
            "the release a hook began went to its end, or there was nothing left of it (what "
            "did not come back stays in the ledger for `restore`, and the log says so)",
        ),
        Exit(EXIT_ERROR, f"the ledger is corrupt; {_STATE}"),
        Exit(
            EXIT_USAGE,
            "not one argument, or a hand-off that is not the JSON a hook writes (a field "
            "missing or unknown, a relative path, a claimant its kind cannot have)",
        ),
        Exit(
            EXIT_REFUSED,
            "another live process carries the lease out, not the hook the hand-off names",
        ),
    ),
    "_watch-start": (
        Exit(
            EXIT_OK,
            "the VM's start was watched to its end: its lease released when the start never "
            "reached post-start, else left alone (a VM lock that cannot be opened is logged)",
        ),
        Exit(EXIT_ERROR, f"the ledger is corrupt; {_STATE}"),
        Exit(
            EXIT_USAGE,
            "not one argument, or a hand-off that is not the JSON a hook writes",
        ),
    ),
    "serve": (
        Exit(
            EXIT_OK,
            "stopped by SIGTERM, SIGINT or SIGHUP, or --idle-exit passed without a request "
            "(the commands it started finish on their own)",
        ),
        Exit(
            EXIT_ERROR,
            "it cannot listen: another server listens on the socket, something that is not a "
            "socket is there, its directory cannot be made or others may write to it; "
            "systemd passed more than one socket",
        ),
        Exit(EXIT_USAGE, "an unknown option, or an option without its value"),
    ),
}

HOOKS = ("hook qemu", "hook oci", "hook oci-inject", "hook proxmox")
# Started by the hooks, never by a person: hooksession.DETACHED (the same names).
DETACHED = ("_finish-release", "_watch-start")
# Commands dispatched before click, with their own arguments: the resident helper
# (hidden from --help; it reads no configuration, so EVERY_COMMAND's rows are not its).
UNLISTED = ("serve",)
# What has no options of click's (EVERY_COMMAND's usage row is not theirs).
OWN_ARGV = HOOKS + DETACHED + UNLISTED


def rows(command: str) -> tuple[Exit, ...]:
    """The exits of `command` (its words after `charly-arbiter`), with those every
    command of the CLI shares: one row per code, in order."""
    shared = () if command in OWN_ARGV else EVERY_COMMAND
    merged: dict[int, list[str]] = {}
    for row in (*TABLE[command], *shared):
        merged.setdefault(row.code, []).append(row.when)
    return tuple(Exit(code, "; ".join(merged[code])) for code in sorted(merged))


def markdown() -> str:
    """The table of docs/operations.md."""
    lines = [
        "| command | exit | when |",
        "|---|---|---|",
    ]
    for command in TABLE:
        for row in TABLE[command]:
            name = command if command == "charly-arbiter" else f"charly-arbiter {command}"
            lines.append(f"| `{name}` | {row.code} ({MEANING[row.code]}) | {row.when} |")
    lines.append(
        "| every command | "
        + " / ".join(f"{row.code} ({MEANING[row.code]})" for row in EVERY_COMMAND)
        + " | "
        + "; ".join(f"{row.code}: {row.when}" for row in EVERY_COMMAND)
        + " |"
    )
    return "\n".join(lines) + "\n"


DOC_BEGIN = (
    "<!-- exit-table: from charly_arbiter/cli/exits.py; "
    "packaging/gen-manpages.py --exit-table rewrites it -->"
)
DOC_END = "<!-- /exit-table -->"


def in_document(text: str) -> str:
    """`text` (docs/operations.md) with the table between DOC_BEGIN and DOC_END made anew."""
    head, begin, rest = text.partition(DOC_BEGIN)
    _, end, tail = rest.partition(DOC_END)
    if not begin or not end:
        raise ValueError(f"the markers {DOC_BEGIN!r} and {DOC_END!r} are missing")
    return head + DOC_BEGIN + "\n" + markdown() + DOC_END + tail
