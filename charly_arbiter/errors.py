"""The errors an operator can meet, each carrying what is needed to act on it.

Every error names the object (token, claimant, file) and, where one exists, the
command that fixes it (`hint`).  The CLI and the hook print `str(error)` and the
hint as one or two plain sentences; nothing else needs to know the wording.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# The exit-code contract of every command and hook (docs/operations.md has the
# table of each command's cases, from cli/exits.py).
EXIT_OK = 0
EXIT_ERROR = 1  # tried and failed (the host, the state dir, a step), or a check found a problem
EXIT_USAGE = 2  # the command as given cannot work: an option, a name, the configuration
EXIT_REFUSED = 3  # well-formed, but the rules refuse it in the present state; nothing changed


def cli_command(*args: str, operands: Sequence[str] = ()) -> str:
    """A `charly-arbiter` command line for a person to paste, in backticks: every
    word quoted for a POSIX shell, so that a name with a space, a quote or a `$`
    (a libvirt domain may have any of them) runs as the very command it reads as.

    `args` are the command's words and options, as the program writes them;
    `operands` are names that come from data (a claimant, a token, a unit) and
    go last, after `--` when one of them starts with `-` (so that a token named
    `-x` is not read as an option)."""
    import shlex

    words = ["charly-arbiter", *args]
    if any(operand.startswith("-") for operand in operands):
        words.append("--")
    return "`" + shlex.join([*words, *operands]) + "`"


class ArbiterError(Exception):
    """Base of every error the arbiter raises on purpose.

    `exit_code` is the CLI's and the hooks' exit status for it: 1 for errors, 2
    for what the command line (or the configuration it names) got wrong, 3 for
    refusals (`UsageError` and `Refused` below).
    """

    exit_code = EXIT_ERROR

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(ArbiterError):
    """The command as given cannot work, whatever the state: an option, a name that
    its kind cannot have or that names nothing, a command for another kind of host."""

    exit_code = EXIT_USAGE


class Refused(ArbiterError):
    """Well-formed, but refused by the rules in the present state; nothing was changed
    (it may work later, or with --force where the command has it)."""

    exit_code = EXIT_REFUSED


class ConfigError(UsageError):
    """The configuration file cannot be read or is not valid (exit 2, like a usage error)."""

    def __init__(self, path: Path | str, key: str | None, why: str) -> None:
        where = f"{path}: {key}" if key else str(path)
        super().__init__(f"{where}: {why}", hint=f"fix {path} and run the command again")
        self.path = Path(path)
        self.key = key
        self.why = why


class InvalidAddress(UsageError):
    """A PCI address that is not of the strict `DDDD:BB:DD.F` form."""

    def __init__(self, text: str) -> None:
        super().__init__(
            f"{text!r} is not a PCI address (expected lower-case DDDD:BB:DD.F, e.g. 0000:0a:00.0)"
        )
        self.text = text


class InvalidClaimant(UsageError):
    """A claimant name that is not `KIND:NAME`."""

    def __init__(self, text: str, why: str) -> None:
        super().__init__(f"{text!r} is not a claimant: {why}")
        self.text = text


class UnknownToken(UsageError):
    def __init__(self, token: str, known: list[str]) -> None:
        names = ", ".join(known) if known else "none"
        super().__init__(
            f"there is no token named {token!r} (known tokens: {names})",
            hint=f"run {cli_command('status')} to see the tokens",
        )
        self.token = token


class HostError(ArbiterError):
    """The host could not be opened or queried (not a refusal, not a switch failure)."""


class NeedsHost(UsageError):
    """A command for another kind of host than the one selected (`detect` on a
    simulated host, `sim show` on this machine): it says what it needs instead of
    reaching for a machine it was not pointed at."""

    def __init__(self, command: str, needs: str, hint: str) -> None:
        super().__init__(f"{command} needs {needs}", hint=hint)


class StateDirUnsafe(ArbiterError):
    """The state directory or a ledger file could be tampered with by someone else."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(
            f"refusing to use {path}: {why}",
            hint=f"make {path} a root-owned directory with mode 0700 (files 0600), not a symlink",
        )
        self.path = path


