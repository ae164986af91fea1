"""The errors an operator can meet, each carrying what is needed to act on it.

Every error names the object (token, claimant, file) and, where one exists, the
command that fixes it (`hint`).  The CLI and the hook print `str(error)` and the
hint as one or two plain sentences; nothing else needs to know the wording.
"""

from __future__ import annotations

from pathlib import Path


def cli_command(*args: str) -> str:
    """A `charly-arbiter` command line for a person to paste, in backticks: every
    word quoted for a POSIX shell, so that a name with a space, a quote or a `$`
    (a libvirt domain may have any of them) runs as the very command it reads as."""
    import shlex

    return "`" + shlex.join(("charly-arbiter", *args)) + "`"


class ArbiterError(Exception):
    """Base of every error the arbiter raises on purpose.

    `exit_code` is the CLI's exit status for it: 1 for errors, 3 for refusals.
    """

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(ArbiterError):
    """The configuration file cannot be read or is not valid (exit 2, like a usage error)."""

    exit_code = 2

    def __init__(self, path: Path | str, key: str | None, why: str) -> None:
        where = f"{path}: {key}" if key else str(path)
        super().__init__(f"{where}: {why}", hint=f"fix {path} and run the command again")
        self.path = Path(path)
        self.key = key
        self.why = why


class InvalidAddress(ArbiterError):
    """A PCI address that is not of the strict `DDDD:BB:DD.F` form."""

    def __init__(self, text: str) -> None:
        super().__init__(
            f"{text!r} is not a PCI address (expected lower-case DDDD:BB:DD.F, e.g. 0000:0a:00.0)"
        )
        self.text = text


class InvalidClaimant(ArbiterError):
    """A claimant name that is not `KIND:NAME`."""

    def __init__(self, text: str, why: str) -> None:
        super().__init__(f"{text!r} is not a claimant: {why}")
        self.text = text


class UnknownToken(ArbiterError):
    def __init__(self, token: str, known: list[str]) -> None:
        names = ", ".join(known) if known else "none"
        super().__init__(
            f"there is no token named {token!r} (known tokens: {names})",
            hint="run `charly-arbiter status` to see the tokens",
        )
        self.token = token


class HostError(ArbiterError):
    """The host could not be opened or queried (not a refusal, not a switch failure)."""


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
            or "run `charly-arbiter recover` to compare its backup with the host, "
            "then `charly-arbiter recover --yes` to continue from it",
        )
        self.path = path
        self.why = why


class LedgerBusy(ArbiterError):
    """The ledger lock was not free within the configured wait."""

    def __init__(self, path: Path, waited: float, holder_pid: int | None) -> None:
        who = f" by process {holder_pid}" if holder_pid else ""
        super().__init__(
            f"the ledger lock {path} is held{who}; gave up after {waited:g} s",
            hint="wait for that command to finish; never delete the lock file",
        )
        self.path = path
        self.holder_pid = holder_pid


class LeaseInProgress(ArbiterError):
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

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"could not write the ledger {path}: {why}; the previous state is kept")
        self.path = path


class ClaimRefused(ArbiterError):
    """A claim that the rules do not allow right now.

    `retry` marks a refusal that another operation in progress will soon lift
    (a lease being released, a holder being started again): `acquire` waits a
    bounded time for it instead of refusing at once.
    """

    exit_code = 3

    def __init__(
        self, token: str, claimant: str, why: str, hint: str | None = None, *, retry: bool = False
    ) -> None:
        super().__init__(f"{claimant} cannot claim {token}: {why}", hint=hint)
        self.token = token
        self.claimant = claimant
        self.why = why
        self.retry = retry


class ClaimantRunning(ArbiterError):
    """Releasing or restoring the lease of a claimant that still runs would send
    its GPU home under it (on a real host the unbind blocks and the GPU is poisoned)."""

    exit_code = 3

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


class TokenPoisoned(ClaimRefused):
    def __init__(self, token: str, claimant: str, reason: str, since: str) -> None:
        super().__init__(
            token,
            claimant,
            f"{token} is poisoned since {since} ({reason})",
            hint=(
                f"check the GPU and its driver by hand, then run "
                f"`charly-arbiter poison clear {token}`"
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


class HolderError(ArbiterError):
    """Stopping or starting a holder failed."""

    def __init__(self, holder: str, action: str, why: str) -> None:
        super().__init__(f"could not {action} {holder}: {why}")
        self.holder = holder
        self.action = action
        self.why = why


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
            f"keep one of tokens.{first} and tokens.{second} in {path} (`charly-arbiter "
            "detect` shows the IOMMU groups), then run the command again"
        )
        self.first = first
        self.second = second
        self.shared = shared


class LedgerContradicted(ArbiterError):
    """The host (or the history) says something the ledger does not account for: a
    token on vfio-pci that no lease covers and no poison explains, or a ledger whose
    generation went backwards.  Nothing acts on it until an operator has decided."""

    exit_code = 3

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


class SettleRefused(ArbiterError):
    """`adopt` or `send-home` asked of a token they do not apply to (it is not on
    vfio-pci without a lease), or that would take a GPU from a claimant that runs."""

    exit_code = 3

    def __init__(self, token: str, why: str, hint: str | None = None) -> None:
        super().__init__(f"{token}: {why}; nothing was changed", hint=hint)
        self.token = token
        self.why = why