class LedgerCorrupt(ArbiterError):
    """The ledger does not verify; it is never read as "no leases", and never
    repaired without an operator (`charly-arbiter recover`)."""

    def __init__(self, path: Path, why: str, hint: str | None = None) -> None:
        super().__init__(
            f"the ledger {path} is corrupt: {why}; nothing was changed",
            hint=hint
            or f"run {cli_command('recover')} to compare its backup with the host, "
            f"then {cli_command('recover', '--yes')} to continue from it",
        )
        self.path = path
        self.why = why


class LedgerBusy(ArbiterError):
    """The ledger lock was not free within the configured wait."""

    def __init__(
        self, path: Path, waited: float, holder_pid: int | None, holder_user: str | None = None
    ) -> None:
        who = f" by process {holder_pid}" if holder_pid else ""
        if holder_pid and holder_user:
            who += f" of user {holder_user}"
        ask = f" (or ask {holder_user} about it)" if holder_user else ""
        super().__init__(
            f"the ledger lock {path} is held{who}; gave up after {waited:g} s",
            hint=f"wait for that command to finish{ask}; never delete the lock file",
        )
        self.path = path
        self.holder_pid = holder_pid
        self.holder_user = holder_user


class LeaseInProgress(Refused):
    """Another live process is acquiring or releasing this claimant's lease."""

    def __init__(self, claimant: str, state: str, pid: int) -> None:
        super().__init__(
            f"the lease of {claimant} is {state} by process {pid}, which is still running",
            hint="wait for that command to finish, then try again",
        )
        self.claimant = claimant
        self.pid = pid


class LedgerWriteFailed(ArbiterError):
    """Writing a new ledger generation failed; the previous one is still in place."""

    def __init__(self, path: Path, why: str, hint: str | None = None) -> None:
        super().__init__(
            f"could not write the ledger {path}: {why}; the previous state is kept", hint=hint
        )
        self.path = path


class ClaimRefused(Refused):
    """A claim that the rules do not allow right now.

    `retry` marks a refusal that another operation in progress will soon lift
    (a lease being released, a holder being started again): `acquire` waits a
    bounded time for it instead of refusing at once.
    """

    def __init__(
        self, token: str, claimant: str, why: str, hint: str | None = None, *, retry: bool = False
    ) -> None:
        super().__init__(f"{claimant} cannot claim {token}: {why}", hint=hint)
        self.token = token
        self.claimant = claimant
        self.why = why
        self.retry = retry


class ClaimantRunning(Refused):
    """Releasing or restoring the lease of a claimant that still runs would send
    its GPU home under it (on a real host the unbind blocks and the GPU is poisoned)."""

    def __init__(self, claimant: str, action: str) -> None:
        super().__init__(
            f"{claimant} still runs; {action} it now would take its GPU away from under it",
            hint=f"stop {claimant} first (its own hook then releases it), or add --force "
            "if you know it no longer uses the GPU",
        )
        self.claimant = claimant


class PassthroughImpossible(ClaimRefused):
    """The host cannot pass this GPU through: refused before anything is stopped."""

    def __init__(self, token: str, claimant: str, why: str, hint: str) -> None:
        super().__init__(token, claimant, f"this host cannot pass it through: {why}", hint=hint)


class ScreenInUse(ClaimRefused):
    """A GPU someone's screen runs on (a display manager, a graphical session, a
    compositor), with `screen = "refuse"`: refused before anything is stopped, naming
    what uses it (`holder`: the display manager, else the compositor) and the people
    whose sessions would end."""

    def __init__(
        self, token: str, claimant: str, why: str, hint: str, holder: str, users: tuple[str, ...]
    ) -> None:
        super().__init__(token, claimant, why, hint=hint)
        self.holder = holder
        self.users = users


class TokenPoisoned(ClaimRefused):
    def __init__(self, token: str, claimant: str, reason: str, since: str) -> None:
        super().__init__(
            token,
            claimant,
            f"{token} is poisoned since {since} ({reason})",
            hint=(
                "check the GPU and its driver by hand, then run "
                + cli_command("poison", "clear", operands=[token])
            ),
        )
        self.reason = reason


class SwitchFailed(ArbiterError):
    """A driver switch or its verification failed; the token gets poisoned."""

    def __init__(self, address: str, driver: str, step: str, why: str) -> None:
        super().__init__(f"{address}: switching to {driver} failed at {step}: {why}")
        self.address = address
        self.driver = driver
        self.step = step
        self.why = why


class SwitchHung(SwitchFailed):
    """A sysfs write did not return within the watchdog's timeout."""

    def __init__(self, address: str, driver: str, step: str, timeout: float) -> None:
        super().__init__(address, driver, step, f"the write did not return within {timeout:g} s")
        self.timeout = timeout


class VfCountInvalid(UsageError):
    """A VF count for a token that cannot have one, or more VFs than it can have."""

    def __init__(self, token: str, why: str) -> None:
        super().__init__(
            f"{token}: {why}", hint=f"run {cli_command('detect')} to see the SR-IOV functions"
        )
        self.token = token


class VfCountRefused(Refused):
    """A change of a physical function's VF count that the rules refuse now: a VF is
    leased or open, the PF is held exclusively or poisoned, another change runs."""

    def __init__(
        self, token: str, count: int, why: str, hint: str | None = None, *, retry: bool = False
    ) -> None:
        super().__init__(f"cannot set the VF count of {token} to {count}: {why}", hint=hint)
        self.token = token
        self.why = why
        self.retry = retry


class VfCountFailed(ArbiterError):
    """The kernel refused a write of `sriov_numvfs` (its errno), or it hung."""

    def __init__(self, address: str, count: int, why: str) -> None:
        super().__init__(f"{address}: writing {count} to sriov_numvfs failed: {why}")
        self.address = address
        self.count = count
        self.why = why


class VfCountHung(VfCountFailed):
    """A write of `sriov_numvfs` did not return within the watchdog's timeout: it is
    stuck in the kernel (a VF's VFIO device held open), where nothing can end it."""

    def __init__(self, address: str, count: int, timeout: float) -> None:
        super().__init__(address, count, f"the write did not return within {timeout:g} s")
        self.timeout = timeout


class MigInvalid(UsageError):
    """A MIG change or instance for a token that has no MIG, or a layout or instance
    it cannot have."""

    def __init__(self, token: str, why: str, hint: str | None = None) -> None:
        super().__init__(f"{token}: {why}", hint=hint)
        self.token = token


class MigFailed(ArbiterError):
    """NVML refused or failed a change of a GPU's MIG mode or layout."""

    def __init__(self, address: str, change: str, why: str, hint: str | None = None) -> None:
        super().__init__(f"{address}: MIG {change} failed: {why}", hint=hint)
        self.address = address


class HolderError(ArbiterError):
    """Stopping or starting a holder failed."""

    def __init__(self, holder: str, action: str, why: str) -> None:
        super().__init__(f"could not {action} {holder}: {why}")
        self.holder = holder
        self.action = action
        self.why = why


class DisplayManagerFailed(HolderError):
    """A display manager started again when its GPU came home did not come up (its unit
    active, a process holding a card, within `timeouts.screen_back`).  It was stopped
    and its failed state reset (no restart loop); `journal` are its last journal
    lines, and `console` the text login started in its place (`tty7`; None: none
    could be started)."""

    def __init__(
        self, holder: str, unit: str, why: str, journal: tuple[str, ...], console: str | None
    ) -> None:
        login = (
            f"a text login runs on {console} in its place"
            if console
            else "no text login could be started either"
        )
        super().__init__(holder, "start", f"{why}; it was stopped (no restart loop), {login}")
        self.unit = unit
        self.journal = journal
        self.console = console
        self.hint = (
            f"read `journalctl -u {unit}` (its last lines are in the history), fix it, then "
            f"run {cli_command('restore', '--stranded')}, which starts it again and checks it"
        )


class CommandFailed(ArbiterError):
    """An external command exited with a status that is not accepted."""

    def __init__(self, argv: list[str], returncode: int | None, stderr: str) -> None:
        status = "timed out" if returncode is None else f"exited with {returncode}"
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        tail = f": {detail}" if detail else ""
        super().__init__(f"{argv[0]} {status}{tail}")
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr


class Interrupt(KeyboardInterrupt):
    """A signal that ends an interactive command (SIGINT, SIGTERM, SIGHUP), raised in
    its main thread wherever it waits; `signal_name` says which."""

    def __init__(self, signal_name: str = "SIGINT") -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def signal_name(interrupt: KeyboardInterrupt) -> str:
    """The signal behind an interrupt (Python's own SIGINT handler raises a plain one)."""
    return interrupt.signal_name if isinstance(interrupt, Interrupt) else "SIGINT"


class Interrupted(ArbiterError):
    """A command ended by a signal: what it left, and the command that converges it."""


class StateDirError(ArbiterError):
    """The host refuses a step on the state directory (a read-only or full filesystem,
    a missing permission): what, where, and the fix (core/files.describe_os_error)."""

    def __init__(self, path: Path | str, action: str, why: str, fix: str) -> None:
        super().__init__(f"cannot {action} {path}: {why}", hint=fix)
        self.path = Path(path)


class TokensOverlap(ConfigError):
    """Two configured tokens share a PCI function or an IOMMU group: one GPU would have
    two owners, and a claim on one would switch the other's functions under its lease."""

    def __init__(self, path: Path | str, first: str, second: str, shared: str) -> None:
        super().__init__(
            path,
            f"tokens.{first}",
            f"tokens {first} and {second} overlap: both hold {shared}; a token is a GPU "
            "with every function of its IOMMU group, so one group is one token",
        )
        self.hint = (
            f"keep one of tokens.{first} and tokens.{second} in {path} "
            f"({cli_command('detect')} shows the IOMMU groups), then run the command again"
        )
        self.first = first
        self.second = second
        self.shared = shared


class LedgerContradicted(Refused):
    """The host (or the history) says something the ledger does not account for: a
    token on vfio-pci that no lease covers and no poison explains, or a ledger whose
    generation went backwards.  Nothing acts on it until an operator has decided."""

    def __init__(self, subject: str, found: str, hint: str) -> None:
        said = f"{subject}: {found}" if subject else found
        super().__init__(f"{said}; nothing was changed", hint=hint)
        self.subject = subject
        self.found = found


class TokenUnaccounted(ClaimRefused):
    """A claim on a token that is on vfio-pci with no exclusive lease and no poison:
    something the ledger does not know uses it (or its lease was lost)."""

    def __init__(self, token: str, claimant: str, addresses: str, hint: str) -> None:
        super().__init__(
            token,
            claimant,
            f"{addresses} on vfio-pci, and no lease or poison in the ledger accounts for it "
            "(the ledger may have been deleted or replaced)",
            hint=hint,
        )


class SettleRefused(Refused):
    """`adopt` or `send-home` asked of a token they do not apply to (it is not on
    vfio-pci without a lease), or that would take a GPU from a claimant that runs."""

    def __init__(self, token: str, why: str, hint: str | None = None) -> None:
        super().__init__(f"{token}: {why}; nothing was changed", hint=hint)
        self.token = token
        self.why = why
